//! The single-Redis backend.
//!
//! * A lock is a string `prefix:{name:parts}` = `<token>:<w>:<owner>`
//!   (fencing token, `1` when an acquire waits for the release, owner); its
//!   TTL is the lease. Release deletes it: a key locked once leaves nothing
//!   behind, so the server's memory follows the locks held now. An
//!   uncontended cycle costs the server five commands in two script calls:
//!   `TIME`, `SET mark GET`, `SET key NX PX GET` to take it, `GET`, `DEL`
//!   to give it back.
//! * Re-entry is counted by the engine: the server keeps one hold per key,
//!   and only a process's first acquire and last release reach it.
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
//!   share one subscriber connection (see `subscriber.rs`).
//!
//! All commands go through one multiplexed connection with connect and
//! response timeouts, so a dead server gives an error, never a hang. A
//! background task keeps it up (`connection.rs`): it notices a server
//! that went away within 250 ms and reconnects with a backoff capped at
//! 250 ms, so while the server is away requests fail at once, and the first
//! request after it is back finds a live connection.
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

use std::time::Duration;

use std::sync::Arc;

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};

use tokio::sync::watch;
use tokio::time::Instant;

use super::wait::{acquire_loop, Attempt};
use super::{redact, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Release, Renewal};
use crate::error::{Error, Result};
use crate::key::{validate_prefix, LockKey};
use crate::owner::Owner;
use tls::{is_tls_url, CA_FILE_VAR};

mod batch;
mod client;
mod connection;
mod high_water;
mod restart;
pub(crate) mod script;
pub(crate) mod subscriber;
pub(crate) mod tls;

pub use tls::RedisTls;

pub(crate) use client::Client;
pub(crate) use connection::RedisConnection;
use connection::{
    connect_error, open_client, require_redis_7, sentinel_target, warn_on_evicting_policy, SentinelConn, SentinelTarget,
};
pub(crate) use connection::{lost_connection, may_have_run, redis_error, Conn};
pub(crate) use restart::RestartGuard;
use script::{acquire_call, acquire_reply, lock_scripts, release_call, Reply, ScriptCall};
use subscriber::Subscriber;

/// Timeouts of the Redis connections.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::redis::RedisOptions;
/// let opts = RedisOptions::default().with_response_timeout(Duration::from_millis(500));
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    connect_timeout: Duration,
    response_timeout: Duration,
    tls: Option<RedisTls>,
    restart_quarantine: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            tls: None,
            restart_quarantine: Duration::ZERO,
        }
    }
}

impl RedisOptions {
    /// How long to wait for a TCP (and TLS, AUTH) connection.
    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long to wait for the reply to one command.
    pub fn with_response_timeout(mut self, t: Duration) -> Self {
        self.response_timeout = t;
        self
    }

    /// The CA (and client certificate) for `rediss://` URLs; plain
    /// `redis://` URLs ignore it (with a warning).
    ///
    /// ```no_run
    /// # fn demo() -> dlock_core::Result<()> {
    /// use dlock_core::backend::redis::RedisOptions;
    /// use dlock_core::RedisTls;
    /// let opts = RedisOptions::default().with_tls(RedisTls::new().with_ca_file("/etc/redis/ca.crt")?);
    /// # Ok(()) }
    /// ```
    pub fn with_tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// After the server restarts or loses its data, grant nothing until it
    /// has been up this long (set it to the longest lease any client uses,
    /// in every client of the server); zero (the default) turns the check
    /// off. See `DLOCK_RESTART_QUARANTINE_MS` and [`RELIABILITY.md`]:
    /// without persistence, a restarted Redis otherwise grants locks whose
    /// earlier holders are still running.
    ///
    /// Every missing data marker is taken for a possible flush, and a flush
    /// is quarantined from when any client first saw it. So a Redis that
    /// dlock has never used (a first deploy, even against a server up for
    /// long) grants nothing during its first quarantine, once: it cannot be
    /// told from a server flushed a moment ago.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::backend::redis::RedisOptions;
    /// let opts = RedisOptions::default().with_restart_quarantine(Duration::from_secs(30));
    /// ```
    ///
    /// [`RELIABILITY.md`]: https://github.com/dlock-rs/dlock/blob/main/RELIABILITY.md
    pub fn with_restart_quarantine(mut self, quarantine: Duration) -> Self {
        self.restart_quarantine = quarantine;
        self
    }

