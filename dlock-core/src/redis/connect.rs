//! How a URL becomes a connection, whatever the topology it names (see
//! `docs/redis-design.md` for what each means for a lock):
//!
//! * `redis://` / `rediss://`: one server, through the connection that a
//!   background task keeps up ([`RedisConnection`]);
//! * `redis+sentinel://[user:password@]host:port,…/master`: the master the
//!   Sentinels name, asked again after a failover ([`SentinelConn`]);
//! * `redis+cluster://[user:password@]host:port,…`: redis-rs's cluster
//!   connection from the seed nodes.
//!
//! Whatever the topology, the server is checked (Redis 7 or later) before
//! the first command, and [`client`] puts the restart quarantine where one
//! is possible in front of it.

use std::sync::Arc;

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use tokio::sync::watch;

use super::client::Client;
use super::connection::{open_client, Conn, RedisConnection, SentinelConn};
use super::error::connect_error;
use super::options::RedisOptions;
use super::restart::RestartGuard;
use super::tls::{self, is_tls_url, CA_FILE_VAR};
use crate::error::{Error, Result};
use crate::redact::redact;

/// A URL's command connection, checked, and the client of the server that
/// publishes (a Sentinel failover sends the new master's).
pub(crate) struct Connected {
    pub(crate) conn: Conn,
    /// Where a subscriber connects: the server, the current master, or a
    /// cluster's first seed node (a cluster forwards every `PUBLISH`).
    pub(crate) pubsub: watch::Receiver<redis::Client>,
}

/// Connects to `url` (any of the topologies above) with the timeouts and
/// TLS material of `options`, and checks the server: Redis 7 or later; a
/// `maxmemory-policy` that evicts keys with a TTL is logged as a warning.
///
/// # Errors
///
/// [`Error::Config`] for a malformed URL, refused credentials, a TLS
/// problem or a server older than Redis 7.0, [`Error::Backend`] when the
/// server cannot be reached in time.
pub(crate) async fn connect(url: &str, options: &RedisOptions) -> Result<Connected> {
    tls::check_url_supported("DLOCK_REDIS_URL", url)?;
    let connected = if let Some(seeds) = cluster_seeds(url) {
        connect_cluster(url, &seeds, options).await?
    } else if let Some(target) = sentinel_target(url) {
        connect_sentinel(url, target?, options).await?
    } else {
        let client = open_client(url, options)?;
        let conn = RedisConnection::connect(url, options).await?;
        warn_on_evicting_policy(conn.clone()).await;
        Connected { conn: Conn::Single(conn), pubsub: watch::channel(client).1 }
    };
    require_redis_7(&connected.conn).await?;
    Ok(connected)
}

async fn connect_cluster(url: &str, seeds: &[String], options: &RedisOptions) -> Result<Connected> {
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
        .map_err(|e| connect_error(url, e, options))?;
    let first = seeds.first().map(String::as_str).unwrap_or_default();
    let client = redis::Client::open(first).map_err(invalid)?;
    Ok(Connected { conn: Conn::Cluster(conn), pubsub: watch::channel(client).1 })
}

async fn connect_sentinel(url: &str, target: SentinelTarget, options: &RedisOptions) -> Result<Connected> {
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
    let sentinel =
        SentinelClient::build(target.sentinels.clone(), target.master.clone(), node_info, SentinelServerType::Master)
            .map_err(invalid)?;
    let conn = SentinelConn::connect(sentinel, options.connect_timeout, options.response_timeout).await?;
    let pubsub = conn.client.subscribe();
    warn_on_evicting_policy(conn.current()).await;
    Ok(Connected { conn: Conn::Sentinel(conn), pubsub })
}

/// The client of `conn`, with the restart quarantine of `options` for the
/// data marker under `prefix` when one is set (refused on a cluster).
pub(crate) async fn client(conn: Conn, prefix: &str, options: &RedisOptions) -> Result<Client> {
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
    Ok(Client::new(conn, restart))
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

/// Refuses a server older than Redis 7.0 at start-up: the lock scripts
/// take a lock with `SET … NX … GET` and the idempotency scripts move TTLs
/// with `PEXPIREAT … GT`, both new in 7.0, so on an older server every
/// acquire would fail with a script error. A server that does not let us
/// read `INFO server` is not refused (it may still be new enough).
async fn require_redis_7(conn: &Conn) -> Result<()> {
    let reply: redis::RedisResult<String> = redis::cmd("INFO").arg("server").query_async(&mut conn.clone()).await;
    match reply {
        Ok(info) => check_version(&info),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the Redis version (INFO not permitted?)");
            Ok(())
        }
    }
}

/// [`require_redis_7`] on an `INFO server` answer.
fn check_version(info: &str) -> Result<()> {
    let Some(version) = info.lines().find_map(|l| l.strip_prefix("redis_version:")).map(str::trim) else {
        return Ok(());
    };
    match version.split('.').next().and_then(|major| major.parse::<u32>().ok()) {
        Some(major) if major < 7 => Err(Error::config(
            "DLOCK_REDIS_URL",
            format!(
                "the Redis server is version {version}; dlock's lock and idempotency scripts need Redis 7.0 or \
                 newer (`SET … NX … GET`, `PEXPIREAT … GT`)"
            ),
        )),
        _ => Ok(()),
    }
}

/// `volatile-*` and `allkeys-*` policies may evict keys with a TTL — every
/// lock is one — so a full Redis would silently free held locks.
async fn warn_on_evicting_policy(mut conn: RedisConnection) {
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

#[cfg(test)]
mod tests {
    use super::{check_version, cluster_seeds};
    use crate::error::Error;

    #[test]
    fn cluster_urls_list_their_seeds() {
        assert_eq!(cluster_seeds("redis://a:1"), None);
        assert_eq!(
            cluster_seeds("redis+cluster://u:p@a:1, b:2").expect("cluster"),
            vec!["redis://u:p@a:1".to_string(), "redis://u:p@b:2".to_string()]
        );
        assert_eq!(cluster_seeds("rediss+cluster://a:1").expect("cluster"), vec!["rediss://a:1".to_string()]);
    }

    #[test]
    fn servers_older_than_redis_7_are_refused_by_name() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        let refused = check_version(&info("6.2.14")).expect_err("6.2 has no SET NX GET");
        assert!(matches!(refused, Error::Config { .. }), "{refused:?}");
        let text = refused.to_string();
        assert!(text.contains("DLOCK_REDIS_URL") && text.contains("6.2.14") && text.contains("7.0"), "{text}");
        for ok in ["7.0.15", "7.2.4", "8.0.1", "10.1.0"] {
            assert!(check_version(&info(ok)).is_ok(), "{ok}");
        }
        assert!(check_version("# Server\r\nuptime_in_seconds:3\r\n").is_ok(), "no version, no refusal");
    }
}
