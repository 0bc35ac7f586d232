//! Putting the [`DlockRuntime`] where every layer finds it, with one lookup.

use axum::extract::Extension;
use axum::http::Extensions;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, Router};
use dlock_core::{Config, DlockRuntime};

use crate::rejection::Rejection;

/// Reads `DLOCK_*` ([`Config::from_env`]) and connects what it names
/// ([`Config::build`]) into one [`DlockRuntime`].
///
/// # Errors
///
/// [`dlock_core::Error::Config`] for a malformed variable,
/// [`dlock_core::Error::Backend`] for a server that cannot be reached.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// let dlock = dlock_axum::from_env().await?; // in process unless DLOCK_BACKEND says otherwise
/// println!("locks in {}, bodies read up to {} bytes", dlock.locker().backend_name(), dlock.max_body_bytes());
/// # Ok(()) }
/// ```
pub async fn from_env() -> Result<DlockRuntime, dlock_core::Error> {
    Config::from_env()?.build().await
}

/// Installs a [`DlockRuntime`] (or a bare [`Locker`](dlock_core::Locker))
/// into every request of a router, for the layers, `#[lockable]`, [`ready`]
/// and handlers (`Extension<DlockRuntime>`).
///
/// **Call it after the routes**: like every `layer`, it wraps the routes added
/// before it; a route added after it answers `500 lock_misconfigured`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// use axum::{routing::post, Extension, Router};
/// use dlock_axum::{DlockRuntime, DlockExt, Rejection};
///
/// async fn report(Extension(dlock): Extension<DlockRuntime>) -> Result<String, Rejection> {
///     let key = dlock.locker().key("report").build()?;
///     let guard = dlock.locker().try_acquire(&key).await?;
///     Ok(format!("fence {}", guard.fencing_token()))
/// }
///
/// let app: Router = Router::new()
///     .route("/report", post(report))
///     .with_dlock(dlock_axum::from_env().await?); // after the routes
/// # Ok(()) }
/// ```
///
/// It is `.layer(Extension(DlockRuntime::from(x)))`. For `State<Locker>`,
/// implement [`FromRef`](axum::extract::FromRef) and install the same runtime:
///
/// ```
/// use axum::{extract::{FromRef, State}, routing::get, Router};
/// use dlock_axum::{DlockRuntime, DlockExt};
/// use dlock_core::{Locker, MemoryBackend};
///
/// #[derive(Clone)]
/// struct AppState { dlock: DlockRuntime }
///
/// impl FromRef<AppState> for Locker {
///     fn from_ref(state: &AppState) -> Locker { state.dlock.locker().clone() }
/// }
///
/// async fn backend(State(locker): State<Locker>) -> &'static str { locker.backend_name() }
///
/// let state = AppState { dlock: DlockRuntime::new(Locker::new(MemoryBackend::new())) };
/// let app: Router = Router::new()
///     .route("/backend", get(backend))
///     .with_dlock(state.dlock.clone())
///     .with_state(state);
/// ```
pub trait DlockExt: Sized {
    /// Adds the runtime to every request of the routes added so far.
    fn with_dlock(self, dlock: impl Into<DlockRuntime>) -> Self;
}

impl<S> DlockExt for Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_dlock(self, dlock: impl Into<DlockRuntime>) -> Self {
        self.layer(Extension(dlock.into()))
    }
}

impl<S> DlockExt for MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_dlock(self, dlock: impl Into<DlockRuntime>) -> Self {
        self.layer(Extension(dlock.into()))
    }
}

/// The runtime [`DlockExt::with_dlock`] installed in a request.
///
/// ```
/// use axum::http::Extensions;
/// use dlock_axum::DlockRuntime;
/// use dlock_core::{Locker, MemoryBackend};
/// let mut ext = Extensions::new();
/// assert!(dlock_axum::installed(&ext).is_none());
/// ext.insert(DlockRuntime::new(Locker::new(MemoryBackend::new())).with_max_body_bytes(10));
/// assert_eq!(dlock_axum::installed(&ext).map(|d| d.max_body_bytes()), Some(10));
/// ```
pub fn installed(extensions: &Extensions) -> Option<&DlockRuntime> {
    extensions.get::<DlockRuntime>()
}

