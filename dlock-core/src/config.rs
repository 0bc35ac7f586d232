//! Configuration from `DLOCK_*` environment variables.

use std::time::Duration;

pub use crate::backend::zookeeper_auth::ZooKeeperAuth;
use crate::backend::zookeeper_auth::AUTH_VAR;
use crate::engine::{LockerOptions, DEFAULT_LEASE};
use crate::error::{Error, Result};
use crate::key::validate_prefix;
use crate::redact::redact;
#[cfg(feature = "redis")]
use crate::redis::tls::{check_url_supported, RedisTls, CA_FILE_VAR, CLIENT_CERT_VAR, CLIENT_KEY_VAR};

/// Which coordination service holds the locks. Its `Debug` hides the
/// passwords in URLs.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// In process (`DLOCK_BACKEND=memory`, the default).
    Memory,
    /// One Redis (`DLOCK_BACKEND=redis`, `DLOCK_REDIS_URL`).
    Redis {
        /// `redis://` or `rediss://` URL.
        url: String,
    },
    /// RedLock over independent masters (`DLOCK_BACKEND=redlock`,
    /// `DLOCK_REDLOCK_URLS`, an odd number ≥ 3 of comma-separated URLs).
    RedLock {
        /// One URL per master.
        urls: Vec<String>,
    },
    /// ZooKeeper (`DLOCK_BACKEND=zookeeper`, `DLOCK_ZOOKEEPER`,
    /// `DLOCK_ZOOKEEPER_SESSION_MS`, `DLOCK_ZOOKEEPER_AUTH`).
    ZooKeeper {
        /// `host:port[,host:port…][/chroot]`.
        connect: String,
        /// The session timeout: the lease of every lock.
        session_timeout: Duration,
        /// Digest credentials; `None`: the nodes are open to every client.
        auth: Option<ZooKeeperAuth>,
    },
    /// PostgreSQL (`DLOCK_BACKEND=postgres`, `DLOCK_POSTGRES_URL`, feature
    /// `postgres`).
    Postgres {
        /// `postgres://user:password@host:port/database`.
        url: String,
        /// Where the release listener connects, if not to `url`
        /// (`DLOCK_POSTGRES_LISTEN_URL`).
        listen_url: Option<String>,
    },
}

impl std::fmt::Debug for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendKind::Memory => f.write_str("Memory"),
            BackendKind::Redis { url } => f.debug_struct("Redis").field("url", &redact(url)).finish(),
            BackendKind::RedLock { urls } => {
                let urls: Vec<String> = urls.iter().map(|u| redact(u)).collect();
                f.debug_struct("RedLock").field("urls", &urls).finish()
            }
            BackendKind::ZooKeeper { connect, session_timeout, auth } => f
                .debug_struct("ZooKeeper")
                .field("connect", connect)
                .field("session_timeout", session_timeout)
                .field("auth", auth)
                .finish(),
            BackendKind::Postgres { url, listen_url } => f
                .debug_struct("Postgres")
                .field("url", &redact(url))
                .field("listen_url", &listen_url.as_deref().map(redact))
                .finish(),
        }
    }
}

impl BackendKind {
    /// The name used in `DLOCK_BACKEND` and in `/health`.
    pub fn name(&self) -> &'static str {
        match self {
            BackendKind::Memory => "memory",
            BackendKind::Redis { .. } => "redis",
            BackendKind::RedLock { .. } => "redlock",
            BackendKind::ZooKeeper { .. } => "zookeeper",
            BackendKind::Postgres { .. } => "postgres",
        }
    }
}

