//! The single-Redis backend.
//!
//! * A lock is a string `prefix:{name:parts}` = `<token>:<w>:<owner>`
//!   (fencing token, `1` when an acquire waits for the release, owner); its
//!   TTL is the lease. Release deletes it: a key locked once leaves nothing
//!   behind, so the server's memory follows the locks held now. An
//!   uncontended cycle costs the server five commands in two script calls:
//!   `TIME`, `SET mark GET`, `SET key NX PX GET` to take it, `GET`, `DEL`
//!   to give it back.
//! * A read lock or a permit held alone is a string like an exclusive
//!   lock, `<token>:<w><mode>:<owner>` (`0s`, `1p3`: the mode, `s` or
//!   `p<N>` for N permits, after the awaited flag), so an uncontended read
//!   or permit cycle costs the same five commands (`dlock-bench --bench
//!   primitives` measures its Redis CPU against the exclusive cycle's).
//!   A second holder, or a writer that waits for a reader, turns the key
//!   into a hash under the same name, so in the same cluster slot
//!   (`counted.lua`): `m` the mode (fixed by the first holder while anyone
//!   holds it or waits for one of its permits: another limit is
//!   [`Error::ModeConflict`] naming both), `w` = `1` once someone waited,
//!   `i` a waiting writer's intent, one field per holder, its owner =
//!   `<fence>:<expiry in server ms>`, and one per waiting permit,
//!   `~<owner>` = the end of its wait. The key expires with the latest
//!   holder, intent or wait; expired ones are dropped by the next operation
//!   that reads the hash, and the hash turns back into a string when it is
//!   taken again with nobody left in it. The same scripts serve every kind:
//!   the exclusive path runs its `SET NX GET` (and release and renew their
//!   `GET`) as `redis.pcall`, and only a `WRONGTYPE` answer, a hash, takes
//!   the counted path, so an exclusive cycle costs what it did. On a hash
//!   an operation costs `TIME`, `HGETALL` and an `HSET` or `HDEL` with a
//!   `PEXPIREAT`: O(holders and waiting permits) per operation. Tokens of
//!   every grant come from the one high-water mark.
//! * Writer preference: a writer that waits for readers records an intent
//!   (`i` = its expiry, bounded by its remaining wait, and its owner) on
//!   each try; new readers are refused while it lives, also once the last
//!   reader left (the hash stays until the intent expires or the writer
//!   takes the key). A writer that leaves without the key before its wait
//!   ends (its caller went, its acquire failed) takes it back at once (the
//!   engine's [`Backend::withdraw`]: the release script with `w`, which
//!   touches no hold), and so does a writer's release (a RedLock writer
//!   granted by a quorum leaves it on the nodes that refused it); either
//!   wakes the readers it kept out.
//! * A semaphore's limit: a permit that waits records its place (`~<owner>`,
//!   bounded by its remaining wait) on each try that finds every permit
//!   taken (the one permit of a semaphore of one, a string, becomes a hash
//!   for it). While a place lives the key stays a semaphore of that
//!   limit, also once nobody holds it: another limit, an exclusive or a
//!   shared request is [`Error::ModeConflict`], and the waiter gets its
//!   permit. A grant takes the waiter's place; so does a withdrawal or a
//!   release, as for an intent.
//! * Re-entry is counted by the engine: the server keeps one hold per key
//!   and owner, and only a process's first acquire and last release reach
//!   it.
//! * Tokens are `max(high-water mark + 1, server time in µs)`; the mark is
//!   one key per prefix, `prefix:fence` (one per hash slot in a cluster, see
//!   `high_water.rs`), so tokens grow strictly per key, and keep growing
//!   when the mark is lost in a restart, lags on a promoted replica or is
//!   deleted.
//! * Acquire, renew and release are one Lua script each (EVALSHA), with the
//!   owner checked inside the script (held by the same owner: the acquire
//!   joins the hold, same token). A refused acquire returns the holder's
//!   remaining TTL in the same call. Renewals queued while a renew call is
//!   in flight go out together in the next call, many locks per script
//!   (one per lock in a cluster, whose locks live in many slots); so do
//!   acquires and releases on a single server or Sentinel master, past 16
//!   in flight (`batch.rs`).
//! * Release publishes on `prefix:{name:parts}:released` when `w` says
//!   someone waits (uncontended releases skip it); waiters of this process
//!   share one subscriber connection (see `subscriber.rs`). The payload `a`
//!   wakes every local waiter instead of one: sent when readers waited for
//!   an exclusive hold (`w` = `2`) or a reader leaves a read-write lock.
//!   A counted key's `w` stays set while the hash lives, so a busy
//!   semaphore that was once waited for announces every release.
//!
//! All commands go through one multiplexed connection with connect and
//! response timeouts, so a dead server gives an error, never a hang. A
//! background task keeps it up (`connection.rs`): it notices a server
//! that went away within 250 ms and reconnects with a backoff capped at
//! 250 ms, so while the server is away requests fail at once, and the first
//! request after it is back finds a live connection. How each of the
//! topologies below is connected and checked is `connect.rs`.
//!
//! **Redis Cluster**: a URL `redis+cluster://host1:port1,host2:port2,…`
//! (seed nodes, `user:password@` before the first host; `rediss+cluster://`
//! for TLS, verified against the system trust store) uses redis-rs's async cluster connection. Every key of one
//! lock shares a hash tag, so each script runs on the one node that owns the
//! lock's slot; release announcements are ordinary `PUBLISH`es, which a
//! cluster forwards to every node, so the waiters of a process subscribe on
//! one connection to the first seed node. A node that is down makes the
//! locks of its slots fail with a backend error; the others keep working.
//!
//! **Redis Sentinel**: `redis+sentinel://[user:password@]host:port,…/master`
//! asks the Sentinels for the master, and asks again when the connection
//! fails or the server answers `READONLY` (it was demoted by a failover);
//! the subscriber follows to the new master. Replication is asynchronous, so
//! a failover can lose a lock that the old master granted: Sentinel buys
//! availability, not safety.
//!
//! **TLS** (feature `tls`): `rediss://` connects with TLS (redis-rs over
//! native-tls, i.e. the system OpenSSL), verifying the server against the
//! system trust store or the CA of [`RedisOptions::with_tls`]; the same
//! material serves the subscriber connection. A handshake that fails at
//! start-up is an [`Error::Config`] that says it is a TLS/certificate
//! problem. Without the feature a `rediss://` URL is refused at start-up.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub(crate) use super::mode_conflict;
use super::wait::{acquire_loop, Attempt};
use super::{redact, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, LockMode, Release, Renewal};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

