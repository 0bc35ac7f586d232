//! Contended handoff on one key, in strict-handoff mode.
//!
//! K tasks loop on the same key: acquire (waiting), hold, release. At every
//! release the other K-1 tasks are parked waiting:
//! * a holder keeps the lock until all K-1 others are inside their acquire
//!   call, and then for a *settle* time (1 ms by default, plus a random
//!   0–2 ms jitter) — a dlock waiter needs two round trips to park;
//! * a task that released competes again only once another task has taken
//!   the lock; otherwise its fresh first try would usually barge in ahead of
//!   the parked waiters.
//!
//! The latency runs from just before `release()` is called to the moment the
//! next task's acquire returns. Commands per acquisition are client commands
//! from `INFO commandstats`, counted between two moments when no command is
//! in flight (see [`measure`]).
//!
//! Implementations, all with a fixed lease:
//! * `dlock/redis` and `dlock/memory`: [`Locker::acquire`](dlock_core::Locker::acquire) with a wait;
//! * `poll-1ms/redis`: `SET NX PX`, sleeping 1 ms between attempts;
//! * `pubsub-naive/redis`: `SET NX PX`; one shared subscription, and every
//!   release wakes *every* local waiter, each of which retries.
//!
//! Because the holder waits for the settle time, throughput here says little;
//! the latency and the commands are the figures that matter.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Locker, MemoryBackend};
use tokio::sync::Notify;

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::{BenchLock, DlockLock, RawLock};
use crate::measure::{command_delta, run_window, CommandCounter, CommandStats, Counting, Sample, Timing};
use crate::report::Row;
use crate::series::{target, Series};

/// Numbers of contending tasks.
pub(crate) const CONTENDERS: &[usize] = &[2, 8, 32];

/// The poller baseline's interval.
const POLL_INTERVAL: Duration = Duration::from_millis(1);

pub(crate) const TITLE: &str = "contended handoff on one key (strict: each release goes to an already parked waiter; \
     ops = acquisitions/s, latency = release() called -> next acquire returned)";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Impl {
    DlockRedis,
    DlockMemory,
    Poll1ms,
    PubSubNaive,
}

const IMPLS: [Impl; 4] = [Impl::DlockRedis, Impl::DlockMemory, Impl::Poll1ms, Impl::PubSubNaive];

