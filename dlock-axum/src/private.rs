//! Runtime support for `#[lockable]`; not a public API.
//!
//! The macro's expansion names only items of this module, so the macro and
//! the runtime can change together without breaking user code. Everything
//! here is a thin adapter over the request-lock pipeline of
//! [`LockLayer`](crate::LockLayer) (`pipeline/`): same policy type,
//! same acquire, same refusals, same log event.

use std::convert::Infallible;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
pub use axum::response::{IntoResponse, Response};
use dlock_core::{LockKey, Locker, Owner};

pub use crate::pipeline::policy::Policy;

/// The policy of a `#[lockable(...)]` attribute, in a `static` of the
/// expansion (so nothing is built per request).
pub const fn policy(
    name: &'static str,
    wait_ms: Option<u64>,
    lease_ms: Option<u64>,
    max_hold_ms: Option<u64>,
    message: Option<&'static str>,
    code: Option<u32>,
) -> Policy {
    Policy::from_attribute(name, wait_ms, lease_ms, max_hold_ms, message, code)
}

/// `#[lockable(mode = "shared")]`: the policy taking its keys shared.
pub const fn shared(policy: Policy) -> Policy {
    policy.in_mode(dlock_core::backend::LockMode::Shared)
}

/// `#[lockable(permits = n)]`: the policy taking one of `n` permits of each
/// key (`n` is at least 1: the macro refuses 0).
pub const fn permits(policy: Policy, n: u32) -> Policy {
    policy.in_mode(dlock_core::backend::LockMode::permits(n))
}

use crate::pipeline::acquire::{self, acquire_for_request};
use crate::pipeline::refusal::Refusal;
use crate::pipeline::until_commit::UntilCommit;
use crate::request::{FencingToken, HeldLock, HeldLocks, RequestOwner};

/// The hidden first extractor of a `#[lockable]` handler: the installed
/// engine and the request's lock owner, or why there are none. It never
/// rejects: a missing engine is answered by [`LockContext::acquire`], through
/// the pipeline, with the handler's policy.
#[derive(Debug)]
pub struct LockContext {
    engine: Result<(Locker, Owner), Refusal>,
    /// Set inside an in-transaction idempotency layer: the lock ends with
    /// the route's transaction, not with the handler.
    until_commit: Option<UntilCommit>,
}

impl<S> FromRequestParts<S> for LockContext
where
    S: Send + Sync,
{
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let until_commit = UntilCommit::of(&parts.extensions);
        let Some(locker) = crate::install::installed(&parts.extensions).map(|dlock| dlock.locker().clone()) else {
            return Ok(LockContext { engine: Err(Refusal::no_engine()), until_commit });
        };
        let engine = match RequestOwner::get_or_insert(&mut parts.extensions) {
            Ok(owner) => Ok((locker, owner)),
            Err(e) => Err(Refusal::no_owner(e)),
        };
        Ok(LockContext { engine, until_commit })
    }
}

impl LockContext {
    /// Builds the keys with `keys` (the expansion builds one key per
    /// `key`/`also(..)` of the attribute, from the locker it is given, with
    /// the field values as parts) and takes them, all or none, or answers
    /// for the handler: `409` when one is held (with the policy's message
    /// and code; `429` on a semaphore route), `400` for a key the request
    /// made invalid, `503` when the lock service is down, `500` without an
    /// engine.
    pub async fn acquire<const N: usize>(
        self,
        policy: &'static Policy,
        keys: impl FnOnce(&Locker) -> dlock_core::Result<[LockKey; N]>,
    ) -> Result<Held, Response> {
        let (locker, owner) = self.engine.map_err(|refusal| refusal.respond(policy))?;
        let keys = keys(&locker)
            .map_err(|e| Refusal::from_error(e, policy, None, std::time::Duration::ZERO).respond(policy))?;
        let held =
            acquire_for_request(&locker, owner, &keys, policy).await.map_err(|refusal| refusal.respond(policy))?;
        Ok(Held { held, policy, until_commit: self.until_commit })
    }
}

/// A lock held while the handler's body runs.
#[derive(Debug)]
pub struct Held {
    held: acquire::Held,
    policy: &'static Policy,
    until_commit: Option<UntilCommit>,
}

impl Held {
    /// Releases the lock once the body has produced its answer (inside an
    /// in-transaction idempotency layer: once its transaction has ended),
    /// and records the outcome in the response. A body that panics drops
    /// the guard, which releases it in the background.
    pub async fn finish<R: IntoResponse>(self, out: R) -> Response {
        let outcome = self.held.release_after_route(self.policy.clone(), self.until_commit, ()).await;
        let mut response = out.into_response();
        response.extensions_mut().insert(outcome);
        response
    }
}

/// An argument of a `#[lockable]` handler that comes from the lock the macro
/// took rather than from the request: the macro fills arguments of these
/// types after acquiring, in place of running an extractor.
pub trait FromHeld {
    /// The argument's value for the lock `held`.
    fn from_held(held: &Held) -> Self;
}

impl FromHeld for FencingToken {
    fn from_held(held: &Held) -> Self {
        FencingToken(held.held.guard().fencing_token())
    }
}

impl FromHeld for Option<FencingToken> {
    fn from_held(held: &Held) -> Self {
        Some(FencingToken::from_held(held))
    }
}

impl FromHeld for HeldLock {
    fn from_held(held: &Held) -> Self {
        HeldLock::of(held.held.guard())
    }
}

impl FromHeld for Option<HeldLock> {
    fn from_held(held: &Held) -> Self {
        Some(HeldLock::of(held.held.guard()))
    }
}

impl FromHeld for HeldLocks {
    fn from_held(held: &Held) -> Self {
        HeldLocks::of(held.held.guards())
    }
}

impl FromHeld for Option<HeldLocks> {
    fn from_held(held: &Held) -> Self {
        Some(HeldLocks::from_held(held))
    }
}