mod batch;
mod client;
mod connect;
mod connection;
mod high_water;
mod restart;
pub(crate) mod script;
pub(crate) mod subscriber;
pub(crate) mod tls;

pub use connect::RedisOptions;
pub(crate) use tls::RedisTls;

pub(crate) use client::Client;
pub(crate) use connection::RedisConnection;
pub(crate) use connection::{lost_connection, redis_error, Conn};
pub(crate) use restart::RestartGuard;
use script::{acquire_call, acquire_reply, lock_scripts, release_call, withdraw_call, Reply, ScriptCall};
use subscriber::Subscriber;

/// Locks in one Redis server.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use std::sync::Arc;
/// use dlock_core::{Locker, LockerOptions};
/// use dlock_core::backend::redis::RedisBackend;
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379", "dlock").await?;
/// let locker = Locker::with_options(Arc::new(backend), LockerOptions::default())?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    /// Every command goes through it, the restart quarantine inside.
    client: Client,
    /// The key namespace its channels are subscribed under.
    prefix: Arc<str>,
    /// Where the last fencing token is kept (see `high_water.rs`).
    high_water: HighWater,
    pub(crate) subscriber: Subscriber,
    /// Acquires, releases and renewals gathered into shared script calls,
    /// on a single server or Sentinel master (see `batch.rs`).
    batch: Option<(batch::Batcher, batch::Calls)>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend").finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// The client every command goes through, shared with the idempotency
    /// store (same cluster routing, Sentinel failovers and quarantine) and
    /// with RedLock (its write-back of tokens).
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// One try on the server.
    async fn try_once(&self, req: &AcquireRequest, awaited: bool) -> Result<Attempt> {
        let attempt = match &self.batch {
            Some((batcher, calls)) => self.try_batched(batcher, calls, req, awaited).await?,
            None => self.try_on_node(req, awaited).await?,
        };
        match attempt {
            NodeAttempt::Granted { grant } => Ok(Attempt::Acquired(grant)),
            NodeAttempt::Held { retry_in } => Ok(Attempt::Held { retry_in }),
            NodeAttempt::Conflict { held } => Err(mode_conflict(req, held)),
        }
    }

    /// Loads the lock scripts into the server's script cache. A script
    /// missing from it costs its first call two more round trips (EVALSHA
    /// answered NOSCRIPT, then SCRIPT LOAD and EVALSHA again), which on a
    /// slow RedLock node is enough to miss the node timeout.
    pub(crate) async fn load_scripts(&self) -> Result<()> {
        let mut conn = self.client.conn().clone();
        let scripts = lock_scripts();
        for script in [&scripts.acquire, &scripts.renew, &scripts.release] {
            script.prepare_invoke().load_async(&mut conn).await.map_err(redis_error)?;
        }
        Ok(())
    }

    /// One acquire script call. `awaited`: the caller waits for releases,
    /// so the lock's release must announce itself (see `wait::acquire_loop`).
    pub(crate) async fn try_on_node(&self, req: &AcquireRequest, awaited: bool) -> Result<NodeAttempt> {
        let slot_mark;
        let mark = match &self.high_water {
            HighWater::Prefix(mark) => mark.as_str(),
            HighWater::PerSlot => {
                slot_mark = high_water::slot_mark(&req.key);
                slot_mark.as_str()
            }
        };
        let attempt = || async {
            let sent = Instant::now();
            let call = acquire_call(&lock_scripts().acquire, req, mark, self.client.marker(), awaited);
            let reply = acquire_reply(self.client.invoke(&call).await?)?;
            Ok((reply, sent))
        };
        let (reply, sent) = self.client.guarded(attempt, marker_gone).await?;
        node_attempt(reply.as_slice(), sent, req.lease)
    }

    /// [`try_on_node`](Self::try_on_node) through the batcher: in one
    /// script call with the acquires of other tasks queued at the same time.
    async fn try_batched(
        &self,
        batcher: &batch::Batcher,
        calls: &batch::Calls,
        req: &AcquireRequest,
        awaited: bool,
    ) -> Result<NodeAttempt> {
        let attempt = || batcher.run(calls, batch::Op::Acquire { req: req.clone(), awaited });
        let (reply, sent) = self.client.guarded(attempt, marker_gone).await?;
        node_attempt(reply.as_slice(), sent, req.lease)
    }
}

