//! Request idempotency stores: one-time tokens and `Idempotency-Key` records.
//!
//! * **Tokens**: [`issue_token`](IdempotencyStore::issue_token), then one
//!   atomic [`claim_token`](IdempotencyStore::claim_token) per request (of
//!   concurrent submits exactly one gets it), then
//!   [`spend_token`](IdempotencyStore::spend_token) or
//!   [`return_token`](IdempotencyStore::return_token).
//! * **Keys**: [`begin`](IdempotencyStore::begin) claims `(scope, key)` and
//!   answers a [`Begin`]; the claim's lease is renewed while the route runs
//!   ([`ClaimTerms`]), then [`complete`](IdempotencyStore::complete) stores
//!   the response or [`abandon`](IdempotencyStore::abandon) frees the key,
//!   both owner-checked ([`Claim`]).
//!
//! [`MemoryStore`] serves one process, [`RedisStore`] and `PostgresStore`
//! share records between instances; each is bounded by
//! [`IdempotencyLimits`]. [`Config::build`](crate::Config::build) picks one;
//! `docs/idempotency.md` has the guarantees.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
//! use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, MemoryStore, StoredResponse, TokenClaim};
//! use std::time::Duration;
//!
//! let store = MemoryStore::new();
//! let token = store.issue_token(None, Duration::from_secs(60)).await?;
//! let TokenClaim::Claimed(claim) = store.claim_token(&token, None, Duration::from_secs(10)).await? else { unreachable!() };
//! assert!(matches!(store.claim_token(&token, None, Duration::from_secs(10)).await?, TokenClaim::InUse));
//! assert!(store.spend_token(&claim).await?); // the request ran to a result: spent
//!
//! let fp = dlock_core::idempotency::fingerprint(&["POST", "/pay", "{}"]);
//! let terms = ClaimTerms::new(Duration::from_secs(10));
//! let Begin::New(claim) = store.begin("alice", "k1", &fp, terms).await? else { unreachable!() };
//! store.complete(&claim, &StoredResponse::new(201, vec![], b"ok".to_vec())).await?;
//! assert!(matches!(store.begin("alice", "k1", &fp, terms).await?, Begin::Completed(_)));
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::Duration;

use crate::backend::BoxFuture;
use crate::error::{Error, Result};

mod canonical;
mod inspect;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "postgres")]
pub use self::postgres::PostgresStore;
#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use canonical::{canonical_body, canonical_json};
pub use inspect::{release_claim, RecordState, RecordView, Usage};
pub use memory::MemoryStore;

/// Random bytes in a token: 128 bits, shown as 32 hex characters.
pub const TOKEN_BYTES: usize = 16;

/// How much a store keeps, per caller (the key's scope) and in total: live
/// records, bytes of stored answers, bound tokens, and a pool of its own for
/// unbound tokens, so that no client can fill the server the locks need.
///
/// A new key or token beyond a cap is [`Error::IdempotencyFull`] (`429` or
/// `503` over HTTP, with `Retry-After`); an answer beyond the byte caps is
/// refused by [`IdempotencyStore::complete`]. What is already stored is
/// still answered at the cap. Defaults: 10 000 records and 64 MiB per
/// caller, a million records and 1 GiB in all, 100 000 unbound tokens
/// (`DLOCK_IDEMPOTENCY_MAX_*`). How each store counts, and how to size
/// Redis for them: `docs/idempotency.md`.
///
/// ```
/// use dlock_core::idempotency::{IdempotencyLimits, MemoryStore};
/// let limits = IdempotencyLimits::default()
///     .with_max_per_scope(100)
///     .with_max_records(10_000)
///     .with_max_bytes_per_scope(1 << 20)
///     .with_max_unbound_tokens(1_000);
/// assert_eq!((limits.max_per_scope(), limits.max_records(), limits.max_bytes_per_scope()), (100, 10_000, 1 << 20));
/// let store = MemoryStore::new().with_limits(limits);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyLimits {
    max_per_scope: u64,
    max_records: u64,
    max_bytes_per_scope: u64,
    max_bytes: u64,
    max_unbound_tokens: u64,
}

