//! [`LockLayer`]: lock a route on a key built from the request.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::time::Duration;
//! use axum::{body::Body, http::Request, routing::post, Router};
//! use dlock_axum::{LockLayer, DlockExt};
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
//!     .with_dlock(Locker::new(MemoryBackend::new()));
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
//! Use `route_layer`, as above: `MethodRouter::layer` also wraps the `405`
//! fallback, which would then read the key and take the lock.
//!
//! The layer builds the key (`400`/`413`/`415` for a bad request) and takes
//! the lock as the request's [`RequestOwner`](crate::RequestOwner): held
//! elsewhere → `409 duplicate_submission` (`409 lock_wait_timeout` after a
//! wait), unreachable → `503 lock_backend_unavailable`. The route then runs
//! to its end under the lock, with its [`FencingToken`](crate::FencingToken),
//! and the response carries a [`LockOutcome`](crate::LockOutcome).
//! `#[lockable]` runs the same pipeline. The steps: `docs/handlers.md`.

mod json;
mod key;
mod layer;
mod quota;
mod service;
mod spec;

pub use crate::pipeline::policy::Policy;
pub use layer::LockLayer;
pub use service::RequireLock;
