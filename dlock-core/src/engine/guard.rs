//! [`LockGuard`]: a held lock, its fencing token, its watchdog and its
//! lost-lock signal.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::watchdog::{Filed, NewHold};
use super::Engine;
use crate::backend::signal::Expiry;
use crate::backend::{AcquireRequest, Grant, GrantLease, LostReason, LostSignal, Release};
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::Owner;

/// A held lock.
///
/// * [`fencing_token`](Self::fencing_token) is greater than that of every
///   earlier grant of the key: hand it to the storage you protect so it can
///   refuse writes from a holder whose lease already ran out.
/// * [`lost`](Self::lost) resolves when the lock may no longer be ours.
/// * [`release`](Self::release) gives it back and says whether we still held
///   it. Dropping an unreleased guard releases it in the background.
///
/// In watchdog mode the engine's watchdog renews the lease every lease/3
/// until the guard is released or dropped. A backend may grant a
/// watchdog-mode lock with no lease at all (the in-process backend does for
/// a lock taken on the spot): it is held until the guard lets it go, nothing
/// renews it, and [`valid_until`](Self::valid_until) is decades away.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::{Locker, MemoryBackend};
/// let locker = Locker::new(MemoryBackend::new());
/// let key = locker.key("stock").part("sku-1").build()?;
/// let guard = locker.try_acquire(&key).await?;
/// let token = guard.fencing_token();
/// tokio::select! {
///     _ = async { /* the protected work, writing with `token` */ } => {}
///     reason = guard.lost() => eprintln!("lock lost: {reason}"),
/// }
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    engine: Arc<Engine>,
    key: LockKey,
    owner: Owner,
    fencing_token: u64,
    watchdog: bool,
    state: LostSignal,
    /// The hold filed with the engine's watchdog (watchdog mode).
    renewals: Option<Filed>,
    /// The lease runs out by itself (`GrantLease::Until`): a failed release
    /// is retried until then. A lock held until released is not retried:
    /// nothing bounds the retries, and its backend frees it with the session.
    lease_ends: bool,
    released: bool,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("fencing_token", &self.fencing_token)
            .field("watchdog", &self.watchdog)
            .field("state", &self.state)
            .finish()
    }
}

impl LockGuard {
    /// The guard of a grant. A lease that runs until an instant is filed
    /// with the watchdog when `renewed`; one held until released has nothing
    /// to renew. The backend's own signal, when it gave one, is the guard's.
    pub(crate) fn start(
        engine: Arc<Engine>,
        req: AcquireRequest,
        grant: Grant,
        renewed: bool,
        max_hold: Option<Duration>,
    ) -> Self {
        let lease_ends = matches!(grant.lease, GrantLease::Until(_));
        let (state, renewals) = match grant.lease {
            GrantLease::Until(valid_until) => {
                // The backend measured `valid_until` from before its request
                // was sent: the grant is at least that old, and no clock
                // read is needed.
                let granted_at = valid_until.checked_sub(req.lease).unwrap_or_else(Instant::now);
                let renew_until = if renewed { max_hold.map(|m| granted_at + m) } else { None };
                let expiry = if renewed { Expiry::Renewed { renew_until } } else { Expiry::Lease };
                let state = match grant.lost {
                    Some(signal) => {
                        signal.set_terms(valid_until, expiry);
                        signal
                    }
                    None => LostSignal::with_expiry(valid_until, expiry),
                };
                let renewals = renewed.then(|| {
                    engine.watchdog.file(NewHold {
                        key: req.key.clone(),
                        owner: req.owner.clone(),
                        lease: req.lease,
                        renew_until,
                        valid_until,
                        granted_at,
                        state: state.clone(),
                    })
                });
                (state, renewals)
            }
            // Its `valid_until` is as far ahead as the backend made it; it
            // never passes, so how it would be explained does not matter.
            GrantLease::UntilReleased => (grant.lost.unwrap_or_else(LostSignal::until_released), None),
        };
        LockGuard {
            engine,
            key: req.key,
            owner: req.owner,
            fencing_token: grant.fencing_token,
            watchdog: renewed,
            state,
            renewals,
            lease_ends,
            released: false,
        }
    }

    /// The lock's key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Who holds it.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Greater than the token of every earlier grant of this key.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// Until when the lock is certainly ours (moves forward with each renewal).
    pub fn valid_until(&self) -> Instant {
        self.state.valid_until()
    }

    /// Whether the lock is in watchdog mode: kept for as long as the guard
    /// lives, its lease renewed by the engine's watchdog, or, where the
    /// backend granted it until released, with no lease to renew.
    pub fn is_watchdog(&self) -> bool {
        self.watchdog
    }

