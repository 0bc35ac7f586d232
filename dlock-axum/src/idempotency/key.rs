//! Key mode: `Idempotency-Key` with stored, replayed responses.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{header, HeaderName, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dlock_core::idempotency::{fingerprint, Begin, Claim, IdempotencyStore, StoredResponse};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::{Layer, Service};

use super::{Idempotency, ResponseFuture, KEY_HEADER, MAX_KEY_LEN, REPLAYED_HEADER};
use crate::install::Dlock;
use crate::lock::body::read_body;
use crate::Rejection;

/// Response headers stored and replayed unless [`IdempotencyLayer::store_headers`]
/// says otherwise. `set-cookie` is deliberately absent: a session cookie must
/// not be handed out again.
pub const DEFAULT_STORED_HEADERS: &[&str] =
    &["content-type", "content-language", "content-encoding", "location", "etag", "cache-control"];

/// Names the caller a request belongs to; see [`IdempotencyLayer::scope`].
type ScopeFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;

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
/// * The first request claims `(scope, key)` atomically with an in-progress
///   record whose lease (default 60 s, [`IdempotencyLayer::lease`]) bounds
///   how long a crashed instance can block the key; it runs the route and
///   stores status, the [`DEFAULT_STORED_HEADERS`] and the body for the TTL.
/// * Same key, same fingerprint, finished → the stored response byte for
///   byte, plus `Idempotent-Replayed: true`.
/// * Same key still running → `409 idempotency_request_in_progress`.
/// * Same key, different fingerprint → `422 idempotency_key_mismatch`.
///
/// **Failure policy.** A `5xx` answer or a panic of the route frees the key,
/// so a retry runs again (the panic is then resumed, for an outer
/// `CatchPanicLayer` to answer). So does a request dropped before the route
/// answered (client gone). `2xx`, `3xx` and `4xx` answers are stored and
/// replayed: a `4xx` is the answer to that request, and re-running it would
/// give the same. A response body above `max_response_bytes` (default 1 MiB)
/// is not stored: the key is freed and the client gets
/// `500 idempotency_response_too_large`, never a silently unstored success.
/// If storing fails (store down after the route ran) the route's response is
/// still returned and the key stays in progress until its lease ends. An
/// instance that dies after the route's side effect and before its response
/// is stored leaves the key in progress until the lease ends; then a retry
/// runs the route again. For at-most-once across crashes, key the side
/// effect itself on the `Idempotency-Key` (the `orders` example records its
/// payment with `SET NX` on caller + key).
///
/// **Scope.** By default the scope is a SHA-1 of the `Authorization` header,
/// so callers with different credentials never see each other's responses;
/// requests without `Authorization` share one anonymous scope. Services that
/// authenticate otherwise set [`IdempotencyLayer::scope`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::idempotency::{Idempotency, IdempotencyLayer};
/// use dlock_core::idempotency::MemoryStore;
/// use tower::ServiceExt;
///
/// let idem = Idempotency::new(Arc::new(MemoryStore::new()));
/// let layer = IdempotencyLayer::new(idem).scope(|parts| {
///     parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
/// });
/// let app: Router = Router::new().route("/pay", post(|| async { (axum::http::StatusCode::CREATED, "paid") }).layer(layer));
/// let pay = || Request::post("/pay").header("idempotency-key", "k1").header("x-user", "u1").body(Body::from("{}")).unwrap();
/// assert_eq!(app.clone().oneshot(pay()).await.unwrap().status(), 201);
/// let again = app.oneshot(pay()).await.unwrap();
/// assert_eq!(again.status(), 201);
/// assert_eq!(again.headers()["idempotent-replayed"], "true");
/// # }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    idem: Idempotency,
    scope: ScopeFn,
    lease: Duration,
    /// `None`: the installed engine's (`DLOCK_MAX_BODY_BYTES`).
    max_body_bytes: Option<usize>,
    max_response_bytes: usize,
    stored_headers: Arc<[HeaderName]>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.idem.store.name())
            .field("lease", &self.lease)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish_non_exhaustive()
    }
}

fn default_scope(parts: &Parts) -> String {
    match parts.headers.get(header::AUTHORIZATION) {
        Some(auth) => format!("auth:{}", fingerprint(&[auth.as_bytes()])),
        None => "anonymous".to_owned(),
    }
}

impl IdempotencyLayer {
    /// Key mode on `idem`'s store, with the defaults documented above.
    pub fn new(idem: Idempotency) -> Self {
        IdempotencyLayer {
            idem,
            scope: Arc::new(default_scope),
            lease: Duration::from_secs(60),
            max_body_bytes: None,
            max_response_bytes: 1024 * 1024,
            stored_headers: DEFAULT_STORED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect(),
        }
    }

    /// The caller a request belongs to (from an auth header, an extension set
    /// by an auth layer, …). Keys of different scopes never meet.
    pub fn scope(mut self, f: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.scope = Arc::new(f);
        self
    }

    /// How long an in-progress claim blocks its key if its instance dies.
    /// Choose it longer than the route ever takes.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Most request body bytes read for the fingerprint. Default: the
    /// installed engine's ([`Dlock::max_body_bytes`], from
    /// `DLOCK_MAX_BODY_BYTES` through [`Config`](dlock_core::Config); 64 KiB).
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = Some(n);
        self
    }

    /// Largest response body stored.
    pub fn max_response_bytes(mut self, n: usize) -> Self {
        self.max_response_bytes = n;
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
/// use std::sync::Arc;
/// use axum::{routing::post, Router};
/// use dlock_axum::idempotency::{Idempotency, Idempotent};
/// use dlock_core::idempotency::MemoryStore;
///
/// let idem = Idempotency::new(Arc::new(MemoryStore::new()));
/// let app: Router = Router::new().route("/pay", post(|| async { "paid" }).layer(Idempotent::layer(idem)));
/// ```
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    layer: IdempotencyLayer,
}

