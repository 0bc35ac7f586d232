//! dlock-core: distributed locks for services that must not do the same work
//! twice. A [`Locker`] takes a lock through a [`Backend`](backend::Backend)
//! (in process, Redis, RedLock, ZooKeeper, PostgreSQL) and returns a
//! [`LockGuard`] with a fencing token and a lost-lock signal; waits are
//! woken by events, and watchdog mode renews the lease while the guard
//! lives. [`Config::from_env`] reads `DLOCK_*`, and [`Config::build`]
//! connects a [`DlockRuntime`]. Guide: `docs/core-api.md`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
//! use dlock_core::{AcquireOptions, Config};
//! use std::time::Duration;
//!
//! let dlock = Config::from_env()?.build().await?; // in process unless DLOCK_BACKEND says otherwise
//! let locker = dlock.locker();
//! let key = locker.key("order.create").part(42).part("token-1").build()?;
//! let guard = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await?;
//! assert!(guard.fencing_token() > 0);
//! guard.release().await?;
//! # Ok(()) }
//! ```

pub mod backend;
#[cfg(feature = "broken-variants")]
pub mod broken_variants;
mod config;
mod connect;
mod engine;
mod error;
pub mod fence;
pub mod idempotency;
mod key;
pub mod metrics;
mod owner;
#[cfg(feature = "postgres")]
mod postgres;
mod redact;
#[cfg(feature = "redis")]
mod redis;
mod runtime;
#[cfg(feature = "test-support")]
pub mod test_support;

pub use backend::lost::LostReason;
pub use backend::memory::MemoryBackend;
pub use backend::{LockMode, LostSignal};
pub use config::{BackendKind, Config, ZooKeeperAuth};
pub use engine::{
    AcquireOptions, ForceUnlock, Listing, LockGuard, Locker, LockerOptions, MultiGuard, DEFAULT_LEASE, MAX_PAGE,
};
pub use error::{Error, Result};
pub use key::{escape_into, KeyBuilder, KeyLogId, KeyPart, LockKey, MAX_KEY_LEN};
pub use owner::Owner;
pub use runtime::{
    DlockRuntime, Readiness, ReadinessCheck, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_IDEMPOTENCY_TTL, DEFAULT_MAX_BODY_BYTES,
};

#[cfg(feature = "redis")]
pub use redis::RedisTls;
