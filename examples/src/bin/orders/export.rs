//! `POST /users/{user}/export`: a semaphore (`#[lockable(permits = 2)]`),
//! at most two exports of one user at once; the third is
//! `429 lock_permits_exhausted` with `Retry-After`.
//!
//! Not every lock backend can keep a semaphore of more than one permit
//! (RedLock cannot: each node counts only the holders that reached it, so
//! three clients can each hold a majority of nodes). On such a backend the
//! service still starts and serves every other route: [`route`] logs one
//! `WARN` naming the route, the backend and why, and the route answers
//! `501 lock_mode_unsupported` as Problem Details, saying why, instead of
//! running exports it cannot bound. A startup that refused the whole
//! service for one route would take the shop down for an export.

use axum::extract::State;
use axum::routing::{post, MethodRouter};
use axum::Json;
use dlock_axum::{lockable, Rejection};
use dlock_core::LockMode;
use dlock_core::Locker;
use serde_json::{json, Value};

use crate::extract::Path;
use crate::App;

/// The route, as logs and answers name it.
const ROUTE: &str = "POST /users/{user}/export";

/// The semaphore's permits: `permits = 2` of [`export`]'s attribute (which
/// takes a literal), kept in step by hand.
const PERMITS: u32 = 2;

/// The export route over `locker`: [`export`] where the backend keeps a
/// semaphore of [`PERMITS`], else a route that refuses every export with
/// `501 lock_mode_unsupported` (logged once here, at `WARN`).
pub(crate) fn route(locker: &Locker) -> MethodRouter<App> {
    match locker.supports(LockMode::permits(PERMITS)) {
        Ok(()) => post(export),
        Err(reason) => {
            let backend = locker.backend_name();
            tracing::warn!(
                route = ROUTE,
                backend,
                %reason,
                "{ROUTE} is not served: the {backend} lock backend cannot keep its semaphore of {PERMITS} permits; \
                 every other route is"
            );
            let refusal = unsupported(backend);
            post(move || std::future::ready(refusal.clone()))
        }
    }
}

/// The answer of the export route on a backend without semaphores:
/// permanent (no `Retry-After`), since only another backend would serve it.
fn unsupported(backend: &str) -> Rejection {
    Rejection::lock_mode_unsupported().with_message(format!(
        "{ROUTE} runs at most {PERMITS} exports of a user at once, and the {backend} lock backend this instance \
         runs on cannot keep that bound; the route is not served here"
    ))
}

/// `POST /users/{user}/export` → `{"user": user, "export": "done"}` after
/// `ORDERS_EXPORT_MS` of work. At most two exports of one user run at once
/// (a semaphore): the third is `429 lock_permits_exhausted`.
#[lockable(key = "export", fields = ["user"], permits = 2, wait_ms = 0)]
pub(crate) async fn export(State(app): State<App>, Path(user): Path<String>) -> Json<Value> {
    tokio::time::sleep(app.export_time).await;
    Json(json!({"user": user, "export": "done"}))
}