impl Impl {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Impl::DlockRedis => ("dlock", "redis"),
            Impl::DlockMemory => ("dlock", "memory"),
            Impl::Poll1ms => ("poll-1ms", "redis"),
            Impl::PubSubNaive => ("pubsub-naive", "redis"),
        }
    }
}

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration };
    let mut series: Vec<Vec<Series>> = IMPLS
        .iter()
        .map(|i| {
            let (imp, backend) = i.names();
            CONTENDERS.iter().map(|&k| Series::new("handoff", imp, backend, k)).collect()
        })
        .collect();
    let rounds = args.handoff_rounds;
    for round in 0..rounds {
        for (ki, &k) in CONTENDERS.iter().enumerate() {
            // Rotate the order so that no implementation always runs first.
            for n in 0..IMPLS.len() {
                let ii = (n + round + ki) % IMPLS.len();
                let name = format!("h-r{round}-k{k}-{}", IMPLS[ii].names().0);
                let counter = Some(&env.counter);
                let sample = match IMPLS[ii] {
                    Impl::DlockRedis => {
                        measure(DlockLock::new(env.redis_locker.clone(), &name, 1)?, k, args.settle, timing, counter)
                            .await?
                    }
                    Impl::DlockMemory => {
                        let lock = DlockLock::new(Locker::new(MemoryBackend::new()), &name, 1)?;
                        measure(lock, k, args.settle, timing, None).await?
                    }
                    Impl::Poll1ms => {
                        let lock = RawLock::poller(env.conn.clone(), &format!("{}:{name}", env.prefix), POLL_INTERVAL)?;
                        measure(lock, k, args.settle, timing, counter).await?
                    }
                    Impl::PubSubNaive => {
                        let lock =
                            RawLock::wake_all(&env.client, env.conn.clone(), &format!("{}:{name}", env.prefix)).await?;
                        measure(lock, k, args.settle, timing, counter).await?
                    }
                };
                series[ii][ki].samples.push(sample);
            }
        }
        eprintln!(
            "handoff round {}/{rounds}: dlock/redis p50 {}",
            round + 1,
            CONTENDERS
                .iter()
                .enumerate()
                .map(|(ki, k)| format!("K={k} {:.0} us", series[0][ki].samples.last().map_or(0.0, |s| s.p50_us)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut rows = Vec::new();
    for ki in 0..CONTENDERS.len() {
        for (imp, per_k) in IMPLS.iter().zip(&series) {
            let mut row = per_k[ki].row();
            if *imp == Impl::DlockRedis {
                match row.concurrency {
                    8 => row.targets.push(target("p50", row.p50_us, true, 250.0, " us")),
                    32 => {
                        row.targets.push(target("p50", row.p50_us, true, 400.0, " us"));
                        let cmds = row.cmds_per_acquisition.unwrap_or(f64::INFINITY);
                        row.targets.push(target("cmds/acq", cmds, true, 4.0, ""));
                    }
                    _ => {}
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// What the K tasks of one measurement share.
#[derive(Debug, Default)]
struct Shared {
    /// Tasks currently inside an acquire call.
    inside: AtomicUsize,
    /// Notified whenever a task enters acquire.
    entered: Notify,
    /// `Clock` time + 1 of the latest `release()` call; 0 when taken.
    released_at: AtomicU64,
    /// Notified whenever a task's acquire returned.
    taken: Notify,
    /// Acquisitions so far.
    acquisitions: AtomicU64,
}

/// Command counts at two quiet moments, with the acquisitions so far.
#[derive(Debug, Default)]
struct Quiet {
    first: Option<(CommandStats, u64)>,
    last: Option<(CommandStats, u64)>,
}

/// One window of K tasks handing one key around.
///
/// Commands are counted between two *quiet* moments rather than at the
/// window's edges, which cut through acquisitions: a holder about to release
/// with every other task parked knows that no command is in flight. The first
/// such holder after the warm-up reads the counts, and the first one after
/// the window (less a margin, so that one comes before the stop). Should a
/// window be too short for that, the counts at its edges are used.
pub(crate) async fn measure<L: BenchLock>(
    lock: L,
    k: usize,
    settle: Duration,
    timing: Timing,
    counter: Option<&CommandCounter>,
) -> Result<Sample> {
    let lock = Arc::new(lock);
    let shared = Arc::new(Shared::default());
    let internal = lock.script_internal_commands();
    let others = k.saturating_sub(1);
    let quiet = Arc::new(tokio::sync::Mutex::new(Quiet::default()));
    let first_mark = u64::try_from(timing.warmup.as_nanos()).unwrap_or(u64::MAX);
    let last_mark = first_mark
        .saturating_add(u64::try_from((timing.duration.saturating_sub(timing.duration / 10)).as_nanos()).unwrap_or(0));
    let counting = counter.map(|counter| Counting {
        counter,
        script_internal: internal,
        client_sent: lock.client_sent_script_commands(),
    });
    let mut sample = run_window(k, timing, counting, |task, clock, stop| {
        let (lock, shared, quiet, counter) = (lock.clone(), shared.clone(), quiet.clone(), counter.cloned());
        async move {
            let mut records = Vec::with_capacity(1024);
            let mut rng = XorShift::seeded(clock.now_ns() ^ (task as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            while !stop.load(Ordering::SeqCst) {
                shared.inside.fetch_add(1, Ordering::SeqCst);
                shared.entered.notify_waiters();
                let held = lock.acquire(0, true).await?;
                let acquired = clock.now_ns();
                shared.acquisitions.fetch_add(1, Ordering::SeqCst);
                shared.inside.fetch_sub(1, Ordering::SeqCst);
                let released = shared.released_at.swap(0, Ordering::SeqCst);
                shared.taken.notify_waiters();
                if released != 0 {
                    records.push((acquired, acquired.saturating_sub(released - 1)));
                }
                // Strict handoff: every other task must be waiting before we let go.
                let all_parked = loop {
                    let entered = shared.entered.notified();
                    tokio::pin!(entered);
                    entered.as_mut().enable();
                    if shared.inside.load(Ordering::SeqCst) >= others {
                        break true;
                    }
                    if stop.load(Ordering::SeqCst) {
                        break false;
                    }
                    // The stop flag is not a notification; look at it now and then.
                    let _ = tokio::time::timeout(Duration::from_millis(20), entered).await;
                };
                if !stop.load(Ordering::SeqCst) {
                    settle_off_the_tick(settle, &mut rng).await?;
                    if let (Some(counter), true) = (&counter, all_parked) {
                        let now = clock.now_ns();
                        let mut q = quiet.lock().await;
                        let done = shared.acquisitions.load(Ordering::SeqCst);
                        if q.first.is_none() && now >= first_mark {
                            q.first = Some((counter.snapshot().await?, done));
                        } else if q.first.is_some() && q.last.is_none() && now >= last_mark {
                            q.last = Some((counter.snapshot().await?, done));
                        }
                    }
                }
                let handed_over = shared.taken.notified();
                tokio::pin!(handed_over);
                handed_over.as_mut().enable();
                shared.released_at.store(clock.now_ns() + 1, Ordering::SeqCst);
                lock.release(held).await?;
                // No barging: compete again only once a parked waiter has
                // the lock, or this task's fresh first try would usually win.
                while shared.released_at.load(Ordering::SeqCst) != 0 && !stop.load(Ordering::SeqCst) {
                    let _ = tokio::time::timeout(Duration::from_millis(20), handed_over.as_mut()).await;
                    handed_over.set(shared.taken.notified());
                    handed_over.as_mut().enable();
                }
            }
            Ok(records)
        }
    })
    .await?;
    let q = quiet.lock().await;
    sample.cmds_per_op = match (&q.first, &q.last) {
        (Some((before, n0)), Some((after, n1))) if n1 > n0 => {
            let d = command_delta(before, after, internal);
            let n = (n1 - n0) as f64;
            Some((d.client as f64 / n, d.server as f64 / n))
        }
        _ => {
            if counter.is_some() {
                eprintln!(
                    "handoff K={k}: no two quiet moments in the window (too short or too slow); \
                     commands counted at the window's edges instead, within a few per cent"
                );
            }
            sample.cmds_per_op
        }
    };
    Ok(sample)
}

/// The random part of a holder's hold time.
///
/// A waiter that polls sleeps from the moment it entered acquire, and that
/// moment is also when the holder's settle time starts; with a fixed hold
/// the release would always fall at the same point of the poller's cycle. A
/// uniform jitter as long as the slowest poll cycle (a tokio `sleep(1 ms)`
/// ends on the runtime's 1 ms timer tick, so after a round trip the cycle is
/// up to 2 ms) puts the release at a random phase of it.
const JITTER: Duration = Duration::from_millis(2);

/// Sleeps `settle` plus a random `[0, JITTER)` on a blocking-pool thread.
///
/// A tokio sleep would end on the runtime's 1 ms timer tick — the very tick
/// on which every polling baseline's sleep ends — and so release just before
/// the pollers look, flattering them. An OS sleep ends at any point of the tick.
async fn settle_off_the_tick(settle: Duration, rng: &mut XorShift) -> Result<()> {
    let extra = Duration::from_nanos(rng.next() % u64::try_from(JITTER.as_nanos()).unwrap_or(u64::MAX));
    tokio::task::spawn_blocking(move || std::thread::sleep(settle + extra))
        .await
        .map_err(|e| BenchError::Invariant(format!("settle sleep failed: {e}")))
}

/// A tiny PRNG for settle jitter (not for anything secret).
#[derive(Debug)]
struct XorShift(u64);

impl XorShift {
    fn seeded(seed: u64) -> Self {
        XorShift(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
