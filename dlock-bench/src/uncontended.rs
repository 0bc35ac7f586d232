//! Uncontended acquire + release: every task cycles on a key of its own, so
//! nothing ever waits and the figures show what the engine costs on top of
//! the round trips a hand-written lock makes anyway.
//!
//! * `dlock/redis`: [`Locker::acquire`](dlock_core::Locker::acquire) with a
//!   fixed lease (no watchdog) and no wait, then `release()`.
//! * `baseline/redis`: `SET key token NX PX` and a compare-and-delete
//!   `EVALSHA`, on one multiplexed connection.
//! * `fenced-floor/redis`: the least a lock with fencing tokens must do —
//!   one script of `SET NX PX` then `INCR` of a counter, and the same
//!   compare-and-delete. Its `ratio` is floor/baseline: what fencing alone
//!   costs; dlock's row reports dlock/floor beside its target ratio.
//! * `dlock/memory`: the engine over the in-process backend (no network), to
//!   show the engine's own overhead.
//!
//! dlock and the baseline alternate, in several rounds, and each figure is
//! the median over the rounds; the ratio is the median of the per-round
//! ratios, so slow phases of a shared machine hit both sides alike.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dlock_core::{Locker, MemoryBackend};

use crate::args::Args;
use crate::env::Env;
use crate::error::Result;
use crate::locks::{BenchLock, DlockLock, RawLock};
use crate::measure::{median, run_window, CommandCounter, Sample, Timing};
use crate::report::Row;
use crate::series::{target, Series};

/// The concurrencies measured.
pub(crate) const CONCURRENCY: &[usize] = &[1, 16, 256];

/// Throughput dlock must reach relative to the baseline.
pub(crate) const RATIO_TARGET: f64 = 0.9;

pub(crate) const TITLE: &str =
    "uncontended acquire+release (each task its own key, fixed lease, wait 0; ops = cycles/s, latency = one cycle)";

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration };
    // The in-process engine is fast and steady; a shorter window suffices.
    let memory_timing = Timing { warmup: args.warmup / 4, duration: args.duration / 4 };
    let mut dlock: Vec<Series> = CONCURRENCY.iter().map(|&c| Series::new("uncontended", "dlock", "redis", c)).collect();
    let mut base: Vec<Series> =
        CONCURRENCY.iter().map(|&c| Series::new("uncontended", "baseline", "redis", c)).collect();
    let mut floor: Vec<Series> =
        CONCURRENCY.iter().map(|&c| Series::new("uncontended", "fenced-floor", "redis", c)).collect();
    let mut memory: Vec<Series> =
        CONCURRENCY.iter().map(|&c| Series::new("uncontended", "dlock", "memory", c)).collect();
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let mut floor_ratios: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let mut over_floor: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let rounds = args.uncontended_rounds;
    for round in 0..rounds {
        for (ci, &c) in CONCURRENCY.iter().enumerate() {
            let name = format!("u-r{round}-c{c}");
            // Rotate who goes first, so none always runs on a warmer server.
            let (mut d, mut b, mut f) = (None, None, None);
            for turn in 0..3 {
                match (round + ci + turn) % 3 {
                    0 => {
                        let lock = DlockLock::new(env.redis_locker.clone(), &format!("{name}-dlock"), c)?;
                        d = Some(measure(lock, c, timing, Some(&env.counter)).await?);
                    }
                    1 => {
                        let lock = RawLock::try_once(env.conn.clone(), &format!("{}:{name}-base", env.prefix), c)?;
                        b = Some(measure(lock, c, timing, Some(&env.counter)).await?);
                    }
                    _ => {
                        let lock =
                            RawLock::fenced_try_once(env.conn.clone(), &format!("{}:{name}-floor", env.prefix), c)?;
                        f = Some(measure(lock, c, timing, Some(&env.counter)).await?);
                    }
                }
            }
            let (Some(d), Some(b), Some(f)) = (d, b, f) else {
                return Err(crate::error::BenchError::Invariant("a round skipped an implementation".into()));
            };
            if b.ops_per_sec > 0.0 {
                ratios[ci].push(d.ops_per_sec / b.ops_per_sec);
                floor_ratios[ci].push(f.ops_per_sec / b.ops_per_sec);
            }
            if f.ops_per_sec > 0.0 {
                over_floor[ci].push(d.ops_per_sec / f.ops_per_sec);
            }
            floor[ci].samples.push(f);
            dlock[ci].samples.push(d);
            base[ci].samples.push(b);
            let mem_lock = DlockLock::new(Locker::new(MemoryBackend::new()), &name, c)?;
            memory[ci].samples.push(measure(mem_lock, c, memory_timing, None).await?);
        }
        eprintln!(
            "uncontended round {}/{rounds}: dlock/baseline/fenced-floor ops {}",
            round + 1,
            CONCURRENCY
                .iter()
                .enumerate()
                .map(|(ci, c)| format!(
                    "c={c} {:.0}/{:.0}/{:.0}",
                    dlock[ci].samples.last().map_or(0.0, |s| s.ops_per_sec),
                    base[ci].samples.last().map_or(0.0, |s| s.ops_per_sec),
                    floor[ci].samples.last().map_or(0.0, |s| s.ops_per_sec)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut rows = Vec::new();
    for ci in 0..CONCURRENCY.len() {
        let mut d = dlock[ci].row();
        let ratio = median(ratios[ci].iter().copied()).unwrap_or(0.0);
        d.ratio = Some(ratio);
        d.targets.push(target("ratio", ratio, false, RATIO_TARGET, ""));
        d.vs_floor = median(over_floor[ci].iter().copied());
        rows.push(d);
        rows.push(base[ci].row());
        let mut f = floor[ci].row();
        f.ratio = median(floor_ratios[ci].iter().copied());
        rows.push(f);
        rows.push(memory[ci].row());
    }
    Ok(rows)
}

/// One window of `concurrency` tasks, each cycling on its own slot.
pub(crate) async fn measure<L: BenchLock>(
    lock: L,
    concurrency: usize,
    timing: Timing,
    counter: Option<&CommandCounter>,
) -> Result<Sample> {
    let lock = Arc::new(lock);
    let internal = lock.script_internal_commands();
    run_window(concurrency, timing, counter.map(|c| (c, internal)), |slot, clock, stop| {
        let lock = lock.clone();
        async move {
            let mut records = Vec::with_capacity(4096);
            while !stop.load(Ordering::Relaxed) {
                let started = clock.now_ns();
                let held = lock.acquire(slot, false).await?;
                lock.release(held).await?;
                let done = clock.now_ns();
                records.push((done, done - started));
            }
            Ok(records)
        }
    })
    .await
}
