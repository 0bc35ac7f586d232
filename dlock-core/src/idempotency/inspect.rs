//! What an operator asks of an idempotency store: a key's record
//! ([`RecordView`]), the claims stuck past their lease
//! ([`IdempotencyStore::stuck_records`]), what a caller keeps against the
//! caps ([`Usage`]), and a stuck claim released on purpose
//! ([`release_claim`]), audited at WARN as a forced unlock is.

use std::fmt;
use std::time::Duration;

use super::{Claim, IdempotencyStore};
use crate::error::{Error, Result};

/// One `Idempotency-Key` record as an operator sees it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, MemoryStore, RecordState};
/// let store = MemoryStore::new();
/// let Begin::New(_claim) = store.begin("alice", "k1", "fp", ClaimTerms::new(Duration::from_secs(10))).await? else {
///     unreachable!()
/// };
/// let record = store.inspect_record("alice", "k1").await?.expect("claimed");
/// assert!(matches!(record.state, RecordState::InProgress { .. }));
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct RecordView {
    /// The caller it belongs to.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// Claimed, stuck, or completed.
    pub state: RecordState,
    /// Since its claim. `None` where the claim's time was not kept: a
    /// completed record on Redis (its answer replaced the claim), a record
    /// written by an earlier version.
    pub age: Option<Duration>,
    /// The bytes of its stored answer, as the caps count them.
    pub bytes: u64,
    /// How long the record lives on (its TTL left).
    pub expires_in: Duration,
    /// The claim's owner, to release it; never shown.
    claimant: Option<String>,
}

impl RecordView {
    /// A record of `(scope, key)` in `state`, living `expires_in` more.
    pub(crate) fn new(scope: &str, key: &str, state: RecordState, bytes: u64, expires_in: Duration) -> Self {
        RecordView { scope: scope.to_owned(), key: key.to_owned(), state, age: None, bytes, expires_in, claimant: None }
    }

    /// Claimed by the request whose claim's owner is `owner`.
    pub(crate) fn claimed_by(mut self, owner: impl Into<String>) -> Self {
        self.claimant = Some(owner.into());
        self
    }

    /// Claimed `age` ago.
    pub(crate) fn with_age(mut self, age: Duration) -> Self {
        self.age = Some(age);
        self
    }

    /// Whether its request neither completed nor gave it back before its
    /// lease ran out: a retry is answered "outcome unknown".
    pub fn is_stuck(&self) -> bool {
        self.state == RecordState::OutcomeUnknown
    }
}

impl fmt::Debug for RecordView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordView")
            .field("scope", &self.scope)
            .field("key", &self.key)
            .field("state", &self.state)
            .field("age", &self.age)
            .field("bytes", &self.bytes)
            .field("expires_in", &self.expires_in)
            .finish_non_exhaustive()
    }
}

/// Where a record's request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// A request holds the key and runs; `lease_left` until a retry is
    /// answered "outcome unknown", `None` while it is held by the route's
    /// own transaction (PostgreSQL's `begin_in`).
    InProgress {
        /// The claim's lease left.
        lease_left: Option<Duration>,
    },
    /// Its request neither completed nor gave it back before its lease
    /// ran out (its instance died): stuck until the record expires or an
    /// operator releases it ([`release_claim`]).
    OutcomeUnknown,
    /// Its answer is stored and replayed.
    Completed {
        /// The stored answer's status.
        status: u16,
    },
}

/// What a caller (or the whole store) keeps against its caps. The counts
/// may include records that expired and were not swept yet (the caps count
/// them until then), never fewer than live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Usage {
    /// Records counted.
    pub records: u64,
    /// Bytes of stored answers counted.
    pub bytes: u64,
    /// The cap on records ([`IdempotencyLimits`](super::IdempotencyLimits)).
    pub max_records: u64,
    /// The cap on bytes.
    pub max_bytes: u64,
}

impl Usage {
    /// `records` and `bytes` held to `max_records` and `max_bytes`.
    pub(crate) fn new(records: u64, bytes: u64, max_records: u64, max_bytes: u64) -> Self {
        Usage { records, bytes, max_records, max_bytes }
    }
}

/// A record's request as logs name it: a short hash of its caller and key
/// (an `Idempotency-Key` may be a secret the client chose).
fn log_id(scope: &str, key: &str) -> String {
    let id = super::fingerprint(&[scope, key]);
    format!("idem#{}", &id[..12])
}

/// Releases the claim on `(scope, key)` on purpose, so that a retry runs:
/// a request stuck past its lease (outcome unknown), or one still in
/// progress that an operator knows is dead. Logged at WARN
/// (`dlock.idempotency.release_claim`, target `dlock::audit`) with the
/// record's hash, its state and the reason. Returns the record it released,
/// `None` when there was no claim to release (no record, or it completed:
/// a stored answer is not a claim).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{release_claim, Begin, ClaimTerms, IdempotencyStore, MemoryStore};
/// let store = MemoryStore::new();
/// let terms = ClaimTerms::new(Duration::from_secs(10));
/// let Begin::New(_dead) = store.begin("alice", "k1", "fp", terms).await? else { unreachable!() };
/// assert!(release_claim(&store, "alice", "k1", "INC-7: its instance died").await?.is_some());
/// assert!(matches!(store.begin("alice", "k1", "fp", terms).await?, Begin::New(_)));
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty reason; the store's when it
/// cannot be asked.
pub async fn release_claim<S: IdempotencyStore + ?Sized>(
    store: &S,
    scope: &str,
    key: &str,
    reason: &str,
) -> Result<Option<RecordView>> {
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(Error::invalid_argument("reason", "a released claim is audited: say why"));
    }
    let Some(record) = store.inspect_record(scope, key).await? else { return Ok(None) };
    let Some(owner) = record.claimant.clone().filter(|_| !matches!(record.state, RecordState::Completed { .. })) else {
        return Ok(None);
    };
    let claim = Claim::new(scope, key)?.owned_by(owner);
    let outcome = store.abandon(&claim).await;
    tracing::warn!(
        target: "dlock::audit",
        record = %log_id(scope, key),
        store = store.name(),
        state = ?record.state,
        reason,
        outcome = match &outcome {
            Ok(true) => "released",
            Ok(false) => "not claimed any more",
            Err(_) => "failed",
        },
        "dlock.idempotency.release_claim"
    );
    Ok(outcome?.then_some(record))
}
