//! Key mode: `Idempotency-Key` with stored, replayed responses.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{header, HeaderName, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dlock_core::idempotency::{fingerprint, Begin, Claim, ClaimTerms, IdempotencyStore, StoredResponse};
use futures_util::StreamExt;
use tower::{Layer, Service};

use super::lease;
use super::{Records, KEY_HEADER, MAX_KEY_LEN, REPLAYED_HEADER};
use crate::caller::Caller;
use crate::future::ResponseFuture;
use crate::pipeline::body::{discard, read_body, BodyLimits};
use crate::pipeline::detached::{self, CatchUnwind, Settled};
use crate::pipeline::outage::STORE;
use crate::rejection::Rejection;

/// Response headers stored and replayed unless [`IdempotencyLayer::store_headers`]
/// says otherwise. `set-cookie` is deliberately absent: a session cookie must
/// not be handed out again.
pub const DEFAULT_STORED_HEADERS: &[&str] =
    &["content-type", "content-language", "content-encoding", "location", "etag", "cache-control"];

/// Decides from the route's response (before its body is read) whether it
/// is stored for replay; see [`IdempotencyLayer::store_when`].
type StoreWhen = Arc<dyn Fn(&Response) -> bool + Send + Sync>;

/// The methods [`IdempotencyLayer`] applies to unless
/// [`IdempotencyLayer::methods`] says otherwise: the unsafe, non-idempotent
/// ones of the IETF draft. `GET`, `HEAD`, `OPTIONS` (CORS preflights),
/// `PUT` and `DELETE` pass through untouched.
pub const DEFAULT_METHODS: &[Method] = &[Method::POST, Method::PATCH];

/// Statuses [`stored_by_default`] never stores: the request was refused
/// before the work (an extractor's rejection, a missing route or method, a
/// timeout, a limit), so a corrected retry must run. As `axum-idempotent`'s
/// defaults, plus `404`.
const NOT_STORED: &[u16] = &[400, 401, 403, 404, 405, 408, 411, 413, 414, 415, 422, 429];

/// The default of [`IdempotencyLayer::store_when`]: store a response only
/// when the route ran to a result.
///
/// * `2xx`, `3xx` and the `4xx` that are results (`409` of the app, `410`,
///   `402`, …) are stored and replayed.
/// * Never stored: `5xx` (the key is freed, a retry runs again); refusals
///   before the work — axum's extractor rejections and what a route answers
///   the same way (`400`, `401`, `403`, `404`, `405`, `408`, `411`, `413`,
///   `414`, `415`, `422`, `429`); and every refusal dlock made (a lock held,
///   a lock wait that ran out, a spent token, …: a response that carries a
///   [`Rejection`] with [`Rejection::is_dlock`]). The key is freed, so the
///   retry the refusal invites runs.
///
/// This is Stripe's rule ("results are only saved if an API endpoint
/// started executing; if incoming parameters failed validation, or the
/// request conflicted with another that was executing concurrently, no
/// idempotent result is saved"), told by status because an axum route's
/// validation and its extractors answer alike.
///
/// ```
/// use axum::{http::StatusCode, response::IntoResponse};
/// use dlock_axum::{idempotency::stored_by_default, Rejection};
/// assert!(stored_by_default(&(StatusCode::CREATED, "made").into_response()));
/// assert!(stored_by_default(&Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "none left").into_response()));
/// assert!(!stored_by_default(&StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response()));
/// assert!(!stored_by_default(&Rejection::duplicate_submission().into_response()));
/// ```
pub fn stored_by_default(response: &Response) -> bool {
    let status = response.status();
    !(status.is_server_error()
        || NOT_STORED.contains(&status.as_u16())
        || Rejection::of(response).is_some_and(Rejection::is_dlock))
}

