use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{header, Request};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use dlock_core::{AcquireOptions, LockKey, Locker};
use http_body_util::BodyExt;
use std::time::Instant;
use tower::Service;

use super::key::build_key;
use super::layer::Spec;
use super::quota::Permit;
use crate::engine::no_engine;
use crate::rejection::Rejection;
use crate::request::{FencingToken, LockOutcome, RequestOwner};

/// The service of [`LockLayer`](super::LockLayer): takes the request's lock,
/// calls the inner service while holding it, and releases it once the inner
/// service has answered.
#[derive(Clone)]
pub struct Lock<S> {
    inner: S,
    spec: Arc<Spec>,
}

impl<S> Lock<S> {
    pub(crate) fn new(inner: S, spec: Arc<Spec>) -> Self {
        Lock { inner, spec }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, by value.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for Lock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock").field("inner", &self.inner).field("name", &self.spec.name).finish()
    }
}

/// The future of [`Lock`]: read the body if the key needs it, acquire, call
/// the inner service, release.
///
/// Dropping it at any point gives the lock back (the guard's `Drop` releases
/// in the background).
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>,
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S> Service<Request<Body>> for Lock<S>
where
    S: Service<Request<Body>> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone may not be ready; the instance that was polled ready goes
        // with this request (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture { inner: Box::pin(run(self.spec.clone(), inner, req)) }
    }
}

/// A refusal made before the inner service is called.
struct Refusal {
    rejection: Rejection,
    outcome: LockOutcome,
    key: Option<LockKey>,
}

impl Refusal {
    fn invalid(rejection: Rejection) -> Self {
        let outcome = if rejection.status().is_server_error() {
            LockOutcome::Misconfigured
        } else {
            LockOutcome::Invalid { error: rejection.error().to_owned() }
        };
        Refusal { rejection, outcome, key: None }
    }
}

async fn run<S>(spec: Arc<Spec>, mut inner: S, req: Request<Body>) -> Result<Response, S::Error>
where
    S: Service<Request<Body>>,
    S::Response: IntoResponse,
{
    let (mut parts, body) = req.into_parts();
    let Admitted { guard, permit, body, waited } = match acquire_for(&spec, &mut parts, body).await {
        Ok(admitted) => admitted,
        Err(refusal) => {
            log_refusal(&spec, &parts, &refusal);
            let mut response = refusal.rejection.into_response();
            response.extensions_mut().insert(refusal.outcome);
            return Ok(response);
        }
    };
    let req = Request::from_parts(parts, body);
    let fencing_token = guard.fencing_token();
    tracing::info!(
        lock = %spec.name, key = %guard.key(), outcome = "acquired", fence = fencing_token,
        waited_ms = waited.as_millis() as u64, method = %req.method(), path = req.uri().path(), "dlock.request"
    );
    // If this future is dropped while the inner service runs, `guard` is
    // dropped with it and releases in the background.
    let result = inner.call(req).await.map(IntoResponse::into_response);
    let key = guard.key().clone();
    match guard.release().await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            lock = %spec.name, key = %key, fence = fencing_token,
            "the lock ran out before the request finished; another request may have run concurrently"
        ),
        Err(e) => tracing::warn!(lock = %spec.name, key = %key, error = %e, "release failed; the lease frees the lock"),
    }
    // The permit, if the layer caps holds per principal, is given back after
    // the release.
    drop(permit);
    result.map(|mut response| {
        response.extensions_mut().insert(LockOutcome::Acquired { fencing_token, waited });
        response
    })
}

/// A request that got its lock: the guard, the quota permit if any, the body
/// to hand on (read already when the key needed it), how long it waited.
struct Admitted {
    guard: dlock_core::LockGuard,
    permit: Option<Permit>,
    body: Body,
    waited: Duration,
}

