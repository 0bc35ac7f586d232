//! dlock-axum: distributed locks and duplicate-submission protection for axum.
//!
//! * [`LockLayer`] locks a route on a key built from request fields; a lost
//!   race is `409 duplicate_submission` (`409 lock_wait_timeout` after a wait).
//! * [`#[lockable]`](lockable) does the same on a handler, from its arguments;
//!   [`FencingToken`] and [`HeldLock`] arguments reach its lock.
//! * [`Rejection`] is every refusal, by default the JSON
//!   `{"error": "<machine code>", "code": <number>, "message": "<text>"}`;
//!   [`RenderRejections`] renders them all in the app's shape or as RFC 9457.
//! * [`from_env`] connects what `DLOCK_*` names into a [`DlockRuntime`];
//!   [`DlockExt::with_dlock`] installs it after the routes; [`ready`] probes it.
//! * [`idempotency`]: one-time tokens and `Idempotency-Key`.
//!
//! Features `tls`, `zookeeper`, `postgres` (also
//! `IdempotencyLayer::in_transaction`) and `uuid` forward dlock-core's.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use dlock_axum::{LockLayer, DlockExt};
//!
//! async fn reduce_stock(body: String) -> String { body }
//!
//! let app: Router = Router::new()
//!     .route(
//!         "/stock/reduce",
//!         post(reduce_stock).route_layer(LockLayer::new("product.stock").json("product_id").wait(Duration::from_secs(5))),
//!     )
//!     .with_dlock(dlock_axum::from_env().await?);
//! # Ok(()) }
//! ```
//!
//! An unreachable lock service is `503 lock_backend_unavailable` (fail
//! closed), never a 500 or a hang.

#[macro_use]
mod macros;

mod caller;
pub mod future;
mod headers;
pub mod idempotency;
mod install;
mod json_body;
pub mod lock;
mod observe;
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
pub use install::{from_env, installed, ready, DlockExt};
pub use json_body::JsonBody;
pub use lock::LockLayer;
pub use rejection::{Rejection, DEFAULT_DUPLICATE_CODE, DEFAULT_DUPLICATE_MESSAGE};
pub use render::{RenderRejections, Rendered};
pub use request::{FencingToken, HeldLock, HeldLocks, LockOutcome, RequestOwner};

/// The README's Rust blocks, and those of the `docs/` pages below, run as
/// doctests (with `--all-features`: some use `postgres`).
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../README.md")]
mod readme {}

/// `docs/handlers.md`: `#[lockable]` and `LockLayer`.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../docs/handlers.md")]
mod docs_handlers {}

/// `docs/idempotency.md`: the idempotency chapter.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../docs/idempotency.md")]
mod docs_idempotency {}

/// `docs/core-api.md`: `dlock-core`'s `Locker` without HTTP.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../docs/core-api.md")]
mod docs_core_api {}