/// Everything dlock reads from the environment.
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `DLOCK_BACKEND` | `memory`, `redis`, `redlock`, `zookeeper` or `postgres` | `memory` |
/// | `DLOCK_REDIS_URL` | Redis URL | `redis://127.0.0.1:6379` |
/// | `DLOCK_REDLOCK_URLS` | comma-separated Redis URLs, odd count ≥ 3 | — |
/// | `DLOCK_ZOOKEEPER` | ZooKeeper connect string (optional `/chroot`) | `127.0.0.1:2181` |
/// | `DLOCK_ZOOKEEPER_SESSION_MS` | ZooKeeper session timeout (the lease) | `10000` |
/// | `DLOCK_ZOOKEEPER_AUTH` | `user:password` for ZooKeeper's digest scheme; lock nodes then get a creator-only ACL (see [`ZooKeeperAuth`]) | none: nodes open to every client |
/// | `DLOCK_POSTGRES_URL` | PostgreSQL URL (`postgres://user:password@host:port/db`); the lock tables are `<prefix>_locks` and `<prefix>_holders` | `postgres://127.0.0.1:5432/postgres` |
/// | `DLOCK_POSTGRES_LISTEN_URL` | where the connection that listens for releases goes: the server (or a session-mode pool) of the same database when `DLOCK_POSTGRES_URL` is a transaction-mode pooler, which loses `LISTEN` | `DLOCK_POSTGRES_URL` |
/// | `DLOCK_PREFIX` | key namespace | `dlock` |
/// | `DLOCK_LEASE_MS` | watchdog lease | `30000` |
/// | `DLOCK_WAIT_MS` | default wait | `0` |
/// | `DLOCK_IDEMPOTENCY_TTL_SECS` | life of tokens and stored responses | `86400` |
/// | `DLOCK_MAX_BODY_BYTES` | most body bytes read to derive a key | `65536` |
/// | `DLOCK_BODY_READ_TIMEOUT_MS` | longest a request body may take to arrive (then `408`) | `30000` |
/// | `DLOCK_RESTART_QUARANTINE_MS` | no grants from a Redis that restarted or lost its data until it has been up this long (≥ the longest lease); `0`: off | `0` |
/// | `DLOCK_IDEMPOTENCY_REDIS_URL` | Redis for idempotency records (see [`Config::build`]); not the lock keyspace of a Redis whose `maxmemory-policy` evicts | the lock backend's Redis (or PostgreSQL database), else in process |
/// | `DLOCK_IDEMPOTENCY_MAX_PER_SCOPE` | most live idempotency records (and, apart, bound tokens) of one caller; beyond, `429` (see [`IdempotencyLimits`](crate::idempotency::IdempotencyLimits)) | `10000` |
/// | `DLOCK_IDEMPOTENCY_MAX_RECORDS` | most live idempotency records (and, apart, bound tokens) in all; beyond, `503` | `1000000` |
/// | `DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE` | most bytes of stored answers of one caller; an answer beyond is delivered and not stored | `67108864` (64 MiB) |
/// | `DLOCK_IDEMPOTENCY_MAX_BYTES` | most bytes of stored answers in all | `1073741824` (1 GiB) |
/// | `DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS` | most live one-time tokens issued to no caller in particular (their own pool); beyond, `503` | `100000` |
/// | `DLOCK_IDEMPOTENCY_LOCAL` | `1`: allow idempotency records in each process with `redlock` or `zookeeper` and no `DLOCK_IDEMPOTENCY_REDIS_URL` | `0`: a start-up error |
/// | `DLOCK_REDIS_CA_FILE` | PEM CA to verify `rediss://` servers with (feature `tls`) | the system trust store |
/// | `DLOCK_REDIS_CLIENT_CERT_FILE`, `DLOCK_REDIS_CLIENT_KEY_FILE` | PEM client certificate and PKCS#8 key for `tls-auth-clients yes` (feature `tls`) | none |
///
/// A backend's own variable set while `DLOCK_BACKEND` is unset is an error
/// naming it, not a silent fallback to in-process locks; one of a backend
/// other than the named one is a warning. An unknown `DLOCK_*` variable is
/// a warning naming the closest known one. An empty variable counts as
/// unset. The TLS files apply to every `rediss://` URL and are parsed here;
/// without the `tls` feature they are an error that says to enable it.
///
/// ```
/// use dlock_core::{BackendKind, Config};
/// let cfg = Config::from_lookup(|var| match var {
///     "DLOCK_BACKEND" => Some("redis".into()),
///     "DLOCK_WAIT_MS" => Some("250".into()),
///     _ => None,
/// }).unwrap();
/// assert_eq!(cfg.backend, BackendKind::Redis { url: "redis://127.0.0.1:6379".into() });
/// assert_eq!(cfg.wait.as_millis(), 250);
///
/// let err = Config::from_lookup(|var| (var == "DLOCK_LEASE_MS").then(|| "soon".into())).unwrap_err();
/// assert!(err.to_string().contains("DLOCK_LEASE_MS"));
/// ```
///
/// Its `Debug` hides passwords in URLs, so a configuration can be logged:
///
/// ```
/// use dlock_core::Config;
/// let cfg = Config::from_lookup(|var| match var {
///     "DLOCK_BACKEND" => Some("redis".into()),
///     "DLOCK_REDIS_URL" => Some("redis://app:s3cret@10.0.0.5:6379/0".into()),
///     _ => None,
/// }).unwrap();
/// let printed = format!("{cfg:?}");
/// assert!(printed.contains("redis://***@10.0.0.5:6379/0"));
/// assert!(!printed.contains("s3cret"));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct Config {
    /// The backend and its address.
    pub backend: BackendKind,
    /// Key namespace.
    pub prefix: String,
    /// Watchdog lease.
    pub lease: Duration,
    /// Default wait.
    pub wait: Duration,
    /// Life of idempotency tokens and stored responses.
    pub idempotency_ttl: Duration,
    /// Most body bytes read to derive a key.
    pub max_body_bytes: usize,
    /// Longest a request body may take to arrive, first read to last byte.
    pub body_read_timeout: Duration,
    /// Where idempotency records live when it is not the lock backend's
    /// Redis (`DLOCK_IDEMPOTENCY_REDIS_URL`).
    pub idempotency_redis_url: Option<String>,
    /// CA and client certificate for `rediss://` (`DLOCK_REDIS_*_FILE`);
    /// `None`: the system trust store.
    #[cfg(feature = "redis")]
    pub redis_tls: Option<RedisTls>,
    /// No grants from a Redis that restarted or lost its data until it has
    /// been up this long (`DLOCK_RESTART_QUARANTINE_MS`; zero: off).
    pub restart_quarantine: Duration,
    /// Whether records may stay in each process with `redlock` and
    /// `zookeeper` and no records Redis (`DLOCK_IDEMPOTENCY_LOCAL=1`; see
    /// [`Config::build`]).
    pub allow_local_idempotency: bool,
    /// Caps on live idempotency records and tokens
    /// (`DLOCK_IDEMPOTENCY_MAX_*`), for the stores this configuration builds.
    pub idempotency_limits: crate::idempotency::IdempotencyLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backend: BackendKind::Memory,
            prefix: "dlock".into(),
            lease: DEFAULT_LEASE,
            wait: Duration::ZERO,
            idempotency_ttl: crate::runtime::DEFAULT_IDEMPOTENCY_TTL,
            max_body_bytes: crate::runtime::DEFAULT_MAX_BODY_BYTES,
            body_read_timeout: crate::runtime::DEFAULT_BODY_READ_TIMEOUT,
            idempotency_redis_url: None,
            #[cfg(feature = "redis")]
            redis_tls: None,
            restart_quarantine: Duration::ZERO,
            allow_local_idempotency: false,
            idempotency_limits: crate::idempotency::IdempotencyLimits::default(),
        }
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Config");
        d.field("backend", &self.backend)
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("wait", &self.wait)
            .field("idempotency_ttl", &self.idempotency_ttl)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("body_read_timeout", &self.body_read_timeout)
            .field("idempotency_redis_url", &self.idempotency_redis_url.as_deref().map(redact));
        #[cfg(feature = "redis")]
        d.field("redis_tls", &self.redis_tls);
        d.field("restart_quarantine", &self.restart_quarantine)
            .field("allow_local_idempotency", &self.allow_local_idempotency)
            .field("idempotency_limits", &self.idempotency_limits)
            .finish()
    }
}

