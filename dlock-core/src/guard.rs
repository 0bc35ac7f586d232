//! [`LockGuard`]: a held lock, its fencing token, its watchdog and its
//! lost-lock signal.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};

use crate::backend::{AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, LostReason, Release, Renewal};
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::Owner;

#[derive(Debug, Clone, Copy)]
struct GuardState {
    valid_until: Instant,
    lost: Option<LostReason>,
}

/// A held lock.
///
/// * [`fencing_token`](Self::fencing_token) is greater than that of every
///   earlier grant of the key: hand it to the storage you protect so it can
///   refuse writes from a holder whose lease already ran out.
/// * [`lost`](Self::lost) resolves when the lock may no longer be ours.
/// * [`release`](Self::release) gives it back and says whether we still held
///   it. Dropping an unreleased guard releases it in the background.
///
/// In watchdog mode a task renews the lease every lease/3 until the guard is
/// released or dropped.
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
    backend: Arc<dyn Backend>,
    key: LockKey,
    owner: Owner,
    fencing_token: u64,
    watchdog: bool,
    state: watch::Receiver<GuardState>,
    /// Keeps the state channel open when no monitor task owns the sender.
    _state_tx: Option<watch::Sender<GuardState>>,
    stop_monitor: Option<CancellationToken>,
    released: bool,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("fencing_token", &self.fencing_token)
            .field("watchdog", &self.watchdog)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl LockGuard {
    pub(crate) fn start(
        backend: Arc<dyn Backend>,
        req: AcquireRequest,
        grant: Grant,
        watchdog: bool,
        max_hold: Option<Duration>,
    ) -> Self {
        let (tx, rx) = watch::channel(GuardState { valid_until: grant.valid_until, lost: None });
        let needs_monitor = watchdog || grant.lost.is_some();
        let (state_tx, stop_monitor) = if needs_monitor {
            let stop = CancellationToken::new();
            let monitor = Monitor {
                backend: backend.clone(),
                key: req.key.clone(),
                owner: req.owner.clone(),
                lease: req.lease,
                watchdog,
                renew_until: max_hold.map(|m| Instant::now() + m),
                state: tx,
                stop: stop.clone(),
            };
            tokio::spawn(monitor.run(grant.lost));
            (None, Some(stop))
        } else {
            (Some(tx), None)
        };
        LockGuard {
            backend,
            key: req.key,
            owner: req.owner,
            fencing_token: grant.fencing_token,
            watchdog,
            state: rx,
            _state_tx: state_tx,
            stop_monitor,
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
        self.state.borrow().valid_until
    }

    /// Whether the lease is renewed by a watchdog.
    pub fn is_watchdog(&self) -> bool {
        self.watchdog
    }

    /// Whether the lock may no longer be ours (see [`lost`](Self::lost)).
    pub fn is_lost(&self) -> bool {
        let s = *self.state.borrow();
        s.lost.is_some() || (!self.watchdog && Instant::now() >= s.valid_until)
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
        let mut rx = self.state.clone();
        loop {
            let s = *rx.borrow_and_update();
            if let Some(reason) = s.lost {
                return reason;
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() {
                    // The monitor ended without a verdict (it only does so when
                    // stopped); the lease is all we can still vouch for.
                    sleep_until(s.valid_until).await;
                    return LostReason::LeaseExpired;
                },
                _ = sleep_until(s.valid_until), if !self.watchdog => return LostReason::LeaseExpired,
            }
        }
    }

    /// Gives the lock back. Returns whether we still held it (`false`: the
    /// lease had run out or someone else holds the key now).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the service cannot be
    /// reached; the lease then frees the key when it runs out.
    pub async fn release(mut self) -> Result<bool> {
        self.released = true;
        self.stop();
        let started = Instant::now();
        let result = self.backend.release(&self.key, &self.owner).await;
        let took_us = started.elapsed().as_micros() as u64;
        match &result {
            Ok(r) => tracing::debug!(key = %self.key, outcome = ?r, took_us, "dlock.release"),
            Err(e) => tracing::warn!(key = %self.key, error = %e, took_us, "dlock.release failed"),
        }
        result.map(|r| r != Release::NotHeld)
    }

    fn stop(&mut self) {
        if let Some(stop) = self.stop_monitor.take() {
            stop.cancel();
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.stop();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.key, "lock guard dropped outside a tokio runtime; the lease frees it");
            return;
        };
        let backend = self.backend.clone();
        let key = self.key.clone();
        let owner = self.owner.clone();
        runtime.spawn(async move {
            match backend.release(&key, &owner).await {
                Ok(r) => tracing::debug!(key = %key, outcome = ?r, "dlock.release (guard dropped)"),
                Err(e) => tracing::warn!(key = %key, error = %e, "dlock.release after drop failed; the lease frees it"),
            }
        });
    }
}

/// The task that renews a watchdog lease and watches the backend's own
/// lost signal. It never outlives the guard: the guard cancels `stop` on
/// release and on drop.
struct Monitor {
    backend: Arc<dyn Backend>,
    key: LockKey,
    owner: Owner,
    lease: Duration,
    watchdog: bool,
    /// No renewal is sent at or after this instant (`max_hold`).
    renew_until: Option<Instant>,
    state: watch::Sender<GuardState>,
    stop: CancellationToken,
}

impl Monitor {
    async fn run(self, backend_lost: Option<BoxFuture<'static, LostReason>>) {
        let backend_lost = async move {
            match backend_lost {
                Some(f) => f.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(backend_lost);
        let interval = self.lease / 3;
        let mut next = Instant::now() + interval;
        loop {
            let valid_until = self.state.borrow().valid_until;
            let renewing = self.watchdog && self.renew_until.is_none_or(|until| next < until);
            let expiry = if self.watchdog { LostReason::MaxHoldExceeded } else { LostReason::LeaseExpired };
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                reason = &mut backend_lost => return self.lose(reason),
                _ = sleep_until(valid_until), if !renewing => return self.lose(expiry),
                _ = sleep_until(next), if renewing => {}
            }
            let sent = Instant::now();
            let renewal = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                reason = &mut backend_lost => return self.lose(reason),
                _ = sleep_until(valid_until) => return self.lose(LostReason::RenewalFailed),
                r = self.backend.renew(&self.key, &self.owner, self.lease) => r,
            };
            match renewal {
                Ok(Renewal::Held { valid_until }) => {
                    tracing::trace!(key = %self.key, took_us = sent.elapsed().as_micros() as u64, "dlock.renew");
                    // The backend measures from its own send; never extend past
                    // what our clock can vouch for.
                    let valid_until = valid_until.min(sent + self.lease);
                    self.state.send_modify(|s| s.valid_until = valid_until);
                    next = sent + interval;
                }
                Ok(Renewal::Lost) => return self.lose(LostReason::Stolen),
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "dlock.renew failed; retrying until the lease ends");
                    // Retry sooner than the regular interval, but no more than
                    // ten times per lease.
                    next = Instant::now() + (self.lease / 10).max(Duration::from_millis(1));
                }
            }
        }
    }

    fn lose(&self, reason: LostReason) {
        if self.stop.is_cancelled() {
            return;
        }
        tracing::warn!(key = %self.key, %reason, "dlock.lost");
        self.state.send_modify(|s| s.lost = Some(reason));
    }
}
