//! What an operator does to locks through a [`Locker`]: see who holds a
//! key ([`Locker::inspect`]), list the held keys of a lock name
//! ([`Locker::list`]), and free a stuck holder ([`Locker::force_unlock`]),
//! every forced release logged at WARN with the operator's reason.

use crate::backend::{under_name, Holder, KeyPage, ListQuery, LockState, Release};
use crate::error::{Error, Result};
use crate::key::{escape_into, LockKey};

use super::Locker;

/// The most keys one page of [`Locker::list`] holds.
pub const MAX_PAGE: usize = 1000;

/// Which keys [`Locker::list`] lists: those of one lock name, or of every
/// name starting with some text, a page at a time.
///
/// ```
/// use dlock_core::Listing;
/// let first = Listing::name("order.create").limit(50);
/// let names = Listing::names_starting_with("order.");
/// # let _ = (first, names);
/// ```
#[derive(Debug, Clone)]
pub struct Listing {
    name: String,
    exact: bool,
    cursor: Option<String>,
    limit: usize,
}

impl Listing {
    /// The keys of the lock called `name` (`#[lockable(key = "name")]`).
    pub fn name(name: &str) -> Self {
        Listing { name: name.to_owned(), exact: true, cursor: None, limit: 100 }
    }

    /// The keys of every lock whose name starts with `start`; `""` lists all.
    pub fn names_starting_with(start: &str) -> Self {
        Listing { name: start.to_owned(), exact: false, cursor: None, limit: 100 }
    }

    /// At most about `n` keys a page (100 unless set; at most [`MAX_PAGE`]).
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = n.clamp(1, MAX_PAGE);
        self
    }

    /// The page after the one whose [`KeyPage::next`] was `cursor`.
    pub fn after(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }
}

/// Which holders [`Locker::force_unlock`] frees, and why: the reason goes
/// into the audit line.
///
/// ```
/// use dlock_core::ForceUnlock;
/// let all = ForceUnlock::all("INC-2041: worker hung holding the nightly report lock");
/// let one = ForceUnlock::holder("1a2b3c4d5e6f", "INC-2042: one permit leaked");
/// # let _ = (all, one);
/// ```
#[derive(Debug, Clone)]
pub struct ForceUnlock {
    holder: Option<String>,
    reason: String,
}

impl ForceUnlock {
    /// Every holder of the key (a semaphore's every permit).
    pub fn all(reason: impl Into<String>) -> Self {
        ForceUnlock { holder: None, reason: reason.into() }
    }

    /// The holder with this short id ([`Holder::id`], as
    /// [`Locker::inspect`] shows it).
    pub fn holder(id: impl Into<String>, reason: impl Into<String>) -> Self {
        ForceUnlock { holder: Some(id.into()), reason: reason.into() }
    }
}

impl Locker {
    /// Who holds `key` now: each holder's short id, mode, fencing token
    /// and time left, and what the backend knows of its waiters.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use dlock_core::{Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let key = locker.key("report").part("nightly").build()?;
    /// let guard = locker.try_acquire(&key).await?;
    /// let state = locker.inspect(&key).await?;
    /// assert_eq!(state.holders[0].fencing_token, guard.fencing_token());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The backend's, when it cannot be asked; [`Error::InvalidArgument`]
    /// from a backend that cannot tell.
    pub async fn inspect(&self, key: &LockKey) -> Result<LockState> {
        self.engine.backend.inspect(key).await
    }

    /// One page of the keys held or waited for under `listing`, in this
    /// locker's namespace; pass [`KeyPage::next`] to
    /// [`Listing::after`] for the next. Bounded, and never blocking the
    /// service (Redis `SCAN` on every master, ZooKeeper's children, an
    /// index scan on PostgreSQL).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use dlock_core::{Listing, Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let key = locker.key("report").part("nightly").build()?;
    /// let _guard = locker.try_acquire(&key).await?;
    /// let page = locker.list(Listing::name("report")).await?;
    /// assert_eq!(page.keys, vec![key]);
    /// assert!(page.next.is_none());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Locker::inspect`]; [`Error::InvalidArgument`] for a cursor the
    /// backend did not make.
    pub async fn list(&self, listing: Listing) -> Result<KeyPage> {
        let prefix = self.engine.options.prefix();
        let mut starts_with = format!("{prefix}:{{");
        escape_into(&listing.name, &mut starts_with);
        let mut query = ListQuery::new(starts_with, listing.limit);
        query.cursor = listing.cursor;
        let mut page = self.engine.backend.list(&query).await?;
        if listing.exact {
            page.keys.retain(|k| under_name(k.as_str(), prefix, &query.starts_with[prefix.len() + 2..]));
        }
        Ok(page)
    }

    /// Frees `key` whoever holds it, as an operator: every holder, or the
    /// one named, each logged at WARN (`dlock.force_unlock`, target
    /// `dlock::audit`) with its id, fencing token and `unlock`'s reason.
    /// Safe for the storage the lock guards: the next grant's fencing token
    /// is above every freed one's, and a freed holder's
    /// [`LockGuard::lost`](crate::LockGuard::lost) fires no later than its
    /// next renewal. Returns the holders it freed.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use dlock_core::{ForceUnlock, Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let key = locker.key("report").part("nightly").build()?;
    /// let stuck = locker.try_acquire(&key).await?;
    /// let freed = locker.force_unlock(&key, ForceUnlock::all("the report worker hung")).await?;
    /// assert_eq!(freed[0].fencing_token, stuck.fencing_token());
    /// let next = locker.try_acquire(&key).await?;
    /// assert!(next.fencing_token() > stuck.fencing_token());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty reason or a holder id the key
    /// does not have; the backend's when it cannot be asked or (RedLock)
    /// no majority of its masters answered the release.
    pub async fn force_unlock(&self, key: &LockKey, unlock: ForceUnlock) -> Result<Vec<Holder>> {
        let reason = unlock.reason.trim();
        if reason.is_empty() {
            return Err(Error::invalid_argument("reason", "a forced unlock is audited: say why"));
        }
        let state = self.inspect(key).await?;
        let chosen: Vec<&Holder> = match &unlock.holder {
            None => state.holders.iter().collect(),
            Some(id) => {
                let one = state.holder(id).ok_or_else(|| {
                    Error::invalid_argument("holder", format!("`{}` holds no `{}` now", id, key.log_id()))
                })?;
                vec![one]
            }
        };
        let mut freed = Vec::with_capacity(chosen.len());
        for holder in chosen {
            let outcome = self.engine.backend.force_unlock(key, holder).await;
            let answer = match &outcome {
                Ok(Release::Freed) => "freed",
                Ok(_) => "not held any more",
                Err(_) => "failed",
            };
            tracing::warn!(
                target: "dlock::audit",
                key = %key.log_id(),
                holder = %holder.id(),
                fence = holder.fencing_token,
                mode = %holder.mode,
                backend = self.engine.backend.name(),
                reason,
                outcome = answer,
                "dlock.force_unlock"
            );
            if outcome? == Release::Freed {
                freed.push(holder.clone());
            }
        }
        Ok(freed)
    }
}
