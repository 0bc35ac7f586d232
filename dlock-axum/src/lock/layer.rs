use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderName;
use dlock_core::LockMode;
use dlock_core::Locker;
use tower::Layer;

use super::json::Want;
use super::quota::Quota;
use super::service::RequireLock;
use super::spec::{Also, KeySource, Spec};
use crate::caller::Caller;
use crate::pipeline::policy::Policy;

/// Locks a route on a key built from request fields; see the [module docs](crate::lock).
///
/// The key is `prefix:{name:part1:part2…}`, parts escaped in declared order
/// (JSON strings as text, other values as JSON); a missing field is a `400`.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use dlock_axum::{LockLayer, DlockExt};
/// use dlock_core::{Locker, MemoryBackend};
///
/// let layer = LockLayer::new("order.create")
///     .json("product.id")
///     .query("token")
///     .header("x-user-id")
///     .wait(Duration::from_millis(0))
///     .lease(Duration::from_secs(10))
///     .message("this order is already being placed")
///     .code(4001);
/// let app: Router = Router::new()
///     .route("/orders", post(|body: String| async move { body }).route_layer(layer))
///     .with_dlock(Locker::new(MemoryBackend::new()));
/// ```
#[derive(Clone)]
pub struct LockLayer {
    spec: Arc<Spec>,
}

impl fmt::Debug for LockLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.spec;
        let p = &s.policy;
        f.debug_struct("LockLayer")
            .field("name", &p.name)
            .field("parts", &s.parts)
            .field("also", &s.also)
            .field("mode", &p.mode)
            .field("wait", &p.wait)
            .field("lease", &p.lease)
            .field("max_hold", &p.max_hold)
            .field("message", &p.message)
            .field("code", &p.code)
            .field("max_body_bytes", &s.max_body_bytes)
            .field("locker", &s.locker)
            .finish()
    }
}

impl LockLayer {
    /// A layer for the lock `name`: one lock for the route until parts are added.
    pub fn new(name: impl Into<String>) -> Self {
        LockLayer {
            spec: Arc::new(Spec {
                policy: Policy::new(name.into()),
                parts: Vec::new(),
                also: Vec::new(),
                json_want: Want::Nothing,
                max_body_bytes: None,
                locker: None,
                quota: None,
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Spec)) -> Self {
        f(Arc::make_mut(&mut self.spec));
        self
    }

    /// Adds a field of the JSON body (`"product.id"`, `"items.0.sku"`), read
    /// once up to [`max_body_bytes`](Self::max_body_bytes) and handed on
    /// unchanged; a `Content-Type` that is not JSON is `415`.
    pub fn json(self, path: impl Into<String>) -> Self {
        let path = path.into();
        let segments: Vec<String> = path.split('.').map(str::to_owned).collect();
        self.with(|s| {
            s.json_want.add(&segments);
            s.last_parts().push(KeySource::Json { path, segments })
        })
    }

    /// Adds a query parameter (percent-decoded); missing, empty or blank →
    /// `400 lock_key_field_missing`, sent twice → `400 lock_key_field_duplicated`.
    pub fn query(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with(|s| s.last_parts().push(KeySource::Query(name)))
    }

    /// Adds a path parameter (`/items/{id}` → `path("id")`); around a whole
    /// router no route is matched yet, so that is `500 lock_misconfigured`.
    pub fn path(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with(|s| s.last_parts().push(KeySource::Path(name)))
    }

    /// Adds a request header; missing, empty or blank →
    /// `400 lock_key_field_missing`, sent twice → `400 lock_key_field_duplicated`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn header(self, name: &str) -> Self {
        let name = match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => name,
            Err(_) => panic!("LockLayer::header: `{name}` is not a valid HTTP header name"),
        };
        self.with(|s| s.last_parts().push(KeySource::Header(name)))
    }

    /// Takes the key shared (a read lock): shared requests run together, an
    /// exclusive one alone; the other mode waits, then gets the route's `409`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{routing::{get, post}, Router};
    /// use dlock_axum::LockLayer;
    ///
    /// let prices: Router = Router::new()
    ///     // Any number of readers at once…
    ///     .route("/prices/{list}", get(|| async { "[]" }).route_layer(LockLayer::new("price.list").path("list").shared()))
    ///     // …or one repricing job, with no reader in between.
    ///     .route(
    ///         "/prices/{list}/reprice",
    ///         post(|| async { "repriced" })
    ///             .route_layer(LockLayer::new("price.list").path("list").wait(Duration::from_secs(5))),
    ///     );
    /// ```
    pub fn shared(self) -> Self {
        self.with(|s| s.policy.mode = LockMode::Shared)
    }

