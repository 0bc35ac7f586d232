//! Request idempotency stores: one-time tokens and `Idempotency-Key` records.
//!
//! * **Tokens** — [`IdempotencyStore::issue_token`] makes a 128-bit token from
//!   the OS CSPRNG that lives for a TTL. A request
//!   [`claim_token`](IdempotencyStore::claim_token)s it in one atomic step,
//!   so of any number of concurrent submits exactly one gets the claim (never
//!   GET-then-write: two callers could both see it fresh), and then either
//!   [`spend_token`](IdempotencyStore::spend_token)s it (its route ran to a
//!   result) or [`return_token`](IdempotencyStore::return_token)s it (the
//!   route did not run, or failed).
//! * **Keys** — [`IdempotencyStore::begin`] claims `(scope, key)` atomically
//!   and answers [`Begin::New`] (run the handler), [`Begin::InProgress`],
//!   [`Begin::Completed`] (the stored response), [`Begin::Mismatch`] (same
//!   key, other request) or [`Begin::OutcomeUnknown`]. The in-progress record
//!   carries a lease that its request [`renew`](IdempotencyStore::renew)s
//!   while the route runs, so a claim whose instance died is settled when
//!   the lease ends ([`ClaimTerms`]): the key then answers "outcome unknown"
//!   (or runs again, if the route chose that). [`IdempotencyStore::complete`]
//!   stores the response for a TTL and [`IdempotencyStore::abandon`] frees the
//!   key. Both check the [`Claim`]'s owner, so a request whose claim was taken
//!   over cannot overwrite the record of the request that took it.
//!
//! [`MemoryStore`] serves one process; [`RedisStore`] shares records between
//! instances (single server, Cluster or Sentinel URLs, as the lock backend).
//! Both bound what lives, per caller and in total ([`IdempotencyLimits`]).
//! [`Config::build`](crate::Config::build) picks one.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
//! use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, MemoryStore, StoredResponse, TokenClaim};
//! use std::time::Duration;
//!
//! let store = MemoryStore::new();
//! let token = store.issue_token(Duration::from_secs(60)).await?;
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
pub use memory::MemoryStore;

/// Random bytes in a token: 128 bits, shown as 32 hex characters.
pub const TOKEN_BYTES: usize = 16;

/// How much a store keeps: live records and tokens, and the bytes of the
/// stored answers, per caller and in total.
///
/// Without a bound, any client that can send an `Idempotency-Key` (or fetch
/// a token) makes a record that lives for the TTL (24 hours by default):
/// enough of them fill the Redis the records live in, and a full Redis
/// refuses every lock (`noeviction`) or evicts held ones (`volatile-*`). So
/// a store counts what lives:
///
/// * **records** of one caller (the scope of a key) up to
///   [`max_per_scope`](Self::max_per_scope), and in all up to
///   [`max_records`](Self::max_records): a new key beyond either is refused
///   ([`Error::IdempotencyFull`]: `429` or `503` over HTTP, with
///   `Retry-After`);
/// * the **bytes** of their stored answers, per caller up to
///   [`max_bytes_per_scope`](Self::max_bytes_per_scope) and in all up to
///   [`max_bytes`](Self::max_bytes): an answer that does not fit is refused
///   by [`IdempotencyStore::complete`] (the HTTP layer then delivers it and
///   keeps a "not stored" record instead);
/// * **tokens bound to a caller**, per caller and in total, apart from the
///   records, with the same two counts;
/// * **unbound tokens** (issued to callers nobody identified) in a pool of
///   their own, [`max_unbound_tokens`](Self::max_unbound_tokens): a flood
///   of anonymous token requests fills that pool only, never the records
///   or the tokens of identified callers. On Redis Cluster this pool lives
///   in one slot, so it is enforced there too.
///
/// A record or token that is already there is still answered at the cap (a
/// retry is replayed), and an abandoned, consumed or spent one stops
/// counting at once; one that expires stops counting within a 64th of its
/// TTL on Redis (the counts are never below what lives), at once in memory.
///
/// The defaults (`DLOCK_IDEMPOTENCY_MAX_PER_SCOPE`, `…_MAX_RECORDS`,
/// `…_MAX_BYTES_PER_SCOPE`, `…_MAX_BYTES`, `…_MAX_UNBOUND_TOKENS`): 10 000
/// records and 64 MiB of answers per caller, a million records and 1 GiB
/// in all, 100 000 unbound tokens. Size Redis's `maxmemory` above the bytes
/// total plus about 200 bytes per record, or lower the caps. On Redis
/// Cluster each total is split into 16 pools, one per slot group of
/// callers, whose caps add up to it: one pool may refuse before the total
/// is reached.
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

