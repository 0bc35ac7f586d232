//! Taking a request's lock ([`acquire_for_request`]), the [`Held`] lock and
//! its release, and [`Policy::run_locked`] inside a handler.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::response::Response;
use dlock_core::{LockGuard, LockKey, Locker, MultiGuard, Owner};

use super::outage;
use super::policy::Policy;
use super::refusal::Refusal;
use super::until_commit::UntilCommit;
use crate::request::LockOutcome;

/// A request that holds its lock, or its locks.
#[derive(Debug)]
pub(crate) struct Held {
    guards: Guards,
    pub(crate) waited: Duration,
}

/// What a request holds: one key, or a set taken all or none.
#[derive(Debug)]
enum Guards {
    One(LockGuard),
    /// `primary`: the route's first declared key's place in the (key-ordered) set.
    All {
        set: MultiGuard,
        primary: usize,
    },
}

impl Held {
    /// The guard of the route's first declared key: the lock the route sees.
    pub(crate) fn guard(&self) -> &LockGuard {
        match &self.guards {
            Guards::One(guard) => guard,
            // `primary` was found in this very set when it was taken.
            Guards::All { set, primary } => &set.guards()[*primary],
        }
    }
}

/// Takes `keys` as `owner` by the policy, and logs the grant; several keys
/// all or none, in key order ([`Locker::acquire_all`]), within one wait.
pub(crate) async fn acquire_for_request(
    locker: &Locker,
    owner: Owner,
    keys: &[LockKey],
    policy: &Policy,
) -> Result<Held, Refusal> {
    // No clock read for an acquire that may not wait.
    let may_wait = !policy.wait.unwrap_or_else(|| locker.options().wait()).is_zero();
    let started = may_wait.then(Instant::now);
    let waited = || started.map_or(Duration::ZERO, |started| started.elapsed());
    let taken = match keys {
        [key] => locker.acquire(key, policy.options(owner)).await.map(Guards::One),
        _ => acquire_set(locker, owner, keys, policy).await,
    };
    match taken {
        Ok(guards) => {
            outage::LOCKS.answered();
            let held = Held { guards, waited: waited() };
            let guard = held.guard();
            tracing::debug!(
                lock = policy.name(),
                key = %guard.key().log_id(),
                outcome = "acquired",
                fence = guard.fencing_token(),
                waited_ms = held.waited.as_millis() as u64,
                "dlock.request"
            );
            Ok(held)
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
            let busy = busy_key(&e, keys);
            Err(Refusal::from_error(e, policy, busy, waited)
                .during_outage(unavailable)
                .lasting_at_most(policy.holder_lease(locker)))
        }
    }
}

/// Several keys, all or none, each in the policy's mode.
async fn acquire_set(locker: &Locker, owner: Owner, keys: &[LockKey], policy: &Policy) -> dlock_core::Result<Guards> {
    let set = locker.acquire_all(keys.iter().map(|key| (key, policy.mode)), policy.options(owner)).await?;
    let primary = keys
        .first()
        .and_then(|first| set.guards().iter().position(|guard| guard.key() == first))
        .ok_or_else(|| dlock_core::Error::Internal("acquire_all returned a set without the first key asked".into()))?;
    Ok(Guards::All { set, primary })
}

/// The key a refusal's log line names: the one key, or the busy one of a set.
fn busy_key(err: &dlock_core::Error, keys: &[LockKey]) -> Option<LockKey> {
    match (keys, err) {
        ([key], _) => Some(key.clone()),
        (_, dlock_core::Error::Busy { key } | dlock_core::Error::Timeout { key, .. }) => {
            keys.iter().find(|k| k.as_str() == key).cloned()
        }
        _ => None,
    }
}

impl Policy {
    /// Takes `key` as `owner` (a [`RequestOwner`](crate::RequestOwner)), runs
    /// `work` holding it, and releases it: [`LockLayer`](crate::LockLayer)'s
    /// pipeline, inside a handler.
    ///
    /// # Errors
    ///
    /// [`LockLayer`](crate::LockLayer)'s answer (`409`, `503`, `400`), with its
    /// [`LockOutcome`]; `work` did not run.
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
        self.run_holding(locker, owner, key, |_| work).await
    }

    /// [`run_locked`](Self::run_locked), with `work` made from the [`HeldLock`](crate::HeldLock).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use dlock_axum::lock::Policy;
    /// use dlock_core::{Locker, MemoryBackend, Owner};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let policy = Policy::new("product.stock");
    /// let key = locker.key(policy.name()).part(42).build()?;
    /// let done = policy.run_holding(&locker, Owner::random()?, key, |held| async move { held.fencing_token().0 }).await;
    /// assert!(matches!(done, Ok((token, _)) if token > 0));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`run_locked`](Self::run_locked): `work` is not called.
    ///
    /// # Cancellation safety
    ///
    /// Dropping the future releases the lock in the background.
    pub async fn run_holding<W, F>(
        &self,
        locker: &Locker,
        owner: Owner,
        key: LockKey,
        work: W,
    ) -> Result<(F::Output, LockOutcome), Response>
    where
        W: FnOnce(crate::HeldLock) -> F,
        F: Future,
    {
        let span = crate::observe::span(crate::observe::Face::Lock, self.name());
        let run = async {
            let held = acquire_for_request(locker, owner, std::slice::from_ref(&key), self).await;
            let held = match held {
                Ok(held) => held,
                Err(refusal) => {
                    let response = refusal.respond(self);
                    crate::observe::responded(
                        crate::observe::Face::Lock,
                        self.name(),
                        &tracing::Span::current(),
                        &response,
                    );
                    return Err(response);
                }
            };
            let out = work(crate::HeldLock::of(held.guard())).await;
            let outcome = held.release(self).await;
            crate::observe::locked(&tracing::Span::current(), &outcome);
            Ok((out, outcome))
        };
        tracing::Instrument::instrument(run, span).await
    }
}

impl Held {
    /// What the response's extensions say of this hold.
    pub(crate) fn outcome(&self) -> LockOutcome {
        LockOutcome::Acquired { fencing_token: self.guard().fencing_token(), waited: self.waited }
    }

    /// Every guard of the hold: the one key, or the set in key order.
    pub(crate) fn guards(&self) -> &[LockGuard] {
        match &self.guards {
            Guards::One(guard) => std::slice::from_ref(guard),
            Guards::All { set, .. } => set.guards(),
        }
    }

    /// Releases the lock, or hands the release to the route's transaction;
    /// `after` (a quota permit) is let go after it.
    pub(crate) async fn release_after_route<T: Send + 'static>(
        self,
        policy: Policy,
        until_commit: Option<UntilCommit>,
        after: T,
    ) -> LockOutcome {
        let outcome = self.outcome();
        let release = async move {
            self.release(&policy).await;
            drop(after);
        };
        match until_commit {
            Some(until_commit) => until_commit.keep(Box::pin(release)),
            None => release.await,
        }
        outcome
    }

    /// Releases the lock; a failed release is logged (the engine retries it).
    pub(crate) async fn release(self, policy: &Policy) -> LockOutcome {
        let outcome = self.outcome();
        let fencing_token = self.guard().fencing_token();
        let released = match self.guards {
            Guards::One(guard) => guard.release().await,
            Guards::All { set, .. } => set.release().await,
        };
        match released {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                lock = policy.name(),
                fence = fencing_token,
                "the lock ran out before the request finished; another request may have run concurrently"
            ),
            Err(e) => tracing::warn!(lock = policy.name(), error = %e, "release failed; retried in the background"),
        }
        outcome
    }
}
