//! The single-Redis lock backend, [`RedisBackend`], on the Redis client
//! layer (`crate::redis`: connections, the restart quarantine, script
//! calls).
//!
//! * A lock is a string `prefix:{name:parts}` = `<token>:<w>:<owner>`
//!   (fencing token, whether someone waits, owner), its TTL the lease;
//!   release deletes it, so a key locked once leaves nothing behind. A
//!   second holder (shared, permits), a writer waiting for readers or a
//!   permit waiting for its turn turns it into a hash under the same name
//!   (`counted.lua`), back into a string when it is taken again with
//!   nobody left in it. A key held in one mode and asked for in another is
//!   [`Error::ModeConflict`](crate::Error::ModeConflict).
//! * Acquire, renew and release are one Lua script each (`script.rs`), the
//!   owner checked inside; a refused acquire returns the holder's remaining
//!   TTL. On a single server or Sentinel master, the operations of many
//!   tasks share script calls (`batch.rs`).
//! * Tokens are `max(high-water mark + 1, server time in µs)`
//!   (`high_water.rs`): they grow strictly per key, also when the mark is
//!   lost.
//! * A release announces itself on `prefix:{name:parts}:released` when
//!   someone waits; the waiters of a process share one subscriber
//!   connection (`subscriber.rs`).
//! * Re-entry is counted by the engine: only a process's first acquire and
//!   last release reach the server.
//!
//! URLs name one server (`redis://`, `rediss://` with the feature `tls`),
//! a Sentinel-watched master (`redis+sentinel://…/master`: a failover can
//! lose a lock the old master granted) or a cluster (`redis+cluster://…`).
//! `docs/redis-design.md` has the whole design: the hash's fields, writer
//! preference, a semaphore's limit, each topology, TLS.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::wait::{acquire_loop, Attempt};
use super::{
    mode_conflict, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Holder, KeyPage, ListQuery, LockMode,
    LockState, Release, RenewRequest, Renewal,
};
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::Owner;
use crate::redis::{lease_ms, redis_error, starts_with_glob, Client, ScriptCall};

mod batch;
mod connect;
mod high_water;
mod inspect;
pub(crate) mod script;
pub(crate) mod subscriber;

pub use crate::redis::RedisOptions;

use script::{
    acquire_call, acquire_reply, lock_scripts, marker_gone, node_attempt, release_call, withdraw_call, NodeAttempt,
};
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

    /// Who holds `key` on the server (`inspect.lua`).
    pub(crate) async fn inspect_on_server(&self, key: &LockKey) -> Result<LockState> {
        let reply: Vec<String> =
            self.client.invoke(&ScriptCall::new(&lock_scripts().inspect, &[key.as_str()], 0)).await?;
        inspect::lock_state(key, &reply)
    }

    /// One page of the server's lock keys starting with `query.starts_with`
    /// (`SCAN` on every master), in the cursor of `scan.rs`.
    pub(crate) async fn list_on_server(&self, query: &ListQuery) -> Result<KeyPage> {
        let glob = starts_with_glob(&query.starts_with);
        let (found, next) = self.client.scan_page(&glob, query.cursor.as_deref(), query.limit).await?;
        let mut keys: Vec<LockKey> = found.iter().filter_map(|k| inspect::listed_lock(k, &self.prefix)).collect();
        keys.sort_unstable();
        keys.dedup();
        Ok(KeyPage::new(keys, next))
    }

    /// Frees `holder`'s hold on the server: its release, sent for it (the
    /// owner checked inside, waiters told on the lock's channel).
    pub(crate) async fn force_unlock_on_server(&self, key: &LockKey, holder: &Holder) -> Result<Release> {
        self.release_on_server(key, &holder.owner()?).await
    }
}

/// Where the acquire script keeps the last fencing token it granted.
#[derive(Debug, Clone)]
enum HighWater {
    /// One key for every lock of the prefix (a single server or master).
    Prefix(String),
    /// One key per hash slot (a cluster script may only touch its lock's slot).
    PerSlot,
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
            move || self.subscriber.register(release_channel(&req.key), req.mode),
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
            Ok(renewal(extended, sent, lease))
        })
    }

    /// The tick's renewals in shared script calls; on a cluster, one call
    /// per lock (a call touches one slot).
    fn renew_many<'a>(&'a self, holds: &'a [RenewRequest]) -> BoxFuture<'a, Vec<Result<Renewal>>> {
        Box::pin(async move {
            let Some((_, calls)) = &self.batch else {
                return futures_util::future::join_all(holds.iter().map(|h| self.renew(&h.key, &h.owner, h.lease)))
                    .await;
            };
            let asked = holds.iter().map(|h| (h.key.clone(), h.owner.clone(), lease_ms(h.lease)));
            let answers = batch::renew_all(calls, asked).await;
            answers
                .into_iter()
                .zip(holds)
                .map(|(answer, h)| answer.map(|(reply, sent)| renewal(reply.as_slice() == [1], sent, h.lease)))
                .collect()
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

    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.inspect_on_server(key))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        Box::pin(self.list_on_server(query))
    }

    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.force_unlock_on_server(key, holder))
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

/// A renewal's answer: extended from when it was sent, or lost.
fn renewal(extended: bool, sent: Instant, lease: Duration) -> Renewal {
    match extended {
        true => Renewal::Held { valid_until: sent + lease },
        false => Renewal::Lost,
    }
}
