//! The seam between the lock engine and a coordination service.
//!
//! One object-safe trait, [`Backend`], fits the four services dlock ships:
//!
//! * in process ([`MemoryBackend`]): a map and a `Notify` per key;
//! * one Redis: the lease is the key's TTL, Lua scripts make every step atomic,
//!   pub/sub wakes waiters;
//! * RedLock over N masters: `acquire` fans out and counts a quorum, the
//!   [`Grant::valid_until`] is lease − elapsed − drift;
//! * ZooKeeper: `acquire` creates an ephemeral sequential node and watches its
//!   predecessor; the lease is the session, whose loss arrives through
//!   [`Grant::lost`] rather than a failed renewal.
//!
//! The engine guarantees that it never drops a backend's `acquire` future
//! while a request may be in flight: it runs it on its own task and passes a
//! [`CancellationToken`] that fires when the caller gave up. A backend selects
//! on it only while it *waits*, and returns [`Error::Cancelled`]; the engine
//! releases any grant that nobody is left to receive.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
pub use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
pub(crate) mod signal;
pub(crate) mod wait;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

pub use memory::MemoryBackend;
pub use signal::LostSignal;

/// A boxed, `Send` future: what the object-safe [`Backend`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One request to take a lock.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    /// The lock.
    pub key: LockKey,
    /// Who asks; the same owner re-entering a lock it holds is counted.
    pub owner: Owner,
    /// How long the grant lives unless renewed (Redis TTL); ignored by
    /// session-based backends.
    pub lease: Duration,
    /// Give up at this instant; `None` means try exactly once.
    pub deadline: Option<Instant>,
}

/// What a backend hands back for a successful acquire.
pub struct Grant {
    /// Strictly greater than the token of every earlier grant of this key.
    /// A re-entrant grant returns the token of the hold it joins.
    pub fencing_token: u64,
    /// Until when the grant is certainly ours, measured on this machine from
    /// before the request was sent.
    pub valid_until: Instant,
    /// Fires when the backend learns the grant is gone outside of renewals
    /// (ZooKeeper session expiry). `None` for TTL backends.
    pub lost: Option<BoxFuture<'static, LostReason>>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("fencing_token", &self.fencing_token)
            .field("valid_until", &self.valid_until)
            .field("lost", &self.lost.is_some())
            .finish()
    }
}

/// The answer to a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
pub enum Release {
    /// We held it and it is now free.
    Freed,
    /// We held it re-entrantly; this many holds remain.
    StillHeld(u32),
    /// We no longer held it (expired, or taken by someone else).
    NotHeld,
}

/// Why a lock was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal found the key gone or owned by someone else.
    Stolen,
    /// Renewals failed until the lease ran out.
    RenewalFailed,
    /// A fixed lease ran out before release.
    LeaseExpired,
    /// The session that carried the lock expired (ZooKeeper).
    SessionExpired,
    /// The watchdog stopped renewing at the acquire's `max_hold` and the
    /// lease ran out.
    MaxHoldExceeded,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::Stolen => "the key is gone or owned by someone else",
            LostReason::RenewalFailed => "renewals failed until the lease ran out",
            LostReason::LeaseExpired => "the lease ran out before release",
            LostReason::SessionExpired => "the session holding the lock expired",
            LostReason::MaxHoldExceeded => "held longer than its max_hold; the watchdog stopped renewing",
        })
    }
}

/// A coordination service that can grant, renew and release leases.
///
/// Implementations must make every step atomic on the service, check the
/// owner on renew and release, and wait for wake-ups without polling at a
/// fixed interval. See the module docs for the cancellation contract.
pub trait Backend: std::any::Any + Send + Sync + std::fmt::Debug {
    /// `memory`, `redis`, `redlock` or `zookeeper`.
    fn name(&self) -> &'static str;

    /// Takes the lock, waiting until `req.deadline` for it to come free.
    ///
    /// Returns [`Error::Busy`] when `req.deadline` is `None` and the key is
    /// held, [`Error::Timeout`] when the deadline passes, and
    /// [`Error::Cancelled`] when `cancel` fires during a wait.
    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>>;

    /// Extends our lease on `key` to `lease` from now, if we still hold it.
    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>>;

    /// Gives back one hold on `key`, if `owner` still has it.
    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>>;

    /// One attempt answered on the spot, for a backend that needs no I/O for
    /// it (the in-process table): what [`acquire`](Backend::acquire) with no
    /// deadline would return. `None` (the default): only `acquire` can tell.
    ///
    /// The engine tries this first and calls `acquire` only to wait for a
    /// key held by someone else, sparing in-process locks the boxed future
    /// and cancellation token an attempt that may suspend needs.
    fn try_acquire_now(&self, req: &AcquireRequest) -> Option<Result<Grant>> {
        let _ = req;
        None
    }

    /// [`release`](Backend::release) answered on the spot, for a backend
    /// that needs no I/O for it; `None` (the default) when it cannot be.
    fn release_now(&self, key: &LockKey, owner: &Owner) -> Option<Result<Release>> {
        let _ = (key, owner);
        None
    }
}

/// Busy or timeout, depending on whether the caller wanted to wait.
pub(crate) fn contention(req: &AcquireRequest, started: Instant) -> Error {
    match req.deadline {
        None => Error::Busy { key: req.key.to_string() },
        Some(_) => Error::Timeout { key: req.key.to_string(), waited: started.elapsed() },
    }
}
