//! The healing connections: one server kept up by a background task
//! ([`RedisConnection`]), the master a set of Sentinels names, followed
//! through a failover ([`SentinelConn`]), and [`Conn`], the one of them (or
//! a cluster connection) that every command goes through.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;
use tokio::sync::watch;

use super::error::{connect_error, lost_connection, redis_error};
use super::options::RedisOptions;
use super::tls::is_tls_url;
use crate::error::{Error, Result};
use crate::redact::redact;

/// The client for one server, with the TLS material when the URL asks for
/// TLS.
pub(super) fn open_client(url: &str, options: &RedisOptions) -> Result<redis::Client> {
    let invalid = |e: redis::RedisError| {
        Error::config("DLOCK_REDIS_URL", format!("`{}` is not a valid Redis URL: {e}", redact(url)))
    };
    if let Some(tls) = options.custom_tls() {
        if !is_tls_url(url) {
            tracing::warn!(url = %redact(url), "TLS files are set but the URL is not `rediss://`: they are not used");
        } else {
            #[cfg(feature = "tls")]
            return redis::Client::build_with_tls(url, tls.certificates()).map_err(invalid);
            #[cfg(not(feature = "tls"))]
            {
                // Unreachable in practice (custom material cannot be built
                // without the feature), but never connect without it.
                let _ = tls;
                return Err(Error::config(
                    super::tls::CA_FILE_VAR,
                    "TLS is not built into this dlock: enable the `tls` feature",
                ));
            }
        }
    }
    redis::Client::open(url).map_err(invalid)
}

/// How long a link waits between two checks of an idle connection: a server
/// that went away is noticed within this, so the reconnect starts before a
/// request needs it.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// The first pause between two failed reconnects, doubled up to
/// [`RECONNECT_MAX_DELAY`]: a server that comes back is found within that.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(20);
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(250);

/// A multiplexed connection to one Redis server that a background task keeps
/// up: it checks an idle connection every 250 ms and reconnects with a
/// backoff capped at 250 ms, so the first request after the server comes back
/// finds a live connection (redis-rs's `ConnectionManager` reconnects only
/// after a request has failed on the dead one). While the server is away,
/// requests fail at once with an I/O error, never waiting for it.
///
/// Clones share the connection; the task ends with the last clone. Commands
/// go through [`redis::aio::ConnectionLike`], so any redis-rs command works.
/// Crate-private: a lock library publishes no connection type; an
/// application's own data can use redis-rs's `ConnectionManager`.
#[derive(Clone)]
pub(crate) struct RedisConnection {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnection").field("server", &self.shared.server).finish_non_exhaustive()
    }
}

struct Shared {
    client: redis::Client,
    config: redis::AsyncConnectionConfig,
    connect_timeout: Duration,
    /// `host:port`, for the logs.
    server: String,
    link: std::sync::RwLock<Link>,
    /// Wakes the task when a request finds the connection broken. Its own
    /// `Arc`, so that the waiting task does not keep `Shared` alive.
    wake: Arc<tokio::sync::Notify>,
}

