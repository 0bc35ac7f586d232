//! Token mode: issue and consume one-time tokens.

use std::task::{Context, Poll};
use std::time::Duration;

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::{header, HeaderValue, Request};
use axum::response::{IntoResponse, Response};
use tower::{Layer, Service};

use super::{Idempotency, ResponseFuture, TOKEN_HEADER};
use crate::Rejection;

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

pub(super) async fn issue(idem: &Idempotency, ttl: Duration) -> Response {
    match idem.store.issue_token(ttl).await {
        Ok(token) => {
            let body = TokenResponse { token, expires_in_secs: ttl.as_secs() }.to_json();
            let mut res = Response::new(Body::from(body));
            res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            // A token must never be served from a cache to a second client.
            res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            res
        }
        Err(e) => {
            tracing::warn!(error = %e, "dlock: issuing an idempotency token failed");
            Rejection::from_lock_error(&e).into_response()
        }
    }
}

/// Consumes a one-time token before the route runs.
///
/// Reads the `Idempotency-Token` header, else the query parameter set with
/// [`TokenLayer::query_param`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::idempotency::{Idempotency, TokenLayer};
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
/// use tower::ServiceExt;
///
/// let idem = Idempotency::new(Arc::new(MemoryStore::new()));
/// let app: Router = Router::new().route("/submit", post(|| async { "ok" }).layer(TokenLayer::new(idem.clone())));
/// let token = idem.store().issue_token(idem.ttl()).await.unwrap();
/// let submit = || Request::post("/submit").header("idempotency-token", &token).body(Body::empty()).unwrap();
/// assert_eq!(app.clone().oneshot(submit()).await.unwrap().status(), 200);
/// assert_eq!(app.oneshot(submit()).await.unwrap().status(), 409);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TokenLayer {
    idem: Idempotency,
    query_param: Option<String>,
    duplicate: Rejection,
}

impl TokenLayer {
    /// Tokens from the `Idempotency-Token` header.
    pub fn new(idem: Idempotency) -> Self {
        TokenLayer { idem, query_param: None, duplicate: Rejection::idempotency_token_unknown() }
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
}

impl<S> Layer<S> for TokenLayer {
    type Service = RequireToken<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireToken { inner, layer: self.clone() }
    }
}

/// The service of [`TokenLayer`]: consumes the request's one-time token,
/// then calls the inner service, whose error passes through unchanged.
///
/// ```
/// use std::sync::Arc;
/// use axum::{routing::post, Router};
/// use dlock_axum::idempotency::{Idempotency, RequireToken};
/// use dlock_core::idempotency::MemoryStore;
///
/// let idem = Idempotency::new(Arc::new(MemoryStore::new()));
/// let app: Router = Router::new().route("/submit", post(|| async { "ok" }).layer(RequireToken::layer(idem)));
/// ```
#[derive(Debug, Clone)]
pub struct RequireToken<S> {
    inner: S,
    layer: TokenLayer,
}

impl RequireToken<()> {
    /// The layer of this service: [`TokenLayer::new`]`(idem)`.
    pub fn layer(idem: Idempotency) -> TokenLayer {
        TokenLayer::new(idem)
    }
}

impl<S> RequireToken<S> {
    inner_service_accessors!();

    fn token(&self, req: &Request<Body>) -> Option<String> {
        if let Some(v) = req.headers().get(TOKEN_HEADER).and_then(|v| v.to_str().ok()) {
            return Some(v.trim().to_owned()).filter(|t| !t.is_empty());
        }
        let name = self.layer.query_param.as_deref()?;
        form_urlencoded::parse(req.uri().query()?.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim().to_owned())
            .filter(|t| !t.is_empty())
    }
}

impl<S> Service<Request<Body>> for RequireToken<S>
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
        let mut inner = take_ready(&mut self.inner);
        let token = self.token(&req);
        let layer = self.layer.clone();
        ResponseFuture::new(async move {
            let Some(token) = token else {
                return Ok(Rejection::idempotency_token_missing().into_response());
            };
            match layer.idem.store.consume_token(&token).await {
                Ok(true) => inner.call(req).await.map(IntoResponse::into_response),
                Ok(false) => Ok(layer.duplicate.clone().into_response()),
                Err(e) => {
                    tracing::warn!(error = %e, "dlock: consuming an idempotency token failed");
                    // `Retry-After` on a 503 comes with the rejection's response.
                    Ok(Rejection::from_lock_error(&e).into_response())
                }
            }
        })
    }
}
