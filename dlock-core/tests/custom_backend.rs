//! A backend written as a third party would write it, against the public
//! seam only: the engine serves its holds held until released and watches
//! the lost signal it hands back, with no special case for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::LostSignal;
use dlock_core::backend::{AcquireRequest, Backend, BoxFuture, Grant, LockMode, Release, Renewal};
use dlock_core::{AcquireOptions, Error, LockKey, Locker, LockerOptions, LostReason, Owner, Result};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Grants each free key to one owner. A request that would keep the lock
/// until released gets no lease (it lives in this process); every other
/// gets its lease. The backend keeps every grant's signal and can take a
/// lock away from its holder, as an operator would.
#[derive(Debug, Default)]
struct Table {
    held: Mutex<HashMap<LockKey, (Owner, LostSignal)>>,
    fence: AtomicU64,
    renewals: AtomicUsize,
}

impl Table {
    fn take_away(&self, key: &LockKey) {
        let taken = self.held.lock().expect("not poisoned").remove(key);
        if let Some((_, signal)) = taken {
            signal.lose(LostReason::Stolen);
        }
    }

    fn attempt(&self, req: &AcquireRequest) -> Result<Grant> {
        if req.mode != LockMode::Exclusive {
            return Err(Error::invalid_argument("mode", "only exclusive locks"));
        }
        let mut held = self.held.lock().expect("not poisoned");
        if held.contains_key(&req.key) {
            return Err(Error::Busy { key: req.key.to_string() });
        }
        let fence = self.fence.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let grant =
            if req.until_released { Grant::until_released(fence) } else { Grant::until(fence, now + req.lease) };
        // One kind of signal for both: the engine sets its end from the
        // grant's lease.
        let signal = LostSignal::until_released();
        held.insert(req.key.clone(), (req.owner.clone(), signal.clone()));
        Ok(grant.with_lost_signal(signal))
    }
}

impl Backend for Table {
    fn name(&self) -> &'static str {
        "table"
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, _: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(async move { self.attempt(req) })
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        self.renewals.fetch_add(1, Ordering::Relaxed);
        let ours = self.held.lock().expect("not poisoned").get(key).is_some_and(|(o, _)| o == owner);
        Box::pin(
            async move { Ok(if ours { Renewal::Held { valid_until: Instant::now() + lease } } else { Renewal::Lost }) },
        )
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        let mut held = self.held.lock().expect("not poisoned");
        let release = match held.get(key) {
            Some((o, _)) if o == owner => {
                held.remove(key);
                Release::Freed
            }
            _ => Release::NotHeld,
        };
        Box::pin(std::future::ready(Ok(release)))
    }
}

fn locker(table: &Arc<Table>) -> Locker {
    let options = LockerOptions::default().with_watchdog_lease(Duration::from_millis(60));
    Locker::with_options(table.clone(), options).expect("valid options")
}

#[tokio::test]
async fn a_hold_until_released_is_never_renewed_and_learns_its_loss_from_the_backend() {
    let table = Arc::new(Table::default());
    let locker = locker(&table);
    let key = locker.key("custom").part(1).build().expect("key");
    let guard = locker.try_acquire(&key).await.expect("free");
    assert!(guard.valid_until() > Instant::now() + Duration::from_secs(3600), "no lease to run out");
    let watcher = guard.lost_signal();

    // Several watchdog periods: nothing to renew.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(table.renewals.load(Ordering::Relaxed), 0, "the watchdog was not asked to renew it");
    assert!(!guard.is_lost());

    table.take_away(&key);
    let reason = tokio::time::timeout(Duration::from_millis(100), guard.lost()).await.expect("told at once");
    assert_eq!(reason, LostReason::Stolen);
    assert_eq!(watcher.reason(), Some(LostReason::Stolen));
    assert!(watcher.is_lost());
    assert!(!guard.release().await.expect("release"), "it was not ours any more");
}

#[tokio::test]
async fn a_hold_until_an_instant_is_renewed_and_its_signal_carries_the_renewals() {
    let table = Arc::new(Table::default());
    let locker = locker(&table);
    let key = locker.key("custom").part(2).build().expect("key");
    // With a max_hold the guard may not keep the lock for ever: the request
    // does not ask to keep it until released, so the backend gives a lease.
    let guard = locker.acquire(&key, AcquireOptions::new().with_max_hold(Duration::from_secs(60))).await.expect("free");
    let first_end = guard.valid_until();
    assert!(first_end < Instant::now() + Duration::from_secs(1), "a lease of its own");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(table.renewals.load(Ordering::Relaxed) >= 2, "renewed every lease/3");
    assert!(!guard.is_lost(), "renewed in time");
    assert!(guard.lost_signal().valid_until() > first_end, "the backend's signal moved with the renewals");

    table.take_away(&key);
    let reason = tokio::time::timeout(Duration::from_millis(100), guard.lost()).await.expect("told at once");
    assert_eq!(reason, LostReason::Stolen);
}

#[tokio::test]
async fn a_fixed_lease_from_a_signalled_grant_expires_as_a_lease() {
    let table = Arc::new(Table::default());
    let locker = locker(&table);
    let key = locker.key("custom").part(3).build().expect("key");
    let guard = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_millis(50))).await.expect("free");
    assert!(guard.valid_until() <= Instant::now() + Duration::from_millis(50), "the grant's lease, not the signal's");
    let reason = tokio::time::timeout(Duration::from_secs(1), guard.lost()).await.expect("the lease runs out");
    assert_eq!(reason, LostReason::LeaseExpired);
    assert_eq!(table.renewals.load(Ordering::Relaxed), 0, "a fixed lease is not renewed");
}
