//! The one error type of dlock-core.

use std::time::Duration;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// Classify with [`is_contention`](Error::is_contention) (the lock is
/// held), [`is_unavailable`](Error::is_unavailable) (the service failed:
/// fail closed), [`is_misconfigured`](Error::is_misconfigured) and
/// [`is_stale`](Error::is_stale) (a fenced write refused), rather than
/// matching every variant. [`Error::Internal`] is none of these: a dlock bug.
///
/// ```
/// use dlock_core::Error;
/// let e = Error::Busy { key: "dlock:{order:42}".into() };
/// assert!(e.is_contention());
/// assert!(!e.is_unavailable());
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock is held by another owner and the caller asked not to wait.
    #[error("lock `{key}` is held by another owner")]
    Busy {
        /// The full lock key.
        key: String,
    },
    /// The lock was still held by another owner when the wait ran out.
    #[error("lock `{key}` was not acquired within {waited:?}")]
    Timeout {
        /// The full lock key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The coordination service failed, timed out or could not be reached.
    #[error("{backend} backend unavailable: {message}")]
    Backend {
        /// Which backend (`memory`, `redis`, `redlock`, `zookeeper`).
        backend: &'static str,
        /// What went wrong, for people.
        message: String,
        /// The underlying error, when there is one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// Fewer than a majority of the RedLock masters answered in time.
    #[error("quorum unavailable: {granted} of {nodes} nodes agreed, {needed} needed")]
    QuorumUnavailable {
        /// How many nodes granted the request.
        granted: usize,
        /// How many nodes were asked.
        nodes: usize,
        /// How many are needed (N/2+1).
        needed: usize,
    },
    /// A configuration value is missing or malformed.
    #[error("invalid configuration: {var}: {reason}")]
    Config {
        /// The environment variable (or option) at fault.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A lock key could not be built (for example it is too long).
    #[error("invalid lock key: {0}")]
    InvalidKey(String),
    /// An argument of a call is out of range: a zero lease, a lock mode the
    /// backend does not support.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument (or option) at fault.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The key is held or awaited in a mode that does not fit the one asked
    /// for: a semaphore asked with another number of permits, a plain lock
    /// asked for as a permit, a shared hold asked to become exclusive.
    /// A mistake of the program (two uses of one key), never contention.
    #[error("lock `{key}`: {reason}")]
    ModeConflict {
        /// The full lock key.
        key: String,
        /// What does not fit, for people.
        reason: String,
    },
    /// The storage ([`fence`](crate::fence)) refused a write or fenced read:
    /// a newer holder has used the resource with a higher token, since this
    /// holder's lease ran out. Nothing was written; the work is not done.
    #[error("fencing token {token} is stale for `{resource}`: token {newest} has already been used")]
    StaleToken {
        /// The fenced resource, as named by the caller.
        resource: String,
        /// The token that was refused.
        token: u64,
        /// The highest token the storage had seen for the resource.
        newest: u64,
    },
    /// dlock broke a rule of its own (a future polled after it finished, a
    /// stored record it cannot read back): a bug to report.
    #[error("internal error: {0}")]
    Internal(String),
    /// The acquiring future was dropped before it finished; only seen by
    /// backends, never by a caller of [`Locker::acquire`](crate::Locker::acquire).
    #[error("acquire cancelled")]
    Cancelled,
    /// An idempotency store is at its
    /// [`IdempotencyLimits`](crate::idempotency::IdempotencyLimits), for this
    /// caller (`per_scope`) or in total. Nothing was stored; retry after
    /// `retry_after`.
    #[error("idempotency store full ({}): retry after {retry_after:?}", if *per_scope { "this caller's records" } else { "all records" })]
    IdempotencyFull {
        /// The caller's cap was reached (else the store's total cap).
        per_scope: bool,
        /// When the oldest counted record (or token) expires.
        retry_after: Duration,
    },
}

impl Error {
    /// The lock is held by someone else ([`Error::Busy`] or [`Error::Timeout`]).
    pub fn is_contention(&self) -> bool {
        matches!(self, Error::Busy { .. } | Error::Timeout { .. })
    }

    /// The coordination service could not answer (fail closed: treat as 503).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Backend { .. } | Error::QuorumUnavailable { .. })
    }

    /// The failed request was sent and its answer lost, on this try or an
    /// earlier one, so it may have been carried out (the engine undoes such
    /// an acquire). Backends mark it ([`MayHaveRun`]).
    pub(crate) fn outcome_unknown(&self) -> bool {
        let Error::Backend { source: Some(source), .. } = self else { return false };
        source.is::<MayHaveRun>()
    }

    /// This error, marked [`outcome_unknown`](Self::outcome_unknown) (only
    /// an [`Error::Backend`]: the others are definite answers).
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn may_have_run(self) -> Error {
        match self {
            Error::Backend { backend, message, source } if !matches!(&source, Some(s) if s.is::<MayHaveRun>()) => {
                Error::Backend { backend, message, source: Some(Box::new(MayHaveRun(source))) }
            }
            other => other,
        }
    }

    /// How long until the same request may succeed, when known: a restart
    /// quarantine's rest ([`Error::unavailable_for`]) or a full store's
    /// ([`Error::IdempotencyFull`]). dlock-axum sends it as `Retry-After`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::Error;
    /// let quarantined = Error::unavailable_for("redis", "restarted", Duration::from_millis(2500));
    /// assert!(quarantined.is_unavailable());
    /// assert_eq!(quarantined.retry_after(), Some(Duration::from_millis(2500)));
    /// assert_eq!(Error::backend("redis", "connection refused").retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::IdempotencyFull { retry_after, .. } => Some(*retry_after),
            Error::Backend { source: Some(source), .. } => source.downcast_ref::<RefusedFor>().map(|r| r.0),
            _ => None,
        }
    }

    /// The storage refused a write whose fencing token a newer holder had
    /// overtaken ([`Error::StaleToken`]): nothing was written.
    ///
    /// ```
    /// use dlock_core::Error;
    /// let e = Error::StaleToken { resource: "stock:42".into(), token: 7, newest: 9 };
    /// assert!(e.is_stale() && !e.is_contention() && !e.is_unavailable());
    /// ```
    pub fn is_stale(&self) -> bool {
        matches!(self, Error::StaleToken { .. })
    }

    /// The program or its environment is misconfigured.
    pub fn is_misconfigured(&self) -> bool {
        matches!(
            self,
            Error::Config { .. } | Error::InvalidKey(_) | Error::InvalidArgument { .. } | Error::ModeConflict { .. }
        )
    }

    /// A backend error with a message and no source.
    pub fn backend(backend: &'static str, message: impl Into<String>) -> Self {
        Error::Backend { backend, message: message.into(), source: None }
    }

    /// A backend that refuses for a known time (a restart quarantine): an
    /// [`Error::Backend`] whose [`retry_after`](Error::retry_after) is
    /// `retry_after`.
    pub fn unavailable_for(backend: &'static str, message: impl Into<String>, retry_after: Duration) -> Self {
        Error::Backend { backend, message: message.into(), source: Some(Box::new(RefusedFor(retry_after))) }
    }

    /// An out-of-range argument, named.
    pub fn invalid_argument(name: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { name, reason: reason.into() }
    }

    /// A [`Error::ModeConflict`] on `key`.
    pub fn mode_conflict(key: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        Error::ModeConflict { key: key.to_string(), reason: reason.into() }
    }

    /// A configuration error naming the variable at fault.
    pub fn config(var: &'static str, reason: impl Into<String>) -> Self {
        Error::Config { var, reason: reason.into() }
    }
}

