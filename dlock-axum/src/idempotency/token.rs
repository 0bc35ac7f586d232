//! Token mode: issue and consume one-time tokens.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::{header, HeaderValue, Method, Request};
use axum::response::{IntoResponse, Response};
use tower::{Layer, Service};

use dlock_core::idempotency::{Claim, IdempotencyStore, TokenClaim};

use super::lease;
use super::settle::{self, kept, stored_by_default, KeepWhen};
use super::{Records, TOKEN_HEADER};
use crate::caller::Caller;
use crate::future::ResponseFuture;
use crate::pipeline::body::discard;
use crate::pipeline::detached::{self, CatchUnwind, Settled};
use crate::pipeline::outage::STORE;
use crate::rejection::Rejection;

/// The body of the token endpoint.
///
/// ```
/// let body = dlock_axum::idempotency::TokenResponse { token: "ab".into(), expires_in_secs: 60 }.to_json();
/// assert_eq!(body, r#"{"token":"ab","expires_in_secs":60}"#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenResponse {
    /// The one-time token.
    pub token: String,
    /// Seconds until it expires.
    pub expires_in_secs: u64,
}

impl TokenResponse {
    /// `{"token": ..., "expires_in_secs": ...}`.
    pub fn to_json(&self) -> String {
        // Written by hand to keep the documented field order.
        format!(
            "{{\"token\":{},\"expires_in_secs\":{}}}",
            serde_json::Value::from(self.token.as_str()),
            self.expires_in_secs
        )
    }
}

/// The token endpoint's answer: a new token, or for `HEAD` the headers only (no token stored).
pub(super) async fn issue(
    store: &Arc<dyn IdempotencyStore>,
    method: &Method,
    principal: Option<&str>,
    ttl: Duration,
) -> Response {
    if method == Method::HEAD {
        return token_response(Body::empty());
    }
    match store.issue_token(principal, ttl).await {
        Ok(token) => {
            let body = TokenResponse { token, expires_in_secs: ttl.as_secs() }.to_json();
            token_response(Body::from(body))
        }
        Err(e @ dlock_core::Error::IdempotencyFull { .. }) => {
            tracing::debug!(error = %e, "dlock: no idempotency token issued: the store is full");
            Rejection::from_lock_error(&e).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "dlock: issuing an idempotency token failed");
            Rejection::from_lock_error(&e).into_response()
        }
    }
}

/// `idempotency_scope_missing`, speaking of a bound token.
pub(super) fn scope_missing() -> Rejection {
    Rejection::idempotency_scope_missing().with_message("the request does not name the caller its token is bound to")
}

