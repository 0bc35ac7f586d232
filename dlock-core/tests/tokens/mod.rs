//! Spending a one-time token in one step, as a request that ran to a result
//! does through `TokenLayer`: claim it, then spend the claim.

use std::time::Duration;

use dlock_core::idempotency::{IdempotencyStore, TokenClaim};

/// `consume` on every store, through `Arc`s and references alike.
pub(crate) trait Consume {
    /// `true` for exactly one caller while `token` lives unclaimed and
    /// unbound; `false` when it is unknown, expired, spent, bound, or
    /// claimed by another.
    async fn consume(&self, token: &str) -> dlock_core::Result<bool>;
}

impl<S: IdempotencyStore + ?Sized> Consume for S {
    async fn consume(&self, token: &str) -> dlock_core::Result<bool> {
        match self.claim_token(token, None, Duration::from_secs(10)).await? {
            TokenClaim::Claimed(claim) => self.spend_token(&claim).await,
            _ => Ok(false),
        }
    }
}