/// The acquire scripts' answer when the data marker is gone.
fn marker_gone((reply, _): &(Reply, Instant)) -> bool {
    reply.as_slice() == [2]
}

impl RedisBackend {
    /// [`release_on_server`](Self::release_on_server) through the
    /// batcher, where there is one.
    async fn release_batched(&self, key: &LockKey, owner: &Owner) -> Result<Release> {
        let Some((batcher, calls)) = &self.batch else {
            return self.release_on_server(key, owner).await;
        };
        let op = batch::Op::Release { key: key.clone(), owner: owner.clone() };
        let (reply, _) = batcher.run(calls, op).await?;
        Ok(if reply.as_slice() == [0] { Release::Freed } else { Release::NotHeld })
    }

    /// Frees `key` on the server if `owner` holds it there.
    pub(crate) async fn release_on_server(&self, key: &LockKey, owner: &Owner) -> Result<Release> {
        let left: i64 = self.client.invoke(&release_call(&lock_scripts().release, key, owner)).await?;
        Ok(if left == 0 { Release::Freed } else { Release::NotHeld })
    }

    /// Takes back what the waits of `owner` left on `key` on the server (a
    /// writer's intent, a waiting permit's place; never a hold), waking the
    /// readers an intent kept out. Whether there was any.
    pub(crate) async fn withdraw_on_server(&self, key: &LockKey, owner: &Owner) -> Result<bool> {
        #[cfg(feature = "broken-variants")]
        if crate::broken_variants::is_on(crate::broken_variants::Switch::IntentNeverWithdrawn) {
            return Ok(false);
        }
        let left: i64 = self.client.invoke(&withdraw_call(&lock_scripts().release, key, owner)).await?;
        Ok(left == 0)
    }
}

