//! Tasks contend for one lock and do a deliberately non-atomic
//! read-modify-write of a shared counter; with the lock the count comes out
//! exact, without it updates are lost.
//!
//! ```sh
//! cargo run -p dlock-examples --bin contend            # in process
//! DLOCK_BACKEND=redis cargo run -p dlock-examples --bin contend
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_core::{AcquireOptions, Config, Locker};

const TASKS: u64 = 16;
const ROUNDS: u64 = 50;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let locker = Config::from_env()?.build().await?.locker().clone();
    println!("backend: {}", locker.backend_name());

    let started = Instant::now();
    let (count, first, last) = run(Some(locker)).await?;
    println!(
        "with the lock:    counter = {count} of {} in {:?}; fencing tokens {first}..={last}",
        TASKS * ROUNDS,
        started.elapsed()
    );
    let (count, _, _) = run(None).await?;
    println!("without the lock: counter = {count} of {} (lost updates: {})", TASKS * ROUNDS, TASKS * ROUNDS - count);
    Ok(())
}

/// Runs the workload; returns the counter and the lowest and highest fencing token seen.
async fn run(locker: Option<Locker>) -> Result<(u64, u64, u64), dlock_core::Error> {
    let counter = Arc::new(AtomicU64::new(0));
    let tokens = Arc::new((AtomicU64::new(u64::MAX), AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (locker, counter, tokens) = (locker.clone(), counter.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = match &locker {
                    Some(l) => {
                        let key = l.key("demo.counter").build()?;
                        let g = l.acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(30))).await?;
                        tokens.0.fetch_min(g.fencing_token(), Ordering::Relaxed);
                        tokens.1.fetch_max(g.fencing_token(), Ordering::Relaxed);
                        Some(g)
                    }
                    None => None,
                };
                let read = counter.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(200)).await;
                counter.store(read + 1, Ordering::SeqCst);
                if let Some(g) = guard {
                    g.release().await?;
                }
            }
            Ok::<(), dlock_core::Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| dlock_core::Error::backend("demo", format!("task failed: {e}")))??;
    }
    Ok((counter.load(Ordering::SeqCst), tokens.0.load(Ordering::Relaxed), tokens.1.load(Ordering::Relaxed)))
}
