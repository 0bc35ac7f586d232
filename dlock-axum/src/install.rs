//! Putting the lock engine, and the settings of its configuration, where
//! handlers and layers find them.
//!
//! Configuration flows one way: `DLOCK_*` is read once, into
//! [`Config`](dlock_core::Config); [`Dlock::from_config`] keeps what the layers
//! need of it beside the engine, and [`LockerExt::with_locker`] installs the
//! two as one request extension. No layer reads the environment.

use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::Extensions;
use axum::routing::{MethodRouter, Router};
use axum::Extension;
use dlock_core::{Config, Locker};

use crate::lock::body::{BodyLimits, DEFAULT_BODY_READ_TIMEOUT};
use crate::rejection::Rejection;

/// The installed lock engine and the settings the layers take from its
/// configuration: the most body bytes read ([`Config::max_body_bytes`],
/// `DLOCK_MAX_BODY_BYTES`) and the life of idempotency records
/// ([`Config::idempotency_ttl`], `DLOCK_IDEMPOTENCY_TTL_SECS`); beside them,
/// how long a body may take to arrive ([`Dlock::with_body_read_timeout`]).
///
/// [`LockerExt::with_locker`] puts it in every request; [`LockLayer`](crate::LockLayer),
/// `#[lockable]`, [`JsonBody`](crate::JsonBody) and the
/// [idempotency layers](crate::idempotency) read their defaults from it at
/// request time (a setting given to a layer itself wins). It is also an
/// extractor, for handlers that take locks by hand; it rejects with
/// `500 lock_misconfigured` when no engine was installed.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// use axum::{routing::post, Router};
/// use dlock_axum::{Dlock, LockerExt, Rejection};
/// use dlock_core::Config;
///
/// async fn report(dlock: Dlock) -> Result<String, Rejection> {
///     let key = dlock.locker().key("report").build()?;
///     let guard = dlock.locker().try_acquire(&key).await?;
///     Ok(format!("fence {}", guard.fencing_token()))
/// }
///
/// let config = Config::from_env()?; // DLOCK_* read once, here
/// let dlock = Dlock::from_config(config.build().await?, &config);
/// let app: Router = Router::new().route("/report", post(report)).with_locker(dlock);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Dlock {
    locker: Locker,
    max_body_bytes: usize,
    idempotency_ttl: Duration,
    body_read_timeout: Duration,
}

impl Dlock {
    /// `locker` with the settings of [`Config::default`] (64 KiB bodies,
    /// records kept 24 hours).
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    /// let dlock = dlock_axum::Dlock::new(Locker::new(MemoryBackend::new()));
    /// assert_eq!(dlock.max_body_bytes(), 64 * 1024);
    /// ```
    pub fn new(locker: Locker) -> Self {
        Dlock::from_config(locker, &Config::default())
    }

    /// `locker` with the settings of `config` (the engine is usually
    /// `config.build().await?`).
    ///
    /// ```
    /// use dlock_core::{Config, Locker, MemoryBackend};
    /// let config = Config::from_lookup(|var| (var == "DLOCK_MAX_BODY_BYTES").then(|| "100".into())).unwrap();
    /// let dlock = dlock_axum::Dlock::from_config(Locker::new(MemoryBackend::new()), &config);
    /// assert_eq!(dlock.max_body_bytes(), 100);
    /// ```
    pub fn from_config(locker: Locker, config: &Config) -> Self {
        Dlock {
            locker,
            max_body_bytes: config.max_body_bytes,
            idempotency_ttl: config.idempotency_ttl,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
        }
    }

    /// Replaces the most body bytes the layers read (`DLOCK_MAX_BODY_BYTES`).
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    /// let dlock = dlock_axum::Dlock::new(Locker::new(MemoryBackend::new())).with_max_body_bytes(1024);
    /// assert_eq!(dlock.max_body_bytes(), 1024);
    /// ```
    pub fn with_max_body_bytes(mut self, limit: usize) -> Self {
        self.max_body_bytes = limit;
        self
    }