/// `200` with the token endpoint's headers and `body`.
fn token_response(body: Body) -> Response {
    let mut res = Response::new(body);
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    // A token must never be served from a cache to a second client.
    res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

/// Admits one request per one-time token.
///
/// The token (`Idempotency-Token`, or [`query_param`](TokenLayer::query_param))
/// is claimed atomically (concurrent submits: `409 idempotency_request_in_progress`),
/// then **spent** when the route ran to a result ([`stored_by_default`](super::stored_by_default);
/// a resubmit: `409 idempotency_token_unknown`), else **given back**. A hang-up
/// cannot cut the route; a dead instance's token is `409 idempotency_outcome_unknown`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::{idempotency::TokenLayer, DlockRuntime, DlockExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
///
/// let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new()));
/// let app: Router = Router::new()
///     .route("/submit", post(|| async { "ok" }).route_layer(TokenLayer::new()))
///     .with_dlock(dlock.clone());
/// let token = dlock.idempotency_store().unwrap().issue_token(None, dlock.idempotency_ttl()).await.unwrap();
/// let submit = || Request::post("/submit").header("idempotency-token", &token).body(Body::empty()).unwrap();
/// assert_eq!(app.clone().oneshot(submit()).await.unwrap().status(), 200);
/// assert_eq!(app.oneshot(submit()).await.unwrap().status(), 409);
/// # }
/// ```
#[derive(Clone)]
pub struct TokenLayer {
    records: Records,
    query_param: Option<String>,
    duplicate: Rejection,
    /// Whether the route's response spends its token ([`TokenLayer::spend_when`]).
    spend_when: KeepWhen,
    /// The caller tokens are bound to; `None`: unbound tokens.
    caller: Option<Caller>,
    /// The lease of a claim, renewed while the route runs.
    lease: Duration,
}

impl std::fmt::Debug for TokenLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenLayer")
            .field("records", &self.records)
            .field("query_param", &self.query_param)
            .field("duplicate", &self.duplicate)
            .field("caller", &self.caller)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Default for TokenLayer {
    fn default() -> Self {
        TokenLayer::new()
    }
}

impl TokenLayer {
    /// Tokens from the `Idempotency-Token` header, in the installed runtime's store.
    pub fn new() -> Self {
        TokenLayer {
            records: Records::default(),
            query_param: None,
            duplicate: Rejection::idempotency_token_unknown(),
            spend_when: Arc::new(stored_by_default),
            caller: None,
            lease: Duration::from_secs(10),
        }
    }

    /// Tokens in `store` rather than the installed runtime's.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use dlock_axum::idempotency::TokenLayer;
    /// let layer = TokenLayer::new().store(Arc::new(dlock_core::idempotency::MemoryStore::new()));
    /// ```
    pub fn store(mut self, store: Arc<dyn IdempotencyStore>) -> Self {
        self.records = self.records.with_store(store);
        self
    }

    /// The lease of a token's claim (default 10 s), renewed while the route
    /// runs: how long a dead instance's token stays "in progress".
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use dlock_axum::idempotency::TokenLayer;
    /// let layer = TokenLayer::new().lease(Duration::from_secs(5));
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Also accept the token as the query parameter `name` (`?token=...`).
    pub fn query_param(mut self, name: impl Into<String>) -> Self {
        self.query_param = Some(name.into());
        self
    }

    /// The answer to a used or unknown token (default `409 idempotency_token_unknown`).
    pub fn duplicate_rejection(mut self, rejection: Rejection) -> Self {
        self.duplicate = rejection;
        self
    }

    /// Accepts only tokens a [`token_handler`](super::token_handler) of the same
    /// `caller` bound to the request's caller (others: `409`; no caller: `400`).
    ///
    /// ```
    /// use axum::{routing::{get, post}, Router};
    /// use dlock_axum::{idempotency::{token_handler, TokenLayer}, Caller};
    /// let app: Router = Router::new()
    ///     .route("/token", get(token_handler(Some(Caller::cookie("session")))))
    ///     .route("/submit", post(|| async { "ok" }).route_layer(TokenLayer::new().caller(Caller::cookie("session"))));
    /// ```
    pub fn caller(mut self, caller: Caller) -> Self {
        self.caller = Some(caller);
        self
    }

    /// Which answers spend the token (default [`stored_by_default`](super::stored_by_default));
    /// the others, and every `5xx`, give it back.
    ///
    /// ```
    /// use dlock_axum::idempotency::{stored_by_default, TokenLayer};
    /// // A 422 of this route comes after its side effect: spend the token then too.
    /// let layer = TokenLayer::new().spend_when(|res| res.status() == 422 || stored_by_default(res));
    /// ```
    pub fn spend_when(mut self, f: impl Fn(&Response) -> bool + Send + Sync + 'static) -> Self {
        self.spend_when = Arc::new(f);
        self
    }
}

impl<S> Layer<S> for TokenLayer {
    type Service = RequireToken<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireToken { inner, layer: self.clone() }
    }
}

/// The service of [`TokenLayer`]; the inner service's error passes through.
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_axum::idempotency::RequireToken;
///
/// let app: Router = Router::new().route("/submit", post(|| async { "ok" }).route_layer(RequireToken::layer()));
/// ```
#[derive(Debug, Clone)]
pub struct RequireToken<S> {
    inner: S,
    layer: TokenLayer,
}

impl RequireToken<()> {
    /// The layer of this service: [`TokenLayer::new`]`()`.
    pub fn layer() -> TokenLayer {
        TokenLayer::new()
    }
}

impl<S> RequireToken<S> {
    inner_service_accessors!();

    /// The request's token, `None` when it sent none, refused when sent twice
    /// (even equal). A header that is not text is a token no store knows.
    fn token(&self, req: &Request<Body>) -> Result<Option<String>, Rejection> {
        let header = crate::headers::sole(req.headers(), TOKEN_HEADER)
            .map_err(|_| Rejection::idempotency_token_duplicated())?
            .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_owned());
        let mut query = match (self.layer.query_param.as_deref(), req.uri().query()) {
            (Some(name), Some(query)) => {
                form_urlencoded::parse(query.as_bytes()).filter(|(k, _)| k == name).map(|(_, v)| v).collect()
            }
            _ => Vec::new(),
        };
        let query = match (query.pop(), query.is_empty()) {
            (None, _) => None,
            (Some(v), true) => Some(v),
            (Some(_), false) => return Err(Rejection::idempotency_token_duplicated()),
        };
        let token = match (header, query) {
            (Some(_), Some(_)) => return Err(Rejection::idempotency_token_duplicated()),
            (Some(h), None) => h,
            (None, Some(q)) => q.trim().to_owned(),
            (None, None) => return Ok(None),
        };
        Ok(Some(token).filter(|t| !t.is_empty()))
    }
}

