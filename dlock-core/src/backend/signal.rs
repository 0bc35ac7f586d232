//! [`LostSignal`]: whether a held lock may still be ours.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

use super::LostReason;

/// Watches one held lock without owning it: whether it may no longer be
/// ours, and why. Lost once reported gone ([`lose`](Self::lose)) or once
/// [`valid_until`](Self::valid_until) passed unrenewed. Cloning is one
/// reference count.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::{ForceUnlock, Locker, LostReason, MemoryBackend};
/// let locker = Locker::new(MemoryBackend::new());
/// let key = locker.key("report").part(7).build()?;
/// let guard = locker.try_acquire(&key).await?;
///
/// let signal = guard.lost_signal();
/// let watcher = tokio::spawn(async move { signal.lost().await });
///
/// locker.force_unlock(&key, ForceUnlock::all("stuck")).await?; // an operator takes the lock away
/// assert_eq!(watcher.await.expect("watcher"), LostReason::Stolen);
/// assert!(guard.is_lost());
/// # Ok(()) }
/// ```
///
/// A backend that learns of losses itself hands one back in its
/// [`Grant`](crate::backend::Grant) and calls [`lose`](Self::lose):
///
/// ```
/// use dlock_core::LostReason;
/// use dlock_core::backend::LostSignal;
/// use tokio::time::{Duration, Instant};
///
/// let signal = LostSignal::new(Instant::now() + Duration::from_secs(30));
/// assert!(!signal.is_lost());
/// assert!(signal.lose(LostReason::SessionExpired));
/// assert!(!signal.lose(LostReason::Stolen), "the first verdict stands");
/// assert_eq!(signal.reason(), Some(LostReason::SessionExpired));
/// ```
#[derive(Clone)]
pub struct LostSignal {
    inner: Arc<Inner>,
}

/// Lighter than a `watch` channel (`docs/performance.md`).
struct Inner {
    state: Mutex<Terms>,
    changed: Notify,
}

/// What a signal knows: until when the lock is ours, what it means when that
/// passes unrenewed, and the verdict once given (kept inline by the engine
/// until someone asks for the signal).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    valid_until: Instant,
    lost: Option<LostReason>,
    expiry: Expiry,
}

impl Terms {
    pub(crate) fn new(valid_until: Instant, expiry: Expiry) -> Self {
        Terms { valid_until, lost: None, expiry }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_some() || Instant::now() >= self.valid_until
    }

    pub(crate) fn reason(&self) -> Option<LostReason> {
        self.lost.or_else(|| (Instant::now() >= self.valid_until).then(|| self.expiry.reason(self.valid_until)))
    }

    /// See [`LostSignal::set_terms`].
    pub(crate) fn set_terms(&mut self, valid_until: Instant, expiry: Expiry) {
        self.valid_until = valid_until;
        self.expiry = expiry;
    }

    /// See [`LostSignal::lose`].
    pub(crate) fn lose(&mut self, reason: LostReason) -> bool {
        let first = self.lost.is_none();
        self.lost.get_or_insert(reason);
        first
    }

    /// See [`LostSignal::renewed`]; `false` when it changed nothing.
    pub(crate) fn renewed(&mut self, valid_until: Instant) -> bool {
        if self.lost.is_some() {
            return false;
        }
        if Instant::now() >= self.valid_until {
            self.lost = Some(self.expiry.reason(self.valid_until));
        } else {
            self.valid_until = valid_until;
        }
        true
    }
}

/// What it means when `valid_until` passes with no verdict: the reason the
/// signal then gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// A fixed lease ran out: [`LostReason::LeaseExpired`].
    Lease,
    /// A lease the watchdog renews: renewals failed, or `max_hold` stopped
    /// them at `renew_until`.
    Renewed { renew_until: Option<Instant> },
}

impl Expiry {
    pub(crate) fn reason(self, valid_until: Instant) -> LostReason {
        match self {
            Expiry::Lease => LostReason::LeaseExpired,
            Expiry::Renewed { renew_until } => renewed_lease_expired(renew_until, valid_until),
        }
    }
}

/// Why a renewed lease ran out: `max_hold` stopped the renewals (the lease
/// reached `renew_until`), or they failed.
pub(crate) fn renewed_lease_expired(renew_until: Option<Instant>, valid_until: Instant) -> LostReason {
    if renew_until.is_some_and(|until| valid_until >= until) {
        LostReason::MaxHoldExceeded
    } else {
        LostReason::RenewalFailed
    }
}

/// `valid_until` of a hold that has no lease: as far ahead as tokio's own
/// "never" (30 years).
pub(crate) fn never_after(now: Instant) -> Instant {
    now + std::time::Duration::from_secs(30 * 365 * 86_400)
}

impl std::fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("LostSignal").field("valid_until", &s.valid_until).field("lost", &s.lost).finish()
    }
}

impl LostSignal {
    /// A signal for a lock that is ours until `valid_until` unless renewed
    /// (then [`LostReason::LeaseExpired`]).
    pub fn new(valid_until: Instant) -> Self {
        Self::with_expiry(valid_until, Expiry::Lease)
    }

    /// A signal for a lock held until released
    /// ([`GrantLease::UntilReleased`](super::GrantLease::UntilReleased)):
    /// only [`lose`](Self::lose) ends it.
    pub fn until_released() -> Self {
        Self::new(never_after(Instant::now()))
    }

