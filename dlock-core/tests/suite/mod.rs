//! The behavioural suite every lock backend must pass. Each backend's test
//! file implements [`Harness`] and expands [`backend_suite!`].

#![allow(dead_code)] // each test binary uses the parts its backend needs

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, Error, ForceUnlock, Listing, LockKey, Locker, LostReason, Owner};
use tokio::time::Instant;

pub(crate) mod primitives;

/// What the suite needs from a backend under test.
pub(crate) trait Harness: Send + Sync + 'static {
    /// A new client of the service: its own connections where the backend
    /// has any, the same shared state as every other client.
    fn client(&self) -> impl std::future::Future<Output = Locker> + Send;
    /// A backend on the same service as the clients', to speak to it past
    /// the engine (as another process would).
    fn backend(&self) -> impl std::future::Future<Output = Arc<dyn Backend>> + Send;
    /// Deletes the lock key on the service, bypassing the engine.
    fn delete_behind_back(&self, key: &LockKey) -> impl std::future::Future<Output = ()> + Send;
    /// How many lock keys (not fencing counters) the service still holds.
    fn lock_keys_left(&self) -> impl std::future::Future<Output = usize> + Send;
    /// How many acquires the service shows parked waiting for `key` (subscribed
    /// to its release, queued behind its holder, registered in the table),
    /// so a test can wait for a waiter to park instead of sleeping.
    fn parked(&self, key: &LockKey) -> impl std::future::Future<Output = usize> + Send;
    /// About how long one uncontended acquire takes; random cancellations
    /// are spread over twice that.
    fn typical_acquire(&self) -> Duration {
        Duration::from_millis(1)
    }
}

fn key(locker: &Locker, name: &str) -> LockKey {
    locker.key(name).part(1).build().expect("short key")
}

/// Waits until the service shows a waiter parked on `key`; panics after
/// 10 s. A wake-up test that released before its waiter parked would pass
/// without testing a wake-up.
pub(crate) async fn until_parked<H: Harness>(h: &H, key: &LockKey) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.parked(key).await == 0 {
        assert!(Instant::now() < deadline, "the waiter never parked on {key}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until the service holds no lock key: background releases of
/// dropped guards and late grants settle quickly; panics after 5 s.
pub(crate) async fn until_no_lock_keys<H: Harness>(h: &H) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = h.lock_keys_left().await;
        if left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{left} lock keys left behind");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn fixed(ms: u64) -> AcquireOptions {
    AcquireOptions::new().with_lease(Duration::from_millis(ms))
}

pub(crate) async fn try_once_is_busy_while_held<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "busy");
    let g = a.try_acquire(&k).await.expect("free key");
    let err = b.try_acquire(&k).await.expect_err("held key");
    assert!(matches!(err, Error::Busy { .. }), "{err:?}");
    assert!(g.release().await.expect("release"));
    b.try_acquire(&k).await.expect("free again").release().await.expect("release");
}

pub(crate) async fn wait_times_out<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "timeout");
    let g = a.acquire(&k, fixed(10_000)).await.expect("free key");
    let started = Instant::now();
    let err = b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_millis(150))).await.expect_err("held");
    let waited = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(waited >= Duration::from_millis(150), "gave up early: {waited:?}");
    assert!(waited < Duration::from_secs(3), "gave up late: {waited:?}");
    g.release().await.expect("release");
}

/// A waiter is woken by the release itself, not by the holder's TTL (which
/// here is 30 s) nor by a poll.
pub(crate) async fn waiter_wakes_on_release<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "wake");
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let g = a.acquire(&k, fixed(30_000)).await.expect("free key");
        let b2 = b.clone();
        let k2 = k.clone();
        let waiter = tokio::spawn(async move {
            let g = b2.acquire(&k2, AcquireOptions::new().with_wait(Duration::from_secs(10))).await;
            (Instant::now(), g)
        });
        until_parked(h, &k).await;
        let released_at = Instant::now();
        assert!(g.release().await.expect("release"));
        let (acquired_at, g2) = waiter.await.expect("waiter task");
        g2.expect("waiter acquires").release().await.expect("release");
        worst = worst.max(acquired_at - released_at);
    }
    eprintln!("release -> waiter acquired, worst of 5: {worst:?}");
    // Milliseconds in practice; the bound only has to rule out the 30 s TTL.
    assert!(worst < Duration::from_millis(500), "waiter woke late: {worst:?}");
}

