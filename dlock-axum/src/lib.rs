//! dlock-axum: distributed locks and duplicate-submission protection for axum
//! services.
//!
//! * [`LockLayer`] locks a route on a key built from request fields (JSON
//!   body, query, path, headers) and answers a lost race with
//!   `409 duplicate_submission` (`409 lock_wait_timeout` when a route's wait
//!   ran out).
//! * [`#[lockable]`](lockable) does the same on a handler, from the handler's
//!   own arguments, through the same pipeline; a handler reaches its lock
//!   with [`FencingToken`] and [`HeldLock`] arguments.
//! * [`Rejection`] is every refusal: by default the JSON
//!   `{"error": "<machine code>", "code": <number>, "message": "<text>"}`;
//!   [`RenderRejections`] renders all of them, from every layer and the
//!   macro, in the application's own shape or as RFC 9457 Problem Details.
//! * [`from_env`] connects what the `DLOCK_*` environment variables name, a
//!   [`DlockRuntime`]: the lock engine, the idempotency store and their
//!   settings; [`LockerExt::with_locker`] installs it in every request, in
//!   one line, after the routes, where every layer finds it. [`ready`] is
//!   its readiness probe.
//!
//! Features: `tls` (`rediss://`) and `zookeeper` (`DLOCK_BACKEND=zookeeper`)
//! forward dlock-core's features of those names.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use dlock_axum::{LockLayer, LockerExt};
//!
//! async fn reduce_stock(body: String) -> String { body }
//!
//! let app: Router = Router::new()
//!     .route(
//!         "/stock/reduce",
//!         post(reduce_stock).route_layer(LockLayer::new("product.stock").json("product_id").wait(Duration::from_secs(5))),
//!     )
//!     .with_locker(dlock_axum::from_env().await?);
//! # Ok(()) }
//! ```
//!
//! When the lock service cannot be reached, requests are refused with
//! `503 lock_backend_unavailable` (fail closed), never a 500 or a hang.

#[macro_use]
mod macros;

mod caller;
pub mod future;
mod headers;
pub mod idempotency;
mod install;
mod json_body;
pub mod lock;
mod pipeline;
mod rejection;
mod render;
mod request;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use caller::Caller;
pub use dlock_core;
pub use dlock_core::DlockRuntime;
#[doc = include_str!("lockable.md")]
pub use dlock_macros::lockable;
pub use install::{from_env, installed, ready, LockerExt};
pub use json_body::JsonBody;
pub use lock::LockLayer;
pub use rejection::{Rejection, DEFAULT_DUPLICATE_CODE, DEFAULT_DUPLICATE_MESSAGE};
pub use render::{RenderRejections, Rendered};
pub use request::{FencingToken, HeldLock, HeldLocks, LockOutcome, RequestOwner};

/// The README's Rust blocks, compiled and run as doctests of this crate.
/// Some use the `postgres` feature (`in_transaction`, `PostgresStore`), so
/// they are run with it (`--all-features`, as the README's test command).
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../README.md")]
mod readme {}