/// `Idempotency-Key` handling for a route, per the IETF draft and Stripe.
///
/// * No `Idempotency-Key` → `400 idempotency_key_missing`. The key may come
///   bare (`k1`) or quoted as the draft's structured-field string (`"k1"`);
///   both are the same key. A key (inside the quotes) that is empty, longer
///   than 255 bytes or has characters outside visible ASCII (`!`..`~`) →
///   `400 idempotency_key_invalid`.
/// * The request is fingerprinted (method, path with query, body; the body
///   is read up to `max_body_bytes`, `413 payload_too_large` beyond, by the
///   same reader and with the same answer as [`LockLayer`](crate::LockLayer)'s).
///   A body whose `Content-Type` is JSON (`application/json`,
///   `application/*+json`) is fingerprinted in its canonical form
///   ([`canonical_json`](dlock_core::idempotency::canonical_json)): keys
///   sorted, no whitespace, strings by their characters, numbers as
///   written. So a client that re-serialises its object for the retry is
///   the same request; `1` and `1.0` are not. Any other body, or one that
///   is not valid JSON or has a key twice, is compared byte for byte.
/// * The first request claims `(caller, key)` atomically with an in-progress
///   record, runs the route and stores status, the [`DEFAULT_STORED_HEADERS`]
///   and the body for the TTL. The claim's lease (default 10 s,
///   [`IdempotencyLayer::lease`]) is renewed while the route runs, so it
///   bounds how long a dead instance's claim blocks the key, not how long a
///   route may take.
/// * Same key, same fingerprint, finished → the stored response byte for
///   byte, plus `Idempotent-Replayed: true`.
/// * Same key still running → `409 idempotency_request_in_progress`
///   (`Retry-After: 1`).
/// * Same key, different fingerprint → `422 idempotency_key_mismatch`.
/// * Same key, claimed by a request that neither answered nor gave it back
///   before its lease ran out (its instance died) →
///   `409 idempotency_outcome_unknown`, final (no `Retry-After`: check what
///   happened, then use a new key); or the route runs again, for a route
///   that chose [`IdempotencyLayer::run_again_after_lease`].
///
/// **Methods.** Only `POST` and `PATCH` ([`DEFAULT_METHODS`],
/// [`IdempotencyLayer::methods`]); every other request passes through
/// untouched, so the layer may sit on a whole router (`GET /health`, CORS
/// preflights and 404s are not asked for a key).
///
/// **What is stored.** Only a response of a route that ran to a result:
/// [`stored_by_default`], which refuses `5xx`, the statuses of refusals
/// before the work (axum's extractor rejections: `400`, `415`, `422`, …;
/// `408`, `413`, `429`) and every refusal dlock made (a lock held inside this
/// layer, a spent token). A response not stored frees the key, so the
/// corrected retry runs. Set another rule with [`IdempotencyLayer::store_when`].
///
/// **Failure policy.** Once claimed, the route runs on a task of its own:
/// a client that hangs up (hyper then drops the request) cancels neither the
/// route nor the storing of its answer, so its retry gets `409` in progress,
/// then the stored answer; the route runs once. A `5xx` answer, the inner
/// service's error or a panic of the route frees the key, so a retry runs
/// again (the panic is then resumed, for an outer `CatchPanicLayer` to
/// answer). The one-time tokens of [`TokenLayer`](super::TokenLayer) follow
/// the same rule. A response body above `max_response_bytes` (default 1 MiB),
/// or one that fails while it is read, is not stored: the key stays
/// completed, and a retry gets `409 idempotency_response_not_stored` (the
/// work was done; its answer was not kept) instead of running the route
/// again. If storing fails (store down after the route ran) the route's
/// response is still returned and the key answers
/// `409 idempotency_outcome_unknown` once its lease ends. So does a key
/// whose instance died while its route ran. For at-most-once across
/// crashes *and* a known outcome, key the side effect itself on the
/// `Idempotency-Key` (the `orders` example records its payment with
/// `SET NX` on caller + key) and choose [`IdempotencyLayer::run_again_after_lease`].
///
/// **Caller.** Keys belong to a caller ([`Caller`]). The default is
/// [`Caller::header`]`("authorization")`, hashed: callers with different
/// credentials never see each other's responses, and a request without
/// `Authorization` is refused with `400 idempotency_scope_missing`. Services
/// that authenticate otherwise say how with [`IdempotencyLayer::caller`] (a
/// header, a cookie, or a function over the request such as the user id an
/// auth layer set).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::{idempotency::IdempotencyLayer, Caller, LockerExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
///
/// // Keys belong to the caller named by `x-user`; a request without it is refused.
/// let layer = IdempotencyLayer::new().caller(Caller::header("x-user"));
/// let app: Router = Router::new()
///     .route("/pay", post(|| async { (axum::http::StatusCode::CREATED, "paid") }).layer(layer))
///     .with_locker(Locker::new(MemoryBackend::new())); // records in this process
/// let pay = || Request::post("/pay").header("idempotency-key", "k1").header("x-user", "u1").body(Body::from("{}")).unwrap();
/// assert_eq!(app.clone().oneshot(pay()).await.unwrap().status(), 201);
/// let again = app.oneshot(pay()).await.unwrap();
/// assert_eq!(again.status(), 201);
/// assert_eq!(again.headers()["idempotent-replayed"], "true");
/// # }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    records: Records,
    caller: Caller,
    methods: Arc<[Method]>,
    store_when: StoreWhen,
    lease: Duration,
    /// Whether a claim whose lease ran out is taken afresh.
    run_again_after_lease: bool,
    /// `None`: the installed engine's (`DLOCK_MAX_BODY_BYTES`).
    max_body_bytes: Option<usize>,
    max_response_bytes: usize,
    stored_headers: Arc<[HeaderName]>,
    /// Runs the route inside a transaction of this store's database.
    #[cfg(feature = "postgres")]
    transaction: Option<dlock_core::idempotency::PostgresStore>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("records", &self.records)
            .field("caller", &self.caller)
            .field("methods", &self.methods)
            .field("lease", &self.lease)
            .field("run_again_after_lease", &self.run_again_after_lease)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("in_transaction", &self.runs_in_transaction())
            .finish_non_exhaustive()
    }
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        IdempotencyLayer::new()
    }
}

