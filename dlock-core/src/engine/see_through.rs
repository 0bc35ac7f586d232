//! [`SeeThrough`]: a future run inline on the caller's task, and finished on
//! a task of its own when the caller gives up on it, since a command already
//! sent is not undone by dropping its future.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::backend::{BoxFuture, CancellationToken};
use crate::error::{Error, Result};

/// A future seen through to its end, whoever waits for it.
pub(super) struct SeeThrough<T: Send + 'static> {
    future: Option<BoxFuture<'static, Result<T>>>,
    /// Fired when the caller gives up, so that a wait inside ends early.
    cancel: Option<CancellationToken>,
}

impl<T: Send + 'static> SeeThrough<T> {
    /// `future`, told through `cancel` (if any) when its caller is gone.
    pub(super) fn new(future: BoxFuture<'static, Result<T>>, cancel: Option<CancellationToken>) -> Self {
        SeeThrough { future: Some(future), cancel }
    }
}

impl<T: Send + 'static> Future for SeeThrough<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Ready(Err(Error::Internal("polled after it finished".into())));
        };
        let result = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(result)
    }
}

impl<T: Send + 'static> Drop for SeeThrough<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        if let Some(cancel) = &self.cancel {
            cancel.cancel();
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // What it returns (a guard) is dropped there, which releases it.
                runtime.spawn(async move { drop(future.await) });
            }
            Err(_) => {
                tracing::warn!(
                    "a lock command abandoned outside a tokio runtime; a grant in flight is freed by its lease"
                )
            }
        }
    }
}
