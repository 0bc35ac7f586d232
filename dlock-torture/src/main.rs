//! `dlock-torture`: runs dlock against real servers (started on free
//! loopback ports) while injecting faults, then checks the history.
//!
//! ```text
//! cargo run --release --bin dlock-torture -- [--short] [--scenario NAME] [--json] [--seed N] [--markdown PATH]
//! cargo run --release --bin dlock-torture -- --list   # the scenario names, one a line
//! cargo run --release --bin dlock-torture -- --list-broken   # the self-test's broken variants
//! ```
//!
//! Every scenario prints one table row (or one JSON object per line with
//! `--json`); `--markdown PATH` also writes the results block of
//! RELIABILITY.md (see [`markdown`]), `--timelines DIR` an SVG per row
//! (see [`timeline`]). The exit code is 1 when a scenario that the backend promises
//! to survive loses an update on the fenced register, accepts a stale write
//! or shows an overlap its fault does not excuse, or when a scenario's own
//! assertion fails (a broken lock the checker missed, residue, a 5xx);
//! 2 for bad arguments. See RELIABILITY.md for the results and what each
//! backend guarantees.

mod badinput;
mod baseline;
mod broken;
mod burst;
mod checker;
mod flush;
mod harness;
mod herd;
mod history;
mod kill_client;
mod markdown;
mod orphan_renewal;
mod own_bugs;
mod partition;
mod pause;
mod pg_fence;
mod pg_idempotency;
mod postgres;
mod preference;
mod primitives;
mod redlock;
mod redlock_skew;
mod release_retry;
mod renewal;
mod resource;
mod restart;
mod rng;
mod scenario;
mod scenarios;
mod self_test;
mod slow;
mod storm;
mod timeline;
mod worker;
mod zk_expire;

use std::process::ExitCode;

use harness::Report;

fn usage() -> String {
    format!(
        "usage: dlock-torture [--short] [--scenario NAME]... [--json] [--seed N] [--markdown PATH|-] [--timelines DIR] | --list | --list-broken\nscenarios: {}",
        scenarios::names()
    )
}

struct Args {
    list: bool,
    /// `--list-broken`: print the self-test's broken variants.
    list_broken: bool,
    short: bool,
    json: bool,
    seed: u64,
    scenarios: Vec<String>,
    /// Where the RELIABILITY.md results block goes (`-`: stdout).
    markdown: Option<String>,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        list: false,
        list_broken: false,
        short: false,
        json: false,
        seed: 0,
        scenarios: Vec::new(),
        markdown: None,
    };
    let mut seeded = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--list" => args.list = true,
            "--list-broken" => args.list_broken = true,
            "--short" => args.short = true,
            "--json" => args.json = true,
            "--seed" => {
                let v = it.next().ok_or("--seed needs a number")?;
                args.seed = v.parse().map_err(|_| format!("--seed: `{v}` is not a number"))?;
                seeded = true;
            }
            "--scenario" => {
                let v = it.next().ok_or("--scenario needs a name")?;
                if scenarios::find(&v).is_none() {
                    return Err(format!("unknown scenario `{v}`"));
                }
                args.scenarios.push(v);
            }
            "--markdown" => {
                let v = it.next().ok_or("--markdown needs a path (or - for stdout)")?;
                markdown::check_target(&v)?;
                args.markdown = Some(v);
            }
            "--timelines" => {
                let v = it.next().ok_or("--timelines needs a directory")?;
                timeline::set_dir(std::path::Path::new(&v))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if !seeded {
        args.seed = history::mono_ns() ^ u64::from(std::process::id());
    }
    if args.scenarios.is_empty() {
        args.scenarios = scenarios::ALL.iter().map(|s| s.name.to_owned()).collect();
    }
    Ok(args)
}

