use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderName;
use dlock_core::backend::LockMode;
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
/// The key is `prefix:{name:part1:part2…}` with the parts in the order they
/// were declared, each escaped so that no two requests with different values
/// share a key. JSON values count as text for strings and as their JSON text
/// for numbers, booleans, objects and arrays; `null` is a value of its own,
/// distinct from every string; a missing field is a `400`.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use dlock_axum::{LockLayer, LockerExt};
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
///     .with_locker(Locker::new(MemoryBackend::new()));
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
    /// A layer for the lock called `name` (a key with no parts yet: every
    /// request of the route takes the same lock until parts are added).
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

    /// Adds a field of the JSON body to the key (to the key the last
    /// [`also`](Self::also) started, if any; so for every part). `path` may walk nested
    /// objects and arrays: `"product.id"`, `"items.0.sku"`.
    ///
    /// The layer then reads the body (at most [`max_body_bytes`](Self::max_body_bytes)),
    /// parses it once and hands the same bytes on to the route. A request
    /// whose `Content-Type` is not JSON is refused with
    /// `415 unsupported_media_type` before anything is read or locked (one
    /// without `Content-Type` is read as JSON).
    pub fn json(self, path: impl Into<String>) -> Self {
        let path = path.into();
        let segments: Vec<String> = path.split('.').map(str::to_owned).collect();
        self.with(|s| {
            s.json_want.add(&segments);
            s.last_parts().push(KeySource::Json { path, segments })
        })
    }

    /// Adds a query-string parameter (percent-decoded). A request without
    /// it, or with an empty or blank value (`?name=`), is refused with
    /// `400 lock_key_field_missing`, as for [`header`](Self::header); one that
    /// sends it more than once with `400 lock_key_field_duplicated`: the
    /// key and the handler could otherwise read different values.
    pub fn query(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with(|s| s.last_parts().push(KeySource::Query(name)))
    }

    /// Adds a path parameter of the route (`/items/{id}` → `path("id")`).
    ///
    /// Path parameters exist once the router has matched the route: put the
    /// layer on the route (`post(handler).route_layer(..)`) or on the router
    /// (`Router::route_layer`, which wraps each route), not around the whole
    /// router as a service; there it answers `500 lock_misconfigured`.
    pub fn path(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with(|s| s.last_parts().push(KeySource::Path(name)))
    }

    /// Adds a request header. A request without it, or with an empty or
    /// blank value, is refused with `400 lock_key_field_missing` (as
    /// [`Caller::header`](crate::Caller::header) finds no caller in it); one
    /// that sends it more than once with `400 lock_key_field_duplicated`, as
    /// for [`query`](Self::query).
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name: that is a programming error
    /// found on start-up, like an invalid route path in axum.
    pub fn header(self, name: &str) -> Self {
        let name = match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => name,
            Err(_) => panic!("LockLayer::header: `{name}` is not a valid HTTP header name"),
        };
        self.with(|s| s.last_parts().push(KeySource::Header(name)))
    }

    /// Takes the key in shared mode (a read lock): requests of shared routes
    /// on one key run together, and a request that takes the key exclusively
    /// (a [`LockLayer`] without `shared`, a `#[lockable]` without
    /// `mode = "shared"`) runs alone. A shared request that finds the key held
    /// exclusively (or an exclusive one that finds it shared) waits, then is
    /// refused with the route's `409` (`duplicate_submission`, or
    /// `lock_wait_timeout` after a wait).
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

    /// Lets at most `n` requests hold the key at once (a semaphore): the
    /// `n + 1`-th waits up to [`wait`](Self::wait), then is refused with
    /// `429 lock_permits_exhausted` and `Retry-After`. Every route that
    /// names the same key must use the same `n` (another `n`, or an exclusive
    /// lock on it, is `500 lock_misconfigured`).
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
    /// When `n` is zero: a programming error found on start-up.
    pub fn permits(self, n: u32) -> Self {
        assert!(n > 0, "LockLayer::permits: a semaphore of 0 permits would refuse every request");
        self.with(|s| s.policy.mode = LockMode::permits(n))
    }

    /// Starts a further key, the lock called `name`: the parts declared
    /// after it ([`json`](Self::json), [`query`](Self::query),
    /// [`path`](Self::path), [`header`](Self::header)) are its parts. The
    /// route then takes every key all or none, in one global order of keys
    /// (so two requests naming the same keys in opposite orders never
    /// deadlock), each in the layer's mode, within one [`wait`](Self::wait).
    /// A request refused because one of them is held gets the route's
    /// `409`; which key was busy is logged (as its log id), never answered.
    /// The [`FencingToken`](crate::FencingToken) and
    /// [`HeldLock`](crate::HeldLock) the route sees are those of the first
    /// key; [`HeldLocks`](crate::HeldLocks) gives every key's, for a route
    /// that fences the storage of each (`locks.token("account", to)`).
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

    /// How long a request waits for a held lock before it is refused with
    /// `409` (default: the engine's, `DLOCK_WAIT_MS`, 0 = try once).
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|s| s.policy.wait = Some(wait))
    }

    /// A fixed lease (default: watchdog mode, renewed while the request runs).
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|s| s.policy.lease = Some(lease))
    }

    /// In watchdog mode, stop renewing once a request has held the lock this
    /// long, so a stuck handler cannot keep it forever (the handler can see
    /// it through the [`FencingToken`](crate::FencingToken) its storage
    /// refuses afterwards).
    pub fn max_hold(self, max_hold: Duration) -> Self {
        self.with(|s| s.policy.max_hold = Some(max_hold))
    }

    /// The `message` of the `409 duplicate_submission` answer (a lock held
    /// by another request; a wait that ran out is `lock_wait_timeout`).
    pub fn message(self, message: impl Into<Cow<'static, str>>) -> Self {
        let message = message.into();
        self.with(|s| s.policy.message = Some(message))
    }

    /// The `code` of the `409 duplicate_submission` answer (default 2101).
    pub fn code(self, code: u32) -> Self {
        self.with(|s| s.policy.code = Some(code))
    }

    /// The most body bytes read to find JSON fields. A larger body is
    /// refused with `413`. Default: the installed engine's
    /// ([`Dlock::max_body_bytes`](crate::DlockRuntime::max_body_bytes), from
    /// `DLOCK_MAX_BODY_BYTES` through [`Config`](dlock_core::Config); 64 KiB).
    pub fn max_body_bytes(self, limit: usize) -> Self {
        self.with(|s| s.max_body_bytes = Some(limit))
    }

    /// At most `max` locks held at once through this layer by requests of
    /// the same [`Caller`]. A request beyond that is refused with
    /// `429 too_many_locks` before any lock is asked for, so one client
    /// cannot hold thousands of renewed locks; its holds end as they are
    /// released, or at [`max_hold`](Self::max_hold). Counted in this
    /// process, per layer (a service with N instances allows N × `max`).
    ///
    /// A request without a caller (the function says `None`, the header is
    /// missing or empty) is refused with `400 lock_caller_missing`, before
    /// any lock is asked for: it is neither let through uncounted, which
    /// would make leaving the caller out a way around the cap, nor counted
    /// with every other such request, where one client could use up the
    /// cap of all the others. Put the route behind the authentication that
    /// names its caller.
    ///
    /// **Name the caller your authentication established** (an extension
    /// its layer set, a verified token's subject) with [`Caller::from_fn`].
    /// A client chooses its own headers: [`Caller::header`] bounds nothing
    /// unless a trusted proxy or gateway sets that header from the identity
    /// it authenticated and drops any value the client sent; otherwise a
    /// client gets a fresh cap for every value it makes up.
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
    /// When `max` is zero: a programming error found on start-up.
    pub fn max_holds_per(self, max: usize, caller: Caller) -> Self {
        assert!(max > 0, "LockLayer::max_holds_per: a cap of 0 would refuse every request");
        self.with(|s| s.quota = Some(Arc::new(Quota::new(caller, max))))
    }

    /// Uses `locker` instead of the one installed in the request extensions.
    pub fn with_locker(self, locker: Locker) -> Self {
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
