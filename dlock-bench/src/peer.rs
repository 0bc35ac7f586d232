//! A peer with Redisson's lock semantics, written from their description
//! (`research/review-2026-11-24/anchors.md` §3), so that dlock is measured
//! against what the most used re-entrant Redis lock does per cycle, not only
//! against locks that do less than dlock.
//!
//! * The lock is a hash: one field per owner (Redisson's `uuid:threadId`;
//!   here a random client id and the bench's slot, which plays the thread),
//!   holding that owner's re-entry count.
//! * Acquire is one script ([`PEER_ACQUIRE`]): grants when the key is absent
//!   or the caller already holds it, answers the remaining `PTTL` otherwise.
//! * Release is one script ([`PEER_RELEASE`]) guarded by an unlock latch,
//!   a key per release request that makes a retried release a no-op, then a
//!   separate `DEL` of that latch from the client. On the last hold the
//!   script deletes the lock and `PUBLISH`es on the lock's channel.
//!
//! Single-server topology, so no `WAIT` after the scripts, and scripts are
//! sent by `EVALSHA` on the same multiplexed connection as the hand-written
//! baselines. No waiting acquire: only the uncontended row measures it.

use std::sync::atomic::{AtomicU64, Ordering};

use dlock_core::Owner;
use redis::aio::MultiplexedConnection;
use redis::Script;

use crate::error::{BenchError, Result};
use crate::locks::{existing_keys, scan, BenchLock, LEASE};

/// `KEYS[1]` the lock; `ARGV[1]` lease ms, `ARGV[2]` owner. `nil` when
/// granted (the owner's count incremented, the lease restarted), otherwise
/// the holder's remaining lease in ms.
pub(crate) const PEER_ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return nil
end
return redis.call('PTTL', KEYS[1])";

/// `KEYS[1]` the lock, `KEYS[2]` its channel, `KEYS[3]` the latch of this
/// release request; `ARGV[1]` owner, `ARGV[2]` lease ms, `ARGV[3]` latch
/// TTL ms. `nil` when the owner holds nothing, 0 when holds remain, 1 when
/// this was the last one. A request whose latch exists answers what it
/// answered the first time and changes nothing; the latch is set on both
/// paths, since a retried non-final release must not take a second hold.
pub(crate) const PEER_RELEASE: &str = r"
local done = redis.call('GET', KEYS[3])
if done then
  return tonumber(done)
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return nil
end
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[3], '0', 'PX', ARGV[3])
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[2], '0')
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 1";

/// How long an unlock latch outlives a release whose client never deleted
/// it: long enough for a client's retries, short enough not to pile up.
const LATCH_TTL_MS: u64 = 10_000;

/// Commands only [`PEER_ACQUIRE`] and [`PEER_RELEASE`] issue. `DEL` is also
/// sent by the client (the latch), which [`PeerLock::latch_dels`] counts.
const PEER_SCRIPT_COMMANDS: &[&str] =
    &["exists", "hexists", "hincrby", "pexpire", "pttl", "get", "set", "del", "publish"];

/// What a release answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// The owner held nothing (or its lease ran out).
    NotHeld,
    /// One hold given back, others remain.
    StillHeld,
    /// The last hold: the lock is gone and its channel was told.
    Freed,
}

/// The Redisson-semantics lock over `slots` keys named `name:0`, `name:1`, …
pub(crate) struct PeerLock {
    conn: MultiplexedConnection,
    /// The keys' common prefix.
    name: String,
    keys: Vec<String>,
    channels: Vec<String>,
    /// The client id that, with a slot, makes an owner field.
    client: String,
    next_request: AtomicU64,
    acquire: Script,
    release: Script,
    /// Latch `DEL`s this client sent, so that the command counts can tell
    /// them from the script's `DEL` of the lock.
    latch_dels: AtomicU64,
}

impl std::fmt::Debug for PeerLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLock").field("keys", &self.keys.len()).finish_non_exhaustive()
    }
}

impl PeerLock {
    /// Tries once; for the uncontended row.
    pub(crate) fn try_once(conn: MultiplexedConnection, name: &str, slots: usize) -> Result<Self> {
        Self::with_release(conn, name, slots, PEER_RELEASE)
    }

    fn with_release(conn: MultiplexedConnection, name: &str, slots: usize, release: &str) -> Result<Self> {
        let keys: Vec<String> = (0..slots).map(|i| format!("{name}:{i}")).collect();
        Ok(PeerLock {
            conn,
            name: name.to_owned(),
            channels: keys.iter().map(|k| format!("{k}:channel")).collect(),
            keys,
            client: Owner::random()?.as_str().to_owned(),
            next_request: AtomicU64::new(0),
            acquire: Script::new(PEER_ACQUIRE),
            release: Script::new(release),
            latch_dels: AtomicU64::new(0),
        })
    }

    fn key(&self, slot: usize) -> Result<&str> {
        self.keys.get(slot).map(String::as_str).ok_or_else(|| BenchError::Invariant(format!("no lock slot {slot}")))
    }

