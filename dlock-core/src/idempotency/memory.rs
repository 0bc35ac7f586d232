//! The in-process store: one mutex-protected map, with every live entry in
//! a [`Ledger`] by expiry, so what expired is dropped from the front (no
//! scan) and the caps count exactly what lives.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    token_well_formed, Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, RecordState, RecordView,
    StoredResponse, TokenClaim, Usage, TOKEN_BYTES,
};
use crate::backend::BoxFuture;
use crate::error::{Error, Result};

/// Idempotency records of one process, bounded by [`IdempotencyLimits`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore, TokenClaim};
/// let store = MemoryStore::new();
/// let t = store.issue_token(None, Duration::from_secs(1)).await?;
/// let TokenClaim::Claimed(claim) = store.claim_token(&t, None, Duration::from_secs(1)).await? else { panic!("fresh") };
/// assert!(store.spend_token(&claim).await?);
/// assert!(!matches!(store.claim_token(&t, None, Duration::from_secs(1)).await?, TokenClaim::Claimed(_)), "spent");
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    limits: IdempotencyLimits,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashMap<String, Token>,
    records: HashMap<(String, String), Record>,
    /// Live bound tokens by expiry (scope: the bound principal).
    token_ledger: Ledger,
    /// Live unbound tokens by expiry: their own pool.
    unbound_ledger: Ledger,
    /// Live records by expiry, and the bytes of their answers.
    record_ledger: Ledger,
}

/// What lives, by expiry, in all and per scope; an entry is `(scope, id)`.
#[derive(Debug, Default)]
struct Ledger {
    all: BTreeSet<(Instant, Option<String>, String, u64)>,
    scopes: HashMap<String, BTreeSet<(Instant, String)>>,
    bytes: u64,
    scope_bytes: HashMap<String, u64>,
}

/// The caps a [`Ledger`] is held to: per scope and in all, entries and bytes.
#[derive(Debug, Clone, Copy)]
struct Caps {
    per_scope: u64,
    all: u64,
    bytes_per_scope: u64,
    bytes: u64,
}

impl Ledger {
    fn add(&mut self, expires: Instant, scope: Option<&str>, id: &str, bytes: u64) {
        self.all.insert((expires, scope.map(str::to_owned), id.to_owned(), bytes));
        self.bytes += bytes;
        if let Some(scope) = scope {
            self.scopes.entry(scope.to_owned()).or_default().insert((expires, id.to_owned()));
            *self.scope_bytes.entry(scope.to_owned()).or_default() += bytes;
        }
    }

    fn remove(&mut self, expires: Instant, scope: Option<&str>, id: &str, bytes: u64) {
        if !self.all.remove(&(expires, scope.map(str::to_owned), id.to_owned(), bytes)) {
            return;
        }
        self.bytes -= bytes;
        if let Some(scope) = scope {
            if let Some(set) = self.scopes.get_mut(scope) {
                set.remove(&(expires, id.to_owned()));
                if set.is_empty() {
                    self.scopes.remove(scope);
                }
            }
            if let Some(b) = self.scope_bytes.get_mut(scope) {
                *b -= bytes;
                if *b == 0 {
                    self.scope_bytes.remove(scope);
                }
            }
        }
    }

    /// Takes out what expired by `now`, oldest first.
    fn expired(&mut self, now: Instant) -> Vec<(Option<String>, String)> {
        let mut gone = Vec::new();
        while let Some((expires, scope, id, bytes)) = self.all.first().filter(|e| e.0 <= now).cloned() {
            self.remove(expires, scope.as_deref(), &id, bytes);
            gone.push((scope, id));
        }
        gone
    }