impl Default for IdempotencyLimits {
    fn default() -> Self {
        IdempotencyLimits {
            max_per_scope: 10_000,
            max_records: 1_000_000,
            max_bytes_per_scope: 64 << 20,
            max_bytes: 1 << 30,
            max_unbound_tokens: 100_000,
        }
    }
}

impl IdempotencyLimits {
    /// Most live records (and, apart, bound tokens) of one caller; at least 1.
    pub fn with_max_per_scope(mut self, n: u64) -> Self {
        self.max_per_scope = n.max(1);
        self
    }

    /// Most live records (and, apart, bound tokens) in the whole store; at least 1.
    pub fn with_max_records(mut self, n: u64) -> Self {
        self.max_records = n.max(1);
        self
    }

    /// Most bytes of stored answers of one caller.
    pub fn with_max_bytes_per_scope(mut self, n: u64) -> Self {
        self.max_bytes_per_scope = n;
        self
    }

    /// Most bytes of stored answers in the whole store.
    pub fn with_max_bytes(mut self, n: u64) -> Self {
        self.max_bytes = n;
        self
    }

    /// Most live tokens issued to no caller in particular; at least 1.
    pub fn with_max_unbound_tokens(mut self, n: u64) -> Self {
        self.max_unbound_tokens = n.max(1);
        self
    }

    /// Most live records of one caller.
    pub fn max_per_scope(&self) -> u64 {
        self.max_per_scope
    }

    /// Most live records in all.
    pub fn max_records(&self) -> u64 {
        self.max_records
    }

    /// Most bytes of stored answers of one caller.
    pub fn max_bytes_per_scope(&self) -> u64 {
        self.max_bytes_per_scope
    }

    /// Most bytes of stored answers in all.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Most live unbound tokens.
    pub fn max_unbound_tokens(&self) -> u64 {
        self.max_unbound_tokens
    }
}

/// A store of one-time tokens and idempotency-key records; dyn-compatible.
///
/// ```
/// use std::sync::Arc;
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
/// let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
/// assert_eq!(store.name(), "memory");
/// ```
pub trait IdempotencyStore: Send + Sync + fmt::Debug + 'static {
    /// `memory` or `redis`, for logs.
    fn name(&self) -> &'static str;

    /// Whether the store answers now, for a readiness probe: one cheap
    /// round trip, nothing written.
    fn ready(&self) -> BoxFuture<'_, Result<()>>;

    /// Issues a token usable once within `ttl`, bound to `principal` when
    /// given (only a claim naming it takes the token).
    /// [`Error::IdempotencyFull`] at the [`IdempotencyLimits`].
    fn issue_token<'a>(&'a self, principal: Option<&'a str>, ttl: Duration) -> BoxFuture<'a, Result<String>>;

    /// Claims a fresh `token` atomically: of concurrent callers exactly one
    /// gets [`TokenClaim::Claimed`], the others [`TokenClaim::InUse`]. The
    /// claim holds for `lease` unless [`renew`](Self::renew)ed; once that
    /// runs out the token answers [`TokenClaim::OutcomeUnknown`] (spent). A
    /// token bound to another `principal` is [`TokenClaim::Unknown`]. A
    /// claim whose answer was lost is given back in the background.
    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>>;

    /// Spends a claimed token; `Ok(false)` when it was no longer this claim's.
    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;

    /// Gives a claimed token back, fresh, for a retry; `Ok(false)` when it
    /// is no longer this claim's or expired.
    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;

    /// Claims `key` within `scope` for a request with this `fingerprint`,
    /// on the [`ClaimTerms`]. A key that has a record is answered from it (a
    /// claim whose lease ran out: [`Begin::OutcomeUnknown`], unless the terms
    /// [`run_again_after_lease`](ClaimTerms::run_again_after_lease)); a new
    /// one beyond the [`IdempotencyLimits`] is [`Error::IdempotencyFull`]. A
    /// claim whose answer was lost is given back in the background.
    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>>;

    /// Extends a claim's lease (of a key or a token) to `lease` from now.
    /// `Ok(false)` when it is no longer ours or already ran out. The default
    /// answers `Ok(false)`.
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        let _ = (claim, lease);
        Box::pin(async { Ok(false) })
    }

    /// Stores the response of a claimed key, for the TTL of its
    /// [`ClaimTerms`]. `Ok(false)` when the claim is no longer ours;
    /// [`Error::IdempotencyFull`] when the answer does not fit the
    /// [`IdempotencyLimits`] (the claim stays: store less, or abandon it).
    fn complete<'a>(&'a self, claim: &'a Claim, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool>>;

    /// Frees a claimed key for a retry; `Ok(false)` when no longer ours.
    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;

    /// The record of `(scope, key)` for an operator: its state, size and
    /// time left; `None` when there is none. Reads only. The default says
    /// this store cannot tell.
    fn inspect_record<'a>(&'a self, scope: &'a str, key: &'a str) -> BoxFuture<'a, Result<Option<RecordView>>> {
        let _ = (scope, key);
        Box::pin(std::future::ready(Err(cannot(self.name(), "inspect_record"))))
    }

    /// Up to `limit` records stuck past their claim's lease ("outcome
    /// unknown"), for an operator to check and [`release_claim`]. The
    /// default says this store cannot list them.
    fn stuck_records(&self, limit: usize) -> BoxFuture<'_, Result<Vec<RecordView>>> {
        let _ = limit;
        Box::pin(std::future::ready(Err(cannot(self.name(), "stuck_records"))))
    }

    /// What `scope` keeps against its caps, or with `None` the whole
    /// store against the totals. The default says this store cannot tell.
    fn usage<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Usage>> {
        let _ = scope;
        Box::pin(std::future::ready(Err(cannot(self.name(), "usage"))))
    }
}