pub(crate) async fn waiter_wakes_when_the_holders_lease_runs_out<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "ttl");
    let g = a.acquire(&k, fixed(300)).await.expect("free key");
    // The holder vanishes without releasing (as a crashed process would).
    std::mem::forget(g);
    let started = Instant::now();
    let g = b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(5))).await.expect("acquired after TTL");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(2), "{waited:?}");
    g.release().await.expect("release");
}

pub(crate) async fn release_tells_whether_we_still_held_it<H: Harness>(h: &H) {
    let a = h.client().await;
    let k = key(&a, "held");
    let g = a.acquire(&k, fixed(100)).await.expect("free key");
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(!g.release().await.expect("release"), "lease had run out");
    let g = a.acquire(&k, fixed(5_000)).await.expect("free key");
    assert!(g.release().await.expect("release"));
}

/// Compare-and-delete: a stranger can neither release nor extend our lock.
pub(crate) async fn only_the_owner_can_release_or_renew<H: Harness>(h: &H) {
    let a = h.client().await;
    let k = key(&a, "owner");
    let g = a.acquire(&k, fixed(10_000)).await.expect("free key");
    let stranger = Owner::random().expect("random");
    let backend = h.backend().await;
    assert_eq!(backend.release(&k, &stranger).await.expect("release"), dlock_core::backend::Release::NotHeld);
    assert_eq!(
        backend.renew(&k, &stranger, Duration::from_secs(60)).await.expect("renew"),
        dlock_core::backend::Renewal::Lost
    );
    assert!(a.try_acquire(&k).await.is_err(), "still held after a stranger's release");
    assert!(g.release().await.expect("release"));
}

pub(crate) async fn owner_tokens_are_128_bit_and_unique<H: Harness>(_h: &H) {
    let mut seen = HashSet::new();
    for _ in 0..10_000 {
        let o = Owner::random().expect("random");
        assert_eq!(o.as_str().len(), 32);
        assert!(o.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(seen.insert(o));
    }
}

pub(crate) async fn same_owner_reenters_and_frees_on_last_release<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "reentrant");
    let me = Owner::random().expect("random");
    let outer = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect("outer");
    let inner = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect("inner re-enters");
    assert_eq!(inner.fencing_token(), outer.fencing_token(), "a re-entry joins the same grant");
    assert!(b.try_acquire(&k).await.is_err(), "others are excluded");
    assert!(inner.release().await.expect("release inner"));
    assert!(b.try_acquire(&k).await.is_err(), "still held by the outer hold");
    assert!(outer.release().await.expect("release outer"));
    b.try_acquire(&k).await.expect("free after the last release").release().await.expect("release");
}

pub(crate) async fn fencing_tokens_strictly_increase_across_clients<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "fence");
    let mut last = 0;
    for i in 0..200 {
        let locker = if i % 2 == 0 { &a } else { &b };
        let g = locker.acquire(&k, fixed(5_000)).await.expect("free key");
        assert!(g.fencing_token() > last, "token {} after {last}", g.fencing_token());
        last = g.fencing_token();
        if i % 3 == 0 {
            drop(g); // a background release must not break monotonicity either
            tokio::time::sleep(Duration::from_millis(5)).await;
            let g =
                locker.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(2))).await.expect("after drop");
            assert!(g.fencing_token() > last);
            last = g.fencing_token();
            g.release().await.expect("release");
        } else {
            g.release().await.expect("release");
        }
    }
}

pub(crate) async fn fixed_lease_expiry_fires_lost<H: Harness>(h: &H) {
    let a = h.client().await;
    let k = key(&a, "expiry");
    let g = a.acquire(&k, fixed(200)).await.expect("free key");
    assert!(!g.is_lost());
    let started = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(3), g.lost()).await.expect("lost fires");
    assert_eq!(reason, LostReason::LeaseExpired);
    assert!(started.elapsed() < Duration::from_millis(1_000), "{:?}", started.elapsed());
    assert!(g.is_lost());
}

