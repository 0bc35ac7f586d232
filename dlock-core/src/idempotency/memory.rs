//! The in-process store: one mutex-protected map, entries expire lazily.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::{token_well_formed, Begin, Claim, IdempotencyStore, StoredResponse, TokenClaim, TOKEN_BYTES};
use crate::backend::BoxFuture;
use crate::error::{Error, Result};

/// Sweep every expired entry once the maps grew by this many inserts, so
/// that records nobody asks for again do not pile up.
const SWEEP_EVERY: usize = 1024;

/// Idempotency records of one process.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
/// let store = MemoryStore::new();
/// let t = store.issue_token(std::time::Duration::from_secs(1)).await?;
/// assert!(store.consume_token(&t).await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashMap<String, Token>,
    records: HashMap<(String, String), Record>,
    inserts: usize,
}

#[derive(Debug)]
struct Token {
    expires: Instant,
    /// Claimed by a running request ([`IdempotencyStore::claim_token`]).
    claimed: bool,
    /// The caller it is bound to ([`IdempotencyStore::issue_bound_token`]).
    principal: Option<String>,
}

#[derive(Debug)]
struct Record {
    fingerprint: String,
    expires: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    InProgress { owner: String },
    Completed(StoredResponse),
}

impl MemoryStore {
    /// An empty store. It needs no key prefix: nothing here is shared
    /// with another process or another store.
    pub fn new() -> Self {
        MemoryStore { inner: Mutex::new(Inner::default()) }
    }

    fn issue(&self, principal: Option<&str>, ttl: Duration) -> Result<String> {
        let token = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let now = Instant::now();
        let mut inner = self.lock()?;
        let record = Token { expires: now + ttl, claimed: false, principal: principal.map(str::to_owned) };
        inner.tokens.insert(token.clone(), record);
        inner.inserted(now);
        Ok(token)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| Error::backend("memory", "idempotency store poisoned by a panic"))
    }
}

impl Inner {
    fn inserted(&mut self, now: Instant) {
        self.inserts += 1;
        if self.inserts >= SWEEP_EVERY {
            self.inserts = 0;
            self.tokens.retain(|_, t| t.expires > now);
            self.records.retain(|_, r| r.expires > now);
        }
    }
}

impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn issue_token<'a>(&'a self, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(None, ttl) })
    }

    fn issue_bound_token<'a>(&'a self, principal: &'a str, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(Some(principal), ttl) })
    }

    fn consume_token<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(false);
            }
            let now = Instant::now();
            let mut inner = self.lock()?;
            // A claimed token belongs to the request running with it, a
            // bound one to its caller's claims.
            let fresh = inner.tokens.get(token).is_some_and(|t| t.expires > now && !t.claimed && t.principal.is_none());
            if fresh {
                inner.tokens.remove(token);
            }
            Ok(fresh)
        })
    }

    fn claim_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<TokenClaim>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(TokenClaim::Unknown);
            }
            let now = Instant::now();
            let mut inner = self.lock()?;
            Ok(match inner.tokens.get_mut(token).filter(|t| t.expires > now && t.principal.as_deref() == principal) {
                None => TokenClaim::Unknown,
                Some(t) if t.claimed => TokenClaim::InUse,
                Some(t) => {
                    t.claimed = true;
                    TokenClaim::Claimed
                }
            })
        })
    }

    fn spend_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock()?;
            let ours = |t: &Token| t.claimed && t.principal.as_deref() == principal;
            let claimed = inner.tokens.get(token).is_some_and(|t| t.expires > now && ours(t));
            if inner.tokens.get(token).is_some_and(ours) {
                inner.tokens.remove(token);
            }
            Ok(claimed)
        })
    }

    fn return_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock()?;
            let ours = |t: &&mut Token| t.expires > now && t.claimed && t.principal.as_deref() == principal;
            Ok(match inner.tokens.get_mut(token).filter(ours) {
                Some(t) => {
                    t.claimed = false;
                    true
                }
                None => false,
            })
        })
    }

    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock()?;
            let id = (scope.to_owned(), key.to_owned());
            if let Some(r) = inner.records.get(&id).filter(|r| r.expires > now) {
                return Ok(if r.fingerprint != fingerprint {
                    Begin::Mismatch
                } else {
                    match &r.state {
                        State::InProgress { .. } => Begin::InProgress,
                        State::Completed(resp) => Begin::Completed(resp.clone()),
                    }
                });
            }
            let claim = Claim::new(scope, key)?;
            inner.records.insert(
                id,
                Record {
                    fingerprint: fingerprint.to_owned(),
                    expires: now + lease,
                    state: State::InProgress { owner: claim.owner.clone() },
                },
            );
            inner.inserted(now);
            Ok(Begin::New(claim))
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock()?;
            let id = (claim.scope.clone(), claim.key.clone());
            match inner.records.get_mut(&id) {
                Some(r)
                    if r.expires > now && matches!(&r.state, State::InProgress { owner } if *owner == claim.owner) =>
                {
                    r.state = State::Completed(response.clone());
                    r.expires = now + ttl;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
    }

    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock()?;
            let id = (claim.scope.clone(), claim.key.clone());
            let ours = inner.records.get(&id).is_some_and(|r| {
                r.expires > now && matches!(&r.state, State::InProgress { owner } if *owner == claim.owner)
            });
            if ours {
                inner.records.remove(&id);
            }
            Ok(ours)
        })
    }
}