const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
const DEFAULT_POSTGRES_URL: &str = "postgres://127.0.0.1:5432/postgres";

/// The variables that configure one backend, with that backend. One set
/// without `DLOCK_BACKEND` is an error, not a hint: a leftover URL must not
/// switch backends silently, and a silent in-process fallback would pass
/// every single-instance test.
const BACKEND_VARS: [(&str, &str); 7] = [
    ("DLOCK_REDIS_URL", "redis"),
    ("DLOCK_REDLOCK_URLS", "redlock"),
    ("DLOCK_ZOOKEEPER", "zookeeper"),
    ("DLOCK_ZOOKEEPER_SESSION_MS", "zookeeper"),
    ("DLOCK_ZOOKEEPER_AUTH", "zookeeper"),
    ("DLOCK_POSTGRES_URL", "postgres"),
    ("DLOCK_POSTGRES_LISTEN_URL", "postgres"),
];

impl Config {
    /// Reads the `DLOCK_*` variables of this process.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when a value is malformed.
    pub fn from_env() -> Result<Self> {
        for name in std::env::vars_os().filter_map(|(name, _)| name.into_string().ok()) {
            if let Some(closest) = unknown_variable(&name) {
                tracing::warn!(
                    variable = %name,
                    "{name} is not a dlock variable and is ignored{}",
                    closest.map(|known| format!(": did you mean {known}?")).unwrap_or_default()
                );
            }
        }
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// Reads the variables through `lookup` (for tests and other sources).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when a value is malformed.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |var: &str| lookup(var).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let defaults = Config::default();
        let chosen = get("DLOCK_BACKEND");
        if let Some(feature) = chosen.as_deref().and_then(missing_feature) {
            return Err(Error::config(
                "DLOCK_BACKEND",
                format!(
                    "`{}` needs dlock-core's `{feature}` cargo feature, which this build was made without \
                     (dlock-axum forwards it: `features = [\"{feature}\"]`)",
                    chosen.as_deref().unwrap_or_default()
                ),
            ));
        }
        match chosen.as_deref() {
            None => {
                if let Some(&(var, backend)) = BACKEND_VARS.iter().find(|(var, _)| get(var).is_some()) {
                    return Err(Error::config(
                        var,
                        format!(
                            "is set but DLOCK_BACKEND is not: set DLOCK_BACKEND={backend} to use it, or \
                             DLOCK_BACKEND=memory for locks that only this process sees"
                        ),
                    ));
                }
            }
            Some(chosen) => {
                for (var, backend) in BACKEND_VARS.iter().filter(|(var, b)| *b != chosen && get(var).is_some()) {
                    tracing::warn!(
                        variable = var,
                        backend = chosen,
                        "{var} is ignored: it configures DLOCK_BACKEND={backend}, not {chosen}"
                    );
                }
            }
        }
        let backend = match chosen.as_deref() {
            None | Some("memory") => BackendKind::Memory,
            Some("redis") => {
                BackendKind::Redis { url: get("DLOCK_REDIS_URL").unwrap_or_else(|| DEFAULT_REDIS_URL.into()) }
            }
            Some("redlock") => {
                let urls: Vec<String> = get("DLOCK_REDLOCK_URLS")
                    .unwrap_or_default()
                    .split(',')
                    .map(|u| u.trim().to_owned())
                    .filter(|u| !u.is_empty())
                    .collect();
                if urls.len() < 3 || urls.len().is_multiple_of(2) {
                    return Err(Error::config(
                        "DLOCK_REDLOCK_URLS",
                        format!("needs an odd number of at least 3 comma-separated Redis URLs, got {}", urls.len()),
                    ));
                }
                BackendKind::RedLock { urls }
            }
            Some("zookeeper") => {
                let session_timeout = millis(&get, "DLOCK_ZOOKEEPER_SESSION_MS")?.unwrap_or(Duration::from_secs(10));
                if session_timeout < Duration::from_millis(100) {
                    return Err(Error::config("DLOCK_ZOOKEEPER_SESSION_MS", "must be at least 100 (milliseconds)"));
                }
                BackendKind::ZooKeeper {
                    connect: get("DLOCK_ZOOKEEPER").unwrap_or_else(|| "127.0.0.1:2181".into()),
                    session_timeout,
                    auth: get(AUTH_VAR).map(|v| v.parse()).transpose()?,
                }
            }
            Some("postgres") => BackendKind::Postgres {
                url: get("DLOCK_POSTGRES_URL").unwrap_or_else(|| DEFAULT_POSTGRES_URL.into()),
                listen_url: get("DLOCK_POSTGRES_LISTEN_URL"),
            },
            Some(other) => {
                return Err(Error::config(
                    "DLOCK_BACKEND",
                    format!(
                        "unknown backend `{other}` (expected `memory`, `redis`, `redlock`, `zookeeper` or `postgres`)"
                    ),
                ))
            }
        };
        let prefix = get("DLOCK_PREFIX").unwrap_or(defaults.prefix);
        validate_prefix(&prefix)?;
        let lease = millis(&get, "DLOCK_LEASE_MS")?.unwrap_or(defaults.lease);
        if lease < Duration::from_millis(3) {
            return Err(Error::config("DLOCK_LEASE_MS", "must be at least 3 (milliseconds)"));
        }
        let wait = millis(&get, "DLOCK_WAIT_MS")?.unwrap_or(defaults.wait);
        let idempotency_ttl =
            number(&get, "DLOCK_IDEMPOTENCY_TTL_SECS")?.map(Duration::from_secs).unwrap_or(defaults.idempotency_ttl);
        if idempotency_ttl.is_zero() {
            return Err(Error::config("DLOCK_IDEMPOTENCY_TTL_SECS", "must be at least 1 (seconds)"));
        }
        let max_body_bytes = match number(&get, "DLOCK_MAX_BODY_BYTES")? {
            Some(n) => {
                usize::try_from(n).map_err(|_| Error::config("DLOCK_MAX_BODY_BYTES", "too large for this machine"))?
            }
            None => defaults.max_body_bytes,
        };
        let body_read_timeout = millis(&get, "DLOCK_BODY_READ_TIMEOUT_MS")?.unwrap_or(defaults.body_read_timeout);
        if body_read_timeout.is_zero() {
            return Err(Error::config("DLOCK_BODY_READ_TIMEOUT_MS", "must be at least 1 (milliseconds)"));
        }
        let idempotency_redis_url = get("DLOCK_IDEMPOTENCY_REDIS_URL");
        if let Some(url) = &idempotency_redis_url {
            const SCHEMES: [&str; 5] =
                ["redis://", "rediss://", "redis+cluster://", "rediss+cluster://", "redis+sentinel://"];
            if !SCHEMES.iter().any(|s| url.starts_with(s) && url.len() > s.len()) {
                return Err(Error::config(
                    "DLOCK_IDEMPOTENCY_REDIS_URL",
                    "must be a Redis URL (`redis://`, `rediss://`, `redis+cluster://`, `rediss+cluster://` or `redis+sentinel://`)",
                ));
            }
        }
        #[cfg(feature = "redis")]
        match &backend {
            BackendKind::Redis { url } => check_url_supported("DLOCK_REDIS_URL", url)?,
            BackendKind::RedLock { urls } => {
                for url in urls {
                    check_url_supported("DLOCK_REDLOCK_URLS", url)?;
                }
            }
            BackendKind::Memory | BackendKind::ZooKeeper { .. } | BackendKind::Postgres { .. } => {}
        }
        #[cfg(feature = "redis")]
        if let Some(url) = &idempotency_redis_url {
            check_url_supported("DLOCK_IDEMPOTENCY_REDIS_URL", url)?;
        }
        #[cfg(feature = "redis")]
        let redis_tls = redis_tls(&get)?;
        let restart_quarantine = millis(&get, "DLOCK_RESTART_QUARANTINE_MS")?.unwrap_or(Duration::ZERO);
        if !restart_quarantine.is_zero() && restart_quarantine < lease {
            tracing::warn!(
                quarantine_ms = restart_quarantine.as_millis() as u64,
                lease_ms = lease.as_millis() as u64,
                "DLOCK_RESTART_QUARANTINE_MS is shorter than the watchdog lease: a lock granted before a restart may \
                 still be held when the quarantine ends"
            );
        }
        let allow_local_idempotency = flag(&get, "DLOCK_IDEMPOTENCY_LOCAL")?.unwrap_or(false);
        let mut idempotency_limits = defaults.idempotency_limits;
        if let Some(n) = positive(&get, "DLOCK_IDEMPOTENCY_MAX_PER_SCOPE")? {
            idempotency_limits = idempotency_limits.with_max_per_scope(n);
        }
        if let Some(n) = positive(&get, "DLOCK_IDEMPOTENCY_MAX_RECORDS")? {
            idempotency_limits = idempotency_limits.with_max_records(n);
        }
        if let Some(n) = positive(&get, "DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE")? {
            idempotency_limits = idempotency_limits.with_max_bytes_per_scope(n);
        }
        if let Some(n) = positive(&get, "DLOCK_IDEMPOTENCY_MAX_BYTES")? {
            idempotency_limits = idempotency_limits.with_max_bytes(n);
        }
        if let Some(n) = positive(&get, "DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS")? {
            idempotency_limits = idempotency_limits.with_max_unbound_tokens(n);
        }
        if idempotency_limits.max_per_scope() > idempotency_limits.max_records() {
            tracing::warn!(
                max_per_scope = idempotency_limits.max_per_scope(),
                max_records = idempotency_limits.max_records(),
                "DLOCK_IDEMPOTENCY_MAX_PER_SCOPE is above DLOCK_IDEMPOTENCY_MAX_RECORDS: one caller can fill the store"
            );
        }
        Ok(Config {
            backend,
            prefix,
            lease,
            wait,
            idempotency_ttl,
            max_body_bytes,
            body_read_timeout,
            idempotency_redis_url,
            #[cfg(feature = "redis")]
            redis_tls,
            restart_quarantine,
            allow_local_idempotency,
            idempotency_limits,
        })
    }

