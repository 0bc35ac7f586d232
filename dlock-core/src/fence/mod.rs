//! Fencing checked by the storage: a write is made conditional on the
//! lock's fencing token inside the storage, so a holder whose lease ran out
//! (a GC pause, a stopped VM) cannot overwrite the work of the holder that
//! came after it. The storage keeps the highest token seen per resource and
//! refuses a lower one with [`Error::StaleToken`](crate::Error::StaleToken)
//! (`409 lock_token_stale` over HTTP); nothing is written then.
//!
//! * [`postgres`]: [`postgres::Fences::check`], first in the transaction
//!   that writes the resource (data in PostgreSQL);
//! * [`redis`]: [`redis::get`] and [`redis::set`] (a Redis value).
//!
//! Rules: check **before you read** what you will write; **every writer**
//! checks; **one lock key** (and backend, and prefix) per fenced resource,
//! since a token sequence that restarts is refused as stale until its
//! fences are deleted. Why, and the alternatives:
//! `docs/core-design.md` and `docs/database-patterns.md`.

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