    /// Whether the lock may no longer be ours (see [`lost`](Self::lost)).
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }

    /// Resolves when the lock may no longer be ours: a renewal found the key
    /// gone or owned by someone else, renewals failed until the lease ran out,
    /// a fixed lease ran out, or the backend's session expired.
    ///
    /// It fires no later than the moment another client could take the key,
    /// and never on a transient error that a later renewal repairs.
    ///
    /// # Cancellation safety
    ///
    /// Cancel-safe; call it as often as you like.
    pub async fn lost(&self) -> LostReason {
        self.state.lost().await
    }

    /// A handle that watches this lock without owning it: hand it to the
    /// work the lock protects, which can then stop when the lock is lost,
    /// while the guard alone decides when to release.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use dlock_core::{Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let key = locker.key("export").part("daily").build()?;
    /// let guard = locker.try_acquire(&key).await?;
    /// let signal = guard.lost_signal();
    /// let work = tokio::spawn(async move {
    ///     tokio::select! {
    ///         _ = async { /* the protected work */ } => None,
    ///         reason = signal.lost() => Some(reason),
    ///     }
    /// });
    /// assert_eq!(work.await.expect("work"), None);
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn lost_signal(&self) -> LostSignal {
        self.state.clone()
    }

    /// Gives the lock back. Returns whether we still held it (`false`: the
    /// lease had run out or someone else holds the key now).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the service cannot be
    /// reached. The release is then retried in the background (with a
    /// backoff, until it goes through, the service says the lock is no longer
    /// ours, or the lease runs out), so a short outage does not keep the key
    /// held for the rest of a long lease.
    pub async fn release(mut self) -> Result<bool> {
        self.released = true;
        self.stop();
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let backend = &self.engine.backend;
        let result = match backend.release_now(&self.key, &self.owner) {
            Some(result) => result,
            None => backend.release(&self.key, &self.owner).await,
        };
        match &result {
            Ok(r) => {
                let took_us = started.map(|s| s.elapsed().as_micros() as u64);
                tracing::debug!(key = %self.key.log_id(), outcome = ?r, took_us, "dlock.release")
            }
            Err(e) => {
                let retried = self.retry_release(e);
                tracing::warn!(key = %self.key.log_id(), error = %e, retried, "dlock.release failed");
            }
        }
        result.map(|r| r != Release::NotHeld)
    }

    /// After a failed release: retries it in the background when the error
    /// says the service could not be reached and the lease bounds the
    /// retries. Returns whether it does.
    fn retry_release(&self, e: &crate::Error) -> bool {
        if !self.lease_ends || !e.is_unavailable() {
            return false;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let until = self.state.valid_until();
        runtime.spawn(retry_release(self.engine.clone(), self.key.clone(), self.owner.clone(), until));
        true
    }

    fn stop(&mut self) {
        if let Some(filed) = self.renewals.take() {
            self.engine.watchdog.unfile(filed);
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.stop();
        if let Some(result) = self.engine.backend.release_now(&self.key, &self.owner) {
            trace_dropped_release(&self.key, &result);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.key.log_id(), "lock guard dropped outside a tokio runtime; the lease frees it");
            return;
        };
        let engine = self.engine.clone();
        let key = self.key.clone();
        let owner = self.owner.clone();
        let until = self.lease_ends.then(|| self.state.valid_until());
        runtime.spawn(async move {
            let result = engine.backend.release(&key, &owner).await;
            trace_dropped_release(&key, &result);
            if let (Err(e), Some(until)) = (&result, until) {
                if e.is_unavailable() {
                    retry_release(engine, key, owner, until).await;
                }
            }
        });
    }
}

/// The first pause before a failed release is tried again; doubled up to
/// [`RELEASE_RETRY_MAX_DELAY`], so a service that is back is found within
/// half a second.
const RELEASE_RETRY_MIN_DELAY: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX_DELAY: Duration = Duration::from_millis(500);

/// Retries a release that could not reach the service, until it goes
/// through, the service answers otherwise (the lock is no longer ours, or
/// an error that a retry will not cure), or the lease ends at `until`:
/// after that the key is free by itself, and a retry could only find
/// someone else's lock (which the backend refuses to release).
async fn retry_release(engine: Arc<Engine>, key: LockKey, owner: Owner, until: Instant) {
    let mut delay = RELEASE_RETRY_MIN_DELAY;
    let mut attempts = 0u32;
    loop {
        if Instant::now() + delay >= until {
            tracing::warn!(key = %key.log_id(), attempts, "dlock.release not retried further: the lease ends");
            return;
        }
        tokio::time::sleep(delay).await;
        attempts += 1;
        match tokio::time::timeout_at(until, engine.backend.release(&key, &owner)).await {
            Err(_) => {
                tracing::warn!(key = %key.log_id(), attempts, "dlock.release not retried further: the lease ended");
                return;
            }
            Ok(Ok(outcome)) => {
                tracing::info!(key = %key.log_id(), attempts, outcome = ?outcome, "dlock.release retried");
                return;
            }
            Ok(Err(e)) if e.is_unavailable() => {
                tracing::debug!(key = %key.log_id(), attempts, error = %e, "dlock.release retry failed");
                delay = (delay * 2).min(RELEASE_RETRY_MAX_DELAY);
            }
            Ok(Err(e)) => {
                tracing::warn!(key = %key.log_id(), attempts, error = %e, "dlock.release retry refused; not retried");
                return;
            }
        }
    }
}

fn trace_dropped_release(key: &LockKey, result: &Result<Release>) {
    match result {
        Ok(r) => tracing::debug!(key = %key.log_id(), outcome = ?r, "dlock.release (guard dropped)"),
        Err(e) => {
            tracing::warn!(key = %key.log_id(), error = %e, "dlock.release after drop failed")
        }
    }
}
