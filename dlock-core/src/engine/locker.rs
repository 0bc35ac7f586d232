//! [`Locker`], the engine's front door: it takes locks through a
//! [`Backend`] and hands out [`LockGuard`]s; and the options it takes.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::guard::{release_last, LockGuard};
use super::holds::{AcquireTurn, Enter, Renew};
use super::see_through::SeeThrough;
use super::Engine;
use crate::backend::{contention, AcquireRequest, Backend, CancellationToken, Grant, LockMode, LostReason, Renewal};
use crate::error::{Error, Result};
use crate::key::{validate_prefix, KeyBuilder, LockKey};
use crate::metrics::{mode_label, LockMeter, Op, Outcome, Stopwatch};
use crate::owner::Owner;

/// The default watchdog lease, as in Redisson.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Engine-wide defaults, usually from [`Config`](crate::Config).
///
/// ```
/// use std::time::Duration;
/// use dlock_core::LockerOptions;
/// let opts = LockerOptions::default().with_prefix("shop").with_wait(Duration::from_millis(200));
/// assert_eq!(opts.prefix(), "shop");
/// ```
#[derive(Debug, Clone)]
pub struct LockerOptions {
    prefix: String,
    wait: Duration,
    watchdog_lease: Duration,
}

impl Default for LockerOptions {
    fn default() -> Self {
        LockerOptions { prefix: "dlock".into(), wait: Duration::ZERO, watchdog_lease: DEFAULT_LEASE }
    }
}

impl LockerOptions {
    /// The namespace every key starts with (`DLOCK_PREFIX`, default `dlock`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long an acquire waits when the call does not say (`DLOCK_WAIT_MS`,
    /// default 0: try once).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The lease held and renewed every lease/3 in watchdog mode
    /// (`DLOCK_LEASE_MS`, default 30 s).
    pub fn with_watchdog_lease(mut self, lease: Duration) -> Self {
        self.watchdog_lease = lease;
        self
    }

    /// The key namespace.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The default wait.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The watchdog lease.
    pub fn watchdog_lease(&self) -> Duration {
        self.watchdog_lease
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate_prefix(&self.prefix)?;
        if self.watchdog_lease < Duration::from_millis(3) {
            return Err(Error::config("DLOCK_LEASE_MS", "the watchdog lease must be at least 3 ms"));
        }
        Ok(())
    }
}

/// Options of one acquire; unset ones take the [`Locker`]'s defaults.
/// Without a fixed lease the lock is in *watchdog mode*: renewed every
/// lease/3 while the guard lives.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::AcquireOptions;
/// let opts = AcquireOptions::new().with_wait(Duration::from_secs(5)).with_lease(Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, Default)]
pub struct AcquireOptions {
    wait: Option<Duration>,
    lease: Option<Duration>,
    owner: Option<Owner>,
    max_hold: Option<Duration>,
    mode: LockMode,
}

impl AcquireOptions {
    /// The locker's defaults, watchdog mode, a fresh owner.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wait up to `wait` for the lock (zero: try once).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// A fixed lease: the lock frees itself after `lease` unless released
    /// before, and [`LockGuard::lost`] fires when it runs out.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Watchdog mode (the default): hold the locker's watchdog lease and
    /// renew it while the guard lives.
    pub fn with_watchdog(mut self) -> Self {
        self.lease = None;
        self
    }

    /// Watchdog mode only: stop renewing `max_hold` after the grant, so a
    /// stuck holder whose process lives cannot keep the lock forever;
    /// [`LockGuard::lost`] then fires with [`LostReason::MaxHoldExceeded`].
    ///
    /// [`LostReason::MaxHoldExceeded`]: crate::LostReason::MaxHoldExceeded
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::AcquireOptions;
    /// let opts = AcquireOptions::new().with_watchdog().with_max_hold(Duration::from_secs(60));
    /// ```
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// Take the lock in `mode` (default [`LockMode::Exclusive`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
    /// use dlock_core::LockMode;
    /// use dlock_core::{AcquireOptions, Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// let key = locker.key("export").part("user-7").build()?;
    /// let two = || AcquireOptions::new().with_mode(LockMode::permits(2));
    /// let (a, b) = (locker.acquire(&key, two()).await?, locker.acquire(&key, two()).await?);
    /// assert!(locker.acquire(&key, two()).await.unwrap_err().is_contention(), "both permits are taken");
    /// assert!(a.fencing_token() < b.fencing_token());
    /// # Ok(()) }
    /// ```
    pub fn with_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    pub(super) fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    pub(super) fn wait(&self) -> Option<Duration> {
        self.wait
    }