    fn custom_tls(&self) -> Option<&RedisTls> {
        self.tls.as_ref().filter(|t| t.is_custom())
    }
}

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
    /// Connects with the default timeouts; see [`RedisBackend::connect_with`].
    ///
    /// # Errors
    ///
    /// As [`RedisBackend::connect_with`].
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, RedisOptions::default()).await
    }

    /// Connects to the server at `url` and checks it: it must answer, the
    /// user must be allowed to subscribe to `prefix:*` channels, and a
    /// `maxmemory-policy` that evicts keys with a TTL (which are exactly the
    /// locks) is logged as a warning.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL, a missing ACL permission or a
    /// server older than Redis 7.0, [`Error::Backend`] when the server cannot
    /// be reached in time.
    pub async fn connect_with(url: &str, prefix: &str, options: RedisOptions) -> Result<Self> {
        validate_prefix(prefix)?;
        tls::check_url_supported("DLOCK_REDIS_URL", url)?;
        if let Some(seeds) = cluster_seeds(url) {
            return Self::connect_cluster(url, &seeds, prefix, options).await;
        }
        if let Some(target) = sentinel_target(url) {
            return Self::connect_sentinel(url, target?, prefix, options).await;
        }
        let client = open_client(url, &options)?;
        let conn = RedisConnection::connect(url, &options).await?;
        warn_on_evicting_policy(conn.clone()).await;
        Self::finish(Conn::Single(conn), watch::channel(client).1, prefix, &options).await
    }

    async fn connect_cluster(url: &str, seeds: &[String], prefix: &str, options: RedisOptions) -> Result<Self> {
        let invalid = |e: redis::RedisError| {
            Error::config("DLOCK_REDIS_URL", format!("`{}` is not a valid Redis Cluster URL: {e}", redact(url)))
        };
        if is_tls_url(url) && options.custom_tls().is_some() {
            // redis-rs hands a custom CA to cluster nodes only in its rustls
            // build; this one uses native-tls (the system OpenSSL).
            return Err(Error::config(
                CA_FILE_VAR,
                "a custom CA or client certificate is not supported with `rediss+cluster://`: \
                 add the CA to the system trust store (or point SSL_CERT_FILE at it) and unset the DLOCK_REDIS_*_FILE variables",
            ));
        }
        let cluster = redis::cluster::ClusterClient::builder(seeds.iter().map(String::as_str))
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.response_timeout)
            .retries(1)
            .build()
            .map_err(invalid)?;
        let conn = tokio::time::timeout(options.connect_timeout * 3, cluster.get_async_connection())
            .await
            .map_err(|_| Error::backend("redis", format!("no answer from the cluster {} in time", redact(url))))?
            .map_err(|e| connect_error(url, e, &options))?;
        let first = seeds.first().map(String::as_str).unwrap_or_default();
        let client = redis::Client::open(first).map_err(invalid)?;
        Self::finish(Conn::Cluster(conn), watch::channel(client).1, prefix, &options).await
    }

    async fn connect_sentinel(url: &str, target: SentinelTarget, prefix: &str, options: RedisOptions) -> Result<Self> {
        let invalid = |e: redis::RedisError| {
            Error::config("DLOCK_REDIS_URL", format!("`{}` is not a valid Redis Sentinel URL: {e}", redact(url)))
        };
        let node_info = match &target.auth {
            Some((user, password)) => {
                let mut info = redis::RedisConnectionInfo::default().set_password(password.clone());
                if let Some(user) = user {
                    info = info.set_username(user.clone());
                }
                Some(SentinelNodeConnectionInfo::default().set_redis_connection_info(info))
            }
            None => None,
        };
        let sentinel = SentinelClient::build(
            target.sentinels.clone(),
            target.master.clone(),
            node_info,
            SentinelServerType::Master,
        )
        .map_err(invalid)?;
        let conn = SentinelConn::connect(sentinel, options.connect_timeout, options.response_timeout).await?;
        let client = conn.client.subscribe();
        warn_on_evicting_policy(conn.current()).await;
        Self::finish(Conn::Sentinel(conn), client, prefix, &options).await
    }

    async fn finish(
        conn: Conn,
        client: watch::Receiver<redis::Client>,
        prefix: &str,
        options: &RedisOptions,
    ) -> Result<Self> {
        require_redis_7(&conn).await?;
        let probe = format!("{prefix}:{{dlock-probe}}:released");
        let subscriber = Subscriber::start(client, &probe).await?;
        let restart = if options.restart_quarantine.is_zero() {
            None
        } else if matches!(conn, Conn::Cluster(_)) {
            // The data marker lives in one slot, and a lock script may only
            // touch the slot of its key.
            return Err(Error::config(
                "DLOCK_RESTART_QUARANTINE_MS",
                "the restart quarantine is not available with Redis Cluster; unset it, or use AOF with appendfsync always",
            ));
        } else {
            let guard = RestartGuard::new(options.restart_quarantine, prefix);
            guard.check_permission(&conn).await?;
            Some(Arc::new(guard))
        };
        let high_water = match conn {
            Conn::Cluster(_) => HighWater::PerSlot,
            Conn::Single(_) | Conn::Sentinel(_) => HighWater::Prefix(high_water::prefix_mark(prefix)),
        };
        let client = Client::new(conn, restart);
        let batch = match &high_water {
            HighWater::Prefix(mark) => {
                Some((batch::Batcher::default(), batch::Calls { client: client.clone(), mark: mark.clone() }))
            }
            HighWater::PerSlot => None,
        };
        Ok(RedisBackend { client, prefix: prefix.into(), high_water, subscriber, batch })
    }

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
        Ok(match attempt {
            NodeAttempt::Granted { grant } => Attempt::Acquired(grant),
            NodeAttempt::Held { retry_in } => Attempt::Held { retry_in },
        })
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
}

