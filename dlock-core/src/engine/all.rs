//! [`Locker::acquire_all`]: several locks taken all or none, one at a time
//! in one global order (the bytes of the full key), so overlapping sets
//! never deadlock; and the [`MultiGuard`] that holds them.

use std::time::Duration;

use tokio::time::Instant;

use super::guard::LockGuard;
use super::locker::{AcquireOptions, Locker};
use crate::backend::{LockMode, LostReason};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// Several locks held together, each with its own fencing token and lost
/// signal; dropping it releases them in the background.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::LockMode;
/// use dlock_core::{AcquireOptions, Locker, MemoryBackend};
/// let locker = Locker::new(MemoryBackend::new());
/// let from = locker.key("account").part(1).build()?;
/// let to = locker.key("account").part(2).build()?;
/// let both = locker
///     .acquire_all([(&to, LockMode::Exclusive), (&from, LockMode::Exclusive)], AcquireOptions::new())
///     .await?;
/// assert_eq!(both.guards().len(), 2);
/// assert!(both.get(&from).is_some_and(|g| g.fencing_token() > 0));
/// assert!(both.release().await?);
/// # Ok(()) }
/// ```
#[must_use = "dropping the guard releases the locks at once"]
#[derive(Debug)]
pub struct MultiGuard {
    /// In the order they were taken: by key.
    guards: Vec<LockGuard>,
}

impl MultiGuard {
    /// The guards, in key order.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The guard of `key`, to read its fencing token.
    pub fn get(&self, key: &LockKey) -> Option<&LockGuard> {
        self.guards.iter().find(|g| g.key() == key)
    }

    /// Whether any of the locks may no longer be ours.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Resolves when the first of the locks may no longer be ours, with why.
    pub async fn lost(&self) -> LostReason {
        let waits = self.guards.iter().map(|g| Box::pin(g.lost()));
        futures_util::future::select_all(waits).await.0
    }

    /// Releases every lock; `true` when all were still held.
    ///
    /// # Errors
    ///
    /// The first release the service failed; the others are still sent.
    pub async fn release(self) -> Result<bool> {
        let mut all = true;
        let mut failed = None;
        for guard in self.guards.into_iter().rev() {
            match guard.release().await {
                Ok(held) => all &= held,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(all),
        }
    }
}

impl Locker {
    /// Takes every key in `keys`, each in its mode, all or none.
    ///
    /// One owner holds them all, and `opts`' wait covers the whole set;
    /// each key says its own mode. A key named twice in one mode is taken
    /// once.
    ///
    /// # Errors
    ///
    /// As [`Locker::acquire`] for the first key that could not be had (the
    /// ones taken before it are released first); [`Error::InvalidArgument`]
    /// for an empty set, and [`Error::ModeConflict`] for a key named twice in
    /// different modes.
    ///
    /// # Cancellation safety
    ///
    /// Dropping the future leaves none of the keys held.
    pub async fn acquire_all<'k>(
        &self,
        keys: impl IntoIterator<Item = (&'k LockKey, LockMode)>,
        opts: AcquireOptions,
    ) -> Result<MultiGuard> {
        let mut keys: Vec<(&LockKey, LockMode)> = keys.into_iter().collect();
        if keys.is_empty() {
            return Err(Error::invalid_argument("keys", "acquire_all needs at least one key"));
        }
        keys.sort_by(|a, b| a.0.as_str().as_bytes().cmp(b.0.as_str().as_bytes()));
        let mut unique: Vec<(&LockKey, LockMode)> = Vec::with_capacity(keys.len());
        for (key, mode) in keys {
            match unique.last() {
                Some((last, held)) if *last == key && *held == mode => {}
                Some((last, held)) if *last == key => {
                    return Err(Error::mode_conflict(key, format!("named twice, as {held} and as {mode}")));
                }
                _ => unique.push((key, mode)),
            }
        }
        let owner = match opts.owner() {
            Some(owner) => owner.clone(),
            None => Owner::random()?,
        };
        let wait = opts.wait().unwrap_or(self.options().wait());
        let deadline = Instant::now() + wait;
        let mut guards = Vec::with_capacity(unique.len());
        for (key, mode) in unique {
            let left = deadline.saturating_duration_since(Instant::now());
            // A wait that ran out before the last key still tries it once.
            let wait = if wait.is_zero() { Duration::ZERO } else { left };
            let each = opts.clone().with_owner(owner.clone()).with_mode(mode).with_wait(wait);
            match self.acquire(key, each).await {
                Ok(guard) => guards.push(guard),
                Err(e) => {
                    // All or none: give back what was taken, newest first.
                    for guard in guards.into_iter().rev() {
                        if let Err(release) = guard.release().await {
                            tracing::debug!(key = %key.log_id(), error = %release, "acquire_all could not undo a key");
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(MultiGuard { guards })
    }
}