    /// Acquire as `owner`, so that the same owner re-entering is counted
    /// instead of deadlocking. The count is per process: an owner shared by
    /// two processes shares the lock, and the first last release frees it
    /// for both.
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }
}

/// Takes distributed locks. Cheap to clone; every clone shares the backend.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::{AcquireOptions, Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new());
/// let key = locker.key("order.create").part(42).build()?;
/// let guard = locker.acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(1))).await?;
/// // ... work, passing guard.fencing_token() to the storage you protect ...
/// assert!(guard.release().await?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    // A clone is one reference count.
    pub(super) engine: Arc<Engine>,
}

impl std::fmt::Debug for Locker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.engine.backend.name())
            .field("options", &self.engine.options)
            .finish()
    }
}

impl Locker {
    /// An engine over `backend` with the default options, in the key
    /// namespace the backend was connected for (see [`Backend::prefix`]).
    pub fn new(backend: impl Backend) -> Self {
        let backend: Arc<dyn Backend> = Arc::new(backend);
        let options = match backend.prefix() {
            Some(prefix) => LockerOptions::default().with_prefix(prefix),
            None => LockerOptions::default(),
        };
        Locker::from_parts(backend, options)
    }

    /// An engine over a shared backend with the given options.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the prefix or the lease is invalid, or the
    /// prefix is not the one the backend was connected for (see
    /// [`Backend::prefix`]): keys in one namespace and wake-ups or lock
    /// nodes in another would never meet.
    pub fn with_options(backend: Arc<dyn Backend>, options: LockerOptions) -> Result<Self> {
        options.validate()?;
        if let Some(connected) = backend.prefix().filter(|p| *p != options.prefix) {
            return Err(Error::config(
                "DLOCK_PREFIX",
                format!(
                    "the {} backend was connected for prefix `{connected}`, the options say `{}`",
                    backend.name(),
                    options.prefix
                ),
            ));
        }
        Ok(Locker::from_parts(backend, options))
    }

    fn from_parts(backend: Arc<dyn Backend>, options: LockerOptions) -> Self {
        Locker { engine: Engine::new(backend, options) }
    }

