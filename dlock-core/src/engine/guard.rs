//! [`LockGuard`]: a held lock, its fencing token, its watchdog and its
//! lost-lock signal.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::holds::{HoldId, Joined, Leave, ReleaseTurn};
use super::see_through::SeeThrough;
use super::Engine;
use crate::backend::{AcquireRequest, LostReason, LostSignal, Release};
use crate::error::Result;
use crate::key::LockKey;
use crate::metrics::{Op, Stopwatch};
use crate::owner::Owner;

/// A held lock: hand its [`fencing_token`](Self::fencing_token) to the
/// storage you protect, watch [`lost`](Self::lost), and
/// [`release`](Self::release) it (dropping it releases in the background).
/// In watchdog mode the lease is renewed every lease/3 while the guard
/// lives; an in-process lock taken on the spot has no lease to renew.
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
    /// The engine's hold this guard shares (see `holds.rs`).
    hold: HoldId,
    key: LockKey,
    owner: Owner,
    fencing_token: u64,
    watchdog: bool,
    /// The hold's signal, asked for when first needed (see `holds::Watch`).
    state: OnceLock<LostSignal>,
    released: bool,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key.log_id())
            .field("owner", &self.owner)
            .field("fencing_token", &self.fencing_token)
            .field("watchdog", &self.watchdog)
            .field("state", &self.state.get())
            .finish()
    }
}

impl LockGuard {
    /// The guard of one share of a hold; `watchdog`: renewed while it lives.
    pub(crate) fn new(engine: Arc<Engine>, req: AcquireRequest, joined: Joined, watchdog: bool) -> Self {
        LockGuard {
            engine,
            hold: joined.id,
            key: req.key,
            owner: req.owner,
            fencing_token: joined.token,
            watchdog,
            state: joined.state.map(OnceLock::from).unwrap_or_default(),
            released: false,
        }
    }

    fn signal(&self) -> &LostSignal {
        self.state.get_or_init(|| self.engine.holds.signal(self.hold))
    }

    /// The lock's key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Who holds it.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The grant's fencing token: greater than the token of every grant of
    /// this key returned before this acquire began (re-entries share it),
    /// on these conditions:
    ///
    /// * in process and on ZooKeeper (the node's creation zxid): always;
    /// * one Redis or Sentinel: while it keeps its high-water mark, else
    ///   (a restart without persistence, a failover) while the server's
    ///   clock has not stepped back;
    /// * RedLock: while a majority of masters keeps its data;
    /// * PostgreSQL: across restarts and crashes while the disk keeps what
    ///   was flushed; across a failover only to a synchronous standby (an
    ///   asynchronous one may grant a held key with its holder's token,
    ///   which no fence refuses: `docs/postgres-design.md`).
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// Until when the lock is certainly ours (moves forward with each renewal).
    pub fn valid_until(&self) -> Instant {
        self.signal().valid_until()
    }

    /// Whether the lock is kept for as long as the guard lives (watchdog mode).
    pub fn is_watchdog(&self) -> bool {
        self.watchdog
    }

    /// Whether the lock may no longer be ours (see [`lost`](Self::lost)).
    pub fn is_lost(&self) -> bool {
        self.signal().is_lost()
    }

    /// Resolves when the lock may no longer be ours (see
    /// [`LostSignal::lost`](crate::LostSignal::lost)): no later than another
    /// client could take the key, never on an error a renewal repairs.
    ///
    /// # Cancellation safety
    ///
    /// Cancel-safe; call it as often as you like.
    pub async fn lost(&self) -> LostReason {
        self.signal().lost().await
    }

    /// A handle that watches this lock without owning it, for the work it
    /// protects.
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
        self.signal().clone()
    }

    /// Gives the lock back. Returns whether we still held it (`false`: the
    /// lease had run out or someone else holds the key now).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the service cannot be
    /// reached; the release is then retried in the background until it
    /// goes through or the lease runs out.
    pub async fn release(mut self) -> Result<bool> {
        self.released = true;
        let turn = match self.engine.holds.leave(self.hold, self.watchdog, self.engine.backend.as_ref()) {
            // Other guards of this process still hold it.
            Leave::Others { lost } => return Ok(!lost),
            Leave::Detached => return Ok(false),
            Leave::Released(result) => {
                trace_release(&self.key, &result, "dlock.release");
                return result.map(|r| r == Release::Freed);
            }
            Leave::Last(turn) => turn,
        };
        let release = release_last(self.engine.clone(), self.key.clone(), self.owner.clone(), turn);
        SeeThrough::new(Box::pin(release), None).await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let turn = match self.engine.holds.leave(self.hold, self.watchdog, self.engine.backend.as_ref()) {
            Leave::Last(turn) => turn,
            Leave::Released(result) => return trace_release(&self.key, &result, "dlock.release (guard dropped)"),
            Leave::Others { .. } | Leave::Detached => return,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.key.log_id(), "lock guard dropped outside a tokio runtime; the lease frees it");
            return;
        };
        runtime.spawn(release_last(self.engine.clone(), self.key.clone(), self.owner.clone(), turn));
    }
}

/// Sends the last release of a hold, keeping its turn until it lands (also
/// through retries, so no acquire of the owner joins a hold about to go).
pub(super) async fn release_last(engine: Arc<Engine>, key: LockKey, owner: Owner, turn: ReleaseTurn) -> Result<bool> {
    let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
    let stopwatch = Stopwatch::start();
    let result = engine.backend.release(&key, &owner).await;
    engine.meters.op(Op::Release, stopwatch);
    if let Err(e) = &result {
        let until = turn.valid_until.filter(|_| e.is_unavailable());
        let retried = until.is_some();
        tracing::warn!(key = %key.log_id(), error = %e, retried, "dlock.release failed");
        if let Some(until) = until {
            turn.retrying();
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(retry_release(engine, key, owner, until, turn))),
                Err(_) => drop(turn),
            }
        }
    } else {
        let took_us = started.map(|s| s.elapsed().as_micros() as u64);
        tracing::debug!(key = %key.log_id(), outcome = ?result, took_us, "dlock.release");
    }
    result.map(|r| r == Release::Freed)
}

/// The first pause before a failed release is retried, doubled up to the
/// max: a service that is back is found within half a second.
const RELEASE_RETRY_MIN_DELAY: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX_DELAY: Duration = Duration::from_millis(500);

/// Retries a release that could not reach the service until it goes
/// through, is answered otherwise, or the lease ends at `until` (the key is
/// then free anyway).
async fn retry_release(engine: Arc<Engine>, key: LockKey, owner: Owner, until: Instant, turn: ReleaseTurn) {
    // Ends with this task: acquires of the key and owner wait until then.
    let _turn = turn;
    #[cfg(feature = "broken-variants")]
    let _turn = crate::broken_variants::keep_turn(_turn);
    let mut delay = RELEASE_RETRY_MIN_DELAY;
    let mut attempts = 0u32;
    loop {
        if Instant::now() + delay >= until {
            tracing::warn!(key = %key.log_id(), attempts, "dlock.release not retried further: the lease ends");
            return;
        }
        tokio::time::sleep(delay).await;
        attempts += 1;
        let stopwatch = Stopwatch::start();
        let released = tokio::time::timeout_at(until, engine.backend.release(&key, &owner)).await;
        engine.meters.op(Op::Release, stopwatch);
        match released {
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

fn trace_release(key: &LockKey, result: &Result<Release>, event: &'static str) {
    match result {
        Ok(r) => tracing::debug!(key = %key.log_id(), outcome = ?r, event),
        Err(e) => tracing::warn!(key = %key.log_id(), error = %e, event),
    }
}