    pub(crate) fn with_expiry(valid_until: Instant, expiry: Expiry) -> Self {
        Self::from_terms(Terms::new(valid_until, expiry))
    }

    pub(crate) fn from_terms(terms: Terms) -> Self {
        LostSignal { inner: Arc::new(Inner { state: Mutex::new(terms), changed: Notify::new() }) }
    }

    /// Sets a grant's terms on the signal its backend made (only the engine
    /// knows whether it renews it). A verdict already given stands.
    pub(crate) fn set_terms(&self, valid_until: Instant, expiry: Expiry) {
        self.state().set_terms(valid_until, expiry);
        self.inner.changed.notify_waiters();
    }

    /// Until when the lock is certainly ours; a renewal moves it forward.
    pub fn valid_until(&self) -> Instant {
        self.state().valid_until
    }

    /// Whether the lock may no longer be ours: reported lost, or
    /// [`valid_until`](Self::valid_until) has passed.
    pub fn is_lost(&self) -> bool {
        let s = *self.state();
        s.is_lost()
    }

    /// Why the lock may no longer be ours, or `None` while it is.
    pub fn reason(&self) -> Option<LostReason> {
        let s = *self.state();
        s.reason()
    }

    /// Resolves when the lock may no longer be ours: a renewal found it gone
    /// or someone else's, renewals failed until the lease ran out, a fixed
    /// lease ran out, or the backend lost it (a session expired, a forced
    /// unlock). No later than another client could take the key, and never
    /// on a transient error that a later renewal repairs.
    ///
    /// # Cancellation safety
    ///
    /// Cancel-safe; call it as often as you like, from as many tasks.
    pub async fn lost(&self) -> LostReason {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read, so a change made after
            // the read wakes it.
            changed.as_mut().enable();
            let s = *self.state();
            if let Some(reason) = s.lost {
                return reason;
            }
            // Only a renewal moves `valid_until`, whatever the watchdog does.
            tokio::select! {
                _ = &mut changed => {}
                _ = sleep_until(s.valid_until) => return s.expiry.reason(s.valid_until),
            }
        }
    }

    /// Marks the lock lost and wakes every [`lost`](Self::lost); returns
    /// whether this verdict was the first (the first stands).
    pub fn lose(&self, reason: LostReason) -> bool {
        let first = self.state().lose(reason);
        self.inner.changed.notify_waiters();
        first
    }

    /// A renewal succeeded: the lock is now ours until `valid_until`. After
    /// a loss, or once `valid_until` passed, it changes nothing: a lock seen
    /// lost never comes back.
    pub fn renewed(&self, valid_until: Instant) {
        if self.state().renewed(valid_until) {
            self.inner.changed.notify_waiters();
        }
    }

    fn state(&self) -> MutexGuard<'_, Terms> {
        // Every update is one assignment: a poisoned lock is still right.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn an_unrenewed_lease_reports_why_it_ran_out() {
        let now = Instant::now();
        let fixed = LostSignal::new(now + Duration::from_secs(1));
        let renewed = LostSignal::with_expiry(now + Duration::from_secs(1), Expiry::Renewed { renew_until: None });
        let capped = LostSignal::with_expiry(
            now + Duration::from_secs(1),
            Expiry::Renewed { renew_until: Some(now + Duration::from_millis(500)) },
        );
        assert_eq!(fixed.reason(), None);
        assert_eq!(fixed.lost().await, LostReason::LeaseExpired);
        assert_eq!(renewed.lost().await, LostReason::RenewalFailed);
        assert_eq!(capped.lost().await, LostReason::MaxHoldExceeded);
        assert_eq!(capped.reason(), Some(LostReason::MaxHoldExceeded));
        assert!(fixed.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_moves_the_end_and_wakes_no_verdict() {
        let start = Instant::now();
        let signal = LostSignal::new(start + Duration::from_secs(1));
        let watcher = signal.clone();
        let waiting = tokio::spawn(async move { (watcher.lost().await, Instant::now()) });
        tokio::time::sleep(Duration::from_millis(500)).await;
        signal.renewed(start + Duration::from_secs(3));
        let (reason, at) = waiting.await.expect("watcher");
        assert_eq!(reason, LostReason::LeaseExpired);
        assert_eq!(at, start + Duration::from_secs(3));
        assert_eq!(signal.valid_until(), start + Duration::from_secs(3));
    }

    /// A renewal answered after the lease already ran out cannot bring the
    /// lock back: someone else may have been granted it meanwhile, and a
    /// guard that saw `is_lost()` once may have stopped its work.
    #[tokio::test(start_paused = true)]
    async fn a_late_renewal_does_not_resurrect_a_lost_lock() {
        let start = Instant::now();
        let signal = LostSignal::with_expiry(start + Duration::from_secs(1), Expiry::Renewed { renew_until: None });
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(signal.is_lost());
        signal.renewed(Instant::now() + Duration::from_secs(30));
        assert!(signal.is_lost(), "the first verdict stands");
        assert_eq!(signal.reason(), Some(LostReason::RenewalFailed));
        assert_eq!(signal.lost().await, LostReason::RenewalFailed);

        let stolen = LostSignal::new(start + Duration::from_secs(60));
        stolen.lose(LostReason::Stolen);
        stolen.renewed(Instant::now() + Duration::from_secs(90));
        assert_eq!(stolen.reason(), Some(LostReason::Stolen));
    }
}