/// Everything before the inner call: find the engine, read the body if
/// needed, build the key, acquire.
async fn acquire_for(spec: &Spec, parts: &mut Parts, body: Body) -> Result<Admitted, Refusal> {
    let locker: Locker = match &spec.locker {
        Some(l) => l.clone(),
        None => parts.extensions.get::<Locker>().cloned().ok_or_else(|| Refusal::invalid(no_engine()))?,
    };
    let (body, json) = if spec.needs_json() {
        let limit = spec.max_body_bytes().map_err(|e| {
            tracing::error!(error = %e, "dlock: invalid body limit");
            Refusal::invalid(Rejection::misconfigured())
        })?;
        let bytes = read_body(&parts.headers, body, limit).await.map_err(Refusal::invalid)?;
        let json = super::json::read(&bytes, &spec.json_want).map_err(|e| {
            Refusal::invalid(Rejection::invalid_json().with_message(format!("the request body is not valid JSON: {e}")))
        })?;
        (Body::from(bytes), Some(json))
    } else {
        (body, None)
    };
    let key = build_key(spec, &locker, parts, json.as_ref()).await.map_err(Refusal::invalid)?;
    let unavailable = |e: dlock_core::Error| {
        tracing::warn!(error = %e, "dlock: no lock owner");
        Refusal { rejection: Rejection::from_lock_error(&e), outcome: LockOutcome::Unavailable, key: None }
    };
    let owner = RequestOwner::get_or_insert(&mut parts.extensions).map_err(unavailable)?;
    let mut opts = AcquireOptions::new().owner(owner);
    if let Some(wait) = spec.wait {
        opts = opts.wait(wait);
    }
    if let Some(lease) = spec.lease {
        opts = opts.lease(lease);
    }
    if let Some(max_hold) = spec.max_hold {
        opts = opts.max_hold(max_hold);
    }
    let permit = match &spec.quota {
        Some(quota) => Some(quota.take(&parts.headers).map_err(|over| {
            let rejection = Rejection::too_many_locks().with_message(format!(
                "the requests with this {} header already hold {} locks here; retry when one has finished",
                over.header, over.max
            ));
            Refusal { rejection, outcome: LockOutcome::OverQuota, key: Some(key.clone()) }
        })?),
        None => None,
    };
    // An acquire that may not wait has nothing to time: no clock is read.
    let may_wait = !spec.wait.unwrap_or_else(|| locker.options().wait()).is_zero();
    let started = may_wait.then(Instant::now);
    let waited = || started.map_or(Duration::ZERO, |started| started.elapsed());
    match locker.acquire(&key, opts).await {
        Ok(guard) => {
            FencingToken::set(&mut parts.extensions, guard.owner(), guard.fencing_token());
            Ok(Admitted { guard, permit, body, waited: waited() })
        }
        Err(e) => {
            let waited = waited();
            let mut rejection = Rejection::from_lock_error(&e);
            let outcome = if e.is_contention() {
                if let Some(message) = &spec.message {
                    rejection = rejection.with_message(message.clone());
                }
                if let Some(code) = spec.code {
                    rejection = rejection.with_code(code);
                }
                LockOutcome::Busy { waited }
            } else if e.is_misconfigured() && !matches!(e, dlock_core::Error::InvalidKey(_)) {
                tracing::error!(key = %key, error = %e, "dlock: acquire refused by configuration");
                LockOutcome::Misconfigured
            } else if matches!(e, dlock_core::Error::InvalidKey(_)) {
                LockOutcome::Invalid { error: rejection.error().to_owned() }
            } else {
                tracing::warn!(key = %key, error = %e, "dlock: lock service unavailable; refusing the request");
                LockOutcome::Unavailable
            };
            Err(Refusal { rejection, outcome, key: Some(key) })
        }
    }
}

/// Reads at most `limit` bytes, refusing up front when `Content-Length`
/// already says the body is larger.
///
/// Most bodies arrive in one frame, which is kept as it is: no copy and no
/// buffer list (`BodyExt::collect` makes both for every body).
async fn read_body(headers: &axum::http::HeaderMap, mut body: Body, limit: usize) -> Result<Bytes, Rejection> {
    let too_large =
        || Rejection::payload_too_large().with_message(format!("the request body is larger than {limit} bytes"));
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            tracing::debug!(error = %e, "dlock: reading the request body failed");
            Rejection::body_unreadable()
        })?;
        // Trailers carry no JSON.
        let Ok(data) = frame.into_data() else { continue };
        len += data.len();
        if len > limit {
            return Err(too_large());
        }
        match joined.as_mut() {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut buf = BytesMut::with_capacity(len);
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

fn log_refusal(spec: &Spec, parts: &Parts, refusal: &Refusal) {
    let (method, path) = (&parts.method, parts.uri.path());
    let key = refusal.key.as_ref().map(|k| k.as_str()).unwrap_or("");
    let outcome = refusal.outcome.as_str();
    let status = refusal.rejection.status().as_u16();
    let error = refusal.rejection.error();
    match &refusal.outcome {
        LockOutcome::Busy { waited } => tracing::info!(
            lock = %spec.name, key, outcome, status, error, waited_ms = waited.as_millis() as u64, %method, path, "dlock.request"
        ),
        LockOutcome::Invalid { .. } | LockOutcome::OverQuota => {
            tracing::info!(lock = %spec.name, key, outcome, status, error, %method, path, "dlock.request")
        }
        LockOutcome::Unavailable => {
            tracing::warn!(lock = %spec.name, key, outcome, status, error, %method, path, "dlock.request")
        }
        _ => tracing::error!(lock = %spec.name, key, outcome, status, error, %method, path, "dlock.request"),
    }
}
