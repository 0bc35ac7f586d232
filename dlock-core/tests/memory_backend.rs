//! The behavioural suite on the in-process backend.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::Backend;
use dlock_core::{ForceUnlock, LockKey, Locker, LockerOptions, MemoryBackend};

struct Memory {
    backend: Arc<MemoryBackend>,
}

/// Every client of the in-process backend shares one table, as every task
/// of a process does.
impl suite::Harness for Memory {
    async fn client(&self) -> Locker {
        let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
        Locker::with_options(self.backend.clone() as Arc<dyn Backend>, opts).expect("valid options")
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        let locker = self.client().await;
        let freed = locker.force_unlock(key, ForceUnlock::all("test: behind the guard's back")).await.expect("forced");
        assert!(!freed.is_empty(), "the key was held");
    }

    async fn lock_keys_left(&self) -> usize {
        self.backend.len()
    }

    async fn parked(&self, key: &LockKey) -> usize {
        self.backend.waiters(key)
    }
}

async fn memory() -> Memory {
    Memory { backend: Arc::new(MemoryBackend::new()) }
}

backend_suite!(memory());
primitives_suite!(memory());
mod waiters {
    use super::*;
    primitives_suite!(@tests memory(); a_waiting_semaphore_keeps_its_limit_against_a_newcomer);
}

use dlock_core::{AcquireOptions, Error, LostReason, Owner};
use suite::Harness as _;

/// A watchdog-mode lock taken on the spot in process has no lease: nothing
/// renews it, it outlives many watchdog leases, and taking it away by force
/// tells its guard at once (a leased hold learns at its next renewal).
#[tokio::test]
async fn in_process_holds_need_no_renewal_and_learn_a_forced_unlock_at_once() {
    let m = memory().await;
    let (a, b) = (m.client().await, m.client().await);
    let k = a.key("until-released").build().expect("key");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free key");
    tokio::time::sleep(Duration::from_millis(700)).await; // > 2 watchdog leases of 300 ms
    assert!(!g.is_lost());
    assert!(b.try_acquire(&k).await.is_err(), "still held");
    assert!(g.valid_until() > tokio::time::Instant::now() + Duration::from_secs(3600), "no lease to run out");
    assert_eq!(b.force_unlock(&k, ForceUnlock::all("test")).await.expect("forced").len(), 1);
    let reason = tokio::time::timeout(Duration::from_millis(50), g.lost()).await.expect("told at once");
    assert_eq!(reason, LostReason::Stolen);
    assert!(!g.release().await.expect("release"), "it was not ours any more");
    assert_eq!(m.backend.len(), 0);
}

/// A re-entry of such a hold keeps its terms: when the first hold is given
/// back, the second still holds the key past any lease, until released.
#[tokio::test]
async fn a_reentered_in_process_hold_keeps_holding_until_released() {
    let m = memory().await;
    let (a, b) = (m.client().await, m.client().await);
    let k = a.key("reentered").build().expect("key");
    let owner = Owner::random().expect("owner");
    let first = a.acquire(&k, AcquireOptions::new().with_owner(owner.clone())).await.expect("free key");
    let second = a.acquire(&k, AcquireOptions::new().with_owner(owner)).await.expect("re-entry");
    assert_eq!(first.fencing_token(), second.fencing_token());
    assert!(first.release().await.expect("release"));
    tokio::time::sleep(Duration::from_millis(700)).await; // > 2 watchdog leases of 300 ms
    assert!(!second.is_lost());
    assert!(b.try_acquire(&k).await.is_err(), "still held by the re-entry");
    assert!(second.release().await.expect("release"));
    b.try_acquire(&k).await.expect("free after the last release").release().await.expect("release");
    assert_eq!(m.backend.len(), 0);
}

/// A zero lease is the caller's mistake, named as such: an invalid argument
/// (counted as misconfiguration), not a configuration variable.
#[tokio::test]
async fn a_zero_lease_is_an_invalid_argument() {
    let locker = Locker::new(MemoryBackend::new());
    let key = locker.key("zero").part(1).build().expect("key");
    let err = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::ZERO)).await.expect_err("zero lease");
    assert!(matches!(err, Error::InvalidArgument { name: "lease", .. }), "{err:?}");
    assert!(err.is_misconfigured() && !err.is_unavailable() && !err.is_contention());
}
