//! The distributed backends against the single Redis, in one run: RedLock
//! over 3 and 5 masters and ZooKeeper (with the `zookeeper` feature), each
//! started by the bench on loopback.
//!
//! * uncontended acquire+release at concurrency 1 and 16 (the same
//!   measurement as `uncontended`), with the ratio to single Redis measured
//!   in the same round;
//! * strict handoff on one key with K = 8 (the same measurement as
//!   `handoff`): release → next acquire latency.
//!
//! Built without the `zookeeper` feature, the ZooKeeper rows are replaced by
//! a line saying so on stderr, never silently left out.

use std::sync::Arc;

use dlock_core::backend::redlock::RedLockBackend;
use dlock_core::backend::Backend;
use dlock_core::{Locker, LockerOptions};
use dlock_testing::RedisServer;

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::DlockLock;
use crate::measure::{median, Timing};
use crate::pin::Pinning;
use crate::report::Row;
use crate::series::Series;
use crate::{handoff, uncontended};

/// Concurrencies of the uncontended rows.
const CONCURRENCY: &[usize] = &[1, 16];
/// Waiting tasks of the handoff rows.
const CONTENDERS: usize = 8;

pub(crate) const TITLE: &str =
    "backends: uncontended acquire+release, each task its own key (ratio = backend / single redis, same round)";
pub(crate) const HANDOFF_TITLE: &str =
    "backends: strict handoff on one key, K = 8 waiting tasks (latency = release() called -> next acquire returned)";

/// A backend under test, with whatever servers it needs.
struct Under {
    name: &'static str,
    locker: Locker,
    /// Kept alive for the measurement; killed on drop.
    _servers: Vec<RedisServer>,
    #[cfg(feature = "zookeeper")]
    _zookeeper: Option<dlock_testing::ZooKeeperServer>,
}

async fn redlock(name: &'static str, n: usize, prefix: &str, pinning: &Pinning) -> Result<Under> {
    let servers: Vec<RedisServer> = (0..n).map(|_| RedisServer::start()).collect();
    for server in &servers {
        // With the main server, off the benchmark's CPUs.
        pinning.server(server.pid()).map_err(BenchError::Server)?;
    }
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let backend = RedLockBackend::connect(&urls, prefix).await?;
    let locker =
        Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default().with_prefix(prefix))?;
    Ok(Under {
        name,
        locker,
        _servers: servers,
        #[cfg(feature = "zookeeper")]
        _zookeeper: None,
    })
}

#[cfg(feature = "zookeeper")]
async fn zookeeper(prefix: &str) -> Result<Option<Under>> {
    use dlock_core::backend::zookeeper::ZooKeeperBackend;
    let server = dlock_testing::ZooKeeperServer::start();
    let backend = ZooKeeperBackend::connect(&server.connect_string(), prefix).await?;
    let locker =
        Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default().with_prefix(prefix))?;
    Ok(Some(Under { name: "zookeeper", locker, _servers: Vec::new(), _zookeeper: Some(server) }))
}

#[cfg(not(feature = "zookeeper"))]
async fn zookeeper(_prefix: &str) -> Result<Option<Under>> {
    eprintln!(
        "backends: ZooKeeper rows not measured: built without the `zookeeper` feature \
         (cargo run --release -p dlock-bench --features zookeeper)"
    );
    Ok(None)
}

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    // A ZooKeeper cycle is a few fsync'd writes: even the quick mode needs a
    // window that holds some of them.
    let timing = Timing { warmup: args.warmup, duration: args.duration.max(std::time::Duration::from_millis(300)) };
    let mut under = vec![
        redlock("redlock-3", 3, &env.prefix, &env.pinning).await?,
        redlock("redlock-5", 5, &env.prefix, &env.pinning).await?,
    ];
    under.extend(zookeeper(&env.prefix).await?);

    let mut base: Vec<Series> = CONCURRENCY.iter().map(|&c| Series::new("backends", "dlock", "redis", c)).collect();
    let mut unc: Vec<Vec<Series>> = under
        .iter()
        .map(|u| CONCURRENCY.iter().map(|&c| Series::new("backends", "dlock", u.name, c)).collect())
        .collect();
    let mut ratios: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); CONCURRENCY.len()]; under.len()];
    let mut hand_base = Series::new("backends-handoff", "dlock", "redis", CONTENDERS);
    let mut hand: Vec<Series> =
        under.iter().map(|u| Series::new("backends-handoff", "dlock", u.name, CONTENDERS)).collect();

    let rounds = args.handoff_rounds.max(1);
    for round in 0..rounds {
        for (ci, &c) in CONCURRENCY.iter().enumerate() {
            let name = format!("b-r{round}-c{c}");
            let b = uncontended::measure(
                DlockLock::new(env.redis_locker.clone(), &format!("{name}-redis"), c)?,
                c,
                timing,
                None,
            )
            .await?;
            for (ui, u) in under.iter().enumerate() {
                let s = uncontended::measure(
                    DlockLock::new(u.locker.clone(), &format!("{name}-{}", u.name), c)?,
                    c,
                    timing,
                    None,
                )
                .await?;
                if b.ops_per_sec > 0.0 {
                    ratios[ui][ci].push(s.ops_per_sec / b.ops_per_sec);
                }
                unc[ui][ci].samples.push(s);
            }
            base[ci].samples.push(b);
        }
        let name = format!("bh-r{round}");
        let lock = DlockLock::new(env.redis_locker.clone(), &format!("{name}-redis"), 1)?;
        hand_base.samples.push(handoff::measure(lock, CONTENDERS, args.settle, timing, None).await?);
        for (ui, u) in under.iter().enumerate() {
            let lock = DlockLock::new(u.locker.clone(), &format!("{name}-{}", u.name), 1)?;
            hand[ui].samples.push(handoff::measure(lock, CONTENDERS, args.settle, timing, None).await?);
        }
        eprintln!(
            "backends round {}/{rounds}: c=1 ops {}",
            round + 1,
            std::iter::once(format!("redis {:.0}", base[0].samples.last().map_or(0.0, |s| s.ops_per_sec)))
                .chain(under.iter().enumerate().map(|(ui, u)| {
                    format!("{} {:.0}", u.name, unc[ui][0].samples.last().map_or(0.0, |s| s.ops_per_sec))
                }))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let mut rows = Vec::new();
    for ci in 0..CONCURRENCY.len() {
        rows.push(without_commands(base[ci].row()));
        for ui in 0..under.len() {
            let mut r = without_commands(unc[ui][ci].row());
            r.ratio = median(ratios[ui][ci].iter().copied());
            rows.push(r);
        }
    }
    rows.push(without_commands(hand_base.row()));
    for h in &hand {
        rows.push(without_commands(h.row()));
    }
    // Drop the servers only after the last measurement.
    drop(under);
    Ok(rows)
}

/// Commands are counted on the bench's own single Redis only; these rows
/// did not count theirs.
pub(crate) fn without_commands(mut row: Row) -> Row {
    row.cmds_per_acquisition = None;
    row.server_cmds_per_acquisition = None;
    row.server_cpu_us = None;
    row
}