impl Idempotent<()> {
    /// The layer of this service: [`IdempotencyLayer::new`]`(idem)`.
    pub fn layer(idem: Idempotency) -> IdempotencyLayer {
        IdempotencyLayer::new(idem)
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

fn store_error(e: &dlock_core::Error) -> Response {
    tracing::warn!(error = %e, "dlock: idempotency store failed");
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

/// Frees the claim if the request ends without completing it: a dropped
/// future (client gone) or a panic in the route.
struct ClaimGuard {
    store: Arc<dyn IdempotencyStore>,
    claim: Option<Claim>,
}

impl ClaimGuard {
    fn take(&mut self) -> Option<Claim> {
        self.claim.take()
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else { return };
        let store = self.store.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Err(e) = store.abandon(&claim).await {
                        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: freeing an idempotency key failed; it frees itself when its lease ends");
                    }
                });
            }
            Err(_) => tracing::warn!(
                key = crate::headers::log_id(claim.key()),
                "dlock: no runtime to free an idempotency key; it frees itself when its lease ends"
            ),
        }
    }
}

/// Polls the route's future and turns a panic into a value, so the key can
/// be freed before the panic goes on.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(move || fut.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

impl<S> Service<Request<Body>> for Idempotent<S>
where
    S: Service<Request<Body>> + Clone + Send + 'static,
    S::Response: IntoResponse,
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
        let inner = take_ready(&mut self.inner);
        let layer = self.layer.clone();
        ResponseFuture::new(handle(layer, inner, req))
    }
}

async fn handle<S>(layer: IdempotencyLayer, mut inner: S, req: Request<Body>) -> Result<Response, S::Error>
where
    S: Service<Request<Body>> + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    let (parts, body) = req.into_parts();
    let key = match idempotency_key(&parts) {
        Ok(k) => k,
        Err(r) => return Ok(r.into_response()),
    };
    let limit = layer.max_body_bytes.unwrap_or_else(|| Dlock::max_body_bytes_in(&parts.extensions));
    let body = match read_body(&parts.headers, body, limit).await {
        Ok(body) => body,
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let fp = fingerprint(&[parts.method.as_str().as_bytes(), path.as_bytes(), &body]);
    let scope = (layer.scope)(&parts);
    let store = layer.idem.store.clone();
    let claim = match store.begin(&scope, &key, &fp, layer.lease).await {
        Ok(Begin::New(claim)) => claim,
        Ok(Begin::InProgress) => return Ok(Rejection::idempotency_request_in_progress().into_response()),
        Ok(Begin::Mismatch) => return Ok(Rejection::idempotency_key_mismatch().into_response()),
        Ok(Begin::Completed(stored)) => return Ok(replay(stored)),
        Err(e) => return Ok(store_error(&e)),
    };
    let mut guard = ClaimGuard { store: store.clone(), claim: Some(claim) };
    let ttl = layer.idem.ttl_in(&parts.extensions);
    let req = Request::from_parts(parts, Body::from(body));
    let response = match CatchUnwind(Box::pin(inner.call(req))).await {
        Ok(Ok(res)) => res.into_response(),
        Ok(Err(e)) => {
            drop(guard); // the route failed: free the key, as for a 5xx
            return Err(e);
        }
        Err(panic) => {
            drop(guard); // frees the key in the background
            std::panic::resume_unwind(panic);
        }
    };
    let Some(claim) = guard.take() else { return Ok(response) };
    if response.status().is_server_error() {
        abandon(&*store, &claim).await;
        return Ok(response);
    }
    let (mut res_parts, res_body) = response.into_parts();
    let bytes: Bytes = match Limited::new(res_body, layer.max_response_bytes).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            abandon(&*store, &claim).await;
            if e.is::<LengthLimitError>() {
                tracing::error!(
                    key = crate::headers::log_id(claim.key()),
                    limit = layer.max_response_bytes,
                    "dlock: response too large to store for replay"
                );
                return Ok(Rejection::idempotency_response_too_large().into_response());
            }
            tracing::warn!(error = %e, "dlock: reading the route's response failed");
            return Ok(Rejection::body_unreadable().into_response());
        }
    };
    let headers = layer
        .stored_headers
        .iter()
        .flat_map(|name| {
            res_parts.headers.get_all(name).iter().map(move |v| (name.as_str().to_owned(), v.as_bytes().to_vec()))
        })
        .collect();
    let stored = StoredResponse::new(res_parts.status.as_u16(), headers, bytes.to_vec());
    match store.complete(&claim, &stored, ttl).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            key = crate::headers::log_id(claim.key()),
            "dlock: the idempotency lease ran out before the route answered; response not stored"
        ),
        Err(e) => {
            tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: storing the idempotent response failed")
        }
    }
    res_parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(res_parts, Body::from(bytes)))
}

async fn abandon(store: &dyn IdempotencyStore, claim: &Claim) {
    if let Err(e) = store.abandon(claim).await {
        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: freeing an idempotency key failed; it frees itself when its lease ends");
    }
}
