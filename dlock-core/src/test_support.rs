//! Hooks for dlock's own tests and torture harness (feature `test-support`),
//! never for an application: each names how a backend stores its locks,
//! which may change in any release, so that a test can inspect or damage it
//! from outside.

#[cfg(feature = "zookeeper")]
use crate::backend::zookeeper::ZooKeeperBackend;
use crate::key::LockKey;

/// The key of the fencing-token high-water mark a Redis Cluster keeps for
/// the slot of `key`.
#[cfg(feature = "redis")]
pub fn fence_key(key: &LockKey) -> String {
    crate::backend::redis::fence_key(key)
}

/// The key of the fencing-token high-water mark a single Redis server (a
/// Sentinel master, a RedLock node) keeps for every lock under `prefix`.
#[cfg(feature = "redis")]
pub fn prefix_fence_key(prefix: &str) -> String {
    crate::backend::redis::prefix_fence_key(prefix)
}

/// The session of a ZooKeeper backend, to expire it from a twin connection
/// (as a partition longer than the session timeout would).
#[cfg(feature = "zookeeper")]
pub fn zookeeper_session(backend: &ZooKeeperBackend) -> zookeeper_client::SessionInfo {
    backend.session_info()
}

/// The container node of `key` in ZooKeeper.
#[cfg(feature = "zookeeper")]
pub fn zookeeper_lock_path(backend: &ZooKeeperBackend, key: &LockKey) -> String {
    backend.lock_path(key)
}

/// The acquires of this PostgreSQL backend (its process) parked waiting
/// for `key` now, so a test can wait for a waiter to park instead of
/// sleeping.
#[cfg(feature = "postgres")]
pub fn postgres_waiters(backend: &crate::backend::postgres::PostgresBackend, key: &LockKey) -> usize {
    backend.waiters(key)
}

/// The acquires of this Redis backend (its process) waiting for `key` now:
/// a waiter counts from before its first try after subscribing, so a
/// release after a test saw it counted wakes it or is seen by that try.
#[cfg(feature = "redis")]
pub fn redis_waiters(backend: &crate::backend::redis::RedisBackend, key: &LockKey) -> usize {
    backend.subscriber.waiters(&crate::backend::redis::release_channel(key))
}
