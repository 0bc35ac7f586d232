//! Restart quarantine: no grants from a Redis that may have lost its locks,
//! until every lease granted before the loss has run out.
//!
//! A Redis restarted without persistence (or with `appendfsync everysec`
//! after a crash, or flushed) has forgotten locks whose holders still
//! believe they hold them; granting the keys again at once puts two holders
//! in the critical section. The Redis documentation's remedy is to keep the
//! restarted server unavailable for the longest lease. dlock enforces it in
//! the client when `DLOCK_RESTART_QUARANTINE_MS` is set (to at least the
//! longest lease any client uses). The rule: quarantine only what the
//! server's own uptime leaves in doubt.
//!
//! * **run_id**: at the first contact, and whenever the connection was lost
//!   or re-established since, the backend reads `INFO server`. A server
//!   whose `run_id` is new to this client and whose uptime is below the
//!   quarantine grants nothing until its uptime reaches it. A server up
//!   longer than the quarantine cannot still hold a lease granted before
//!   its restart, so it is not quarantined.
//! * **data marker**: a key without TTL that the acquire script checks, so
//!   a restart this client did not notice (it was idle) or a `FLUSHALL`
//!   shows as a missing marker. When the server has been up less than the
//!   quarantine, the rest of it is sat out before the marker is set again.
//!   When it has been up longer, the marker is set and grants go on at once
//!   (a new server, a first deploy: logged at info, "data marker set") —
//!   except when this process saw the marker present on the same `run_id`:
//!   then the data was flushed under our eyes, and the quarantine runs from
//!   now (the latest the loss can have happened).
//!
//! **The gap**: a flush that no client watching the server saw (every
//! process that had seen the marker restarted, or none was running) looks
//! like a first deploy on a server that has been up long, and is granted at
//! once. Persistence (`appendonly yes`, `appendfsync always`) and an ACL
//! that refuses `FLUSHALL`/`FLUSHDB` to the clients close it.
//!
//! The check reads `INFO server`, a `@dangerous` command: under an ACL with
//! `-@dangerous` the user needs `+info`, which `connect` checks up front.
//!
//! A quarantined acquire fails with [`Error::Backend`] (`503` over HTTP):
//! unavailable, never unsafe. Renewals need no quarantine (they only extend
//! a key that is still there).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{lost_connection, redis_error, Conn};
use crate::error::{Error, Result};

/// The restart guard of one Redis server (one RedLock node).
#[derive(Debug)]
pub(crate) struct RestartGuard {
    quarantine: Duration,
    /// The key the acquire script checks.
    pub(crate) marker: String,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The server's `run_id` when we last checked.
    run_id: Option<String>,
    /// A connection error happened since the last check.
    suspect: bool,
    /// No grants before this instant.
    until: Option<Instant>,
    /// The marker was found missing and a full quarantine has been sat out
    /// since: the marker may be set again.
    marker_wait_done: bool,
    /// This process saw the marker present on the server of `run_id`: a
    /// marker missing there later was flushed under our eyes.
    marker_seen: bool,
    /// The connection's generation at the last identity check: a new one
    /// means the connection was re-established, perhaps to a restarted
    /// server.
    generation: u64,
}

