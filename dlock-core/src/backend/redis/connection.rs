//! The command connection to Redis: one server, a cluster, or the master a
//! set of Sentinels names; how a URL becomes a client, and how its errors
//! read.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::SentinelClient;
use tokio::sync::watch;

use super::tls::{is_tls_url, CA_FILE_VAR, CLIENT_CERT_VAR};
use super::{redact, RedisOptions, RedisTls};
use crate::error::{Error, Result};

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
                return Err(Error::config(CA_FILE_VAR, "TLS is not built into this dlock: enable the `tls` feature"));
            }
        }
    }
    redis::Client::open(url).map_err(invalid)
}

pub(super) fn manager_config(options: &RedisOptions) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.response_timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500))
}

/// The command connection: one server, a cluster routed by key slot, or the
/// master a set of Sentinels names.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    Sentinel(SentinelConn),
}

/// A connection to the master that the Sentinels name, asked again when the
/// connection fails or the server says it is a read-only replica (after a
/// failover).
#[derive(Clone)]
pub(crate) struct SentinelConn {
    sentinel: Arc<tokio::sync::Mutex<SentinelClient>>,
    current: Arc<std::sync::RwLock<ConnectionManager>>,
    /// The master's client, for the subscriber to follow.
    pub(super) client: Arc<watch::Sender<redis::Client>>,
    config: ConnectionManagerConfig,
    connect_timeout: Duration,
}

impl SentinelConn {
    pub(super) async fn connect(
        mut sentinel: SentinelClient,
        config: ConnectionManagerConfig,
        connect_timeout: Duration,
    ) -> Result<Self> {
        let client = tokio::time::timeout(connect_timeout * 2, sentinel.async_get_client())
            .await
            .map_err(|_| Error::backend("redis", "no Sentinel named the master in time"))?
            .map_err(redis_error)?;
        let manager = tokio::time::timeout(
            connect_timeout * 2,
            ConnectionManager::new_with_config(client.clone(), config.clone()),
        )
        .await
        .map_err(|_| Error::backend("redis", "the master named by the Sentinels did not answer in time"))?
        .map_err(redis_error)?;
        Ok(SentinelConn {
            sentinel: Arc::new(tokio::sync::Mutex::new(sentinel)),
            current: Arc::new(std::sync::RwLock::new(manager)),
            client: Arc::new(watch::channel(client).0),
            config,
            connect_timeout,
        })
    }

    pub(super) fn current(&self) -> ConnectionManager {
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
        match ConnectionManager::new_lazy_with_config(client.clone(), self.config.clone()) {
            Ok(manager) => {
                tracing::warn!(master = %client.get_connection_info().addr(), "Redis master changed (Sentinel failover)");
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = manager;
                self.client.send_replace(client);
            }
            Err(e) => tracing::warn!(error = %e, "cannot use the new master"),
        }
    }

    fn should_refresh(e: &redis::RedisError) -> bool {
        lost_connection(e) || e.code() == Some("READONLY")
    }
}

impl redis::aio::ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let result = self.current().req_packed_command(cmd).await;
            if let Err(e) = &result {
                if Self::should_refresh(e) {
                    self.refresh().await;
                }
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
            if let Err(e) = &result {
                if Self::should_refresh(e) {
                    self.refresh().await;
                }
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().get_db()
    }
}

/// Where `redis+sentinel://[user:password@]host:port,host:port/master-name`
/// points; the credentials are the master's.
pub(super) struct SentinelTarget {
    pub(super) sentinels: Vec<String>,
    pub(super) master: String,
    pub(super) auth: Option<(Option<String>, String)>,
}

pub(super) fn sentinel_target(url: &str) -> Option<Result<SentinelTarget>> {
    let rest = url.strip_prefix("redis+sentinel://")?;
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => {
            let (user, password) = match auth.split_once(':') {
                Some((u, p)) => ((!u.is_empty()).then(|| u.to_owned()), p.to_owned()),
                None => (None, auth.to_owned()),
            };
            (Some((user, password)), rest)
        }
        None => (None, rest),
    };
    let Some((hosts, master)) = rest.split_once('/').filter(|(_, m)| !m.is_empty()) else {
        return Some(Err(Error::config(
            "DLOCK_REDIS_URL",
            "a Sentinel URL names the master: redis+sentinel://host:port,host:port/master-name",
        )));
    };
    let sentinels = hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("redis://{h}")).collect();
    Some(Ok(SentinelTarget { sentinels, master: master.to_owned(), auth }))
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

