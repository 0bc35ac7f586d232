//! What a locked request asks of its lock: one [`Policy`] for every face, so
//! acquire, refusal, log event and release cannot drift apart.

use std::borrow::Cow;
use std::time::Duration;

use dlock_core::LockMode;
use dlock_core::{AcquireOptions, Locker};

/// The name, timing and duplicate answer of a request's lock, as
/// [`LockLayer`](crate::LockLayer) and `#[lockable]` have it, for a lock by hand.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use dlock_axum::lock::Policy;
/// use dlock_core::{Locker, MemoryBackend, Owner};
///
/// let locker = Locker::new(MemoryBackend::new());
/// let policy = Policy::new("product.stock").with_wait(Duration::from_secs(5)).with_code(4001);
/// let key = locker.key(policy.name()).part(42).build().unwrap();
/// let (sold, _outcome) = policy.run_locked(&locker, Owner::random().unwrap(), key, async { 1 }).await.unwrap();
/// assert_eq!(sold, 1);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The lock's name, the key's first part.
    pub(crate) name: Cow<'static, str>,
    /// How long to wait for a held lock; `None`: the engine's default.
    pub(crate) wait: Option<Duration>,
    /// A fixed lease; `None`: watchdog mode.
    pub(crate) lease: Option<Duration>,
    /// In watchdog mode, the longest a request may hold the lock.
    pub(crate) max_hold: Option<Duration>,
    /// `message` of the `409 duplicate_submission` answer (not of `lock_wait_timeout`).
    pub(crate) message: Option<Cow<'static, str>>,
    /// `code` of that answer.
    pub(crate) code: Option<u32>,
    /// How every key of the request is taken.
    pub(crate) mode: LockMode,
}

impl Policy {
    /// A policy for the lock `name` with the engine's defaults.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        Policy {
            name: name.into(),
            wait: None,
            lease: None,
            max_hold: None,
            message: None,
            code: None,
            mode: LockMode::Exclusive,
        }
    }

    /// How long to wait for a held lock before refusing with `409`.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// A fixed lease instead of watchdog mode.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// In watchdog mode, stop renewing once the lock was held this long.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// The `message` of the `409 duplicate_submission` answer.
    pub fn with_message(mut self, message: impl Into<Cow<'static, str>>) -> Self {
        self.message = Some(message.into());
        self
    }

    /// The `code` of the `409 duplicate_submission` answer (default 2101).
    pub fn with_code(mut self, code: u32) -> Self {
        self.code = Some(code);
        self
    }

    /// Take the request's keys in `mode`: [`LockMode::Exclusive`] (the default),
    /// [`LockMode::Shared`] (shared requests run together; the other mode is a
    /// `409`), or [`LockMode::permits`]`(n)` (the next is `429 lock_permits_exhausted`).
    ///
    /// ```
    /// use dlock_axum::lock::Policy;
    /// use dlock_core::LockMode;
    ///
    /// let exports = Policy::new("report.export").with_mode(LockMode::permits(2));
    /// assert_eq!(exports.mode(), LockMode::permits(2));
    /// ```
    pub fn with_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// How the request's keys are taken (see [`with_mode`](Self::with_mode)).
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// A semaphore route (refused with `429`, not `409`).
    pub(crate) fn is_semaphore(&self) -> bool {
        matches!(self.mode, LockMode::Permits { .. })
    }

    /// The policy of a `#[lockable(...)]` attribute (`__private::policy`).
    pub(crate) const fn from_attribute(
        name: &'static str,
        wait_ms: Option<u64>,
        lease_ms: Option<u64>,
        max_hold_ms: Option<u64>,
        message: Option<&'static str>,
        code: Option<u32>,
    ) -> Self {
        const fn millis(ms: Option<u64>) -> Option<Duration> {
            match ms {
                Some(ms) => Some(Duration::from_millis(ms)),
                None => None,
            }
        }
        Policy {
            name: Cow::Borrowed(name),
            wait: millis(wait_ms),
            lease: millis(lease_ms),
            max_hold: millis(max_hold_ms),
            message: match message {
                Some(m) => Some(Cow::Borrowed(m)),
                None => None,
            },
            code,
            mode: LockMode::Exclusive,
        }
    }

    /// The policy in `mode`, in a `const` (see `__private::shared`).
    pub(crate) const fn in_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The longest a holder keeps the lock unrenewed: the fixed lease, else the
    /// watchdog's ([`Refusal::lasting_at_most`](super::refusal::Refusal::lasting_at_most)).
    pub(crate) fn holder_lease(&self, locker: &Locker) -> Duration {
        self.lease.unwrap_or_else(|| locker.options().watchdog_lease())
    }

    /// The acquire options of a request taken as `owner`.
    pub(crate) fn options(&self, owner: dlock_core::Owner) -> AcquireOptions {
        let mut opts = AcquireOptions::new().with_owner(owner).with_mode(self.mode);
        if let Some(wait) = self.wait {
            opts = opts.with_wait(wait);
        }
        if let Some(lease) = self.lease {
            opts = opts.with_lease(lease);
        }
        if let Some(max_hold) = self.max_hold {
            opts = opts.with_max_hold(max_hold);
        }
        opts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attribute_policy_is_the_builder_policy() {
        static FROM_MACRO: Policy =
            Policy::from_attribute("order.create", Some(5), Some(6000), Some(7000), Some("busy"), Some(9));
        let mut built = Policy::new("order.create");
        built.wait = Some(Duration::from_millis(5));
        built.lease = Some(Duration::from_secs(6));
        built.max_hold = Some(Duration::from_secs(7));
        built.message = Some("busy".into());
        built.code = Some(9);
        assert_eq!(FROM_MACRO, built);
    }

    #[test]
    fn a_holder_keeps_the_fixed_lease_else_the_watchdog_lease() {
        let options = dlock_core::LockerOptions::default().with_watchdog_lease(Duration::from_millis(4_500));
        let backend: std::sync::Arc<dyn dlock_core::backend::Backend> =
            std::sync::Arc::new(dlock_core::MemoryBackend::new());
        let locker = Locker::with_options(backend, options).expect("valid options");
        assert_eq!(Policy::new("a").holder_lease(&locker), Duration::from_millis(4_500));
        let fixed = Policy::new("a").with_lease(Duration::from_secs(7)).with_max_hold(Duration::from_secs(60));
        assert_eq!(fixed.holder_lease(&locker), Duration::from_secs(7));
        let default = Locker::new(dlock_core::MemoryBackend::new());
        assert_eq!(Policy::new("a").holder_lease(&default), dlock_core::DEFAULT_LEASE);
    }
}
