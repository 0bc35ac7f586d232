//! `coalesced-burst`: the Redis backend's coalesced path under many
//! acquires of the same keys at once. Past 16 acquires in flight a process
//! queues them, and one script call (`acquire_many.lua`) carries up to 128,
//! often several of one key: the first of them may be granted, every other
//! one must be answered "held".
//!
//! Two worker processes of 32 tasks each try two keys once (no wait) and
//! at once again on "held", so every batch holds repeats of both keys. No
//! fault: promised safe, 0 overlaps, nothing lost, tokens grow, no lock
//! left; and the script calls are fewer than the lock operations (the
//! batches really ran). Its broken twin, `broken-batch-repeats-token`
//! (dlock's own coalescer answering a repeated key with the earlier grant,
//! see [`crate::own_bugs`]), runs the same workload in `checker-self-test`
//! and must overlap.

use std::time::Duration;

use dlock_testing::RedisServer;

use crate::harness::{Report, Run};
use crate::scenario::{config, describe, finish, residue, resource_server, spawn_workers, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("coalesced-burst", "redis", size, seed).await?])
}

/// One row of the workload: `backend` is `redis` (the scenario's row) or a
/// broken variant (the self-test's).
pub(crate) async fn row(scenario: &str, backend: &str, size: Size, seed: u64) -> Result<Report, String> {
    let lock = RedisServer::start();
    let (res_server, resource) = resource_server().await?;
    let mut cfg = config(backend, vec![lock.url()], &res_server, seed);
    cfg.keys = 2;
    cfg.tasks = 32;
    cfg.wait_ms = 0;
    (cfg.cs_min_ms, cfg.cs_max_ms) = (1, 3);
    cfg.duration_ms = size.pick(1200, 3000);
    let procs = 2;
    let mut run = Run::new(&format!("{scenario}-{backend}")).map_err(|e| e.to_string())?;
    tokio::task::block_in_place(|| lock.reset_stats());
    spawn_workers(&mut run, &cfg, procs)?;
    let mut r = Report::new(scenario, backend, seed);
    r.expected_safe = backend == "redis";
    r.tokens_promised = r.expected_safe;
    r.fault_kind = "none (32 acquires a process in flight: coalesced batches)".into();
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    let events = run.events()?;
    let ops = events.iter().filter(|e| e.op == "acq_invoke" || e.op == "rel_invoke").count() as u64;
    let calls = tokio::task::block_in_place(|| lock.command_calls("evalsha") + lock.command_calls("eval"));
    r.note(format!(
        "lock script calls {calls} for {ops} acquires and releases ({:.2} a call): the queued path carried the rest",
        ops as f64 / calls.max(1) as f64
    ));
    if calls >= ops {
        r.fail(format!("{calls} script calls for {ops} lock operations: nothing was coalesced"));
    }
    let (left, refreshed) = residue(&lock.url(), Duration::from_millis(cfg.lease_ms / 3)).await?;
    r.residual_keys = Some(left);
    r.refreshed_keys = Some(refreshed);
    if r.expected_safe && left > 0 {
        r.fail(format!("{left} lock key(s) left after every worker released"));
    }
    Ok(r)
}
