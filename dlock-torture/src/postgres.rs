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
//!   after the restart, tokens keep growing. Promised safe.
//!
//! Both rows check C6 on the table: no live lease row once every worker has
//! ended.

use std::time::Duration;

use dlock_testing::PostgresServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::mono_ns;
use crate::kill_client::judge_recovery;
use crate::rng::Rng;
use crate::scenario::{config, describe, find_holder, finish, resource_server, spawn_workers, workers_started, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![kill_client(size, seed).await?, restart(size, seed).await?])
}

/// Live lease rows left in the workers' table (their prefix is `torture`).
fn live_rows(pg: &PostgresServer) -> Result<u64, String> {
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
    let total = kills * 800 + 1500;
    cfg.duration_ms = total;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(10)).await?;
    let started = mono_ns();
    let mut rng = Rng::new(seed);
    let mut done = 0;
    for _ in 0..kills {
        sleep(Duration::from_millis(600)).await;
        let Some(pid) = find_holder(&run, None, Duration::from_millis(500), &mut rng).await? else { continue };
        tokio::task::block_in_place(|| run.kill(pid));
        done += 1;
        let mut again = cfg.clone();
        again.duration_ms = total.saturating_sub((mono_ns() - started) / 1_000_000).max(500);
        run.spawn(again).map_err(|e| e.to_string())?;
    }
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

async fn restart(size: Size, seed: u64) -> Result<Report, String> {
    let mut pg = tokio::task::spawn_blocking(PostgresServer::start).await.map_err(|e| format!("Postgres: {e}"))?;
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new("postgres-restart").map_err(|e| e.to_string())?;
    let restarts = size.pick(2u64, 10);
    let mut cfg = config("postgres", vec![pg.url()], &res_server, seed);
    cfg.lease_ms = 5000;
    cfg.keys = 2;
    cfg.cs_max_ms = 20;
    cfg.wait_ms = 3000;
    cfg.duration_ms = restarts * 4000 + 2000;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(10)).await?;
    let mut done = 0;
    let mut longest = Duration::ZERO;
    for _ in 0..restarts {
        sleep(Duration::from_millis(1500)).await;
        run.log("kill", None);
        let down = tokio::time::Instant::now();
        tokio::task::block_in_place(|| {
            pg.crash();
            pg.start_again();
        });
        run.log("restart", None);
        longest = longest.max(down.elapsed());
        done += 1;
    }
    let mut r = Report::new("postgres", "postgres (crash and restart)", seed);
    r.expected_safe = true;
    r.faults = done;
    r.fault_kind =
        format!("pg_ctl stop -m immediate, then start (longest outage {} ms), leases 5 s", longest.as_millis());
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
    r.note(format!(
        "acquires answered unavailable during the outages: {}; releases answered `not held`: {}",
        findings.acq_unavailable, findings.released_not_held
    ));
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
