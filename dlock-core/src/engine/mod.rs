//! The lock engine: what turns a backend's grants into held locks.
//!
//! * [`Locker`] (`locker.rs`) takes a lock through the [`Backend`] seam,
//!   answering on the spot when the backend can and waiting otherwise, and
//!   hands out a [`LockGuard`];
//! * [`LockGuard`] (`guard.rs`) owns one held lock: its fencing token, its
//!   [`LostSignal`](crate::LostSignal) and its release;
//! * [`Locker::acquire_all`] (`all.rs`) takes several keys all or none, in
//!   one global order, and hands out a [`MultiGuard`];
//! * the holds (`holds.rs`) are every lock this process holds, once per key
//!   and owner: re-entry is counted there, and only a first acquire and a
//!   last release reach the backend;
//! * the watchdog (`watchdog.rs`) renews every hold granted until an
//!   instant in watchdog mode, one task per engine, scheduling the same
//!   holds.
//!
//! The engine depends on the seam (`backend/`), never the other way round:
//! a backend knows nothing of guards or of the watchdog.

use std::sync::Arc;

use crate::backend::Backend;

mod all;
mod guard;
mod holds;
mod locker;
mod see_through;
mod watchdog;

pub use all::MultiGuard;
pub use guard::LockGuard;
pub use locker::{AcquireOptions, Locker, LockerOptions, DEFAULT_LEASE};

use holds::Holds;

/// What a [`Locker`] and its guards share.
pub(crate) struct Engine {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) options: LockerOptions,
    pub(crate) holds: Arc<Holds>,
}

impl Engine {
    fn new(backend: Arc<dyn Backend>, options: LockerOptions) -> Arc<Self> {
        Arc::new(Engine { backend, options, holds: Arc::default() })
    }
}
