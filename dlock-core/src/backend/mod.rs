//! The seam between the lock engine and a coordination service.
//!
//! One object-safe trait, [`Backend`], fits the five services dlock ships:
//!
//! * in process ([`MemoryBackend`](crate::MemoryBackend)): a map and a `Notify` per key;
//! * one Redis: the lease is the key's TTL, Lua scripts make every step atomic,
//!   pub/sub wakes waiters;
//! * RedLock over N masters: `acquire` fans out and counts a quorum, the
//!   grant is valid until lease − elapsed − drift;
//! * ZooKeeper: `acquire` creates an ephemeral sequential node and watches its
//!   predecessor; the lease is the session, whose loss the backend reports
//!   through the grant's [`LostSignal`] rather than a failed renewal;
//! * PostgreSQL (feature `postgres`): a lease table whose rows expire on
//!   the server clock, PL/pgSQL functions make every step atomic,
//!   `LISTEN/NOTIFY` wakes waiters, a sequence gives the fencing tokens.
//!
//! # What a backend answers
//!
//! The engine sends an [`AcquireRequest`]; the backend answers a [`Grant`]
//! that says how long it holds ([`GrantLease::Until`] an instant, renewed by
//! the engine's watchdog through [`Backend::renew`] in watchdog mode, or
//! [`GrantLease::UntilReleased`] for a hold that cannot outlive this
//! process) and, when the backend can notice a loss on its own (a session
//! expiring, an operator forcing a lock free), the [`LostSignal`] it will
//! mark. The guard watches that one signal whatever the backend; there is no
//! other path from a backend to a guard.
//!
//! Re-entry is the engine's: it keeps one hold per key and owner however
//! many guards share it, and calls [`Backend::acquire`] only for the first
//! and [`Backend::release`] only for the last. A backend holds a key for an
//! owner once, and never counts.
//!
//! A backend that can answer without I/O (the in-process table) implements
//! [`Backend::try_acquire_now`] and [`Backend::release_now`]: the engine
//! tries them first for every backend, which spares in-process locks a
//! boxed future, a cancellation token and a clock read.
//!
//! # Cancellation
//!
//! The engine guarantees that it never drops a backend's `acquire` future
//! while a request may be in flight: it runs it on its own task and passes a
//! [`CancellationToken`] that fires when the caller gave up. A backend selects
//! on it only while it *waits*, and returns [`Error::Cancelled`]; the engine
//! releases any grant that nobody is left to receive, and has the backend
//! take back what the wait left for others to see ([`Backend::withdraw`]).
//!
//! # Plugging in a new backend
//!
//! Implement [`Backend`] for a type of yours and hand it to
//! [`Locker::new`](crate::Locker::new); nothing in the engine names a
//! concrete backend. Build answers with [`Grant::until`] or
//! [`Grant::until_released`] (plus [`Grant::with_lost_signal`]), and wait for
//! a held key with an event (a release announced, a lease running out), not
//! by polling. Check the owner on renew and release, make each step atomic
//! on the service, and answer a [`LockMode`] you do not support with
//! [`Error::InvalidArgument`] (see [`Backend::supports`]). A backend that names things of its own after
//! the key prefix (Redis channels, ZooKeeper nodes) takes the prefix when it
//! connects and reports it through [`Backend::prefix`], so the engine can
//! refuse a configuration where the two differ. The PostgreSQL backend is
//! such a plug-in: one folder here, `postgres/`, plus a
//! [`BackendKind`](crate::BackendKind) variant so that `DLOCK_BACKEND` names it.
//!
//! ```
//! use std::time::Duration;
//! use dlock_core::backend::{
//!     AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, LockMode, Release, Renewal,
//! };
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
//!
//! # Modes: read-write locks and semaphores
//!
//! [`AcquireRequest::mode`] says how the key is to be shared: exclusive, a
//! shared (read) hold, or one of N permits ([`LockMode`]). A backend stores
//! the mode with the hold, as it stores the owner, so that `renew` and
//! `release` by key and owner stay the same for every mode; every grant
//! still carries a fencing token that grows per key, across modes. The
//! first holder of a key fixes what it is: a request that does not fit
//! (another number of permits, permits on a read-write key) is
//! [`Error::ModeConflict`], not contention. A backend that does not keep a
//! mode refuses it with [`Error::InvalidArgument`] (RedLock refuses
//! semaphores of more than one permit: majorities cannot count holders).
//!
//! Several keys at once need nothing of a backend: the engine takes each key
//! in one global order through this same trait
//! ([`Locker::acquire_all`](crate::Locker::acquire_all)).
//!
//! The guard side needs nothing new: every hold has a fencing token, a
//! [`GrantLease`] and a [`LostSignal`].

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
pub use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

// Exported at the crate root only (`dlock_core::MemoryBackend`).
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
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

pub(crate) use lost::LostReason;
pub use signal::LostSignal;

