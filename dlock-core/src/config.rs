//! Configuration from `DLOCK_*` environment variables.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::memory::MemoryBackend;
#[cfg(feature = "redis")]
use crate::backend::redis::tls::{check_url_supported, RedisTls, CA_FILE_VAR, CLIENT_CERT_VAR, CLIENT_KEY_VAR};
pub use crate::backend::zookeeper_auth::ZooKeeperAuth;
use crate::backend::zookeeper_auth::AUTH_VAR;
use crate::backend::{redact, Backend};
use crate::engine::{Locker, LockerOptions, DEFAULT_LEASE};
use crate::error::{Error, Result};
use crate::key::validate_prefix;

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
        /// Digest credentials; with them the lock nodes can be changed and
        /// deleted only by clients with the same credentials. `None`: the
        /// nodes are open to every client of the ensemble.
        auth: Option<ZooKeeperAuth>,
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
        }
    }
}

/// Everything dlock reads from the environment.
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `DLOCK_BACKEND` | `memory`, `redis`, `redlock` or `zookeeper` | `memory` |
/// | `DLOCK_REDIS_URL` | Redis URL | `redis://127.0.0.1:6379` |
/// | `DLOCK_REDLOCK_URLS` | comma-separated Redis URLs, odd count ≥ 3 | — |
/// | `DLOCK_ZOOKEEPER` | ZooKeeper connect string (optional `/chroot`) | `127.0.0.1:2181` |
/// | `DLOCK_ZOOKEEPER_SESSION_MS` | ZooKeeper session timeout (the lease) | `10000` |
/// | `DLOCK_ZOOKEEPER_AUTH` | `user:password` for ZooKeeper's digest scheme; lock nodes then get a creator-only ACL (see [`ZooKeeperAuth`]) | none: nodes open to every client |
/// | `DLOCK_PREFIX` | key namespace | `dlock` |
/// | `DLOCK_LEASE_MS` | watchdog lease | `30000` |
/// | `DLOCK_WAIT_MS` | default wait | `0` |
/// | `DLOCK_IDEMPOTENCY_TTL_SECS` | life of tokens and stored responses | `86400` |
/// | `DLOCK_MAX_BODY_BYTES` | most body bytes read to derive a key | `65536` |
/// | `DLOCK_RESTART_QUARANTINE_MS` | no grants from a Redis that restarted or lost its data until it has been up this long (≥ the longest lease); `0`: off | `0` |
/// | `DLOCK_IDEMPOTENCY_REDIS_URL` | Redis for idempotency records (see [`Config::idempotency_store`]); not the lock keyspace of a Redis whose `maxmemory-policy` evicts | the lock backend's Redis, else in process |
/// | `DLOCK_IDEMPOTENCY_MAX_PER_SCOPE` | most live idempotency records (and, apart, bound tokens) of one caller; beyond, `429` (see [`IdempotencyLimits`](crate::idempotency::IdempotencyLimits)) | `10000` |
/// | `DLOCK_IDEMPOTENCY_MAX_RECORDS` | most live idempotency records (and, apart, bound tokens) in all; beyond, `503` | `1000000` |
/// | `DLOCK_IDEMPOTENCY_MAX_BYTES_PER_SCOPE` | most bytes of stored answers of one caller; an answer beyond is delivered and not stored | `67108864` (64 MiB) |
/// | `DLOCK_IDEMPOTENCY_MAX_BYTES` | most bytes of stored answers in all | `1073741824` (1 GiB) |
/// | `DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS` | most live one-time tokens issued to no caller in particular (their own pool); beyond, `503` | `100000` |
/// | `DLOCK_IDEMPOTENCY_LOCAL` | `1`: allow idempotency records in each process with `redlock` or `zookeeper` and no `DLOCK_IDEMPOTENCY_REDIS_URL` | `0`: a start-up error |
/// | `DLOCK_REDIS_CA_FILE` | PEM CA to verify `rediss://` servers with (feature `tls`) | the system trust store |
/// | `DLOCK_REDIS_CLIENT_CERT_FILE`, `DLOCK_REDIS_CLIENT_KEY_FILE` | PEM client certificate and PKCS#8 key for `tls-auth-clients yes` (feature `tls`) | none |
///
/// A backend's own variable (`DLOCK_REDIS_URL`, `DLOCK_REDLOCK_URLS`,
/// `DLOCK_ZOOKEEPER*`) set while `DLOCK_BACKEND` is not is an error naming
/// it, not a silent fallback to in-process locks; one of another backend
/// than `DLOCK_BACKEND` names is ignored with a warning.
///
/// An empty variable counts as unset. The TLS files apply to every
/// `rediss://` URL (lock backend, RedLock masters, idempotency store); they
/// are read and parsed here, so a missing or malformed file is an error
/// naming its variable. Without the `tls` feature a `rediss://` URL or a TLS
/// file is an error that says to enable it.
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
    /// Where idempotency records live when it is not the lock backend's
    /// Redis (`DLOCK_IDEMPOTENCY_REDIS_URL`).
    pub idempotency_redis_url: Option<String>,
    /// CA and client certificate for `rediss://` connections
    /// (`DLOCK_REDIS_CA_FILE`, `DLOCK_REDIS_CLIENT_CERT_FILE`,
    /// `DLOCK_REDIS_CLIENT_KEY_FILE`); `None`: the system trust store.
    #[cfg(feature = "redis")]
    pub redis_tls: Option<RedisTls>,
    /// No grants from a Redis that restarted or lost its data until it has
    /// been up this long (`DLOCK_RESTART_QUARANTINE_MS`; zero: off).
    pub restart_quarantine: Duration,
    /// Whether idempotency records may stay in each process with the
    /// `redlock` and `zookeeper` backends when `idempotency_redis_url` is
    /// unset (`DLOCK_IDEMPOTENCY_LOCAL=1`). Off, that is a start-up error
    /// (see [`Config::idempotency_store`]): a duplicate sent to two
    /// instances would run on both.
    pub allow_local_idempotency: bool,
    /// Caps on live idempotency records and tokens, per caller and in all
    /// (`DLOCK_IDEMPOTENCY_MAX_PER_SCOPE`, `DLOCK_IDEMPOTENCY_MAX_RECORDS`);
    /// the stores this configuration builds enforce them.
    pub idempotency_limits: crate::idempotency::IdempotencyLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backend: BackendKind::Memory,
            prefix: "dlock".into(),
            lease: DEFAULT_LEASE,
            wait: Duration::ZERO,
            idempotency_ttl: Duration::from_secs(86_400),
            max_body_bytes: 64 * 1024,
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

