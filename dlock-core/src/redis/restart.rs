//! Restart quarantine: no grants from a Redis that may have lost its locks,
//! until every lease granted before the loss has run out. On when
//! `DLOCK_RESTART_QUARANTINE_MS` is set (to at least the longest lease any
//! client uses, in every client of the server).
//!
//! * **run_id**: whenever a restart is in doubt (first contact, a
//!   connection lost or re-established), `INFO server` is read; a server
//!   whose `run_id` is new and whose uptime is below the quarantine grants
//!   nothing until its uptime reaches it.
//! * **data marker**: `prefix:{dlock-data-marker}`, a key without TTL that
//!   every acquire script (and the idempotency store's claim script)
//!   checks. Every missing marker is taken for a possible flush: the first
//!   client that finds it missing records the server time in
//!   `prefix:{dlock-data-marker}:quarantine`, every client refuses until
//!   its quarantine has passed since then, and the first to ask after that
//!   sets the marker again, each step one script ([`QUARANTINE`]).
//!
//! A quarantined acquire fails with [`Error::Backend`] (`503` over HTTP):
//! unavailable, never unsafe. Renewals need no quarantine. A failover to a
//! replica is not seen. `docs/redis-design.md` has what is promised and
//! why, and the gaps.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::connection::Conn;
use super::error::{lost_connection, redis_error};
use super::script::ScriptCall;
use crate::error::{Error, Result};

