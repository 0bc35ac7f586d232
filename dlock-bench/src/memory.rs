//! What one-off locks leave behind: a burst of locks on keys used once (a
//! key per request, as idempotency tokens make them), each released, then
//! the keys and bytes Redis holds more than before the burst, per lock.
//!
//! * `dlock/redis`: [`Locker::acquire`](dlock_core::Locker::acquire) with a
//!   fixed lease and `release()`; the target is ≤ 0.01 keys per lock.
//! * `fenced-floor/redis`: the fenced floor of the `uncontended` benchmark,
//!   whose `INCR` counter per key has no TTL: one key per lock, for
//!   comparison.
//!
//! Bytes are the change of `INFO memory`'s `used_memory`, which also moves
//! with client buffers: a few kB either way are noise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use redis::aio::MultiplexedConnection;
use tokio::task::JoinSet;

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::{BenchLock, DlockLock, RawLock};
use crate::measure::{command_delta, process_cpu_ns, Clock};
use crate::report::Row;
use crate::series::target;

/// Tasks cycling through the burst.
const TASKS: usize = 16;

/// Keys left per released one-off lock that dlock may reach at most.
const KEYS_PER_LOCK_TARGET: f64 = 0.01;

pub(crate) const TITLE: &str =
    "one-off locks (each key locked once and released; keys/bytes per lock = what Redis keeps more afterwards)";

pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let locks = args.one_off_locks;
    let dlock = DlockLock::new(env.redis_locker.clone(), "oneoff", locks)?;
    let mut d = burst(env, dlock, locks, "dlock").await?;
    let keys = d.keys_left_per_lock.unwrap_or(f64::INFINITY);
    d.targets.push(target("keys/lock", keys, true, KEYS_PER_LOCK_TARGET, ""));
    let floor = RawLock::fenced_try_once(env.conn.clone(), &format!("{}:oneoff-floor", env.prefix), locks)?;
    let f = burst(env, floor, locks, "fenced-floor").await?;
    Ok(vec![d, f])
}

/// Redis' key count and `used_memory`.
async fn footprint(conn: &MultiplexedConnection) -> Result<(u64, i64)> {
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut conn.clone()).await?;
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn.clone()).await?;
    let used = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse::<i64>().ok())
        .ok_or_else(|| BenchError::Invariant("INFO memory has no used_memory".into()))?;
    Ok((keys, used))
}

/// Locks each of `locks` slots of `lock` once, `TASKS` at a time.
async fn burst<L: BenchLock + Send + Sync + 'static>(env: &Env, lock: L, locks: usize, imp: &str) -> Result<Row>
where
    L::Held: Send,
{
    let lock = Arc::new(lock);
    let next = Arc::new(AtomicUsize::new(0));
    let clock = Clock::start();
    let internal = lock.script_internal_commands();
    let (keys_before, bytes_before) = footprint(&env.conn).await?;
    let stats_before = env.counter.snapshot().await?;
    let started = clock.now_ns();
    let cpu_started = process_cpu_ns();
    let mut set = JoinSet::new();
    for _ in 0..TASKS {
        let (lock, next) = (lock.clone(), next.clone());
        set.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let slot = next.fetch_add(1, Ordering::Relaxed);
                if slot >= locks {
                    return Ok::<_, BenchError>(latencies);
                }
                let t = clock.now_ns();
                let held = lock.acquire(slot, false).await?;
                lock.release(held).await?;
                latencies.push(clock.now_ns() - t);
            }
        });
    }
    let mut latencies = Vec::with_capacity(locks);
    while let Some(done) = set.join_next().await {
        let mut l = done.map_err(|e| BenchError::Invariant(format!("a one-off task failed: {e}")))??;
        latencies.append(&mut l);
    }
    let secs = (clock.now_ns() - started) as f64 / 1e9;
    let cpu_us = process_cpu_ns().saturating_sub(cpu_started) as f64 / 1000.0;
    let delta = command_delta(&stats_before, &env.counter.snapshot().await?, internal);
    let (keys_after, bytes_after) = footprint(&env.conn).await?;
    let n = latencies.len() as f64;
    let percentile_us = |q| dlock_testing::percentile(&latencies, q).map_or(0.0, |ns| ns as f64 / 1000.0);
    Ok(Row {
        bench: "memory",
        imp: imp.to_owned(),
        backend: "redis",
        concurrency: TASKS,
        ops_per_sec: if secs > 0.0 { n / secs } else { 0.0 },
        p50_us: percentile_us(0.50),
        p99_us: percentile_us(0.99),
        cmds_per_acquisition: Some(delta.client as f64 / n),
        server_cmds_per_acquisition: Some(delta.server as f64 / n),
        server_cpu_us: Some(delta.server_cpu_us as f64 / n),
        client_cpu_us: Some(cpu_us / n),
        ratio: None,
        vs_floor: None,
        vs_clock_floor: None,
        vs_peer: None,
        cpu_vs_floor: None,
        keys_left_per_lock: Some((keys_after as f64 - keys_before as f64) / n),
        bytes_left_per_lock: Some((bytes_after - bytes_before) as f64 / n),
        targets: Vec::new(),
        rounds: 1,
        samples: latencies.len() as u64,
    })
}