    fn owner(&self, slot: usize) -> String {
        format!("{}:{slot}", self.client)
    }

    /// One acquire attempt: `Ok(None)` when granted, else the holder's
    /// remaining lease in ms.
    pub(crate) async fn try_acquire(&self, slot: usize) -> Result<Option<i64>> {
        let ttl: Option<i64> = self
            .acquire
            .key(self.key(slot)?)
            .arg(LEASE.as_millis() as u64)
            .arg(self.owner(slot))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(ttl)
    }

    /// A fresh release request id, unique per release.
    fn request(&self) -> String {
        format!("{}-{}", self.client, self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    /// The release script for request `request` only, without the latch's
    /// `DEL`: what a client that lost the reply would resend.
    async fn release_script(&self, slot: usize, request: &str) -> Result<Released> {
        let key = self.key(slot)?;
        let reply: Option<i64> = self
            .release
            .key(key)
            .key(&self.channels[slot])
            .key(format!("{key}:unlock-latch:{request}"))
            .arg(self.owner(slot))
            .arg(LEASE.as_millis() as u64)
            .arg(LATCH_TTL_MS)
            .invoke_async(&mut self.conn.clone())
            .await?;
        match reply {
            None => Ok(Released::NotHeld),
            Some(0) => Ok(Released::StillHeld),
            Some(1) => Ok(Released::Freed),
            Some(other) => Err(BenchError::Invariant(format!("peer: the release script answered {other}"))),
        }
    }

    /// A whole release as Redisson's client makes it: the script, then `DEL`
    /// of the request's latch.
    pub(crate) async fn release_request(&self, slot: usize, request: &str) -> Result<Released> {
        let released = self.release_script(slot, request).await?;
        let _: i64 = redis::cmd("DEL")
            .arg(format!("{}:unlock-latch:{request}", self.key(slot)?))
            .query_async(&mut self.conn.clone())
            .await?;
        self.latch_dels.fetch_add(1, Ordering::Relaxed);
        Ok(released)
    }
}

impl BenchLock for PeerLock {
    type Held = usize;

    async fn acquire(&self, slot: usize, wait: bool) -> Result<usize> {
        if wait {
            return Err(BenchError::Invariant("peer: no waiting acquire (only the uncontended row uses it)".into()));
        }
        match self.try_acquire(slot).await? {
            None => Ok(slot),
            Some(ttl) => Err(BenchError::Invariant(format!(
                "peer: `{}` was held ({ttl} ms left) on an uncontended acquire",
                self.key(slot)?
            ))),
        }
    }

    async fn release(&self, slot: usize) -> Result<()> {
        match self.release_request(slot, &self.request()).await? {
            Released::Freed => Ok(()),
            other => Err(BenchError::Invariant(format!(
                "peer: a release of a single hold on `{}` answered {other:?}",
                self.key(slot)?
            ))),
        }
    }

    fn script_internal_commands(&self) -> &'static [&'static str] {
        PEER_SCRIPT_COMMANDS
    }

    fn client_sent_script_commands(&self) -> Option<&AtomicU64> {
        Some(&self.latch_dels)
    }

    async fn leftovers(&self, conn: &MultiplexedConnection) -> Result<Vec<String>> {
        let mut left = existing_keys(conn, &self.keys).await?;
        // Every release deletes its latch, so none may outlive the row.
        left.extend(scan(conn, &format!("{}:*:unlock-latch:*", self.name)).await?);
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dlock_testing::RedisServer;
    use futures_util::StreamExt;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
    }

    async fn connect(server: &RedisServer) -> MultiplexedConnection {
        let client = redis::Client::open(server.url()).expect("a client");
        client.get_multiplexed_async_connection().await.expect("connect to the test redis-server")
    }

    async fn holds(conn: &MultiplexedConnection, lock: &PeerLock, slot: usize) -> Option<i64> {
        redis::cmd("HGET")
            .arg(&lock.keys[slot])
            .arg(lock.owner(slot))
            .query_async(&mut conn.clone())
            .await
            .expect("HGET")
    }

    async fn exists(conn: &MultiplexedConnection, key: &str) -> bool {
        redis::cmd("EXISTS").arg(key).query_async(&mut conn.clone()).await.expect("EXISTS")
    }

    #[test]
    fn re_entry_counts_and_the_last_release_frees() {
        let server = RedisServer::start();
        runtime().block_on(async {
            let conn = connect(&server).await;
            let lock = PeerLock::try_once(conn.clone(), "t:reentry", 1).expect("lock");
            let other = PeerLock::try_once(conn.clone(), "t:reentry", 1).expect("another client");
            assert_eq!(lock.try_acquire(0).await.expect("acquire"), None);
            assert_eq!(lock.try_acquire(0).await.expect("re-enter"), None);
            assert_eq!(holds(&conn, &lock, 0).await, Some(2));
            let ttl = other.try_acquire(0).await.expect("another owner's attempt");
            assert!(ttl.is_some_and(|t| t > 0 && t <= LEASE.as_millis() as i64), "refused with the PTTL: {ttl:?}");

            assert_eq!(lock.release_request(0, "r1").await.expect("release"), Released::StillHeld);
            assert_eq!(holds(&conn, &lock, 0).await, Some(1));
            assert_eq!(lock.release_request(0, "r2").await.expect("release"), Released::Freed);
            assert!(!exists(&conn, "t:reentry:0").await, "the last release deletes the lock");
            assert_eq!(lock.release_request(0, "r3").await.expect("release"), Released::NotHeld);
            assert_eq!(other.try_acquire(0).await.expect("free now"), None);
        });
    }

    #[test]
    fn a_repeated_release_request_is_a_no_op() {
        let server = RedisServer::start();
        runtime().block_on(async {
            let conn = connect(&server).await;
            let lock = PeerLock::try_once(conn.clone(), "t:latch", 1).expect("lock");
            let other = PeerLock::try_once(conn.clone(), "t:latch", 1).expect("another client");
            let latch = |request: &str| format!("t:latch:0:unlock-latch:{request}");
            for _ in 0..2 {
                assert_eq!(lock.try_acquire(0).await.expect("acquire"), None);
            }
            // A client that lost the reply resends the same request: one hold
            // is given back, not two.
            assert_eq!(lock.release_script(0, "a").await.expect("release"), Released::StillHeld);
            assert_eq!(lock.release_script(0, "a").await.expect("resent"), Released::StillHeld);
            assert_eq!(holds(&conn, &lock, 0).await, Some(1));
            let ttl: i64 = redis::cmd("PTTL").arg(latch("a")).query_async(&mut conn.clone()).await.expect("PTTL");
            assert!(ttl > 0 && ttl <= LATCH_TTL_MS as i64, "the latch expires on its own: {ttl}");

            // The last hold, then a resend after someone else took the lock:
            // the latch answers, the new holder keeps its lock.
            assert_eq!(lock.release_script(0, "b").await.expect("release"), Released::Freed);
            assert_eq!(other.try_acquire(0).await.expect("free now"), None);
            assert_eq!(lock.release_script(0, "b").await.expect("resent"), Released::Freed);
            assert_eq!(holds(&conn, &other, 0).await, Some(1), "a resent release freed another owner's lock");

            // The whole release deletes its latch afterwards.
            assert_eq!(other.release_request(0, "c").await.expect("release"), Released::Freed);
            assert!(!exists(&conn, &latch("c")).await, "the client's DEL removes the latch");
            assert_eq!(other.latch_dels.load(Ordering::Relaxed), 1);
        });
    }

    #[test]
    fn only_the_last_release_publishes() {
        let server = RedisServer::start();
        runtime().block_on(async {
            let conn = connect(&server).await;
            let client = redis::Client::open(server.url()).expect("a client");
            let mut pubsub = client.get_async_pubsub().await.expect("pub/sub connection");
            pubsub.subscribe("t:pub:0:channel").await.expect("SUBSCRIBE");
            let mut messages = pubsub.into_on_message();
            let lock = PeerLock::try_once(conn.clone(), "t:pub", 1).expect("lock");
            for _ in 0..2 {
                assert_eq!(lock.try_acquire(0).await.expect("acquire"), None);
            }
            assert_eq!(lock.release_request(0, "1").await.expect("release"), Released::StillHeld);
            let early = tokio::time::timeout(Duration::from_millis(200), messages.next()).await;
            assert!(early.is_err(), "a release that leaves a hold must not publish");
            assert_eq!(lock.release_request(0, "2").await.expect("release"), Released::Freed);
            let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
                .await
                .expect("the last release publishes")
                .expect("a message");
            assert_eq!(message.get_channel_name(), "t:pub:0:channel");
        });
    }

    /// The uncontended row's check after each window: a peer whose release
    /// never deletes the lock still completes every cycle (the owner's field
    /// stays, so it re-enters), and only the leftover keys give it away.
    #[test]
    fn the_bench_fails_a_release_that_never_deletes() {
        let server = RedisServer::start();
        runtime().block_on(async {
            let env = crate::env::Env::connect(&server.url(), crate::pin::Pinning::Off("a test".into()))
                .await
                .expect("the bench's environment");
            let timing =
                crate::measure::Timing { warmup: Duration::from_millis(10), duration: Duration::from_millis(50) };
            let sound = PeerLock::try_once(env.conn.clone(), "t:sound", 4).expect("lock");
            let sample = crate::uncontended::measure_redis(&env, sound, 4, timing).await.expect("a sound peer passes");
            assert!(sample.ops > 0);

            let broken_script = PEER_RELEASE.replace("redis.call('DEL', KEYS[1])\n", "");
            assert_ne!(broken_script, PEER_RELEASE, "the test must remove the DEL");
            let broken = PeerLock::with_release(env.conn.clone(), "t:broken", 4, &broken_script).expect("lock");
            match crate::uncontended::measure_redis(&env, broken, 4, timing).await {
                Err(BenchError::Invariant(m)) => assert!(m.contains("lock keys left"), "{m}"),
                other => panic!("a peer that never deletes its lock passed the bench: {other:?}"),
            }
        });
    }
}
