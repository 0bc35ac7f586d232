//! What dlock leaves in a request and its response: the request's lock owner,
//! the locks it holds with their fencing tokens, and the outcome for logs.

use std::fmt;
use std::time::{Duration, Instant};

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::Extensions;
use dlock_core::LostSignal;
use dlock_core::{LockGuard, LockKey, LostReason, Owner};

use crate::rejection::Rejection;

/// What dlock keeps in a request's extensions, in one entry (`docs/performance.md`).
#[derive(Debug, Clone)]
struct RequestLock {
    owner: Owner,
    /// The first declared key of the innermost lock taken.
    held: Option<HeldLock>,
    /// Every key the request holds, of every lock taken for it.
    all: Vec<HeldLock>,
}

/// The lock owner of one request: a nested lock on the same key (a locked
/// handler behind a [`LockLayer`](crate::LockLayer)) re-enters instead of
/// deadlocking. A handler extracts it to lock further as the same owner.
///
/// ```
/// use axum::http::Extensions;
/// use dlock_axum::RequestOwner;
/// let mut ext = Extensions::new();
/// let a = RequestOwner::get_or_insert(&mut ext).unwrap();
/// let b = RequestOwner::get_or_insert(&mut ext).unwrap();
/// assert_eq!(a, b);
/// assert_eq!(RequestOwner::get(&ext), Some(a));
///
/// async fn handler(RequestOwner(owner): RequestOwner) -> String {
///     format!("locks of this request are held by {}", owner.as_str())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOwner(pub Owner);

impl RequestOwner {
    /// The request's owner, made (from the OS random source) on first use.
    ///
    /// # Errors
    ///
    /// [`dlock_core::Error::Backend`] when the OS random source fails.
    pub fn get_or_insert(extensions: &mut Extensions) -> Result<Owner, dlock_core::Error> {
        if let Some(lock) = extensions.get::<RequestLock>() {
            return Ok(lock.owner.clone());
        }
        let owner = Owner::random()?;
        extensions.insert(RequestLock { owner: owner.clone(), held: None, all: Vec::new() });
        Ok(owner)
    }

    /// The request's owner, if a lock was taken (or an owner made) for it.
    pub fn get(extensions: &Extensions) -> Option<Owner> {
        extensions.get::<RequestLock>().map(|lock| lock.owner.clone())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestOwner {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        RequestOwner::get_or_insert(&mut parts.extensions).map(RequestOwner).map_err(|e| Rejection::from_lock_error(&e))
    }
}

/// The fencing token of the request's lock ([`LockLayer`](crate::LockLayer)'s
/// or [`lockable`](crate::lockable)'s): pass it to the storage you protect,
/// so it refuses a holder whose lease ran out. Without a lock: `500` (take an
/// `Option`). Of several keys, the first's: [`HeldLocks`] has the others.
///
/// ```
/// use dlock_axum::{lockable, FencingToken};
/// use axum::extract::Path;
///
/// #[lockable(key = "account.debit", fields = ["account"])]
/// async fn debit(Path(account): Path<String>, FencingToken(fence): FencingToken) -> String {
///     format!("writing {account} with fence {fence}")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token of the lock the request holds, if any.
    pub fn get(extensions: &Extensions) -> Option<FencingToken> {
        extensions.get::<RequestLock>().and_then(|lock| lock.held.as_ref()).map(HeldLock::fencing_token)
    }
}

/// The lock this request holds: its fencing token, validity and lost signal
/// (work that must not outlive it races [`HeldLock::lost`]). Without a lock:
/// `500 lock_misconfigured` (take an `Option`).
///
/// ```
/// use std::time::Duration;
/// use axum::extract::Path;
/// use dlock_axum::{lockable, HeldLock};
///
/// #[lockable(key = "report.build", fields = ["id"])]
/// async fn build(Path(id): Path<u64>, lock: HeldLock) -> String {
///     tokio::select! {
///         _ = tokio::time::sleep(Duration::from_millis(10)) => {
///             format!("report {id} built under fence {}", lock.fencing_token().0)
///         }
///         reason = lock.lost() => format!("stopped: the lock was lost ({reason})"),
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct HeldLock {
    key: LockKey,
    fencing_token: u64,
    signal: LostSignal,
}

impl HeldLock {
    /// The lock `guard` holds.
    pub(crate) fn of(guard: &LockGuard) -> Self {
        HeldLock { key: guard.key().clone(), fencing_token: guard.fencing_token(), signal: guard.lost_signal() }
    }