impl IdempotencyLayer {
    /// Key mode, with the defaults documented above, on the idempotency
    /// store of the installed [`DlockRuntime`](dlock_core::DlockRuntime)
    /// (see [`with_store`](Self::with_store) for one of its own).
    pub fn new() -> Self {
        IdempotencyLayer {
            records: Records::default(),
            caller: Caller::authorization(),
            methods: DEFAULT_METHODS.into(),
            store_when: Arc::new(stored_by_default),
            lease: Duration::from_secs(10),
            run_again_after_lease: false,
            max_body_bytes: None,
            max_response_bytes: 1024 * 1024,
            stored_headers: DEFAULT_STORED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect(),
            #[cfg(feature = "postgres")]
            transaction: None,
        }
    }

    /// Whether the route runs inside a transaction ([`in_transaction`](Self::in_transaction)).
    fn runs_in_transaction(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.transaction.is_some();
        #[cfg(not(feature = "postgres"))]
        false
    }

    /// Records in `store` rather than the installed runtime's.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use dlock_axum::idempotency::IdempotencyLayer;
    /// let layer = IdempotencyLayer::new().with_store(Arc::new(dlock_core::idempotency::MemoryStore::new()));
    /// ```
    pub fn with_store(mut self, store: Arc<dyn IdempotencyStore>) -> Self {
        self.records = self.records.with_store(store);
        self
    }