/// The error of an operator's call that `store` does not answer.
fn cannot(store: &str, what: &'static str) -> Error {
    Error::invalid_argument(what, format!("the {store} idempotency store does not implement it"))
}

/// The answer of [`IdempotencyStore::claim_token`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore, TokenClaim};
/// let (store, lease) = (MemoryStore::new(), Duration::from_secs(10));
/// let token = store.issue_token(None, Duration::from_secs(60)).await?;
/// let TokenClaim::Claimed(claim) = store.claim_token(&token, None, lease).await? else { unreachable!() };
/// assert_eq!(store.claim_token(&token, None, lease).await?, TokenClaim::InUse);
/// assert!(store.return_token(&claim).await?); // the route failed: usable again
/// let TokenClaim::Claimed(claim) = store.claim_token(&token, None, lease).await? else { unreachable!() };
/// assert!(store.spend_token(&claim).await?);
/// assert_eq!(store.claim_token(&token, None, lease).await?, TokenClaim::Unknown);
///
/// // Bound to a caller: nobody else takes it.
/// let mine = store.issue_token(Some("alice"), Duration::from_secs(60)).await?;
/// assert_eq!(store.claim_token(&mine, Some("bob"), lease).await?, TokenClaim::Unknown);
/// assert!(matches!(store.claim_token(&mine, Some("alice"), lease).await?, TokenClaim::Claimed(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenClaim {
    /// The token was fresh and is now this caller's: run, then spend or return it.
    Claimed(Claim),
    /// Another request holds the token and has not finished.
    InUse,
    /// The request that claimed the token neither spent nor returned it
    /// before its lease ran out (its instance died): whether its work ran is
    /// unknown. The token counts as spent.
    OutcomeUnknown,
    /// The token is unknown, expired or spent.
    Unknown,
}

/// The answer of [`IdempotencyStore::begin`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Begin {
    /// The key was free and is now ours: run the handler, then complete or abandon.
    New(Claim),
    /// Another request holds the key and has not finished.
    InProgress,
    /// A request with this key and fingerprint finished; here is its response.
    Completed(StoredResponse),
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The claim's lease ran out unsettled (its instance died): whether its
    /// work ran is unknown. Final for the record's TTL: check, then use a
    /// new key.
    OutcomeUnknown,
}

