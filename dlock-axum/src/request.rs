//! What dlock leaves in a request and its response: the request's lock owner,
//! the fencing token of the lock it holds, and the outcome for logs.

use std::fmt;
use std::time::Duration;

use axum::http::Extensions;
use dlock_core::Owner;

/// The lock owner of one request, kept in the request extensions.
///
/// Every lock taken while handling a request is taken as this owner, so a
/// nested lock on the same key (a locked handler behind a [`LockLayer`](crate::LockLayer),
/// two layers) re-enters instead of deadlocking.
///
/// ```
/// use axum::http::Extensions;
/// use dlock_axum::RequestOwner;
/// let mut ext = Extensions::new();
/// let a = RequestOwner::get_or_insert(&mut ext).unwrap();
/// let b = RequestOwner::get_or_insert(&mut ext).unwrap();
/// assert_eq!(a, b);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOwner(pub Owner);

impl RequestOwner {
    /// The request's owner, created (from the OS random source) and stored on
    /// first use.
    ///
    /// # Errors
    ///
    /// [`dlock_core::Error::Backend`] when the OS random source fails.
    pub fn get_or_insert(extensions: &mut Extensions) -> Result<Owner, dlock_core::Error> {
        if let Some(RequestOwner(owner)) = extensions.get::<RequestOwner>() {
            return Ok(owner.clone());
        }
        let owner = Owner::random()?;
        extensions.insert(RequestOwner(owner.clone()));
        Ok(owner)
    }
}

/// The fencing token of the lock this request holds, in the request
/// extensions for the handler: pass it to the storage you protect so it can
/// refuse writes from a holder whose lease already ran out.
///
/// ```
/// use axum::Extension;
/// use dlock_axum::FencingToken;
/// async fn handler(Extension(FencingToken(fence)): Extension<FencingToken>) -> String {
///     format!("writing with fence {fence}")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

/// What happened to the lock of a request; [`LockLayer`](crate::LockLayer)
/// puts it in the response extensions so an access log can print it.
///
/// ```
/// use dlock_axum::LockOutcome;
/// assert_eq!(LockOutcome::Busy { waited: Default::default() }.as_str(), "busy");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockOutcome {
    /// The lock was taken and the handler ran.
    Acquired {
        /// The grant's fencing token.
        fencing_token: u64,
        /// How long the request waited for the lock.
        waited: Duration,
    },
    /// Someone else held the lock until the wait ran out: `409`.
    Busy {
        /// How long the request waited.
        waited: Duration,
    },
    /// The lock service could not be reached: `503`.
    Unavailable,
    /// The request could not be turned into a key (missing field, bad JSON,
    /// body too large): `4xx`, the handler did not run.
    Invalid {
        /// The rejection's machine code.
        error: String,
    },
    /// The principal already held as many locks through the layer as it
    /// may: `429`, no lock was asked for.
    OverQuota,
    /// No engine installed or invalid options: `500`.
    Misconfigured,
}

impl LockOutcome {
    /// A short word for logs: `acquired`, `busy`, `unavailable`, `invalid`,
    /// `over_quota`, `misconfigured`.
    pub fn as_str(&self) -> &'static str {
        match self {
            LockOutcome::Acquired { .. } => "acquired",
            LockOutcome::Busy { .. } => "busy",
            LockOutcome::Unavailable => "unavailable",
            LockOutcome::Invalid { .. } => "invalid",
            LockOutcome::OverQuota => "over_quota",
            LockOutcome::Misconfigured => "misconfigured",
        }
    }
}

impl fmt::Display for LockOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockOutcome::Acquired { fencing_token, waited } => {
                write!(f, "acquired (fence {fencing_token}, waited {} ms)", waited.as_millis())
            }
            LockOutcome::Busy { waited } => write!(f, "busy (waited {} ms)", waited.as_millis()),
            LockOutcome::Invalid { error } => write!(f, "invalid ({error})"),
            other => f.write_str(other.as_str()),
        }
    }
}
