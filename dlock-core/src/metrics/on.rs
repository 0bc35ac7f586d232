//! The engine's meters, with the `metrics` feature: handles registered once
//! per lock name and mode, so a lock cycle costs handle updates, not
//! recorder lookups.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, RwLock};

use ::metrics::{Counter, Gauge, Histogram, Unit};
use tokio::time::Instant;

use super::{lost_label, mode_label, Op, Outcome, MAX_LOCK_NAMES};
use crate::{LockKey, LockMode, LostReason};

/// Describes every dlock metric (unit and meaning) to the installed
/// recorder. Each [`Locker`](crate::Locker) does it when it is made; call
/// it yourself if the recorder came later.
pub fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram};
    quietly(|| {
        describe_histogram!(super::ACQUIRE_DURATION, Unit::Seconds, "How long an acquire took, by outcome");
        describe_histogram!(super::HOLD_DURATION, Unit::Seconds, "From a lock's grant to the end of its release");
        describe_gauge!(super::HELD, Unit::Count, "Locks this process holds now");
        describe_gauge!(super::WAITING, Unit::Count, "Acquires waiting for a lock now");
        describe_counter!(super::LOST, Unit::Count, "Holds that ended lost, by reason");
        describe_counter!(super::RENEWALS, Unit::Count, "The watchdog's lease renewals, by outcome");
        describe_histogram!(super::BACKEND_OPERATION_DURATION, Unit::Seconds, "One request to the lock service");
        describe_counter!(super::HTTP_REFUSALS, Unit::Count, "Requests dlock refused, by error code");
        describe_counter!(super::IDEMPOTENCY_REQUESTS, Unit::Count, "Idempotent requests, by outcome");
        describe_gauge!(super::IDEMPOTENCY_RECORDS, Unit::Count, "Records an idempotency store counts against its cap");
        describe_gauge!(super::IDEMPOTENCY_BYTES, Unit::Bytes, "Bytes of stored answers against the store's cap");
    });
}

/// Sets the store's gauges to `usage` (`super::record_store_usage`).
pub(super) fn store_usage(store: &'static str, usage: &crate::idempotency::Usage) {
    quietly(|| {
        let gauge = |name: String, value: u64| ::metrics::gauge!(name, "dlock.store" => store).set(value as f64);
        gauge(super::IDEMPOTENCY_RECORDS.to_owned(), usage.records);
        gauge(format!("{}.limit", super::IDEMPOTENCY_RECORDS), usage.max_records);
        gauge(super::IDEMPOTENCY_BYTES.to_owned(), usage.bytes);
        gauge(format!("{}.limit", super::IDEMPOTENCY_BYTES), usage.max_bytes);
    });
}

/// Runs `record`, keeping a recorder's panic from reaching the lock.
fn quietly<T>(record: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(record)) {
        Ok(value) => Some(value),
        Err(_) => {
            tracing::debug!("dlock: the metrics recorder panicked; the figure is lost");
            None
        }
    }
}

/// A lock name's meters in each mode (exclusive, shared, semaphore), made
/// when first used.
type ByMode = [Option<Arc<LockMeters>>; 3];

/// The meters of one engine.
pub(crate) struct Meters {
    backend: &'static str,
    ops: [Histogram; 4],
    renewals: [Counter; 3],
    by_name: RwLock<HashMap<Box<str>, ByMode, RandomState>>,
}

