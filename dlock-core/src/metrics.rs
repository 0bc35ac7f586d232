//! Metrics through the [`metrics`](https://docs.rs/metrics/0.24) facade,
//! with the `metrics` feature: dlock records, the application installs the
//! recorder it likes (Prometheus, OpenTelemetry, StatsD) and dlock never
//! chooses an exporter. Without the feature none of this is compiled and
//! the engine reads no extra clock.
//!
//! | Name | Kind | Unit | Labels |
//! |---|---|---|---|
//! | `dlock.lock.acquire.duration` | histogram | s | `dlock.lock.name`, `dlock.backend`, `dlock.lock.mode`, `dlock.outcome` |
//! | `dlock.lock.hold.duration` | histogram | s | name, backend, mode, `dlock.release` (`released`, `lost`) |
//! | `dlock.lock.held` | gauge | {lock} | name, backend, mode |
//! | `dlock.lock.waiting` | gauge | {request} | name, backend, mode |
//! | `dlock.lock.lost` | counter | {lock} | name, backend, mode, `dlock.lost.reason` |
//! | `dlock.lock.renewals` | counter | {renewal} | backend, `dlock.outcome` (`renewed`, `failed`, `lost`) |
//! | `dlock.backend.operation.duration` | histogram | s | backend, `dlock.operation` (`acquire`, `release`, `renew`, `withdraw`) |
//! | `dlock.http.refusals` | counter | {request} | `dlock.lock.name` (the route's lock, or the idempotency face), `error` (the answer's code) |
//! | `dlock.idempotency.requests` | counter | {request} | `dlock.face` (`idempotency_key`, `token`), `dlock.outcome` (`executed`, `replayed`, `in_progress`, `mismatch`, `outcome_unknown`, `not_stored`, `refused`) |
//! | `dlock.idempotency.records`, `….records.limit` | gauge | {record} | `dlock.store` |
//! | `dlock.idempotency.bytes`, `….bytes.limit` | gauge | By | `dlock.store` |
//!
//! `dlock.http.refusals` and `dlock.idempotency.requests` are recorded by
//! `dlock-axum` (its `metrics` feature); the store's gauges by
//! [`record_store_usage`], which the application calls when it is scraped.
//!
//! `dlock.outcome` of an acquire is one of `acquired`, `busy` (held, no
//! wait), `timeout` (held past the wait), `cancelled` (the caller gave up),
//! `unavailable` (the service did not answer), `refused` (a mode that does
//! not fit the key, a bad argument) or `error`. The count of each is the
//! histogram's count. An acquire answered on the spot, waiting for nothing
//! (an in-process lock), is recorded as 0 s, with no clock read. A hold's time runs from its grant to the end of its
//! release (re-entries share one hold); a lost hold is counted once, when
//! its last guard goes, with the reason its guards were given.
//!
//! Labels are bounded: the lock *name* (`order.create`, never a key's
//! parts), the backend, the mode and the outcome. Past
//! [`MAX_LOCK_NAMES`] names in one [`Locker`](crate::Locker) the others
//! are counted under `dlock.lock.name = "_other"`.
//!
//! Handles are registered once per lock name and mode, on first use: install
//! the recorder before the first lock is taken. A recorder that panics
//! loses its figure, never the lock. `docs/operations.md` says what to
//! alert on.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
//! // In the app: install a recorder (here the `metrics` crate's no-op one), then describe.
//! dlock_core::metrics::describe();
//! let locker = dlock_core::Locker::new(dlock_core::MemoryBackend::new());
//! let key = locker.key("order.create").part(42).build()?;
//! locker.try_acquire(&key).await?.release().await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "metrics")]
mod on;
#[cfg(feature = "metrics")]
pub use on::describe;
#[cfg(feature = "metrics")]
pub(crate) use on::{HoldMeter, LockMeter, Meters, Stopwatch};

#[cfg(not(feature = "metrics"))]
mod off;
#[cfg(not(feature = "metrics"))]
pub use off::describe;
#[cfg(not(feature = "metrics"))]
pub(crate) use off::{HoldMeter, LockMeter, Meters, Stopwatch};

/// Whether this build records anything (the `metrics` feature).
pub(crate) const RECORDS: bool = cfg!(feature = "metrics");

/// How many lock names one [`Locker`](crate::Locker) labels apart; the
/// rest share `dlock.lock.name = "_other"`, so a name built from request
/// values cannot grow the exporter without bound.
pub const MAX_LOCK_NAMES: usize = 256;

