//! Taking a request's lock: [`acquire_for_request`], the hold it gives
//! ([`Held`]) and its release, and [`Policy::run_locked`] for a lock taken
//! inside a handler. A failure is the request's [`Refusal`].

use std::future::Future;
use std::time::{Duration, Instant};

use axum::response::Response;
use dlock_core::{LockGuard, LockKey, Locker, Owner};

use super::outage;
use super::policy::Policy;
use super::refusal::Refusal;
use crate::request::LockOutcome;

/// A request that holds its lock.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) guard: LockGuard,
    pub(crate) waited: Duration,
}

/// Takes `key` for a request as `owner` (the request's
/// [`RequestOwner`](crate::RequestOwner)) with the policy's wait, lease and
/// max hold, and logs the grant; a failure is the request's [`Refusal`].
pub(crate) async fn acquire_for_request(
    locker: &Locker,
    owner: Owner,
    key: LockKey,
    policy: &Policy,
) -> Result<Held, Refusal> {
    // An acquire that may not wait has nothing to time: no clock is read.
    let may_wait = !policy.wait.unwrap_or_else(|| locker.options().wait()).is_zero();
    let started = may_wait.then(Instant::now);
    let waited = || started.map_or(Duration::ZERO, |started| started.elapsed());
    match locker.acquire(&key, policy.options(owner)).await {
        Ok(guard) => {
            outage::LOCKS.answered();
            let waited = waited();
            tracing::debug!(
                lock = policy.name(),
                key = %guard.key().log_id(),
                outcome = "acquired",
                fence = guard.fencing_token(),
                waited_ms = waited.as_millis() as u64,
                "dlock.request"
            );
            Ok(Held { guard, waited })
        }
        Err(e) => {
            let waited = waited();
            let unavailable = e.is_unavailable();
            if unavailable {
                outage::LOCKS.refused(&e.to_string());
            } else {
                // A lock found held is an answer too.
                outage::LOCKS.answered();
            }
            Err(Refusal::from_error(e, policy, Some(key), waited).during_outage(unavailable))
        }
    }
}

impl Policy {
    /// Takes `key` as `owner` (a request's [`RequestOwner`](crate::RequestOwner),
    /// so a lock the request already holds re-enters), runs `work` while
    /// holding it, and releases it: the pipeline of [`LockLayer`](crate::LockLayer),
    /// for a lock taken inside a handler.
    ///
    /// # Errors
    ///
    /// The answer [`LockLayer`](crate::LockLayer) would give, with the
    /// [`LockOutcome`] in its extensions: `409` when the lock stays held
    /// (with this policy's message and code), `503` when the lock service is
    /// down, `400` for an invalid key. `work` did not run.
    ///
    /// # Cancellation safety
    ///
    /// Dropping the future releases the lock in the background.
    pub async fn run_locked<F: Future>(
        &self,
        locker: &Locker,
        owner: Owner,
        key: LockKey,
        work: F,
    ) -> Result<(F::Output, LockOutcome), Response> {
        let held = acquire_for_request(locker, owner, key, self).await.map_err(|refusal| refusal.respond(self))?;
        let out = work.await;
        Ok((out, held.release(self).await))
    }
}

impl Held {
    /// Releases the lock once the route has answered, and says what happened
    /// for the response's extensions. A release that fails is logged: the
    /// route's work is done, and the engine retries the release in the
    /// background until it goes through or the lease runs out.
    pub(crate) async fn release(self, policy: &Policy) -> LockOutcome {
        let Held { guard, waited } = self;
        let fencing_token = guard.fencing_token();
        match guard.release().await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                lock = policy.name(),
                fence = fencing_token,
                "the lock ran out before the request finished; another request may have run concurrently"
            ),
            Err(e) => tracing::warn!(lock = policy.name(), error = %e, "release failed; retried in the background"),
        }
        LockOutcome::Acquired { fencing_token, waited }
    }
}
