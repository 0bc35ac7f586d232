//! What an operator asks of a backend: who holds a key ([`LockState`],
//! each [`Holder`] named by a short id, never its owner token), which keys
//! are held ([`ListQuery`], one [`KeyPage`] at a time), and a holder freed
//! by force ([`Backend::force_unlock`](super::Backend::force_unlock)).
//! [`Locker::inspect`](crate::Locker::inspect) and its siblings are the
//! public door.

use std::fmt;
use std::time::Duration;

use super::LockMode;
use crate::key::LockKey;

/// Who holds one key now, as its backend sees it.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::{Holder, LockMode, LockState};
/// use dlock_core::LockKey;
/// let key = LockKey::builder("dlock", "stock").part(7).build()?;
/// let state = LockState::new(key)
///     .with_holder(Holder::new("owner-token", LockMode::permits(3), 41).with_time_left(Duration::from_secs(9)))
///     .with_waiting(2);
/// assert!(state.is_held());
/// assert_eq!(state.limit(), Some(3));
/// assert_eq!(state.holders[0].id().as_str().len(), 12);
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockState {
    /// The key asked about.
    pub key: LockKey,
    /// Its live holders, oldest grant first where the backend knows.
    pub holders: Vec<Holder>,
    /// How many acquires wait for it, where the backend knows (the
    /// in-process table, ZooKeeper's line); `None` where waiters leave no
    /// trace on the server (Redis, PostgreSQL, whose waiters only listen).
    pub waiting: Option<u64>,
    /// What the waits left on the server that keeps others out: a writer's
    /// intent (readers wait behind it) or a waiting permit's place.
    pub intents: u64,
}

impl LockState {
    /// A key nobody holds.
    pub fn new(key: LockKey) -> Self {
        LockState { key, holders: Vec::new(), waiting: None, intents: 0 }
    }

    /// With one more holder.
    pub fn with_holder(mut self, holder: Holder) -> Self {
        self.holders.push(holder);
        self
    }

    /// With `n` acquires known to wait.
    pub fn with_waiting(mut self, n: u64) -> Self {
        self.waiting = Some(n);
        self
    }

    /// With `n` intents or places left by waits.
    pub fn with_intents(mut self, n: u64) -> Self {
        self.intents = n;
        self
    }

    /// Whether anyone holds it.
    pub fn is_held(&self) -> bool {
        !self.holders.is_empty()
    }

    /// The mode it is held in (the holders share one), `None` when free.
    pub fn mode(&self) -> Option<LockMode> {
        self.holders.first().map(|h| h.mode)
    }

    /// How many may hold it at once in its mode: 1 exclusive, the
    /// semaphore's limit, `None` shared or free.
    pub fn limit(&self) -> Option<u32> {
        self.mode().and_then(LockMode::limit)
    }

    /// The holder called `id` ([`Holder::id`]).
    pub fn holder(&self, id: &str) -> Option<&Holder> {
        self.holders.iter().find(|h| h.id().as_str() == id)
    }
}

/// One holder of a key.
///
/// Its handle (the owner token, or ZooKeeper's node name) is what frees it;
/// the owner token lets whoever knows it renew and release the hold, so it
/// never leaves the process: `Debug` and every log write [`Holder::id`].
#[derive(Clone)]
#[non_exhaustive]
pub struct Holder {
    handle: String,
    /// How it holds the key.
    pub mode: LockMode,
    /// Its fencing token. On RedLock, where each master granted its own,
    /// the lowest a quorum granted: the holder's is that or higher.
    pub fencing_token: u64,
    /// How long its lease has left, `None` for holds that end with a
    /// session or a release (ZooKeeper, an in-process hold until released).
    pub time_left: Option<Duration>,
    /// How many masters of a RedLock hold it for it; `None` elsewhere.
    pub on_nodes: Option<u32>,
}

impl Holder {
    /// A holder known to its backend by `handle` (for dlock's backends the
    /// owner token, or the node's name on ZooKeeper).
    pub fn new(handle: impl Into<String>, mode: LockMode, fencing_token: u64) -> Self {
        Holder { handle: handle.into(), mode, fencing_token, time_left: None, on_nodes: None }
    }

    /// With `left` of its lease to run.
    pub fn with_time_left(mut self, left: Duration) -> Self {
        self.time_left = Some(left);
        self
    }

