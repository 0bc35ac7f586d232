//! Connecting what a [`Config`] names into one [`DlockRuntime`], with the
//! start-up checks of its servers (`config.rs` does no I/O).

use std::sync::Arc;

use crate::backend::memory::MemoryBackend;
use crate::backend::Backend;
use crate::config::{BackendKind, Config};
use crate::engine::Locker;
use crate::error::{Error, Result};
use crate::idempotency::{IdempotencyStore, MemoryStore};
use crate::redact::redact;
use crate::runtime::DlockRuntime;

impl Config {
    /// Connects the lock backend and the idempotency store this
    /// configuration names, and checks their servers.
    ///
    /// | lock backend | idempotency records live in |
    /// |---|---|
    /// | `memory` | this process, unless `DLOCK_IDEMPOTENCY_REDIS_URL` is set |
    /// | `redis` | `DLOCK_IDEMPOTENCY_REDIS_URL` if set, else the same Redis as the locks, over the same connection |
    /// | `postgres` | `DLOCK_IDEMPOTENCY_REDIS_URL` if set, else the same database as the locks, on the same pool ([`PostgresStore`](crate::idempotency::PostgresStore)), its tables made when it is first asked for a record |
    /// | `redlock`, `zookeeper` | `DLOCK_IDEMPOTENCY_REDIS_URL`; unset: none, unless `DLOCK_IDEMPOTENCY_LOCAL=1` keeps them in this process |
    ///
    /// Without a place for records the locks work, and every request that
    /// needs records is refused naming `DLOCK_IDEMPOTENCY_REDIS_URL`
    /// ([`DlockRuntime::idempotency_store`]): records in each process would
    /// let a duplicate sent to two instances run on both. Routes with a
    /// store of their own hand it over with
    /// [`DlockRuntime::with_idempotency_store`] or
    /// [`DlockRuntime::also_check`].
    ///
    /// Redis servers are checked now (they answer, are Redis 7 or newer,
    /// let the ACL user subscribe to the lock channels). Records in the lock
    /// keyspace of a Redis whose `maxmemory-policy` evicts are refused (they
    /// would evict held locks); a records Redis that persists nothing is a
    /// warning.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// let dlock = dlock_core::Config::default().build().await?;
    /// assert_eq!(dlock.locker().backend_name(), "memory");
    ///
    /// let redis_locks = dlock_core::Config::from_lookup(|var| match var {
    ///     "DLOCK_BACKEND" => Some("redis".into()),
    ///     "DLOCK_REDIS_URL" => Some("redis://127.0.0.1:6379".into()),
    ///     _ => None,
    /// })?;
    /// # let _ = redis_locks;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable for a URL that does not parse,
    /// credentials a server refused, missing permissions, or records in an
    /// evicting lock keyspace; [`Error::Backend`] when a server cannot be
    /// reached, its message naming the variable and the address (password
    /// hidden).
    pub async fn build(&self) -> Result<DlockRuntime> {
        tracing::info!(
            backend = %self.backend_summary(),
            prefix = %self.prefix,
            idempotency = %self.records_summary(),
            "dlock: lock backend and idempotency store"
        );
        #[cfg(feature = "redis")]
        if let BackendKind::Redis { url } = &self.backend
            && self.idempotency_redis_url.as_ref().is_none_or(|own| own == url)
        {
            let backend = Arc::new(
                crate::backend::redis::RedisBackend::connect_with(url, &self.prefix, self.redis_options())
                    .await
                    .map_err(at("DLOCK_REDIS_URL", url))?,
            );
            let store = crate::idempotency::RedisStore::from_backend(&backend).with_limits(self.idempotency_limits);
            self.check_records_beside_locks(&store, url).await?;
            let locker = Locker::with_options(backend, self.locker_options())?;
            return Ok(DlockRuntime::from_parts(locker, Ok(Arc::new(store)), self));
        }
        #[cfg(feature = "postgres")]
        if let (BackendKind::Postgres { url, listen_url }, None) = (&self.backend, &self.idempotency_redis_url) {
            let backend = Arc::new(postgres_backend(url, listen_url.as_deref(), &self.prefix).await?);
            // Tables on first use: routes may keep records elsewhere.
            let store = crate::idempotency::PostgresStore::on_first_use(&backend)
                .map_err(at("DLOCK_POSTGRES_URL", url))?
                .with_limits(self.idempotency_limits);
            let locker = Locker::with_options(backend, self.locker_options())?;
            return Ok(DlockRuntime::from_parts(locker, Ok(Arc::new(store)), self));
        }
        // The records first, so a records Redis down is reported as such.
        let records = self.connect_records().await?;
        let locker = self.connect_locks().await?;
        Ok(DlockRuntime::from_parts(locker, records, self))
    }