impl<S> Service<Request<Body>> for RequireToken<S>
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
        let token = self.token(&req);
        let layer = self.layer.clone();
        let (parts, body) = req.into_parts();
        let principal = layer.caller.as_ref().map(|caller| caller.of(&parts));
        let records = layer.records.in_request(&parts.extensions);
        let req = Request::from_parts(parts, body);
        ResponseFuture::observed(crate::observe::Face::Token, "token".into(), async move {
            let asked = match (token, principal, records) {
                (Err(refused), _, _) => Err(refused.into_response()),
                (Ok(None), _, _) => Err(Rejection::idempotency_token_missing().into_response()),
                (Ok(Some(_)), Some(None), _) => Err(scope_missing().into_response()),
                (Ok(Some(_)), _, Err(refused)) => Err(refused.into_response()),
                (Ok(Some(token)), principal, Ok((store, _))) => Ok((token, principal.flatten(), store)),
            };
            let (token, principal, store) = match asked {
                Ok(asked) => asked,
                Err(response) => return Ok(refuse(req, response).await),
            };
            // On its own task from the claim on: a hang-up never strands it half-claimed.
            detached::run_detached(move |client| async move {
                let claim = match claim_token(&layer, &*store, &token, principal.as_deref()).await {
                    Ok(claim) => claim,
                    Err(response) => return Settled::Answer(refuse(req, response).await),
                };
                if client.is_gone() {
                    // Nobody waits for the answer: the token goes back unspent.
                    give_back(&*store, &claim).await;
                    return Settled::Answer(Rejection::idempotency_request_in_progress().into_response());
                }
                let route = inner.call(req);
                let answered = lease::renewing(&*store, &claim, layer.lease, CatchUnwind(Box::pin(route))).await;
                settle::settle(ClaimedToken { store, claim, spend_when: layer.spend_when }, answered).await
            })
            .await
        })
    }
}

/// Answers a request refused before its body was read, draining the body first.
async fn refuse(req: Request<Body>, response: Response) -> Response {
    let (parts, body) = req.into_parts();
    discard(&parts.headers, body, false).await;
    response
}

/// Claims `token` for one run of the route, or answers why not.
async fn claim_token(
    layer: &TokenLayer,
    store: &dyn IdempotencyStore,
    token: &str,
    principal: Option<&str>,
) -> Result<Claim, Response> {
    let claimed = store.claim_token(token, principal, layer.lease).await;
    match &claimed {
        Err(e) if e.is_unavailable() => STORE.refused(&e.to_string()),
        _ => STORE.answered(),
    }
    match claimed {
        Ok(TokenClaim::Claimed(claim)) => Ok(claim),
        Ok(TokenClaim::InUse) => Err(Rejection::idempotency_request_in_progress()
            .with_message("a request with this token is still being processed")
            .into_response()),
        Ok(TokenClaim::OutcomeUnknown) => Err(Rejection::idempotency_outcome_unknown()
            .with_message(
                "a request with this token was started but never answered; whether it ran is unknown: check, then \
                 fetch a new token",
            )
            .into_response()),
        // Unknown, or an answer this layer does not know: never run on it.
        Ok(_) => Err(layer.duplicate.clone().into_response()),
        Err(e) => {
            // An outage is told once, with a count, by the outage log.
            if e.is_unavailable() {
                tracing::debug!(error = %e, "dlock: claiming an idempotency token failed");
            } else {
                tracing::warn!(error = %e, "dlock: claiming an idempotency token failed");
            }
            Err(Rejection::from_lock_error(&e).into_response())
        }
    }
}

/// A one-time token claimed for one run of its route: spent, or given back.
struct ClaimedToken {
    store: Arc<dyn IdempotencyStore>,
    claim: Claim,
    spend_when: KeepWhen,
}

impl settle::Claimed for ClaimedToken {
    fn keeps(&self, response: &Response) -> bool {
        kept(&self.spend_when, response)
    }

    async fn abandon(self) {
        give_back(&*self.store, &self.claim).await;
    }

    async fn keep(self, response: Response) -> Response {
        match self.store.spend_token(&self.claim).await {
            Ok(true) => {}
            // Its lease ran out: it answers "outcome unknown" for its TTL, which counts as spent.
            Ok(false) => {
                tracing::warn!("dlock: an idempotency token's claim ran out before it was spent; it stays claimed")
            }
            Err(e) => tracing::warn!(error = %e, "dlock: spending an idempotency token failed; it stays claimed"),
        }
        response
    }
}

async fn give_back(store: &dyn IdempotencyStore, claim: &Claim) {
    match store.return_token(claim).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("dlock: an idempotency token could not be given back (expired); it stays spent"),
        Err(e) => tracing::warn!(error = %e, "dlock: giving an idempotency token back failed; it stays spent"),
    }
}
