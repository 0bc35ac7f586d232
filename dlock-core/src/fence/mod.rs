//! Fencing checked by the storage: a write is made conditional on the
//! lock's fencing token, inside the storage, so a holder whose lease ran
//! out cannot overwrite the work of the holder that came after it.
//!
//! A lease is a promise about time, and a process can be paused (a GC, a
//! stopped VM, a slow network) past the end of its lease without noticing:
//! another holder takes the lock, both believe they hold it, and the stale
//! one's write lands after the new one's (the failure Martin Kleppmann
//! describes in "How to do distributed locking"). Every grant carries a
//! fencing token greater than every earlier grant's of the same key
//! ([`LockGuard::fencing_token`](crate::LockGuard::fencing_token)); these
//! helpers keep, per protected resource, the highest token the storage has
//! seen, and refuse an access with a lower one as
//! [`Error::StaleToken`](crate::Error::StaleToken) (HTTP: dlock-axum answers
//! it `409 lock_token_stale`). Nothing is written when it is refused.
//!
//! * [`postgres`] (feature `postgres`): [`postgres::Fences::check`], one
//!   statement at the start of the caller's own transaction; the row it
//!   locks orders the transactions of the resource.
//! * [`redis`] (feature `redis`): [`redis::get`] and [`redis::set`], one
//!   script each call, the highest token in a companion key.
//!
//! # Rules
//!
//! * **Check before you read.** A fenced read-modify-write is safe when the
//!   read comes after the check (Postgres: after [`postgres::Fences::check`]
//!   in the same transaction; Redis: through [`redis::get`], which raises
//!   the mark like a write). A read before it may see the state a newer
//!   holder is about to replace, and the write computed from it would
//!   lose that holder's update although every write carried a good token.
//! * **Every writer checks.** One writer of the resource that skips the
//!   check can overwrite anything.
//! * **One token source per resource.** Tokens are compared as numbers of
//!   one lock key's sequence. Use one lock key per fenced resource, keep
//!   its backend and prefix; the fences outlive the lock service's state,
//!   so a sequence that restarts (the in-process backend restarts at 1
//!   with its process; a switch to another backend) is refused as stale
//!   until the fences of its resources are deleted.
//!
//! # Which to pick
//!
//! [`postgres`] when the protected data lives in Postgres: the check joins
//! the transaction of the writes, so the writes and the fence commit or
//! roll back together. [`redis`] when the data is a Redis value read and
//! written whole. For a single-statement write to a row of your own, a
//! guarded update does the same without a fences table (see
//! [`postgres`]). `docs/database-patterns.md` compares these with a unique
//! index, a `version` column and `SELECT … FOR UPDATE`.

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
