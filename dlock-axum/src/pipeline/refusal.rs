//! [`Refusal`]: a request refused before its route ran, its [`Rejection`] and
//! its one `dlock.request` event (keys by their
//! [`log_id`](dlock_core::LockKey::log_id); fields: `docs/operations.md`).

use std::borrow::Cow;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use dlock_core::LockKey;

use super::policy::Policy;
use crate::rejection::{whole_seconds, Rejection};
use crate::request::LockOutcome;

/// A request refused before its route ran: the answer, the outcome, the log event.
#[derive(Debug)]
pub(crate) struct Refusal {
    rejection: Rejection,
    outcome: LockOutcome,
    key: Option<LockKey>,
    /// Why, for the log only (engine errors name servers; clients never see it).
    cause: Option<Cow<'static, str>>,
    /// Counted by the outage log: the request's own event is then `DEBUG`.
    in_outage: bool,
}

impl Refusal {
    /// A refusal of the request itself, or of the setup when it is a `5xx`.
    pub(crate) fn invalid(rejection: Rejection) -> Self {
        let outcome = if rejection.status().is_server_error() {
            LockOutcome::Misconfigured
        } else {
            LockOutcome::Invalid { error: rejection.error().to_owned() }
        };
        Refusal { rejection, outcome, key: None, cause: None, in_outage: false }
    }

    /// No engine installed where the request was locked.
    pub(crate) fn no_engine() -> Self {
        Refusal::invalid(Rejection::misconfigured().with_message("no lock engine installed on this route")).with_cause(
            "no dlock engine in the request extensions; install one with `.with_dlock(..)` after the routes that need it",
        )
    }

    /// The OS random source could not make the request's lock owner.
    pub(crate) fn no_owner(err: dlock_core::Error) -> Self {
        Refusal {
            rejection: Rejection::from_lock_error(&err),
            outcome: LockOutcome::Unavailable,
            key: None,
            cause: Some(err.to_string().into()),
            in_outage: false,
        }
    }

    /// The caller already holds as many locks as the layer allows.
    pub(crate) fn over_quota(rejection: Rejection, key: Option<LockKey>) -> Self {
        Refusal { rejection, outcome: LockOutcome::OverQuota, key, cause: None, in_outage: false }
    }

    /// An engine error ([`Rejection::from_lock_error`]): a held lock gets the
    /// policy's message and code (not a wait that ran out: clients tell them
    /// apart), a semaphore route `429`. `key`: the busy key, for the log.
    pub(crate) fn from_error(err: dlock_core::Error, policy: &Policy, key: Option<LockKey>, waited: Duration) -> Self {
        let mut rejection = Rejection::from_lock_error(&err);
        let outcome = if err.is_contention() && policy.is_semaphore() {
            rejection = Rejection::permits_exhausted();
            LockOutcome::Busy { waited }
        } else if err.is_contention() {
            let duplicate = matches!(err, dlock_core::Error::Busy { .. });
            if let Some(message) = policy.message.as_ref().filter(|_| duplicate) {
                rejection = rejection.with_message(message.clone());
            }
            if let Some(code) = policy.code.filter(|_| duplicate) {
                rejection = rejection.with_code(code);
            }
            LockOutcome::Busy { waited }
        } else if matches!(err, dlock_core::Error::InvalidKey(_)) {
            LockOutcome::Invalid { error: rejection.error().to_owned() }
        } else if err.is_misconfigured() {
            LockOutcome::Misconfigured
        } else {
            LockOutcome::Unavailable
        };
        Refusal { rejection, outcome, key, cause: Some(err.to_string().into()), in_outage: false }
    }

    /// A busy lock's refusal says `lease` ([`Policy::holder_lease`]) in
    /// `Retry-After`, rounded up (why: `docs/axum-design.md`); others keep theirs.
    pub(crate) fn lasting_at_most(mut self, lease: Duration) -> Self {
        if matches!(self.outcome, LockOutcome::Busy { .. }) {
            self.rejection = self.rejection.with_retry_after(Some(whole_seconds(lease)));
        }
        self
    }

