//! Semaphores and read-write locks next to the exclusive lock, in the same
//! run (issue 26).
//!
//! * uncontended cycles, each task on a key of its own, fixed lease, wait 0:
//!   `exclusive` (the plain lock), `permit` (one of 1,000 permits: never
//!   full) and `shared` (a read lock nobody writes), on Redis and in
//!   process. Each Redis row reports Redis CPU per cycle; the permit and
//!   shared rows carry its ratio to the exclusive row's, the median of the
//!   per-round ratios (the three take turns in every round, so a slow phase
//!   of a shared machine hits them alike), with the targets: a permit cycle
//!   ≤ [`PERMIT_CPU_TARGET`] × an exclusive one, a shared read ≤
//!   [`SHARED_CPU_TARGET`] ×, at every concurrency.
//! * handoff of a freed permit: K tasks on a semaphore of one permit, in the
//!   handoff benchmark's strict mode (every release goes to a parked
//!   waiter), beside the exclusive lock under the same K.

use dlock_core::LockMode;
use dlock_core::{Locker, MemoryBackend};

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::DlockLock;
use crate::measure::{median, Timing};
use crate::report::Row;
use crate::series::{target, Series};
use crate::uncontended::{measure, measure_redis};

/// A permit cycle's Redis CPU at most this times an exclusive cycle's.
pub(crate) const PERMIT_CPU_TARGET: f64 = 1.5;

/// A shared read's Redis CPU at most this times an exclusive cycle's.
pub(crate) const SHARED_CPU_TARGET: f64 = 1.2;

/// The concurrencies of the uncontended rows.
const CONCURRENCY: &[usize] = &[1, 16];

/// The contenders of the handoff rows.
const CONTENDERS: &[usize] = &[8];

/// Permits of the uncontended semaphore: more than any task count, so it
/// is never full and the row measures the cycle, not a wait.
const WIDE: u32 = 1_000;

pub(crate) const TITLE: &str = "primitives: uncontended cycles by mode (each task its own key, fixed lease, wait 0; \
     srv us = Redis CPU per cycle; ratio = srv us vs the exclusive row), and the handoff of a freed permit \
     (a semaphore of 1, strict handoff as in `handoff`)";

/// The modes measured, in the order a round's turns rotate through.
const MODES: [(&str, LockMode); 3] =
    [("exclusive", LockMode::Exclusive), ("permit", LockMode::permits(WIDE)), ("shared", LockMode::Shared)];

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration };
    let memory_timing = Timing { warmup: args.warmup / 4, duration: args.duration / 4 };
    let mut redis: Vec<[Series; 3]> =
        CONCURRENCY.iter().map(|&c| MODES.map(|(m, _)| Series::new("primitives", m, "redis", c))).collect();
    let mut memory: Vec<[Series; 3]> =
        CONCURRENCY.iter().map(|&c| MODES.map(|(m, _)| Series::new("primitives", m, "memory", c))).collect();
    // Per concurrency, per mode (permit, shared): per-round CPU ratios to exclusive.
    let mut cpu: Vec<[Vec<f64>; 2]> = CONCURRENCY.iter().map(|_| [Vec::new(), Vec::new()]).collect();
    let rounds = args.uncontended_rounds;
    for round in 0..rounds {
        for (ci, &c) in CONCURRENCY.iter().enumerate() {
            let mut srv = [None; 3];
            for turn in 0..MODES.len() {
                let i = (round + ci + turn) % MODES.len();
                let (name, mode) = MODES[i];
                let keys = format!("p-r{round}-c{c}-{name}");
                let lock = DlockLock::new(env.redis_locker.clone(), &keys, c)?.with_mode(mode);
                let sample = measure_redis(env, lock, c, timing).await?;
                srv[i] = sample.server_cpu_us_per_op;
                redis[ci][i].samples.push(sample);
                let lock = DlockLock::new(Locker::new(MemoryBackend::new()), &keys, c)?.with_mode(mode);
                memory[ci][i].samples.push(measure(lock, c, memory_timing, None).await?);
            }
            for (m, ratios) in cpu[ci].iter_mut().enumerate() {
                if let (Some(x), Some(num)) = (srv[0], srv[m + 1])
                    && x > 0.0
                {
                    ratios.push(num / x);
                }
            }
        }
        eprintln!("primitives round {}/{rounds}", round + 1);
    }
    let mut rows = Vec::new();
    for ci in 0..CONCURRENCY.len() {
        for (i, series) in redis[ci].iter().enumerate() {
            let mut row = series.row();
            if i > 0 {
                let ratio = median(cpu[ci][i - 1].iter().copied());
                row.ratio = ratio;
                let limit = if i == 1 { PERMIT_CPU_TARGET } else { SHARED_CPU_TARGET };
                let value = ratio.ok_or_else(|| BenchError::Invariant("no Redis CPU was measured".into()))?;
                row.targets.push(target("srv us vs exclusive", value, true, limit, ""));
            }
            rows.push(row);
        }
        rows.extend(memory[ci].iter().map(Series::row));
    }
    for &k in CONTENDERS {
        for (name, mode) in [("exclusive", LockMode::Exclusive), ("permit-of-1", LockMode::permits(1))] {
            let mut series = Series::new("primitives-handoff", name, "redis", k);
            for round in 0..args.handoff_rounds {
                let lock = DlockLock::new(env.redis_locker.clone(), &format!("ph-r{round}-k{k}-{name}"), 1)?;
                let sample =
                    crate::handoff::measure(lock.with_mode(mode), k, args.settle, timing, Some(&env.counter)).await?;
                series.samples.push(sample);
            }
            rows.push(series.row());
        }
    }
    Ok(rows)
}