impl Meters {
    pub(crate) fn new(backend: &'static str) -> Self {
        describe();
        let op = |op: &'static str| {
            quietly(|| {
                ::metrics::histogram!(super::BACKEND_OPERATION_DURATION, "dlock.backend" => backend, "dlock.operation" => op)
            })
            .unwrap_or_else(Histogram::noop)
        };
        let renewal = |outcome: &'static str| {
            quietly(|| ::metrics::counter!(super::RENEWALS, "dlock.backend" => backend, "dlock.outcome" => outcome))
                .unwrap_or_else(Counter::noop)
        };
        Meters {
            backend,
            ops: [op("acquire"), op("release"), op("renew"), op("withdraw")],
            renewals: [renewal("renewed"), renewal("failed"), renewal("lost")],
            by_name: RwLock::default(),
        }
    }

    /// The meters of `key`'s lock name in `mode`: a read lock and a lookup
    /// by name, the handles made once.
    pub(crate) fn lock(&self, key: &LockKey, mode: LockMode) -> LockMeter {
        let (index, mode) = match mode {
            LockMode::Exclusive => (0, mode_label(mode)),
            LockMode::Shared => (1, mode_label(mode)),
            LockMode::Permits { .. } => (2, mode_label(mode)),
        };
        let name = key.name();
        let by_name = self.by_name.read().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = by_name.get(name).and_then(|modes| modes[index].clone()) {
            return LockMeter(Some(found));
        }
        drop(by_name);
        let mut by_name = self.by_name.write().unwrap_or_else(|p| p.into_inner());
        let name = if by_name.len() >= MAX_LOCK_NAMES && !by_name.contains_key(name) { "_other" } else { name };
        let modes = by_name.entry(name.into()).or_default();
        let made = modes[index].get_or_insert_with(|| Arc::new(LockMeters::new(self.backend, name, mode))).clone();
        LockMeter(Some(made))
    }

    /// One request to the service took from `started` until now.
    pub(crate) fn op(&self, op: Op, started: Stopwatch) {
        let seconds = started.0.elapsed().as_secs_f64();
        quietly(|| self.ops[op as usize].record(seconds));
    }

    /// The watchdog's renewals answered: `renewed` held, `failed` errors,
    /// `lost` found gone.
    pub(crate) fn renewals(&self, renewed: u64, failed: u64, lost: u64) {
        quietly(|| {
            for (counter, n) in self.renewals.iter().zip([renewed, failed, lost]) {
                if n > 0 {
                    counter.increment(n);
                }
            }
        });
    }
}

/// A clock read for a duration the meters record.
#[derive(Clone, Copy)]
pub(crate) struct Stopwatch(Instant);

impl Stopwatch {
    pub(crate) fn start() -> Self {
        Stopwatch(Instant::now())
    }

    /// One started at `at`, read for something else.
    pub(crate) fn at(at: Instant) -> Self {
        Stopwatch(at)
    }
}

/// The handles of one lock name and mode.
struct LockMeters {
    acquire: [Histogram; 7],
    waiting: Gauge,
    held: Gauge,
    hold_released: Histogram,
    hold_lost: Histogram,
    lost: [Counter; 5],
    name: Box<str>,
    backend: &'static str,
    mode: &'static str,
}

impl LockMeters {
    fn new(backend: &'static str, name: &str, mode: &'static str) -> Self {
        let name: ::metrics::SharedString = name.to_owned().into();
        let labels = |extra: Option<(&'static str, &'static str)>| {
            let mut labels = vec![
                ::metrics::Label::new("dlock.lock.name", name.clone()),
                ::metrics::Label::new("dlock.backend", backend),
                ::metrics::Label::new("dlock.lock.mode", mode),
            ];
            if let Some((key, value)) = extra {
                labels.push(::metrics::Label::new(key, value));
            }
            labels
        };
        let histogram = |metric: &'static str, extra| {
            quietly(|| ::metrics::histogram!(metric, labels(extra))).unwrap_or_else(Histogram::noop)
        };
        let gauge =
            |metric: &'static str| quietly(|| ::metrics::gauge!(metric, labels(None))).unwrap_or_else(Gauge::noop);
        let counter = |metric: &'static str, extra| {
            quietly(|| ::metrics::counter!(metric, labels(extra))).unwrap_or_else(Counter::noop)
        };
        let reasons = [
            LostReason::Stolen,
            LostReason::RenewalFailed,
            LostReason::LeaseExpired,
            LostReason::SessionExpired,
            LostReason::MaxHoldExceeded,
        ];
        LockMeters {
            acquire: Outcome::ALL.map(|o| histogram(super::ACQUIRE_DURATION, Some(("dlock.outcome", o.label())))),
            waiting: gauge(super::WAITING),
            held: gauge(super::HELD),
            hold_released: histogram(super::HOLD_DURATION, Some(("dlock.release", "released"))),
            hold_lost: histogram(super::HOLD_DURATION, Some(("dlock.release", "lost"))),
            lost: reasons.map(|r| counter(super::LOST, Some(("dlock.lost.reason", lost_label(r))))),
            name: name.to_string().into(),
            backend,
            mode,
        }
    }
}

