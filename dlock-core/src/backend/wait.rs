//! The event-driven wait loop shared by the TTL backends (memory, Redis,
//! RedLock): try, and while the key is held sleep until a release wakes us or
//! the holder's lease runs out — never on a fixed interval.

use std::future::Future;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{contention, AcquireRequest, Grant};
use crate::error::{Error, Result};

/// The result of one atomic try.
#[derive(Debug)]
pub(crate) enum Attempt {
    Acquired(Grant),
    /// Held by someone else; the holder's lease ends in `retry_in` (`None`:
    /// unknown, wait for a release or the deadline).
    Held {
        retry_in: Option<Duration>,
    },
}

/// Waking a little after the holder's TTL ends avoids a try that would find
/// the key a microsecond before it expires.
const TTL_SLACK: Duration = Duration::from_millis(1);

/// Runs `attempt` until it acquires, the deadline passes or `cancel` fires.
///
/// `attempt(awaited)` tries once; `awaited` is true for the tries made after
/// subscribing: a backend that announces releases only when someone waits
/// marks the lock as awaited on such a try, held or granted (a grant, since
/// other waiters of this process may be parked behind it and will not try
/// again until they are woken).
///
/// `subscribe` is called once, only when the first try finds the key held and
/// the caller is willing to wait; what it returns must be notified (one
/// waiter per release is enough) whenever the key may have come free, for as
/// long as it lives. The try that follows a subscription covers a release
/// that happened before it.
///
/// `others_wait`: whether other tasks of this process already wait for the
/// key, so that it is almost surely held and its subscription live; asked
/// only of a caller willing to wait. Such a caller then subscribes first and
/// makes one (awaited) try instead of two: under contention a plain first
/// try is a round trip that only says "held".
pub(crate) async fn acquire_loop<O, A, AF, S, SF, W>(
    req: &AcquireRequest,
    cancel: &CancellationToken,
    others_wait: O,
    mut attempt: A,
    subscribe: S,
) -> Result<Grant>
where
    O: FnOnce() -> bool,
    A: FnMut(bool) -> AF,
    AF: Future<Output = Result<Attempt>>,
    S: FnOnce() -> SF,
    SF: Future<Output = W>,
    W: AsRef<Notify>,
{
    let subscribe_first = req.deadline.is_some() && others_wait();
    if !subscribe_first {
        if let Attempt::Acquired(grant) = attempt(false).await? {
            return Ok(grant);
        }
    }
    let Some(deadline) = req.deadline else {
        return Err(contention(req, Instant::now()));
    };
    // The clock is read only once there is a wait to time.
    let started = Instant::now();
    // Subscribing waits for the server's confirmation, which a slow server
    // may give late: it must not carry the wait past its deadline.
    let wakeups = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Err(Error::Cancelled),
        w = subscribe() => w,
        _ = tokio::time::sleep_until(deadline) => return Err(contention(req, started)),
    };
    loop {
        let notified = wakeups.as_ref().notified();
        tokio::pin!(notified);
        // Registered before the try, so a release between the try and the
        // sleep still wakes us.
        notified.as_mut().enable();
        let retry_in = match attempt(true).await? {
            Attempt::Acquired(grant) => return Ok(grant),
            Attempt::Held { retry_in } => retry_in,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(contention(req, started));
        }
        let wake_at = retry_in.map_or(deadline, |d| (now + d + TTL_SLACK).min(deadline));
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = &mut notified => {}
            _ = tokio::time::sleep_until(wake_at) => {
                if wake_at >= deadline {
                    return Err(contention(req, started));
                }
            }
        }
    }
}