/// How long a claim of [`IdempotencyStore::begin`] lasts unrenewed
/// (`lease`: how long a dead instance's claim answers "in progress"), how
/// long its record lives (`ttl`, default 24 h), and what a retry gets after
/// the lease: [`Begin::OutcomeUnknown`], or a new run with
/// [`run_again_after_lease`](Self::run_again_after_lease).
///
/// ```
/// use std::time::Duration;
/// use dlock_core::idempotency::ClaimTerms;
/// let terms = ClaimTerms::new(Duration::from_secs(10)).with_ttl(Duration::from_secs(3600));
/// assert_eq!((terms.lease(), terms.ttl(), terms.runs_again_after_lease()), (Duration::from_secs(10), Duration::from_secs(3600), false));
/// assert!(terms.run_again_after_lease().runs_again_after_lease());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimTerms {
    lease: Duration,
    ttl: Duration,
    run_again: bool,
}

impl ClaimTerms {
    /// A claim of `lease`, in a record that lives 24 hours.
    pub fn new(lease: Duration) -> Self {
        ClaimTerms { lease, ttl: Duration::from_secs(24 * 3600), run_again: false }
    }

    /// How long the record lives; never shorter than the lease.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// A claim whose lease ran out is taken afresh, for a route whose work
    /// is itself idempotent.
    pub fn run_again_after_lease(mut self) -> Self {
        self.run_again = true;
        self
    }

    /// The claim's lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How long the record lives (at least the lease).
    pub fn ttl(&self) -> Duration {
        self.ttl.max(self.lease)
    }

    /// Whether a claim whose lease ran out is taken afresh.
    pub fn runs_again_after_lease(&self) -> bool {
        self.run_again
    }
}

/// Proof of a [`Begin::New`] or a [`TokenClaim::Claimed`]: which key (or
/// token), and the random owner that claimed it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::idempotency::{Begin, IdempotencyStore, MemoryStore};
/// let store = MemoryStore::new();
/// let terms = dlock_core::idempotency::ClaimTerms::new(std::time::Duration::from_secs(5));
/// let Begin::New(claim) = store.begin("s", "k", "fp", terms).await? else { unreachable!() };
/// assert_eq!((claim.scope(), claim.key()), ("s", "k"));
/// assert!(store.abandon(&claim).await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    scope: String,
    key: String,
    owner: String,
    of: Of,
    /// What the store needs to settle it (Redis: fingerprint and bucket).
    memo: String,
}

/// What a [`Claim`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Of {
    /// An idempotency key's record.
    Key,
    /// A one-time token, bound to its scope as principal or not.
    Token { bound: bool },
}

impl Claim {
    fn new(scope: &str, key: &str) -> Result<Self> {
        let owner = crate::owner::random_hex::<TOKEN_BYTES>()?;
        Ok(Claim { scope: scope.to_owned(), key: key.to_owned(), owner, of: Of::Key, memo: String::new() })
    }

    fn token(token: &str, principal: Option<&str>) -> Result<Self> {
        let owner = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let of = Of::Token { bound: principal.is_some() };
        Ok(Claim {
            scope: principal.unwrap_or_default().to_owned(),
            key: token.to_owned(),
            owner,
            of,
            memo: String::new(),
        })
    }