    /// How long a completed key is replayed (and a claim kept), rather
    /// than the installed runtime's `DLOCK_IDEMPOTENCY_TTL_SECS`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let layer = dlock_axum::idempotency::IdempotencyLayer::new().ttl(Duration::from_secs(3600));
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.records = self.records.with_ttl(ttl);
        self
    }

    /// Whom a request's key belongs to (default: the `Authorization`
    /// header, hashed). Keys of different callers never meet; a request
    /// without a caller is refused with `400 idempotency_scope_missing`.
    ///
    /// ```
    /// use dlock_axum::{idempotency::IdempotencyLayer, Caller};
    ///
    /// #[derive(Clone)]
    /// struct UserId(u64); // put in the extensions by the app's auth layer
    ///
    /// let by_session = IdempotencyLayer::new().caller(Caller::cookie("session"));
    /// let by_user = IdempotencyLayer::new()
    ///     .caller(Caller::from_fn(|parts| parts.extensions.get::<UserId>().map(|u| u.0.to_string())));
    /// ```
    pub fn caller(mut self, caller: Caller) -> Self {
        self.caller = caller;
        self
    }

    /// The methods the layer applies to (default [`DEFAULT_METHODS`]: `POST`,
    /// `PATCH`); requests of other methods pass through untouched.
    ///
    /// ```
    /// use axum::http::Method;
    /// use dlock_axum::idempotency::IdempotencyLayer;
    /// let layer = IdempotencyLayer::new().methods([Method::POST, Method::PATCH, Method::DELETE]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Which responses are stored and replayed (default
    /// [`stored_by_default`]). A `5xx` is never stored, whatever this says:
    /// it frees the key. A response not stored frees the key too.
    ///
    /// ```
    /// use dlock_axum::idempotency::{stored_by_default, IdempotencyLayer};
    /// // Also replay the route's own 422s (its validation runs after the work started).
    /// let layer = IdempotencyLayer::new().store_when(|res| res.status() == 422 || stored_by_default(res));
    /// ```
    pub fn store_when(mut self, f: impl Fn(&Response) -> bool + Send + Sync + 'static) -> Self {
        self.store_when = Arc::new(f);
        self
    }

    /// The lease of a claim (default 10 s): renewed every third of it while
    /// the route runs, so a route may take longer; it is how long a key
    /// whose instance died answers `409 idempotency_request_in_progress`
    /// before it answers `409 idempotency_outcome_unknown`.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Once the lease of a claim whose instance died has run out, the next
    /// request with the key runs the route again, instead of being told
    /// `409 idempotency_outcome_unknown`. Only for a route whose work is
    /// idempotent by itself (it is keyed on the `Idempotency-Key` in the
    /// database, say): the dead instance may have done it.
    ///
    /// ```
    /// use dlock_axum::idempotency::IdempotencyLayer;
    /// let layer = IdempotencyLayer::new().run_again_after_lease();
    /// ```
    pub fn run_again_after_lease(mut self) -> Self {
        self.run_again_after_lease = true;
        self
    }

    /// Most request body bytes read for the fingerprint. Default: the
    /// installed runtime's ([`DlockRuntime::max_body_bytes`](dlock_core::DlockRuntime::max_body_bytes), from
    /// `DLOCK_MAX_BODY_BYTES` through [`Config`](dlock_core::Config); 64 KiB).
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = Some(n);
        self
    }

    /// Largest response body stored (default 1 MiB). A larger one is sent
    /// to the client but not kept: retries get
    /// `409 idempotency_response_not_stored`.
    pub fn max_response_bytes(mut self, n: usize) -> Self {
        self.max_response_bytes = n;
        self
    }

    /// Runs the route inside a PostgreSQL transaction that also claims the
    /// key and, before it commits, stores the answer, in `store`'s tables
    /// (the application's own database: [`PostgresStore::with_pool`](dlock_core::idempotency::PostgresStore::with_pool)).
    /// The handler joins that transaction with a [`Tx`](super::Tx)
    /// argument. Its writes and the stored answer commit together or not
    /// at all:
    ///
    /// * the route answered a result ([`store_when`](Self::store_when)):
    ///   the answer is stored and the transaction committed; a commit that
    ///   fails answers `503 idempotency_not_committed`, and nothing was
    ///   kept: the retry runs the route again, once;
    /// * a `5xx`, a refusal before the work, an error or a panic: rolled
    ///   back, writes and claim alike; the retry runs;
    /// * the instance dies (`kill -9`) or its connection breaks: the server
    ///   rolls back; the instance stops (a pause) with the transaction
    ///   open: the server ends it once it stays idle for the
    ///   [`lease`](Self::lease) (`idle_in_transaction_session_timeout`), so
    ///   a route must not keep it idle longer (a slow call to another
    ///   service in between: a longer lease);
    /// * a duplicate while it runs: `409 idempotency_request_in_progress`
    ///   at once, never a wait; after it: the stored answer.
    ///
    /// The hang-up rule holds: a client that hangs up cancels neither the
    /// route nor its commit, nor the `BEGIN` of its transaction (begun on
    /// the route's own task, never cut half-way: sqlx 0.8's `Pool::begin`
    /// is not cancel-safe and would hand the application's pool a
    /// connection inside a transaction). What the handler does outside the
    /// database (a call to a payment provider) is not rolled back: key that
    /// call on the `Idempotency-Key` as well, as the layer's docs say.
    ///
    /// With a lock on the same route, either order holds: a
    /// [`LockLayer`](crate::LockLayer) outside this layer releases its lock
    /// after the commit (the route runs to its end under it, hang-up or
    /// not); one inside it (or a `#[lockable]` handler) hands its release
    /// to this layer, which runs it once the transaction has committed or
    /// rolled back, so the next holder reads what it committed. A lock taken
    /// in the handler itself (`Policy::run_locked`) ends with the handler,
    /// before the commit: take route locks with a layer or `#[lockable]`.
    /// The README's "A lock and idempotency on one route" compares the two
    /// orders.
    ///
    /// `/ready` ([`ready`](crate::ready)) asks the runtime's stores, not this
    /// layer's: hand this store to the runtime with
    /// `DlockRuntime::with_idempotency_store(Arc::new(store.clone()))`, so
    /// that it checks the database the routes use (and the layers without a
    /// transaction keep their records there too), or add it with
    /// `DlockRuntime::also_check("records", Arc::new(store.clone()))` when the
    /// runtime's own store is used as well.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> dlock_core::Result<()> {
    /// use axum::{routing::post, Router};
    /// use dlock_axum::idempotency::{IdempotencyLayer, Tx};
    /// use dlock_core::idempotency::PostgresStore;
    ///
    /// async fn pay(mut tx: Tx) -> &'static str {
    ///     // Joins the transaction that claimed the key.
    ///     sqlx::query("INSERT INTO payments (amount) VALUES (42)").execute(&mut *tx).await.ok();
    ///     "paid"
    /// }
    ///
    /// let store = PostgresStore::with_pool(pool, "dlock").await?;
    /// let app: Router = Router::new().route("/pay", post(pay).layer(IdempotencyLayer::new().in_transaction(store)));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn in_transaction(mut self, store: dlock_core::idempotency::PostgresStore) -> Self {
        self.transaction = Some(store);
        self
    }

    /// The response headers stored and replayed (replaces the defaults).
    pub fn store_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.stored_headers = names.into_iter().collect();
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent { inner, layer: self.clone() }
    }
}

