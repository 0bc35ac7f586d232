//! The outage log: one `WARN` line, a count an interval, one `INFO` line at
//! the end, not a line per request (`docs/operations.md`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The lock service's, fed by [`acquire_for_request`](super::acquire::acquire_for_request).
pub(crate) static LOCKS: OutageLog = OutageLog::new("the lock service", Duration::from_secs(10));

/// The idempotency store's, fed where keys and tokens are claimed.
pub(crate) static STORE: OutageLog = OutageLog::new("the idempotency store", Duration::from_secs(10));

pub(crate) struct OutageLog {
    what: &'static str,
    interval: Duration,
    /// Whether an outage is being logged: the one thing an answer reads.
    down: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// When the outage began (its first refusal); `None`: no outage.
    since: Option<Instant>,
    /// Requests refused since it began.
    refused: u64,
    /// When the last line about it was written, and the refusals since.
    reported: Option<Instant>,
    unreported: u64,
}

impl OutageLog {
    pub(crate) const fn new(what: &'static str, interval: Duration) -> Self {
        OutageLog {
            what,
            interval,
            down: AtomicBool::new(false),
            state: Mutex::new(State { since: None, refused: 0, reported: None, unreported: 0 }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Counters only: a poisoned state is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request refused for an unreachable service; `cause` is for the log only.
    pub(crate) fn refused(&self, cause: &str) {
        let now = Instant::now();
        let mut s = self.state();
        s.refused += 1;
        let (Some(since), Some(reported)) = (s.since, s.reported) else {
            s.since = Some(now);
            s.reported = Some(now);
            s.unreported = 0;
            self.down.store(true, Ordering::Relaxed);
            tracing::warn!(
                cause,
                "dlock: {} is unavailable; requests that need it are refused with 503 until it answers again",
                self.what
            );
            return;
        };
        s.unreported += 1;
        let quiet = now.saturating_duration_since(reported);
        if quiet >= self.interval {
            let refused = std::mem::take(&mut s.unreported);
            s.reported = Some(now);
            tracing::warn!(
                refused,
                down_ms = millis(now.saturating_duration_since(since)),
                cause,
                "dlock: {} is still unavailable, {refused} refused in the last {:.1} s",
                self.what,
                quiet.as_secs_f64()
            );
        }
    }

    /// The service answered (a grant, or a lock found held): ends an outage.
    pub(crate) fn answered(&self) {
        if !self.down.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.state();
        let Some(since) = s.since else { return };
        let refused = s.refused;
        *s = State::default();
        self.down.store(false, Ordering::Relaxed);
        let down = since.elapsed();
        tracing::info!(
            refused,
            down_ms = millis(down),
            "dlock: {} is available again after {} ms, {refused} requests refused",
            self.what,
            down.as_millis()
        );
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_testing::capture_logs;

    /// One warning, one count an interval, one line at the end; nothing otherwise.
    #[test]
    fn an_outage_is_one_line_a_summary_an_interval_and_an_end() {
        let (lines, _guard) = capture_logs();
        let log = OutageLog::new("the test service", Duration::from_millis(200));

        log.answered();
        assert!(lines.take_lines().is_empty(), "an answer outside an outage says nothing");

        for _ in 0..50 {
            log.refused("connection refused");
        }
        let start = lines.take_lines();
        assert_eq!(start.len(), 1, "{start:#?}");
        assert!(start[0].contains(" WARN ") && start[0].contains("the test service is unavailable"), "{start:?}");
        assert!(start[0].contains("connection refused"), "{start:?}");

        std::thread::sleep(Duration::from_millis(250));
        for _ in 0..10 {
            log.refused("connection refused");
        }
        let summary = lines.take_lines();
        assert_eq!(summary.len(), 1, "{summary:#?}");
        // 49 after the first line, and the one that found the interval over.
        assert!(summary[0].contains("is still unavailable, 50 refused in the last 0."), "{summary:?}");
        assert!(summary[0].contains("refused=50"), "{summary:?}");

        log.answered();
        log.answered();
        let end = lines.take_lines();
        assert_eq!(end.len(), 1, "{end:#?}");
        assert!(end[0].contains(" INFO ") && end[0].contains("available again"), "{end:?}");
        assert!(end[0].contains("refused=60"), "every refusal of the outage: {end:?}");

        // The next outage starts afresh.
        log.refused("timed out");
        let again = lines.take_lines();
        assert!(again.len() == 1 && again[0].contains("is unavailable") && again[0].contains("timed out"), "{again:?}");
    }
}
