//! Key mode: `Idempotency-Key` with stored, replayed responses.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{HeaderName, Method, Request};
use axum::response::{IntoResponse, Response};
use dlock_core::idempotency::{fingerprint, Claim, ClaimTerms, IdempotencyStore};
use tower::{Layer, Service};

use super::settle::{self, claimed, not_stored_record, Begun, StorePolicy};
use super::{lease, Records, KEY_HEADER, MAX_IDEMPOTENCY_KEY_LEN};
use crate::caller::Caller;
use crate::future::ResponseFuture;
use crate::pipeline::body::{discard, read_body, BodyLimits};
use crate::pipeline::detached::{self, CatchUnwind, Settled};
use crate::rejection::Rejection;

/// The methods [`IdempotencyLayer`] applies to by default (the IETF draft's).
pub const DEFAULT_METHODS: &[Method] = &[Method::POST, Method::PATCH];

/// `Idempotency-Key` handling for a route (IETF draft, Stripe): the first
/// request with a key runs the route; a retry gets its stored answer with
/// `Idempotent-Replayed: true`. In full: `docs/idempotency.md`.
///
/// * No key → `400 idempotency_key_missing`; a malformed one (empty, over
///   255 bytes, not visible ASCII) → `400 idempotency_key_invalid`.
/// * The same key with another fingerprint (method, path, body; JSON in
///   [`canonical_json`](dlock_core::idempotency::canonical_json) form) →
///   `422 idempotency_key_mismatch`; still running →
///   `409 idempotency_request_in_progress`; claimed by an instance that died
///   → `409 idempotency_outcome_unknown` (or see [`run_again_after_lease`](IdempotencyLayer::run_again_after_lease)).
/// * Only [`DEFAULT_METHODS`] (`POST`, `PATCH`); others pass through.
/// * Stored: what [`stored_by_default`](super::stored_by_default) keeps,
///   with the [`DEFAULT_STORED_HEADERS`](super::DEFAULT_STORED_HEADERS);
///   anything else frees the key. A response too large to keep answers
///   retries `409 idempotency_response_not_stored`.
/// * Once claimed, the route runs to its end even if the client hangs up; a
///   store that fails after it ran leaves the key "outcome unknown".
/// * Keys belong to a [`Caller`] (default: the `Authorization` header,
///   hashed); none → `400 idempotency_scope_missing`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::{idempotency::IdempotencyLayer, Caller, DlockExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
///
/// // Keys belong to the caller named by `x-user`; a request without it is refused.
/// let layer = IdempotencyLayer::new().caller(Caller::header("x-user"));
/// let app: Router = Router::new()
///     .route("/pay", post(|| async { (axum::http::StatusCode::CREATED, "paid") }).layer(layer))
///     .with_dlock(Locker::new(MemoryBackend::new())); // records in this process
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
    policy: StorePolicy,
    lease: Duration,
    /// Whether a claim whose lease ran out is taken afresh.
    run_again_after_lease: bool,
    /// `None`: the installed engine's (`DLOCK_MAX_BODY_BYTES`).
    max_body_bytes: Option<usize>,
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
            .field("max_response_bytes", &self.policy.max_response_bytes)
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
    /// Key mode with the defaults above, on the installed runtime's store.
    pub fn new() -> Self {
        IdempotencyLayer {
            records: Records::default(),
            caller: Caller::authorization(),
            methods: DEFAULT_METHODS.into(),
            policy: StorePolicy::default(),
            lease: Duration::from_secs(10),
            run_again_after_lease: false,
            max_body_bytes: None,
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
    /// let layer = IdempotencyLayer::new().store(Arc::new(dlock_core::idempotency::MemoryStore::new()));
    /// ```
    pub fn store(mut self, store: Arc<dyn IdempotencyStore>) -> Self {
        self.records = self.records.with_store(store);
        self
    }

    /// How long a key is kept, rather than `DLOCK_IDEMPOTENCY_TTL_SECS`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let layer = dlock_axum::idempotency::IdempotencyLayer::new().ttl(Duration::from_secs(3600));
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.records = self.records.with_ttl(ttl);
        self
    }

    /// Whom a request's key belongs to (default: the `Authorization` header,
    /// hashed); see [`Caller`].
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

    /// The methods the layer applies to (default [`DEFAULT_METHODS`]).
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

    /// Which responses are stored (default [`stored_by_default`](super::stored_by_default));
    /// the others, and every `5xx`, free the key.
    ///
    /// ```
    /// use dlock_axum::idempotency::{stored_by_default, IdempotencyLayer};
    /// // Also replay the route's own 422s (its validation runs after the work started).
    /// let layer = IdempotencyLayer::new().store_when(|res| res.status() == 422 || stored_by_default(res));
    /// ```
    pub fn store_when(mut self, f: impl Fn(&Response) -> bool + Send + Sync + 'static) -> Self {
        self.policy.store_when = Arc::new(f);
        self
    }

    /// The lease of a claim (default 10 s), renewed while the route runs: how
    /// long a dead instance's key stays "in progress" before "outcome unknown".
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// A dead instance's claim, once run out, runs the route again instead of
    /// `409 idempotency_outcome_unknown`: only for work keyed on the key itself.
    ///
    /// ```
    /// use dlock_axum::idempotency::IdempotencyLayer;
    /// let layer = IdempotencyLayer::new().run_again_after_lease();
    /// ```
    pub fn run_again_after_lease(mut self) -> Self {
        self.run_again_after_lease = true;
        self
    }

    /// Most request body bytes read for the fingerprint (default
    /// [`DlockRuntime::max_body_bytes`](dlock_core::DlockRuntime::max_body_bytes)).
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = Some(n);
        self
    }

    /// Largest response body stored (default 1 MiB); retries of a larger one
    /// get `409 idempotency_response_not_stored`.
    pub fn max_response_bytes(mut self, n: usize) -> Self {
        self.policy.max_response_bytes = n;
        self
    }

    /// Runs the route inside a transaction of `store`'s PostgreSQL (the app's
    /// own: [`PostgresStore::with_pool`](dlock_core::idempotency::PostgresStore::with_pool))
    /// that also claims the key and stores the answer; the handler joins it
    /// with a [`Tx`](super::Tx). A result commits with its answer (a failed
    /// commit: `503 idempotency_not_committed`); anything else rolls back; a
    /// duplicate meanwhile is `409 idempotency_request_in_progress`. A lock
    /// inside this layer is released after the commit. In full, with `/ready`
    /// and the order of a lock and this layer: `docs/idempotency.md`.
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
        self.policy.stored_headers = names.into_iter().collect();
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent { inner, layer: self.clone() }
    }
}

