//! A claim's lease kept alive while its route runs.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use dlock_core::idempotency::{Claim, IdempotencyStore};
use futures_util::future::{select, Either};

/// Polls `route` while renewing the claim every third of `lease`: it outlives
/// a slow route, not a dead instance.
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
