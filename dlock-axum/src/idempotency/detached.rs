//! The route of a claimed key or token runs on a task of its own.
//!
//! hyper drops a request's future when its client hangs up. If the route's
//! future were that future, a hang-up after the side effect (the charge was
//! made; the answer was not yet written) would cancel the layer too, and
//! whatever it then did to the claim would be wrong: freeing it runs the
//! side effect again on retry, keeping it blocks the key until its lease
//! ends. So once a claim is taken, the route and everything that settles the
//! claim (store the answer, spend the token) run on a spawned task that the
//! client cannot cancel; the request only waits for it. A retry meanwhile
//! gets `409 in progress`, then the stored answer — as Stripe's API does.

use std::any::Any;
use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use dlock_core::idempotency::{Claim, IdempotencyStore};
use futures_util::future::{select, Either};
use tracing::Instrument;

use crate::rejection::Rejection;

/// How a claimed request ended, handed from its task back to the request.
pub(super) enum Settled<E> {
    /// The route answered (stored, or not, as the layer's rule says).
    Answer(Response),
    /// The inner service failed; its error passes through.
    Failed(E),
    /// The route panicked; the panic goes on in the request, for an outer
    /// `CatchPanicLayer` to answer.
    Panicked(Box<dyn Any + Send>),
}

/// Runs `work` (the route and the claim's settling) to completion on its own
/// task, and answers what it settled. Dropping the returned future does not
/// stop `work`.
///
/// Without a Tokio runtime (a test polling the service by hand) `work` runs
/// in place, and a drop cancels it as any future; its claim then ends with
/// its lease.
pub(super) async fn run_detached<E: Send + 'static>(
    work: impl Future<Output = Settled<E>> + Send + 'static,
) -> Result<Response, E> {
    let settled = match tokio::runtime::Handle::try_current() {
        Ok(runtime) => match runtime.spawn(work.in_current_span()).await {
            Ok(settled) => settled,
            // `work` catches the route's panics; one here is dlock's own.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: the claim ends with its lease.
            Err(_) => return Ok(Rejection::backend_unavailable().into_response()),
        },
        Err(_) => work.await,
    };
    match settled {
        Settled::Answer(response) => Ok(response),
        Settled::Failed(e) => Err(e),
        Settled::Panicked(panic) => std::panic::resume_unwind(panic),
    }
}

/// Polls `route` while the claim's lease is renewed every third of `lease`,
/// so a claim outlives a slow route but not the instance that runs it: once
/// the instance is gone, the lease runs out within `lease`.
pub(super) async fn renewing<T>(
    store: &dyn IdempotencyStore,
    claim: &Claim,
    lease: Duration,
    route: impl Future<Output = T>,
) -> T {
    let renew = async {
        loop {
            tokio::time::sleep(lease / 3).await;
            match store.renew(claim, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(
                        key = crate::headers::log_id(claim.key()),
                        "dlock: an idempotency claim's lease ran out while its route still ran; retries are told \
                         the outcome is unknown"
                    );
                    return std::future::pending::<std::convert::Infallible>().await;
                }
                // A store that failed once may answer the next renewal;
                // the lease bounds how long it may fail.
                Err(e) => {
                    tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: renewing an idempotency claim failed")
                }
            }
        }
    };
    match select(pin!(route), pin!(renew)).await {
        Either::Left((out, _)) => out,
        Either::Right((never, _)) => match never {},
    }
}