    /// The backend's name ([`Backend::name`]).
    pub fn backend_name(&self) -> &'static str {
        self.engine.backend.name()
    }

    /// Whether the backend would answer a grant now: one cheap round trip,
    /// no lock taken (see [`Backend::ready`]). For a readiness probe.
    ///
    /// # Errors
    ///
    /// Why not, as the backend reports it.
    pub async fn ready(&self) -> Result<()> {
        self.engine.backend.ready().await
    }

    /// Whether locks of `mode` can be taken here, to ask at start-up
    /// ([`Backend::supports`]; RedLock refuses semaphores of several permits).
    ///
    /// ```
    /// use dlock_core::LockMode;
    /// use dlock_core::{Locker, MemoryBackend};
    /// let locker = Locker::new(MemoryBackend::new());
    /// assert!(locker.supports(LockMode::permits(2)).is_ok());
    /// assert!(locker.supports(LockMode::permits(0)).is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] saying why the mode cannot be kept.
    pub fn supports(&self, mode: LockMode) -> Result<()> {
        mode.validate()?;
        self.engine.backend.supports(mode)
    }

    /// The engine's defaults.
    pub fn options(&self) -> &LockerOptions {
        &self.engine.options
    }

    /// Starts a key in this locker's namespace.
    pub fn key(&self, name: &str) -> KeyBuilder {
        LockKey::builder(&self.engine.options.prefix, name)
    }

    /// Tries once, in watchdog mode.
    ///
    /// # Errors
    ///
    /// As [`Locker::acquire`]; [`Error::Busy`] when the key is held.
    pub async fn try_acquire(&self, key: &LockKey) -> Result<LockGuard> {
        self.acquire(key, AcquireOptions::new().with_wait(Duration::ZERO)).await
    }

    /// Takes `key`, waiting as `opts` say (until a release is announced or
    /// the holder's lease runs out, never by polling).
    ///
    /// # Errors
    ///
    /// [`Error::Busy`] (no wait) or [`Error::Timeout`] when another owner
    /// holds the key; [`Error::Backend`] / [`Error::QuorumUnavailable`] when
    /// the service fails; [`Error::InvalidArgument`] for a zero lease.
    ///
    /// # Cancellation safety
    ///
    /// Dropping the future at any point leaves no lock and no renewal
    /// behind: an attempt in flight is finished on a task of its own, which
    /// releases a late grant.
    pub async fn acquire(&self, key: &LockKey, opts: AcquireOptions) -> Result<LockGuard> {
        let engine = &self.engine;
        let mut metered = engine.meters.lock(key, opts.mode).acquire();
        let span = tracing::info_span!(
            "dlock.acquire",
            dlock.lock.name = key.name(),
            key = %key.log_id(),
            dlock.backend = engine.backend.name(),
            dlock.lock.mode = mode_label(opts.mode),
            dlock.outcome = tracing::field::Empty,
            dlock.fence = tracing::field::Empty,
            waited_ms = tracing::field::Empty,
        );
        // Read only for a span someone records.
        let span_started = (!span.is_disabled()).then(Instant::now);
        // Every answer goes out through here, recorded. One future, not a
        // metered one around the acquire's: the extra layer cost a copy of
        // the whole state per acquire (an in-process cycle 15 % slower).
        macro_rules! answer {
            ($result:expr) => {{
                // Returned in place when nothing records it: a result held
                // for a look is copied out after (tens of ns in process).
                if span_started.is_none() && !crate::metrics::RECORDS {
                    return $result;
                }
                let result: Result<LockGuard> = $result;
                if let Some(started) = span_started {
                    record_on(&span, started, &result);
                }
                metered.finish(&result);
                return result;
            }};
        }
        let owner = match opts.owner {
            Some(owner) => owner,
            None => match Owner::random() {
                Ok(owner) => owner,
                Err(e) => answer!(Err(e)),
            },
        };
        let wait = opts.wait.unwrap_or(engine.options.wait);
        let (lease, renewed) = match opts.lease {
            Some(lease) => (lease, false),
            None => (engine.options.watchdog_lease, true),
        };
        if lease.is_zero() {
            answer!(Err(Error::invalid_argument("lease", "a lease must be longer than zero")));
        }
        if let Err(e) = opts.mode.validate() {
            answer!(Err(e));
        }
        let max_hold = opts.max_hold;
        let renew = renewed.then_some(Renew { lease, max_hold });
        let mut req = AcquireRequest::new(key.clone(), owner, lease)
            .with_until_released(renewed && max_hold.is_none())
            .with_mode(opts.mode);
        // An answer on the spot never suspends: spend the coop budget, and
        // before the attempt, so a caller dropped here leaves no grant.
        tokio::task::coop::consume_budget().await;
        // Set at the first thing waited for: no clock read on the spot.
        let mut started = None;
        let turn = loop {
            let (enter, kick) =
                engine.holds.enter(&req, !wait.is_zero(), renew, engine.backend.as_ref(), metered.lock());
            engine.kick(kick);
            match enter {
                Enter::Joined(joined) => answer!(Ok(LockGuard::new(engine.clone(), req, joined, renewed))),
                Enter::First(turn) => break turn,
                Enter::Busy => answer!(Err(contention(&req, Instant::now()))),
                Enter::Refused(e) => {
                    let _entered = span.enter();
                    trace_attempt(Err(&e), None);
                    answer!(Err(e))
                }
                // Waited for even when trying once: it ends within the
                // backend's timeouts.
                Enter::Wait(settled) if wait.is_zero() => {
                    metered.started(Instant::now());
                    settled.await
                }
                Enter::Wait(settled) => {
                    metered.waiting();
                    let started = *started.get_or_insert_with(Instant::now);
                    metered.started(started);
                    tokio::select! {
                        _ = settled => {}
                        _ = tokio::time::sleep_until(started + wait) => {
                            answer!(Err(Error::Timeout { key: key.to_string(), waited: started.elapsed() }))
                        }
                    }
                }
                Enter::Extend(id) => {
                    let sent = Instant::now();
                    metered.started(sent);
                    let renewal = engine.backend.renew(key, &req.owner, lease).await;
                    engine.meters.op(Op::Renew, Stopwatch::at(sent));
                    match renewal {
                        Ok(Renewal::Held { valid_until }) => {
                            let (joined, kick) = engine.holds.extended(id, sent, lease, valid_until, renew);
                            engine.kick(kick);
                            if let Some(joined) = joined {
                                answer!(Ok(LockGuard::new(engine.clone(), req, joined, renewed)));
                            }
                        }
                        Ok(Renewal::Lost) => engine.holds.lost(id, LostReason::Stolen),
                        Err(e) => answer!(Err(e)),
                    }
                }
            }
        };
        let started = started.unwrap_or_else(Instant::now);
        metered.started(started);
        req.deadline = (!wait.is_zero()).then(|| started + wait);
        if !wait.is_zero() {
            metered.waiting();
        }
        let cancel = CancellationToken::new();
        let engine = engine.clone();
        let in_flight = cancel.clone();
        let meter = metered.lock().clone();
        let attempt = async move {
            let result = engine.backend.acquire(&req, &in_flight).await;
            engine.meters.op(Op::Acquire, Stopwatch::at(started));
            trace_attempt(result.as_ref().map(|grant| grant.fencing_token), Some(started));
            match result {
                Ok(grant) => Ok(granted(&engine, turn, grant, req, renew, &meter)),
                Err(e) => {
                    undo(&engine, turn, req, e.outcome_unknown());
                    Err(e)
                }
            }
        }
        .instrument(span.clone());
        answer!(SeeThrough::new(Box::pin(attempt), Some(cancel)).await)
    }
}

