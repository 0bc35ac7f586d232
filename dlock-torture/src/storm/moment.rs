//! When a client's hang-up landed, measured against its key's claim: before
//! the claim reached the store, while the claim's answer was still on its
//! way back (held by the slow proxy), or after the answer was in.
//!
//! The middle case is the one that stranded keys before the claim moved to
//! a detached task: the request's future was dropped with the answer still
//! out, and nobody ran or freed the key. A row must see it happen, or it
//! tested nothing.

use std::time::{Duration, Instant};

/// How much earlier than its answer's arrival a hang-up must land to count
/// as in flight: time for the server to see the connection close before the
/// answer comes in.
const GUARD: Duration = Duration::from_millis(10);
/// The resolution of `PTTL`, by which a claim's age may be off.
const TICK: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Moment {
    /// No record when looked at just after the hang-up: nothing was claimed
    /// yet.
    BeforeClaim,
    /// Claimed before the hang-up, its answer due at the server at least
    /// [`GUARD`] after it.
    InFlight,
    /// The claim's answer was back before the hang-up.
    AfterAnswer,
    /// Too close to call, or claimed only after the hang-up.
    Unclear,
}

/// The hang-up's moment. `hung_up`: when the client closed its connection;
/// `looked` and `seen`: when the record's age was asked for and answered
/// (Redis read it in between); `age`: the claim's age then (`None`: no
/// record); `slow`: how late the proxy delivers the store's answers.
pub(super) fn of(hung_up: Instant, looked: Instant, seen: Instant, age: Option<Duration>, slow: Duration) -> Moment {
    let Some(age) = age else { return Moment::BeforeClaim };
    // The claim ran on Redis within [earliest, latest].
    let (Some(earliest), Some(latest)) = (looked.checked_sub(age + TICK), seen.checked_sub(age.saturating_sub(TICK)))
    else {
        return Moment::Unclear;
    };
    if latest + slow <= hung_up {
        Moment::AfterAnswer
    } else if latest <= hung_up && hung_up + GUARD < earliest + slow {
        Moment::InFlight
    } else {
        Moment::Unclear
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: Duration = Duration::from_millis(150);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A hang-up at `h`, the record's age asked for at h + 1 ms, read by
    /// Redis at h + 2 ms, answered at h + 3 ms; the claim made `offset` ms
    /// from the hang-up (negative: before it), or none.
    fn at(offset: Option<i64>) -> Moment {
        let h = Instant::now() + ms(1000);
        let claim = |o: i64| if o < 0 { h - ms(o.unsigned_abs()) } else { h + ms(o.unsigned_abs()) };
        let age = offset.map(|o| (h + ms(2)).saturating_duration_since(claim(o)));
        of(h, h + ms(1), h + ms(3), age, SLOW)
    }

    #[test]
    fn a_hang_up_is_dated_against_its_claim() {
        assert_eq!(at(None), Moment::BeforeClaim);
        // Claimed 50 ms before: its answer was due 100 ms after the hang-up.
        assert_eq!(at(Some(-50)), Moment::InFlight);
        // Claimed 145 ms before: the answer was due 5 ms after, inside the guard.
        assert_eq!(at(Some(-145)), Moment::Unclear);
        // Claimed 200 ms before: the answer was in 50 ms before the hang-up.
        assert_eq!(at(Some(-200)), Moment::AfterAnswer);
        // Claimed after the hang-up (a detached claim may be).
        assert_eq!(at(Some(5)), Moment::Unclear);
        // Claimed just as the client hung up: too close to call.
        assert_eq!(at(Some(0)), Moment::Unclear);
    }
}