/// A store of one-time tokens and idempotency-key records.
///
/// Dyn-compatible: the HTTP layer holds an `Arc<dyn IdempotencyStore>`.
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
    /// round trip, nothing written. An error says why not.
    fn ready(&self) -> BoxFuture<'_, Result<()>>;

    /// Issues a fresh token that can be consumed once within `ttl`;
    /// [`Error::IdempotencyFull`] when the store holds as many tokens as its
    /// [`IdempotencyLimits`] allow.
    fn issue_token<'a>(&'a self, ttl: Duration) -> BoxFuture<'a, Result<String>>;

    /// Issues a fresh token bound to `principal` (a caller: a hashed
    /// credential, a user id): only a claim naming the same principal takes it.
    fn issue_bound_token<'a>(&'a self, principal: &'a str, ttl: Duration) -> BoxFuture<'a, Result<String>>;

    /// Claims a fresh `token` for a request about to run, atomically: of any
    /// number of concurrent callers exactly one gets [`TokenClaim::Claimed`],
    /// the others [`TokenClaim::InUse`] until it is spent or returned. The
    /// token keeps its TTL; the claim holds for `lease` unless
    /// [`renew`](Self::renew)ed, and a claim whose lease ran out (its
    /// instance died) is never returned: the token then answers
    /// [`TokenClaim::OutcomeUnknown`] (it counts as spent). `principal` is
    /// the caller a token was bound to ([`issue_bound_token`](Self::issue_bound_token)),
    /// `None` for an unbound one; a token bound to another principal is
    /// [`TokenClaim::Unknown`]. A claim whose answer was lost (a timeout) is
    /// given back by the store itself, owner-checked, in the background.
    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>>;

    /// Spends a token this caller claimed. `Ok(false)` when it was no
    /// longer its claim (it expired).
    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;

    /// Gives a token this caller claimed back, fresh, with the rest of its
    /// TTL, so that a retry can use it. `Ok(false)` when it could not be (it
    /// is no longer this claim's, or it expired).
    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;

    /// Claims `key` within `scope` for a request whose `fingerprint` is given,
    /// with an in-progress record on the [`ClaimTerms`]: it lives for their
    /// TTL, and its claim for their lease unless [`renew`](Self::renew)ed. A
    /// key that has a record is answered from it (an in-progress one whose
    /// lease ran out: [`Begin::OutcomeUnknown`], or claimed afresh when the
    /// terms say [`run_again_after_lease`](ClaimTerms::run_again_after_lease));
    /// a new one beyond the [`IdempotencyLimits`] of `scope` or of the store
    /// is [`Error::IdempotencyFull`] (nothing is stored).
    ///
    /// A store whose answer was lost (a timeout, a broken connection) gives
    /// a claim that may have been made back by itself, owner-checked, in the
    /// background: the key is not blocked for a lease by a request that was
    /// told to retry.
    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>>;

    /// Extends a claim's lease — of a key ([`begin`](Self::begin)) or of a
    /// token ([`claim_token`](Self::claim_token)) — to `lease` from now,
    /// while its route runs. `Ok(false)` when the claim is no longer ours or
    /// its lease has already run out (a retry may have been told the outcome
    /// is unknown).
    ///
    /// The default (for stores that cannot) answers `Ok(false)`: such a
    /// claim keeps the lease [`begin`](Self::begin) gave it.
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        let _ = (claim, lease);
        Box::pin(async { Ok(false) })
    }

    /// Stores the response of a claimed key; the record keeps the TTL its
    /// [`ClaimTerms`] gave it (it lives that long from its claim).
    /// `Ok(false)` when the claim is no longer ours (its lease ran out and
    /// another request took it over); [`Error::IdempotencyFull`] when the
    /// answer's bytes do not fit the [`IdempotencyLimits`] (nothing is
    /// stored and the claim stays: store a smaller answer, or abandon it).
    fn complete<'a>(&'a self, claim: &'a Claim, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool>>;

    /// Frees a claimed key so that a retry runs again. `Ok(false)` when the
    /// claim is no longer ours.
    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>>;
}