/// An acquire script's reply for one lock, sent at `sent`.
fn node_attempt(reply: &[i64], sent: Instant, lease: Duration) -> Result<NodeAttempt> {
    Ok(match reply {
        // Held in a mode that does not fit the one asked for: -1 exclusive,
        // 0 shared, N one of N permits.
        [3, held] => NodeAttempt::Conflict {
            held: match u32::try_from(*held) {
                Ok(0) => LockMode::Shared,
                Ok(limit) => LockMode::Permits { limit },
                Err(_) => LockMode::Exclusive,
            },
        },
        // The third value tells a fresh grant (1) from one that joined a
        // hold of the same owner (2), which keeps its token: either is ours.
        [1, token, _] => NodeAttempt::Granted { grant: Grant::until(u64::try_from(*token).unwrap_or(0), sent + lease) },
        // PTTL: -2 gone since (try again now), -1 no TTL (wait for a release).
        [0, -2] => NodeAttempt::Held { retry_in: Some(Duration::ZERO) },
        [0, ms] if *ms >= 0 => NodeAttempt::Held { retry_in: Some(Duration::from_millis(*ms as u64)) },
        [0, _] => NodeAttempt::Held { retry_in: None },
        other => return Err(Error::backend("redis", format!("unexpected reply from the acquire script: {other:?}"))),
    })
}

/// Where the acquire script keeps the last fencing token it granted.
#[derive(Debug, Clone)]
enum HighWater {
    /// One key for every lock of the prefix (a single server or master).
    Prefix(String),
    /// One key per hash slot (a cluster script may only touch its lock's slot).
    PerSlot,
}

/// One node's answer to an acquire.
#[derive(Debug)]
pub(crate) enum NodeAttempt {
    Granted {
        grant: Grant,
    },
    Held {
        retry_in: Option<Duration>,
    },
    /// Held (by others, or by this owner) in `held`, which does not fit the
    /// mode asked for: a mistake of the program, not contention.
    Conflict {
        held: LockMode,
    },
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    /// Every mode.
    fn supports(&self, _: LockMode) -> Result<()> {
        Ok(())
    }

    fn prefix(&self) -> Option<&str> {
        Some(&self.prefix)
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(acquire_loop(
            req,
            cancel,
            || self.subscriber.waited_on(|| release_channel(&req.key)),
            move |awaited| self.try_once(req, awaited),
            move || self.subscriber.register(release_channel(&req.key)),
        ))
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        Box::pin(async move {
            let (extended, sent) = match &self.batch {
                Some((batcher, calls)) => {
                    let op = batch::Op::Renew { key: key.clone(), owner: owner.clone(), lease_ms: lease_ms(lease) };
                    let (reply, sent) = batcher.run(calls, op).await?;
                    (reply.as_slice() == [1], sent)
                }
                None => {
                    // A cluster: one script call touches one slot, and the
                    // locks renewed together may live in many. One call per lock.
                    let sent = Instant::now();
                    let mut call = ScriptCall::new(&lock_scripts().renew, &[key.as_str()], 2);
                    call.arg(owner.as_str()).arg(lease_ms(lease));
                    let extended: Vec<i64> = self.client.invoke(&call).await?;
                    (extended == [1], sent)
                }
            };
            Ok(match extended {
                true => Renewal::Held { valid_until: sent + lease },
                false => Renewal::Lost,
            })
        })
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.release_batched(key, owner))
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.client.ready())
    }

    /// A writer's intent and a waiting permit's place; a waiting reader
    /// leaves nothing, and costs no round trip.
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if req.mode == LockMode::Shared {
                return Ok(());
            }
            self.withdraw_on_server(&req.key, &req.owner).await.map(drop)
        })
    }
}

/// The high-water mark of fencing tokens that a Redis Cluster keeps for
/// the slot of `key` (same slot as `key`); a single server keeps one for
/// the whole prefix instead, [`prefix_fence_key`].
///
/// It names how locks are stored in Redis, which may change between
/// releases: public only in [`test_support`](crate::test_support).
#[cfg(feature = "test-support")]
pub(crate) fn fence_key(key: &LockKey) -> String {
    high_water::slot_mark(key)
}

/// The high-water mark of fencing tokens that a single server (a Sentinel
/// master, a RedLock node) keeps for every lock under `prefix`.
///
/// Crate-private for the same reason as [`fence_key`].
pub(crate) fn prefix_fence_key(prefix: &str) -> String {
    high_water::prefix_mark(prefix)
}

/// The channel a release of `key` is announced on (the release scripts
/// name it themselves: `KEYS[1] .. ':released'`).
pub(crate) fn release_channel(key: &LockKey) -> String {
    format!("{key}:released")
}

/// A duration as whole milliseconds for `PX` / `PEXPIRE`, at least 1 (0 is
/// an error there).
pub(crate) fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://***@host:6379/0");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }
}
