//! `flush-redis`: the restart quarantine against `FLUSHALL` under load.
//! A flush forgets every lock while its holders still believe they hold
//! it; only the quarantine of the missing data marker (kept on the server,
//! one for every client) keeps the keys from being granted again before
//! those holders' leases have run out. No restart, so no `run_id` check
//! helps: the data marker alone must do it.
//!
//! Worker processes with the quarantine on contend for two keys with
//! sections of 100–300 ms (a holder is mid-section at each flush) and
//! acquires that give up after 50 ms (a fresh try reaches the server soon
//! after every flush). The harness flushes the lock server while a worker
//! holds a key. Promised safe: 0 overlaps, nothing lost, tokens grow (from
//! the server clock once the flush took the mark). Its broken twin,
//! `broken-quarantine-opens-early` (dlock's own quarantine told 0 µs, see
//! [`crate::own_bugs`]), runs the same workload in `checker-self-test` and
//! must overlap.

use std::time::Duration;

use dlock_testing::RedisServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::rng::Rng;
use crate::scenario::{config, describe, find_holder, finish, resource_server, spawn_workers, workers_started, Size};

/// The watchdog lease, and the quarantine: longer than the lease.
const LEASE_MS: u64 = 500;
const QUARANTINE_MS: u64 = 700;

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("flush-redis", "redis", size, seed).await?])
}

/// One row of the flush workload: `backend` is `redis` (the scenario's
/// row) or a broken variant (the self-test's).
pub(crate) async fn row(scenario: &str, backend: &str, size: Size, seed: u64) -> Result<Report, String> {
    let lock = RedisServer::start();
    let (res_server, resource) = resource_server().await?;
    let flushes = size.pick(3u64, 12);
    let quarantine = Duration::from_millis(QUARANTINE_MS);
    let mut cfg = config(backend, vec![lock.url()], &res_server, seed);
    cfg.keys = 2;
    cfg.lease_ms = LEASE_MS;
    cfg.quarantine_ms = QUARANTINE_MS;
    (cfg.cs_min_ms, cfg.cs_max_ms) = (100, 300);
    cfg.wait_ms = 50;
    // A brand-new server sits out one quarantine before its first grant;
    // then each flush: a quarantine, and the keys busy again.
    let cycle = quarantine + Duration::from_millis(400);
    cfg.duration_ms = QUARANTINE_MS + 500 + flushes * u64::try_from(cycle.as_millis()).unwrap_or(0) + 500;
    let procs = 3;
    let mut run = Run::new(&format!("{scenario}-{backend}")).map_err(|e| e.to_string())?;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(5)).await?;
    let mut rng = Rng::new(seed);
    let client = redis::Client::open(lock.url()).map_err(|e| e.to_string())?;
    let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    sleep(quarantine + Duration::from_millis(300)).await;
    let mut done = 0u64;
    for _ in 0..flushes {
        // A flush with a live hold: its holder still believes, mid-section.
        if find_holder(&run, None, Duration::from_millis(500), &mut rng).await?.is_some() {
            // Counted when the server answered it (`OK` once every key is gone).
            let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.map_err(|e| format!("FLUSHALL: {e}"))?;
            run.log("flush", None);
            done += 1;
        }
        sleep(cycle).await;
    }
    let mut r = Report::new(scenario, backend, seed);
    r.expected_safe = backend == "redis";
    r.tokens_promised = r.expected_safe;
    r.faults = done;
    if done < flushes {
        r.note(format!("{} of {flushes} flush(es) found no holder and were skipped", flushes - done));
    }
    r.fault_kind = format!("FLUSHALL under a live hold; clients quarantine {QUARANTINE_MS} ms (lease {LEASE_MS} ms)");
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    Ok(r)
}
