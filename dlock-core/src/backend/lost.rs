//! [`LostReason`]: why a hold ended before its release.

/// Why a lock was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal found the key gone or owned by someone else.
    Stolen,
    /// Renewals failed until the lease ran out.
    RenewalFailed,
    /// A fixed lease ran out before release.
    LeaseExpired,
    /// The session that carried the lock expired (ZooKeeper).
    SessionExpired,
    /// The watchdog stopped renewing at the acquire's `max_hold` and the
    /// lease ran out.
    MaxHoldExceeded,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::Stolen => "the key is gone or owned by someone else",
            LostReason::RenewalFailed => "renewals failed until the lease ran out",
            LostReason::LeaseExpired => "the lease ran out before release",
            LostReason::SessionExpired => "the session holding the lock expired",
            LostReason::MaxHoldExceeded => "held longer than its max_hold; the watchdog stopped renewing",
        })
    }
}
