//! `postgres`: the Postgres backend under `kill -9` of holders and under
//! restarts of the server (issue 27).
//!
//! * `kill-client`: holders killed with `kill -9` every ~0.8 s and replaced
//!   at once (lease 500 ms, watchdog). Promised safe; the victims' keys must
//!   be granted again within lease + 1 s.
//! * `restart`: the server crashes (`pg_ctl stop -m immediate`: no
//!   checkpoint, the WAL replayed at the next start) under load and comes
//!   back, with leases longer than the outage (watchdog, 5 s). The lease
//!   table and the fencing sequence are durable: held locks are still held
//!   after the restart, tokens keep growing. Promised safe. Each crash also
//!   has a probe: a lock the harness holds across it must be refused to
//!   another client after the restart.
//! * `restart` again, on a server set to `synchronous_commit = off` (a
//!   common throughput setting, which answers a commit before its WAL is
//!   written), crashed as a machine would crash under it: the WAL writers
//!   are held for a moment under load (the probe's grant among what is
//!   committed meanwhile) and then killed, so crash recovery loses every
//!   commit that did not write its own WAL. dlock pins its statements'
//!   commits durable (backend/postgres/durable.rs): promised safe all the
//!   same. The first row's clean crash keeps what the server had in memory
//!   and cannot tell (review 2026-12-07, E2).
//!
//! Every row checks C6 on the table: no live lease row once every worker
//! has ended.

use std::time::Duration;

use dlock_core::backend::postgres::PostgresBackend;
use dlock_core::{AcquireOptions, LockKey, Locker};
use dlock_testing::PostgresServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::kill_client::judge_recovery;
use crate::rng::Rng;
use crate::scenario::{config, describe, finish, kill_holders, resource_server, spawn_workers, workers_started, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![
        kill_client(size, seed).await?,
        restart(size, seed, Crash::Immediate).await?,
        restart(size, seed, Crash::LosingUnwrittenWal).await?,
    ])
}

/// Live lease rows left in the workers' table (their prefix is `torture`):
/// the heads of held keys.
pub(crate) fn live_rows(pg: &PostgresServer) -> Result<u64, String> {
    let out = pg.psql("SELECT count(*) FROM torture_locks WHERE expires_at > clock_timestamp()");
    out.parse().map_err(|e| format!("live rows: `{out}`: {e}"))
}

async fn kill_client(size: Size, seed: u64) -> Result<Report, String> {
    let pg = tokio::task::spawn_blocking(PostgresServer::start).await.map_err(|e| format!("Postgres: {e}"))?;
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new("postgres-kill").map_err(|e| e.to_string())?;
    let kills = size.pick(4u64, 40);
    let mut cfg = config("postgres", vec![pg.url()], &res_server, seed);
    cfg.lease_ms = 500;
    cfg.keys = 3;
    cfg.cs_max_ms = 10;
    cfg.duration_ms = kills * 800 + 1500;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(10)).await?;
    let mut rng = Rng::new(seed);
    let done = kill_holders(&mut run, &cfg, kills, Duration::from_millis(600), 500, &mut rng).await?;
    let mut r = Report::new("postgres", "postgres (kill -9 a holder)", seed);
    r.expected_safe = true;
    r.faults = done;
    if done < kills {
        r.note(format!("{} of {kills} episode(s) found no holder to hit and were skipped", kills - done));
    }
    r.fault_kind = "kill -9 a holder, lease 500 ms (watchdog)".into();
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    judge_recovery(&mut r, cfg.lease_ms as f64 + 1000.0);
    sleep(Duration::from_millis(cfg.lease_ms + 100)).await;
    let left = tokio::task::block_in_place(|| live_rows(&pg))?;
    r.residual_keys = Some(left);
    if left > 0 {
        r.fail(format!("{left} lease row(s) of killed holders outlived their lease"));
    }
    Ok(r)
}

/// How a restart row brings the server down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// `pg_ctl stop -m immediate`, then start, on a server with the default
    /// settings: what the server wrote (to the operating system) stays.
    Immediate,
    /// On a server set to `synchronous_commit = off`: the WAL writers held
    /// for [`WAL_HELD`] under load, then killed (recovery follows at once).
    LosingUnwrittenWal,
}

/// How long the WAL writers are held before the crash: the asynchronous
/// commit window (at most `3 × wal_writer_delay`, 600 ms by default), which
/// the workers' grants and releases fall into.
const WAL_HELD: Duration = Duration::from_millis(400);

impl Crash {
    fn server(self) -> PostgresServer {
        match self {
            Crash::Immediate => PostgresServer::start(),
            Crash::LosingUnwrittenWal => PostgresServer::start_with(&[("synchronous_commit", "off")]),
        }
    }

    /// Before the probe's grant: nothing, or the WAL writers held.
    fn prepare(self, pg: &mut PostgresServer) {
        if self == Crash::LosingUnwrittenWal {
            pg.hold_wal_writes();
        }
    }