impl RestartGuard {
    pub(crate) fn new(quarantine: Duration, prefix: &str) -> Self {
        RestartGuard {
            quarantine,
            marker: format!("{prefix}:{{dlock-data-marker}}"),
            state: Mutex::new(State {
                run_id: None,
                suspect: true,
                until: None,
                marker_wait_done: false,
                marker_seen: false,
                generation: 0,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Single-field updates only: a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection failed: the server may have restarted.
    fn suspect(&self) {
        self.state().suspect = true;
    }

    fn refuse(&self, left: Duration, why: &str) -> Error {
        Error::backend(
            "redis",
            format!(
                "{why}; no grants for {} ms more (DLOCK_RESTART_QUARANTINE_MS = {} ms), so that no lease granted \
                 before it can still be running",
                left.as_millis(),
                self.quarantine.as_millis()
            ),
        )
    }

    /// Before a grant: refuses while quarantined, and checks the server's
    /// identity when a restart is in doubt.
    pub(crate) async fn check(&self, conn: &Conn) -> Result<()> {
        let generation = conn.generation();
        {
            let mut s = self.state();
            let now = Instant::now();
            match s.until {
                Some(until) if now < until => {
                    return Err(self.refuse(until - now, "the Redis server restarted or lost data"))
                }
                Some(_) => s.until = None,
                None => {}
            }
            if s.generation != generation {
                s.suspect = true;
            }
            if !s.suspect && s.marker_seen {
                return Ok(());
            }
        }
        if self.state().suspect {
            let (run_id, uptime) = self.server_identity(conn).await?;
            let mut s = self.state();
            let restarted = s.run_id.as_deref() != Some(run_id.as_str());
            if restarted {
                s.marker_seen = false;
            }
            s.run_id = Some(run_id);
            s.suspect = false;
            s.generation = generation;
            if restarted && uptime < self.quarantine {
                let left = self.quarantine - uptime;
                s.until = Some(Instant::now() + left);
                return Err(self.refuse(left, &format!("the Redis server has been up only {} s", uptime.as_secs())));
            }
        }
        if !self.state().marker_seen {
            // Once per server, until the marker is seen: every grant is
            // then preceded by the marker having been seen here, so a flush
            // later is recognised as one.
            let present: i64 = redis::cmd("EXISTS")
                .arg(&self.marker)
                .query_async(&mut conn.clone())
                .await
                .map_err(|e| self.failed(e))?;
            if present == 1 {
                self.state().marker_seen = true;
            }
        }
        Ok(())
    }

    /// The acquire script found the data marker missing. Returns `Ok` when
    /// the marker has been set again and the acquire may be retried.
    ///
    /// Many calls may find the marker gone at once (coalesced batches, tasks
    /// on one connection), and their answers come in any order: whatever
    /// one of them decided, a quarantine in force refuses the others, and
    /// each judges a flush by what this process knew before asking.
    pub(crate) async fn marker_missing(&self, conn: &Conn) -> Result<()> {
        let (wait_done, seen_before) = {
            let s = self.state();
            if let Some(left) = Self::left(&s) {
                return Err(self.lost_data(left));
            }
            (s.marker_wait_done, s.marker_seen)
        };
        if wait_done {
            self.set_marker(conn).await?;
            // Cleared only once the marker is set: a RedLock attempt may drop
            // this future half-way, and must not have to wait again.
            self.state().marker_wait_done = false;
            tracing::info!(marker = %self.marker, "dlock: restart quarantine over; Redis grants locks again");
            return Ok(());
        }
        let (run_id, uptime) = self.server_identity(conn).await?;
        {
            // Another answer may have started a quarantine while we asked.
            let s = self.state();
            if let Some(left) = Self::left(&s) {
                return Err(self.lost_data(left));
            }
        }
        let flushed_under_our_eyes = seen_before && self.state().run_id.as_deref() == Some(run_id.as_str());
        if uptime >= self.quarantine && !flushed_under_our_eyes {
            // Up longer than any lease: nothing granted before a restart can
            // still run. A new server, or a first deploy on it.
            self.set_marker(conn).await?;
            let mut s = self.state();
            s.run_id = Some(run_id);
            s.suspect = false;
            tracing::info!(marker = %self.marker, uptime_s = uptime.as_secs(), "dlock: data marker set");
            return Ok(());
        }
        let mut s = self.state();
        // Lost at restart: the quarantine counts from the start. Flushed
        // under our eyes: from now, the latest the loss can have happened.
        let left = if flushed_under_our_eyes { self.quarantine } else { self.quarantine - uptime };
        s.run_id = Some(run_id);
        s.suspect = false;
        s.marker_seen = false;
        s.until = Some(Instant::now() + left);
        s.marker_wait_done = true;
        tracing::warn!(marker = %self.marker, left_ms = left.as_millis() as u64, "dlock: Redis lost its data; quarantined");
        Err(self.lost_data(left))
    }

    /// What is left of a quarantine in force.
    fn left(s: &State) -> Option<Duration> {
        s.until.and_then(|u| u.checked_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    fn lost_data(&self, left: Duration) -> Error {
        self.refuse(left, "the Redis server lost its data (restart without persistence, or a flush)")
    }

    async fn set_marker(&self, conn: &Conn) -> Result<()> {
        let _: () = redis::cmd("SET")
            .arg(&self.marker)
            .arg("1")
            .arg("NX")
            .query_async(&mut conn.clone())
            .await
            .map_err(|e| self.failed(e))?;
        self.state().marker_seen = true;
        Ok(())
    }

    /// At start-up: the quarantine reads `INFO server` before grants, a
    /// `@dangerous` command that the README's ACL (`-@dangerous`) refuses;
    /// without this check every acquire would fail later instead.
    pub(crate) async fn check_permission(&self, conn: &Conn) -> Result<()> {
        let info: redis::RedisResult<String> = redis::cmd("INFO").arg("server").query_async(&mut conn.clone()).await;
        match info {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("NOPERM") => Err(Error::config(
                "DLOCK_RESTART_QUARANTINE_MS",
                "the restart quarantine reads `INFO server`, which the Redis ACL user may not run; allow it with \
                 `ACL SETUSER <user> +info`, or unset DLOCK_RESTART_QUARANTINE_MS",
            )),
            Err(e) => Err(redis_error(e)),
        }
    }

    /// A command failed; a broken connection may mean a restarted server.
    pub(crate) fn failed(&self, e: redis::RedisError) -> Error {
        if lost_connection(&e) {
            self.suspect();
        }
        redis_error(e)
    }

    /// `run_id` and uptime from `INFO server`.
    async fn server_identity(&self, conn: &Conn) -> Result<(String, Duration)> {
        let mut c = conn.clone();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut c).await.map_err(|e| self.failed(e))?;
        parse_identity(&info).ok_or_else(|| {
            Error::backend("redis", "INFO server gave no run_id and uptime_in_seconds; cannot check for restarts")
        })
    }
}

/// `run_id` and the least time the server can have been up.
///
/// Redis computes `uptime_in_seconds` as the difference of two whole-second
/// clocks (now and the start), so it reads 1 after 0.2 s when the start fell
/// at x.9 s. Counting it as one second more than the truth would end a
/// quarantine up to a second early, while a lease granted before the
/// restart still runs: one second is taken off.
fn parse_identity(info: &str) -> Option<(String, Duration)> {
    let field = |name: &str| {
        info.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(':')).map(str::trim))
    };
    let run_id = field("run_id")?.to_owned();
    let uptime = field("uptime_in_seconds")?.parse::<u64>().ok()?;
    Some((run_id, Duration::from_secs(uptime.saturating_sub(1))))
}

/// A failed lock command as an error, told to the restart quarantine first
/// when it is on.
pub(crate) fn command_failed(guard: Option<&RestartGuard>, e: redis::RedisError) -> Error {
    match guard {
        Some(guard) => guard.failed(e),
        None => redis_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers that find the marker gone after a flush, all at once (as a
    /// coalesced batch's do): whichever is judged first starts the
    /// quarantine, and none of the others may end it by setting the marker
    /// again. Before, the second one read the first one's `marker_seen =
    /// false`, took the flush for a first use and granted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_racing_after_a_flush_all_stay_quarantined() {
        let server = dlock_testing::RedisServer::start();
        // Up longer than the quarantine (uptime is counted a second short).
        tokio::time::sleep(Duration::from_millis(2_100)).await;
        let options = super::super::RedisOptions::default();
        let conn =
            Conn::Single(super::super::RedisConnection::connect(&server.url(), &options).await.expect("connect"));
        let guard = RestartGuard::new(Duration::from_millis(500), "race");
        guard.check(&conn).await.expect("first contact");
        guard.marker_missing(&conn).await.expect("first use of a server up long enough: the marker is set");
        guard.check(&conn).await.expect("the marker is seen");
        let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
        let answers = futures_util::future::join_all((0..8).map(|_| guard.marker_missing(&conn))).await;
        let granted = answers.iter().filter(|a| a.is_ok()).count();
        assert_eq!(granted, 0, "a flush under our eyes quarantines every racing answer: {answers:?}");
    }

    #[test]
    fn identity_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\ntcp_port:6379\r\nuptime_in_seconds:42\r\n";
        // 42 whole seconds on Redis' clocks: at least 41 really.
        assert_eq!(parse_identity(info), Some(("abc123".into(), Duration::from_secs(41))));
        assert_eq!(parse_identity("# Server\r\nrun_id:x\r\n"), None);
    }
}
