//! The lock engine: [`Locker`] takes locks through the [`Backend`] seam and
//! hands out [`LockGuard`]s ([`MultiGuard`]s for several keys); the holds
//! (`holds.rs`) count re-entry, and one watchdog task per engine
//! (`watchdog.rs`) renews them. A backend knows nothing of guards or of the
//! watchdog.

use std::sync::Arc;

use crate::backend::Backend;
use crate::metrics::Meters;

mod all;
mod guard;
mod holds;
mod inspect;
mod locker;
mod see_through;
mod watchdog;

pub use all::MultiGuard;
pub use guard::LockGuard;
pub use inspect::{ForceUnlock, Listing, MAX_PAGE};
pub use locker::{AcquireOptions, Locker, LockerOptions, DEFAULT_LEASE};

use holds::Holds;

/// What a [`Locker`] and its guards share.
pub(crate) struct Engine {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) options: LockerOptions,
    pub(crate) holds: Arc<Holds>,
    /// What it records through the `metrics` facade (nothing without the feature).
    pub(crate) meters: Meters,
}

impl Engine {
    fn new(backend: Arc<dyn Backend>, options: LockerOptions) -> Arc<Self> {
        let meters = Meters::new(backend.name());
        Arc::new(Engine { backend, options, holds: Arc::default(), meters })
    }
}