    /// Marks a refusal the outage log counted: its own event is then `DEBUG`.
    pub(crate) fn during_outage(mut self, in_outage: bool) -> Self {
        self.in_outage = in_outage;
        self
    }

    /// Adds what the log says about the refusal.
    pub(crate) fn with_cause(mut self, cause: impl Into<Cow<'static, str>>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    /// Logs the `dlock.request` event and answers, with the [`LockOutcome`].
    pub(crate) fn respond(self, policy: &Policy) -> Response {
        let Refusal { rejection, outcome, key, cause, in_outage } = self;
        let (lock, status, error) = (policy.name(), rejection.status().as_u16(), rejection.error());
        let cause = cause.as_deref().unwrap_or("");
        match &outcome {
            LockOutcome::Unavailable if in_outage => {
                tracing::debug!(lock, outcome = outcome.as_str(), status, error, cause, "dlock.request")
            }
            LockOutcome::Unavailable => {
                tracing::warn!(lock, outcome = outcome.as_str(), status, error, cause, "dlock.request")
            }
            LockOutcome::Misconfigured => {
                tracing::error!(lock, outcome = outcome.as_str(), status, error, cause, "dlock.request")
            }
            _ => {
                let waited_ms = match &outcome {
                    LockOutcome::Busy { waited } => waited.as_millis() as u64,
                    _ => 0,
                };
                let key = key.as_ref().map(LockKey::log_id);
                tracing::debug!(
                    lock,
                    key = key.map(tracing::field::display),
                    outcome = outcome.as_str(),
                    status,
                    error,
                    waited_ms,
                    "dlock.request"
                )
            }
        }
        let mut response = rejection.into_response();
        response.extensions_mut().insert(outcome);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::Error;

    fn retry_after(refusal: Refusal) -> Option<u32> {
        refusal.rejection.retry_after()
    }

    /// A busy lock's refusal says the lease, rounded up; on a semaphore route too.
    #[test]
    fn a_busy_refusal_says_how_long_the_lock_may_last() {
        let busy = || Error::Busy { key: "dlock:{k}".into() };
        let timeout = || Error::Timeout { key: "dlock:{k}".into(), waited: Duration::from_secs(5) };
        let (mutex, semaphore) = (Policy::new("k"), Policy::new("k").with_mode(dlock_core::LockMode::permits(2)));
        for (lease, seconds) in [(30_000, 30), (2_500, 3), (1, 1), (0, 1), (5_000, 5)] {
            let lease = Duration::from_millis(lease);
            for (err, policy, error) in [
                (busy(), &mutex, "duplicate_submission"),
                (timeout(), &mutex, "lock_wait_timeout"),
                (busy(), &semaphore, "lock_permits_exhausted"),
                (timeout(), &semaphore, "lock_permits_exhausted"),
            ] {
                let refusal = Refusal::from_error(err, policy, None, Duration::ZERO).lasting_at_most(lease);
                assert_eq!(refusal.rejection.error(), error);
                assert_eq!(retry_after(refusal), Some(seconds), "{error} for a lease of {lease:?}");
            }
        }
    }

    /// Refusals that are not about a held lock keep their `Retry-After`.
    #[test]
    fn other_refusals_keep_theirs() {
        let lease = Duration::from_secs(30);
        let policy = Policy::new("k");
        let down = Refusal::from_error(Error::backend("redis", "down"), &policy, None, Duration::ZERO);
        assert_eq!(retry_after(down.lasting_at_most(lease)), Some(1));
        let invalid = Refusal::from_error(Error::InvalidKey("long".into()), &policy, None, Duration::ZERO);
        assert_eq!(retry_after(invalid.lasting_at_most(lease)), None);
        let over = Refusal::over_quota(Rejection::too_many_locks(), None);
        assert_eq!(retry_after(over.lasting_at_most(lease)), Some(1));
        let missing = Refusal::invalid(Rejection::missing_field("json field `id`"));
        assert_eq!(retry_after(missing.lasting_at_most(lease)), None);
    }
}