impl std::fmt::Debug for LockMeters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockMeters")
            .field("name", &self.name)
            .field("backend", &self.backend)
            .field("mode", &self.mode)
            .finish()
    }
}

/// The meters of one lock name and mode, for one acquire and its hold.
#[derive(Clone, Default)]
pub(crate) struct LockMeter(Option<Arc<LockMeters>>);

impl LockMeter {
    /// Meters an acquire; dropped unfinished, it counts as cancelled. It
    /// keeps these meters ([`AcquireMeter::lock`]): no second handle.
    pub(crate) fn acquire(self) -> AcquireMeter {
        AcquireMeter { meter: self, started: None, waiting: false, done: false }
    }

    /// A hold granted now: counted as held until [`HoldMeter::end`].
    pub(crate) fn held(&self) -> HoldMeter {
        if let Some(meter) = &self.0 {
            quietly(|| meter.held.increment(1.0));
        }
        HoldMeter { meter: self.0.clone().map(|meter| (meter, Instant::now())) }
    }
}

/// One acquire on its way.
pub(crate) struct AcquireMeter {
    meter: LockMeter,
    /// When it first waited (for the service, a turn, a release); `None`:
    /// answered on the spot, in no measurable time and with no clock read.
    started: Option<Instant>,
    waiting: bool,
    done: bool,
}

impl AcquireMeter {
    /// The meters of the lock it acquires (for the hold it may be granted).
    pub(crate) fn lock(&self) -> &LockMeter {
        &self.meter
    }

    /// The acquire started waiting at `at` (its first wait counts).
    pub(crate) fn started(&mut self, at: Instant) {
        self.started.get_or_insert(at);
    }

    /// The acquire waits (counted in `dlock.lock.waiting` until it ends).
    pub(crate) fn waiting(&mut self) {
        if self.waiting {
            return;
        }
        self.waiting = true;
        if let Some(meter) = &self.meter.0 {
            quietly(|| meter.waiting.increment(1.0));
        }
    }

    /// The acquire ended with `result`.
    pub(crate) fn finish<T>(mut self, result: &crate::Result<T>) {
        self.record(Outcome::of(result));
    }

    fn record(&mut self, outcome: Outcome) {
        self.done = true;
        let Some(meter) = &self.meter.0 else { return };
        let seconds = self.started.map_or(0.0, |started| started.elapsed().as_secs_f64());
        let waiting = self.waiting;
        quietly(|| {
            if waiting {
                meter.waiting.decrement(1.0);
            }
            meter.acquire[outcome as usize].record(seconds);
        });
    }
}

impl Drop for AcquireMeter {
    fn drop(&mut self) {
        if !self.done {
            self.record(Outcome::Cancelled);
        }
    }
}

/// One hold, from its grant.
pub(crate) struct HoldMeter {
    meter: Option<(Arc<LockMeters>, Instant)>,
}

impl HoldMeter {
    /// No hold yet (one whose first acquire is on its way).
    pub(crate) fn none() -> Self {
        HoldMeter { meter: None }
    }

    /// The hold ended: lost for the reason `lost` gives, or released.
    pub(crate) fn end(&mut self, lost: impl FnOnce() -> Option<LostReason>) {
        let Some((meter, granted_at)) = self.meter.take() else { return };
        let lost = lost();
        let seconds = granted_at.elapsed().as_secs_f64();
        quietly(|| {
            meter.held.decrement(1.0);
            match lost {
                None => meter.hold_released.record(seconds),
                Some(reason) => {
                    meter.hold_lost.record(seconds);
                    let index = match reason {
                        LostReason::Stolen => 0,
                        LostReason::RenewalFailed => 1,
                        LostReason::LeaseExpired => 2,
                        LostReason::SessionExpired => 3,
                        LostReason::MaxHoldExceeded => 4,
                    };
                    meter.lost[index].increment(1);
                }
            }
        });
    }
}