    /// Whether `n` more entries of `bytes` more bytes of `scope` fit; else
    /// the refusal.
    fn room(&self, caps: Caps, scope: Option<&str>, n: u64, bytes: u64, now: Instant) -> Result<()> {
        let full = |per_scope: bool, oldest: Option<Instant>| Error::IdempotencyFull {
            per_scope,
            retry_after: oldest.map_or(Duration::ZERO, |t| t.saturating_duration_since(now)),
        };
        if let Some(scope) = scope {
            let set = self.scopes.get(scope);
            let (count, used) = (set.map_or(0, |s| s.len() as u64), self.scope_bytes.get(scope).copied().unwrap_or(0));
            if count + n > caps.per_scope || used + bytes > caps.bytes_per_scope {
                return Err(full(true, set.and_then(|s| s.first()).map(|e| e.0)));
            }
        }
        if self.all.len() as u64 + n > caps.all || self.bytes + bytes > caps.bytes {
            return Err(full(false, self.all.first().map(|e| e.0)));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Token {
    expires: Instant,
    /// Claimed by a running request: its owner and lease end.
    claimed: Option<(String, Instant)>,
    /// The caller it is bound to ([`IdempotencyStore::issue_token`]).
    principal: Option<String>,
}

#[derive(Debug)]
struct Record {
    fingerprint: String,
    /// When its request claimed it, for an operator.
    claimed: Instant,
    expires: Instant,
    /// The bytes of its answer, as the ledger counts them.
    bytes: u64,
    state: State,
}

#[derive(Debug)]
enum State {
    /// Claimed by `owner` until `lease_until`, unless renewed.
    InProgress {
        owner: String,
        lease_until: Instant,
    },
    Completed(StoredResponse),
}

impl MemoryStore {
    /// An empty store with the default [`IdempotencyLimits`] (no prefix:
    /// nothing is shared).
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// Replaces the caps on live records and tokens.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use std::time::Duration;
    /// use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyLimits, IdempotencyStore, MemoryStore};
    /// let store = MemoryStore::new().with_limits(IdempotencyLimits::default().with_max_per_scope(1));
    /// assert!(matches!(store.begin("alice", "k1", "fp", ClaimTerms::new(Duration::from_secs(5))).await?, Begin::New(_)));
    /// let full = store.begin("alice", "k2", "fp", ClaimTerms::new(Duration::from_secs(5))).await.unwrap_err();
    /// assert!(matches!(full, dlock_core::Error::IdempotencyFull { per_scope: true, .. }));
    /// # Ok(()) }
    /// ```
    pub fn with_limits(mut self, limits: IdempotencyLimits) -> Self {
        self.limits = limits;
        self
    }

    fn issue(&self, principal: Option<&str>, ttl: Duration) -> Result<String> {
        let token = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let now = Instant::now();
        let mut inner = self.lock(now)?;
        let (caps, ledger) = self.token_pool(&mut inner, principal.is_some());
        ledger.room(caps, principal, 1, 0, now)?;
        let expires = now + ttl;
        ledger.add(expires, principal, &token, 0);
        inner.tokens.insert(token.clone(), Token { expires, claimed: None, principal: principal.map(str::to_owned) });
        Ok(token)
    }

    /// The caps and the ledger of bound tokens, or (`bound` false) unbound ones.
    fn token_pool<'a>(&self, inner: &'a mut Inner, bound: bool) -> (Caps, &'a mut Ledger) {
        let l = &self.limits;
        if bound {
            let caps =
                Caps { per_scope: l.max_per_scope(), all: l.max_records(), bytes_per_scope: u64::MAX, bytes: u64::MAX };
            (caps, &mut inner.token_ledger)
        } else {
            let caps =
                Caps { per_scope: u64::MAX, all: l.max_unbound_tokens(), bytes_per_scope: u64::MAX, bytes: u64::MAX };
            (caps, &mut inner.unbound_ledger)
        }
    }

    /// The caps of records.
    fn record_caps(&self) -> Caps {
        let l = &self.limits;
        Caps {
            per_scope: l.max_per_scope(),
            all: l.max_records(),
            bytes_per_scope: l.max_bytes_per_scope(),
            bytes: l.max_bytes(),
        }
    }

    /// The store, with what expired by `now` dropped.
    fn lock(&self, now: Instant) -> Result<std::sync::MutexGuard<'_, Inner>> {
        let mut inner =
            self.inner.lock().map_err(|_| Error::backend("memory", "idempotency store poisoned by a panic"))?;
        inner.purge(now);
        Ok(inner)
    }
}

impl Record {
    /// As an operator sees it at `now`.
    fn view(&self, scope: &str, key: &str, now: Instant) -> RecordView {
        let state = match &self.state {
            State::Completed(response) => RecordState::Completed { status: response.status },
            State::InProgress { lease_until, .. } if *lease_until > now => {
                RecordState::InProgress { lease_left: Some(*lease_until - now) }
            }
            State::InProgress { .. } => RecordState::OutcomeUnknown,
        };
        let view = RecordView::new(scope, key, state, self.bytes, self.expires.saturating_duration_since(now))
            .with_age(now.saturating_duration_since(self.claimed));
        match &self.state {
            State::InProgress { owner, .. } => view.claimed_by(owner.clone()),
            State::Completed(_) => view,
        }
    }
}

impl Inner {
    fn purge(&mut self, now: Instant) {
        for (_, token) in self.token_ledger.expired(now).into_iter().chain(self.unbound_ledger.expired(now)) {
            self.tokens.remove(&token);
        }
        for (scope, key) in self.record_ledger.expired(now) {
            self.records.remove(&(scope.unwrap_or_default(), key));
        }
    }

