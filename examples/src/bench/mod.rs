//! The pieces of `dlock-bench`: one module per benchmark, a shared
//! measurement harness and one row type with its printers.
//!
//! A later benchmark (HTTP layer vs none, RedLock, ZooKeeper) adds a module
//! next to `uncontended` and `handoff` that returns [`report::Row`]s, and a
//! name in [`args::BENCHES`].

pub(crate) mod args;
pub(crate) mod backends;
pub(crate) mod handoff;
pub(crate) mod http;
pub(crate) mod idempotency;
pub(crate) mod locks;
pub(crate) mod measure;
pub(crate) mod report;
pub(crate) mod uncontended;

use std::fmt;

/// Everything that can stop a benchmark run.
#[derive(Debug)]
pub(crate) enum BenchError {
    /// Bad command line.
    Usage(String),
    /// The Redis server used by the baselines or the command counter failed.
    Redis(redis::RedisError),
    /// The engine under test failed.
    Lock(dlock_core::Error),
    /// The benchmark's own redis-server could not be started.
    Server(String),
    /// Something that must not happen in the scenario did: an uncontended
    /// acquire was refused, a release found the lock gone, tasks hung.
    Invariant(String),
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Usage(m) => write!(f, "{m}\n\n{}", args::USAGE),
            BenchError::Redis(e) => write!(f, "redis: {e}"),
            BenchError::Lock(e) => write!(f, "dlock: {e}"),
            BenchError::Server(m) => write!(f, "redis-server: {m}"),
            BenchError::Invariant(m) => write!(f, "benchmark invariant broken: {m}"),
        }
    }
}

impl std::error::Error for BenchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BenchError::Redis(e) => Some(e),
            BenchError::Lock(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for BenchError {
    fn from(e: redis::RedisError) -> Self {
        BenchError::Redis(e)
    }
}

impl From<dlock_core::Error> for BenchError {
    fn from(e: dlock_core::Error) -> Self {
        BenchError::Lock(e)
    }
}

pub(crate) type Result<T, E = BenchError> = std::result::Result<T, E>;

use std::sync::Arc;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::{Locker, LockerOptions};
use redis::aio::MultiplexedConnection;

use measure::{median, CommandCounter, Sample};
use report::{Row, Target};

/// The server under test and the clients every benchmark shares.
pub(crate) struct Env {
    pub(crate) url: String,
    /// For connections a baseline opens itself (pub/sub).
    pub(crate) client: redis::Client,
    /// The one multiplexed connection of the hand-written baselines.
    pub(crate) conn: MultiplexedConnection,
    /// Reads `INFO commandstats` on a connection of its own.
    pub(crate) counter: CommandCounter,
    /// dlock over [`RedisBackend`].
    pub(crate) redis_locker: Locker,
    /// Namespace of every key of this run, so that runs against a shared
    /// server never meet.
    pub(crate) prefix: String,
    pub(crate) server_version: String,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env").field("url", &self.url).field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl Env {
    pub(crate) async fn connect(url: &str) -> Result<Env> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        let counter = CommandCounter::new(client.get_multiplexed_async_connection().await?);
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn.clone()).await?;
        let server_version =
            info.lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or("unknown").trim().to_owned();
        let prefix = format!("dlock-bench-{}", std::process::id());
        let backend = RedisBackend::connect(url, &prefix).await?;
        let redis_locker = Locker::with_options(Arc::new(backend), LockerOptions::default().with_prefix(&prefix))?;
        Ok(Env { url: url.to_owned(), client, conn, counter, redis_locker, prefix, server_version })
    }
}

/// Measurements of one (implementation, backend, concurrency) over rounds.
#[derive(Debug)]
pub(crate) struct Series {
    pub(crate) bench: &'static str,
    pub(crate) imp: &'static str,
    pub(crate) backend: &'static str,
    pub(crate) concurrency: usize,
    pub(crate) samples: Vec<Sample>,
}

impl Series {
    pub(crate) fn new(bench: &'static str, imp: &'static str, backend: &'static str, concurrency: usize) -> Self {
        Series { bench, imp, backend, concurrency, samples: Vec::new() }
    }

    pub(crate) fn median_ops(&self) -> f64 {
        median(self.samples.iter().map(|s| s.ops_per_sec)).unwrap_or(0.0)
    }

    /// The row: the median of every figure over the rounds.
    pub(crate) fn row(&self) -> Row {
        let in_process = self.backend == "memory";
        let cmds = |pick: fn(&(f64, f64)) -> f64| {
            if in_process {
                Some(0.0)
            } else {
                median(self.samples.iter().filter_map(|s| s.cmds_per_op.as_ref().map(pick)))
            }
        };
        Row {
            bench: self.bench,
            imp: self.imp.to_owned(),
            backend: self.backend,
            concurrency: self.concurrency,
            ops_per_sec: self.median_ops(),
            p50_us: median(self.samples.iter().map(|s| s.p50_us)).unwrap_or(0.0),
            p99_us: median(self.samples.iter().map(|s| s.p99_us)).unwrap_or(0.0),
            cmds_per_acquisition: cmds(|c| c.0),
            server_cmds_per_acquisition: if in_process { None } else { cmds(|c| c.1) },
            server_cpu_us: median(self.samples.iter().filter_map(|s| s.server_cpu_us_per_op)),
            ratio: None,
            vs_floor: None,
            targets: Vec::new(),
            rounds: self.samples.len(),
            samples: self.samples.iter().map(|s| s.ops).sum(),
        }
    }
}

/// A target on a figure: `value <= limit` or `value >= limit`.
pub(crate) fn target(name: &str, value: f64, at_most: bool, limit: f64, unit: &str) -> Target {
    let (op, met) = if at_most { ("<=", value <= limit) } else { (">=", value >= limit) };
    Target { goal: format!("{name} {op} {limit}{unit}"), met }
}
