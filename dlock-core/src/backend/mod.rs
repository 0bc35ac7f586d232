//! The seam between the lock engine and a coordination service: the
//! object-safe [`Backend`] trait, the [`AcquireRequest`] the engine sends
//! and the [`Grant`] a backend answers. Re-entry, waits, several keys and
//! cancellation are the engine's; what a backend must keep, and why, is in
//! `docs/core-design.md`.
//!
//! # Plugging in a new backend
//!
//! Implement [`Backend`] and hand it to [`Locker::new`](crate::Locker::new).
//! Make each step atomic on the service, check the owner on renew and
//! release, wait for an event (a release, a lease's end) rather than poll,
//! and refuse a [`LockMode`] you do not keep with
//! [`Error::InvalidArgument`] ([`Backend::supports`]).
//!
//! ```
//! use std::time::Duration;
//! use dlock_core::backend::{AcquireRequest, Backend, BoxFuture, Grant, LockMode, Release, Renewal};
//! use tokio_util::sync::CancellationToken;
//! use dlock_core::{Error, LockKey, Locker, Owner, Result};
//!
//! /// Grants every lock at once, to show the shape (a real backend asks a service).
//! #[derive(Debug, Default)]
//! struct Lenient(std::sync::atomic::AtomicU64);
//!
//! impl Backend for Lenient {
//!     fn name(&self) -> &'static str {
//!         "lenient"
//!     }
//!     fn acquire<'a>(&'a self, req: &'a AcquireRequest, _: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
//!         Box::pin(async move {
//!             match req.mode {
//!                 LockMode::Exclusive => {}
//!                 other => return Err(Error::invalid_argument("mode", format!("{other:?} is not supported"))),
//!             }
//!             let fence = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
//!             Ok(Grant::until(fence, tokio::time::Instant::now() + req.lease))
//!         })
//!     }
//!     fn renew<'a>(&'a self, _: &'a LockKey, _: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
//!         Box::pin(async move { Ok(Renewal::Held { valid_until: tokio::time::Instant::now() + lease }) })
//!     }
//!     fn release<'a>(&'a self, _: &'a LockKey, _: &'a Owner) -> BoxFuture<'a, Result<Release>> {
//!         Box::pin(async { Ok(Release::Freed) })
//!     }
//!     fn ready(&self) -> BoxFuture<'_, Result<()>> {
//!         Box::pin(async { Ok(()) })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
//! let locker = Locker::new(Lenient::default());
//! let key = locker.key("demo").part(1).build()?;
//! let guard = locker.try_acquire(&key).await?;
//! assert_eq!(guard.fencing_token(), 1);
//! guard.release().await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
pub(crate) use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;
// Where the PostgreSQL backend and its client layer take it from.
#[cfg(feature = "postgres")]
pub(crate) use crate::redact::redact;

// Exported at the crate root only (`dlock_core::MemoryBackend`).
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
// The type the idempotency store is made on (`PostgresStore::from_backend`).
#[cfg(feature = "postgres")]
pub(crate) use postgres::PostgresBackend;
#[cfg(feature = "redis")]
pub mod redis;
// The type the idempotency store is made on (`RedisStore::from_backend`).
#[cfg(feature = "redis")]
pub(crate) use redis::RedisBackend;
mod inspect;
#[cfg(feature = "redis")]
pub mod redlock;
pub(crate) mod signal;
pub(crate) mod wait;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;
pub(crate) mod zookeeper_auth;
// Exported at the crate root only (`dlock_core::LostReason`): callers
// match on it as much as backends report it.
pub(crate) mod lost;

pub(crate) use inspect::under_name;
pub use inspect::{Holder, HolderId, KeyPage, ListQuery, LockState};
pub(crate) use lost::LostReason;
pub use signal::LostSignal;

/// A boxed, `Send` future: what the object-safe [`Backend`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One request to take a lock, built by the engine and read by a backend.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::{AcquireRequest, LockMode};
/// use dlock_core::{LockKey, Owner};
/// # fn main() -> dlock_core::Result<()> {
/// let key = LockKey::builder("dlock", "report").part(7).build()?;
/// let req = AcquireRequest::new(key, Owner::random()?, Duration::from_secs(30));
/// assert_eq!(req.mode, LockMode::Exclusive);
/// assert!(req.deadline.is_none(), "try once");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// The lock.
    pub key: LockKey,
    /// Who asks. The engine sends one acquire per key and owner at a time,
    /// and none while it holds the key for that owner, unless its hold was
    /// lost (a hold the service still has for the owner is then joined).
    pub owner: Owner,
    /// How long the grant lives unless renewed (Redis TTL); ignored by
    /// session-based backends.
    pub lease: Duration,
    /// Give up at this instant; `None` means try exactly once.
    pub deadline: Option<Instant>,
    /// The guard keeps the lock while it lives (watchdog mode, no
    /// `max_hold`): a backend whose holds cannot outlive this process may
    /// answer [`GrantLease::UntilReleased`]; others ignore it.
    pub until_released: bool,
    /// How the lock is shared; see [`LockMode`].
    pub mode: LockMode,
}