/// The service of [`IdempotencyLayer`]: answers a repeated `Idempotency-Key`
/// from the store, runs the inner service for a new one. The inner service's
/// error passes through unchanged (and frees the key, like a `5xx`).
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_axum::idempotency::Idempotent;
///
/// let app: Router = Router::new().route("/pay", post(|| async { "paid" }).layer(Idempotent::layer()));
/// ```
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    layer: IdempotencyLayer,
}

impl Idempotent<()> {
    /// The layer of this service: [`IdempotencyLayer::new`]`()`.
    pub fn layer() -> IdempotencyLayer {
        IdempotencyLayer::new()
    }
}

impl<S> Idempotent<S> {
    inner_service_accessors!();
}

/// A syntactically acceptable `Idempotency-Key`, or the rejection.
fn idempotency_key(parts: &Parts) -> Result<String, Rejection> {
    let value = crate::headers::sole_idempotency_key(&parts.headers, KEY_HEADER)?
        .ok_or_else(Rejection::idempotency_key_missing)?;
    let bytes = value.as_bytes();
    // The draft sends the key as a structured-field string: accept the
    // quoted form too, and compare keys by their content.
    let bytes = match bytes {
        [b'"', inner @ .., b'"'] => inner,
        other => other,
    };
    if bytes.is_empty() || bytes.len() > MAX_KEY_LEN || !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(Rejection::idempotency_key_invalid());
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

pub(super) fn store_error(e: &dlock_core::Error) -> Response {
    if matches!(e, dlock_core::Error::IdempotencyFull { .. }) {
        // A refusal the caps are there to make, once per request of a flood:
        // not worth a warning each.
        tracing::debug!(error = %e, "dlock: idempotency store full");
    } else if e.is_unavailable() {
        // Told once per outage, with a count, by the outage log.
        tracing::debug!(error = %e, "dlock: idempotency store failed");
        STORE.refused(&e.to_string());
    } else {
        tracing::warn!(error = %e, "dlock: idempotency store failed");
    }
    // `Retry-After` on a 503 comes with the rejection's response.
    Rejection::from_lock_error(e).into_response()
}

fn replay(stored: StoredResponse) -> Response {
    let mut res = Response::new(Body::from(stored.body));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in stored.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
            res.headers_mut().append(n, v);
        }
    }
    res.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    res
}