    /// Replaces how long a request body may take to arrive, from the first
    /// read to the last byte (default 30 s). A body still arriving then is
    /// refused with `408 request_timeout` and its connection closed, so a
    /// client that sends slowly or stops cannot hold a task for ever.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{Locker, MemoryBackend};
    /// let dlock = dlock_axum::Dlock::new(Locker::new(MemoryBackend::new())).with_body_read_timeout(Duration::from_secs(5));
    /// assert_eq!(dlock.body_read_timeout(), Duration::from_secs(5));
    /// ```
    pub fn with_body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }

    /// Replaces how long idempotency tokens and stored responses live
    /// (`DLOCK_IDEMPOTENCY_TTL_SECS`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{Locker, MemoryBackend};
    /// let dlock = dlock_axum::Dlock::new(Locker::new(MemoryBackend::new())).with_idempotency_ttl(Duration::from_secs(60));
    /// assert_eq!(dlock.idempotency_ttl(), Duration::from_secs(60));
    /// ```
    pub fn with_idempotency_ttl(mut self, ttl: Duration) -> Self {
        self.idempotency_ttl = ttl;
        self
    }

    /// The engine.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// The engine, by value.
    pub fn into_locker(self) -> Locker {
        self.locker
    }

    /// The most request body bytes a layer reads unless told otherwise.
    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// How long a request body may take to arrive before `408`.
    pub fn body_read_timeout(&self) -> Duration {
        self.body_read_timeout
    }

    /// How long idempotency tokens and stored responses live unless the
    /// [`Idempotency`](crate::idempotency::Idempotency) was given its own.
    pub fn idempotency_ttl(&self) -> Duration {
        self.idempotency_ttl
    }

    /// What [`LockerExt::with_locker`] installed in a request; a bare
    /// [`Locker`] extension (`.layer(Extension(locker))`) counts too, with the
    /// default settings.
    ///
    /// ```
    /// use axum::http::Extensions;
    /// use dlock_axum::Dlock;
    /// use dlock_core::{Locker, MemoryBackend};
    /// let mut ext = Extensions::new();
    /// assert!(Dlock::from_extensions(&ext).is_none());
    /// ext.insert(Dlock::new(Locker::new(MemoryBackend::new())).with_max_body_bytes(10));
    /// assert_eq!(Dlock::from_extensions(&ext).map(|d| d.max_body_bytes()), Some(10));
    /// ```
    pub fn from_extensions(extensions: &Extensions) -> Option<Dlock> {
        match extensions.get::<Dlock>() {
            Some(dlock) => Some(dlock.clone()),
            None => extensions.get::<Locker>().map(|locker| Dlock::new(locker.clone())),
        }
    }
}

impl Dlock {
    /// The body limit of the engine installed in `extensions`, else the
    /// default: read without cloning the engine.
    pub(crate) fn max_body_bytes_in(extensions: &Extensions) -> usize {
        // `Config::default()` builds strings; its limit is taken once.
        static DEFAULT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        match extensions.get::<Dlock>() {
            Some(dlock) => dlock.max_body_bytes,
            None => *DEFAULT.get_or_init(|| Config::default().max_body_bytes),
        }
    }

    /// The bounds of a body read for the engine installed in `extensions`:
    /// `max_bytes` if given (a layer's own), else the engine's; its
    /// read timeout.
    pub(crate) fn body_limits_in(extensions: &Extensions, max_bytes: Option<usize>) -> BodyLimits {
        Dlock::body_limits_of(extensions.get::<Dlock>(), extensions, max_bytes)
    }

    /// [`body_limits_in`](Self::body_limits_in) for a caller that looked up
    /// the installed `Dlock` already (once per request is enough).
    pub(crate) fn body_limits_of(
        installed: Option<&Dlock>,
        extensions: &Extensions,
        max_bytes: Option<usize>,
    ) -> BodyLimits {
        match installed {
            Some(dlock) => {
                BodyLimits { max_bytes: max_bytes.unwrap_or(dlock.max_body_bytes), timeout: dlock.body_read_timeout }
            }
            // A bare `Locker` extension, or none: the defaults.
            None => BodyLimits {
                max_bytes: max_bytes.unwrap_or_else(|| Dlock::max_body_bytes_in(extensions)),
                timeout: DEFAULT_BODY_READ_TIMEOUT,
            },
        }
    }
}

impl From<Locker> for Dlock {
    fn from(locker: Locker) -> Self {
        Dlock::new(locker)
    }
}