pub(crate) async fn watchdog_keeps_the_lock_past_its_lease<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "watchdog");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    tokio::time::sleep(Duration::from_millis(1_000)).await; // > 3 leases of 300 ms
    assert!(!g.is_lost(), "renewed");
    assert!(b.try_acquire(&k).await.is_err(), "still held");
    assert!(g.release().await.expect("release"));
    // The watchdog stopped with the release: a fixed-lease holder after us
    // loses its key when its own lease ends.
    let g2 = b.acquire(&k, fixed(200)).await.expect("free");
    std::mem::forget(g2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.try_acquire(&k).await.expect("nobody renewed it").release().await.expect("release");
}

pub(crate) async fn deleting_the_key_behind_the_guards_back_fires_lost<H: Harness>(h: &H) {
    let a = h.client().await;
    let k = key(&a, "stolen");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    h.delete_behind_back(&k).await;
    let reason = tokio::time::timeout(Duration::from_secs(3), g.lost()).await.expect("lost fires");
    assert_eq!(reason, LostReason::Stolen);
    assert!(!g.release().await.expect("release"), "it was not ours any more");
}

pub(crate) async fn dropping_a_guard_releases_it<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "drop");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    drop(g);
    let started = Instant::now();
    let g = b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(5))).await.expect("freed by drop");
    assert!(started.elapsed() < Duration::from_secs(1), "released by drop, not by the 300 ms lease chain");
    g.release().await.expect("release");
}