    /// Records the locks just taken for the route's extractors: `primary` (the
    /// first declared key) for [`HeldLock`] and [`FencingToken`], `all` for [`HeldLocks`].
    pub(crate) fn set(
        extensions: &mut Extensions,
        owner: &Owner,
        primary: HeldLock,
        all: impl Iterator<Item = HeldLock>,
    ) {
        match extensions.get_mut::<RequestLock>() {
            Some(lock) => {
                lock.held = Some(primary);
                lock.all.extend(all);
            }
            None => {
                extensions.insert(RequestLock { owner: owner.clone(), held: Some(primary), all: all.collect() });
            }
        }
    }

    /// The key this lock is on (`key().log_id()` names it in logs without its values).
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Whether this lock is on the key of lock `name` with the one part `part`,
    /// as a layer builds it (`LockLayer::new(name).path(..)`), whatever the prefix.
    ///
    /// ```
    /// # use dlock_core::{Locker, MemoryBackend};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_core::Error> {
    /// # let locker = Locker::new(MemoryBackend::new());
    /// # let policy = dlock_axum::lock::Policy::new("account");
    /// # let key = locker.key("account").part(7).build()?;
    /// # let owner = dlock_core::Owner::random()?;
    /// # let _ = policy.run_holding(&locker, owner, key, |held| async move {
    /// assert!(held.is("account", 7));
    /// assert!(held.is("account", "7")); // a part is its text
    /// assert!(!held.is("account", 8));
    /// # }).await;
    /// # Ok(()) }
    /// ```
    pub fn is(&self, name: &str, part: impl dlock_core::KeyPart) -> bool {
        // `{` is escaped inside names and parts, so the lock's own text is
        // everything from the last `:{` on, whatever the prefix.
        match LockKey::builder("", name).part(part).build() {
            Ok(probe) => self.key.as_str().ends_with(probe.as_str()),
            Err(_) => false,
        }
    }

    /// The lock the request holds, if any.
    ///
    /// ```
    /// let ext = axum::http::Extensions::new();
    /// assert!(dlock_axum::HeldLock::get(&ext).is_none());
    /// ```
    pub fn get(extensions: &Extensions) -> Option<HeldLock> {
        extensions.get::<RequestLock>().and_then(|lock| lock.held.clone())
    }

    /// The grant's fencing token: pass it to the storage you protect.
    pub fn fencing_token(&self) -> FencingToken {
        FencingToken(self.fencing_token)
    }

    /// Until when the lock is certainly ours (renewals move it on).
    pub fn valid_until(&self) -> Instant {
        self.signal.valid_until().into_std()
    }

    /// Whether the lock was lost (found gone, lease run out, `max_hold` passed).
    pub fn is_lost(&self) -> bool {
        self.signal.is_lost()
    }

    /// Why the lock was lost, once it was.
    pub fn reason(&self) -> Option<LostReason> {
        self.signal.reason()
    }

    /// Resolves when the lock is lost; pending for as long as it is held.
    ///
    /// # Cancellation safety
    ///
    /// Cancel-safe: dropping the future only stops watching.
    pub async fn lost(&self) -> LostReason {
        self.signal.lost().await
    }

    /// The lock's lost signal, to hand to work that outlives this borrow.
    pub fn lost_signal(&self) -> &LostSignal {
        &self.signal
    }
}

/// The extractors of a type read from the request's lock (without one, a `500`), and of `Option<_>`.
macro_rules! from_request_lock {
    ($ty:ident, $message:literal) => {
        impl<S: Send + Sync> FromRequestParts<S> for $ty {
            type Rejection = Rejection;

            async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
                $ty::get(&parts.extensions).ok_or_else(|| no_lock(stringify!($ty), $message))
            }
        }

        impl<S: Send + Sync> OptionalFromRequestParts<S> for $ty {
            type Rejection = std::convert::Infallible;

            async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
                Ok($ty::get(&parts.extensions))
            }
        }
    };
}

from_request_lock!(FencingToken, "this route holds no lock, so it has no fencing token");
from_request_lock!(HeldLock, "this route holds no lock");

