//! Request idempotency over HTTP: one-time tokens and `Idempotency-Key`.
//!
//! **Token mode** (a form that must be submitted once): the client fetches a
//! token from [`token_handler`] (`{"token": "...",
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
//! Both find their store in the installed
//! [`DlockRuntime`](dlock_core::DlockRuntime) (`DLOCK_IDEMPOTENCY_REDIS_URL`,
//! else the lock Redis, else this process), as `LockLayer` finds the engine;
//! `with_store` gives a layer its own.
//!
//! **Key mode** (IETF "The Idempotency-Key HTTP Header Field", Stripe):
//! [`IdempotencyLayer`] — see there for the rules, the default caller and the
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
//! use axum::{body::Body, http::Request, routing::{get, post}, Router};
//! use dlock_axum::idempotency::{token_handler, IdempotencyLayer, TokenLayer};
//! use dlock_axum::LockerExt;
//! use dlock_core::{Locker, MemoryBackend};
//! use tower::ServiceExt;
//!
//! let app: Router = Router::new()
//!     .route("/idempotency/token", get(token_handler()))
//!     .route("/orders", post(|| async { "placed" }).route_layer(TokenLayer::new().query_param("token")))
//!     .route("/payments", post(|| async { "paid" }).layer(IdempotencyLayer::new()))
//!     .with_locker(Locker::new(MemoryBackend::new())); // records in this process
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

use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use dlock_core::idempotency::IdempotencyStore;

use crate::caller::Caller;
use crate::rejection::Rejection;

mod key;
mod lease;
mod token;
#[cfg(feature = "postgres")]
mod transaction;

pub use key::{stored_by_default, IdempotencyLayer, Idempotent, DEFAULT_METHODS, DEFAULT_STORED_HEADERS};

pub use token::{RequireToken, TokenLayer, TokenResponse};
#[cfg(feature = "postgres")]
pub use transaction::Tx;

/// The header a retried response carries.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The request header of key mode.
pub const KEY_HEADER: &str = "idempotency-key";
/// The request header of token mode.
pub const TOKEN_HEADER: &str = "idempotency-token";
/// Longest accepted `Idempotency-Key`.
pub const MAX_KEY_LEN: usize = 255;

/// Where a layer or token endpoint takes its records: its own store and TTL
/// when given ([`IdempotencyLayer::with_store`], [`TokenLayer::with_store`]),
/// else the installed [`DlockRuntime`](dlock_core::DlockRuntime)'s.
#[derive(Clone, Default)]
pub(crate) struct Records {
    store: Option<Arc<dyn IdempotencyStore>>,
    ttl: Option<Duration>,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = self.store.as_ref().map_or("installed", |store| store.name());
        f.debug_struct("Records").field("store", &store).field("ttl", &self.ttl).finish()
    }
}

impl Records {
    fn with_store(mut self, store: Arc<dyn IdempotencyStore>) -> Self {
        self.store = Some(store);
        self
    }

    fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The TTL of records for one request: the one given here, else the
    /// installed runtime's, else the default.
    pub(crate) fn ttl_in_request(&self, extensions: &axum::http::Extensions) -> Duration {
        match (self.ttl, crate::install::installed(extensions)) {
            (Some(ttl), _) => ttl,
            (None, Some(dlock)) => dlock.idempotency_ttl(),
            (None, None) => dlock_core::DEFAULT_IDEMPOTENCY_TTL,
        }
    }

    /// The store and TTL for one request: the ones given here, else the
    /// installed runtime's. A runtime whose configuration keeps no records
    /// (RedLock or ZooKeeper locks without `DLOCK_IDEMPOTENCY_REDIS_URL`)
    /// refuses with `500 lock_misconfigured`, its log naming the variable.
    pub(crate) fn in_request(
        &self,
        extensions: &axum::http::Extensions,
    ) -> Result<(Arc<dyn IdempotencyStore>, Duration), Rejection> {
        let installed = crate::install::installed(extensions);
        let ttl = self.ttl_in_request(extensions);
        let store = match (&self.store, installed) {
            (Some(store), _) => store.clone(),
            (None, Some(dlock)) => dlock.idempotency_store().cloned().map_err(|e| {
                tracing::error!(error = %e, "dlock: an idempotency route, and no idempotency records configured");
                Rejection::misconfigured().with_message("no idempotency records configured for this route")
            })?,
            (None, None) => return Err(crate::install::no_engine()),
        };
        Ok((store, ttl))
    }
}

/// A handler that issues a token: `200 {"token": "...", "expires_in_secs": n}`,
/// or `503 lock_backend_unavailable`; records in the installed runtime.
/// Mount it where clients ask for tokens. A `HEAD` gets the headers, and no
/// token is issued for it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::get, Router};
/// use dlock_axum::{idempotency::token_handler, LockerExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
/// let app: Router = Router::new()
///     .route("/idempotency/token", get(token_handler()))
///     .with_locker(Locker::new(MemoryBackend::new()));
/// let res = app.oneshot(Request::get("/idempotency/token").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// # }
/// ```
pub fn token_handler() -> impl Fn(Parts) -> Issued + Clone + Send + Sync + 'static {
    issuing(None)
}

/// A handler that issues a token bound to the request's caller, as
/// `caller` names it: only a [`TokenLayer::caller`] of the same [`Caller`],
/// on a request of the same caller, accepts it. A request without a caller
/// is `400 idempotency_scope_missing`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::get, Router};
/// use dlock_axum::{idempotency::bound_token_handler, Caller, LockerExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
/// let app: Router = Router::new()
///     .route("/token", get(bound_token_handler(Caller::header("x-user"))))
///     .with_locker(Locker::new(MemoryBackend::new()));
/// let res = app.oneshot(Request::get("/token").header("x-user", "alice").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// # }
/// ```
pub fn bound_token_handler(caller: Caller) -> impl Fn(Parts) -> Issued + Clone + Send + Sync + 'static {
    issuing(Some(caller))
}

/// The future of a token handler.
type Issued = std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>;

/// The token handlers: unbound tokens (`None`), or tokens bound to the
/// request's caller, refused when it names none.
fn issuing(caller: Option<Caller>) -> impl Fn(Parts) -> Issued + Clone + Send + Sync + 'static {
    move |parts: Parts| {
        let records = Records::default().in_request(&parts.extensions);
        let principal = caller.as_ref().map(|caller| caller.of(&parts));
        Box::pin(async move {
            match (records, principal) {
                (Err(refused), _) => refused.into_response(),
                (Ok(_), Some(None)) => token::scope_missing().into_response(),
                (Ok((store, ttl)), principal) => {
                    token::issue(&store, &parts.method, principal.flatten().as_deref(), ttl).await
                }
            }
        })
    }
}