    /// The Redis connection options of this configuration (TLS material).
    #[cfg(feature = "redis")]
    pub fn redis_options(&self) -> crate::redis::RedisOptions {
        let options = crate::redis::RedisOptions::default().with_restart_quarantine(self.restart_quarantine);
        match &self.redis_tls {
            Some(tls) => options.with_tls(tls.clone()),
            None => options,
        }
    }

    /// The engine defaults of this configuration.
    pub fn locker_options(&self) -> LockerOptions {
        LockerOptions::default().with_prefix(self.prefix.clone()).with_wait(self.wait).with_watchdog_lease(self.lease)
    }
}

/// The TLS files, loaded and parsed now so that a bad one stops start-up.
#[cfg(feature = "redis")]
fn redis_tls(get: &impl Fn(&str) -> Option<String>) -> Result<Option<RedisTls>> {
    let (ca, cert, key) = (get(CA_FILE_VAR), get(CLIENT_CERT_VAR), get(CLIENT_KEY_VAR));
    if ca.is_none() && cert.is_none() && key.is_none() {
        return Ok(None);
    }
    let mut tls = RedisTls::new();
    if let Some(ca) = ca {
        tls = tls.with_ca_file(ca)?;
    }
    tls = match (cert, key) {
        (Some(cert), Some(key)) => tls.with_client_files(cert, key)?,
        (Some(_), None) => return Err(Error::config(CLIENT_KEY_VAR, format!("must be set when {CLIENT_CERT_VAR} is"))),
        (None, Some(_)) => return Err(Error::config(CLIENT_CERT_VAR, format!("must be set when {CLIENT_KEY_VAR} is"))),
        (None, None) => tls,
    };
    Ok(Some(tls))
}

