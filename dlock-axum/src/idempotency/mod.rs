//! Request idempotency over HTTP: one-time tokens and `Idempotency-Key`.
//!
//! **Token mode** (a form that must be submitted once): the client fetches a
//! token from [`Idempotency::token_handler`] (`{"token": "...",
//! "expires_in_secs": n}`) and sends it with the submit, in the header
//! `Idempotency-Token` or a query parameter ([`TokenLayer::query_param`]).
//! [`TokenLayer`] claims it atomically before the route runs: missing →
//! `400 idempotency_token_missing`; unknown, expired or used →
//! `409 idempotency_token_unknown` (permanent: fetch a new token); in use by
//! a concurrent submit → `409 idempotency_request_in_progress`. Of any
//! number of concurrent submits of one token, exactly one reaches the route.
//!
//! **One rule for tokens and keys.** A request counts — its token spent, its
//! `Idempotency-Key` completed and replayed — only when its route ran to a
//! result ([`stored_by_default`]). A refusal before the work (axum's
//! extractor rejections, dlock's own refusals), a `5xx` or a panic gives the
//! token back and frees the key, so the corrected retry runs. A client that
//! hangs up does neither: once claimed, the route runs to its end on a task
//! of its own, and its answer counts.
//!
//! **Key mode** (IETF "The Idempotency-Key HTTP Header Field", Stripe):
//! [`IdempotencyLayer`] — see there for the rules, the scope default and the
//! failure policy.
//!
//! Both answer `503 lock_backend_unavailable` when the store cannot be reached
//! (fail closed: never run a request whose duplicate could not be ruled out),
//! and refuse a new key or token beyond the store's
//! [`IdempotencyLimits`](dlock_core::idempotency::IdempotencyLimits) with
//! `429 idempotency_scope_full` (the caller's cap) or
//! `503 idempotency_store_full` (the total), `Retry-After` until the oldest
//! record expires. A refusal made before the body is read drains it first,
//! as the lock layers do, so a client still sending it reads the answer.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::sync::Arc;
//! use axum::{body::Body, http::Request, routing::{get, post}, Router};
//! use dlock_axum::idempotency::{Idempotency, IdempotencyLayer, TokenLayer};
//! use dlock_core::idempotency::MemoryStore;
//! use tower::ServiceExt;
//!
//! let idem = Idempotency::new(Arc::new(MemoryStore::new()));
//! let app: Router = Router::new()
//!     .route("/idempotency/token", get(idem.token_handler()))
//!     .route("/orders", post(|| async { "placed" }).route_layer(TokenLayer::new(idem.clone()).query_param("token")))
//!     .route("/payments", post(|| async { "paid" }).layer(IdempotencyLayer::new(idem.clone())));
//!
//! let res = app.clone().oneshot(Request::post("/orders").body(Body::empty()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), 400); // idempotency_token_missing
//! let pay = Request::post("/payments").header("idempotency-key", "k-1").header("authorization", "Bearer alice");
//! let res = app.oneshot(pay.body(Body::empty()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), 200);
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use dlock_core::idempotency::IdempotencyStore;

use crate::install::Dlock;

mod detached;
mod key;
mod token;

pub use key::{stored_by_default, IdempotencyLayer, Idempotent, Scope, DEFAULT_METHODS, DEFAULT_STORED_HEADERS};

pub use token::{RequireToken, TokenLayer, TokenResponse};

/// The future of [`Idempotent`] and [`RequireToken`]: the layer's work, then
/// the inner service's answer; the inner service's error passes through.
pub struct ResponseFuture<E> {
    inner: std::pin::Pin<Box<dyn std::future::Future<Output = Result<axum::response::Response, E>> + Send>>,
}