/// A wrong user or password is a configuration error naming the variable
/// (never the password); anything else as [`redis_error`].
pub(super) fn connect_error(url: &str, e: redis::RedisError, options: &RedisOptions) -> Error {
    if e.kind() == redis::ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS") {
        return Error::config(
            "DLOCK_REDIS_URL",
            format!("Redis at {} refused the user or password in the URL ({:?})", redact(url), e.kind()),
        );
    }
    if is_tls_url(url) {
        if let Some(failure) = tls_failure(&e) {
            let (var, hint) = match failure {
                TlsFailure::Untrusted => (
                    CA_FILE_VAR,
                    "the server's certificate is not trusted or does not name this host: \
                     point DLOCK_REDIS_CA_FILE at the CA that signed it",
                ),
                TlsFailure::ClientCertificate => (
                    CLIENT_CERT_VAR,
                    "the server refused this client's certificate or wants one (`tls-auth-clients yes`): \
                     set DLOCK_REDIS_CLIENT_CERT_FILE and DLOCK_REDIS_CLIENT_KEY_FILE",
                ),
                TlsFailure::Other => (CA_FILE_VAR, "check the TLS set-up of client and server"),
            };
            return Error::config(var, format!("TLS handshake with {} failed: {hint} ({e})", redact(url)));
        }
        // With TLS 1.3 the server checks the client certificate after the
        // client considers the handshake done, and its alert is lost when it
        // resets the connection: all the client sees is the reset.
        let has_client_cert = options.custom_tls().is_some_and(RedisTls::has_client_certificate);
        if e.is_connection_dropped() && !e.is_connection_refusal() && !has_client_cert {
            return Error::Backend {
                backend: "redis",
                message: format!(
                    "{} closed the TLS connection right after the handshake; a server with `tls-auth-clients yes` does \
                     this to a client without a certificate: set DLOCK_REDIS_CLIENT_CERT_FILE and \
                     DLOCK_REDIS_CLIENT_KEY_FILE ({e})",
                    redact(url)
                ),
                source: Some(Box::new(e)),
            };
        }
    }
    redis_error(e)
}

enum TlsFailure {
    Untrusted,
    ClientCertificate,
    Other,
}

/// Sorts a TLS failure out of a connection error by its OpenSSL text (redis-rs
/// wraps the native-tls error without a kind of its own).
fn tls_failure(e: &redis::RedisError) -> Option<TlsFailure> {
    let text = e.to_string().to_ascii_lowercase();
    if text.contains("certificate verify failed")
        || text.contains("unable to get local issuer")
        || text.contains("self-signed certificate")
        || text.contains("hostname mismatch")
        || text.contains("ip address mismatch")
    {
        Some(TlsFailure::Untrusted)
    } else if text.contains("certificate required") || text.contains("bad certificate") || text.contains("unknown ca") {
        Some(TlsFailure::ClientCertificate)
    } else if text.contains("ssl") || text.contains("tls") || text.contains("handshake") {
        Some(TlsFailure::Other)
    } else {
        None
    }
}

/// The connection broke, refused or timed out (rather than the server
/// answering with an error): the server may be gone, restarted or failed over.
pub(crate) fn lost_connection(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout()
}

pub(crate) fn redis_error(e: redis::RedisError) -> Error {
    let message = if e.code() == Some("OOM") || e.to_string().contains("OOM command not allowed") {
        format!(
            "Redis is out of memory (maxmemory reached under `noeviction`): no new locks until memory is freed; \
             held locks stay held and can be released: {e}"
        )
    } else if e.is_timeout() {
        format!("Redis did not answer in time: {e}")
    } else if lost_connection(&e) {
        format!("cannot reach Redis: {e}")
    } else {
        e.to_string()
    };
    Error::Backend { backend: "redis", message, source: Some(Box::new(e)) }
}

/// `volatile-*` and `allkeys-*` policies may evict keys with a TTL — every
/// lock is one — so a full Redis would silently free held locks.
pub(super) async fn warn_on_evicting_policy(mut conn: ConnectionManager) {
    let reply: redis::RedisResult<Vec<String>> =
        redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").query_async(&mut conn).await;
    match reply.as_deref() {
        Ok([_, policy]) if policy.starts_with("volatile-") || policy.starts_with("allkeys-") => {
            tracing::warn!(
                policy = %policy,
                "Redis maxmemory-policy may evict lock keys when memory is full, freeing held locks; use `noeviction` for the lock server"
            );
        }
        Ok(_) => {}
        Err(e) => tracing::debug!(error = %e, "could not read maxmemory-policy (CONFIG not permitted?)"),
    }
}