impl<S> Service<Request<Body>> for Idempotent<S>
where
    S: Service<Request<Body>> + Clone + Send + 'static,
    S::Response: IntoResponse + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        if !self.layer.methods.contains(req.method()) {
            // Not a method this layer guards: untouched, no key asked for.
            let future = inner.call(req);
            return ResponseFuture::new(async move { future.await.map(IntoResponse::into_response) });
        }
        let layer = self.layer.clone();
        ResponseFuture::new(handle(layer, inner, req))
    }
}

async fn handle<S>(layer: IdempotencyLayer, mut inner: S, req: Request<Body>) -> Result<Response, S::Error>
where
    S: Service<Request<Body>> + Send + 'static,
    S::Response: IntoResponse + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let (parts, body) = req.into_parts();
    let key = match idempotency_key(&parts) {
        Ok(k) => k,
        Err(r) => {
            // Refused before the body was read: drain it first, or a client
            // still sending it gets a broken pipe instead of this answer.
            discard(&parts.headers, body, false).await;
            return Ok(r.into_response());
        }
    };
    // In a transaction the layer's own store keeps the records; else the
    // installed runtime's, or the layer's.
    let records = match layer.runs_in_transaction() {
        true => Ok(None),
        false => layer.records.in_request(&parts.extensions).map(Some),
    };
    let (store, ttl) = match records {
        Ok(Some((store, ttl))) => (Some(store), ttl),
        Ok(None) => (None, layer.records.ttl_in_request(&parts.extensions)),
        Err(refused) => {
            discard(&parts.headers, body, false).await;
            return Ok(refused.into_response());
        }
    };
    // The installed runtime's bounds: its body limit unless the layer has
    // its own, and its body-read timeout.
    let limits = BodyLimits::of(crate::install::installed(&parts.extensions), layer.max_body_bytes);
    let body = match read_body(&parts.headers, body, limits).await {
        Ok(body) => body,
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let fp = fingerprint(&[
        parts.method.as_str().as_bytes(),
        path.as_bytes(),
        &dlock_core::idempotency::canonical_body(
            &body,
            crate::pipeline::body::require_json_content_type(&parts.headers).is_ok(),
        ),
    ]);
    let Some(scope) = layer.caller.of(&parts) else {
        return Ok(Rejection::idempotency_scope_missing().into_response());
    };
    let mut terms = ClaimTerms::new(layer.lease).with_ttl(ttl);
    if layer.run_again_after_lease {
        terms = terms.run_again_after_lease();
    }
    #[cfg(feature = "postgres")]
    if let Some(pg) = &layer.transaction {
        let pg = pg.clone();
        let claimed = super::transaction::Claimed { scope, key, fingerprint: fp, terms };
        return super::transaction::run(layer, pg, inner, parts, body, claimed).await;
    }
    let Some(store) = store else {
        return Ok(crate::install::no_engine().into_response());
    };
    // From the claim on, the request runs on its own task: a client that
    // hangs up while the claim is on its way, or while the route runs,
    // cancels neither the route nor the storing of its answer.
    detached::run_detached(move |client| async move {
        let claim = match claimed(store.begin(&scope, &key, &fp, terms).await) {
            Begun::Run(claim) => claim,
            Begun::Answer(answer) => return Settled::Answer(answer),
        };
        if client.is_gone() {
            // Nobody waits for the route's answer: the key is freed
            // unrun, and its retry runs.
            abandon(&*store, &claim).await;
            return Settled::Answer(Rejection::idempotency_request_in_progress().into_response());
        }
        let route = inner.call(Request::from_parts(parts, Body::from(body)));
        settle(layer, store, claim, route).await
    })
    .await
}