    /// The backend and where it is, for the start-up line, passwords hidden.
    pub(crate) fn backend_summary(&self) -> String {
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
            BackendKind::Postgres { url, .. } => format!("postgres {}", redact(url)),
        }
    }

    fn records_summary(&self) -> String {
        match (&self.idempotency_redis_url, &self.backend) {
            (Some(url), _) => format!("redis {}", redact(url)),
            (None, BackendKind::Redis { .. }) => "the lock backend's redis".into(),
            (None, BackendKind::Memory) => "memory (this process only)".into(),
            (None, BackendKind::Postgres { .. }) => "the lock backend's postgres".into(),
            (None, _) if self.allow_local_idempotency => "memory (each process its own)".into(),
            (None, _) => "none (DLOCK_IDEMPOTENCY_REDIS_URL unset)".into(),
        }
    }

    async fn connect_locks(&self) -> Result<Locker> {
        let backend: Arc<dyn Backend> = match &self.backend {
            BackendKind::Memory => Arc::new(MemoryBackend::new()),
            #[cfg(feature = "redis")]
            BackendKind::Redis { url } => Arc::new(
                crate::backend::redis::RedisBackend::connect_with(url, &self.prefix, self.redis_options())
                    .await
                    .map_err(at("DLOCK_REDIS_URL", url))?,
            ),
            #[cfg(feature = "redis")]
            BackendKind::RedLock { urls } => Arc::new(
                crate::backend::redlock::RedLockBackend::connect_with(
                    urls,
                    &self.prefix,
                    crate::backend::redlock::RedLockOptions::default().with_redis(self.redis_options()),
                )
                .await
                .map_err(|e| match e {
                    Error::Config { var: "DLOCK_REDIS_URL", reason } => Error::config("DLOCK_REDLOCK_URLS", reason),
                    other => other,
                })?,
            ),
            #[cfg(feature = "zookeeper")]
            BackendKind::ZooKeeper { connect, session_timeout, auth } => {
                let mut options =
                    crate::backend::zookeeper::ZooKeeperOptions::default().with_session_timeout(*session_timeout);
                if let Some(auth) = auth {
                    options = options.with_auth(auth.clone());
                }
                Arc::new(
                    crate::backend::zookeeper::ZooKeeperBackend::connect_with(connect, &self.prefix, options)
                        .await
                        .map_err(at("DLOCK_ZOOKEEPER", connect))?,
                )
            }
            #[cfg(feature = "postgres")]
            BackendKind::Postgres { url, listen_url } => {
                Arc::new(postgres_backend(url, listen_url.as_deref(), &self.prefix).await?)
            }
            // `Config::from_lookup` refuses a backend whose feature is off.
            #[allow(unreachable_patterns)]
            other => {
                return Err(Error::config(
                    "DLOCK_BACKEND",
                    format!("dlock-core was built without the `{}` feature", other.name()),
                ))
            }
        };
        Locker::with_options(backend, self.locker_options())
    }

    /// The idempotency store on a connection of its own; `Err` inside: no
    /// records (not a start-up error), with the variable and the reason.
    async fn connect_records(&self) -> Result<std::result::Result<Arc<dyn IdempotencyStore>, (&'static str, String)>> {
        let url = match (&self.idempotency_redis_url, &self.backend) {
            (Some(url), _) => Some(url.as_str()),
            (None, BackendKind::Redis { url }) => Some(url.as_str()),
            (None, BackendKind::Memory) => None,
            (None, other) if !self.allow_local_idempotency => {
                let reason = format!(
                    "must be set with DLOCK_BACKEND={} for idempotency records: without it each instance would keep \
                     its own, and a duplicate sent to two instances would run on both (set DLOCK_IDEMPOTENCY_LOCAL=1 \
                     to accept that)",
                    other.name()
                );
                tracing::warn!(
                    backend = other.name(),
                    "dlock: no idempotency records: routes with an idempotency layer will refuse every request. \
                     DLOCK_IDEMPOTENCY_REDIS_URL {reason}"
                );
                return Ok(Err(("DLOCK_IDEMPOTENCY_REDIS_URL", reason)));
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
            None => Ok(Ok(Arc::new(MemoryStore::new().with_limits(self.idempotency_limits)))),
            #[cfg(feature = "redis")]
            Some(url) => {
                let var = match &self.idempotency_redis_url {
                    Some(_) => "DLOCK_IDEMPOTENCY_REDIS_URL",
                    None => "DLOCK_REDIS_URL",
                };
                let store = crate::idempotency::RedisStore::connect_with(url, &self.prefix, self.redis_options())
                    .await
                    .map_err(at(var, url))?
                    .with_limits(self.idempotency_limits);
                self.check_records_beside_locks(&store, url).await?;
                Ok(Ok(Arc::new(store)))
            }
            #[cfg(not(feature = "redis"))]
            Some(_) => {
                Err(Error::config("DLOCK_IDEMPOTENCY_REDIS_URL", "dlock-core was built without the `redis` feature"))
            }
        }
    }
}

/// An error of connecting to the server `var` names at `address`, saying
/// which (a configuration error is moved to `var`).
#[cfg(any(feature = "redis", feature = "zookeeper", feature = "postgres"))]
fn at<'a>(var: &'static str, address: &'a str) -> impl FnOnce(Error) -> Error + 'a {
    move |e| match e {
        Error::Backend { backend, message, source } => {
            Error::Backend { backend, message: format!("{var} ({}): {message}", redact(address)), source }
        }
        Error::Config { var: "DLOCK_REDIS_URL", reason } => Error::config(var, reason),
        other => other,
    }
}

