//! Work a hang-up must not cut (a locked route, a claim, a `BEGIN`) is seen
//! through: it runs in the request's task, and moves to a task of its own
//! when the request goes first (`docs/axum-design.md`).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::response::{IntoResponse, Response};
use tracing::Instrument;

/// How detached work ended, handed from its task back to the request.
pub(crate) enum Settled<E> {
    /// The route answered (or the work answered for it).
    Answer(Response),
    /// The inner service failed; its error passes through.
    Failed(E),
    /// The route panicked; the panic goes on in the request.
    Panicked(Box<dyn Any + Send>),
}

impl<E> Settled<E> {
    /// What a route's future, caught by [`CatchUnwind`], ended with.
    pub(crate) fn of<R: IntoResponse>(answered: std::thread::Result<Result<R, E>>) -> Self {
        match answered {
            Ok(Ok(res)) => Settled::Answer(res.into_response()),
            Ok(Err(e)) => Settled::Failed(e),
            Err(panic) => Settled::Panicked(panic),
        }
    }
}

/// Whether the request that started the work still waits for its answer.
#[derive(Debug, Clone, Default)]
pub(crate) struct Client(Arc<AtomicBool>);

impl Client {
    /// The request's future was dropped (a hang-up, an outer timeout).
    pub(crate) fn is_gone(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Runs `work` to completion and answers what it settled. It runs in the
/// request's own task (no task per request); if the request's future is
/// dropped first, the [`Client`] is marked gone and the rest of `work` moves
/// to a task of its own, as the engine sees an acquire through. Without a
/// Tokio runtime a drop cancels it (what it held is let go by its own drop).
pub(crate) async fn run_detached<E, F>(work: impl FnOnce(Client) -> F) -> Result<Response, E>
where
    E: Send + 'static,
    F: Future<Output = Settled<E>> + Send + 'static,
{
    let client = Client::default();
    let work = Box::pin(work(client.clone()).in_current_span());
    match (SeenThrough { client, work: Some(work) }).await {
        Settled::Answer(response) => Ok(response),
        Settled::Failed(e) => Err(e),
        Settled::Panicked(panic) => std::panic::resume_unwind(panic),
    }
}

/// Work polled in the request's task, handed to a task of its own when the
/// request goes before it ends.
struct SeenThrough<F: Future + Send + 'static> {
    client: Client,
    work: Option<Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> Future for SeenThrough<F>
where
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(work) = self.work.as_mut() else {
            // Not reachable: the request awaits it once.
            return Poll::Pending;
        };
        let settled = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        Poll::Ready(settled)
    }
}

impl<F: Future + Send + 'static> Drop for SeenThrough<F> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        // Before the work is polled again: it asks, to answer nobody.
        self.client.0.store(true, Ordering::Release);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { drop(work.await) });
        }
    }
}

/// Turns a route's panic into a value, so what it held is settled first.
pub(crate) struct CatchUnwind<F>(pub(crate) Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(move || fut.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}