/// Every lock this request holds ([`LockLayer::also`](crate::LockLayer::also),
/// `#[lockable(also(..))]`), each with its own fencing token: tokens are drawn
/// per key, so fence each row with its own key's token, never the first's.
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_axum::{HeldLocks, LockLayer};
///
/// #[derive(serde::Deserialize)]
/// struct Transfer { from: u64, to: u64 }
///
/// async fn transfer(locks: HeldLocks, axum::Json(t): axum::Json<Transfer>) -> String {
///     let from = locks.token("account", t.from).map(|token| token.0);
///     let to = locks.token("account", t.to).map(|token| token.0);
///     format!("debit under {from:?}, credit under {to:?}")
/// }
///
/// let app: Router = Router::new().route(
///     "/transfers",
///     post(transfer).route_layer(LockLayer::new("account").json("from").also("account").json("to")),
/// );
/// ```
#[derive(Debug, Clone, Default)]
pub struct HeldLocks(Vec<HeldLock>);

impl HeldLocks {
    /// The locks `guards` hold.
    pub(crate) fn of(guards: &[LockGuard]) -> Self {
        HeldLocks(guards.iter().map(HeldLock::of).collect())
    }

    /// Every lock the request holds.
    ///
    /// ```
    /// let ext = axum::http::Extensions::new();
    /// assert!(dlock_axum::HeldLocks::get_all(&ext).is_empty());
    /// ```
    pub fn get_all(extensions: &Extensions) -> HeldLocks {
        HeldLocks(extensions.get::<RequestLock>().map(|lock| lock.all.clone()).unwrap_or_default())
    }

    /// The lock on `name` with the one part `part` ([`HeldLock::is`]), if held.
    pub fn get(&self, name: &str, part: impl dlock_core::KeyPart) -> Option<&HeldLock> {
        let probe = LockKey::builder("", name).part(part).build().ok()?;
        self.0.iter().find(|held| held.key.as_str().ends_with(probe.as_str()))
    }

    /// The lock on `key` (a key of several parts, built as the layer builds it).
    pub fn get_key(&self, key: &LockKey) -> Option<&HeldLock> {
        self.0.iter().find(|held| &held.key == key)
    }

    /// The fencing token of the lock on `name` with the one part `part`.
    pub fn token(&self, name: &str, part: impl dlock_core::KeyPart) -> Option<FencingToken> {
        self.get(name, part).map(HeldLock::fencing_token)
    }

    /// The locks, in the order they were taken (a set in key order).
    pub fn iter(&self) -> impl Iterator<Item = &HeldLock> {
        self.0.iter()
    }

    /// How many locks the request holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the request holds no lock.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLocks {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(HeldLocks::get_all(&parts.extensions))
    }
}

fn no_lock(extractor: &str, message: &'static str) -> Rejection {
    tracing::error!(
        "{extractor} extracted by a handler that holds no lock; put the route behind a LockLayer, \
         or write the argument's type as `{extractor}` in a #[lockable] handler"
    );
    Rejection::misconfigured().with_message(message)
}

/// What happened to a request's lock, in the response extensions, for an
/// access log ([`Policy::run_locked`](crate::lock::Policy::run_locked) too).
///
/// ```
/// use dlock_axum::LockOutcome;
/// assert_eq!(LockOutcome::Busy { waited: Default::default() }.as_str(), "busy");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockOutcome {
    /// The lock was taken and the handler ran.
    Acquired {
        /// The grant's fencing token.
        fencing_token: u64,
        /// How long the request waited for the lock.
        waited: Duration,
    },
    /// Someone else held the lock until the wait ran out: `409`.
    Busy {
        /// How long the request waited.
        waited: Duration,
    },
    /// The lock service could not be reached: `503`.
    Unavailable,
    /// No key could be built (missing field, bad JSON, body too large): `4xx`.
    Invalid {
        /// The rejection's machine code.
        error: String,
    },
    /// The caller already held as many locks through the layer as it may: `429`.
    OverQuota,
    /// No engine installed or invalid options: `500`.
    Misconfigured,
}

impl LockOutcome {
    /// A short word for logs (`acquired`, `busy`, `over_quota`, …).
    pub fn as_str(&self) -> &'static str {
        match self {
            LockOutcome::Acquired { .. } => "acquired",
            LockOutcome::Busy { .. } => "busy",
            LockOutcome::Unavailable => "unavailable",
            LockOutcome::Invalid { .. } => "invalid",
            LockOutcome::OverQuota => "over_quota",
            LockOutcome::Misconfigured => "misconfigured",
        }
    }
}

impl fmt::Display for LockOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockOutcome::Acquired { fencing_token, waited } => {
                write!(f, "acquired (fence {fencing_token}, waited {} ms)", waited.as_millis())
            }
            LockOutcome::Busy { waited } => write!(f, "busy (waited {} ms)", waited.as_millis()),
            LockOutcome::Invalid { error } => write!(f, "invalid ({error})"),
            other => f.write_str(other.as_str()),
        }
    }
}