/// Records how an acquire ended on its span, begun at `started`.
fn record_on(span: &tracing::Span, started: Instant, result: &Result<LockGuard>) {
    span.record("dlock.outcome", Outcome::of(result).label());
    span.record("waited_ms", started.elapsed().as_secs_f64() * 1e3);
    if let Ok(guard) = result {
        span.record("dlock.fence", guard.fencing_token());
    }
}

/// Undoes, in the background and on the key and owner's turn, what an
/// acquire that returned no grant may have left: a wait that ended early is
/// withdrawn ([`Backend::withdraw`]), an acquire whose outcome is unknown
/// is released, owner-checked (`docs/core-design.md`).
fn undo(engine: &Arc<Engine>, turn: AcquireTurn, req: AcquireRequest, outcome_unknown: bool) {
    let now = Instant::now();
    let left_early = req.deadline.is_some_and(|deadline| now < deadline);
    let until = match (outcome_unknown, req.deadline) {
        (true, _) => now + req.lease,
        (false, Some(deadline)) if left_early => deadline,
        // Nothing to undo: the turn ends here.
        _ => return,
    };
    let Some(turn) = turn.undo(until) else { return };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let engine = engine.clone();
    runtime.spawn(async move {
        if left_early {
            withdraw(&engine, &req).await;
        }
        if outcome_unknown {
            drop(release_last(engine, req.key, req.owner, turn).await);
        }
    });
}

/// [`Backend::withdraw`] for `req`, logged.
async fn withdraw(engine: &Engine, req: &AcquireRequest) {
    let started = Stopwatch::start();
    let withdrawn = engine.backend.withdraw(req).await;
    engine.meters.op(Op::Withdraw, started);
    match withdrawn {
        Ok(()) => tracing::debug!(key = %req.key.log_id(), "dlock.withdraw"),
        Err(e) => tracing::warn!(
            key = %req.key.log_id(),
            error = %e,
            "dlock.withdraw failed; what the wait left ends with its wait"
        ),
    }
}

/// The guard of a first acquire the backend granted.
fn granted(
    engine: &Arc<Engine>,
    turn: AcquireTurn,
    grant: Grant,
    req: AcquireRequest,
    renew: Option<Renew>,
    meter: &LockMeter,
) -> LockGuard {
    let (joined, kick) = engine.holds.granted(turn, grant, &req, renew, meter);
    engine.kick(kick);
    LockGuard::new(engine.clone(), req, joined, renew.is_some())
}

/// One event for the outcome of an acquire attempt, in its span.
fn trace_attempt(outcome: std::result::Result<u64, &Error>, started: Option<Instant>) {
    // Evaluated only when the event is enabled.
    let waited_us = || started.map_or(0, |started| started.elapsed().as_micros() as u64);
    match outcome {
        Ok(fence) => tracing::debug!(waited_us = waited_us(), fence, "acquired"),
        Err(Error::Cancelled) => tracing::debug!(waited_us = waited_us(), "caller gave up"),
        Err(e) if e.is_contention() => tracing::debug!(waited_us = waited_us(), "held by another owner"),
        Err(e) => tracing::debug!(waited_us = waited_us(), error = %e, "acquire failed"),
    }
}