/// `dlock.lock.acquire.duration`: how long each acquire took, by outcome.
pub const ACQUIRE_DURATION: &str = "dlock.lock.acquire.duration";
/// `dlock.lock.hold.duration`: grant to the end of the release.
pub const HOLD_DURATION: &str = "dlock.lock.hold.duration";
/// `dlock.lock.held`: holds of this process now.
pub const HELD: &str = "dlock.lock.held";
/// `dlock.lock.waiting`: acquires that wait now.
pub const WAITING: &str = "dlock.lock.waiting";
/// `dlock.lock.lost`: holds that ended lost, by reason.
pub const LOST: &str = "dlock.lock.lost";
/// `dlock.lock.renewals`: the watchdog's renewals, by outcome.
pub const RENEWALS: &str = "dlock.lock.renewals";
/// `dlock.backend.operation.duration`: one request to the service.
pub const BACKEND_OPERATION_DURATION: &str = "dlock.backend.operation.duration";

/// `dlock.http.refusals`: requests dlock-axum refused, by `error` code.
pub const HTTP_REFUSALS: &str = "dlock.http.refusals";
/// `dlock.idempotency.requests`: idempotent requests, by outcome.
pub const IDEMPOTENCY_REQUESTS: &str = "dlock.idempotency.requests";

/// `dlock.idempotency.records`: records an idempotency store counts
/// against its caps ([`record_store_usage`]); `….limit` the cap.
pub const IDEMPOTENCY_RECORDS: &str = "dlock.idempotency.records";
/// `dlock.idempotency.bytes`: bytes of stored answers against the cap.
pub const IDEMPOTENCY_BYTES: &str = "dlock.idempotency.bytes";

/// Reads what `store` keeps against its totals
/// ([`IdempotencyStore::usage`](crate::idempotency::IdempotencyStore::usage))
/// and, with the `metrics` feature, sets the gauges
/// `dlock.idempotency.records`, `dlock.idempotency.bytes` and their
/// `.limit`s (label `dlock.store`). One cheap read of the store: call it
/// when the metrics are scraped, and alert on a store near its cap.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::idempotency::MemoryStore;
/// let usage = dlock_core::metrics::record_store_usage(&MemoryStore::new()).await?;
/// assert_eq!(usage.records, 0);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// The store's, when it cannot be asked.
pub async fn record_store_usage<S: crate::idempotency::IdempotencyStore + ?Sized>(
    store: &S,
) -> crate::Result<crate::idempotency::Usage> {
    let usage = store.usage(None).await?;
    #[cfg(feature = "metrics")]
    on::store_usage(store.name(), &usage);
    Ok(usage)
}

/// What one backend request was, for [`BACKEND_OPERATION_DURATION`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Acquire,
    Release,
    Renew,
    Withdraw,
}

/// How an acquire ended, for [`ACQUIRE_DURATION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Acquired,
    Busy,
    Timeout,
    Cancelled,
    Unavailable,
    Refused,
    Error,
}

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
impl Outcome {
    const ALL: [Outcome; 7] = [
        Outcome::Acquired,
        Outcome::Busy,
        Outcome::Timeout,
        Outcome::Cancelled,
        Outcome::Unavailable,
        Outcome::Refused,
        Outcome::Error,
    ];

    pub(crate) fn of<T>(result: &crate::Result<T>) -> Outcome {
        use crate::Error;
        match result {
            Ok(_) => Outcome::Acquired,
            Err(Error::Busy { .. }) => Outcome::Busy,
            Err(Error::Timeout { .. }) => Outcome::Timeout,
            Err(Error::Cancelled) => Outcome::Cancelled,
            Err(e) if e.is_unavailable() => Outcome::Unavailable,
            Err(Error::ModeConflict { .. } | Error::InvalidArgument { .. } | Error::InvalidKey(_)) => Outcome::Refused,
            Err(_) => Outcome::Error,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Busy => "busy",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Unavailable => "unavailable",
            Outcome::Refused => "refused",
            Outcome::Error => "error",
        }
    }
}

/// The `dlock.lock.mode` label.
pub(crate) fn mode_label(mode: crate::LockMode) -> &'static str {
    match mode {
        crate::LockMode::Exclusive => "exclusive",
        crate::LockMode::Shared => "shared",
        crate::LockMode::Permits { .. } => "semaphore",
    }
}

/// The `dlock.lost.reason` label.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn lost_label(reason: crate::LostReason) -> &'static str {
    use crate::LostReason;
    match reason {
        LostReason::Stolen => "stolen",
        LostReason::RenewalFailed => "renewal_failed",
        LostReason::LeaseExpired => "lease_expired",
        LostReason::SessionExpired => "session_expired",
        LostReason::MaxHoldExceeded => "max_hold_exceeded",
    }
}