    /// Held on `n` RedLock masters.
    pub fn with_on_nodes(mut self, n: u32) -> Self {
        self.on_nodes = Some(n);
        self
    }

    /// The short id an operator names it by: 12 hex digits of a SHA-1 of
    /// its handle, the same in every process, that do not give the owner
    /// token away.
    pub fn id(&self) -> HolderId {
        let digest = sha1_smol::Sha1::from(self.handle.as_bytes()).digest().to_string();
        HolderId(digest[..12].to_owned())
    }

    /// What the backend frees it by: a secret on most backends (the owner
    /// token). Only for [`Backend::force_unlock`](super::Backend::force_unlock).
    pub fn handle(&self) -> &str {
        &self.handle
    }

    /// The owner whose token is the handle, for a backend that frees a
    /// hold by its owner (Redis, RedLock, PostgreSQL).
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn owner(&self) -> crate::Result<crate::Owner> {
        crate::owner::Owner::from_token(&self.handle)
            .ok_or_else(|| crate::Error::invalid_argument("holder", "not a holder this backend showed"))
    }
}

impl fmt::Debug for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holder")
            .field("id", &self.id().as_str())
            .field("mode", &self.mode)
            .field("fencing_token", &self.fencing_token)
            .field("time_left", &self.time_left)
            .field("on_nodes", &self.on_nodes)
            .finish()
    }
}

/// A [`Holder`]'s short id; see [`Holder::id`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HolderId(String);

impl HolderId {
    /// The 12 hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One page of a listing of held keys: those whose stored text starts
/// with [`starts_with`](ListQuery::starts_with), from where the last page
/// ended.
///
/// ```
/// use dlock_core::backend::ListQuery;
/// let first = ListQuery::new("dlock:{order.create", 100);
/// assert!(first.cursor.is_none());
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ListQuery {
    /// The text every listed key starts with (a whole lock name is
    /// `prefix:{name`, and the caller keeps only that name's keys).
    pub starts_with: String,
    /// Where the last page ended ([`KeyPage::next`]); `None` for the first.
    pub cursor: Option<String>,
    /// About how many keys a page holds: a page is bounded by it, though a
    /// Redis `SCAN` page may hold a few more, or none before the end.
    pub limit: usize,
}

impl ListQuery {
    /// The first page of the keys starting with `starts_with`.
    pub fn new(starts_with: impl Into<String>, limit: usize) -> Self {
        ListQuery { starts_with: starts_with.into(), cursor: None, limit: limit.max(1) }
    }

    /// The page after the one that returned `cursor`.
    pub fn after(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }
}

/// One page of held keys.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct KeyPage {
    /// The keys, each held or waited for when it was seen.
    pub keys: Vec<LockKey>,
    /// Where the next page starts; `None` at the end.
    pub next: Option<String>,
}

impl KeyPage {
    /// A page of `keys`, the last one when `next` is `None`.
    pub fn new(keys: Vec<LockKey>, next: Option<String>) -> Self {
        KeyPage { keys, next }
    }
}

/// Whether `text` ends a lock key: the part after `starts_with`, up to the
/// key's closing brace, holds no brace (a listing by lock name keeps
/// `prefix:{name}` and `prefix:{name:…}`, not `prefix:{names…}`).
pub(crate) fn under_name(key: &str, prefix: &str, name: &str) -> bool {
    key.strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix(":{"))
        .and_then(|rest| rest.strip_prefix(name))
        .is_some_and(|rest| rest.starts_with(':') || rest == "}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holders_id_hides_its_handle() {
        let h = Holder::new("0123456789abcdef0123456789abcdef", LockMode::Exclusive, 1);
        let shown = format!("{h:?} {}", h.id());
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
        assert_eq!(h.id(), Holder::new(h.handle(), LockMode::Shared, 2).id(), "the id is the handle's alone");
    }

    #[test]
    fn a_listing_by_name_keeps_that_name_only() {
        assert!(under_name("dlock:{order:1}", "dlock", "order"));
        assert!(under_name("dlock:{order}", "dlock", "order"));
        assert!(!under_name("dlock:{orders:1}", "dlock", "order"));
        assert!(!under_name("other:{order:1}", "dlock", "order"));
    }
}
