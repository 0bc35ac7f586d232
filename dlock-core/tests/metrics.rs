//! The `metrics` feature: after a known workload, the figures a recording
//! recorder holds are the workload's, on the in-process backend and on a
//! real redis-server; labels never carry a key's parts; a recorder that
//! panics loses its figures, never a lock.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, LockMode, Locker, LockerOptions, MemoryBackend};
use dlock_testing::metrics::{recording, Panicking, Recorded};
use dlock_testing::RedisServer;
use metrics::Unit;

fn acquire(name: &str, backend: &str, mode: &str, outcome: &str) -> String {
    format!("dlock.lock.acquire.duration{{dlock.backend={backend},dlock.lock.mode={mode},dlock.lock.name={name},dlock.outcome={outcome}}}")
}

fn per_lock(metric: &str, name: &str, backend: &str, mode: &str, extra: Option<&str>) -> String {
    let mut labels =
        vec![format!("dlock.backend={backend}"), format!("dlock.lock.mode={mode}"), format!("dlock.lock.name={name}")];
    labels.extend(extra.map(str::to_owned));
    labels.sort();
    format!("{metric}{{{}}}", labels.join(","))
}

/// The workload both backends run, and what it must have recorded. The
/// key's part `secret-7` must appear in no label.
async fn workload(locker: &Locker, backend: &str, recorded: &Recorded) {
    let key = locker.key("pay").part("secret-7").build().expect("key");
    for _ in 0..3 {
        locker.try_acquire(&key).await.expect("free").release().await.expect("release");
    }
    // Busy, then a wait that times out, then a wait given up by its caller.
    let held = locker.try_acquire(&key).await.expect("free");
    assert!(locker.try_acquire(&key).await.expect_err("held").is_contention());
    let wait = |ms| AcquireOptions::new().with_wait(Duration::from_millis(ms));
    let timed_out = locker.acquire(&key, wait(60)).await.expect_err("held");
    assert!(matches!(timed_out, dlock_core::Error::Timeout { .. }), "{timed_out}");
    let (given_up, waiting) = {
        let waiter = locker.acquire(&key, wait(5_000));
        tokio::pin!(waiter);
        let mut waiting = 0.0;
        let given_up = tokio::select! {
            _ = &mut waiter => false,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                waiting = recorded.gauge(&per_lock("dlock.lock.waiting", "pay", backend, "exclusive", None));
                true
            }
        };
        (given_up, waiting)
    };
    assert!(given_up, "the key is held: the waiter waits");
    assert_eq!(waiting, 1.0, "one acquire waited while it was held");
    assert_eq!(recorded.gauge(&per_lock("dlock.lock.held", "pay", backend, "exclusive", None)), 1.0);
    held.release().await.expect("release");
    // A fixed lease that runs out before its release: lost.
    let short = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_millis(40))).await.expect("free");
    tokio::time::sleep(Duration::from_millis(80)).await;
    drop(short.release().await);
    // A semaphore asked for with another limit than its holder's: refused.
    let permits = locker.key("export").part("secret-7").build().expect("key");
    let two = locker.acquire(&permits, AcquireOptions::new().with_mode(LockMode::permits(2))).await.expect("free");
    let three = locker.acquire(&permits, AcquireOptions::new().with_mode(LockMode::permits(3))).await;
    assert!(matches!(three, Err(dlock_core::Error::ModeConflict { .. })), "{three:?}");
    two.release().await.expect("release");
    // The releases of dropped guards and given-up waits settle in the background.
    tokio::time::sleep(Duration::from_millis(100)).await;

    assert_eq!(recorded.count(&acquire("pay", backend, "exclusive", "acquired")), 5);
    assert_eq!(recorded.count(&acquire("pay", backend, "exclusive", "busy")), 1);
    assert_eq!(recorded.count(&acquire("pay", backend, "exclusive", "timeout")), 1);
    assert_eq!(recorded.count(&acquire("pay", backend, "exclusive", "cancelled")), 1);
    assert_eq!(recorded.count(&acquire("export", backend, "semaphore", "acquired")), 1);
    assert_eq!(recorded.count(&acquire("export", backend, "semaphore", "refused")), 1);
    let timeout = recorded.values(&acquire("pay", backend, "exclusive", "timeout"));
    assert!(timeout[0] >= 0.055, "a timed-out acquire waited its 60 ms: {timeout:?}");
    assert_eq!(recorded.gauge(&per_lock("dlock.lock.waiting", "pay", backend, "exclusive", None)), 0.0);
    assert_eq!(recorded.gauge(&per_lock("dlock.lock.held", "pay", backend, "exclusive", None)), 0.0);
    assert_eq!(recorded.gauge(&per_lock("dlock.lock.held", "export", backend, "semaphore", None)), 0.0);
    let released = per_lock("dlock.lock.hold.duration", "pay", backend, "exclusive", Some("dlock.release=released"));
    let lost = per_lock("dlock.lock.hold.duration", "pay", backend, "exclusive", Some("dlock.release=lost"));
    assert_eq!((recorded.count(&released), recorded.count(&lost)), (4, 1));
    let held_long = recorded.values(&released).into_iter().fold(0.0, f64::max);
    assert!(held_long >= 0.1, "the held lock was held across the timed-out and given-up waits: {held_long}");
    let expired = per_lock("dlock.lock.lost", "pay", backend, "exclusive", Some("dlock.lost.reason=lease_expired"));
    assert_eq!(recorded.counter(&expired), 1);
    for series in recorded.series() {
        assert!(!series.contains("secret"), "a key's part in a label: {series}");
    }
}

fn memory_locker() -> Locker {
    Locker::new(MemoryBackend::new())
}

