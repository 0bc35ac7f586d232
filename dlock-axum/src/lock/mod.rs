//! [`LockLayer`]: lock a route on a key built from the request.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::time::Duration;
//! use axum::{body::Body, http::Request, routing::post, Router};
//! use dlock_axum::{LockLayer, LockerExt};
//! use dlock_core::{Locker, MemoryBackend};
//! use tower::ServiceExt;
//!
//! async fn reduce(body: String) -> String { body } // sees the body unchanged
//!
//! let app: Router = Router::new()
//!     .route(
//!         "/stock/reduce",
//!         post(reduce).route_layer(LockLayer::new("product.stock").json("product_id").wait(Duration::from_secs(5))),
//!     )
//!     .with_locker(Locker::new(MemoryBackend::new()));
//!
//! let req = Request::post("/stock/reduce").body(Body::from(r#"{"product_id": 7, "quantity": 1}"#)).unwrap();
//! let res = app.clone().oneshot(req).await.unwrap();
//! assert_eq!(res.status(), 200);
//! // A method the route does not serve: axum's 405, no key read, no lock.
//! let res = app.oneshot(Request::get("/stock/reduce").body(Body::empty()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), 405);
//! # }
//! ```
//!
//! Put the layer on the route with `route_layer`, as above. axum's
//! `MethodRouter::layer` (`post(reduce).layer(..)`) also wraps the fallback
//! that answers `405` to the methods the route does not serve, and the layer
//! cannot tell that fallback from a handler: a `GET` would then read the
//! key and take the lock before its `405` (or answer `409` while a `POST`
//! holds it).
//!
//! For each request the layer
//!
//! 1. finds the engine: the one given to [`LockLayer::with_locker`], else the
//!    one installed in the request extensions
//!    ([`LockerExt::with_locker`](crate::LockerExt::with_locker), a
//!    [`DlockRuntime`](crate::DlockRuntime));
//! 2. when the key names JSON fields, refuses a `Content-Type` that is not
//!    JSON (`415 unsupported_media_type`), reads at most `max_body_bytes` of
//!    the body (the layer's own, else the installed engine's
//!    `DLOCK_MAX_BODY_BYTES`; `413 payload_too_large` past it, also when
//!    `Content-Length` says so up front) within the engine's
//!    [`body_read_timeout`](crate::DlockRuntime::body_read_timeout) (`408
//!    request_timeout` past it), parses it once (`400 invalid_json`),
//!    and later hands the very same bytes to the route;
//! 3. builds the key from the declared parts in order
//!    (`400 lock_key_field_missing` when one is absent);
//! 4. acquires as the request's [`RequestOwner`](crate::RequestOwner), so a
//!    nested lock on the same key in the same request re-enters;
//!    a lock held elsewhere is `409 duplicate_submission` on a route that
//!    does not wait, `409 lock_wait_timeout` once a route's wait ran out
//!    (both with `Retry-After`), an
//!    unreachable backend `503 lock_backend_unavailable`;
//! 5. records the grant's [`FencingToken`](crate::FencingToken) (every
//!    key's in [`HeldLocks`](crate::HeldLocks)) for the route to extract,
//!    calls the route on a task of its own, and releases once the route has
//!    answered. A client that hangs up does not cut the route, so the lock
//!    covers everything it does, an idempotency layer inside that runs it
//!    detached included. Inside
//!    [`IdempotencyLayer::in_transaction`](crate::idempotency::IdempotencyLayer::in_transaction)
//!    the release waits until the route's transaction has committed or
//!    rolled back, so the next holder reads what it committed;
//! 6. logs one `dlock.request` event with the outcome (the key at `DEBUG`
//!    only) and puts the [`LockOutcome`](crate::LockOutcome) in the response
//!    extensions.
//!
//! `#[lockable]` runs steps 3–6 through the same code, so a request refused
//! by either gets the same answer.
//!
//! Refusals are responses (see [`Rejection`](crate::Rejection)); the route's
//! own error type passes through unchanged. Before answering a refusal, the
//! layer reads and throws away what is left of the request body, however
//! large, for a bounded time (at most 30 s, and 5 s without a byte; not when
//! the client waits for `100 Continue`), so that a client still sending it
//! reads the answer rather than a reset connection, as nginx's lingering
//! close does.

mod json;
mod key;
mod layer;
mod quota;
mod service;
mod spec;

pub use crate::pipeline::policy::Policy;
pub use layer::LockLayer;
pub use service::RequireLock;