/// Runs a worker process to completion, with the workload its
/// configuration names; the error says what could not start.
fn run_worker(config_json: &str) -> Result<(), String> {
    let cfg = worker::config(config_json)?;
    let rt = worker::runtime()?;
    match cfg.kind.as_str() {
        "" => rt.block_on(worker::registers(cfg)),
        "pg-fence" | "pg-fence-check-outside-tx" => rt.block_on(pg_fence::work(cfg)),
        "pg-idempotency" | "pg-idempotency-effect-outside-tx" => rt.block_on(pg_idempotency::work(cfg)),
        other => Err(format!("unknown worker kind `{other}`")),
    }
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let mut argv = raw.clone().into_iter().peekable();
    if argv.peek().map(String::as_str) == Some("worker") {
        let config = argv.nth(1).unwrap_or_default();
        return match run_worker(&config) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dlock-torture worker: {e}");
                ExitCode::from(3)
            }
        };
    }
    let args = match parse(argv) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("dlock-torture: {e}");
            }
            eprintln!("{}", usage());
            return ExitCode::from(2);
        }
    };
    if args.list {
        for s in scenarios::ALL {
            println!("{}", s.name);
        }
        return ExitCode::SUCCESS;
    }
    if args.list_broken {
        for v in self_test::variants() {
            println!("{v}");
        }
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock-torture: cannot start a tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("dlock-torture: seed {} ({})", args.seed, if args.short { "short" } else { "long" });
    let size = scenario::Size { short: args.short };
    let (started_at, run_started) = (std::time::SystemTime::now(), std::time::Instant::now());
    let commit = if args.markdown.is_some() { markdown::commit() } else { String::new() };
    harness::size_set_registers(args.short);
    let mut rows: Vec<Report> = Vec::new();
    if !args.json {
        println!("{}", header());
    }
    for name in &args.scenarios {
        let started = std::time::Instant::now();
        let got = rt.block_on(scenarios::run(name, size, args.seed));
        eprintln!("dlock-torture: {name} took {:.1} s", started.elapsed().as_secs_f64());
        for r in got {
            if args.json {
                match serde_json::to_string(&r) {
                    Ok(line) => println!("{line}"),
                    Err(e) => eprintln!("dlock-torture: cannot encode a report: {e}"),
                }
            } else {
                println!("{}", row(&r));
            }
            rows.push(r);
        }
    }
    if let Some(path) = &args.markdown {
        let stamp = markdown::Stamp::of_this_run(commit.clone(), &raw, args.seed, started_at, run_started.elapsed());
        match markdown::write(path, &markdown::block(&stamp, &rows)) {
            Ok(()) if path != "-" => eprintln!("dlock-torture: results written to {path}"),
            Ok(()) => {}
            Err(e) => {
                eprintln!("dlock-torture: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let failed: Vec<&Report> = rows.iter().filter(|r| !r.pass || !r.safety_ok()).collect();
    if !args.json {
        println!();
        for r in &rows {
            if !r.notes.is_empty() {
                println!("{} [{}]: {}", r.scenario, r.backend, r.notes);
            }
        }
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        for r in failed {
            eprintln!("dlock-torture: FAILED {} [{}]: {}", r.scenario, r.backend, r.notes);
        }
        ExitCode::FAILURE
    }
}

fn header() -> String {
    format!(
        "{:<18} {:<46} {:>5} {:>6} {:>6} {:>8} {:>5} {:>7} {:>7} {:>8} {:>8} {:>8} {}",
        "scenario",
        "backend",
        "safe",
        "ops",
        "faults",
        "overlaps",
        "lost",
        "refused",
        "st.acc",
        "unf.lost",
        "p50 ms",
        "p99 ms",
        "verdict"
    )
}

fn row(r: &Report) -> String {
    let overlaps = if r.overlaps_informational { format!("{}(i)", r.overlaps) } else { r.overlaps.to_string() };
    let verdict = markdown::verdict(r);
    format!(
        "{:<18} {:<46} {:>5} {:>6} {:>6} {:>8} {:>5} {:>7} {:>7} {:>8} {:>8.2} {:>8.2} {}",
        r.scenario,
        r.backend,
        if r.expected_safe { "yes" } else { "no" },
        r.operations,
        r.faults,
        overlaps,
        r.lost_updates,
        r.stale_writes_refused,
        r.stale_accepted,
        r.unfenced_lost,
        r.p50_wait_ms,
        r.p99_wait_ms,
        verdict
    )
}
