//! Waiting for a lock, once for every backend: the event-driven wait loop
//! of the TTL backends (memory, Redis, RedLock, PostgreSQL) — try, and while
//! the key is held sleep until a release wakes us or the holder's lease
//! runs out, never on a fixed interval — and the acquires parked per key
//! with the one rule of whom a release wakes ([`Parked`], [`Waiters`]).

#[cfg(any(feature = "redis", feature = "postgres"))]
use std::collections::HashMap;
use std::future::Future;
#[cfg(any(feature = "redis", feature = "postgres"))]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
#[cfg(any(feature = "redis", feature = "postgres"))]
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{contention, AcquireRequest, Grant, LockMode};
use crate::error::{Error, Result};

/// The result of one atomic try.
#[derive(Debug)]
pub(crate) enum Attempt {
    Acquired(Grant),
    /// Held by someone else; the holder's lease ends in `retry_in` (`None`:
    /// unknown, wait for a release or the deadline).
    Held {
        retry_in: Option<Duration>,
    },
}

/// Waking a little after the holder's TTL ends avoids a try that would find
/// the key a microsecond before it expires.
const TTL_SLACK: Duration = Duration::from_millis(1);

/// Runs `attempt` until it acquires, the deadline passes or `cancel` fires.
///
/// `attempt(awaited)` tries once; `awaited` is true for the tries made after
/// subscribing: a backend that announces releases only when someone waits
/// marks the lock as awaited on such a try, held or granted (a grant, since
/// other waiters of this process may be parked behind it and will not try
/// again until they are woken).
///
/// `subscribe` is called once, only when the first try finds the key held and
/// the caller is willing to wait; what it returns must be notified (one
/// waiter per release is enough) whenever the key may have come free, for as
/// long as it lives. The try that follows a subscription covers a release
/// that happened before it.
///
/// `others_wait`: whether other tasks of this process already wait for the
/// key, so that it is almost surely held and its subscription live; asked
/// only of a caller willing to wait. Such a caller then subscribes first and
/// makes one (awaited) try instead of two: under contention a plain first
/// try is a round trip that only says "held".
pub(crate) async fn acquire_loop<O, A, AF, S, SF, W>(
    req: &AcquireRequest,
    cancel: &CancellationToken,
    others_wait: O,
    mut attempt: A,
    subscribe: S,
) -> Result<Grant>
where
    O: FnOnce() -> bool,
    A: FnMut(bool) -> AF,
    AF: Future<Output = Result<Attempt>>,
    S: FnOnce() -> SF,
    SF: Future<Output = W>,
    W: AsRef<Notify>,
{
    let subscribe_first = req.deadline.is_some() && others_wait();
    if !subscribe_first && let Attempt::Acquired(grant) = attempt(false).await? {
        return Ok(grant);
    }
    let Some(deadline) = req.deadline else {
        return Err(contention(req, Instant::now()));
    };
    // The clock is read only once there is a wait to time.
    let started = Instant::now();
    // Subscribing waits for the server's confirmation, which a slow server
    // may give late: it must not carry the wait past its deadline.
    let wakeups = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Err(Error::Cancelled),
        w = subscribe() => w,
        _ = tokio::time::sleep_until(deadline) => return Err(contention(req, started)),
    };
    loop {
        let notified = wakeups.as_ref().notified();
        tokio::pin!(notified);
        // Registered before the try, so a release between the try and the
        // sleep still wakes us.
        notified.as_mut().enable();
        let retry_in = match attempt(true).await? {
            Attempt::Acquired(grant) => return Ok(grant),
            Attempt::Held { retry_in } => retry_in,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(contention(req, started));
        }
        let wake_at = retry_in.map_or(deadline, |d| (now + d + TTL_SLACK).min(deadline));
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = &mut notified => {}
            _ = tokio::time::sleep_until(wake_at) => {
                if wake_at >= deadline {
                    return Err(contention(req, started));
                }
            }
        }
    }
}

/// The acquires of this process parked on one key, and whom a release
/// wakes: the one wake rule of every backend ([`Parked::wake`]).
#[derive(Debug, Default)]
pub(crate) struct Parked {
    /// Made by the first acquire parked: most keys are never waited for.
    notify: Option<Arc<Notify>>,
    /// Every acquire parked here.
    pub(crate) waiters: usize,
    /// Those that want the key exclusive.
    pub(crate) writers: usize,
}

/// What a release freed, as far as the releaser's announcement tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freed {
    /// Room for one waiter: a permit, or a release the server judged one
    /// waiter can use.
    One,
    /// An exclusive hold, or a release of unknown kind.
    Hold,
    /// Room for every waiter: a shared hold left, or the server said so.
    All,
}

impl Freed {
    /// What the release of one hold in `mode` frees.
    pub(crate) fn release_of(mode: LockMode) -> Freed {
        match mode {
            LockMode::Shared => Freed::All,
            LockMode::Permits { .. } => Freed::One,
            _ => Freed::Hold,
        }
    }
}

impl Parked {
    /// Parks one acquire in `mode`; what to wait on.
    pub(crate) fn park(&mut self, mode: LockMode) -> Arc<Notify> {
        self.waiters += 1;
        self.writers += usize::from(mode == LockMode::Exclusive);
        self.notify.get_or_insert_with(Default::default).clone()
    }