    /// Removes a token that is no longer live (consumed or spent).
    fn drop_token(&mut self, token: &str) {
        if let Some(t) = self.tokens.remove(token) {
            let ledger = if t.principal.is_some() { &mut self.token_ledger } else { &mut self.unbound_ledger };
            ledger.remove(t.expires, t.principal.as_deref(), token, 0);
        }
    }
}

/// Whether `token` is held by `claim` (owner and principal).
fn holds(token: &Token, claim: &Claim) -> bool {
    token.principal.as_deref() == claim.principal()
        && token.claimed.as_ref().is_some_and(|(owner, _)| *owner == claim.owner)
}

impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn issue_token<'a>(&'a self, principal: Option<&'a str>, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(principal, ttl) })
    }

    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(TokenClaim::Unknown);
            }
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            Ok(match inner.tokens.get_mut(token).filter(|t| t.expires > now && t.principal.as_deref() == principal) {
                None => TokenClaim::Unknown,
                Some(Token { claimed: Some((_, until)), .. }) if *until > now => TokenClaim::InUse,
                Some(Token { claimed: Some(_), .. }) => TokenClaim::OutcomeUnknown,
                Some(t) => {
                    let claim = Claim::token(token, principal)?;
                    t.claimed = Some((claim.owner.clone(), now + lease));
                    TokenClaim::Claimed(claim)
                }
            })
        })
    }

    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            let ours = inner.tokens.get(claim.key()).is_some_and(|t| t.expires > now && holds(t, claim));
            if ours {
                inner.drop_token(claim.key());
            }
            Ok(ours)
        })
    }

    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            Ok(match inner.tokens.get_mut(claim.key()).filter(|t| t.expires > now && holds(t, claim)) {
                Some(t) => {
                    t.claimed = None;
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
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            let id = (scope.to_owned(), key.to_owned());
            if let Some(r) = inner.records.get_mut(&id).filter(|r| r.expires > now) {
                if r.fingerprint != fingerprint {
                    return Ok(Begin::Mismatch);
                }
                return Ok(match &mut r.state {
                    State::Completed(resp) => Begin::Completed(resp.clone()),
                    State::InProgress { lease_until, .. } if *lease_until > now => Begin::InProgress,
                    State::InProgress { .. } if !terms.runs_again_after_lease() => Begin::OutcomeUnknown,
                    // Taken over: the old owner can no longer complete it.
                    State::InProgress { owner, lease_until } => {
                        let claim = Claim::new(scope, key)?;
                        owner.clone_from(&claim.owner);
                        *lease_until = now + terms.lease();
                        r.claimed = now;
                        Begin::New(claim)
                    }
                });
            }
            // Only a new record counts against the caps.
            inner.record_ledger.room(self.record_caps(), Some(scope), 1, 0, now)?;
            let claim = Claim::new(scope, key)?;
            let expires = now + terms.ttl();
            inner.record_ledger.add(expires, Some(scope), key, 0);
            let state = State::InProgress { owner: claim.owner.clone(), lease_until: now + terms.lease() };
            let record = Record { fingerprint: fingerprint.to_owned(), claimed: now, expires, bytes: 0, state };
            inner.records.insert(id, record);
            Ok(Begin::New(claim))
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            if claim.is_token() {
                return Ok(match inner.tokens.get_mut(claim.key()).filter(|t| holds(t, claim)) {
                    Some(Token { claimed: Some((_, until)), .. }) if *until > now => {
                        *until = now + lease;
                        true
                    }
                    _ => false,
                });
            }
            let id = (claim.scope.clone(), claim.key.clone());
            Ok(match inner.records.get_mut(&id).map(|r| &mut r.state) {
                Some(State::InProgress { owner, lease_until }) if *owner == claim.owner && *lease_until > now => {
                    *lease_until = now + lease;
                    true
                }
                _ => false,
            })
        })
    }

    fn complete<'a>(&'a self, claim: &'a Claim, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            let id = (claim.scope.clone(), claim.key.clone());
            let expires = match inner.records.get(&id) {
                Some(r) if matches!(&r.state, State::InProgress { owner, .. } if *owner == claim.owner) => r.expires,
                _ => return Ok(false),
            };
            let bytes = response.encode().len() as u64;
            inner.record_ledger.room(self.record_caps(), Some(&claim.scope), 0, bytes, now)?;
            if let Some(r) = inner.records.get_mut(&id) {
                r.state = State::Completed(response.clone());
                r.bytes = bytes;
            }
            inner.record_ledger.remove(expires, Some(&claim.scope), &claim.key, 0);
            inner.record_ledger.add(expires, Some(&claim.scope), &claim.key, bytes);
            Ok(true)
        })
    }

    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock(now)?;
            let id = (claim.scope.clone(), claim.key.clone());
            let ours = inner.records.get(&id).is_some_and(|r| {
                r.expires > now && matches!(&r.state, State::InProgress { owner, .. } if *owner == claim.owner)
            });
            if ours && let Some(r) = inner.records.remove(&id) {
                inner.record_ledger.remove(r.expires, Some(&claim.scope), &claim.key, r.bytes);
            }
            Ok(ours)
        })
    }

    fn inspect_record<'a>(&'a self, scope: &'a str, key: &'a str) -> BoxFuture<'a, Result<Option<RecordView>>> {
        Box::pin(async move {
            let now = Instant::now();
            let inner = self.lock(now)?;
            let id = (scope.to_owned(), key.to_owned());
            Ok(inner.records.get(&id).filter(|r| r.expires > now).map(|r| r.view(scope, key, now)))
        })
    }

    fn stuck_records(&self, limit: usize) -> BoxFuture<'_, Result<Vec<RecordView>>> {
        Box::pin(async move {
            let now = Instant::now();
            let inner = self.lock(now)?;
            let mut stuck: Vec<RecordView> = inner
                .records
                .iter()
                .map(|((scope, key), r)| r.view(scope, key, now))
                .filter(RecordView::is_stuck)
                .collect();
            // The longest stuck first.
            stuck.sort_by_key(|v| std::cmp::Reverse(v.age));
            stuck.truncate(limit);
            Ok(stuck)
        })
    }

    fn usage<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Usage>> {
        Box::pin(async move {
            let inner = self.lock(Instant::now())?;
            let (ledger, caps) = (&inner.record_ledger, self.record_caps());
            Ok(match scope {
                Some(scope) => Usage::new(
                    ledger.scopes.get(scope).map_or(0, |s| s.len() as u64),
                    ledger.scope_bytes.get(scope).copied().unwrap_or(0),
                    caps.per_scope,
                    caps.bytes_per_scope,
                ),
                None => Usage::new(ledger.all.len() as u64, ledger.bytes, caps.all, caps.bytes),
            })
        })
    }
}
