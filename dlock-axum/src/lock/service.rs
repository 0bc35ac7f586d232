use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::macros::take_ready;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use dlock_core::Locker;
use tower::Service;

use super::key::build_keys;
use super::quota::{NoPermit, Permit};
use super::spec::Spec;
use crate::future::ResponseFuture;
use crate::install::installed;
use crate::pipeline::acquire::{acquire_for_request, Held};
use crate::pipeline::body::{discard, read_body, require_json_content_type, BodyLimits};
use crate::pipeline::detached::{run_detached, CatchUnwind, Settled};
use crate::pipeline::refusal::Refusal;
use crate::pipeline::until_commit::UntilCommit;
use crate::rejection::Rejection;
use crate::request::{HeldLock, RequestOwner};

/// The service of [`LockLayer`](super::LockLayer): the route runs under the
/// request's lock, to its end even if the client hangs up; see the [module docs](super).
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_axum::lock::RequireLock;
///
/// let app: Router = Router::new().route("/orders", post(|| async { "placed" }).route_layer(RequireLock::layer("order.create")));
/// ```
#[derive(Clone)]
pub struct RequireLock<S> {
    inner: S,
    spec: Arc<Spec>,
}

impl<S> RequireLock<S> {
    pub(crate) fn new(inner: S, spec: Arc<Spec>) -> Self {
        RequireLock { inner, spec }
    }

    inner_service_accessors!();
}

impl<S: fmt::Debug> fmt::Debug for RequireLock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequireLock").field("inner", &self.inner).field("name", &self.spec.policy.name).finish()
    }
}

impl<S> Service<Request<Body>> for RequireLock<S>
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
        let inner = take_ready(&mut self.inner);
        let name = self.spec.policy.name.clone();
        ResponseFuture::observed(crate::observe::Face::Lock, name, run(self.spec.clone(), inner, req))
    }
}

async fn run<S>(spec: Arc<Spec>, mut inner: S, req: Request<Body>) -> Result<Response, S::Error>
where
    S: Service<Request<Body>> + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let (mut parts, body) = req.into_parts();
    let mut pending = Some(body);
    let Admitted { held, permit, body } = match admit(&spec, &mut parts, &mut pending).await {
        Ok(admitted) => admitted,
        Err(refusal) => {
            // A body not read yet is drained first, so the client reads the answer.
            if let Some(body) = pending {
                discard(&parts.headers, body, false).await;
            }
            return Ok(refusal.respond(&spec.policy));
        }
    };
    // Inside an in-transaction layer the lock lasts until the transaction ends.
    let until_commit = UntilCommit::of(&parts.extensions);
    let route = inner.call(Request::from_parts(parts, body));
    // The route runs to its end under the lock: a hang-up does not release it.
    run_detached(move |_| async move {
        let answered = CatchUnwind(Box::pin(route)).await.map(|r| r.map(IntoResponse::into_response));
        // A quota permit is given back after the release.
        let outcome = held.release_after_route(spec.policy.clone(), until_commit, permit).await;
        let mut settled = Settled::of(answered);
        if let Settled::Answer(response) = &mut settled {
            response.extensions_mut().insert(outcome);
        }
        settled
    })
    .await
}

/// A request that got its lock: the lock, the quota permit, the body to hand on.
struct Admitted {
    held: Held,
    permit: Option<Permit>,
    body: Body,
}

/// Everything before the inner call. The body to hand on stays in `pending`:
/// as it came, or as the bytes read for the key.
async fn admit(spec: &Spec, parts: &mut Parts, pending: &mut Option<Body>) -> Result<Admitted, Refusal> {
    let installed = installed(&parts.extensions);
    let limits = BodyLimits::of(installed, spec.max_body_bytes);
    let locker: Locker = match (&spec.locker, installed) {
        (Some(l), _) => l.clone(),
        (None, Some(dlock)) => dlock.locker().clone(),
        (None, None) => return Err(Refusal::no_engine()),
    };
    let json = if spec.needs_json() {
        require_json_content_type(&parts.headers).map_err(Refusal::invalid)?;
        let body = pending.take().unwrap_or_default();
        let bytes = read_body(&parts.headers, body, limits).await.map_err(Refusal::invalid)?;
        let json = super::json::read(&bytes, &spec.json_want).map_err(|e| {
            Refusal::invalid(Rejection::invalid_json().with_message(format!("the request body is not valid JSON: {e}")))
        })?;
        *pending = Some(Body::from(bytes));
        Some(json)
    } else {
        None
    };
    let keys = build_keys(spec, &locker, parts, json.as_ref()).await?;
    let owner = RequestOwner::get_or_insert(&mut parts.extensions).map_err(Refusal::no_owner)?;
    let permit = match &spec.quota {
        Some(quota) => Some(quota.take(parts).map_err(|refused| match refused {
            NoPermit::NoCaller => Refusal::invalid(Rejection::lock_caller_missing()),
            NoPermit::OverQuota(over) => Refusal::over_quota(over.rejection(), keys.as_slice().first().cloned()),
        })?),
        None => None,
    };
    let held = acquire_for_request(&locker, owner, keys.as_slice(), &spec.policy).await?;
    HeldLock::set(
        &mut parts.extensions,
        held.guard().owner(),
        HeldLock::of(held.guard()),
        held.guards().iter().map(HeldLock::of),
    );
    Ok(Admitted { held, permit, body: pending.take().unwrap_or_default() })
}
