//! [`ResponseFuture`]: the future of every dlock service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::borrow::Cow;

use axum::response::Response;
use tracing::Span;

use crate::observe::{self, Face};

/// The boxed future of dlock's services ([`RequireLock`](crate::lock::RequireLock),
/// …); dropping it gives back what the layer took.
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>,
    /// The request's span and what its answer is recorded as.
    observed: Option<Observed>,
}

struct Observed {
    face: Face,
    name: Cow<'static, str>,
    span: Span,
}

impl<E> ResponseFuture<E> {
    /// A request dlock only passes on.
    pub(crate) fn new(future: impl Future<Output = Result<Response, E>> + Send + 'static) -> Self {
        ResponseFuture { inner: Box::pin(future), observed: None }
    }

    /// A request of `face` (a lock named `name`), run in its span and its
    /// answer recorded ([`observe`]). Kept beside the boxed future, not
    /// around it: a future wrapped in another is copied when made, and a
    /// route's future is large.
    pub(crate) fn observed(
        face: Face,
        name: Cow<'static, str>,
        future: impl Future<Output = Result<Response, E>> + Send + 'static,
    ) -> Self {
        let span = observe::span(face, &name);
        ResponseFuture { inner: Box::pin(future), observed: Some(Observed { face, name, span }) }
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(observed) = &this.observed else { return this.inner.as_mut().poll(cx) };
        let answered = {
            let _entered = observed.span.enter();
            std::task::ready!(this.inner.as_mut().poll(cx))
        };
        if let Ok(response) = &answered {
            observe::responded(observed.face, &observed.name, &observed.span, response);
        }
        Poll::Ready(answered)
    }
}