/// Every variable [`Config::from_lookup`] reads.
const KNOWN: [&str; 25] = [
    "DLOCK_BACKEND",
    "DLOCK_REDIS_URL",
    "DLOCK_REDLOCK_URLS",
    "DLOCK_ZOOKEEPER",
    "DLOCK_ZOOKEEPER_SESSION_MS",
    "DLOCK_ZOOKEEPER_AUTH",
    "DLOCK_POSTGRES_URL",
    "DLOCK_POSTGRES_LISTEN_URL",
    "DLOCK_PREFIX",
    "DLOCK_LEASE_MS",
    "DLOCK_WAIT_MS",
    "DLOCK_IDEMPOTENCY_TTL_SECS",
    "DLOCK_MAX_BODY_BYTES",
    "DLOCK_BODY_READ_TIMEOUT_MS",
    "DLOCK_RESTART_QUARANTINE_MS",
    "DLOCK_IDEMPOTENCY_REDIS_URL",
    "DLOCK_IDEMPOTENCY_MAX_PER_SCOPE",
    "DLOCK_IDEMPOTENCY_MAX_RECORDS",
    "DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE",
    "DLOCK_IDEMPOTENCY_MAX_BYTES",
    "DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS",
    "DLOCK_IDEMPOTENCY_LOCAL",
    "DLOCK_REDIS_CA_FILE",
    "DLOCK_REDIS_CLIENT_CERT_FILE",
    "DLOCK_REDIS_CLIENT_KEY_FILE",
];

/// `Some` for a `DLOCK_*` name this configuration does not read, with the
/// closest known name when it looks like a typo (`DLOCK_REDIS_URI` →
/// `DLOCK_REDIS_URL`). `DLOCK_TORTURE_*` is not judged.
fn unknown_variable(name: &str) -> Option<Option<&'static str>> {
    if !name.starts_with("DLOCK_") || KNOWN.contains(&name) || name.starts_with("DLOCK_TORTURE_") {
        return None;
    }
    let (distance, closest) = KNOWN.iter().map(|known| (edit_distance(name, known), *known)).min()?;
    let close = distance <= 3 || distance * 3 <= closest.len() - "DLOCK_".len();
    Some(close.then_some(closest))
}