/// Cancel acquires at random points, thousands of times: no lock key may
/// be left and no renewal may keep running.
pub(crate) async fn cancelled_acquires_leave_nothing_behind<H: Harness>(h: &H, iterations: u64) {
    let lockers = [h.client().await, h.client().await];
    let keys: Vec<LockKey> = (0..4).map(|i| lockers[0].key("cancel").part(i).build().expect("key")).collect();
    let acquired = Arc::new(AtomicU64::new(0));
    let cancelled = Arc::new(AtomicU64::new(0));
    // Budgets around what an acquire really costs here and now, so a loaded
    // machine still sees both completed and cancelled acquires.
    let mut measured = h.typical_acquire();
    let probe = lockers[0].key("cancel-calibrate").part(0).build().expect("key");
    for _ in 0..5 {
        let started = Instant::now();
        lockers[0].try_acquire(&probe).await.expect("free").release().await.expect("release");
        measured = measured.max(started.elapsed());
    }
    let max_budget_us = 2 * measured.as_micros().max(1) as u64;
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let locker = lockers[(t % 2) as usize].clone();
        let keys = keys.clone();
        let (acquired, cancelled) = (acquired.clone(), cancelled.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
            for _ in 0..iterations / 8 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let k = &keys[(rng % 4) as usize];
                let opts = if rng & 16 == 0 { AcquireOptions::new() } else { fixed(2_000) };
                let opts = opts.with_wait(Duration::from_millis(3));
                let budget = Duration::from_micros(rng % max_budget_us);
                match tokio::time::timeout(budget, locker.acquire(k, opts)).await {
                    Ok(Ok(g)) => {
                        acquired.fetch_add(1, Ordering::Relaxed);
                        // Sometimes hold the key a while, so that other tasks
                        // find it held and wait: an in-process acquire of a free
                        // key never suspends, so only a wait can be cut short.
                        if rng & 96 == 0 {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        } else {
                            tokio::task::yield_now().await;
                        }
                        match rng % 3 {
                            0 => drop(g),
                            1 => drop(g.release().await),
                            _ => {
                                // Cancel the release too, mid-flight.
                                let budget = Duration::from_micros(rng % (max_budget_us / 4).max(1));
                                let _ = tokio::time::timeout(budget, g.release()).await;
                            }
                        }
                    }
                    Ok(Err(_)) => {}
                    Err(_) => {
                        cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let (acquired, cancelled) = (acquired.load(Ordering::Relaxed), cancelled.load(Ordering::Relaxed));
    eprintln!("{iterations} iterations: {acquired} acquired, {cancelled} cancelled mid-acquire");
    assert!(acquired > 0 && cancelled > 0, "the test must exercise both paths");
    until_no_lock_keys(h).await;
    // No orphan renewal: nothing re-creates or keeps a key alive afterwards.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.lock_keys_left().await, 0);
    for k in &keys {
        lockers[0].try_acquire(k).await.expect("every key is free").release().await.expect("release");
    }
}

/// 32 tasks over 2 clients, a non-atomic read-modify-write inside the lock.
pub(crate) async fn mutual_exclusion_under_contention<H: Harness>(h: &H) {
    const TASKS: u64 = 32;
    const PER_TASK: u64 = 64; // 2,048 acquisitions
    let lockers = [h.client().await, h.client().await];
    let k = key(&lockers[0], "counter");
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let locker = lockers[(t % 2) as usize].clone();
        let (k, counter) = (k.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..PER_TASK {
                let g = locker
                    .acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(60)))
                    .await
                    .expect("acquire within the wait");
                let read = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(read + 1, Ordering::SeqCst);
                assert!(g.release().await.expect("release"), "lost the lock mid-section");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(counter.load(Ordering::SeqCst), TASKS * PER_TASK, "lost updates: mutual exclusion broken");
}

/// Waiters of one process are woken one per release; the one that wins must
/// leave its own release announced, or the others sleep until the holder's
/// lease runs out. Here leases (60 s) outlast the wait (20 s), so a missed
/// wake-up fails an acquire.
pub(crate) async fn waiters_of_one_client_are_woken_in_turn<H: Harness>(h: &H) {
    const TASKS: u64 = 8;
    const PER_TASK: u64 = 16;
    let locker = h.client().await;
    let k = key(&locker, "in-turn");
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (locker, k, counter) = (locker.clone(), k.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..PER_TASK {
                let opts = fixed(60_000).with_wait(Duration::from_secs(20));
                let g = locker.acquire(&k, opts).await.expect("woken by a release within the wait");
                let read = counter.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(200)).await;
                counter.store(read + 1, Ordering::SeqCst);
                assert!(g.release().await.expect("release"));
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(counter.load(Ordering::SeqCst), TASKS * PER_TASK);
}

/// T3b: a holder that hangs while its process lives keeps its watchdog
/// renewing; `max_hold` bounds that. Renewed past its 300 ms lease until
/// then, the lock is free soon after, the stalled guard's lost signal says
/// why, and the next holder's fencing token is higher.
pub(crate) async fn max_hold_stops_the_watchdog<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "max-hold");
    let granted = Instant::now();
    let stalled = a
        .acquire(&k, AcquireOptions::new().with_watchdog().with_max_hold(Duration::from_millis(900)))
        .await
        .expect("free");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(b.try_acquire(&k).await.is_err(), "renewed past its lease before max_hold");
    let next =
        b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(10))).await.expect("free after max_hold");
    let held = granted.elapsed();
    assert!(held >= Duration::from_millis(900), "freed before max_hold: {held:?}");
    assert!(held < Duration::from_secs(5), "max_hold 900 ms + lease 300 ms, freed only after {held:?}");
    assert_eq!(stalled.lost().await, LostReason::MaxHoldExceeded);
    assert!(next.fencing_token() > stalled.fencing_token());
    assert!(!stalled.release().await.expect("release"), "the stalled guard no longer holds it");
    assert!(next.release().await.expect("release"));
}

