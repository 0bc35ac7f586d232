//! Putting the lock engine where handlers and layers find it.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::Extensions;
use axum::routing::{MethodRouter, Router};
use axum::Extension;
use dlock_core::{Config, Locker};

use crate::rejection::Rejection;

/// Builds the engine from the `DLOCK_*` environment variables
/// ([`Config::from_env`] then [`Config::build`]).
///
/// # Errors
///
/// [`dlock_core::Error::Config`] naming the variable when one is malformed,
/// [`dlock_core::Error::Backend`] when the backend cannot be reached.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// let locker = dlock_axum::from_env().await?; // in process unless DLOCK_BACKEND says otherwise
/// println!("locks in {}", locker.backend_name());
/// # Ok(()) }
/// ```
pub async fn from_env() -> Result<Locker, dlock_core::Error> {
    Config::from_env()?.build().await
}

/// Installs a [`Locker`] into every request of a router, in one line.
///
/// `#[lockable]` handlers and [`LockLayer`](crate::LockLayer)
/// look for a [`Locker`] in the request extensions. One line installs it:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// use axum::{routing::get, Router};
/// use dlock_axum::LockerExt;
///
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hi" }))
///     .with_locker(dlock_axum::from_env().await?);
/// # Ok(()) }
/// ```
///
/// `with_locker(locker)` is `.layer(axum::Extension(locker))`; either works.
///
/// # A `Locker` in the application state
///
/// Keep the engine in your state and implement [`FromRef`](axum::extract::FromRef)
/// so handlers can take it with `State<Locker>`; install the same engine for
/// the layers and macros before calling `with_state`:
///
/// ```
/// use axum::{extract::{FromRef, State}, routing::get, Router};
/// use dlock_axum::LockerExt;
/// use dlock_core::{Locker, MemoryBackend};
///
/// #[derive(Clone)]
/// struct AppState { locker: Locker }
///
/// impl FromRef<AppState> for Locker {
///     fn from_ref(state: &AppState) -> Locker { state.locker.clone() }
/// }
///
/// async fn backend(State(locker): State<Locker>) -> &'static str { locker.backend_name() }
///
/// let state = AppState { locker: Locker::new(MemoryBackend::new()) };
/// let app: Router = Router::new()
///     .route("/backend", get(backend))
///     .with_locker(Locker::from_ref(&state))
///     .with_state(state);
/// ```
pub trait LockerExt: Sized {
    /// Adds `locker` to the extensions of every request this router (or
    /// method router) handles.
    fn with_locker(self, locker: Locker) -> Self;
}

impl<S> LockerExt for Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_locker(self, locker: Locker) -> Self {
        self.layer(Extension(locker))
    }
}

impl<S> LockerExt for MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_locker(self, locker: Locker) -> Self {
        self.layer(Extension(locker))
    }
}

/// The installed engine, from the request extensions.
///
/// ```
/// use axum::http::Extensions;
/// use dlock_core::{Locker, MemoryBackend};
/// let mut ext = Extensions::new();
/// assert!(dlock_axum::locker_from_extensions(&ext).is_none());
/// ext.insert(Locker::new(MemoryBackend::new()));
/// assert_eq!(dlock_axum::locker_from_extensions(&ext).map(|l| l.backend_name()), Some("memory"));
/// ```
pub fn locker_from_extensions(extensions: &Extensions) -> Option<&Locker> {
    extensions.get::<Locker>()
}

/// Extracts the installed [`Locker`], for handlers that take locks by hand.
///
/// Rejects with `500 lock_misconfigured` when no engine was installed.
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_axum::{Engine, LockerExt, Rejection};
/// use dlock_core::{Locker, MemoryBackend};
///
/// async fn handler(Engine(locker): Engine) -> Result<String, Rejection> {
///     let key = locker.key("report").build()?;
///     let guard = locker.try_acquire(&key).await?;
///     Ok(format!("fence {}", guard.fencing_token()))
/// }
///
/// let app: Router = Router::new().route("/report", post(handler)).with_locker(Locker::new(MemoryBackend::new()));
/// ```
#[derive(Debug, Clone)]
pub struct Engine(pub Locker);

impl<S> FromRequestParts<S> for Engine
where
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        locker_from_extensions(&parts.extensions).cloned().map(Engine).ok_or_else(no_engine)
    }
}

/// The rejection for a request that reached dlock without an installed engine.
pub(crate) fn no_engine() -> Rejection {
    tracing::error!("no dlock Locker in the request extensions; install one with `.with_locker(locker)`");
    Rejection::misconfigured().with_message("no lock engine installed on this route")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use dlock_core::MemoryBackend;
    use tower::ServiceExt;

    async fn name(Engine(locker): Engine) -> &'static str {
        locker.backend_name()
    }

    #[tokio::test]
    async fn router_with_locker_reaches_handlers() {
        let app: Router = Router::new().route("/", get(name)).with_locker(Locker::new(MemoryBackend::new()));
        let res = app.oneshot(Request::new(Body::empty())).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn missing_engine_is_a_500_json() {
        let app: Router = Router::new().route("/", get(name));
        let res = app.oneshot(Request::new(Body::empty())).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(res.headers()["content-type"], "application/json");
    }
}
