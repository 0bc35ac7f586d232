//! `orphan-renewal`: cancelled acquires, dropped guards and aborted holder
//! tasks must leave no lock key behind and no renewal running.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::{AcquireOptions, Locker, LockerOptions};
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
    let lanes = 8u64;
    let mut handles = Vec::new();
    for lane in 0..lanes {
        let locker = locker.clone();
        handles.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ (lane << 32));
            let (mut cancelled, mut dropped, mut aborted, mut errors) = (0u64, 0u64, 0u64, 0u64);
            for _ in 0..cycles / lanes {
                let k = rng.below(16);
                let Ok(key) = locker.key("orphan").part(k).build() else {
                    errors += 1;
                    continue;
                };
                let opts = AcquireOptions::new().with_wait(Duration::from_millis(rng.below(5)));
                let cut = Duration::from_micros(rng.below(2000));
                match rng.below(4) {
                    0 => match tokio::time::timeout(cut, locker.acquire(&key, opts)).await {
                        Err(_) => cancelled += 1,
                        Ok(Ok(g)) => drop(g.release().await),
                        Ok(Err(_)) => {}
                    },
                    1 => {
                        if let Ok(g) = locker.acquire(&key, opts).await {
                            sleep(cut).await;
                            drop(g);
                            dropped += 1;
                        }
                    }
                    2 => {
                        let l = locker.clone();
                        let task = tokio::spawn(async move {
                            if let Ok(g) = l.acquire(&key, opts).await {
                                sleep(Duration::from_millis(50)).await;
                                drop(g.release().await);
                            }
                        });
                        sleep(cut).await;
                        task.abort();
                        aborted += 1;
                    }
                    _ => {
                        if let Ok(g) = locker.acquire(&key, opts).await {
                            drop(g.release().await);
                        }
                    }
                }
            }
            (cancelled, dropped, aborted, errors)
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
        let (c, d, a, e) = h.await.map_err(|e| e.to_string())?;
        r.faults += c + d + a;
        r.acq_failures += e;
    }
    r.operations = cycles;
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
    Ok(vec![r])
}
