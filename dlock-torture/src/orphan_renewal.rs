//! `orphan-renewal`: cancelled acquires, dropped guards and aborted holder
//! tasks must leave no lock key behind and no renewal running.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::{AcquireOptions, LockGuard, Locker, LockerOptions};
use dlock_testing::RedisServer;
use tokio::time::sleep;

use crate::harness::Report;
use crate::rng::Rng;
use crate::scenario::{residue, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let lock = RedisServer::start();
    let lease = Duration::from_millis(300);
    let backend = RedisBackend::connect(&lock.url(), "torture").await.map_err(|e| e.to_string())?;
    let locker = Locker::with_options(
        Arc::new(backend),
        LockerOptions::default().with_prefix("torture").with_watchdog_lease(lease),
    )
    .map_err(|e| e.to_string())?;
    let cycles = size.pick(1500u64, 20_000);
    // More lanes than the 16 operations a process sends alone: the rest
    // queue, and the coalescer's batches (and their cancellations) run.
    let lanes = 32u64;
    let tally = Arc::new(Tally::default());
    let mut handles = Vec::new();
    for lane in 0..lanes {
        let (locker, tally) = (locker.clone(), tally.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ (lane << 32));
            for _ in 0..cycles / lanes {
                let k = rng.below(16);
                let key = match locker.key("orphan").part(k).build() {
                    Ok(key) => key,
                    Err(e) => {
                        tally.error(format!("key: {e}"));
                        continue;
                    }
                };
                let opts = AcquireOptions::new().with_wait(Duration::from_millis(rng.below(5)));
                let cut = Duration::from_micros(rng.below(2000));
                match rng.below(4) {
                    0 => match tokio::time::timeout(cut, locker.acquire(&key, opts)).await {
                        Err(_) => tally.faults.fetch_add(1, Ordering::Relaxed),
                        Ok(got) => {
                            if let Some(g) = tally.granted(got) {
                                tally.released(g.release().await);
                            }
                            0
                        }
                    },
                    1 => {
                        if let Some(g) = tally.granted(locker.acquire(&key, opts).await) {
                            sleep(cut).await;
                            drop(g);
                            tally.faults.fetch_add(1, Ordering::Relaxed);
                        }
                        0
                    }
                    2 => {
                        let (l, t) = (locker.clone(), tally.clone());
                        let task = tokio::spawn(async move {
                            if let Some(g) = t.granted(l.acquire(&key, opts).await) {
                                sleep(Duration::from_millis(50)).await;
                                t.released(g.release().await);
                            }
                        });
                        sleep(cut).await;
                        task.abort();
                        tally.faults.fetch_add(1, Ordering::Relaxed)
                    }
                    _ => {
                        if let Some(g) = tally.granted(locker.acquire(&key, opts).await) {
                            tally.released(g.release().await);
                        }
                        0
                    }
                };
            }
        }));
    }
    let mut r = Report::new("orphan-renewal", "redis", seed);
    r.expected_safe = true;
    r.keys = 16;
    r.tasks = lanes as u32;
    r.processes = 1;
    r.lease_ms = 300;
    r.fault_kind = "cancelled acquires, dropped guards, aborted holder tasks".into();
    for h in handles {
        h.await.map_err(|e| e.to_string())?;
    }
    // Aborted holder tasks are gone; counts are final.
    r.operations = tally.acquired.load(Ordering::Relaxed);
    r.faults = tally.faults.load(Ordering::Relaxed);
    r.acq_failures = tally.contended.load(Ordering::Relaxed);
    let errors = tally.errors.load(Ordering::Relaxed);
    r.note(format!(
        "{cycles} cycles: {} grants, {} acquires that found the key held, {} cancellations/drops/aborts, {errors} errors",
        r.operations, r.acq_failures, r.faults
    ));
    // Each cycle sends one acquire, each grant one release: fewer script
    // calls than that means the queued path carried some in batches.
    let calls = tokio::task::block_in_place(|| lock.command_calls("evalsha") + lock.command_calls("eval"));
    let sent = cycles + r.operations;
    r.note(format!("lock script calls {calls} for about {sent} acquires and releases ({lanes} lanes)"));
    // Sent one by one, with the renewals on top, the calls are more than
    // the operations (8 lanes: 3219 calls for 2755).
    if calls >= sent {
        r.fail(format!("{calls} script calls for {sent} lock operations: the coalescer's queued path did not run"));
    }
    if errors > 0 {
        let first = tally.first_error.lock().map(|e| e.clone()).unwrap_or_default();
        r.fail(format!("{errors} acquire or release error(s) with no fault to excuse them, first: {first}"));
    }
    // Background releases of dropped guards are in flight; then two PTTL
    // samples 2 × renew interval apart: a refreshed key is an orphan renewal.
    sleep(Duration::from_millis(100)).await;
    let (left_now, refreshed) = residue(&lock.url(), lease / 3).await?;
    sleep(lease).await;
    let (left, _) = residue(&lock.url(), Duration::ZERO).await?;
    r.residual_keys = Some(left);
    r.refreshed_keys = Some(refreshed);
    r.note(format!("keys left 100 ms after the run: {left_now}; after one more lease: {left}"));
    if refreshed > 0 || left > 0 {
        r.fail("orphaned lock keys or a renewal still running");
    }
    // A grant leaked until its lease ran out is gone after one more lease:
    // only the count 100 ms after the run shows it.
    if left_now > 0 {
        r.fail(format!("{left_now} lock key(s) still there 100 ms after the run (leaked until their lease ends)"));
    }
    Ok(vec![r])
}

/// What the lanes did: grants (the operations), acquires answered "held",
/// cancellations, and errors, which nothing here excuses.
#[derive(Debug, Default)]
struct Tally {
    acquired: AtomicU64,
    contended: AtomicU64,
    faults: AtomicU64,
    errors: AtomicU64,
    first_error: Mutex<String>,
}

impl Tally {
    /// Counts an acquire's answer; the guard when it was a grant.
    fn granted(&self, got: Result<LockGuard, dlock_core::Error>) -> Option<LockGuard> {
        match got {
            Ok(g) => {
                self.acquired.fetch_add(1, Ordering::Relaxed);
                Some(g)
            }
            Err(e) if e.is_contention() => {
                self.contended.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => {
                self.error(format!("acquire: {e}"));
                None
            }
        }
    }

    fn released(&self, got: Result<bool, dlock_core::Error>) {
        if let Err(e) = got {
            self.error(format!("release: {e}"));
        }
    }

    fn error(&self, what: String) {
        if self.errors.fetch_add(1, Ordering::Relaxed) == 0
            && let Ok(mut first) = self.first_error.lock()
        {
            *first = what;
        }
    }
}