/// What a claim's answer leads to: run the route, or answer at once.
pub(super) enum Begun {
    /// [`Begin::New`]: the key is the request's.
    Run(Claim),
    /// Anything else: a replay, a refusal, or the store's error.
    Answer(Response),
}

/// What `begun` leads to.
pub(super) fn claimed(begun: dlock_core::Result<Begin>) -> Begun {
    match &begun {
        Err(e) if e.is_unavailable() => {}
        _ => STORE.answered(),
    }
    Begun::Answer(match begun {
        Ok(Begin::New(claim)) => return Begun::Run(claim),
        Ok(Begin::InProgress) => Rejection::idempotency_request_in_progress().into_response(),
        Ok(Begin::Mismatch) => Rejection::idempotency_key_mismatch().into_response(),
        Ok(Begin::Completed(stored)) => replay(stored),
        Ok(Begin::OutcomeUnknown) => Rejection::idempotency_outcome_unknown().into_response(),
        // A store newer than this layer: running the route could run the
        // work twice, so refuse as for a store that cannot answer.
        Ok(other) => store_error(&dlock_core::Error::Internal(format!(
            "the idempotency store answered {other:?}, which this layer does not know"
        ))),
        Err(e) => store_error(&e),
    })
}

/// Runs the claimed route (renewing the claim meanwhile) and settles the
/// claim by its answer: stores it, or frees the key when the route did not
/// run to a result.
async fn settle<R, E>(
    layer: IdempotencyLayer,
    store: Arc<dyn IdempotencyStore>,
    claim: Claim,
    route: impl Future<Output = Result<R, E>> + Send,
) -> Settled<E>
where
    R: IntoResponse,
{
    let answered = lease::renewing(&*store, &claim, layer.lease, CatchUnwind(Box::pin(route))).await;
    let response = match answered {
        Ok(Ok(res)) => res.into_response(),
        Ok(Err(e)) => {
            abandon(&*store, &claim).await; // the route failed: free the key, as for a 5xx
            return Settled::Failed(e);
        }
        Err(panic) => {
            abandon(&*store, &claim).await;
            return Settled::Panicked(panic);
        }
    };
    if !is_stored(&layer, &response) {
        // Not a result of the route (a 5xx, a refusal before the work): free
        // the key so that the retry runs, and answer untouched.
        abandon(&*store, &claim).await;
        return Settled::Answer(response);
    }
    let (record, answer) = to_record(&layer, response, claim.key()).await;
    complete(&*store, &claim, &record).await;
    Settled::Answer(answer)
}

