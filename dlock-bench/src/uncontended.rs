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
//! * `clock-floor/redis`: the fenced floor that also reads the server
//!   clock (`TIME`) in its script, as any lock whose tokens must survive a
//!   lost counter has to; no target, it shows what dlock's restart-proof
//!   tokens cost (dlock's row prints dlock / it as "of the clock floor").
//! * `redisson-peer/redis`: Redisson's re-entrant hash lock ([`crate::peer`]):
//!   an acquire script, a release script guarded by an unlock latch and the
//!   client's `DEL` of that latch. Its `ratio` is peer/baseline.
//! * `dlock/memory`: the engine over the in-process backend (no network), to
//!   show the engine's own overhead.
//!
//! The five Redis implementations take turns, in several rounds, and each
//! figure is the median over the rounds; every ratio is the median of the
//! per-round ratios, so slow phases of a shared machine hit both sides alike.
//! After each window the implementation's lock keys must all be gone (see
//! [`BenchLock::leftovers`]); a lock that keeps them fails the run.
//!
//! dlock's row carries the targets, each printed PASS or MISS:
//! throughput ≥ [`FLOOR_TARGET`] × the fenced floor at every concurrency;
//! Redis CPU per cycle ≤ [`CPU_VS_FLOOR_TARGET`] × the floor's and
//! throughput ≥ [`PEER_TARGET`] × the peer at c ≥ 16; throughput ≥
//! [`STRETCH_TARGET`] × the bare baseline at c = 256 (a stretch goal). The
//! bare baseline is no target below that: a lock with fencing tokens cannot
//! be held to a lock without them, which is what the floor is for.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dlock_core::{Locker, MemoryBackend};

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::{BenchLock, DlockLock, RawLock};
use crate::measure::{median, run_window, CommandCounter, Counting, Sample, Timing};
use crate::peer::PeerLock;
use crate::report::Row;
use crate::series::{target, Series};

/// The concurrencies measured.
pub(crate) const CONCURRENCY: &[usize] = &[1, 16, 256];

/// Throughput dlock should reach relative to the bare baseline at c = 256.
pub(crate) const STRETCH_TARGET: f64 = 1.0;

/// Throughput dlock must reach relative to the fenced floor.
pub(crate) const FLOOR_TARGET: f64 = 0.95;

/// Redis CPU per dlock cycle at most this times the floor's (c ≥ 16, where
/// the one Redis is the bottleneck).
pub(crate) const CPU_VS_FLOOR_TARGET: f64 = 1.2;

/// Throughput dlock must reach relative to the Redisson-semantics peer (c ≥ 16).
pub(crate) const PEER_TARGET: f64 = 1.3;

pub(crate) const TITLE: &str =
    "uncontended acquire+release (each task its own key, fixed lease, wait 0; ops = cycles/s, latency = one cycle, \
     srv/acq = server commands per cycle, srv us = Redis CPU per cycle, cli us = this process's CPU per cycle; \
     ratio = vs baseline)";

/// The Redis implementations, in the order a round's turns rotate through.
const IMPLS: [&str; 5] = ["dlock", "baseline", "fenced-floor", "redisson-peer", "clock-floor"];

/// Per-round ratios of one concurrency.
#[derive(Default)]
struct Ratios {
    dlock_vs_base: Vec<f64>,
    floor_vs_base: Vec<f64>,
    peer_vs_base: Vec<f64>,
    dlock_vs_floor: Vec<f64>,
    dlock_vs_clock_floor: Vec<f64>,
    clock_floor_vs_base: Vec<f64>,
    dlock_vs_peer: Vec<f64>,
    cpu_vs_floor: Vec<f64>,
}