/// Levenshtein distance over bytes (the names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The cargo feature a backend needs when this build lacks it.
fn missing_feature(backend: &str) -> Option<&'static str> {
    match backend {
        "redis" | "redlock" if !cfg!(feature = "redis") => Some("redis"),
        "zookeeper" if !cfg!(feature = "zookeeper") => Some("zookeeper"),
        "postgres" if !cfg!(feature = "postgres") => Some("postgres"),
        _ => None,
    }
}

fn number(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u64>> {
    get(var)
        .map(|v| v.parse::<u64>().map_err(|_| Error::config(var, format!("`{v}` is not a whole non-negative number"))))
        .transpose()
}

/// A whole number of at least 1 (a cap of 0 would refuse everything).
fn positive(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u64>> {
    match number(get, var)? {
        Some(0) => Err(Error::config(var, "must be at least 1")),
        n => Ok(n),
    }
}

/// `1`/`true`/`yes` or `0`/`false`/`no`; anything else is an error.
fn flag(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<bool>> {
    get(var)
        .map(|v| match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" => Ok(true),
            "0" | "false" | "no" => Ok(false),
            _ => Err(Error::config(var, format!("`{v}` is not `1` or `0` (`true`/`false`, `yes`/`no`)"))),
        })
        .transpose()
}

fn millis(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<Duration>> {
    Ok(number(get, var)?.map(Duration::from_millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn unset_is_the_in_process_default() {
        let c = cfg(&[]).expect("defaults");
        assert_eq!(c.backend, BackendKind::Memory);
        assert_eq!(c.prefix, "dlock");
        assert_eq!(c.lease, Duration::from_secs(30));
        assert_eq!(c.wait, Duration::ZERO);
        assert_eq!(c.max_body_bytes, 65536);
    }

    #[test]
    fn errors_name_the_variable() {
        for (var, val) in [
            ("DLOCK_BACKEND", "etcd"),
            ("DLOCK_LEASE_MS", "30s"),
            ("DLOCK_WAIT_MS", "-1"),
            ("DLOCK_PREFIX", "a{b}"),
            ("DLOCK_IDEMPOTENCY_TTL_SECS", "x"),
            ("DLOCK_MAX_BODY_BYTES", "1e9"),
            ("DLOCK_LEASE_MS", "0"),
        ] {
            let err = cfg(&[(var, val)]).expect_err(var);
            assert!(err.is_misconfigured(), "{err}");
            assert!(err.to_string().contains(var), "{err} should name {var}");
        }
    }

    #[test]
    fn redlock_needs_an_odd_number_of_urls() {
        let two = cfg(&[("DLOCK_BACKEND", "redlock"), ("DLOCK_REDLOCK_URLS", "redis://a, redis://b")]);
        assert!(two.expect_err("even").to_string().contains("DLOCK_REDLOCK_URLS"));
        let three = cfg(&[("DLOCK_BACKEND", "redlock"), ("DLOCK_REDLOCK_URLS", "redis://a, redis://b,redis://c")]);
        assert_eq!(
            three.expect("odd").backend,
            BackendKind::RedLock { urls: vec!["redis://a".into(), "redis://b".into(), "redis://c".into()] }
        );
    }

    #[test]
    fn idempotency_redis_url_is_checked() {
        let c = Config::from_lookup(|v| (v == "DLOCK_IDEMPOTENCY_REDIS_URL").then(|| "redis://10.0.0.2:7001".into()))
            .expect("valid");
        assert_eq!(c.idempotency_redis_url.as_deref(), Some("redis://10.0.0.2:7001"));
        let e = Config::from_lookup(|v| (v == "DLOCK_IDEMPOTENCY_REDIS_URL").then(|| "http://x".into()))
            .expect_err("not redis");
        assert!(e.to_string().contains("DLOCK_IDEMPOTENCY_REDIS_URL"));
    }

    #[test]
    fn redis_url_is_read() {
        let c = cfg(&[("DLOCK_BACKEND", "redis"), ("DLOCK_REDIS_URL", "redis://10.0.0.1:7000")]).expect("ok");
        assert_eq!(c.backend, BackendKind::Redis { url: "redis://10.0.0.1:7000".into() });
    }

    #[test]
    fn debug_hides_every_password() {
        let c = cfg(&[
            ("DLOCK_BACKEND", "redlock"),
            ("DLOCK_REDLOCK_URLS", "redis://a:pw1@h1:6379,redis://:pw2@h2:6379,redis://h3:6379"),
            ("DLOCK_IDEMPOTENCY_REDIS_URL", "redis://idem:pw3@h4:6379"),
        ])
        .expect("valid");
        let printed = format!("{c:?}");
        for secret in ["pw1", "pw2", "pw3"] {
            assert!(!printed.contains(secret), "{secret} in {printed}");
        }
        assert!(printed.contains("redis://***@h1:6379") && printed.contains("redis://h3:6379"), "{printed}");
        assert!(printed.contains("redis://***@h4:6379"), "{printed}");
    }

    /// `DLOCK_REDIS_URL` alone used to give in-process locks silently.
    #[test]
    fn a_backend_variable_without_a_backend_is_an_error_naming_it() {
        for (var, val, backend) in [
            ("DLOCK_REDIS_URL", "redis://10.0.0.1:6379", "redis"),
            ("DLOCK_REDLOCK_URLS", "redis://a,redis://b,redis://c", "redlock"),
            ("DLOCK_ZOOKEEPER", "10.0.0.1:2181", "zookeeper"),
            ("DLOCK_ZOOKEEPER_SESSION_MS", "6000", "zookeeper"),
            ("DLOCK_ZOOKEEPER_AUTH", "app:pw", "zookeeper"),
        ] {
            let err = cfg(&[(var, val)]).expect_err(var);
            assert!(err.is_misconfigured(), "{err}");
            let text = err.to_string();
            assert!(text.contains(var), "{text} should name {var}");
            assert!(text.contains(&format!("DLOCK_BACKEND={backend}")), "{text} should say which backend");
            assert!(!text.contains("pw"), "{text} must not show the password");
        }
        // `memory` chosen on purpose ignores them, with a warning.
        let c = cfg(&[("DLOCK_BACKEND", "redis"), ("DLOCK_REDIS_URL", "redis://10.0.0.1:6379")]).expect("redis");
        assert_eq!(c.backend, BackendKind::Redis { url: "redis://10.0.0.1:6379".into() });
        let c = cfg(&[("DLOCK_BACKEND", "memory"), ("DLOCK_REDIS_URL", "redis://10.0.0.1:6379")]).expect("memory");
        assert_eq!(c.backend, BackendKind::Memory);
        // Variables that are not a backend's own stay valid without one.
        let c = cfg(&[("DLOCK_IDEMPOTENCY_REDIS_URL", "redis://10.0.0.2:6379"), ("DLOCK_PREFIX", "shop")]);
        assert_eq!(c.expect("not a backend's variable").backend, BackendKind::Memory);
    }

    /// The start-up line says which backend and where, never a password.
    #[test]
    fn the_start_up_summary_names_the_backend_without_secrets() {
        let summary = |vars: &[(&str, &str)]| cfg(vars).expect("valid").backend_summary();
        assert!(summary(&[]).starts_with("memory"), "{}", summary(&[]));
        let redis = summary(&[("DLOCK_BACKEND", "redis"), ("DLOCK_REDIS_URL", "redis://app:pw1@h1:6379/0")]);
        assert_eq!(redis, "redis redis://***@h1:6379/0");
        let redlock = summary(&[
            ("DLOCK_BACKEND", "redlock"),
            ("DLOCK_REDLOCK_URLS", "redis://:pw2@h1:6379,redis://h2:6379,redis://h3:6379"),
        ]);
        assert_eq!(redlock, "redlock redis://***@h1:6379,redis://h2:6379,redis://h3:6379");
        // A backend whose feature is off is refused before its summary.
        #[cfg(feature = "zookeeper")]
        {
            let zookeeper = summary(&[
                ("DLOCK_BACKEND", "zookeeper"),
                ("DLOCK_ZOOKEEPER", "z1:2181"),
                ("DLOCK_ZOOKEEPER_AUTH", "app:pw3"),
            ]);
            assert!(zookeeper.starts_with("zookeeper z1:2181") && zookeeper.contains("app"), "{zookeeper}");
            assert!(!zookeeper.contains("pw3"), "{zookeeper}");
        }
    }

    #[cfg(feature = "zookeeper")]
    #[test]
    fn zookeeper_auth_is_read_and_never_printed() {
        let c = cfg(&[("DLOCK_BACKEND", "zookeeper"), ("DLOCK_ZOOKEEPER_AUTH", "orders:pa:ss")]).expect("valid");
        let BackendKind::ZooKeeper { auth: Some(auth), .. } = &c.backend else { panic!("{c:?}") };
        assert_eq!(auth.user(), "orders");
        assert_eq!(auth.credentials(), "orders:pa:ss", "the password may contain `:`");
        let printed = format!("{c:?}");
        assert!(!printed.contains("pa:ss") && printed.contains("orders"), "{printed}");
        assert!(!c.backend_summary().contains("pa:ss"), "{}", c.backend_summary());
        let c = cfg(&[("DLOCK_BACKEND", "zookeeper")]).expect("valid");
        assert!(matches!(c.backend, BackendKind::ZooKeeper { auth: None, .. }), "{c:?}");
        for bad in ["orders", ":pw", "orders:", "a:"] {
            let err = cfg(&[("DLOCK_BACKEND", "zookeeper"), ("DLOCK_ZOOKEEPER_AUTH", bad)]).expect_err(bad);
            assert!(err.is_misconfigured() && err.to_string().contains("DLOCK_ZOOKEEPER_AUTH"), "{err}");
            assert!(!err.to_string().contains("pw"), "{err}");
        }
    }

    #[test]
    fn an_unknown_variable_names_the_closest_known_one() {
        assert_eq!(unknown_variable("DLOCK_REDIS_URI"), Some(Some("DLOCK_REDIS_URL")));
        assert_eq!(unknown_variable("DLOCK_WAIT"), Some(Some("DLOCK_WAIT_MS")));
        assert_eq!(unknown_variable("DLOCK_LEASE"), Some(Some("DLOCK_LEASE_MS")));
        assert_eq!(unknown_variable("DLOCK_COMPLETELY_ELSE"), Some(None));
        assert_eq!(unknown_variable("DLOCK_REDIS_URL"), None);
        assert_eq!(unknown_variable("DLOCK_TORTURE_KEEP"), None);
        assert_eq!(unknown_variable("REDIS_URL"), None, "not ours to judge");
        for known in KNOWN {
            assert_eq!(unknown_variable(known), None, "{known}");
        }
    }

    /// Every variable read is in `KNOWN`, or it would be warned about.
    #[test]
    fn every_variable_read_is_known() {
        let read = std::cell::RefCell::new(Vec::new());
        for backend in ["memory", "redis", "redlock", "zookeeper", "postgres"] {
            let _ = Config::from_lookup(|var| {
                read.borrow_mut().push(var.to_owned());
                match var {
                    "DLOCK_BACKEND" => Some(backend.into()),
                    "DLOCK_REDLOCK_URLS" => Some("redis://a,redis://b,redis://c".into()),
                    _ => None,
                }
            });
        }
        let read = read.into_inner();
        assert!(read.len() >= KNOWN.len(), "{read:?}");
        for var in read {
            assert!(KNOWN.contains(&var.as_str()), "{var} is read but not in KNOWN");
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn the_postgres_listen_url_is_read_with_its_backend_only() {
        let c = cfg(&[("DLOCK_BACKEND", "postgres"), ("DLOCK_POSTGRES_LISTEN_URL", "postgres://db:5432/app")]);
        match c.expect("valid").backend {
            BackendKind::Postgres { listen_url, .. } => {
                assert_eq!(listen_url.as_deref(), Some("postgres://db:5432/app"))
            }
            other => panic!("{other:?}"),
        }
        let err = cfg(&[("DLOCK_POSTGRES_LISTEN_URL", "postgres://db:5432/app")]).expect_err("not postgres");
        assert!(err.to_string().contains("DLOCK_POSTGRES_LISTEN_URL"), "{err}");
    }

    #[test]
    fn the_body_read_timeout_is_read() {
        assert_eq!(cfg(&[]).expect("default").body_read_timeout, Duration::from_secs(30));
        let c = cfg(&[("DLOCK_BODY_READ_TIMEOUT_MS", "1500")]).expect("valid");
        assert_eq!(c.body_read_timeout, Duration::from_millis(1500));
        let e = cfg(&[("DLOCK_BODY_READ_TIMEOUT_MS", "0")]).expect_err("zero");
        assert!(e.to_string().contains("DLOCK_BODY_READ_TIMEOUT_MS"), "{e}");
    }

    /// Without the feature, that is said first.
    #[cfg(not(feature = "zookeeper"))]
    #[test]
    fn a_backend_without_its_feature_is_the_first_error() {
        let e = cfg(&[("DLOCK_BACKEND", "zookeeper")]).expect_err("feature off");
        assert!(matches!(e, Error::Config { var: "DLOCK_BACKEND", .. }), "{e}");
        assert!(e.to_string().contains("`zookeeper` cargo feature"), "{e}");
    }

    #[test]
    fn idempotency_caps_are_read_and_checked() {
        use crate::idempotency::IdempotencyLimits;
        assert_eq!(cfg(&[]).expect("default").idempotency_limits, IdempotencyLimits::default());
        let c = cfg(&[
            ("DLOCK_IDEMPOTENCY_MAX_PER_SCOPE", "50"),
            ("DLOCK_IDEMPOTENCY_MAX_RECORDS", "5000"),
            ("DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE", "1024"),
            ("DLOCK_IDEMPOTENCY_MAX_BYTES", "4096"),
            ("DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS", "7"),
        ])
        .expect("caps");
        let l = c.idempotency_limits;
        assert_eq!((l.max_per_scope(), l.max_records()), (50, 5000));
        assert_eq!((l.max_bytes_per_scope(), l.max_bytes(), l.max_unbound_tokens()), (1024, 4096, 7));
        for var in [
            "DLOCK_IDEMPOTENCY_MAX_PER_SCOPE",
            "DLOCK_IDEMPOTENCY_MAX_RECORDS",
            "DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE",
            "DLOCK_IDEMPOTENCY_MAX_BYTES",
            "DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS",
        ] {
            for bad in ["0", "-1", "many", "1e6"] {
                let e = cfg(&[(var, bad)]).expect_err(bad);
                assert!(e.to_string().contains(var), "{bad}: {e}");
            }
        }
    }

    #[test]
    fn idempotency_local_is_a_checked_flag() {
        assert!(!cfg(&[]).expect("default").allow_local_idempotency);
        for (val, want) in [("1", true), ("true", true), ("YES", true), ("0", false), ("no", false)] {
            let c = cfg(&[("DLOCK_IDEMPOTENCY_LOCAL", val)]).expect(val);
            assert_eq!(c.allow_local_idempotency, want, "{val}");
        }
        let err = cfg(&[("DLOCK_IDEMPOTENCY_LOCAL", "on please")]).expect_err("not a flag");
        assert!(err.is_misconfigured() && err.to_string().contains("DLOCK_IDEMPOTENCY_LOCAL"), "{err}");
    }
}