/// A boxed, `Send` future: what the object-safe [`Backend`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One request to take a lock.
///
/// Built by the engine; a backend reads it. Marked `#[non_exhaustive]` so
/// that what later primitives need (a shared mode, a number of permits)
/// arrives as a new field with a default, not as a break of every backend.
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
    /// Who asks. The engine counts re-entry: it sends one acquire per key
    /// and owner at a time, and none while it holds the key for that owner,
    /// except after its hold was lost (then a hold of the same owner that
    /// the service still has is joined, same token).
    pub owner: Owner,
    /// How long the grant lives unless renewed (Redis TTL); ignored by
    /// session-based backends.
    pub lease: Duration,
    /// Give up at this instant; `None` means try exactly once.
    pub deadline: Option<Instant>,
    /// The caller's guard keeps the lock for as long as it lives (watchdog
    /// mode, no `max_hold`), so the engine would renew the lease without
    /// end. A backend whose holds cannot outlive this process (the
    /// in-process table) may then answer [`GrantLease::UntilReleased`] and
    /// spare the renewals; every other backend ignores it.
    pub until_released: bool,
    /// How the lock is shared; see [`LockMode`].
    pub mode: LockMode,
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

    /// Says that the caller would keep the lock until it releases it (see
    /// [`until_released`](Self::until_released)).
    pub fn with_until_released(mut self, until_released: bool) -> Self {
        self.until_released = until_released;
        self
    }
}