/// One renewal of a [`Backend::renew_many`] batch.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RenewRequest {
    /// The lock.
    pub key: LockKey,
    /// Who holds it.
    pub owner: Owner,
    /// The lease to extend it to, from now.
    pub lease: Duration,
}

impl RenewRequest {
    /// A renewal of `owner`'s hold of `key` to `lease`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{backend::RenewRequest, LockKey, Owner};
    /// let key = LockKey::builder("dlock", "orders").part(7).build()?;
    /// let req = RenewRequest::new(key, Owner::random()?, Duration::from_secs(30));
    /// assert_eq!(req.lease, Duration::from_secs(30));
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    pub fn new(key: LockKey, owner: Owner, lease: Duration) -> Self {
        RenewRequest { key, owner, lease }
    }
}

impl AcquireRequest {
    /// A try-once, exclusive request for `key` as `owner` with `lease`.
    pub fn new(key: LockKey, owner: Owner, lease: Duration) -> Self {
        AcquireRequest { key, owner, lease, deadline: None, until_released: false, mode: LockMode::Exclusive }
    }

    /// Waits for the lock until `deadline`.
    pub fn with_deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Asks for the lock in `mode` (see [`LockMode`]).
    pub fn with_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets [`until_released`](Self::until_released).
    pub fn with_until_released(mut self, until_released: bool) -> Self {
        self.until_released = until_released;
        self
    }
}

/// How a lock is shared among its holders.
///
/// * [`Exclusive`](LockMode::Exclusive): one holder at a time; also the
///   write side of a read-write lock.
/// * [`Shared`](LockMode::Shared): the read side. Shared holders share the
///   key; an exclusive one excludes them. Writers are preferred: once a
///   writer waits, new readers wait behind it, and a writer that gives up
///   its wait lets them in at once ([`Backend::withdraw`]).
/// * [`Permits`](LockMode::Permits): one of `limit` permits of a semaphore.
///   The first holder fixes `limit` (on most backends also while anyone
///   waits for a permit: `docs/backends.md`); another limit is
///   [`Error::ModeConflict`], not contention. RedLock keeps only `limit` 1.
///
/// Every hold has its own lease (or watchdog), fencing token and lost
/// signal. `#[non_exhaustive]`: a backend outside this crate must refuse a
/// mode it does not know with [`Error::InvalidArgument`].
///
/// ```
/// use dlock_core::backend::LockMode;
/// assert_eq!(LockMode::default(), LockMode::Exclusive);
/// assert_eq!(LockMode::permits(3).to_string(), "one of 3 permits");
/// assert!(LockMode::Shared.is_compatible_with(LockMode::Shared));
/// assert!(!LockMode::Shared.is_compatible_with(LockMode::Exclusive));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockMode {
    /// One holder (one owner, re-entering as often as it likes) at a time.
    #[default]
    Exclusive,
    /// Shared with every other shared holder; excludes an exclusive one.
    Shared,
    /// One of `limit` permits; `limit` is at least 1.
    Permits {
        /// How many holders the key admits at once.
        limit: u32,
    },
}

impl LockMode {
    /// One of `limit` permits of a semaphore.
    pub const fn permits(limit: u32) -> Self {
        LockMode::Permits { limit }
    }

    /// Whether holders of `self` and of `other` (other owners) may share a
    /// key: shared with shared, permits of the same limit.
    pub fn is_compatible_with(self, other: LockMode) -> bool {
        match (self, other) {
            (LockMode::Shared, LockMode::Shared) => true,
            (LockMode::Permits { limit: a }, LockMode::Permits { limit: b }) => a == b,
            _ => false,
        }
    }

    /// How many holders of this mode a key admits (`None`: any number).
    pub fn limit(self) -> Option<u32> {
        match self {
            LockMode::Exclusive => Some(1),
            LockMode::Shared => None,
            LockMode::Permits { limit } => Some(limit),
        }
    }

    /// `Ok` unless it is zero permits.
    pub(crate) fn validate(self) -> Result<()> {
        match self {
            LockMode::Permits { limit: 0 } => {
                Err(Error::invalid_argument("mode", "a semaphore needs at least one permit"))
            }
            _ => Ok(()),
        }
    }