/// Numbers the connections of every link, so that a number names one
/// connection for the life of the process.
static CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_number() -> u64 {
    CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[derive(Clone)]
enum Link {
    /// The live connection and its number (a failure seen on an older
    /// connection must not take down a newer one; a new number tells the
    /// restart guard that the server may have restarted).
    Up(MultiplexedConnection, u64),
    /// Broken; the task is reconnecting. The number of the last connection.
    Down(u64),
}

impl RedisConnection {
    /// Connects to the server at `url` (`redis://` or `rediss://`) with the
    /// timeouts and TLS material of `options`, and keeps the connection up
    /// from then on.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or refused credentials,
    /// [`Error::Backend`] when the server cannot be reached in time.
    pub(crate) async fn connect(url: &str, options: &RedisOptions) -> Result<Self> {
        let client = open_client(url, options)?;
        Self::connect_client(client, options.connect_timeout, options.response_timeout).await.map_err(|e| match e {
            ConnectFailure::Timeout => {
                Error::backend("redis", format!("no answer from {} within the connect timeout", redact(url)))
            }
            ConnectFailure::Redis(e) => connect_error(url, e, options),
        })
    }

    async fn connect_client(
        client: redis::Client,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> std::result::Result<Self, ConnectFailure> {
        let link = Self::lazy(client, connect_timeout, response_timeout, false);
        let conn = tokio::time::timeout(connect_timeout + response_timeout, link.shared.open())
            .await
            .map_err(|_| ConnectFailure::Timeout)?
            .map_err(ConnectFailure::Redis)?;
        *link.shared.write() = Link::Up(conn, next_number());
        link.spawn_keeper();
        Ok(link)
    }

    /// A link that starts down, its task connecting in the background
    /// (`keep`: start the task now).
    fn lazy(client: redis::Client, connect_timeout: Duration, response_timeout: Duration, keep: bool) -> Self {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout));
        let server = client.get_connection_info().addr().to_string();
        let link = RedisConnection {
            shared: Arc::new(Shared {
                client,
                config,
                connect_timeout,
                server,
                link: std::sync::RwLock::new(Link::Down(0)),
                wake: Arc::new(tokio::sync::Notify::new()),
            }),
        };
        if keep {
            link.spawn_keeper();
        }
        link
    }

    fn spawn_keeper(&self) {
        tokio::spawn(keep_up(Arc::downgrade(&self.shared), self.shared.wake.clone()));
    }

    /// The live connection, or at once an I/O error while reconnecting.
    fn live(&self) -> redis::RedisResult<(MultiplexedConnection, u64)> {
        match &*self.shared.read() {
            Link::Up(conn, n) => Ok((conn.clone(), *n)),
            Link::Down(_) => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("not connected to Redis at {} (reconnecting in the background)", self.shared.server),
            ))),
        }
    }

    /// The number of the current (or last) connection: it changes with every
    /// reconnect.
    pub(crate) fn number(&self) -> u64 {
        match &*self.shared.read() {
            Link::Up(_, n) | Link::Down(n) => *n,
        }
    }

    /// A request failed: a broken connection is handed to the task.
    fn check<T>(&self, number: u64, result: &redis::RedisResult<T>) {
        if let Err(e) = result
            && breaks(e)
        {
            self.shared.down(number);
        }
    }
}

/// Why the first connection failed.
enum ConnectFailure {
    Timeout,
    Redis(redis::RedisError),
}

/// The connection is gone (rather than one command failing on it). A
/// response timeout is not counted: a slow script does not break the
/// connection, and the probe finds a server that stopped answering.
fn breaks(e: &redis::RedisError) -> bool {
    e.is_unrecoverable_error() || e.is_connection_dropped() || e.is_io_error() || e.is_connection_refusal()
}

impl Shared {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Link> {
        // Whole-value writes only: a poisoned link is still consistent.
        self.link.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Link> {
        self.link.write().unwrap_or_else(|p| p.into_inner())
    }

    async fn open(&self) -> redis::RedisResult<MultiplexedConnection> {
        self.client.get_multiplexed_async_connection_with_config(&self.config).await
    }

    /// Marks connection `number` broken, if it is still the current one.
    fn down(&self, number: u64) {
        let mut link = self.write();
        if matches!(&*link, Link::Up(_, n) if *n == number) {
            *link = Link::Down(number);
            drop(link);
            tracing::warn!(server = %self.server, "dlock: Redis connection lost; reconnecting");
            self.wake.notify_one();
        }
    }
}

/// The task behind a [`RedisConnection`]: probes the live connection, and
/// reconnects a broken one with a bounded backoff, until the last clone of
/// the connection is dropped.
async fn keep_up(shared: std::sync::Weak<Shared>, wake: Arc<tokio::sync::Notify>) {
    let mut delay = RECONNECT_MIN_DELAY;
    loop {
        let Some(s) = shared.upgrade() else { return };
        let link = s.read().clone();
        match link {
            Link::Up(mut conn, number) => {
                drop(s);
                tokio::select! {
                    _ = wake.notified() => continue,
                    _ = tokio::time::sleep(PROBE_EVERY) => {}
                }
                let probe: redis::RedisResult<()> = redis::cmd("PING").query_async(&mut conn).await;
                if let Err(e) = probe {
                    // A probe that times out counts too: the server stopped
                    // answering, and a new connection will tell.
                    if breaks(&e) || e.is_timeout() {
                        let Some(s) = shared.upgrade() else { return };
                        s.down(number);
                    }
                }
            }
            Link::Down(_) => {
                let attempt = tokio::time::timeout(s.connect_timeout, s.open()).await.unwrap_or_else(|_| {
                    Err(redis::RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no connection within the connect timeout",
                    )))
                });
                match attempt {
                    Ok(conn) => {
                        *s.write() = Link::Up(conn, next_number());
                        tracing::info!(server = %s.server, "dlock: Redis connection re-established");
                        delay = RECONNECT_MIN_DELAY;
                    }
                    Err(e) => {
                        tracing::debug!(server = %s.server, error = %e, "dlock: Redis reconnect failed");
                        drop(s);
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(RECONNECT_MAX_DELAY);
                    }
                }
            }
        }
    }
}

