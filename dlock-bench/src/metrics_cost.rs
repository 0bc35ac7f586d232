//! What dlock's metrics cost (feature `metrics`): one task cycling
//! acquire + release on a key of its own, with no recorder and with the
//! Prometheus exporter's recorder installed, in alternating rounds on one
//! thread (`metrics::with_local_recorder`), on the in-process backend and
//! on Redis.
//!
//! * `no-recorder/<backend>`: the feature compiled in, nothing installed
//!   (the facade's one atomic load per handle made).
//! * `prometheus/<backend>`: `metrics-exporter-prometheus`'s recorder, the
//!   one most apps install; its `ratio` is recorder / no recorder, the
//!   median of the per-round ratios.
//!
//! Targets: with a recorder, an in-process cycle at least
//! [`MEMORY_TARGET`] of its speed without (at most 10 % slower); a Redis
//! cycle at least [`REDIS_TARGET`] (within the run-to-run spread of a
//! round trip). The feature off is the other benchmarks' rows, built
//! without it.

use std::time::{Duration, Instant};

use dlock_core::backend::redis::RedisBackend;
use dlock_core::{AcquireOptions, Locker, MemoryBackend};
use metrics_exporter_prometheus::PrometheusBuilder;

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::measure::{median, Sample};
use crate::report::Row;
use crate::series::{target, Series};

/// With a recorder, an in-process cycle keeps at least this share of its speed.
pub(crate) const MEMORY_TARGET: f64 = 0.90;

/// With a recorder, a Redis cycle keeps at least this share (its spread).
pub(crate) const REDIS_TARGET: f64 = 0.95;

pub(crate) const TITLE: &str =
    "metrics cost (one task, acquire+release on its own key, fixed lease; ratio = with the Prometheus recorder / without)";

/// How the locker of a window is made (a fresh one per window: a locker
/// registers its handles with the recorder of its first lock).
#[derive(Clone, Copy)]
enum Backend {
    Memory,
    Redis,
}

/// Runs on a thread of its own: each window starts its own runtime there.
pub(crate) fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let (url, prefix, args) = (env.url.clone(), env.prefix.clone(), args.clone());
    std::thread::spawn(move || rounds(&url, &prefix, &args))
        .join()
        .map_err(|_| BenchError::Invariant("metrics: the benchmark's thread panicked".into()))?
}

fn rounds(url: &str, prefix: &str, args: &Args) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (backend, name, goal) in [(Backend::Memory, "memory", MEMORY_TARGET), (Backend::Redis, "redis", REDIS_TARGET)] {
        let mut none = Series::new("metrics", "no-recorder", name, 1);
        let mut with = Series::new("metrics", "prometheus", name, 1);
        let mut ratios = Vec::new();
        for round in 0..args.uncontended_rounds {
            // Alternate which goes first, so a slow phase hits both alike.
            let order = if round % 2 == 0 { [false, true] } else { [true, false] };
            let mut pair = [0.0; 2];
            for recorded in order {
                let sample = window(url, prefix, args, backend, recorded)?;
                pair[usize::from(recorded)] = sample.ops_per_sec;
                if recorded {
                    with.samples.push(sample)
                } else {
                    none.samples.push(sample)
                }
            }
            if pair[0] > 0.0 {
                ratios.push(pair[1] / pair[0]);
            }
            eprintln!(
                "metrics round {}/{}: {name} cycles/s none {:.0}, prometheus {:.0}",
                round + 1,
                args.uncontended_rounds,
                pair[0],
                pair[1]
            );
        }
        let ratio = median(ratios).ok_or_else(|| BenchError::Invariant("metrics: no round measured".into()))?;
        let mut row = with.row();
        row.ratio = Some(ratio);
        row.targets.push(target("prometheus/none", ratio, false, goal, ""));
        rows.push(none.row());
        rows.push(row);
    }
    Ok(rows)
}

/// One window on a runtime of this thread, with or without the recorder.
fn window(url: &str, prefix: &str, args: &Args, backend: Backend, recorded: bool) -> Result<Sample> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Invariant(format!("cannot start a runtime: {e}")))?;
    let (url, prefix) = (url.to_owned(), prefix.to_owned());
    let (warmup, duration) = (args.warmup, args.duration);
    let cycles = async move {
        let locker = match backend {
            Backend::Memory => Locker::new(MemoryBackend::new()),
            Backend::Redis => Locker::new(RedisBackend::connect(&url, &prefix).await?),
        };
        let key = locker.key("metrics-cost").part(u64::from(recorded)).build()?;
        let opts = || AcquireOptions::new().with_lease(Duration::from_secs(10));
        let mut latencies = Vec::new();
        let end_warmup = Instant::now() + warmup;
        while Instant::now() < end_warmup {
            locker.acquire(&key, opts()).await?.release().await?;
        }
        let started = Instant::now();
        while started.elapsed() < duration {
            let t = Instant::now();
            locker.acquire(&key, opts()).await?.release().await?;
            latencies.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let elapsed = started.elapsed().as_secs_f64();
        Ok::<_, BenchError>((latencies, elapsed))
    };
    let (mut latencies, elapsed) = if recorded {
        let recorder = PrometheusBuilder::new().build_recorder();
        metrics::with_local_recorder(&recorder, || runtime.block_on(cycles))?
    } else {
        runtime.block_on(cycles)?
    };
    latencies.sort_by(f64::total_cmp);
    let pick = |q: f64| latencies.get(((latencies.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(0.0);
    let ops = latencies.len() as u64;
    if ops == 0 {
        return Err(BenchError::Invariant("metrics: a window did no cycle".into()));
    }
    Ok(Sample {
        ops_per_sec: ops as f64 / elapsed,
        p50_us: pick(0.5),
        p99_us: pick(0.99),
        ops,
        cmds_per_op: None,
        server_cpu_us_per_op: None,
        client_cpu_us_per_op: None,
    })
}
