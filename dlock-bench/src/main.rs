//! `dlock-bench`: what dlock costs, against hand-written Redis locks, in one
//! run against one local `redis-server`.
//!
//! * uncontended acquire+release cycles/s, p50/p99 latency, server commands
//!   and Redis CPU per cycle at concurrency 1, 16 and 256, for dlock, a raw
//!   `SET NX PX` + compare-and-delete baseline, the fenced floor and a
//!   Redisson-semantics peer, with dlock's targets against each (PASS/MISS);
//! * one-off locks (a key locked once each): the keys and bytes Redis keeps
//!   per released lock;
//! * contended handoff on one key with K = 2, 8 and 32 tasks in strict-handoff
//!   mode: release → next-acquire latency and Redis commands per acquisition,
//!   for dlock (Redis and in-process) and for a 1 ms poller and naive pub/sub.
//!
//! ```sh
//! cargo run --release --bin dlock-bench              # tables; starts its own redis-server
//! cargo run --release --bin dlock-bench -- --json    # one JSON object per line
//! cargo run --release --bin dlock-bench -- --quick --redis-url redis://127.0.0.1:6379
//! cargo run --release -p dlock-bench --features zookeeper        # with the ZooKeeper rows
//! cargo run --release -p dlock-bench --features postgres -- --bench postgres   # PostgreSQL rows
//! cargo run --release -p dlock-bench --features metrics -- --bench metrics     # what metrics cost
//! ```
//!
//! One module per benchmark (`uncontended`, `handoff`, `http`,
//! `idempotency`, `backends`), each returning [`report::Row`]s; they share
//! the measurement harness (`measure`), the locks under test (`locks`) and
//! one row type with its printers (`report`). A new benchmark adds a module
//! beside them and a name in [`args::BENCHES`].

mod args;
mod backends;
mod env;
mod error;
mod handoff;
mod http;
mod idempotency;
mod locks;
mod measure;
mod memory;
#[cfg(feature = "metrics")]
mod metrics_cost;
mod peer;
mod pin;
#[cfg(feature = "postgres")]
mod postgres;
mod primitives;
mod report;
mod series;
mod uncontended;

use std::process::ExitCode;

use args::{Args, USAGE};
use dlock_testing::RedisServer;
use env::Env;
use error::{BenchError, Result};
use pin::Pinning;

fn main() -> ExitCode {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        // A bad command line is answered with the usage, which the command
        // line's module owns (the error type only carries the complaint).
        Err(e) => {
            eprintln!("dlock-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dlock-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<String> {
    // Kept alive until the end of the run; dropping it stops the server.
    let (_server, url) = match &args.redis_url {
        Some(url) => (None, url.clone()),
        None => {
            let server = start_server()?;
            let url = server.url();
            (Some(server), url)
        }
    };
    // Before the runtime starts its threads, which inherit it; a server of
    // someone else's (--redis-url) is left where it is.
    let pinning = match &_server {
        Some(server) => {
            let pinning = Pinning::apply(args.no_pin);
            pinning.server(server.pid()).map_err(BenchError::Server)?;
            pinning
        }
        None => Pinning::Off("--redis-url".into()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Invariant(format!("cannot start the tokio runtime: {e}")))?;
    runtime.block_on(async {
        let env = Env::connect(&url, pinning).await?;
        eprintln!(
            "dlock-bench: redis {} at {}{}, {}, windows of {:?} after {:?} warm-up, rounds {}/{} (uncontended/handoff), settle {:?}",
            env.server_version,
            env.url,
            if args.redis_url.is_none() { " (own server)" } else { "" },
            env.pinning.describe(),
            args.duration,
            args.warmup,
            args.uncontended_rounds,
            args.handoff_rounds,
            args.settle,
        );
        let mut rows = Vec::new();
        if args.runs("uncontended") {
            rows.extend(uncontended::run(&env, args).await?);
        }
        if args.runs("memory") {
            rows.extend(memory::run(&env, args).await?);
        }
        if args.runs("handoff") {
            rows.extend(handoff::run(&env, args).await?);
        }
        if args.runs("primitives") {
            rows.extend(primitives::run(&env, args).await?);
        }
        if args.runs("http") {
            rows.extend(http::run(&env, args).await?);
        }
        if args.runs("idempotency") {
            rows.extend(idempotency::run(&env, args).await?);
        }
        if args.runs("backends") {
            rows.extend(backends::run(&env, args).await?);
        }
        if args.runs("metrics") {
            #[cfg(feature = "metrics")]
            rows.extend(metrics_cost::run(&env, args)?);
            #[cfg(not(feature = "metrics"))]
            eprintln!(
                "metrics: not measured: built without the `metrics` feature \
                 (cargo run --release -p dlock-bench --features metrics -- --bench metrics)"
            );
        }
        if args.runs("postgres") || args.runs("postgres-tx") {
            #[cfg(feature = "postgres")]
            rows.extend(postgres::run(&env, args, args.runs("postgres")).await?);
            #[cfg(not(feature = "postgres"))]
            eprintln!(
                "postgres: not measured: built without the `postgres` feature \
                 (cargo run --release -p dlock-bench --features postgres -- --bench postgres)"
            );
        }
        Ok(if args.json {
            report::json_lines(&rows)
        } else {
            let header = format!(
                "dlock-bench against redis {} ({}; {}), medians over rounds; cmds/acq = client commands per acquisition, \
                 srv/acq = every server call incl. those inside Lua scripts",
                env.server_version,
                env.url,
                env.pinning.describe()
            );
            let titles = [
                ("uncontended", uncontended::TITLE),
                ("memory", memory::TITLE),
                ("handoff", handoff::TITLE),
                ("primitives", primitives::TITLE),
                ("primitives-handoff", primitives::TITLE),
                ("http", http::TITLE),
                ("http-in-process", http::IN_PROCESS_TITLE),
                ("idempotency", idempotency::TITLE),
                ("backends", backends::TITLE),
                ("backends-handoff", backends::HANDOFF_TITLE),
                #[cfg(feature = "metrics")]
                ("metrics", metrics_cost::TITLE),
                #[cfg(feature = "postgres")]
                ("postgres", postgres::TITLE),
                #[cfg(feature = "postgres")]
                ("postgres-handoff", postgres::HANDOFF_TITLE),
                #[cfg(feature = "postgres")]
                ("postgres-route", postgres::ROUTE_TITLE),
            ];
            format!("{header}\n{}", report::tables(&rows, &titles))
        })
    })
}

/// Starts a `redis-server` on a free loopback port.
fn start_server() -> Result<RedisServer> {
    let installed = std::process::Command::new("redis-server")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !installed {
        return Err(BenchError::Server(
            "`redis-server` is not installed; install it (`apt-get install -y redis-server`) or pass --redis-url"
                .into(),
        ));
    }
    std::panic::catch_unwind(RedisServer::start)
        .map_err(|_| BenchError::Server("it did not come up (see the message above); or pass --redis-url".into()))
}
