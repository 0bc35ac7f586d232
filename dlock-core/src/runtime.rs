//! [`DlockRuntime`]: what a configuration connects, in one value.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::idempotency::{IdempotencyStore, MemoryStore};
use crate::Locker;

/// dlock, connected: the lock engine, the idempotency store and the HTTP
/// settings of one configuration. [`Config::build`](crate::Config::build)
/// makes one; dlock-axum's `with_dlock` installs it in every request. A bare
/// [`Locker`] converts into one with records in this process.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// let dlock = dlock_core::Config::default().build().await?;
/// assert_eq!(dlock.locker().backend_name(), "memory");
/// assert_eq!(dlock.idempotency_store()?.name(), "memory");
/// assert_eq!(dlock.max_body_bytes(), 64 * 1024);
/// assert!(dlock.readiness().await.is_ready());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DlockRuntime {
    // One reference count per clone: the HTTP layers clone the runtime into
    // every request (several counts cost an in-process route ~100 ns).
    parts: Arc<Parts>,
}

#[derive(Clone)]
struct Parts {
    locker: Locker,
    idempotency: Records,
    /// Stores added with [`also_check`](Self::also_check), by name.
    also_checked: Vec<(&'static str, Arc<dyn IdempotencyStore>)>,
    max_body_bytes: usize,
    body_read_timeout: Duration,
    idempotency_ttl: Duration,
}

/// Where idempotency records live, or why the configuration keeps none.
#[derive(Clone)]
enum Records {
    Store(Arc<dyn IdempotencyStore>),
    /// Refused by the configuration: a request that needs records gets it.
    Refused {
        var: &'static str,
        reason: String,
    },
}

impl std::fmt::Debug for DlockRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let records = match &self.parts.idempotency {
            Records::Store(store) => store.name(),
            Records::Refused { var, .. } => var,
        };
        let also: Vec<_> = self.parts.also_checked.iter().map(|(part, store)| (part, store.name())).collect();
        f.debug_struct("DlockRuntime")
            .field("locks", &self.parts.locker.backend_name())
            .field("idempotency", &records)
            .field("also_checked", &also)
            .field("max_body_bytes", &self.parts.max_body_bytes)
            .field("body_read_timeout", &self.parts.body_read_timeout)
            .field("idempotency_ttl", &self.parts.idempotency_ttl)
            .finish()
    }
}

/// How long a request body may take to arrive unless configured otherwise
/// (`DLOCK_BODY_READ_TIMEOUT_MS`).
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The most request body bytes read to derive a key or a fingerprint unless
/// configured otherwise (`DLOCK_MAX_BODY_BYTES`).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;

/// How long idempotency tokens and stored responses live unless configured
/// otherwise (`DLOCK_IDEMPOTENCY_TTL_SECS`): 24 hours.
pub const DEFAULT_IDEMPOTENCY_TTL: Duration = Duration::from_secs(86_400);

impl DlockRuntime {
    /// `locker`, with idempotency records in this process and the settings
    /// of [`Config::default`](crate::Config::default).
    ///
    /// ```
    /// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new()));
    /// assert_eq!(dlock.idempotency_store().unwrap().name(), "memory");
    /// ```
    pub fn new(locker: Locker) -> Self {
        DlockRuntime {
            parts: Arc::new(Parts {
                locker,
                idempotency: Records::Store(Arc::new(MemoryStore::new())),
                also_checked: Vec::new(),
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
                body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
                idempotency_ttl: DEFAULT_IDEMPOTENCY_TTL,
            }),
        }
    }

