//! Runtime support for `#[lockable]`; not a public API.
//!
//! The macro's expansion names only items of this module, so the macro and
//! the runtime can change together without breaking user code.

use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
pub use axum::response::{IntoResponse, Response};
use dlock_core::{AcquireOptions, KeyBuilder, LockGuard, LockKey, Locker, Owner};
use std::time::Instant;

use crate::engine::{locker_from_extensions, no_engine};
use crate::{LockOutcome, Rejection, RequestOwner};

/// What one `#[lockable(...)]` attribute asked for.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The key's name.
    pub key: &'static str,
    /// `wait_ms`, or the engine's default wait.
    pub wait_ms: Option<u64>,
    /// `lease_ms`, or watchdog mode.
    pub lease_ms: Option<u64>,
    /// `message` of the duplicate-submission answer.
    pub message: Option<&'static str>,
    /// `code` of the duplicate-submission answer.
    pub code: Option<u32>,
    /// The handler's name, for logs.
    pub handler: &'static str,
}

/// The hidden first extractor of a `#[lockable]` handler: the installed
/// engine and the request's lock owner.
#[derive(Debug)]
pub struct LockContext {
    locker: Locker,
    owner: Owner,
}

impl<S> FromRequestParts<S> for LockContext
where
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(locker) = locker_from_extensions(&parts.extensions).cloned() else {
            return Err(no_engine().into_response());
        };
        let owner = RequestOwner::get_or_insert(&mut parts.extensions)
            .map_err(|e| Rejection::from_lock_error(&e).into_response())?;
        Ok(LockContext { locker, owner })
    }
}

impl LockContext {
    /// Starts the key `name`; the expansion adds the field values as parts.
    pub fn key(&self, name: &str) -> KeyBuilder {
        self.locker.key(name)
    }

    /// Takes the lock, or answers for the handler: `409` when it is held
    /// (with the attribute's message and code), `400` for a key the request
    /// made invalid, `503` when the lock service is down.
    pub async fn acquire(&self, spec: &Spec, key: dlock_core::Result<LockKey>) -> Result<Held, Response> {
        let key = key.map_err(|e| {
            tracing::info!(handler = spec.handler, error = %e, "lockable: invalid key");
            refusal(spec, &e, LockOutcome::Invalid { error: "lock_key_invalid".into() })
        })?;
        let mut opts = AcquireOptions::new().owner(self.owner.clone());
        if let Some(ms) = spec.wait_ms {
            opts = opts.wait(Duration::from_millis(ms));
        }
        if let Some(ms) = spec.lease_ms {
            opts = opts.lease(Duration::from_millis(ms));
        }
        let started = Instant::now();
        match self.locker.acquire(&key, opts).await {
            Ok(guard) => Ok(Held { guard, waited: started.elapsed() }),
            Err(e) => {
                let waited = started.elapsed();
                let outcome = if e.is_contention() {
                    LockOutcome::Busy { waited }
                } else if e.is_misconfigured() {
                    LockOutcome::Misconfigured
                } else {
                    LockOutcome::Unavailable
                };
                tracing::info!(handler = spec.handler, key = %key, error = %e, outcome = outcome.as_str(), "lockable: refused");
                Err(refusal(spec, &e, outcome))
            }
        }
    }
}

fn refusal(spec: &Spec, err: &dlock_core::Error, outcome: LockOutcome) -> Response {
    let mut rejection = Rejection::from_lock_error(err);
    if err.is_contention() {
        if let Some(message) = spec.message {
            rejection = rejection.with_message(message);
        }
        if let Some(code) = spec.code {
            rejection = rejection.with_code(code);
        }
    }
    let mut response = rejection.into_response();
    response.extensions_mut().insert(outcome);
    response
}

/// A lock held while the handler's body runs.
#[derive(Debug)]
pub struct Held {
    guard: LockGuard,
    waited: Duration,
}

impl Held {
    /// Releases the lock once the body has produced its answer, and records
    /// the outcome in the response. A body that panics drops the guard,
    /// which releases it in the background.
    pub async fn finish<R: IntoResponse>(self, out: R) -> Response {
        let fencing_token = self.guard.fencing_token();
        let key = self.guard.key().clone();
        if let Err(e) = self.guard.release().await {
            // The work is done; the lease frees the key when it runs out.
            tracing::warn!(key = %key, error = %e, "lockable: release failed after the handler ran");
        }
        let mut response = out.into_response();
        response.extensions_mut().insert(LockOutcome::Acquired { fencing_token, waited: self.waited });
        response
    }
}