    /// At most `n` requests hold the key at once (a semaphore); the next waits,
    /// then gets `429 lock_permits_exhausted`. Every route of the key uses one `n`.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use dlock_axum::LockLayer;
    ///
    /// // At most two exports of one user at once; a third is a 429.
    /// let exports: Router = Router::new()
    ///     .route("/exports", post(|| async { "exported" }).route_layer(LockLayer::new("export").header("x-user-id").permits(2)));
    /// ```
    ///
    /// # Panics
    ///
    /// When `n` is zero.
    pub fn permits(self, n: u32) -> Self {
        assert!(n > 0, "LockLayer::permits: a semaphore of 0 permits would refuse every request");
        self.with(|s| s.policy.mode = LockMode::permits(n))
    }

    /// Starts a further key, `name`, with the parts declared after it. All keys
    /// are taken or none, in one global order (no deadlock), within one wait;
    /// [`HeldLocks`](crate::HeldLocks) has every key's token.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use dlock_axum::LockLayer;
    ///
    /// // A transfer holds both accounts: `{"from": 1, "to": 2, "amount": 5}`.
    /// let layer = LockLayer::new("account").json("from").also("account").json("to");
    /// let app: Router = Router::new().route("/transfers", post(|body: String| async move { body }).route_layer(layer));
    /// ```
    pub fn also(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with(|s| s.also.push(Also { name, parts: Vec::new() }))
    }

    /// How long to wait for a held lock before the `409` (default `DLOCK_WAIT_MS`).
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|s| s.policy.wait = Some(wait))
    }

    /// A fixed lease (default: watchdog mode, renewed while the request runs).
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|s| s.policy.lease = Some(lease))
    }

    /// In watchdog mode, stop renewing after this long (a stuck handler's cap).
    pub fn max_hold(self, max_hold: Duration) -> Self {
        self.with(|s| s.policy.max_hold = Some(max_hold))
    }

    /// The `message` of the `409 duplicate_submission` answer.
    pub fn message(self, message: impl Into<Cow<'static, str>>) -> Self {
        let message = message.into();
        self.with(|s| s.policy.message = Some(message))
    }

    /// The `code` of the `409 duplicate_submission` answer (default 2101).
    pub fn code(self, code: u32) -> Self {
        self.with(|s| s.policy.code = Some(code))
    }

    /// The most body bytes read for JSON fields (`413` past it; default
    /// [`DlockRuntime::max_body_bytes`](crate::DlockRuntime::max_body_bytes)).
    pub fn max_body_bytes(self, limit: usize) -> Self {
        self.with(|s| s.max_body_bytes = Some(limit))
    }

    /// At most `max` locks held at once through this layer per [`Caller`] (in
    /// this process): the next is `429 too_many_locks`, one without a caller
    /// `400 lock_caller_missing`. Name the caller your authentication verified
    /// ([`Caller::from_fn`]); see `docs/handlers.md`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_axum::{Caller, LockLayer};
    ///
    /// /// Set by the service's authentication middleware.
    /// #[derive(Clone)]
    /// struct User(String);
    ///
    /// let layer = LockLayer::new("report.build")
    ///     .json("report_id")
    ///     .max_holds_per(20, Caller::from_fn(|parts| parts.extensions.get::<User>().map(|u| u.0.clone())))
    ///     .max_hold(Duration::from_secs(60));
    /// ```
    ///
    /// # Panics
    ///
    /// When `max` is zero.
    pub fn max_holds_per(self, max: usize, caller: Caller) -> Self {
        assert!(max > 0, "LockLayer::max_holds_per: a cap of 0 would refuse every request");
        self.with(|s| s.quota = Some(Arc::new(Quota::new(caller, max))))
    }

    /// Uses `locker` instead of the one installed in the request extensions.
    pub fn locker(self, locker: Locker) -> Self {
        self.with(|s| s.locker = Some(locker))
    }
}

impl<S> Layer<S> for LockLayer {
    type Service = RequireLock<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireLock::new(inner, self.spec.clone())
    }
}

impl RequireLock<()> {
    /// The layer of this service: [`LockLayer::new`]`(name)`.
    pub fn layer(name: impl Into<String>) -> LockLayer {
        LockLayer::new(name)
    }
}