    /// The claim of `owner`, as the store recorded it: for an operator's
    /// release of a claim whose request is gone.
    fn owned_by(mut self, owner: String) -> Self {
        self.owner = owner;
        self
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    fn with_memo(mut self, memo: String) -> Self {
        self.memo = memo;
        self
    }

    /// The scope the key was claimed in (a token's principal, or empty).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The idempotency key, or the one-time token.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// For a token's claim, the caller it was bound to.
    pub fn principal(&self) -> Option<&str> {
        matches!(self.of, Of::Token { bound: true }).then_some(self.scope.as_str())
    }

    /// Whether this is the claim of a one-time token (else of a key).
    pub fn is_token(&self) -> bool {
        matches!(self.of, Of::Token { .. })
    }

    /// The random id of the claiming request.
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

/// A response as stored for replay: status, selected headers, body.
///
/// ```
/// use dlock_core::idempotency::StoredResponse;
/// let r = StoredResponse::new(201, vec![("content-type".into(), b"application/json".to_vec())], b"{}".to_vec());
/// assert_eq!(StoredResponse::decode(&r.encode()).expect("round trip"), r);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header names (lower case) and raw values, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A response from its parts.
    pub fn new(status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Self {
        StoredResponse { status, headers, body }
    }

    /// A self-delimiting binary form: status, header count, length-prefixed
    /// names and values, then the body.
    pub fn encode(&self) -> Vec<u8> {
        let size = 6 + self.headers.iter().map(|(n, v)| 8 + n.len() + v.len()).sum::<usize>() + self.body.len();
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(&self.status.to_be_bytes());
        out.extend_from_slice(&len32(self.headers.len()).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&len32(name.len()).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&len32(value.len()).to_be_bytes());
            out.extend_from_slice(value);
        }
        out.extend_from_slice(&self.body);
        out
    }

    /// The inverse of [`StoredResponse::encode`].
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the bytes are not a stored response (a
    /// foreign value under our key).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = || Error::backend("idempotency", "a stored response is corrupt");
        let mut rest = bytes;
        let mut take = |n: usize| -> Result<&[u8]> {
            if rest.len() < n {
                return Err(bad());
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u32_of = |b: &[u8]| -> Result<usize> {
            let arr: [u8; 4] = b.try_into().map_err(|_| bad())?;
            Ok(u32::from_be_bytes(arr) as usize)
        };
        let status = u16::from_be_bytes(take(2)?.try_into().map_err(|_| bad())?);
        let count = u32_of(take(4)?)?;
        let mut headers = Vec::with_capacity(count.min(64));
        for _ in 0..count {
            let n = u32_of(take(4)?)?;
            let name = String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())?;
            let v = u32_of(take(4)?)?;
            headers.push((name, take(v)?.to_vec()));
        }
        let body = rest.to_vec();
        Ok(StoredResponse { status, headers, body })
    }
}

fn len32(n: usize) -> u32 {
    // Headers and bodies above 4 GiB are refused long before (body limit).
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A fingerprint of request parts (method, path, [`canonical_body`]): SHA-1
/// over the length-prefixed parts. SHA-1 suffices: a collision could only
/// replay the caller's own response under its own key.
///
/// ```
/// use dlock_core::idempotency::fingerprint;
/// assert_ne!(fingerprint(&["ab", "c"]), fingerprint(&["a", "bc"]));
/// assert_eq!(fingerprint(&["POST"]).len(), 40);
/// ```
pub fn fingerprint<P: AsRef<[u8]>>(parts: &[P]) -> String {
    let mut h = sha1_smol::Sha1::new();
    for p in parts {
        let p = p.as_ref();
        h.update(&(p.len() as u64).to_be_bytes());
        h.update(p);
    }
    h.digest().to_string()
}

/// Gives back, in the background and owner-checked, a claim whose answer
/// was lost, retried until the store answers or `lease` ends: the request
/// was told to retry, so the key must not stay blocked for a lease.
#[cfg(any(feature = "redis", feature = "postgres"))]
fn give_back_later<S: IdempotencyStore + Clone>(store: &S, claim: Claim, lease: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let store = store.clone();
    runtime.spawn(async move {
        let deadline = tokio::time::Instant::now() + lease;
        let mut pause = Duration::from_millis(50);
        loop {
            let given_back =
                if claim.is_token() { store.return_token(&claim).await } else { store.abandon(&claim).await };
            match given_back {
                Ok(freed) => {
                    tracing::debug!(freed, "dlock: an idempotency claim whose answer was lost is given back");
                    return;
                }
                Err(e) if tokio::time::Instant::now() + pause >= deadline => {
                    tracing::warn!(error = %e, "dlock: giving back an idempotency claim whose answer was lost failed until its lease ended");
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    });
}

/// Whether `token` has the shape we issue (32 lower-case hex).
pub(crate) fn token_well_formed(token: &str) -> bool {
    token.len() == TOKEN_BYTES * 2 && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_records_are_errors_not_panics() {
        assert!(StoredResponse::decode(&[0]).is_err());
        assert!(StoredResponse::decode(&[0, 200, 0, 0, 0, 9]).is_err());
        let r = StoredResponse::new(200, vec![("a".into(), vec![])], vec![]);
        assert_eq!(StoredResponse::decode(&r.encode()).expect("decode"), r);
    }

    #[test]
    fn token_shape() {
        assert!(token_well_formed(&"a".repeat(32)));
        assert!(!token_well_formed("A".repeat(32).as_str()));
        assert!(!token_well_formed("abc"));
    }
}