fn push_ratio(to: &mut Vec<f64>, num: f64, den: f64) {
    if den > 0.0 && num.is_finite() {
        to.push(num / den);
    }
}

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration };
    // The in-process engine is fast and steady; a shorter window suffices.
    let memory_timing = Timing { warmup: args.warmup / 4, duration: args.duration / 4 };
    let mut series: Vec<[Series; 5]> =
        CONCURRENCY.iter().map(|&c| IMPLS.map(|imp| Series::new("uncontended", imp, "redis", c))).collect();
    let mut memory: Vec<Series> =
        CONCURRENCY.iter().map(|&c| Series::new("uncontended", "dlock", "memory", c)).collect();
    let mut ratios: Vec<Ratios> = CONCURRENCY.iter().map(|_| Ratios::default()).collect();
    let rounds = args.uncontended_rounds;
    for round in 0..rounds {
        for (ci, &c) in CONCURRENCY.iter().enumerate() {
            let name = format!("u-r{round}-c{c}");
            let mut got: [Option<Sample>; 5] = [None, None, None, None, None];
            // Rotate who goes first, so none always runs on a warmer server.
            for turn in 0..IMPLS.len() {
                let i = (round + ci + turn) % IMPLS.len();
                let keys = format!("{}:{name}-{}", env.prefix, IMPLS[i]);
                let sample = match i {
                    0 => {
                        let lock = DlockLock::new(env.redis_locker.clone(), &format!("{name}-dlock"), c)?;
                        measure_redis(env, lock, c, timing).await?
                    }
                    1 => measure_redis(env, RawLock::try_once(env.conn.clone(), &keys, c)?, c, timing).await?,
                    2 => measure_redis(env, RawLock::fenced_try_once(env.conn.clone(), &keys, c)?, c, timing).await?,
                    3 => measure_redis(env, PeerLock::try_once(env.conn.clone(), &keys, c)?, c, timing).await?,
                    _ => {
                        let lock = RawLock::fenced_clock_try_once(env.conn.clone(), &keys, c)?;
                        measure_redis(env, lock, c, timing).await?
                    }
                };
                got[i] = Some(sample);
            }
            let [Some(d), Some(b), Some(f), Some(p), Some(t)] = got else {
                return Err(BenchError::Invariant("a round skipped an implementation".into()));
            };
            let r = &mut ratios[ci];
            push_ratio(&mut r.dlock_vs_base, d.ops_per_sec, b.ops_per_sec);
            push_ratio(&mut r.floor_vs_base, f.ops_per_sec, b.ops_per_sec);
            push_ratio(&mut r.peer_vs_base, p.ops_per_sec, b.ops_per_sec);
            push_ratio(&mut r.dlock_vs_floor, d.ops_per_sec, f.ops_per_sec);
            push_ratio(&mut r.dlock_vs_peer, d.ops_per_sec, p.ops_per_sec);
            push_ratio(&mut r.dlock_vs_clock_floor, d.ops_per_sec, t.ops_per_sec);
            push_ratio(&mut r.clock_floor_vs_base, t.ops_per_sec, b.ops_per_sec);
            if let (Some(dc), Some(fc)) = (d.server_cpu_us_per_op, f.server_cpu_us_per_op) {
                push_ratio(&mut r.cpu_vs_floor, dc, fc);
            }
            for (s, sample) in series[ci].iter_mut().zip([d, b, f, p, t]) {
                s.samples.push(sample);
            }
            let mem_lock = DlockLock::new(Locker::new(MemoryBackend::new()), &name, c)?;
            memory[ci].samples.push(measure(mem_lock, c, memory_timing, None).await?);
        }
        eprintln!(
            "uncontended round {}/{rounds}: {} ops {}",
            round + 1,
            IMPLS.join("/"),
            CONCURRENCY
                .iter()
                .enumerate()
                .map(|(ci, c)| format!(
                    "c={c} {}",
                    series[ci]
                        .iter()
                        .map(|s| format!("{:.0}", s.samples.last().map_or(0.0, |x| x.ops_per_sec)))
                        .collect::<Vec<_>>()
                        .join("/")
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut rows = Vec::new();
    for (ci, &c) in CONCURRENCY.iter().enumerate() {
        let r = &ratios[ci];
        let med = |v: &Vec<f64>| median(v.iter().copied());
        let [d, b, f, p, t] = &series[ci];
        let mut d = d.row();
        let ratio = med(&r.dlock_vs_base).unwrap_or(0.0);
        d.ratio = Some(ratio);
        if c >= 256 {
            d.targets.push(target("ratio (stretch)", ratio, false, STRETCH_TARGET, ""));
        }
        d.vs_floor = med(&r.dlock_vs_floor);
        d.vs_clock_floor = med(&r.dlock_vs_clock_floor);
        d.targets.push(target("ops vs fenced-floor", d.vs_floor.unwrap_or(0.0), false, FLOOR_TARGET, ""));
        d.cpu_vs_floor = med(&r.cpu_vs_floor);
        d.vs_peer = med(&r.dlock_vs_peer);
        if c >= 16 {
            let cpu = d.cpu_vs_floor.unwrap_or(f64::INFINITY);
            d.targets.push(target("srv us vs fenced-floor", cpu, true, CPU_VS_FLOOR_TARGET, ""));
            d.targets.push(target("ops vs redisson-peer", d.vs_peer.unwrap_or(0.0), false, PEER_TARGET, ""));
        }
        rows.push(d);
        rows.push(b.row());
        let mut f = f.row();
        f.ratio = med(&r.floor_vs_base);
        rows.push(f);
        let mut p = p.row();
        p.ratio = med(&r.peer_vs_base);
        rows.push(p);
        let mut t = t.row();
        t.ratio = med(&r.clock_floor_vs_base);
        rows.push(t);
        rows.push(memory[ci].row());
    }
    Ok(rows)
}

/// [`measure`] on the bench's Redis with the command counter, then checks
/// that the lock left none of its keys behind.
pub(crate) async fn measure_redis<L: BenchLock>(
    env: &Env,
    lock: L,
    concurrency: usize,
    timing: Timing,
) -> Result<Sample> {
    let lock = Arc::new(lock);
    let sample = measure_shared(&lock, concurrency, timing, Some(&env.counter)).await?;
    let left = lock.leftovers(&env.conn).await?;
    if let Some(first) = left.first() {
        return Err(BenchError::Invariant(format!(
            "{} lock keys left after every hold was released at concurrency {concurrency} (e.g. `{first}`)",
            left.len()
        )));
    }
    Ok(sample)
}

/// One window of `concurrency` tasks, each cycling on its own slot.
pub(crate) async fn measure<L: BenchLock>(
    lock: L,
    concurrency: usize,
    timing: Timing,
    counter: Option<&CommandCounter>,
) -> Result<Sample> {
    measure_shared(&Arc::new(lock), concurrency, timing, counter).await
}

async fn measure_shared<L: BenchLock>(
    lock: &Arc<L>,
    concurrency: usize,
    timing: Timing,
    counter: Option<&CommandCounter>,
) -> Result<Sample> {
    let counting = counter.map(|counter| Counting {
        counter,
        script_internal: lock.script_internal_commands(),
        client_sent: lock.client_sent_script_commands(),
    });
    run_window(concurrency, timing, counting, |slot, clock, stop| {
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