    /// The runtime [`Config::build`](crate::Config::build) connected;
    /// `idempotency`: the store, or the variable and reason that refused one.
    pub(crate) fn from_parts(
        locker: Locker,
        idempotency: std::result::Result<Arc<dyn IdempotencyStore>, (&'static str, String)>,
        config: &crate::Config,
    ) -> Self {
        let idempotency = match idempotency {
            Ok(store) => Records::Store(store),
            Err((var, reason)) => Records::Refused { var, reason },
        };
        DlockRuntime {
            parts: Arc::new(Parts {
                locker,
                idempotency,
                also_checked: Vec::new(),
                max_body_bytes: config.max_body_bytes,
                body_read_timeout: config.body_read_timeout,
                idempotency_ttl: config.idempotency_ttl,
            }),
        }
    }

    /// Replaces where idempotency records and tokens live, for the layers
    /// given no store of their own and for [`readiness`](Self::readiness):
    /// hand it the store your routes use (say, a
    /// [`PostgresStore::with_pool`](crate::idempotency::PostgresStore::with_pool)
    /// of your database). A store used beside this one goes to
    /// [`also_check`](Self::also_check) instead.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use dlock_core::{idempotency::MemoryStore, DlockRuntime, Locker, MemoryBackend};
    /// let store = Arc::new(MemoryStore::new());
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).with_idempotency_store(store);
    /// assert!(dlock.idempotency_store().is_ok());
    /// ```
    pub fn with_idempotency_store(mut self, store: Arc<dyn IdempotencyStore>) -> Self {
        Arc::make_mut(&mut self.parts).idempotency = Records::Store(store);
        self
    }

    /// Adds a store routes use beside the runtime's own to
    /// [`readiness`](Self::readiness), as a check named `part`. Records and
    /// tokens stay where they were.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::sync::Arc;
    /// use dlock_core::{idempotency::MemoryStore, DlockRuntime, Locker, MemoryBackend};
    /// let payments = Arc::new(MemoryStore::new()); // e.g. PostgresStore::with_pool(app_pool, "payments")
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).also_check("payments records", payments);
    /// let parts: Vec<_> = dlock.readiness().await.checks().iter().map(|c| c.part()).collect();
    /// assert_eq!(parts, ["locks", "idempotency", "payments records"]);
    /// # }
    /// ```
    pub fn also_check(mut self, part: &'static str, store: Arc<dyn IdempotencyStore>) -> Self {
        Arc::make_mut(&mut self.parts).also_checked.push((part, store));
        self
    }

    /// Replaces the most body bytes read to derive a key or a fingerprint
    /// (`DLOCK_MAX_BODY_BYTES`).
    ///
    /// ```
    /// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).with_max_body_bytes(1024);
    /// assert_eq!(dlock.max_body_bytes(), 1024);
    /// ```
    pub fn with_max_body_bytes(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.parts).max_body_bytes = limit;
        self
    }

    /// Replaces how long a request body may take to arrive, first read to
    /// last byte (`DLOCK_BODY_READ_TIMEOUT_MS`, default 30 s).
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).with_body_read_timeout(Duration::from_secs(5));
    /// assert_eq!(dlock.body_read_timeout(), Duration::from_secs(5));
    /// ```
    pub fn with_body_read_timeout(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.parts).body_read_timeout = timeout;
        self
    }

    /// Replaces how long idempotency tokens and stored responses live
    /// (`DLOCK_IDEMPOTENCY_TTL_SECS`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
    /// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).with_idempotency_ttl(Duration::from_secs(60));
    /// assert_eq!(dlock.idempotency_ttl(), Duration::from_secs(60));
    /// ```
    pub fn with_idempotency_ttl(mut self, ttl: Duration) -> Self {
        Arc::make_mut(&mut self.parts).idempotency_ttl = ttl;
        self
    }

    /// The lock engine.
    pub fn locker(&self) -> &Locker {
        &self.parts.locker
    }

    /// Where idempotency records and tokens live.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when the configuration keeps
    /// no records (`redlock` or `zookeeper` locks without
    /// `DLOCK_IDEMPOTENCY_REDIS_URL`; see [`Config::build`](crate::Config::build)).
    pub fn idempotency_store(&self) -> Result<&Arc<dyn IdempotencyStore>> {
        match &self.parts.idempotency {
            Records::Store(store) => Ok(store),
            Records::Refused { var, reason } => Err(Error::config(var, reason.clone())),
        }
    }

    /// The most request body bytes read unless a layer says otherwise.
    pub fn max_body_bytes(&self) -> usize {
        self.parts.max_body_bytes
    }

    /// How long a request body may take to arrive.
    pub fn body_read_timeout(&self) -> Duration {
        self.parts.body_read_timeout
    }

    /// How long idempotency tokens and stored responses live unless a layer
    /// says otherwise.
    pub fn idempotency_ttl(&self) -> Duration {
        self.parts.idempotency_ttl
    }

    /// Asks every server this runtime uses whether it answers now (the lock
    /// backend, the idempotency store if any, each store added with
    /// [`also_check`](Self::also_check)): one round trip per server, all at
    /// once, no lock taken and nothing written.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
    /// let readiness = DlockRuntime::new(Locker::new(MemoryBackend::new())).readiness().await;
    /// assert!(readiness.is_ready());
    /// assert_eq!(readiness.checks()[0].part(), "locks");
    /// # }
    /// ```
    pub async fn readiness(&self) -> Readiness {
        // A configuration without records only locks: still ready.
        let runtime_store = match &self.parts.idempotency {
            Records::Store(store) => Some(("idempotency", store)),
            Records::Refused { .. } => None,
        };
        let stores =
            runtime_store.into_iter().chain(self.parts.also_checked.iter().map(|(part, store)| (*part, store)));
        // At once: the slowest server's time, not their sum.
        let (locks, stores) = tokio::join!(
            self.parts.locker.ready(),
            futures_util::future::join_all(
                stores.map(|(part, store)| async move { ReadinessCheck::of(part, store.name(), store.ready().await) })
            )
        );
        let mut checks = vec![ReadinessCheck::of("locks", self.parts.locker.backend_name(), locks)];
        checks.extend(stores);
        Readiness { checks }
    }
}

