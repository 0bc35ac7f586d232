//! The one error type of dlock-core.

use std::time::Duration;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// The variants fall in three classes, each with a classification method, so
/// that callers (and the HTTP layer) can map them without matching on every
/// variant:
///
/// * contention — the lock is held by someone else: [`Error::is_contention`]
///   ([`Error::Busy`], [`Error::Timeout`]);
/// * the coordination service failed or could not be reached:
///   [`Error::is_unavailable`] ([`Error::Backend`], [`Error::QuorumUnavailable`]);
/// * the program or its environment is wrong: [`Error::is_misconfigured`]
///   ([`Error::Config`], [`Error::InvalidKey`], [`Error::InvalidArgument`],
///   [`Error::ModeConflict`]);
/// * the storage refused a write fenced by a token a newer holder has
///   overtaken: [`Error::is_stale`] ([`Error::StaleToken`]).
///
/// [`Error::Internal`] is none of these: dlock itself broke a rule it keeps.
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
    /// The storage refused a write (or a fenced read) because a newer holder
    /// of the lock has already used the resource with a higher fencing
    /// token: this holder's lease ran out (a pause, a slow network) and the
    /// lock was granted again. Nothing was written; the caller must not
    /// treat its work as done. Made by the helpers of [`fence`](crate::fence),
    /// which check the token inside the storage, so the refusal holds even
    /// when the holder never noticed it lost the lock.
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
    /// stored record it cannot read back); a bug to report, not a state of
    /// the service or of the caller's program.
    #[error("internal error: {0}")]
    Internal(String),
    /// The acquiring future was dropped before it finished; only seen by
    /// backends, never by a caller of [`Locker::acquire`](crate::Locker::acquire).
    #[error("acquire cancelled")]
    Cancelled,
    /// An idempotency store holds as many live records (or tokens) as its
    /// [`IdempotencyLimits`](crate::idempotency::IdempotencyLimits) allow:
    /// for this caller (`per_scope`), or in total. Nothing was stored; the
    /// same request may succeed once `retry_after` has passed and the
    /// oldest record expired.
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

    /// The service may have carried out the request that failed: it was
    /// sent, and its answer was lost (a response timeout, a connection that
    /// dropped while it was in flight), on this try or an earlier one of
    /// the same request. A connection refused, or down before the request
    /// was sent, did nothing. The engine undoes an acquire that failed this
    /// way.
    ///
    /// A backend marks such an error when it builds it ([`MayHaveRun`]),
    /// so this module knows no backend's error types.
    pub(crate) fn outcome_unknown(&self) -> bool {
        let Error::Backend { source: Some(source), .. } = self else { return false };
        source.is::<MayHaveRun>()
    }

    /// This error, marked as one whose request may have been carried out
    /// ([`outcome_unknown`](Self::outcome_unknown)): for a retry loop whose
    /// earlier try may have run, whatever its last try failed with. An
    /// error that is not [`Error::Backend`] is a definite answer and stays
    /// as it is.
    pub(crate) fn may_have_run(self) -> Error {
        match self {
            Error::Backend { backend, message, source } if !matches!(&source, Some(s) if s.is::<MayHaveRun>()) => {
                Error::Backend { backend, message, source: Some(Box::new(MayHaveRun(source))) }
            }
            other => other,
        }
    }

    /// How long until the same request may succeed, when that is known: what
    /// is left of a Redis restart quarantine (an [`Error::Backend`] made by
    /// [`Error::unavailable_for`]), or when the oldest record of a full
    /// idempotency store expires ([`Error::IdempotencyFull`]). `None` for an
    /// outage nobody can time, and for errors a retry cannot mend. dlock-axum
    /// sends it as `Retry-After`.
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

/// The source of an [`Error::Backend`] whose request may have been carried
/// out: it was sent and its answer was lost, on the last try or an earlier
/// one ([`Error::outcome_unknown`]). It wraps the error's own source, if any.
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
