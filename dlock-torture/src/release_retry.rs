//! `release-retry`: releases that hit an outage, retried in the background,
//! under owners that are reused (`AcquireOptions::with_owner`, as the HTTP
//! layer's per-request owner or an application's own do).
//!
//! Every task of every worker acquires its one key under one owner of its
//! own for all its sections; the lock server (AOF always: the locks
//! survive) is killed for 300 ms now and then. A holder whose section ends
//! in the outage cannot release: the release is retried in the background,
//! holding the owner's turn, and the same task's next acquire of the key
//! waits for it. Were the turn not kept, that acquire would join the hold
//! still on the server (same owner, same token) just before the retry
//! deletes it, and another owner would be granted the key under a live
//! guard. Promised safe: 0 overlaps, nothing lost, tokens grow. Its broken
//! twin, `broken-retry-ignores-turn` (dlock's own retry dropping the turn,
//! see [`crate::own_bugs`]), runs the same workload in `checker-self-test`
//! and must overlap.

use std::time::Duration;

use dlock_testing::RedisServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::redlock::refuses;
use crate::scenario::{config, describe, finish, resource_server, spawn_workers, workers_started, Size};

/// How long each outage lasts: longer than a section, so the holder's
/// release meets it, and well inside the lease, so the hold outlives it.
const OUTAGE: Duration = Duration::from_millis(300);

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("release-retry", "redis", size, seed).await?])
}

/// One row of the workload: `backend` is `redis` (the scenario's row) or a
/// broken variant (the self-test's).
pub(crate) async fn row(scenario: &str, backend: &str, size: Size, seed: u64) -> Result<Report, String> {
    let mut lock = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let (res_server, resource) = resource_server().await?;
    let outages = size.pick(2u64, 15);
    let cycle = Duration::from_millis(700);
    let mut cfg = config(backend, vec![lock.url()], &res_server, seed);
    cfg.keys = 1;
    cfg.tasks = 2;
    cfg.reuse_owner = true;
    (cfg.cs_min_ms, cfg.cs_max_ms) = (50, 150);
    cfg.duration_ms = 500 + outages * u64::try_from((OUTAGE + cycle).as_millis()).unwrap_or(0) + 500;
    let procs = 3;
    let mut run = Run::new(&format!("{scenario}-{backend}")).map_err(|e| e.to_string())?;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(5)).await?;
    sleep(Duration::from_millis(300)).await;
    let mut done = 0u64;
    for _ in 0..outages {
        run.log("kill", None);
        tokio::task::block_in_place(|| lock.kill());
        // Counted once the port refuses (the server is gone), not because
        // it was told to die.
        let down = tokio::task::block_in_place(|| refuses(lock.port()));
        sleep(OUTAGE).await;
        tokio::task::block_in_place(|| lock.start_again());
        run.log("restart", None);
        done += u64::from(down);
        sleep(cycle).await;
    }
    let mut r = Report::new(scenario, backend, seed);
    r.expected_safe = backend == "redis";
    r.tokens_promised = r.expected_safe;
    r.faults = done;
    if done < outages {
        r.note(format!("only {done} of {outages} kills left the server refusing connections"));
    }
    r.fault_kind = format!("kill -9 the server (AOF always) for {} ms; owners reused", OUTAGE.as_millis());
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    let events = run.events()?;
    let failed_releases = events.iter().filter(|e| e.op == "rel_err").count();
    r.note(format!(
        "releases that met an outage (retried in the background): {failed_releases}; unavailable acquires: {}",
        findings.acq_unavailable
    ));
    if failed_releases == 0 {
        r.fail("no release met an outage: the retry was never exercised");
    }
    Ok(r)
}
