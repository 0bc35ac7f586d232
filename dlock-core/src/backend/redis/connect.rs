//! How a URL becomes a [`RedisBackend`]: the three topologies a URL can
//! name (see the module docs of `redis` for what each means for a lock),
//! each connected its own way and then checked the same way before the
//! first lock is taken.
//!
//! * `redis://` / `rediss://`: one server, through the connection that a
//!   background task keeps up (`connection.rs`);
//! * `redis+sentinel://[user:password@]host:port,…/master`: the master the
//!   Sentinels name, asked again after a failover;
//! * `redis+cluster://[user:password@]host:port,…`: redis-rs's cluster
//!   connection from the seed nodes, the subscriber on the first seed.
//!
//! Whatever the topology, [`RedisBackend::finish`] checks the server
//! (Redis 7 or later), starts the subscriber, sets up the restart quarantine
//! where one is possible, and picks where the high-water mark of fencing
//! tokens lives (one key per prefix, or one per slot in a cluster).

use std::sync::Arc;
use std::time::Duration;

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use tokio::sync::watch;

use super::connection::{connect_error, open_client, require_redis_7, warn_on_evicting_policy, SentinelConn};
use super::subscriber::Subscriber;
use super::tls::{self, is_tls_url, CA_FILE_VAR};
use super::{
    batch, high_water, redact, Client, Conn, HighWater, RedisBackend, RedisConnection, RedisTls, RestartGuard,
};
use crate::error::{Error, Result};
use crate::key::validate_prefix;

/// Timeouts of the Redis connections.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::redis::RedisOptions;
/// let opts = RedisOptions::default().with_response_timeout(Duration::from_millis(500));
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
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

    pub(super) fn custom_tls(&self) -> Option<&RedisTls> {
        self.tls.as_ref().filter(|t| t.is_custom())
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

/// Where `redis+sentinel://[user:password@]host:port,host:port/master-name`
/// points; the credentials are the master's.
struct SentinelTarget {
    sentinels: Vec<String>,
    master: String,
    auth: Option<(Option<String>, String)>,
}

fn sentinel_target(url: &str) -> Option<Result<SentinelTarget>> {
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

#[cfg(test)]
mod tests {
    use super::cluster_seeds;

    #[test]
    fn cluster_urls_list_their_seeds() {
        assert_eq!(cluster_seeds("redis://a:1"), None);
        assert_eq!(
            cluster_seeds("redis+cluster://u:p@a:1, b:2").expect("cluster"),
            vec!["redis://u:p@a:1".to_string(), "redis://u:p@b:2".to_string()]
        );
        assert_eq!(cluster_seeds("rediss+cluster://a:1").expect("cluster"), vec!["rediss://a:1".to_string()]);
    }
}