/// An acquire script's reply for one lock, sent at `sent`.
fn node_attempt(reply: &[i64], sent: Instant, lease: Duration) -> Result<NodeAttempt> {
    Ok(match reply {
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
    Granted { grant: Grant },
    Held { retry_in: Option<Duration> },
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
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
}

/// The seed URLs of a `redis+cluster://a:1,b:2` (or `rediss+cluster://`)
/// URL; `None` for a single-server URL. Credentials given before the first
/// host apply to every seed.
fn cluster_seeds(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+cluster://") {
        ("redis", rest)
    } else {
        ("rediss", url.strip_prefix("rediss+cluster://")?)
    };
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    Some(hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("{scheme}://{auth}{h}")).collect())
}

/// The high-water mark of fencing tokens that a Redis Cluster keeps for
/// the slot of `key` (same slot as `key`); a single server keeps one for
/// the whole prefix instead, [`prefix_fence_key`].
///
/// Hidden: it names how locks are stored in Redis, which may change between
/// releases; public only so that the tests can damage and inspect the
/// counter from outside.
#[doc(hidden)]
pub fn fence_key(key: &LockKey) -> String {
    high_water::slot_mark(key)
}

/// The high-water mark of fencing tokens that a single server (a Sentinel
/// master, a RedLock node) keeps for every lock under `prefix`.
///
/// Hidden for the same reason as [`fence_key`].
#[doc(hidden)]
pub fn prefix_fence_key(prefix: &str) -> String {
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
    fn cluster_urls_list_their_seeds() {
        use super::cluster_seeds;
        assert_eq!(cluster_seeds("redis://a:1"), None);
        assert_eq!(
            cluster_seeds("redis+cluster://u:p@a:1, b:2").expect("cluster"),
            vec!["redis://u:p@a:1".to_string(), "redis://u:p@b:2".to_string()]
        );
        assert_eq!(cluster_seeds("rediss+cluster://a:1").expect("cluster"), vec!["rediss://a:1".to_string()]);
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://***@host:6379/0");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }
}