/// The rejection for a request that reached dlock without an installed runtime.
pub(crate) fn no_engine() -> Rejection {
    tracing::error!(
        "no dlock runtime in the request extensions; install one with `.with_dlock(..)` after the routes that need it"
    );
    Rejection::misconfigured().with_message("no lock engine installed on this route")
}

/// A readiness probe ([`DlockRuntime::readiness`]): `200` when the installed
/// runtime's lock backend (not in a restart quarantine), idempotency store
/// and [`also_check`](DlockRuntime::also_check) stores all answer, else `503`:
///
/// ```json
/// {"ready": false, "checks": [{"part": "locks", "backend": "redis", "ok": false, "problem": "…"}]}
/// ```
///
/// A store given only to a layer (`in_transaction`) is checked once the runtime has it:
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(app_pool: sqlx::PgPool) -> Result<(), dlock_core::Error> {
/// use std::sync::Arc;
/// use axum::{routing::{get, post}, Router};
/// use dlock_axum::{idempotency::IdempotencyLayer, DlockExt};
/// use dlock_core::idempotency::PostgresStore;
///
/// let wallet = PostgresStore::with_pool(app_pool, "wallet").await?;
/// // `/ready` now fails while the wallet's database does not answer.
/// let dlock = dlock_axum::from_env().await?.with_idempotency_store(Arc::new(wallet.clone()));
/// let app: Router = Router::new()
///     .route("/transfers", post(|| async { "done" }).layer(IdempotencyLayer::new().in_transaction(wallet)))
///     .route("/ready", get(dlock_axum::ready))
///     .with_dlock(dlock);
/// # Ok(()) }
/// ```
///
/// It takes no lock and writes nothing; without a runtime it is a `500`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::get, Router};
/// use dlock_axum::DlockExt;
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
///
/// let app: Router = Router::new().route("/ready", get(dlock_axum::ready)).with_dlock(Locker::new(MemoryBackend::new()));
/// let res = app.oneshot(Request::get("/ready").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// # }
/// ```
pub async fn ready(extensions: Extensions) -> Response {
    let Some(dlock) = installed(&extensions) else {
        return no_engine().into_response();
    };
    let readiness = dlock.readiness().await;
    let checks: Vec<serde_json::Value> = readiness
        .checks()
        .iter()
        .map(|check| {
            let mut json = serde_json::json!({ "part": check.part(), "backend": check.backend(), "ok": check.is_ok() });
            if let Some(problem) = check.problem() {
                json["problem"] = problem.into();
            }
            json
        })
        .collect();
    let status = match readiness.is_ready() {
        true => axum::http::StatusCode::OK,
        false => axum::http::StatusCode::SERVICE_UNAVAILABLE,
    };
    let body = serde_json::json!({ "ready": readiness.is_ready(), "checks": checks }).to_string();
    let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
    (status, json, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use dlock_core::{Locker, MemoryBackend};
    use tower::ServiceExt;

    async fn name(Extension(dlock): Extension<DlockRuntime>) -> &'static str {
        dlock.locker().backend_name()
    }

    #[tokio::test]
    async fn router_with_dlock_reaches_handlers() {
        let app: Router = Router::new().route("/", get(name)).with_dlock(Locker::new(MemoryBackend::new()));
        let res = app.oneshot(Request::new(Body::empty())).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn without_a_runtime_the_probe_is_a_500_json() {
        let app: Router = Router::new().route("/ready", get(ready));
        let res = app.oneshot(Request::get("/ready").body(Body::empty()).expect("request")).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(res.headers()["content-type"], "application/json");
    }

    /// A route added after `with_dlock` is outside its layer.
    #[tokio::test]
    async fn a_route_added_after_with_dlock_has_no_runtime() {
        let app: Router = Router::new().with_dlock(Locker::new(MemoryBackend::new())).route("/ready", get(ready));
        let res = app.oneshot(Request::get("/ready").body(Body::empty()).expect("request")).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