/// Every watchdog-mode hold of an engine is renewed by one shared task, not
/// a task per guard: hundreds of holds stay renewed past several leases,
/// and the runtime carries no task per hold.
pub(crate) async fn one_watchdog_renews_every_hold<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    // A ZooKeeper renewal is a server round trip through a single session;
    // 200 of them every 100 ms do not fit the 300 ms lease on a loaded
    // 2-core machine beside the rest of the suite. A RedLock renewal is one
    // script call per node, not batched: 200 holds are 6,000 calls a second
    // on the three nodes, which missed the lease once on that machine.
    // PostgreSQL's renewals of 200 permits in one statement missed it twice
    // with another test binary beside it (scripts/parallel-tests.sh), never
    // alone, and of 100 once more; RedLock's 100 (as a semaphore of one)
    // missed it once so too. The property (one watchdog, no task per hold)
    // does not depend on the count.
    let holds: u64 = match a.backend_name() {
        "zookeeper" | "postgres" | "redlock" => 40,
        _ => 200,
    };
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();
    let mut guards = Vec::new();
    for i in 0..holds {
        let k = a.key("many").part(i).build().expect("short key");
        guards.push(a.acquire(&k, AcquireOptions::new()).await.expect("free key"));
    }
    // ZooKeeper keeps one task per hold, which ends its lease and watches
    // its node (its session is watched once for all of them).
    if a.backend_name() != "zookeeper" {
        // RedLock finishes the nodes it did not wait for on short-lived
        // tasks (each ends within the node timeout); what must not exist
        // is a task that lives as long as its hold.
        let settled = tokio::time::Instant::now() + Duration::from_millis(500);
        let mut extra = metrics.num_alive_tasks().saturating_sub(tasks_before);
        while extra >= 5 && tokio::time::Instant::now() < settled {
            tokio::time::sleep(Duration::from_millis(10)).await;
            extra = metrics.num_alive_tasks().saturating_sub(tasks_before);
        }
        assert!(extra < 5, "{extra} tasks for {holds} holds");
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await; // > 3 leases of 300 ms
    for g in &guards {
        assert!(!g.is_lost(), "{} renewed", g.key());
        assert!(b.try_acquire(g.key()).await.is_err(), "{} still held", g.key());
    }
    for g in guards {
        assert!(g.release().await.expect("release"));
    }
    assert_eq!(h.lock_keys_left().await, 0);
}

/// The shared watchdog task dies with the runtime that started it; the next
/// hold starts a new one on its own runtime instead of never being renewed.
pub(crate) async fn holds_outlive_the_runtime_that_started_the_watchdog<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "runtime-gone");
    let (other, k2) = (a.clone(), k.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let g = other.acquire(&k2, AcquireOptions::new()).await.expect("free key");
            assert!(g.release().await.expect("release"));
        });
        // Dropping the runtime drops the watchdog task it ran.
    })
    .join()
    .expect("the other runtime's thread");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    tokio::time::sleep(Duration::from_millis(1_000)).await; // > 3 leases of 300 ms
    assert!(!g.is_lost(), "renewed by a new watchdog task");
    assert!(b.try_acquire(&k).await.is_err(), "still held");
    assert!(g.release().await.expect("release"));
}

/// An operator sees who holds a key (its fencing token, its limit), finds
/// the key in a listing of its lock name, and frees it by force with a
/// reason: the waiter is let in with a greater token, and the freed guard
/// learns of its loss by its next renewal. Empty reasons and unknown
/// holders are refused; a free key has nobody to free.
pub(crate) async fn an_operator_sees_and_frees_a_stuck_holder<H: Harness>(h: &H) {
    let (a, b, op) = (h.client().await, h.client().await, h.client().await);
    let k = key(&a, "stuck");
    let stuck = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    let state = op.inspect(&k).await.expect("inspect");
    assert_eq!(state.holders.len(), 1, "{state:?}");
    let held = state.holders[0].clone();
    assert_eq!(state.limit(), Some(1), "{state:?}");
    // On RedLock the masters' tokens differ; the holder's is the highest of
    // the quorum that answered it first, at least the one shown.
    let floor_only = a.backend_name() == "redlock";
    let shows = |shown: u64, token: u64| if floor_only { shown <= token } else { shown == token };
    assert!(shows(held.fencing_token, stuck.fencing_token()), "{state:?}");
    let page = op.list(Listing::name("stuck")).await.expect("list");
    assert!(page.keys.contains(&k), "{page:?}");
    let bad = op.force_unlock(&k, ForceUnlock::all(" ")).await.expect_err("no reason");
    assert!(matches!(bad, Error::InvalidArgument { .. }), "{bad:?}");
    let bad = op.force_unlock(&k, ForceUnlock::holder("000000000000", "test")).await.expect_err("nobody");
    assert!(matches!(bad, Error::InvalidArgument { .. }), "{bad:?}");
    let wanted = k.clone();
    let waiter =
        tokio::spawn(async move { b.acquire(&wanted, AcquireOptions::new().with_wait(Duration::from_secs(10))).await });
    until_parked(h, &k).await;
    let freed = op.force_unlock(&k, ForceUnlock::all("test: the holder hung")).await.expect("forced");
    assert_eq!(freed.len(), 1);
    assert_eq!(freed[0].id(), held.id());
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is woken")
        .expect("waiter task")
        .expect("granted");
    assert!(next.fencing_token() > stuck.fencing_token(), "{} after {}", next.fencing_token(), stuck.fencing_token());
    tokio::time::timeout(Duration::from_secs(5), stuck.lost()).await.expect("the freed guard learns of it");
    assert!(!stuck.release().await.expect("release"), "it was not ours any more");
    let now = op.inspect(&k).await.expect("inspect");
    assert_eq!(now.holders.len(), 1, "{now:?}");
    assert!(shows(now.holders[0].fencing_token, next.fencing_token()), "{now:?}");
    assert!(now.holders[0].fencing_token > held.fencing_token, "{now:?}");
    assert!(next.release().await.expect("release"));
    assert!(op.force_unlock(&k, ForceUnlock::all("test: again")).await.expect("free key").is_empty());
}