/// How a lock is shared among its holders.
///
/// * [`Exclusive`](LockMode::Exclusive): one holder at a time; also the
///   write side of a read-write lock.
/// * [`Shared`](LockMode::Shared): the read side of a read-write lock. Any
///   number of shared holders at once, none while an exclusive holder has
///   the key. A writer that waits is not starved: once it waits, new
///   readers wait behind it (writer preference), until it is granted or
///   its wait ends. On every backend of this crate, a writer whose caller
///   goes (an HTTP request that hung up, a dropped acquire future) or
///   whose acquire fails mid-wait stops keeping readers out at once, and
///   the readers it kept out are woken ([`Backend::withdraw`]; on
///   PostgreSQL, its intent row is deleted and its end announced).
/// * [`Permits`](LockMode::Permits): one of `limit` permits of a
///   semaphore. The first holder fixes `limit`; asking with another is
///   [`Error::ModeConflict`], not contention. How long it stays fixed
///   depends on the backend:
///   - Redis (one server, Sentinel, Cluster): while anyone holds the key
///     *or waits for one of its permits*. A waiter that found the key a
///     semaphore of its limit keeps that limit, also once every holder is
///     gone, until it is granted, gives up (cancelled or failed: its place
///     is withdrawn at once), or its wait would have ended (a waiter whose
///     process died). A waiter that found the key held exclusive keeps
///     nothing.
///   - RedLock: only `limit` 1 (larger semaphores are refused, see
///     [`Backend::supports`]), kept on each node as on Redis.
///   - ZooKeeper: while anyone holds or waits for the key: every
///     contender's node is in one line, and a request whose mode does not
///     fit any node ahead of it is the conflict.
///   - In process ([`MemoryBackend`](crate::MemoryBackend)): as on Redis,
///     while anyone holds the key or waits for one of its permits. A
///     waiter's place goes when its acquire ends (granted, cancelled,
///     dropped, failed or timed out).
///   - PostgreSQL: as on Redis, while anyone holds the key or waits for
///     one of its permits. A waiter that found every permit of its limit
///     taken keeps a place (a row beside the holders') until it is granted,
///     gives up (withdrawn at once), or its wait would have ended; one that
///     found the key held exclusive keeps nothing.
///
/// Every hold, whatever its mode, has its own lease (or watchdog), fencing
/// token and lost signal. The enum is `#[non_exhaustive]` so that a backend
/// outside this crate must already answer a mode it does not know, with
/// [`Error::InvalidArgument`], rather than grant it as something else.
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

    /// Whether holders of `self` and of `other` (other owners) may hold
    /// one key at the same time: shared with shared, and permits of the
    /// same semaphore (up to its limit).
    pub fn is_compatible_with(self, other: LockMode) -> bool {
        match (self, other) {
            (LockMode::Shared, LockMode::Shared) => true,
            (LockMode::Permits { limit: a }, LockMode::Permits { limit: b }) => a == b,
            _ => false,
        }
    }

    /// How many holders of this mode a key admits at once (`None`: any
    /// number, for shared holders).
    pub fn limit(self) -> Option<u32> {
        match self {
            LockMode::Exclusive => Some(1),
            LockMode::Shared => None,
            LockMode::Permits { limit } => Some(limit),
        }
    }

    /// `Ok` for a mode a caller may ask for: permits need a limit of at
    /// least one.
    pub(crate) fn validate(self) -> Result<()> {
        match self {
            LockMode::Permits { limit: 0 } => {
                Err(Error::invalid_argument("mode", "a semaphore needs at least one permit"))
            }
            _ => Ok(()),
        }
    }

    /// What the same owner may ask for while it holds the key in `self`:
    /// the same mode again, or a shared hold under its exclusive one (a
    /// writer may read). `Err` says why not.
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
    /// Until this instant, measured on this machine from before the request
    /// was sent. The engine's watchdog renews it in watchdog mode; the
    /// guard's lost signal fires when it passes unrenewed.
    Until(Instant),
    /// Until the guard releases it: the hold cannot outlive this process,
    /// so there is nothing to renew. Only an answer to a request with
    /// [`AcquireRequest::until_released`] set.
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
    /// Strictly greater than the token of every earlier grant of this key.
    /// A re-entrant grant returns the token of the hold it joins.
    pub fencing_token: u64,
    /// How long it is ours.
    pub lease: GrantLease,
    /// The signal the backend marks when it learns, outside of renewals,
    /// that the grant is gone (a ZooKeeper session expired, an operator
    /// forced the in-process lock free); the guard watches it. `None`: the
    /// backend learns of losses only when a renewal fails, and the engine
    /// makes the guard's signal itself. The engine sets the signal's
    /// `valid_until` from [`lease`](Self::lease).
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
/// Implementations must make every step atomic on the service, check the
/// owner on renew and release, and wait for wake-ups without polling at a
/// fixed interval. See the module docs for the cancellation contract.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// `memory`, `redis`, `redlock`, `zookeeper` or `postgres`.
    fn name(&self) -> &'static str;

    /// Takes the lock, waiting until `req.deadline` for it to come free.
    ///
    /// Returns [`Error::Busy`] when `req.deadline` is `None` and the key is
    /// held, [`Error::Timeout`] when the deadline passes, and
    /// [`Error::Cancelled`] when `cancel` fires during a wait.
    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>>;

    /// Extends our lease on `key` to `lease` from now, if we still hold it.
    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>>;

    /// Frees `key` if `owner` holds it (the engine sends only the last
    /// release of its holds).
    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>>;

    /// Whether a grant could be asked for now, for a readiness probe: one
    /// cheap round trip to the service, no lock taken. An error says why
    /// not (unreachable, no quorum, a restart quarantine with the time it
    /// has left). Required, so that a backend never reports ready by default.
    fn ready(&self) -> BoxFuture<'_, Result<()>>;

    /// One attempt answered on the spot, for a backend that needs no I/O for
    /// it (the in-process table): what [`acquire`](Backend::acquire) with no
    /// deadline would return, whatever `req.deadline` says. `None` (the
    /// default): only `acquire` can tell.
    ///
    /// The engine tries this first for every backend and calls `acquire`
    /// only when it returns `None`, or contention for a caller that waits,
    /// sparing in-process locks the boxed future and cancellation token an
    /// attempt that may suspend needs.
    fn try_acquire_now(&self, req: &AcquireRequest) -> Option<Result<Grant>> {
        let _ = req;
        None
    }

    /// Whether this backend keeps holds of `mode`, asked before any lock is
    /// taken (a route's configuration checked at start-up): `Err` says why
    /// not, as [`acquire`](Backend::acquire) would. The default keeps only
    /// [`LockMode::Exclusive`], so a backend written before modes existed
    /// refuses them here rather than granting a weaker lock.
    fn supports(&self, mode: LockMode) -> Result<()> {
        match mode {
            LockMode::Exclusive => Ok(()),
            other => {
                Err(Error::invalid_argument("mode", format!("the {} backend does not keep {other} locks", self.name())))
            }
        }
    }

    /// The key namespace the backend was connected for, when it keeps one
    /// of its own (the Redis channels it subscribes to, the ZooKeeper node
    /// its locks live under); `None` (the default) when any key will do.
    /// [`Locker::new`](crate::Locker::new) takes it, and
    /// [`Locker::with_options`](crate::Locker::with_options) refuses
    /// options with another, so the prefix is given once.
    fn prefix(&self) -> Option<&str> {
        None
    }

    /// [`release`](Backend::release) answered on the spot, for a backend
    /// that needs no I/O for it; `None` (the default) when it cannot be.
    fn release_now(&self, key: &LockKey, owner: &Owner) -> Option<Result<Release>> {
        let _ = (key, owner);
        None
    }

    /// Takes back what the waits of `req` left on the service for others to
    /// see (a writer's intent that keeps new readers out, a waiting permit's
    /// place that keeps the semaphore's limit), now that it ended without a
    /// grant before its deadline: cancelled (its caller went, e.g. an HTTP
    /// request that hung up) or failed. Left there, it would keep readers
    /// out, or a limit fixed, until the wait would have ended.
    ///
    /// Only what `req.owner` left, never a hold, and it wakes the waiters
    /// what it takes back kept out. The engine sends it on a task of its
    /// own once [`acquire`](Backend::acquire) returned (after its last
    /// command was answered, so it lands after it), once, keeping the
    /// owner's turn on the key until it is answered; an acquire whose
    /// outcome is unknown is released as well, after it. What a failed
    /// withdrawal leaves ends with the wait it bounded.
    ///
    /// The default does nothing: for a backend whose waits leave nothing
    /// behind, or take it with them (in process, a waiter's registration;
    /// ZooKeeper, its node).
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        let _ = req;
        Box::pin(std::future::ready(Ok(())))
    }
}

/// `url` with its user and password replaced by `***`:
/// `redis://***@host:6379/0`. Every URL dlock prints goes through here.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://***@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// The error for `req` finding its key held in `held`, naming both modes
/// (for permits, both limits).
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