    /// What the owner holding the key in `self` may ask for again: the same
    /// mode, or shared under its exclusive hold.
    pub(crate) fn reentry(self, asked: LockMode, key: &LockKey) -> Result<()> {
        match (self, asked) {
            (held, asked) if held == asked => Ok(()),
            (LockMode::Exclusive, LockMode::Shared) => Ok(()),
            (LockMode::Shared, LockMode::Exclusive) => Err(Error::mode_conflict(
                key,
                "this owner holds it shared, and an upgrade to exclusive would deadlock with another \
                 reader upgrading at the same time: release the shared hold first, or take it exclusive \
                 from the start",
            )),
            (held, asked) => Err(Error::mode_conflict(key, format!("this owner holds it as {held}, not as {asked}"))),
        }
    }
}

impl std::fmt::Display for LockMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockMode::Exclusive => f.write_str("exclusive"),
            LockMode::Shared => f.write_str("shared"),
            LockMode::Permits { limit } => write!(f, "one of {limit} permits"),
        }
    }
}

/// How long a [`Grant`] is ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrantLease {
    /// Until this instant, measured here from before the request was sent;
    /// renewed by the watchdog in watchdog mode.
    Until(Instant),
    /// Until the guard releases it (the hold cannot outlive this process);
    /// only for a request with [`AcquireRequest::until_released`] set.
    UntilReleased,
}

/// What a backend hands back for a successful acquire.
///
/// ```
/// use dlock_core::backend::{Grant, GrantLease};
/// use dlock_core::backend::LostSignal;
/// use tokio::time::{Duration, Instant};
///
/// let valid_until = Instant::now() + Duration::from_secs(30);
/// let grant = Grant::until(7, valid_until);
/// assert_eq!(grant.lease, GrantLease::Until(valid_until));
///
/// // A backend that learns of a loss on its own keeps a clone of the
/// // signal and calls `lose` on it.
/// let signal = LostSignal::new(valid_until);
/// let grant = Grant::until_released(8).with_lost_signal(signal.clone());
/// assert!(grant.lost.is_some());
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Grant {
    /// Greater than every earlier grant's of this key (a re-entrant grant:
    /// the token of the hold it joins).
    pub fencing_token: u64,
    /// How long it is ours.
    pub lease: GrantLease,
    /// The signal the backend marks when it learns of a loss outside of
    /// renewals (a session expired, a forced unlock). `None`: only renewals
    /// tell, and the engine makes the signal.
    pub lost: Option<LostSignal>,
}

impl Grant {
    /// A grant that is ours until `valid_until` unless renewed.
    pub fn until(fencing_token: u64, valid_until: Instant) -> Self {
        Grant { fencing_token, lease: GrantLease::Until(valid_until), lost: None }
    }

    /// A grant that is ours until the guard releases it.
    pub fn until_released(fencing_token: u64) -> Self {
        Grant { fencing_token, lease: GrantLease::UntilReleased, lost: None }
    }

    /// The signal the backend will mark if it learns of a loss itself.
    pub fn with_lost_signal(mut self, signal: LostSignal) -> Self {
        self.lost = Some(signal);
        self
    }

    /// The end of the lease; `None` for a grant held until released.
    pub fn valid_until(&self) -> Option<Instant> {
        match self.lease {
            GrantLease::Until(at) => Some(at),
            GrantLease::UntilReleased => None,
        }
    }
}

/// The answer to a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// Still ours, now until the given instant.
    Held {
        /// The new end of the lease.
        valid_until: Instant,
    },
    /// The key is gone or belongs to someone else.
    Lost,
}

/// The answer to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Release {
    /// We held it and it is now free.
    Freed,
    /// We no longer held it (expired, or taken by someone else).
    NotHeld,
}