/// The answer of [`IdempotencyStore::claim_token`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{IdempotencyStore, MemoryStore, TokenClaim};
/// let (store, lease) = (MemoryStore::new(), Duration::from_secs(10));
/// let token = store.issue_token(Duration::from_secs(60)).await?;
/// let TokenClaim::Claimed(claim) = store.claim_token(&token, None, lease).await? else { unreachable!() };
/// assert_eq!(store.claim_token(&token, None, lease).await?, TokenClaim::InUse);
/// assert!(store.return_token(&claim).await?); // the route failed: usable again
/// let TokenClaim::Claimed(claim) = store.claim_token(&token, None, lease).await? else { unreachable!() };
/// assert!(store.spend_token(&claim).await?);
/// assert_eq!(store.claim_token(&token, None, lease).await?, TokenClaim::Unknown);
///
/// // Bound to a caller: nobody else takes it.
/// let mine = store.issue_bound_token("alice", Duration::from_secs(60)).await?;
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
///
/// `#[non_exhaustive]`: a later store may answer more (a record kept without
/// its response, say), so a caller outside this crate keeps an arm for what
/// it does not know.
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
    /// The request that claimed the key neither completed nor gave it back
    /// before its lease ran out (its instance died, or its store stalled):
    /// whether its work ran is unknown. Final for the record's TTL: the
    /// client must check what happened and use a new key.
    OutcomeUnknown,
}

/// How long a claim made by [`IdempotencyStore::begin`] lasts, and what a
/// retry gets once it has run out without an answer.
///
/// * `lease` — how long the claim holds without a renewal: the layer renews
///   it while the route runs, so this bounds how long a dead instance's
///   claim answers "in progress", not how long a route may take.
/// * `ttl` — how long the record lives (default 24 h, as a stored answer):
///   a claim whose lease ran out answers [`Begin::OutcomeUnknown`] that long.
/// * after the lease — [`Begin::OutcomeUnknown`] by default (exactly once
///   over "at least once": the work may have run); or, for a route whose
///   work is itself idempotent, [`run_again_after_lease`](Self::run_again_after_lease).
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
    /// A claim that holds for `lease` unless renewed, in a record that lives
    /// 24 hours.
    pub fn new(lease: Duration) -> Self {
        ClaimTerms { lease, ttl: Duration::from_secs(24 * 3600), run_again: false }
    }

    /// How long the record lives; never shorter than the lease.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// A claim whose lease ran out is taken afresh by the next request,
    /// which runs the route again.
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
    /// What the store that made the claim needs to settle it (the Redis
    /// store: the stored fingerprint and the record's pool bucket).
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
    /// names and values, then the body (no serde in dlock-core).
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

/// A fingerprint of request parts (e.g. method, path, body): SHA-1 over the
/// length-prefixed parts, so `["ab", "c"]` and `["a", "bc"]` differ.
///
/// SHA-1 is enough here: the fingerprint only tells one caller's retries
/// apart from a different request under the same key in the caller's own
/// scope; a collision could only replay the caller's own response.
///
/// A JSON body goes in as its [`canonical_body`], so that key order and
/// whitespace do not make a retry another request.
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

/// Gives `claim` back in the background (abandons a key's, returns a
/// token's) after the answer to the request that made it was lost (a
/// timeout, a broken connection), until the store answers or the claim's
/// `lease` ends, so that the key or token is not blocked for a lease by a
/// request that was told to retry. Owner-checked: a claim that was never
/// made, or was taken over, is left alone. Each store sends it where it
/// lands after the claim (the Redis store: on the claim's connection; the
/// PostgreSQL store: behind the key's advisory lock).
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

/// Whether `token` has the shape of one we issue (32 lower-case hex), so
/// that junk never reaches the store as a key.
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
