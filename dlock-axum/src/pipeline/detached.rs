//! Work a hang-up must not cut runs on a task of its own.
//!
//! hyper drops a request's future when its client hangs up. If the work a
//! request started were that future, a hang-up would cut it wherever it
//! stood, and whatever it held would be let go too early:
//!
//! * a route behind [`LockLayer`](crate::LockLayer) would lose its lock while
//!   an idempotency layer inside it still ran the route detached, and the
//!   next request on the same accounts would read balances about to be
//!   overwritten;
//! * an idempotency claim answered `New` with nobody left to run or free it
//!   would block its key for the record's lifetime;
//! * a transaction whose `BEGIN` was cut half-way would go back to the
//!   application's pool still open (sqlx 0.8's `begin` is not cancel-safe).
//!
//! So once a request has what it must settle (a lock, a claim), the rest
//! runs here: on a spawned task that the client cannot cancel, while the
//! request only waits for it. The work is told whether its request is still
//! waiting ([`Client::is_gone`]), so that a claim nobody waits for any more
//! can be given back instead of run.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use crate::rejection::Rejection;

/// How detached work ended, handed from its task back to the request.
pub(crate) enum Settled<E> {
    /// The route answered (or the work answered for it).
    Answer(Response),
    /// The inner service failed; its error passes through.
    Failed(E),
    /// The route panicked; the panic goes on in the request, for an outer
    /// `CatchPanicLayer` to answer.
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

/// Whether the request that started the detached work still waits for its
/// answer.
#[derive(Debug, Clone, Default)]
pub(crate) struct Client(Arc<AtomicBool>);

impl Client {
    /// The request's future was dropped: its client hung up (or an outer
    /// timeout gave up on it). Nobody reads the answer any more.
    pub(crate) fn is_gone(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Marks the [`Client`] gone when the request's future is dropped before
/// the work answered.
struct Waiting(Client);

impl Drop for Waiting {
    fn drop(&mut self) {
        (self.0).0.store(true, Ordering::Release);
    }
}

/// Runs `work` (made with the request's [`Client`]) to completion on its own
/// task, and answers what it settled. Dropping the returned future does not
/// stop `work`: it sees its client gone and goes on.
///
/// Without a Tokio runtime (a test polling the service by hand) `work` runs
/// in place, and a drop cancels it as any future: whatever it held is then
/// let go by its own drop (a lock in the background, a claim with its lease).
pub(crate) async fn run_detached<E, F>(work: impl FnOnce(Client) -> F) -> Result<Response, E>
where
    E: Send + 'static,
    F: Future<Output = Settled<E>> + Send + 'static,
{
    let client = Client::default();
    let waiting = Waiting(client.clone());
    let work = work(client);
    let settled = match tokio::runtime::Handle::try_current() {
        Ok(runtime) => match runtime.spawn(work.in_current_span()).await {
            Ok(settled) => settled,
            // `work` catches the route's panics; one here is dlock's own.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: what the work held ends with its
            // drop (a lock in the background, a claim with its lease).
            Err(_) => return Ok(Rejection::backend_unavailable().into_response()),
        },
        Err(_) => work.await,
    };
    drop(waiting);
    match settled {
        Settled::Answer(response) => Ok(response),
        Settled::Failed(e) => Err(e),
        Settled::Panicked(panic) => std::panic::resume_unwind(panic),
    }
}

/// Polls a route's future and turns a panic into a value, so that what the
/// route held (a lock, a claim, a transaction) is settled before the panic
/// goes on.
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