/// The PostgreSQL backend of `DLOCK_POSTGRES_URL`, listening on
/// `DLOCK_POSTGRES_LISTEN_URL` when it is set.
#[cfg(feature = "postgres")]
async fn postgres_backend(
    url: &str,
    listen_url: Option<&str>,
    prefix: &str,
) -> Result<crate::backend::postgres::PostgresBackend> {
    let mut options = crate::backend::postgres::PostgresOptions::default();
    if let Some(listen) = listen_url {
        options = options.with_listen_url(listen);
    }
    crate::backend::postgres::PostgresBackend::connect_with(url, prefix, options)
        .await
        .map_err(at("DLOCK_POSTGRES_URL", url))
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
/// or the same host, port and database once parsed (Cluster and Sentinel
/// URLs only when written the same).
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
    /// Refuses records in the lock keyspace of a Redis whose
    /// `maxmemory-policy` evicts (a flood would evict held locks); a policy
    /// that cannot be read is a warning, and the caps are what is left.
    async fn check_records_beside_locks(
        &self,
        store: &crate::idempotency::RedisStore,
        records_url: &str,
    ) -> Result<()> {
        warn_without_persistence(store).await;
        let locks: &[String] = match &self.backend {
            BackendKind::Redis { url } => std::slice::from_ref(url),
            BackendKind::RedLock { urls } => urls,
            BackendKind::Memory | BackendKind::ZooKeeper { .. } | BackendKind::Postgres { .. } => &[],
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

/// Warns when the records' Redis persists nothing: back empty, every key
/// completed before would run its route again.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())).expect("valid")
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

    /// RedLock or ZooKeeper with no shared store: no records, unless allowed.
    #[tokio::test]
    async fn records_in_each_process_need_to_be_allowed() {
        let redlock = [("DLOCK_BACKEND", "redlock"), ("DLOCK_REDLOCK_URLS", "redis://a,redis://b,redis://c")];
        let zookeeper = [("DLOCK_BACKEND", "zookeeper"), ("DLOCK_ZOOKEEPER", "10.0.0.1:2181")];
        // Without the feature, `zookeeper` is refused before its records.
        let backends: &[&[(&str, &str)]] =
            if cfg!(feature = "zookeeper") { &[&redlock, &zookeeper] } else { &[&redlock] };
        for &vars in backends {
            // Decided before connecting to anything (these addresses answer nobody).
            let refused = cfg(vars).connect_records().await.expect("no connection needed");
            let (var, reason) = refused.map(|s| s.name()).expect_err("refused");
            assert_eq!(var, "DLOCK_IDEMPOTENCY_REDIS_URL");
            let text = Error::config(var, reason).to_string();
            assert!(text.contains("DLOCK_IDEMPOTENCY_REDIS_URL") && text.contains("DLOCK_IDEMPOTENCY_LOCAL"), "{text}");

            let mut allowed = vars.to_vec();
            allowed.push(("DLOCK_IDEMPOTENCY_LOCAL", "1"));
            let store = cfg(&allowed).connect_records().await.expect("no connection").expect("allowed");
            assert_eq!(store.name(), "memory");
        }
        // The in-process backend is one process by design.
        let store = cfg(&[]).connect_records().await.expect("no connection").expect("memory");
        assert_eq!(store.name(), "memory");
    }

    /// A refused configuration leaves the locks working and ready; asking
    /// for records names the variable.
    #[tokio::test]
    async fn a_runtime_without_records_names_the_variable() {
        let mut config = cfg(&[]);
        config.allow_local_idempotency = false;
        let refused = Err(("DLOCK_IDEMPOTENCY_REDIS_URL", "must be set".to_owned()));
        let runtime = DlockRuntime::from_parts(Locker::new(MemoryBackend::new()), refused, &config);
        let err = runtime.idempotency_store().map(|s| s.name()).expect_err("refused");
        assert!(err.to_string().contains("DLOCK_IDEMPOTENCY_REDIS_URL"), "{err}");
        let readiness = runtime.readiness().await;
        assert!(readiness.is_ready(), "{readiness:?}");
        assert_eq!(readiness.checks().iter().map(|c| c.part()).collect::<Vec<_>>(), ["locks"]);
    }

    /// Which Redis failed, and where, the password hidden.
    #[test]
    fn connection_errors_name_the_variable_and_the_address() {
        let e = at("DLOCK_IDEMPOTENCY_REDIS_URL", "redis://app:s3cret@10.0.0.9:6380/1")(Error::backend(
            "redis",
            "cannot reach Redis: Connection refused",
        ));
        let text = e.to_string();
        assert!(text.contains("DLOCK_IDEMPOTENCY_REDIS_URL (redis://***@10.0.0.9:6380/1)"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let e = at("DLOCK_IDEMPOTENCY_REDIS_URL", "redis://h")(Error::config("DLOCK_REDIS_URL", "bad"));
        assert!(matches!(e, Error::Config { var: "DLOCK_IDEMPOTENCY_REDIS_URL", .. }), "{e}");
    }
}