    /// One acquire in `mode` leaves.
    pub(crate) fn leave(&mut self, mode: LockMode) {
        self.waiters = self.waiters.saturating_sub(1);
        if mode == LockMode::Exclusive {
            self.writers = self.writers.saturating_sub(1);
        }
    }

    /// Wakes whom `freed` lets in. One waiter for one permit, and for an
    /// exclusive hold while every waiter wants the key exclusive: only one
    /// of them can take it, and waking all would send each to the server
    /// for nothing. Everyone otherwise: readers go together, permits up to
    /// their limit, and one woken in a writer's place would let the wake-up
    /// go to waste. Every waiter has its `notified()` enabled before each
    /// try, so waking all misses none; a woken waiter that gives up passes
    /// its wake-up on (tokio's `Notify`).
    pub(crate) fn wake(&self, freed: Freed) {
        let Some(notify) = &self.notify else { return };
        match freed {
            Freed::One => notify.notify_one(),
            Freed::Hold if self.writers == self.waiters => notify.notify_one(),
            Freed::Hold | Freed::All => notify.notify_waiters(),
        }
    }
}

/// The [`Parked`] acquires of this process, per key (or per release
/// channel): the registry the remote backends wake from their release
/// announcements.
#[cfg(any(feature = "redis", feature = "postgres"))]
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<String, Parked>>,
    /// Every acquire parked, on any key: lets the common answer, "nobody
    /// waits", skip the lock and the key's text.
    total: AtomicUsize,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Waiters {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Parked>> {
        // Every update is one insert, count or removal.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Parks an acquire of `key` in `mode` until the registration drops.
    pub(crate) fn register(self: &Arc<Self>, key: &str, mode: LockMode) -> Registration {
        let notify = self.map().entry(key.to_owned()).or_default().park(mode);
        self.total.fetch_add(1, Ordering::Relaxed);
        Registration { waiters: self.clone(), key: key.to_owned(), mode, notify }
    }

    /// How many acquires are parked on `key`.
    pub(crate) fn count(&self, key: &str) -> usize {
        self.map().get(key).map_or(0, |parked| parked.waiters)
    }

    /// Whether an acquire is parked on the key `key` names (built only when
    /// some acquire is parked on any).
    pub(crate) fn waited_on(&self, key: impl FnOnce() -> String) -> bool {
        self.total.load(Ordering::Relaxed) > 0 && self.count(&key()) > 0
    }

    /// Wakes whom a release of `key` lets in ([`Parked::wake`]).
    pub(crate) fn wake(&self, key: &str, freed: Freed) {
        if let Some(parked) = self.map().get(key) {
            parked.wake(freed);
        }
    }

    /// Wakes every parked acquire: announcements may have been missed.
    pub(crate) fn wake_every_key(&self) {
        for parked in self.map().values() {
            parked.wake(Freed::All);
        }
    }
}

/// An acquire parked in [`Waiters`]; dropping it takes it out.
#[cfg(any(feature = "redis", feature = "postgres"))]
#[derive(Debug)]
pub(crate) struct Registration {
    waiters: Arc<Waiters>,
    key: String,
    mode: LockMode,
    notify: Arc<Notify>,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl AsRef<Notify> for Registration {
    fn as_ref(&self) -> &Notify {
        &self.notify
    }
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.waiters.map();
        if let Some(parked) = map.get_mut(&self.key) {
            self.waiters.total.fetch_sub(1, Ordering::Relaxed);
            parked.leave(self.mode);
            if parked.waiters == 0 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(all(test, any(feature = "redis", feature = "postgres")))]
mod tests {
    use super::*;

    /// The one wake rule: one waiter for a permit and for an exclusive
    /// hold that only writers wait for; all of them otherwise.
    #[tokio::test]
    async fn a_release_wakes_whom_it_lets_in() {
        let woken = |modes: &[LockMode], freed: Freed| {
            let waiters = Arc::new(Waiters::default());
            let regs: Vec<Registration> = modes.iter().map(|m| waiters.register("k", *m)).collect();
            let mut notified: Vec<_> = regs.iter().map(|r| Box::pin(r.as_ref().notified())).collect();
            for n in &mut notified {
                n.as_mut().enable();
            }
            waiters.wake("k", freed);
            notified.iter_mut().map(|n| n.as_mut().now_or_never().is_some()).filter(|woken| *woken).count()
        };
        use futures_util::FutureExt;
        let (x, s, p) = (LockMode::Exclusive, LockMode::Shared, LockMode::permits(3));
        assert_eq!(woken(&[x, x, x], Freed::Hold), 1, "writers only: one");
        assert_eq!(woken(&[x, s, s], Freed::Hold), 3, "readers wait: all");
        assert_eq!(woken(&[p, p, p], Freed::Hold), 3, "permits behind a hold: all");
        assert_eq!(woken(&[p, p, p], Freed::One), 1, "one permit freed: one");
        assert_eq!(woken(&[x, x], Freed::All), 2);
        let waiters = Arc::new(Waiters::default());
        let (a, b) = (waiters.register("k", x), waiters.register("k", s));
        assert_eq!(waiters.count("k"), 2);
        drop((a, b));
        assert_eq!(waiters.count("k"), 0, "the key's entry goes with its last waiter");
        assert!(waiters.map().is_empty());
    }
}