/// A listing pages through every held key of a lock name, each page
/// bounded, and leaves out the keys of other names. A Redis page may hold
/// more than its limit (`SCAN`'s count is a hint: a keyspace being rehashed
/// gave all 7 keys of an earlier version of this test at once for a limit
/// of 3), so the keys are many and the bound is half of them.
pub(crate) async fn a_listing_pages_through_held_keys<H: Harness>(h: &H) {
    const KEYS: usize = 40;
    let a = h.client().await;
    let mut guards = Vec::new();
    let mut want = HashSet::new();
    for i in 0..KEYS as u64 {
        let k = a.key("listed").part(i).build().expect("key");
        guards.push(a.try_acquire(&k).await.expect("free key"));
        want.insert(k);
    }
    let other = a.key("listed-not").part(1).build().expect("key");
    guards.push(a.try_acquire(&other).await.expect("free key"));
    let (mut seen, mut listing, mut pages) = (HashSet::new(), Listing::name("listed").limit(3), 0);
    loop {
        let page = a.list(listing.clone()).await.expect("list");
        pages += 1;
        assert!(page.keys.len() < KEYS / 2 && pages < 100, "page {pages}: {page:?}");
        seen.extend(page.keys);
        match page.next {
            Some(next) => listing = listing.after(next),
            None => break,
        }
    }
    assert_eq!(seen, want);
    assert!(pages >= 3, "{KEYS} keys in pages of 3 came in {pages}");
    for g in guards {
        g.release().await.expect("release");
    }
}

/// Expands one `#[tokio::test]` per suite function for a harness.
#[macro_export]
macro_rules! backend_suite {
    ($make:expr) => {
        $crate::backend_suite!(@tests $make;
            try_once_is_busy_while_held,
            wait_times_out,
            waiter_wakes_on_release,
            waiter_wakes_when_the_holders_lease_runs_out,
            release_tells_whether_we_still_held_it,
            only_the_owner_can_release_or_renew,
            owner_tokens_are_128_bit_and_unique,
            same_owner_reenters_and_frees_on_last_release,
            fencing_tokens_strictly_increase_across_clients,
            fixed_lease_expiry_fires_lost,
            watchdog_keeps_the_lock_past_its_lease,
            deleting_the_key_behind_the_guards_back_fires_lost,
            dropping_a_guard_releases_it,
            mutual_exclusion_under_contention,
            waiters_of_one_client_are_woken_in_turn,
            max_hold_stops_the_watchdog,
            one_watchdog_renews_every_hold,
            holds_outlive_the_runtime_that_started_the_watchdog,
            an_operator_sees_and_frees_a_stuck_holder,
            a_listing_pages_through_held_keys,
        );
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn cancelled_acquires_leave_nothing_behind() {
            let h = $make.await;
            suite::cancelled_acquires_leave_nothing_behind(&h, 4_000).await;
        }
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let h = $make.await;
            suite::$name(&h).await;
        }
    )*};
}