/// The variables that configure one backend, with that backend.
///
/// One of them set while `DLOCK_BACKEND` is not is a configuration error
/// rather than a hint to pick that backend: a URL left in the environment
/// by an earlier deployment would otherwise switch backends just as
/// silently as the in-process fallback ignored it, variables of two
/// backends would leave the choice to the order of this list, and the
/// mistake costs one line to fix at start-up, while a silent fallback to
/// in-process locks costs every lock its meaning with N instances and
/// passes every single-instance test.
const BACKEND_VARS: [(&str, &str); 5] = [
    ("DLOCK_REDIS_URL", "redis"),
    ("DLOCK_REDLOCK_URLS", "redlock"),
    ("DLOCK_ZOOKEEPER", "zookeeper"),
    ("DLOCK_ZOOKEEPER_SESSION_MS", "zookeeper"),
    ("DLOCK_ZOOKEEPER_AUTH", "zookeeper"),
];

impl Config {
    /// Reads the `DLOCK_*` variables of this process.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when a value is malformed.
    pub fn from_env() -> Result<Self> {
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
            Some(other) => {
                return Err(Error::config(
                    "DLOCK_BACKEND",
                    format!("unknown backend `{other}` (expected `memory`, `redis`, `redlock` or `zookeeper`)"),
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
            BackendKind::Memory | BackendKind::ZooKeeper { .. } => {}
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
    pub fn redis_options(&self) -> crate::backend::redis::RedisOptions {
        let options = crate::backend::redis::RedisOptions::default().with_restart_quarantine(self.restart_quarantine);
        match &self.redis_tls {
            Some(tls) => options.with_tls(tls.clone()),
            None => options,
        }
    }

    /// The engine defaults of this configuration.
    pub fn locker_options(&self) -> LockerOptions {
        LockerOptions::default().with_prefix(self.prefix.clone()).with_wait(self.wait).with_watchdog_lease(self.lease)
    }

    /// Connects to the backend and builds the engine.
    ///
    /// For Redis this checks the server at start-up: it must answer, the ACL
    /// user must be allowed to subscribe to the lock channels, and a
    /// `maxmemory-policy` that may evict keys with a TTL is logged as a warning.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid URL or missing permissions,
    /// [`Error::Backend`] when the server cannot be reached.
    pub async fn build(&self) -> Result<Locker> {
        tracing::info!(backend = %self.backend_summary(), prefix = %self.prefix, "dlock: lock backend");
        self.build_locker().await
    }

    /// The backend and where it is, for the start-up log line: URLs with
    /// their passwords hidden, the ZooKeeper user without its password.
    fn backend_summary(&self) -> String {
        match &self.backend {
            BackendKind::Memory => "memory (this process only)".into(),
            BackendKind::Redis { url } => format!("redis {}", redact(url)),
            BackendKind::RedLock { urls } => {
                let urls: Vec<String> = urls.iter().map(|u| redact(u)).collect();
                format!("redlock {}", urls.join(","))
            }
            BackendKind::ZooKeeper { connect, auth, .. } => match auth {
                Some(auth) => format!("zookeeper {connect} (digest auth as `{}`)", auth.user()),
                None => format!("zookeeper {connect} (no auth: lock nodes open to every client)"),
            },
        }
    }

    async fn build_locker(&self) -> Result<Locker> {
        let backend: Arc<dyn Backend> = match &self.backend {
            BackendKind::Memory => Arc::new(MemoryBackend::new()),
            #[cfg(feature = "redis")]
            BackendKind::Redis { url } => Arc::new(
                crate::backend::redis::RedisBackend::connect_with(url, &self.prefix, self.redis_options()).await?,
            ),
            #[cfg(feature = "redis")]
            BackendKind::RedLock { urls } => Arc::new(
                crate::backend::redlock::RedLockBackend::connect_with(
                    urls,
                    &self.prefix,
                    crate::backend::redlock::RedLockOptions::default().with_redis(self.redis_options()),
                )
                .await?,
            ),
            #[cfg(not(feature = "redis"))]
            BackendKind::Redis { .. } | BackendKind::RedLock { .. } => {
                return Err(Error::config("DLOCK_BACKEND", "dlock-core was built without the `redis` feature"))
            }
            #[cfg(feature = "zookeeper")]
            BackendKind::ZooKeeper { connect, session_timeout, auth } => {
                let mut options =
                    crate::backend::zookeeper::ZooKeeperOptions::default().with_session_timeout(*session_timeout);
                if let Some(auth) = auth {
                    options = options.with_auth(auth.clone());
                }
                Arc::new(
                    crate::backend::zookeeper::ZooKeeperBackend::connect_with(connect, &self.prefix, options).await?,
                )
            }
            #[cfg(not(feature = "zookeeper"))]
            BackendKind::ZooKeeper { .. } => {
                return Err(Error::config("DLOCK_BACKEND", "dlock-core was built without the `zookeeper` feature"))
            }
        };
        Locker::with_options(backend, self.locker_options())
    }
}

/// What one [`Config`] builds: the lock engine and the idempotency store,
/// over shared connections where they use the same service.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// let services = dlock_core::Config::default().build_services().await?;
/// assert_eq!(services.locker.backend_name(), "memory");
/// assert_eq!(services.idempotency.name(), "memory");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Services {
    /// The lock engine.
    pub locker: Locker,
    /// Where idempotency tokens and stored responses live.
    pub idempotency: Arc<dyn crate::idempotency::IdempotencyStore>,
}

impl Config {
    /// Builds the lock engine and the idempotency store of this
    /// configuration. When both live in the same Redis (the `redis` backend
    /// with `DLOCK_IDEMPOTENCY_REDIS_URL` unset or equal to
    /// `DLOCK_REDIS_URL`) the store shares the lock backend's connection
    /// instead of opening its own; otherwise this is [`build`](Self::build)
    /// and [`idempotency_store`](Self::idempotency_store).
    ///
    /// Records in the lock keyspace (no `DLOCK_IDEMPOTENCY_REDIS_URL`, or
    /// one naming the same server and database) of a Redis whose
    /// `maxmemory-policy` evicts keys are refused: a flood of records would
    /// make it evict held locks. Point `DLOCK_IDEMPOTENCY_REDIS_URL` at
    /// another instance or database (`redis://host:6379/1`), or use
    /// `noeviction`.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build) and [`idempotency_store`](Self::idempotency_store);
    /// [`Error::Config`] naming `DLOCK_IDEMPOTENCY_REDIS_URL` for records in
    /// an evicting lock keyspace.
    pub async fn build_services(&self) -> Result<Services> {
        let idempotency = match (&self.idempotency_redis_url, &self.backend) {
            (Some(url), _) => format!("redis {}", redact(url)),
            (None, BackendKind::Redis { .. }) => "the lock backend's redis".into(),
            (None, _) => "memory (this process only)".into(),
        };
        tracing::info!(
            backend = %self.backend_summary(),
            prefix = %self.prefix,
            idempotency = %idempotency,
            "dlock: lock backend and idempotency store"
        );
        #[cfg(feature = "redis")]
        if let BackendKind::Redis { url } = &self.backend {
            if self.idempotency_redis_url.as_ref().is_none_or(|own| own == url) {
                let backend = Arc::new(
                    crate::backend::redis::RedisBackend::connect_with(url, &self.prefix, self.redis_options()).await?,
                );
                let store = crate::idempotency::RedisStore::from_backend(&backend).with_limits(self.idempotency_limits);
                self.check_records_beside_locks(&store, url).await?;
                let idempotency = Arc::new(store);
                let locker = Locker::with_options(backend, self.locker_options())?;
                return Ok(Services { locker, idempotency });
            }
        }
        // The store first: its configuration error needs no connection.
        let idempotency = self.idempotency_store().await?;
        Ok(Services { locker: self.build_locker().await?, idempotency })
    }

    /// Connects the idempotency store that goes with this configuration
    /// on a connection of its own (see [`build_services`](Self::build_services)
    /// to share the lock backend's).
    ///
    /// | lock backend | records live in |
    /// |---|---|
    /// | `memory` | this process ([`MemoryStore`](crate::idempotency::MemoryStore)), unless `DLOCK_IDEMPOTENCY_REDIS_URL` is set |
    /// | `redis` | `DLOCK_IDEMPOTENCY_REDIS_URL` if set, else the same Redis as the locks |
    /// | `redlock`, `zookeeper` | `DLOCK_IDEMPOTENCY_REDIS_URL`; unset → an error, unless `DLOCK_IDEMPOTENCY_LOCAL=1` ([`allow_local_idempotency`](Self::allow_local_idempotency)) keeps them in this process, with a warning |
    ///
    /// Records in each process are refused by default with several
    /// instances in mind: a duplicate request sent to two of them would run
    /// on both, and nothing would say so. The `memory` backend is one
    /// process by design, so its records stay there.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// let store = dlock_core::Config::default().idempotency_store().await?;
    /// assert_eq!(store.name(), "memory");
    /// # Ok(()) }
    /// ```
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let mut cfg = dlock_core::Config::from_lookup(|var| match var {
    ///     "DLOCK_BACKEND" => Some("zookeeper".into()),
    ///     _ => None,
    /// }).unwrap();
    /// let err = cfg.idempotency_store().await.unwrap_err();
    /// assert!(err.to_string().contains("DLOCK_IDEMPOTENCY_REDIS_URL"));
    /// cfg.allow_local_idempotency = true;
    /// assert_eq!(cfg.idempotency_store().await.unwrap().name(), "memory");
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_IDEMPOTENCY_REDIS_URL` for `redlock`
    /// or `zookeeper` without it (and without `DLOCK_IDEMPOTENCY_LOCAL=1`),
    /// or for records in the lock keyspace of a Redis whose
    /// `maxmemory-policy` evicts keys (see [`build_services`](Self::build_services));
    /// as [`RedisStore::connect`](crate::idempotency::RedisStore::connect).
    pub async fn idempotency_store(&self) -> Result<Arc<dyn crate::idempotency::IdempotencyStore>> {
        let url = match (&self.idempotency_redis_url, &self.backend) {
            (Some(url), _) => Some(url.as_str()),
            (None, BackendKind::Redis { url }) => Some(url.as_str()),
            (None, BackendKind::Memory) => None,
            (None, other) if !self.allow_local_idempotency => {
                return Err(Error::config(
                    "DLOCK_IDEMPOTENCY_REDIS_URL",
                    format!(
                        "must be set with DLOCK_BACKEND={}: without it each instance keeps its own idempotency \
                         records, and a duplicate sent to two instances runs on both (set \
                         DLOCK_IDEMPOTENCY_LOCAL=1 to accept that)",
                        other.name()
                    ),
                ));
            }
            (None, other) => {
                tracing::warn!(
                    backend = other.name(),
                    "DLOCK_IDEMPOTENCY_REDIS_URL is not set: idempotency records stay in this process and are not shared between instances"
                );
                None
            }
        };
        match url {
            None => Ok(Arc::new(crate::idempotency::MemoryStore::new().with_limits(self.idempotency_limits))),
            #[cfg(feature = "redis")]
            Some(url) => {
                let store = crate::idempotency::RedisStore::connect_with(url, &self.prefix, self.redis_options())
                    .await?
                    .with_limits(self.idempotency_limits);
                self.check_records_beside_locks(&store, url).await?;
                Ok(Arc::new(store))
            }
            #[cfg(not(feature = "redis"))]
            Some(_) => {
                Err(Error::config("DLOCK_IDEMPOTENCY_REDIS_URL", "dlock-core was built without the `redis` feature"))
            }
        }
    }
}

/// Where idempotency records live, seen from the locks.
#[cfg(feature = "redis")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Beside {
    /// The same server and database as (some of) the locks.
    Keyspace,
    /// The same server, another database: apart keys, shared memory.
    Instance,
    /// Elsewhere.
    Apart,
}

/// Whether `records` (a Redis URL) is where a lock URL is: the same string,
/// or the same host, port and database once parsed (`localhost` is
/// `127.0.0.1`). Cluster and Sentinel URLs count as one place only when
/// written the same.
#[cfg(feature = "redis")]
fn beside(records: &str, lock: &str) -> Beside {
    use redis::IntoConnectionInfo;
    if records == lock {
        return Beside::Keyspace;
    }
    let place = |url: &str| {
        let info = url.into_connection_info().ok()?;
        let (host, port) = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            redis::ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
            _ => return None,
        };
        let host = match host.to_ascii_lowercase().as_str() {
            "localhost" | "::1" | "[::1]" => "127.0.0.1".to_owned(),
            other => other.to_owned(),
        };
        Some((host, port, info.redis_settings().db()))
    };
    match (place(records), place(lock)) {
        (Some(r), Some(l)) if r == l => Beside::Keyspace,
        (Some(r), Some(l)) if (&r.0, r.1) == (&l.0, l.1) => Beside::Instance,
        _ => Beside::Apart,
    }
}

#[cfg(feature = "redis")]
impl Config {
    /// Refuses idempotency records in the lock keyspace of a Redis whose
    /// `maxmemory-policy` evicts keys: a flood of records would then evict
    /// held locks. `noeviction` is allowed (the caps keep the records from
    /// filling it); a policy that cannot be read (`CONFIG` refused by an
    /// ACL) is a warning, and the caps are what is left.
    async fn check_records_beside_locks(
        &self,
        store: &crate::idempotency::RedisStore,
        records_url: &str,
    ) -> Result<()> {
        warn_without_persistence(store).await;
        let locks: &[String] = match &self.backend {
            BackendKind::Redis { url } => std::slice::from_ref(url),
            BackendKind::RedLock { urls } => urls,
            BackendKind::Memory | BackendKind::ZooKeeper { .. } => &[],
        };
        let place = locks.iter().map(|lock| beside(records_url, lock)).min_by_key(|b| *b as u8);
        let place = match place {
            None | Some(Beside::Apart) => return Ok(()),
            Some(place) => place,
        };
        let policy = match store.maxmemory_policy().await {
            Ok(policy) => policy,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "dlock: cannot read the maxmemory-policy of the Redis that holds both locks and idempotency \
                     records (CONFIG not permitted?): if it evicts keys, a flood of records can evict held locks. \
                     Only DLOCK_IDEMPOTENCY_MAX_RECORDS bounds them; set DLOCK_IDEMPOTENCY_REDIS_URL to another \
                     Redis instance to be sure"
                );
                return Ok(());
            }
        };
        let evicts = policy.starts_with("volatile-") || policy.starts_with("allkeys-");
        match (place, evicts) {
            (Beside::Keyspace, true) => Err(Error::config(
                "DLOCK_IDEMPOTENCY_REDIS_URL",
                format!(
                    "idempotency records would live in the lock keyspace of a Redis whose maxmemory-policy is \
                     `{policy}`: when it fills up, it evicts keys with a TTL, held locks among them. Set \
                     DLOCK_IDEMPOTENCY_REDIS_URL to a separate instance (best: it has its own memory) or a \
                     separate database (e.g. redis://host:6379/1), or set maxmemory-policy noeviction on this one"
                ),
            )),
            (Beside::Instance, true) => {
                tracing::warn!(
                    policy = %policy,
                    "dlock: idempotency records are in another database of the lock Redis, whose maxmemory-policy \
                     evicts keys: the databases share its memory, so records can still cause locks to be evicted. \
                     Prefer a separate instance for DLOCK_IDEMPOTENCY_REDIS_URL, or maxmemory-policy noeviction"
                );
                Ok(())
            }
            (_, false) => {
                tracing::info!(
                    policy = %policy,
                    max_records = self.idempotency_limits.max_records(),
                    "dlock: idempotency records share the lock Redis; DLOCK_IDEMPOTENCY_MAX_RECORDS keeps them \
                     from filling it"
                );
                Ok(())
            }
            (Beside::Apart, true) => Ok(()),
        }
    }
}

/// Warns when the records' Redis keeps nothing over a restart (neither an
/// append-only file nor RDB snapshots): it would come back empty, and every
/// key completed before would run its route again.
#[cfg(feature = "redis")]
async fn warn_without_persistence(store: &crate::idempotency::RedisStore) {
    match store.persists().await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            "dlock: the Redis that holds idempotency records keeps no persistence (appendonly no, no save \
             points): a restart forgets every completed key, and their retries run again. Turn on \
             `appendonly yes` (with `appendfsync everysec` or `always`) for DLOCK_IDEMPOTENCY_REDIS_URL"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            "dlock: cannot read whether the Redis that holds idempotency records persists them (CONFIG not \
             permitted?): without `appendonly yes`, a restart forgets completed keys and their retries run again"
        ),
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

fn number(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u64>> {
    get(var)
        .map(|v| v.parse::<u64>().map_err(|_| Error::config(var, format!("`{v}` is not a whole non-negative number"))))
        .transpose()
}

/// A whole number of at least 1: a cap of 0 would refuse everything, which
/// is never what a typo meant.
fn positive(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u64>> {
    match number(get, var)? {
        Some(0) => Err(Error::config(var, "must be at least 1")),
        n => Ok(n),
    }
}

/// `1`/`true`/`yes` or `0`/`false`/`no`; anything else is an error rather
/// than "off", so a typo does not quietly keep the default.
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

    /// `DLOCK_REDIS_URL` alone, the natural first guess, used to give
    /// in-process locks without a word: N instances that share nothing.
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
        // Named, the backend takes its variables; `memory` chosen on purpose
        // ignores them (with a warning).
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
        let zookeeper = summary(&[
            ("DLOCK_BACKEND", "zookeeper"),
            ("DLOCK_ZOOKEEPER", "z1:2181"),
            ("DLOCK_ZOOKEEPER_AUTH", "app:pw3"),
        ]);
        assert!(zookeeper.starts_with("zookeeper z1:2181") && zookeeper.contains("app"), "{zookeeper}");
        assert!(!zookeeper.contains("pw3"), "{zookeeper}");
    }

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

    #[cfg(feature = "redis")]
    #[test]
    fn records_beside_locks_are_told_by_host_port_and_database() {
        let at = |records: &str, lock: &str| beside(records, lock);
        assert_eq!(at("redis://h:6379", "redis://h:6379"), Beside::Keyspace);
        assert_eq!(at("redis://localhost/0", "redis://127.0.0.1:6379"), Beside::Keyspace);
        assert_eq!(at("redis://u:pw@h:6379/0", "redis://h"), Beside::Keyspace);
        assert_eq!(at("redis://h:6379/1", "redis://h:6379"), Beside::Instance);
        assert_eq!(at("redis://h:6380", "redis://h:6379"), Beside::Apart);
        assert_eq!(at("redis://other:6379", "redis://h:6379"), Beside::Apart);
        assert_eq!(at("redis+cluster://a:1,b:2", "redis+cluster://a:1"), Beside::Apart);
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

    /// With RedLock or ZooKeeper and no shared store, each instance would
    /// keep its own records and a duplicate sent to two would run twice.
    #[tokio::test]
    async fn records_in_each_process_need_to_be_allowed() {
        let redlock = [("DLOCK_BACKEND", "redlock"), ("DLOCK_REDLOCK_URLS", "redis://a,redis://b,redis://c")];
        let zookeeper = [("DLOCK_BACKEND", "zookeeper"), ("DLOCK_ZOOKEEPER", "10.0.0.1:2181")];
        for vars in [&redlock[..], &zookeeper[..]] {
            let c = cfg(vars).expect("valid");
            let err = c.idempotency_store().await.map(|s| s.name()).expect_err("refused");
            assert!(err.is_misconfigured(), "{err}");
            let text = err.to_string();
            assert!(text.contains("DLOCK_IDEMPOTENCY_REDIS_URL") && text.contains("DLOCK_IDEMPOTENCY_LOCAL"), "{text}");
            // build_services refuses before connecting to anything (the
            // addresses here answer nobody).
            let err = c.build_services().await.map(|s| s.locker.backend_name()).expect_err("refused");
            assert!(err.to_string().contains("DLOCK_IDEMPOTENCY_REDIS_URL"), "{err}");

            let mut allowed = vars.to_vec();
            allowed.push(("DLOCK_IDEMPOTENCY_LOCAL", "1"));
            let store = cfg(&allowed).expect("valid").idempotency_store().await.expect("allowed");
            assert_eq!(store.name(), "memory");
        }
        // The in-process backend is one process by design.
        assert_eq!(cfg(&[]).expect("valid").idempotency_store().await.expect("memory").name(), "memory");
    }
}
