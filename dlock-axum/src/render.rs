//! [`RenderRejections`]: one rendering hook for every [`Rejection`], found in
//! its response's extensions (as axum's `WithRejection` is for other errors).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{header, Request};
use axum::response::{IntoResponse, Response};
use tower::{Layer, Service};

use crate::macros::take_ready;
use crate::rejection::Rejection;

type Render = Arc<dyn Fn(&Rejection) -> Response + Send + Sync>;

/// Renders every [`Rejection`] answered inside it with one function, keeping
/// the original's extensions ([`LockOutcome`](crate::LockOutcome)) and `Retry-After`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::{Request, StatusCode}, response::IntoResponse, routing::post, Json, Router};
/// use dlock_axum::{RenderRejections, Rejection};
/// use tower::ServiceExt;
///
/// // The app's own error shape: {"error": {"kind": ..., "detail": ...}}.
/// let render = RenderRejections::new(|r: &Rejection| {
///     (r.status(), Json(serde_json::json!({"error": {"kind": r.error(), "detail": r.message()}}))).into_response()
/// });
/// let app: Router = Router::new()
///     .route("/orders", post(|| async { Rejection::lock_wait_timeout() }))
///     .layer(render);
/// let res = app.oneshot(Request::post("/orders").body(Body::empty()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), StatusCode::CONFLICT);
/// assert_eq!(res.headers()["retry-after"], "1");
/// # }
/// ```
#[derive(Clone)]
pub struct RenderRejections {
    render: Render,
}

impl std::fmt::Debug for RenderRejections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderRejections").finish_non_exhaustive()
    }
}

impl RenderRejections {
    /// Renders with `render`.
    pub fn new(render: impl Fn(&Rejection) -> Response + Send + Sync + 'static) -> Self {
        RenderRejections { render: Arc::new(render) }
    }

    /// Renders as RFC 9457 Problem Details ([`Rejection::to_problem_details`]).
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// let app: Router = Router::new()
    ///     .route("/orders", post(|| async { "placed" }))
    ///     .layer(dlock_axum::RenderRejections::problem_details());
    /// ```
    pub fn problem_details() -> Self {
        Self::new(Rejection::to_problem_details)
    }
}

impl<S> Layer<S> for RenderRejections {
    type Service = Rendered<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Rendered { inner, render: self.render.clone() }
    }
}

/// The service of [`RenderRejections`].
#[derive(Clone)]
pub struct Rendered<S> {
    inner: S,
    render: Render,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Rendered<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendered").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S> Rendered<S> {
    inner_service_accessors!();
}

impl<S, B> Service<Request<B>> for Rendered<S>
where
    S: Service<Request<B>> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let render = self.render.clone();
        let future = inner.call(req);
        Box::pin(async move { future.await.map(|res| rerender(&render, res.into_response())) })
    }
}

/// The response rendered by `render` if it carries a [`Rejection`].
fn rerender(render: &Render, response: Response) -> Response {
    let Some(rejection) = Rejection::of(&response).cloned() else { return response };
    let (parts, _body) = response.into_parts();
    let mut rendered = render(&rejection);
    if let Some(retry_after) = parts.headers.get(header::RETRY_AFTER) {
        rendered.headers_mut().entry(header::RETRY_AFTER).or_insert_with(|| retry_after.clone());
    }
    let mut extensions = parts.extensions;
    // The rendering's own extensions win over the original's.
    extensions.extend(std::mem::take(rendered.extensions_mut()));
    *rendered.extensions_mut() = extensions;
    rendered
}