#[test]
fn the_in_process_backend_records_its_workload() {
    let recorded = Recorded::default();
    recording(&recorded, async {
        workload(&memory_locker(), "memory", &recorded).await;
    });
    let described = recorded.described();
    assert_eq!(described.get("dlock.lock.acquire.duration"), Some(&Some(Unit::Seconds)));
    assert_eq!(described.get("dlock.lock.held"), Some(&Some(Unit::Count)));
    assert_eq!(described.len(), 11, "{described:?}");
}

/// An idempotency store's usage against its caps, as gauges set when the
/// application asks (at each scrape).
#[test]
fn a_stores_usage_is_recorded_against_its_caps() {
    use dlock_core::idempotency::{
        Begin, ClaimTerms, IdempotencyLimits, IdempotencyStore, MemoryStore, StoredResponse,
    };
    let recorded = Recorded::default();
    recording(&recorded, async {
        let store = MemoryStore::new().with_limits(IdempotencyLimits::default().with_max_records(500));
        let terms = ClaimTerms::new(std::time::Duration::from_secs(10));
        for key in ["a", "b"] {
            let Begin::New(claim) = store.begin("alice", key, "fp", terms).await.expect("begin") else {
                panic!("a new key")
            };
            let answer = StoredResponse::new(200, vec![], vec![b'x'; 100]);
            assert!(store.complete(&claim, &answer).await.expect("complete"));
        }
        let usage = dlock_core::metrics::record_store_usage(&store).await.expect("usage");
        assert_eq!(usage.records, 2);
    });
    let gauge = |name: &str| recorded.gauge(&format!("{name}{{dlock.store=memory}}"));
    assert_eq!((gauge("dlock.idempotency.records"), gauge("dlock.idempotency.records.limit")), (2.0, 500.0));
    assert!(gauge("dlock.idempotency.bytes") > 200.0, "two answers of 100 bytes and their heads");
    assert!(gauge("dlock.idempotency.bytes.limit") > 0.0);
}

#[test]
fn redis_records_its_workload_its_requests_and_its_renewals() {
    let server = RedisServer::start();
    let recorded = Recorded::default();
    recording(&recorded, async {
        let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect to the test redis-server");
        let options = LockerOptions::default().with_watchdog_lease(Duration::from_millis(150));
        let locker = Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, options).expect("options");
        workload(&locker, "redis", &recorded).await;

        // Held across three renewals (every 50 ms), then taken away behind
        // its back: the next renewal finds it gone.
        let key = locker.key("pay").part("secret-8").build().expect("key");
        let guard = locker.try_acquire(&key).await.expect("free");
        tokio::time::sleep(Duration::from_millis(230)).await;
        let _: u64 = redis::cmd("DEL").arg(key.as_str()).query(&mut server.connection()).expect("DEL");
        assert_eq!(guard.lost().await, dlock_core::LostReason::Stolen);
        drop(guard);
        tokio::time::sleep(Duration::from_millis(50)).await;
    });
    let renewed = recorded.counter("dlock.lock.renewals{dlock.backend=redis,dlock.outcome=renewed}");
    assert!(renewed >= 3, "renewed {renewed} times, 230 ms of them one hold of a 150 ms lease");
    assert_eq!(recorded.counter("dlock.lock.renewals{dlock.backend=redis,dlock.outcome=lost}"), 1);
    let stolen = per_lock("dlock.lock.lost", "pay", "redis", "exclusive", Some("dlock.lost.reason=stolen"));
    assert_eq!(recorded.counter(&stolen), 1);
    let op = |op: &str| {
        recorded.count(&format!("dlock.backend.operation.duration{{dlock.backend=redis,dlock.operation={op}}}"))
    };
    // Acquires that reached the server: the workload's 9 (one answered on
    // the spot by nothing on Redis) and the last one.
    assert!(op("acquire") >= 9, "acquires sent: {}", op("acquire"));
    assert!(op("release") >= 6, "releases sent: {}", op("release"));
    assert!(op("renew") >= 3, "renewal batches sent: {}", op("renew"));
}

/// More lock names than [`dlock_core::metrics::MAX_LOCK_NAMES`] share one label.
#[test]
fn lock_names_past_the_bound_share_one_label() {
    let recorded = Recorded::default();
    recording(&recorded, async {
        let locker = memory_locker();
        for i in 0..dlock_core::metrics::MAX_LOCK_NAMES + 10 {
            let key = locker.key(&format!("name-{i}")).build().expect("key");
            locker.try_acquire(&key).await.expect("free").release().await.expect("release");
        }
    });
    let names: std::collections::BTreeSet<String> = recorded
        .series()
        .iter()
        .filter_map(|s| {
            s.split("dlock.lock.name=").nth(1).map(|rest| rest.split([',', '}']).next().unwrap_or("").to_owned())
        })
        .collect();
    assert_eq!(names.len(), dlock_core::metrics::MAX_LOCK_NAMES + 1, "the bound and `_other`");
    assert_eq!(recorded.count(&acquire("_other", "memory", "exclusive", "acquired")), 10);
}

#[test]
fn a_recorder_that_panics_loses_its_figures_not_the_lock() {
    let mut ok = false;
    recording(&Panicking, async {
        let locker = memory_locker();
        let key = locker.key("pay").part(1).build().expect("key");
        let guard = locker.try_acquire(&key).await.expect("free");
        assert!(locker.try_acquire(&key).await.expect_err("held").is_contention());
        assert!(guard.release().await.expect("release"));
        locker.try_acquire(&key).await.expect("free again").release().await.expect("release");
        ok = true;
    });
    assert!(ok, "the workload ran to its end");
}