impl redis::aio::ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let (mut conn, number) = self.live()?;
            let result = conn.req_packed_command(cmd).await;
            self.check(number, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let (mut conn, number) = self.live()?;
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.check(number, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.client.get_connection_info().redis_settings().db()
    }
}

/// The command connection: one server, a cluster routed by key slot, or the
/// master a set of Sentinels names.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(RedisConnection),
    Cluster(redis::cluster_async::ClusterConnection),
    Sentinel(SentinelConn),
}

/// A connection to the master that the Sentinels name, asked again when the
/// connection fails or the server says it is a read-only replica (after a
/// failover).
#[derive(Clone)]
pub(crate) struct SentinelConn {
    sentinel: Arc<tokio::sync::Mutex<SentinelClient>>,
    current: Arc<std::sync::RwLock<RedisConnection>>,
    /// The master's client, for the subscriber to follow.
    pub(super) client: Arc<watch::Sender<redis::Client>>,
    connect_timeout: Duration,
    response_timeout: Duration,
}

impl SentinelConn {
    pub(super) async fn connect(
        mut sentinel: SentinelClient,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<Self> {
        let client = tokio::time::timeout(connect_timeout * 2, sentinel.async_get_client())
            .await
            .map_err(|_| Error::backend("redis", "no Sentinel named the master in time"))?
            .map_err(redis_error)?;
        let manager = RedisConnection::connect_client(client.clone(), connect_timeout, response_timeout)
            .await
            .map_err(|e| match e {
                ConnectFailure::Timeout => {
                    Error::backend("redis", "the master named by the Sentinels did not answer in time")
                }
                ConnectFailure::Redis(e) => redis_error(e),
            })?;
        Ok(SentinelConn {
            sentinel: Arc::new(tokio::sync::Mutex::new(sentinel)),
            current: Arc::new(std::sync::RwLock::new(manager)),
            client: Arc::new(watch::channel(client).0),
            connect_timeout,
            response_timeout,
        })
    }

    pub(super) fn current(&self) -> RedisConnection {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Asks the Sentinels for the master again and switches to it.
    async fn refresh(&self) {
        let Ok(mut sentinel) = self.sentinel.try_lock() else {
            return; // another task is already asking
        };
        let asked = tokio::time::timeout(self.connect_timeout * 2, sentinel.async_get_client()).await;
        let Ok(Ok(client)) = asked else {
            tracing::warn!("no Sentinel answered; staying on the current master");
            return;
        };
        if client.get_connection_info().addr() == self.client.borrow().get_connection_info().addr() {
            return;
        }
        let manager = RedisConnection::lazy(client.clone(), self.connect_timeout, self.response_timeout, true);
        tracing::warn!(master = %client.get_connection_info().addr(), "Redis master changed (Sentinel failover)");
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = manager;
        self.client.send_replace(client);
    }

    fn should_refresh(e: &redis::RedisError) -> bool {
        lost_connection(e) || e.code() == Some("READONLY")
    }
}

impl redis::aio::ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let result = self.current().req_packed_command(cmd).await;
            if let Err(e) = &result
                && Self::should_refresh(e)
            {
                self.refresh().await;
            }
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let result = self.current().req_packed_commands(pipeline, offset, count).await;
            if let Err(e) = &result
                && Self::should_refresh(e)
            {
                self.refresh().await;
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().get_db()
    }
}

impl Conn {
    /// Changes whenever the connection to the server is re-established (a
    /// server behind it may have restarted meanwhile); constant for a
    /// cluster, whose restart quarantine is refused.
    pub(crate) fn generation(&self) -> u64 {
        match self {
            Conn::Single(c) => c.number(),
            Conn::Sentinel(s) => s.current().number(),
            Conn::Cluster(_) => 0,
        }
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    /// Back by itself after an outage: the first command after the server
    /// returns succeeds, found by the probe, not by a command that failed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_comes_back_by_itself() {
        let mut server = dlock_testing::RedisServer::start();
        let options = super::RedisOptions::default();
        let conn = super::RedisConnection::connect(&server.url(), &options).await.expect("connect");
        let () = redis::cmd("SET").arg("k").arg("v").query_async(&mut conn.clone()).await.expect("SET");
        server.kill();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        server.start_again();
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let () = redis::cmd("SET").arg("k").arg("x").query_async(&mut conn.clone()).await.expect("first SET after");
    }
}