    /// Down, and back.
    fn crash(self, pg: &mut PostgresServer) {
        match self {
            Crash::Immediate => {
                pg.crash();
                pg.start_again();
            }
            Crash::LosingUnwrittenWal => pg.crash_losing_unwritten_wal(),
        }
    }
}

async fn restart(size: Size, seed: u64, crash: Crash) -> Result<Report, String> {
    let mut pg = tokio::task::spawn_blocking(move || crash.server()).await.map_err(|e| format!("Postgres: {e}"))?;
    let (res_server, resource) = resource_server().await?;
    let run_name = match crash {
        Crash::Immediate => "postgres-restart",
        Crash::LosingUnwrittenWal => "postgres-async-crash",
    };
    let mut run = Run::new(run_name).map_err(|e| e.to_string())?;
    let restarts = size.pick(2u64, 10);
    let mut cfg = config("postgres", vec![pg.url()], &res_server, seed);
    cfg.lease_ms = 5000;
    cfg.keys = 2;
    // Sections long enough that holders are inside one when the server
    // crashes, so a lost lease would show as an overlap (C1).
    (cfg.cs_min_ms, cfg.cs_max_ms) = (100, 400);
    cfg.wait_ms = 3000;
    cfg.duration_ms = restarts * 4000 + 2000;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(10)).await?;
    let mut done = 0;
    let mut longest = Duration::ZERO;
    let mut probe_failures = Vec::new();
    for i in 0..restarts {
        sleep(Duration::from_millis(1500)).await;
        // The probe: a lock held across the crash must still be held after
        // it (a table that lost its rows would grant it to the next asker).
        let key = format!("probe-{i}");
        let holder = probe_locker(&pg).await?;
        tokio::task::block_in_place(|| crash.prepare(&mut pg));
        let held =
            holder.acquire(&probe_key(&holder, &key)?, probe_lease()).await.map_err(|e| format!("probe: {e}"))?;
        if crash == Crash::LosingUnwrittenWal {
            sleep(WAL_HELD).await;
        }
        run.log("kill", None);
        let down = tokio::time::Instant::now();
        tokio::task::block_in_place(|| crash.crash(&mut pg));
        run.log("restart", None);
        longest = longest.max(down.elapsed());
        done += 1;
        let other = probe_locker(&pg).await?;
        match other.try_acquire(&probe_key(&other, &key)?).await {
            Err(e) if e.is_contention() => {}
            Ok(_) => probe_failures.push(format!("{key}: granted to another client after the restart")),
            Err(e) => probe_failures.push(format!("{key}: {e}")),
        }
        drop(held);
    }
    let (row, fault) = match crash {
        Crash::Immediate => ("postgres (crash and restart)", "pg_ctl stop -m immediate, then start".to_owned()),
        Crash::LosingUnwrittenWal => (
            "postgres (OS crash, asynchronous commit)",
            format!(
                "synchronous_commit = off; WAL writers held {} ms under load, then killed (recovery loses what \
                 commits left unwritten)",
                WAL_HELD.as_millis()
            ),
        ),
    };
    let mut r = Report::new("postgres", row, seed);
    r.expected_safe = true;
    r.faults = done;
    r.fault_kind = format!("{fault} (longest outage {} ms), leases 5 s", longest.as_millis());
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
    r.note(format!(
        "acquires answered unavailable during the outages: {}; releases answered `not held`: {}",
        findings.acq_unavailable, findings.released_not_held
    ));
    r.note(format!(
        "probes (a lock held across each crash, asked for after it): {} of {done} refused",
        done - probe_failures.len() as u64
    ));
    for failure in &probe_failures {
        r.fail(format!("a lock held across a crash was lost: {failure}"));
    }
    if longest >= Duration::from_millis(cfg.lease_ms) {
        r.fail("an outage outlasted the leases: the row no longer tests that held locks survive a restart");
    }
    let left = tokio::task::block_in_place(|| live_rows(&pg))?;
    r.residual_keys = Some(left);
    if left > 0 {
        r.fail(format!("{left} live lease row(s) after every worker released"));
    }
    Ok(r)
}

/// A client of the restart row's probe, on its own connections (`probe_`
/// tables beside the workers' `torture_` ones).
async fn probe_locker(pg: &PostgresServer) -> Result<Locker, String> {
    let backend = PostgresBackend::connect(&pg.url(), "probe").await.map_err(|e| format!("probe: {e}"))?;
    Ok(Locker::new(backend))
}

fn probe_key(locker: &Locker, name: &str) -> Result<LockKey, String> {
    locker.key(name).build().map_err(|e| e.to_string())
}

/// The probe's lease: far longer than an outage, never renewed.
fn probe_lease() -> AcquireOptions {
    AcquireOptions::new().with_lease(Duration::from_secs(30))
}