/// Starts, reports or ends the quarantine of a missing data marker, in one
/// step with the check of the marker.
///
/// KEYS[1] the data marker; KEYS[2] the quarantine's record: the server
/// time in µs at which the marker was first found missing (no TTL).
/// ARGV[1] the caller's quarantine in µs; ARGV[2] `1` to set the marker
/// again when the quarantine is over, `0` only to start it.
/// Returns `{1, 0}` when the marker is there, `{1, 1}` when this call set
/// it again, `{0, µs left, 1 if this call started the quarantine}`
/// otherwise.
const QUARANTINE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {1, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local start = tonumber(redis.call('GET', KEYS[2]) or '')
local started = 0
if not start then
  start = now
  started = 1
  redis.call('SET', KEYS[2], string.format('%d', now))
end
local left = start + tonumber(ARGV[1]) - now
if left > 0 or ARGV[2] ~= '1' then
  return {0, left, started}
end
redis.call('SET', KEYS[1], '1')
redis.call('DEL', KEYS[2])
return {1, 1}
";

/// The restart guard of one Redis server (one RedLock node).
#[derive(Debug)]
pub(crate) struct RestartGuard {
    quarantine: Duration,
    /// The key the acquire script checks.
    pub(crate) marker: String,
    /// Where the start of the quarantine of a missing marker is kept.
    record: String,
    script: Script,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The server's `run_id` when we last checked.
    run_id: Option<String>,
    /// A connection error happened since the last check.
    suspect: bool,
    /// No grants before this instant: what this process knows of a
    /// quarantine in force (the server's record decides; this only spares
    /// it a round trip, and is never earlier than the record's end).
    until: Option<Instant>,
    /// The connection's generation at the last identity check: a new one
    /// means the connection was re-established, perhaps to a restarted
    /// server.
    generation: u64,
}

/// What the quarantine script found.
#[derive(Debug, PartialEq, Eq)]
enum Marker {
    /// The marker is there; `set`: this call set it again.
    Present { set: bool },
    /// Missing, in quarantine for `left` more; `started`: by this call.
    Quarantined { left: Duration, started: bool },
}

impl RestartGuard {
    pub(crate) fn new(quarantine: Duration, prefix: &str) -> Self {
        let marker = format!("{prefix}:{{dlock-data-marker}}");
        RestartGuard {
            quarantine,
            record: format!("{marker}:quarantine"),
            marker,
            script: Script::new(QUARANTINE),
            state: Mutex::new(State { run_id: None, suspect: true, until: None, generation: 0 }),
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

    /// The refusal, carrying `left` for [`Error::retry_after`] (a client's
    /// `Retry-After`).
    fn refuse(&self, left: Duration, why: &str) -> Error {
        Error::unavailable_for(
            "redis",
            format!(
                "{why}; no grants for {} ms more (DLOCK_RESTART_QUARANTINE_MS = {} ms), so that no lease granted \
                 before it can still be running",
                left.as_millis(),
                self.quarantine.as_millis()
            ),
            left,
        )
    }

    /// No grants here for `left` more (never shortens a quarantine known).
    fn refuse_for(&self, left: Duration) {
        let until = Instant::now() + left;
        let mut s = self.state();
        s.until = Some(s.until.map_or(until, |u| u.max(until)));
    }

    /// Before a grant: refuses while quarantined, and checks the server's
    /// identity when a restart is in doubt.
    pub(crate) async fn check(&self, conn: &Conn) -> Result<()> {
        let generation = conn.generation();
        {
            let mut s = self.state();
            if let Some(left) = Self::left(&s) {
                return Err(self.refuse(left, "the Redis server restarted or lost data"));
            }
            s.until = None;
            if s.generation != generation {
                s.suspect = true;
            }
            if !s.suspect {
                return Ok(());
            }
        }
        let (run_id, uptime) = self.server_identity(conn).await?;
        let restarted = {
            let mut s = self.state();
            let restarted = s.run_id.as_deref() != Some(run_id.as_str());
            s.run_id = Some(run_id);
            s.suspect = false;
            s.generation = generation;
            restarted
        };
        if restarted && uptime < self.quarantine {
            let mut left = self.quarantine - uptime;
            // Without persistence the marker went with the restart: its
            // quarantine starts now, not after this one (which would make
            // two in a row). It only starts here; `marker_missing` ends it.
            if let Marker::Quarantined { left: missing, .. } = self.run_script(conn, false).await? {
                left = left.max(missing);
            }
            self.refuse_for(left);
            return Err(self.refuse(left, &format!("the Redis server has been up only {} s", uptime.as_secs())));
        }
        Ok(())
    }

    /// The acquire script found the data marker missing. Returns `Ok` when
    /// the marker is there again (set now by this call, after a full
    /// quarantine since the loss was first seen, or by another client) and
    /// the acquire may be retried; otherwise refuses for what is left of
    /// the quarantine, started now if nobody had.
    ///
    /// Many calls may find the marker gone at once (coalesced batches, tasks
    /// on one connection, other processes): the server's record is the one
    /// quarantine they all count from, and the script that ends it is the
    /// only one that sets the marker.
    pub(crate) async fn marker_missing(&self, conn: &Conn) -> Result<()> {
        if let Some(left) = Self::left(&self.state()) {
            return Err(self.lost_data(left));
        }
        // The connection may have been re-established since the acquire's
        // own check, to a restarted server: its identity is checked first,
        // so that a record kept by its persistence is not ended before its
        // uptime reaches the quarantine.
        self.check(conn).await?;
        match self.run_script(conn, true).await? {
            Marker::Present { set } => {
                if set {
                    tracing::info!(marker = %self.marker, "dlock: restart quarantine over; Redis grants locks again");
                }
                Ok(())
            }
            Marker::Quarantined { left, started } => {
                if started {
                    tracing::warn!(
                        marker = %self.marker,
                        left_ms = left.as_millis() as u64,
                        "dlock: the Redis data marker is missing (data lost, or a server new to dlock); quarantined"
                    );
                }
                self.refuse_for(left);
                Err(self.lost_data(left))
            }
        }
    }

    /// The quarantine script (see [`QUARANTINE`]); `end`: set the marker
    /// again when the quarantine is over.
    async fn run_script(&self, conn: &Conn, end: bool) -> Result<Marker> {
        let mut call = ScriptCall::new(&self.script, &[self.marker.as_str(), self.record.as_str()], 2);
        let micros = u64::try_from(self.quarantine.as_micros()).unwrap_or(u64::MAX);
        #[cfg(feature = "broken-variants")]
        let micros = crate::broken_variants::quarantine_micros(micros);
        call.arg(micros).arg(if end { "1" } else { "0" });
        let reply: Vec<i64> = call.invoke(&mut conn.clone()).await.map_err(|e| self.failed(e))?;
        match reply.as_slice() {
            [1, set] => Ok(Marker::Present { set: *set == 1 }),
            [0, left, started] => Ok(Marker::Quarantined {
                left: Duration::from_micros(u64::try_from(*left).unwrap_or(0)),
                started: *started == 1,
            }),
            other => Err(Error::backend("redis", format!("unexpected reply from the quarantine script: {other:?}"))),
        }
    }

    /// What is left of a quarantine in force.
    fn left(s: &State) -> Option<Duration> {
        s.until.and_then(|u| u.checked_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    fn lost_data(&self, left: Duration) -> Error {
        self.refuse(
            left,
            "the Redis server lost its data (restart without persistence, or a flush), or is new to dlock: its data \
             marker is missing",
        )
    }

    /// At start-up: the quarantine reads `INFO server` before grants, a
    /// `@dangerous` command that the ACL of `docs/backends.md` (`-@dangerous`) refuses;
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn connect(server: &dlock_testing::RedisServer) -> Conn {
        let options = crate::redis::RedisOptions::default();
        Conn::Single(
            super::super::connection::RedisConnection::connect(&server.url(), &options).await.expect("connect"),
        )
    }

    fn exists(server: &dlock_testing::RedisServer, key: &str) -> bool {
        let n: u64 = redis::cmd("EXISTS").arg(key).query(&mut server.connection()).expect("EXISTS");
        n == 1
    }

    /// Answers that find the marker gone after a flush, all at once (as a
    /// coalesced batch's do): one of them starts the quarantine, and none
    /// of the others may end it by setting the marker again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_racing_after_a_flush_all_stay_quarantined() {
        let server = dlock_testing::RedisServer::start();
        // Up longer than the quarantine (uptime is counted a second short).
        tokio::time::sleep(Duration::from_millis(2_100)).await;
        let conn = connect(&server).await;
        let guard = RestartGuard::new(Duration::from_millis(500), "race");
        let _: () = redis::cmd("SET").arg(&guard.marker).arg("1").query(&mut server.connection()).expect("SET");
        guard.check(&conn).await.expect("first contact");
        let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
        let answers = futures_util::future::join_all((0..8).map(|_| guard.marker_missing(&conn))).await;
        let granted = answers.iter().filter(|a| a.is_ok()).count();
        assert_eq!(granted, 0, "a flush quarantines every racing answer: {answers:?}");
        assert!(!exists(&server, &guard.marker), "nobody set the marker again");
    }

    /// A1: the quarantine lives on the server. Two processes (two guards)
    /// find the marker missing; the second joins the first one's quarantine,
    /// and whichever asks after it ended sets the marker again. The next
    /// flush then starts a new, full quarantine for every process, the one
    /// that did not end the first included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_quarantine_is_kept_on_the_server_and_every_flush_gets_one() {
        let server = dlock_testing::RedisServer::start();
        tokio::time::sleep(Duration::from_millis(2_100)).await;
        let conn = connect(&server).await;
        let quarantine = Duration::from_millis(400);
        let (a, c) = (RestartGuard::new(quarantine, "shared"), RestartGuard::new(quarantine, "shared"));
        a.check(&conn).await.expect("up long enough");
        c.check(&conn).await.expect("up long enough");

        let started = Instant::now();
        a.marker_missing(&conn).await.expect_err("a server without the marker is quarantined first");
        assert!(exists(&server, &a.record), "the quarantine's start is on the server");
        c.marker_missing(&conn).await.expect_err("the other process sees the same quarantine");
        // Past the end as each process knows it (counted from its reply).
        tokio::time::sleep_until(started + quarantine + Duration::from_millis(100)).await;
        c.marker_missing(&conn).await.expect("over: the other process sets the marker again");
        assert!(exists(&server, &c.marker) && !exists(&server, &c.record));
        a.marker_missing(&conn).await.expect("the marker is there");

        let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
        let flushed = Instant::now();
        a.marker_missing(&conn).await.expect_err("the next flush is quarantined for A too");
        c.marker_missing(&conn).await.expect_err("and for C");
        let mut granted = None;
        while granted.is_none() {
            if a.marker_missing(&conn).await.is_ok() {
                granted = Some(flushed.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let granted = granted.unwrap_or_default();
        assert!(granted >= quarantine, "ended {granted:?} after the flush");
    }

    #[test]
    fn identity_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\ntcp_port:6379\r\nuptime_in_seconds:42\r\n";
        // 42 whole seconds on Redis' clocks: at least 41 really.
        assert_eq!(parse_identity(info), Some(("abc123".into(), Duration::from_secs(41))));
        assert_eq!(parse_identity("# Server\r\nrun_id:x\r\n"), None);
    }
}
