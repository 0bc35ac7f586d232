//! Contended handoff on one key, in strict-handoff mode.
//!
//! K tasks loop on the same key: acquire (waiting), hold, release, and — so
//! that it cannot barge in before a parked waiter — wait until another task
//! has taken the lock before competing again. A holder
//! keeps the lock until all K-1 other tasks are inside their acquire call,
//! and then for a further *settle* time (1 ms by default, plus a random
//! 0–2 ms jitter; a dlock waiter needs two round trips to park), so every release is picked up by a task that was
//! already parked waiting. The latency is from just before `release()` is
//! called to the moment the next task's acquire returns; commands per
//! acquisition come from `INFO commandstats` over the window.
//!
//! Implementations, all with a fixed lease:
//! * `dlock/redis` and `dlock/memory`: [`Locker::acquire`](dlock_core::Locker::acquire) with a wait;
//! * `poll-1ms/redis`: `SET NX PX`, sleeping 1 ms between attempts;
//! * `pubsub-naive/redis`: `SET NX PX`; every release is published and wakes
//!   *every* local waiter, and each one retries.
//!
//! Because the holder waits for the settle time, throughput here says little;
//! the latency and the commands are the figures that matter.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Locker, MemoryBackend};
use tokio::sync::Notify;

use super::args::Args;
use super::locks::{BenchLock, DlockLock, RawLock};
use super::measure::{run_window, CommandCounter, Sample, Timing};
use super::report::Row;
use super::{target, BenchError, Env, Result, Series};

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
                        let lock = RawLock::wake_all(&env.client, env.conn.clone(), &format!("{}:{name}", env.prefix))
                            .await?;
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
        for (ii, imp) in IMPLS.iter().enumerate() {
            let mut row = series[ii][ki].row();
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
}

/// One window of K tasks handing one key around.
async fn measure<L: BenchLock>(
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
    run_window(k, timing, counter.map(|c| (c, internal)), |task, clock, stop| {
        let (lock, shared) = (lock.clone(), shared.clone());
        async move {
            let mut records = Vec::with_capacity(1024);
            let mut rng = XorShift::seeded(clock.now_ns() ^ (task as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            while !stop.load(Ordering::SeqCst) {
                shared.inside.fetch_add(1, Ordering::SeqCst);
                shared.entered.notify_waiters();
                let held = lock.acquire(0, true).await?;
                let acquired = clock.now_ns();
                shared.inside.fetch_sub(1, Ordering::SeqCst);
                let released = shared.released_at.swap(0, Ordering::SeqCst);
                shared.taken.notify_waiters();
                if released != 0 {
                    records.push((acquired, acquired.saturating_sub(released - 1)));
                }
                // Strict handoff: every other task must be waiting before we let go.
                loop {
                    let entered = shared.entered.notified();
                    tokio::pin!(entered);
                    entered.as_mut().enable();
                    if shared.inside.load(Ordering::SeqCst) >= others || stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // The stop flag is not a notification; look at it now and then.
                    let _ = tokio::time::timeout(Duration::from_millis(20), entered).await;
                }
                if !stop.load(Ordering::SeqCst) {
                    settle_off_the_tick(settle, &mut rng).await?;
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
    .await
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