impl From<Locker> for DlockRuntime {
    fn from(locker: Locker) -> Self {
        DlockRuntime::new(locker)
    }
}

/// What [`DlockRuntime::readiness`] found: one [`ReadinessCheck`] per part.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use dlock_core::{DlockRuntime, Locker, MemoryBackend};
/// let readiness = DlockRuntime::new(Locker::new(MemoryBackend::new())).readiness().await;
/// for check in readiness.checks() {
///     println!("{} on {}: {}", check.part(), check.backend(), check.problem().unwrap_or("ok"));
/// }
/// assert_eq!(readiness.checks().len(), 2); // locks, idempotency
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Readiness {
    checks: Vec<ReadinessCheck>,
}

impl Readiness {
    /// Every part answered.
    pub fn is_ready(&self) -> bool {
        self.checks.iter().all(ReadinessCheck::is_ok)
    }

    /// The parts, locks first.
    pub fn checks(&self) -> &[ReadinessCheck] {
        &self.checks
    }
}

/// One part of a [`Readiness`]: its name, its backend, and the error when
/// it did not answer.
#[derive(Debug, Clone)]
pub struct ReadinessCheck {
    part: &'static str,
    backend: &'static str,
    problem: Option<String>,
}

impl ReadinessCheck {
    fn of(part: &'static str, backend: &'static str, answer: Result<()>) -> Self {
        ReadinessCheck { part, backend, problem: answer.err().map(|e| e.to_string()) }
    }

    /// `locks`, `idempotency`, or the name given to
    /// [`DlockRuntime::also_check`].
    pub fn part(&self) -> &'static str {
        self.part
    }

    /// `memory`, `redis`, `redlock`, `zookeeper` or `postgres`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// It answered.
    pub fn is_ok(&self) -> bool {
        self.problem.is_none()
    }

    /// What is wrong, for people (a quarantine says how long it has left).
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }
}