impl<S> FromRequestParts<S> for Dlock
where
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Dlock::from_extensions(&parts.extensions).ok_or_else(no_engine)
    }
}

/// Builds the engine from the `DLOCK_*` environment variables
/// ([`Config::from_env`], read once, then [`Config::build`]) and keeps the
/// configuration's settings beside it for the layers.
///
/// # Errors
///
/// [`dlock_core::Error::Config`] naming the variable when one is malformed,
/// [`dlock_core::Error::Backend`] when the backend cannot be reached.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// let dlock = dlock_axum::from_env().await?; // in process unless DLOCK_BACKEND says otherwise
/// println!("locks in {}, bodies read up to {} bytes", dlock.locker().backend_name(), dlock.max_body_bytes());
/// # Ok(()) }
/// ```
pub async fn from_env() -> Result<Dlock, dlock_core::Error> {
    let config = Config::from_env()?;
    Ok(Dlock::from_config(config.build().await?, &config))
}

/// Installs the engine (a [`Dlock`], or a bare [`Locker`] with the default
/// settings) into every request of a router, in one line.
///
/// `#[lockable]` handlers, [`LockLayer`](crate::LockLayer) and
/// [`JsonBody`](crate::JsonBody) look for it in the request extensions.
///
/// **Call it after the routes.** Like every `Router::layer`, it wraps the
/// routes added *before* it; a route added after `.with_locker(..)` finds no
/// engine and answers `500 lock_misconfigured` ("no lock engine installed on
/// this route"). The same holds for `MethodRouter::with_locker`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
/// use axum::{routing::get, Router};
/// use dlock_axum::LockerExt;
///
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hi" }))
///     .with_locker(dlock_axum::from_env().await?); // after the routes
/// # Ok(()) }
/// ```
///
/// `with_locker(x)` is `.layer(Extension(Dlock::from(x)))`.
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
    /// Adds the engine to the extensions of every request this router (or
    /// method router) handles: the routes added so far.
    fn with_locker(self, dlock: impl Into<Dlock>) -> Self;
}

impl<S> LockerExt for Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_locker(self, dlock: impl Into<Dlock>) -> Self {
        self.layer(Extension(dlock.into()))
    }
}

impl<S> LockerExt for MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn with_locker(self, dlock: impl Into<Dlock>) -> Self {
        self.layer(Extension(dlock.into()))
    }
}

/// The installed engine, from the request extensions (see
/// [`Dlock::from_extensions`] for its settings too).
///
/// ```
/// use axum::http::Extensions;
/// use dlock_core::{Locker, MemoryBackend};
/// let mut ext = Extensions::new();
/// assert!(dlock_axum::locker_from_extensions(&ext).is_none());
/// ext.insert(dlock_axum::Dlock::new(Locker::new(MemoryBackend::new())));
/// assert_eq!(dlock_axum::locker_from_extensions(&ext).map(|l| l.backend_name()), Some("memory"));
/// ```
pub fn locker_from_extensions(extensions: &Extensions) -> Option<&Locker> {
    match extensions.get::<Dlock>() {
        Some(dlock) => Some(&dlock.locker),
        None => extensions.get::<Locker>(),
    }
}

/// The rejection for a request that reached dlock without an installed engine.
pub(crate) fn no_engine() -> Rejection {
    tracing::error!(
        "no dlock engine in the request extensions; install one with `.with_locker(..)` after the routes that need it"
    );
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

    async fn name(dlock: Dlock) -> &'static str {
        dlock.locker().backend_name()
    }

    #[tokio::test]
    async fn router_with_locker_reaches_handlers() {
        let app: Router = Router::new().route("/", get(name)).with_locker(Locker::new(MemoryBackend::new()));
        let res = app.oneshot(Request::new(Body::empty())).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn a_bare_locker_extension_is_found_too() {
        let app: Router = Router::new().route("/", get(name)).layer(Extension(Locker::new(MemoryBackend::new())));
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

    /// The mistake the docs warn about: a route added after `with_locker`
    /// is outside its layer.
    #[tokio::test]
    async fn a_route_added_after_with_locker_has_no_engine() {
        let app: Router = Router::new().with_locker(Locker::new(MemoryBackend::new())).route("/", get(name));
        let res = app.oneshot(Request::new(Body::empty())).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