/// The record a route's response is kept as, and the answer its client
/// gets: the status, the stored headers and the body; or, for a body too
/// large to keep or that failed while read, the refusal a retry gets
/// instead (`409 idempotency_response_not_stored`: the work was done).
pub(super) async fn to_record(layer: &IdempotencyLayer, response: Response, key: &str) -> (StoredResponse, Response) {
    let (mut res_parts, res_body) = response.into_parts();
    let headers: Vec<(String, Vec<u8>)> = layer
        .stored_headers
        .iter()
        .flat_map(|name| {
            res_parts.headers.get_all(name).iter().map(move |v| (name.as_str().to_owned(), v.as_bytes().to_vec()))
        })
        .collect();
    let bytes = match read_response(res_body, layer.max_response_bytes).await {
        ResponseBody::Whole(bytes) => bytes,
        ResponseBody::TooLarge(body) => {
            // The work is done and the client gets its answer; what a retry
            // gets instead of running the work again is a clear refusal.
            tracing::warn!(
                key = crate::headers::log_id(key),
                limit = layer.max_response_bytes,
                "dlock: response too large to store for replay; retries get idempotency_response_not_stored"
            );
            res_parts.headers.remove(header::CONTENT_LENGTH);
            return (not_stored_record(), Response::from_parts(res_parts, body));
        }
        ResponseBody::Failed(e) => {
            // The route ran to a result (its status said so) and its body
            // then failed: the work is done, so the key stays completed,
            // with the refusal a retry gets instead of running it again.
            tracing::warn!(error = %e, key = crate::headers::log_id(key), "dlock: reading the route's response failed; retries get idempotency_response_not_stored");
            return (not_stored_record(), Rejection::body_unreadable().into_response());
        }
    };
    let stored = StoredResponse::new(res_parts.status.as_u16(), headers, bytes.to_vec());
    res_parts.headers.remove(header::CONTENT_LENGTH);
    (stored, Response::from_parts(res_parts, Body::from(bytes)))
}

/// Whether `response` is kept for replay: never a `5xx`, else as the
/// layer's rule says.
pub(super) fn is_stored(layer: &IdempotencyLayer, response: &Response) -> bool {
    !response.status().is_server_error() && (layer.store_when)(response)
}

/// What a retry of a key whose response was too large to keep is answered:
/// `409 idempotency_response_not_stored`, as its JSON body.
pub(super) fn not_stored_record() -> StoredResponse {
    let rejection = Rejection::idempotency_response_not_stored();
    StoredResponse::new(
        rejection.status().as_u16(),
        vec![("content-type".to_owned(), b"application/json".to_vec())],
        rejection.body_json().into_bytes(),
    )
}

/// Stores `stored` as the answer of `claim`. An answer over the store's
/// byte budget is not kept: the key is completed with the refusal a retry
/// gets instead (`409 idempotency_response_not_stored`), never freed.
async fn complete(store: &dyn IdempotencyStore, claim: &Claim, stored: &StoredResponse) {
    let mut result = store.complete(claim, stored).await;
    if let Err(e @ dlock_core::Error::IdempotencyFull { .. }) = &result {
        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: the answer is over the idempotency store's byte budget; retries get idempotency_response_not_stored");
        result = store.complete(claim, &not_stored_record()).await;
    }
    match result {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            key = crate::headers::log_id(claim.key()),
            "dlock: the idempotency claim was taken over before the route answered; response not stored"
        ),
        Err(e) => {
            tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: storing the idempotent response failed")
        }
    }
}

/// A route's response body, read for storing.
enum ResponseBody {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Over the limit: the bytes read so far followed by the rest, for the
    /// client (never buffered whole).
    TooLarge(Body),
    /// The body failed while being read.
    Failed(axum::Error),
}

async fn read_response(body: Body, limit: usize) -> ResponseBody {
    let mut stream = body.into_data_stream();
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                len += chunk.len();
                read.push(chunk);
                if len > limit {
                    let head = futures_util::stream::iter(read.into_iter().map(Ok::<Bytes, axum::Error>));
                    return ResponseBody::TooLarge(Body::from_stream(head.chain(stream)));
                }
            }
            Err(e) => return ResponseBody::Failed(e),
        }
    }
    ResponseBody::Whole(match read.len() {
        0 => Bytes::new(),
        1 => read.swap_remove(0),
        _ => read.concat().into(),
    })
}

async fn abandon(store: &dyn IdempotencyStore, claim: &Claim) {
    if let Err(e) = store.abandon(claim).await {
        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: freeing an idempotency key failed; retries are told the outcome is unknown once its lease ends");
    }
}
