//! What dlock leaves in a request and its response: the request's lock owner,
//! the fencing token of the lock it holds, and the outcome for logs.

use std::fmt;
use std::time::Duration;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::Extensions;
use dlock_core::Owner;

use crate::rejection::Rejection;

/// What dlock keeps in a request's extensions: its lock owner and the
/// fencing token of the lock it holds, in one entry. `http`'s extension map
/// starts with room for three: a router's own entries plus two of ours
/// would make it grow on every locked request.
#[derive(Debug, Clone)]
struct RequestLock {
    owner: Owner,
    fencing_token: Option<u64>,
}

/// The lock owner of one request.
///
/// Every lock taken while handling a request is taken as this owner, so a
/// nested lock on the same key (a locked handler behind a [`LockLayer`](crate::LockLayer),
/// two layers) re-enters instead of deadlocking. A handler can extract it
/// (it is made on first use) to take further locks as the same owner.
///
/// ```
/// use axum::http::Extensions;
/// use dlock_axum::RequestOwner;
/// let mut ext = Extensions::new();
/// let a = RequestOwner::get_or_insert(&mut ext).unwrap();
/// let b = RequestOwner::get_or_insert(&mut ext).unwrap();
/// assert_eq!(a, b);
/// assert_eq!(RequestOwner::get(&ext), Some(a));
///
/// async fn handler(RequestOwner(owner): RequestOwner) -> String {
///     format!("locks of this request are held by {}", owner.as_str())
/// }
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
        if let Some(lock) = extensions.get::<RequestLock>() {
            return Ok(lock.owner.clone());
        }
        let owner = Owner::random()?;
        extensions.insert(RequestLock { owner: owner.clone(), fencing_token: None });
        Ok(owner)
    }

    /// The request's owner, if a lock was taken (or an owner made) for it.
    pub fn get(extensions: &Extensions) -> Option<Owner> {
        extensions.get::<RequestLock>().map(|lock| lock.owner.clone())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestOwner {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        RequestOwner::get_or_insert(&mut parts.extensions).map(RequestOwner).map_err(|e| Rejection::from_lock_error(&e))
    }
}

/// The fencing token of the lock this request holds, for the handler: pass
/// it to the storage you protect so it can refuse writes from a holder whose
/// lease already ran out.
///
/// Extracting it from a request that holds no lock through a
/// [`LockLayer`](crate::LockLayer) is a server misconfiguration (`500`); take
/// `Option<FencingToken>` where the route may run without one.
///
/// ```
/// use dlock_axum::FencingToken;
/// async fn handler(FencingToken(fence): FencingToken) -> String {
///     format!("writing with fence {fence}")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token of the lock the request holds, if any.
    pub fn get(extensions: &Extensions) -> Option<FencingToken> {
        extensions.get::<RequestLock>().and_then(|lock| lock.fencing_token).map(FencingToken)
    }

    /// Records the token of the lock just taken for the request of `owner`.
    pub(crate) fn set(extensions: &mut Extensions, owner: &Owner, token: u64) {
        match extensions.get_mut::<RequestLock>() {
            Some(lock) => lock.fencing_token = Some(token),
            None => {
                extensions.insert(RequestLock { owner: owner.clone(), fencing_token: Some(token) });
            }
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for FencingToken {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        FencingToken::get(&parts.extensions).ok_or_else(|| {
            tracing::error!("FencingToken extracted by a handler that holds no lock; put the route behind a LockLayer");
            Rejection::misconfigured().with_message("this route holds no lock, so it has no fencing token")
        })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for FencingToken {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(FencingToken::get(&parts.extensions))
    }
}

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
