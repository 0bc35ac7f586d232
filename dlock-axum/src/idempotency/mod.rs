//! Request idempotency over HTTP: one-time tokens ([`TokenLayer`],
//! [`token_handler`]) and `Idempotency-Key` ([`IdempotencyLayer`]); see
//! `docs/idempotency.md`.
//!
//! A request counts only when its route ran to a result ([`stored_by_default`]);
//! once claimed, it runs to its end. An unreachable store is
//! `503 lock_backend_unavailable` (fail closed).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use axum::{body::Body, http::Request, routing::{get, post}, Router};
//! use dlock_axum::idempotency::{token_handler, IdempotencyLayer, TokenLayer};
//! use dlock_axum::DlockExt;
//! use dlock_core::{Locker, MemoryBackend};
//! use tower::ServiceExt;
//!
//! let app: Router = Router::new()
//!     .route("/idempotency/token", get(token_handler(None)))
//!     .route("/orders", post(|| async { "placed" }).route_layer(TokenLayer::new().query_param("token")))
//!     .route("/payments", post(|| async { "paid" }).layer(IdempotencyLayer::new()))
//!     .with_dlock(Locker::new(MemoryBackend::new())); // records in this process
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
mod settle;
mod token;
#[cfg(feature = "postgres")]
mod transaction;

pub use key::{IdempotencyLayer, Idempotent, DEFAULT_METHODS};
pub use settle::{stored_by_default, DEFAULT_STORED_HEADERS};

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
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Where a layer takes its records: its own store and TTL, else the installed runtime's.
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

    /// The TTL for one request: this one, else the runtime's, else the default.
    pub(crate) fn ttl_in_request(&self, extensions: &axum::http::Extensions) -> Duration {
        match (self.ttl, crate::install::installed(extensions)) {
            (Some(ttl), _) => ttl,
            (None, Some(dlock)) => dlock.idempotency_ttl(),
            (None, None) => dlock_core::DEFAULT_IDEMPOTENCY_TTL,
        }
    }

    /// The store and TTL for one request; a runtime without records (RedLock or
    /// ZooKeeper without `DLOCK_IDEMPOTENCY_REDIS_URL`) is `500 lock_misconfigured`.
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

/// A handler that issues a token: `200 {"token": "...", "expires_in_secs": n}`
/// (`HEAD`: headers only). With a [`Caller`], tokens are bound to the
/// request's caller ([`TokenLayer::caller`]; none: `400 idempotency_scope_missing`);
/// with `None`, anyone may spend one.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::get, Router};
/// use dlock_axum::{idempotency::token_handler, Caller, DlockExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
/// let app: Router = Router::new()
///     .route("/idempotency/token", get(token_handler(None)))
///     .route("/my/token", get(token_handler(Some(Caller::header("x-user")))))
///     .with_dlock(Locker::new(MemoryBackend::new()));
/// let res = app.clone().oneshot(Request::get("/idempotency/token").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// let res = app.oneshot(Request::get("/my/token").header("x-user", "alice").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// # }
/// ```
pub fn token_handler(caller: Option<Caller>) -> impl Fn(Parts) -> Issued + Clone + Send + Sync + 'static {
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

/// The future of a token handler.
type Issued = std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>;