impl<E> ResponseFuture<E> {
    fn new(future: impl std::future::Future<Output = Result<axum::response::Response, E>> + Send + 'static) -> Self {
        ResponseFuture { inner: Box::pin(future) }
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> std::future::Future for ResponseFuture<E> {
    type Output = Result<axum::response::Response, E>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// The header a retried response carries.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The request header of key mode.
pub const KEY_HEADER: &str = "idempotency-key";
/// The request header of token mode.
pub const TOKEN_HEADER: &str = "idempotency-token";
/// Longest accepted `Idempotency-Key`.
pub const MAX_KEY_LEN: usize = 255;

/// A store and the TTL of its tokens and stored responses, shared by the
/// token endpoint and the layers.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// let cfg = dlock_core::Config::from_env()?;
/// let idem = dlock_axum::idempotency::Idempotency::from_config(&cfg).await?;
/// assert_eq!(idem.ttl(), cfg.idempotency_ttl);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency {
    store: Arc<dyn IdempotencyStore>,
    /// `None`: the installed engine's ([`Dlock::idempotency_ttl`]), else 24 hours.
    ttl: Option<Duration>,
}

impl Idempotency {
    /// Records in `store`, living as long as the installed engine's
    /// configuration says ([`Dlock::idempotency_ttl`],
    /// `DLOCK_IDEMPOTENCY_TTL_SECS`; 24 hours without one).
    pub fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Idempotency { store, ttl: None }
    }

    /// The store [`Config::idempotency_store`](dlock_core::Config::idempotency_store)
    /// picks, with the configured TTL. It opens connections of its own; to
    /// share the lock backend's, build both with
    /// [`Config::build_services`](dlock_core::Config::build_services) and
    /// take [`Idempotency::new`] of its store (the README shows it).
    ///
    /// # Errors
    ///
    /// When the store cannot be connected.
    pub async fn from_config(cfg: &dlock_core::Config) -> dlock_core::Result<Self> {
        Ok(Idempotency { store: cfg.idempotency_store().await?, ttl: Some(cfg.idempotency_ttl) })
    }

    /// Changes how long tokens and stored responses live.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// How long tokens and stored responses live when no engine says
    /// otherwise: the TTL given here, else 24 hours.
    pub fn ttl(&self) -> Duration {
        self.ttl.unwrap_or_else(|| dlock_core::Config::default().idempotency_ttl)
    }

    /// The TTL for a request: the one given here, else the installed
    /// engine's, else 24 hours.
    pub(crate) fn ttl_in(&self, extensions: &axum::http::Extensions) -> Duration {
        match (self.ttl, extensions.get::<Dlock>()) {
            (Some(ttl), _) => ttl,
            (None, Some(dlock)) => dlock.idempotency_ttl(),
            (None, None) => self.ttl(),
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.store
    }

    /// A handler that issues a token bound to the request's caller, as
    /// `scope` names it: only a [`TokenLayer::with_scope`] of the same scope,
    /// on a request of the same caller, accepts it. A request whose scope is
    /// missing is `400 idempotency_scope_missing`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use axum::{body::Body, http::Request, routing::get, Router};
    /// use dlock_axum::idempotency::{Idempotency, Scope};
    /// use tower::ServiceExt;
    /// let idem = Idempotency::new(std::sync::Arc::new(dlock_core::idempotency::MemoryStore::new()));
    /// let app: Router = Router::new().route("/token", get(idem.bound_token_handler(Scope::header("x-user"))));
    /// let res = app.oneshot(Request::get("/token").header("x-user", "alice").body(Body::empty()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// # }
    /// ```
    pub fn bound_token_handler(
        &self,
        scope: Scope,
    ) -> impl Fn(
        axum::http::request::Parts,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = axum::response::Response> + Send>>
           + Clone
           + Send
           + Sync
           + 'static {
        let idem = self.clone();
        move |parts: axum::http::request::Parts| {
            let idem = idem.clone();
            let ttl = idem.ttl_in(&parts.extensions);
            let principal = scope.of(&parts);
            Box::pin(async move {
                match principal {
                    Some(principal) => token::issue(&idem, &parts.method, Some(&principal), ttl).await,
                    None => axum::response::IntoResponse::into_response(token::scope_missing()),
                }
            })
        }
    }

    /// A handler that issues a token: `200 {"token": "...", "expires_in_secs": n}`,
    /// or `503 lock_backend_unavailable`. Mount it where clients ask for tokens.
    /// A `HEAD` gets the headers, and no token is issued for it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use axum::{body::Body, http::Request, routing::get, Router};
    /// use tower::ServiceExt;
    /// let idem = dlock_axum::idempotency::Idempotency::new(std::sync::Arc::new(dlock_core::idempotency::MemoryStore::new()));
    /// let app: Router = Router::new().route("/idempotency/token", get(idem.token_handler()));
    /// let res = app.oneshot(Request::get("/idempotency/token").body(Body::empty()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// # }
    /// ```
    pub fn token_handler(
        &self,
    ) -> impl Fn(
        axum::http::request::Parts,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = axum::response::Response> + Send>>
           + Clone
           + Send
           + Sync
           + 'static {
        let idem = self.clone();
        move |parts: axum::http::request::Parts| {
            let idem = idem.clone();
            let ttl = idem.ttl_in(&parts.extensions);
            Box::pin(async move { token::issue(&idem, &parts.method, None, ttl).await })
        }
    }
}