/// The source of an [`Error::Backend`] that refuses for a known time.
#[derive(Debug)]
struct RefusedFor(Duration);

impl std::fmt::Display for RefusedFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refusing for {} ms more", self.0.as_millis())
    }
}

impl std::error::Error for RefusedFor {}

/// `Result` with dlock's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The source of an [`Error::Backend`] whose request may have run
/// ([`Error::outcome_unknown`]), wrapping the error's own source.
#[derive(Debug)]
pub(crate) struct MayHaveRun(pub(crate) Option<Box<dyn std::error::Error + Send + Sync>>);

impl std::fmt::Display for MayHaveRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(e) => write!(f, "{e} (it may have been carried out)"),
            None => f.write_str("the answer was lost (it may have been carried out)"),
        }
    }
}

impl std::error::Error for MayHaveRun {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_that_a_request_may_have_run_survives_its_retry_and_keeps_the_message() {
        let refused = Error::backend("redis", "cannot reach Redis: connection refused");
        assert!(!refused.outcome_unknown(), "refused before it was sent: it did nothing");
        let marked = refused.may_have_run();
        assert!(marked.outcome_unknown(), "an earlier try of the same request may have run");
        assert_eq!(marked.to_string(), "redis backend unavailable: cannot reach Redis: connection refused");
        assert!(marked.may_have_run().outcome_unknown(), "marking twice keeps one mark");
        let busy = Error::Busy { key: "k".into() }.may_have_run();
        assert!(!busy.outcome_unknown(), "a definite answer stays one");
    }
}