/// A coordination service that can grant, renew and release leases.
///
/// Every step atomic on the service, the owner checked on renew and
/// release, waits woken by events (see the [module](self) docs).
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// `memory`, `redis`, `redlock`, `zookeeper` or `postgres`.
    fn name(&self) -> &'static str;

    /// Takes the lock, waiting until `req.deadline` for it to come free.
    ///
    /// Returns [`Error::Busy`] when `req.deadline` is `None` and the key is
    /// held, [`Error::Timeout`] when the deadline passes, and
    /// [`Error::Cancelled`] when `cancel` fires during a wait. The engine
    /// never drops this future while a command may be in flight: select on
    /// `cancel` only while waiting.
    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>>;

    /// Extends our lease on `key` to `lease` from now, if we still hold it.
    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>>;

    /// Renews the watchdog's due holds of one tick, one answer per hold in
    /// order. The default sends concurrent [`renew`](Self::renew)s; a
    /// backend that can renew many in one request overrides it.
    fn renew_many<'a>(&'a self, holds: &'a [RenewRequest]) -> BoxFuture<'a, Vec<Result<Renewal>>> {
        Box::pin(futures_util::future::join_all(holds.iter().map(|h| self.renew(&h.key, &h.owner, h.lease))))
    }

    /// Frees `key` if `owner` holds it (the engine sends only the last
    /// release of its holds).
    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>>;

    /// Whether a grant could be asked for now, for a readiness probe: one
    /// cheap round trip, no lock taken; an error says why not. Required, so
    /// that no backend is ready by default.
    fn ready(&self) -> BoxFuture<'_, Result<()>>;

    /// One attempt answered without I/O (the in-process table): what
    /// [`acquire`](Backend::acquire) with no deadline would return. `None`
    /// (the default): only `acquire` can tell. The engine tries it first.
    fn try_acquire_now(&self, req: &AcquireRequest) -> Option<Result<Grant>> {
        let _ = req;
        None
    }

    /// Whether this backend keeps holds of `mode`, asked at start-up; `Err`
    /// says why not. The default keeps only [`LockMode::Exclusive`], so an
    /// older backend refuses other modes rather than grant a weaker lock.
    fn supports(&self, mode: LockMode) -> Result<()> {
        match mode {
            LockMode::Exclusive => Ok(()),
            other => {
                Err(Error::invalid_argument("mode", format!("the {} backend does not keep {other} locks", self.name())))
            }
        }
    }

    /// The key namespace the backend was connected for, when it names
    /// things of its own after it (Redis channels, ZooKeeper nodes); `None`
    /// (the default) when any key will do. [`Locker::new`](crate::Locker::new)
    /// takes it; [`Locker::with_options`](crate::Locker::with_options)
    /// refuses another.
    fn prefix(&self) -> Option<&str> {
        None
    }

    /// [`release`](Backend::release) answered without I/O; `None` (the
    /// default) when it cannot be.
    fn release_now(&self, key: &LockKey, owner: &Owner) -> Option<Result<Release>> {
        let _ = (key, owner);
        None
    }

    /// Takes back what the wait of `req` left for others to see (a
    /// writer's intent that keeps readers out, a waiting permit's place),
    /// now that it ended early without a grant (cancelled or failed). Only
    /// what `req.owner` left, never a hold; it wakes the waiters that kept
    /// out. Sent once, after [`acquire`](Backend::acquire) returned. The
    /// default does nothing, for waits that leave nothing behind.
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        let _ = req;
        Box::pin(std::future::ready(Ok(())))
    }

    /// Who holds `key` now, for an operator: each live holder's mode,
    /// fencing token and time left, and what the backend knows of its
    /// waiters. Reads only. The default says this backend cannot tell.
    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        let _ = key;
        Box::pin(std::future::ready(Err(cannot(self.name(), "inspect"))))
    }

    /// One page of the keys held (or waited for) whose text starts with
    /// `query.starts_with`, bounded by `query.limit`, without blocking the
    /// service (Redis `SCAN` on every master, never `KEYS`). The default
    /// says this backend cannot list.
    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        let _ = query;
        Box::pin(std::future::ready(Err(cannot(self.name(), "list"))))
    }

    /// Frees `holder`'s hold of `key` ([`inspect`](Backend::inspect) found
    /// it) for an operator, whoever holds it: waiters are woken, the next
    /// grant's fencing token is above the freed one's, and the holder
    /// learns of its loss no later than its next renewal.
    /// [`Release::NotHeld`] when it held the key no longer. The default
    /// says this backend cannot.
    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        let _ = (key, holder);
        Box::pin(std::future::ready(Err(cannot(self.name(), "force_unlock"))))
    }
}

/// The error of an operator's call that `backend` does not answer.
fn cannot(backend: &str, what: &'static str) -> Error {
    Error::invalid_argument(what, format!("the {backend} backend does not implement it"))
}

/// The error for `req` finding its key held in `held`, naming both modes.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
pub(crate) fn mode_conflict(req: &AcquireRequest, held: LockMode) -> Error {
    let reason = match (held, req.mode) {
        (LockMode::Permits { limit: held }, LockMode::Permits { limit: asked }) => format!(
            "it is a semaphore of {held} permits, and was asked for as one of {asked}: the first holder \
             fixes the limit while anyone holds the key (on some backends, also while anyone waits for it)"
        ),
        (LockMode::Exclusive, asked) => format!("this owner holds it exclusive, not as {asked}"),
        (held, asked) => format!("it is held as {held}, and was asked for as {asked}"),
    };
    Error::mode_conflict(&req.key, reason)
}

/// Busy or timeout, depending on whether the caller wanted to wait.
pub(crate) fn contention(req: &AcquireRequest, started: Instant) -> Error {
    match req.deadline {
        None => Error::Busy { key: req.key.to_string() },
        Some(_) => Error::Timeout { key: req.key.to_string(), waited: started.elapsed() },
    }
}
