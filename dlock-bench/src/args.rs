//! The command line of `dlock-bench`.

use std::time::Duration;

use crate::error::{BenchError, Result};

/// The benchmarks this binary knows, in the order they run.
pub(crate) const BENCHES: &[&str] = &[
    "uncontended",
    "memory",
    "handoff",
    "primitives",
    "http",
    "idempotency",
    "backends",
    "metrics",
    "postgres",
    "postgres-tx",
];

pub(crate) const USAGE: &str = "\
usage: dlock-bench [--json] [--redis-url URL] [--duration-ms N] [--rounds N] [--settle-us N]
                   [--bench NAME[,NAME]] [--quick] [--no-pin]

  --json           one JSON object per line instead of tables
  --redis-url URL  measure against this server instead of starting a redis-server
                   on a free loopback port (its INFO commandstats must be ours alone)
  --duration-ms N  length of one measurement window (default 500; each is preceded
                   by a warm-up of a fifth of it, at most 100 ms)
  --rounds N       rounds of every measurement, the median is reported
                   (default: 5 uncontended, 3 handoff)
  --settle-us N    strict handoff: the holder keeps the lock N us (plus a random
                   0-2 ms) after the last waiter entered acquire, so that it is
                   parked (default 1000)
  --bench NAMES    run only these benchmarks: uncontended, memory, handoff, http,
                   idempotency, backends, primitives, metrics (feature `metrics`: with and
                   without a recorder), postgres (feature `postgres`;
                   its locks and routes), postgres-tx (its routes alone)
  --quick          tiny sizes, for a CI smoke test
  --no-pin         leave the threads to the scheduler; by default the servers the
                   benchmark starts run on the last CPU and the benchmark on the others";

/// Parsed options.
#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) json: bool,
    pub(crate) redis_url: Option<String>,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    pub(crate) uncontended_rounds: usize,
    pub(crate) handoff_rounds: usize,
    pub(crate) settle: Duration,
    /// Locks of the `memory` burst (100,000; 2,000 with `--quick`).
    pub(crate) one_off_locks: usize,
    pub(crate) benches: Vec<&'static str>,
    /// Do not pin the benchmark and its servers to CPUs (see `pin.rs`).
    pub(crate) no_pin: bool,
}

impl Args {
    /// Parses the arguments after the program name. `Ok(None)` means help
    /// was asked for.
    pub(crate) fn parse(argv: impl IntoIterator<Item = String>) -> Result<Option<Args>> {
        let mut json = false;
        let mut quick = false;
        let mut no_pin = false;
        let mut redis_url = None;
        let mut duration_ms = None;
        let mut rounds = None;
        let mut settle_us = 1000;
        let mut benches: Option<Vec<&'static str>> = None;
        let mut it = argv.into_iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
                _ => (arg.clone(), None),
            };
            let mut value = |name: &str| -> Result<String> {
                inline.clone().or_else(|| it.next()).ok_or_else(|| BenchError::Usage(format!("{name} needs a value")))
            };
            match flag.as_str() {
                "--json" => json = true,
                "--quick" => quick = true,
                "--no-pin" => no_pin = true,
                "-h" | "--help" => return Ok(None),
                "--redis-url" => redis_url = Some(value("--redis-url")?),
                "--duration-ms" => duration_ms = Some(number(&value("--duration-ms")?, "--duration-ms")?),
                "--rounds" => rounds = Some(number(&value("--rounds")?, "--rounds")?.max(1) as usize),
                "--settle-us" => settle_us = number(&value("--settle-us")?, "--settle-us")?,
                "--bench" => {
                    let mut picked = Vec::new();
                    for name in value("--bench")?.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                        match BENCHES.iter().find(|b| **b == name) {
                            Some(b) => picked.push(*b),
                            None => {
                                return Err(BenchError::Usage(format!(
                                    "unknown benchmark `{name}` (known: {})",
                                    BENCHES.join(", ")
                                )))
                            }
                        }
                    }
                    benches = Some(picked);
                }
                other => return Err(BenchError::Usage(format!("unknown argument `{other}`"))),
            }
        }
        let duration = Duration::from_millis(duration_ms.unwrap_or(if quick { 40 } else { 500 }).max(1));
        let warmup = if quick { Duration::from_millis(10) } else { (duration / 5).min(Duration::from_millis(100)) };
        let (uncontended_rounds, handoff_rounds) = match (rounds, quick) {
            (Some(n), _) => (n, n),
            (None, true) => (1, 1),
            (None, false) => (5, 3),
        };
        Ok(Some(Args {
            json,
            redis_url,
            warmup,
            duration,
            uncontended_rounds,
            handoff_rounds,
            settle: Duration::from_micros(settle_us),
            one_off_locks: if quick { 2_000 } else { 100_000 },
            benches: benches.unwrap_or_else(|| BENCHES.to_vec()),
            no_pin,
        }))
    }

    pub(crate) fn runs(&self, bench: &str) -> bool {
        self.benches.contains(&bench)
    }
}

fn number(s: &str, flag: &str) -> Result<u64> {
    s.parse().map_err(|_| BenchError::Usage(format!("{flag} wants a whole number, not `{s}`")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Args>> {
        Args::parse(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults_and_flags() {
        let a = parse(&[]).ok().flatten().expect("defaults parse");
        assert!(!a.json);
        assert_eq!(a.duration, Duration::from_millis(500));
        assert_eq!((a.uncontended_rounds, a.handoff_rounds), (5, 3));
        assert_eq!(a.benches, BENCHES.to_vec());

        let a = parse(&["--json", "--redis-url", "redis://127.0.0.1:1", "--duration-ms=50", "--bench", "handoff"])
            .ok()
            .flatten()
            .expect("flags parse");
        assert!(a.json);
        assert_eq!(a.redis_url.as_deref(), Some("redis://127.0.0.1:1"));
        assert_eq!(a.duration, Duration::from_millis(50));
        assert_eq!(a.benches, vec!["handoff"]);
        assert!(!a.runs("uncontended"));
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(parse(&["--duration-ms", "soon"]), Err(BenchError::Usage(_))));
        assert!(matches!(parse(&["--bench", "nope"]), Err(BenchError::Usage(_))));
        assert!(matches!(parse(&["--frobnicate"]), Err(BenchError::Usage(_))));
        assert!(matches!(parse(&["--redis-url"]), Err(BenchError::Usage(_))));
        assert!(matches!(parse(&["--help"]), Ok(None)));
    }
}