/// The service of [`IdempotencyLayer`]; the inner service's error passes
/// through (and frees the key).
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
    if bytes.is_empty() || bytes.len() > MAX_IDEMPOTENCY_KEY_LEN || !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(Rejection::idempotency_key_invalid());
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
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
            let future = inner.call(req);
            return ResponseFuture::new(async move { future.await.map(IntoResponse::into_response) });
        }
        let layer = self.layer.clone();
        ResponseFuture::observed(crate::observe::Face::Key, "idempotency_key".into(), handle(layer, inner, req))
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
            // Drained first, so a client still sending it reads this answer.
            discard(&parts.headers, body, false).await;
            return Ok(r.into_response());
        }
    };
    // In a transaction the layer's own store keeps the records.
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
        return super::transaction::run(layer.policy, pg, inner, parts, body, claimed).await;
    }
    let Some(store) = store else {
        return Ok(crate::install::no_engine().into_response());
    };
    // From the claim on, the request runs on its own task: a hang-up cancels
    // neither the route nor the storing of its answer.
    detached::run_detached(move |client| async move {
        let claim = match claimed(store.begin(&scope, &key, &fp, terms).await) {
            Begun::Run(claim) => claim,
            Begun::Answer(answer) => return Settled::Answer(answer),
        };
        if client.is_gone() {
            // Nobody waits for the answer: the key is freed unrun for its retry.
            abandon(&*store, &claim).await;
            return Settled::Answer(Rejection::idempotency_request_in_progress().into_response());
        }
        let route = inner.call(Request::from_parts(parts, Body::from(body)));
        let answered = lease::renewing(&*store, &claim, layer.lease, CatchUnwind(Box::pin(route))).await;
        settle::settle(KeyClaim { store, claim, policy: layer.policy }, answered).await
    })
    .await
}

/// A key claimed in a store: its answer stored, or the key freed.
struct KeyClaim {
    store: Arc<dyn IdempotencyStore>,
    claim: Claim,
    policy: StorePolicy,
}

impl settle::Claimed for KeyClaim {
    fn keeps(&self, response: &Response) -> bool {
        self.policy.stores(response)
    }

    async fn abandon(self) {
        abandon(&*self.store, &self.claim).await;
    }

    /// Stores the answer; one over the byte budget completes the key as "not stored".
    async fn keep(self, response: Response) -> Response {
        let (record, answer) = self.policy.record(response, self.claim.key()).await;
        let mut stored = self.store.complete(&self.claim, &record).await;
        if settle::over_budget(&stored, &self.claim) {
            stored = self.store.complete(&self.claim, &not_stored_record()).await;
        }
        match stored {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                key = crate::headers::log_id(self.claim.key()),
                "dlock: the idempotency claim was taken over before the route answered; response not stored"
            ),
            Err(e) => {
                tracing::warn!(error = %e, key = crate::headers::log_id(self.claim.key()), "dlock: storing the idempotent response failed")
            }
        }
        answer
    }
}

async fn abandon(store: &dyn IdempotencyStore, claim: &Claim) {
    if let Err(e) = store.abandon(claim).await {
        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: freeing an idempotency key failed; retries are told the outcome is unknown once its lease ends");
    }
}
