//! [`ResponseFuture`]: the future of every dlock service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::Response;

/// The future of [`RequireLock`](crate::lock::RequireLock),
/// [`Idempotent`](crate::idempotency::Idempotent) and
/// [`RequireToken`](crate::idempotency::RequireToken): the layer's work, then
/// the inner service's answer; the inner service's error passes through.
///
/// Boxed, as axum's middleware guide allows for published middleware: the
/// work is an `async` pipeline with several awaits. Dropping it at any point
/// gives back what the layer took (a lock's guard releases in the
/// background; a claimed route runs on to its answer on a task of its own).
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(future: impl Future<Output = Result<Response, E>> + Send + 'static) -> Self {
        ResponseFuture { inner: Box::pin(future) }
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
        self.inner.as_mut().poll(cx)
    }
}
