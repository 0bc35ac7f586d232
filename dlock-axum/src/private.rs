//! Runtime support for `#[lockable]`; not a public API. The expansion names
//! only items of this module, each a thin adapter over the pipeline.

use std::convert::Infallible;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
pub use axum::response::{IntoResponse, Response};
use dlock_core::{LockKey, Locker, Owner};

pub use crate::pipeline::policy::Policy;

/// The policy of a `#[lockable(...)]` attribute, in a `static` of the expansion.
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
    policy.in_mode(dlock_core::LockMode::Shared)
}

/// `#[lockable(permits = n)]` (`n` ≥ 1: the macro refuses 0).
pub const fn permits(policy: Policy, n: u32) -> Policy {
    policy.in_mode(dlock_core::LockMode::permits(n))
}

use crate::pipeline::acquire::{self, acquire_for_request};
use crate::pipeline::refusal::Refusal;
use crate::pipeline::until_commit::UntilCommit;
use crate::request::{FencingToken, HeldLock, HeldLocks, RequestOwner};

/// The hidden first extractor of a `#[lockable]` handler: the engine and the
/// request's lock owner. It never rejects: [`LockContext::acquire`] answers.
#[derive(Debug)]
pub struct LockContext {
    engine: Result<(Locker, Owner), Refusal>,
    /// Set inside an in-transaction idempotency layer: the lock ends with its transaction.
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
    /// Builds the keys with `keys` (one per `key`/`also(..)` of the attribute) and
    /// takes them all or none, or answers as [`LockLayer`](crate::LockLayer) does.
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
    /// Releases the lock once the body has answered (inside an in-transaction
    /// layer: once its transaction has ended) and records the outcome.
    pub async fn finish<R: IntoResponse>(self, out: R) -> Response {
        let outcome = self.held.release_after_route(self.policy.clone(), self.until_commit, ()).await;
        let mut response = out.into_response();
        response.extensions_mut().insert(outcome);
        response
    }
}

/// An argument of a `#[lockable]` handler that the macro fills from the lock it took.
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
