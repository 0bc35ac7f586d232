//! `baseline` (reliability.md T1): every backend under one workload, no faults.

use std::time::Duration;

use dlock_testing::{PostgresServer, RedisServer, ZooKeeperServer};

use crate::harness::{Report, Run};
use crate::scenario::{config, describe, finish, redlock_masters, residue_on, resource_server, spawn_workers, Size};

/// T1: the zero every fault is compared against. One row per backend, no
/// faults: 0 overlaps, 0 lost updates (counter and set), no lock left on
/// the servers, and the throughput and acquire latency of the same
/// workload on each.
pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let mut rows = Vec::new();
    for backend in ["redis", "redlock", "zookeeper", "postgres", "memory"] {
        let mut r = Report::new("baseline", backend, seed);
        if let Err(e) = baseline_row(size, seed, &mut r).await {
            r.fail(format!("the row could not run: {e}"));
        }
        rows.push(r);
    }
    Ok(rows)
}

/// Runs one backend's baseline into `r` (whose `backend` names it).
async fn baseline_row(size: Size, seed: u64, r: &mut Report) -> Result<(), String> {
    let (res_server, resource) = resource_server().await?;
    let backend = r.backend.clone();
    // The servers live until the row is checked.
    let pg = match backend.as_str() {
        "postgres" => Some(
            tokio::task::spawn_blocking(PostgresServer::start)
                .await
                .map_err(|e| format!("PostgreSQL did not start: {e}"))?,
        ),
        _ => None,
    };
    let (lock, nodes, zk) = match backend.as_str() {
        "redis" => (Some(RedisServer::start()), Vec::new(), None),
        // As `redlock()` runs them: 5 masters with AOF always.
        "redlock" => (None, redlock_masters(), None),
        "zookeeper" => {
            let zk = tokio::task::spawn_blocking(ZooKeeperServer::start)
                .await
                .map_err(|e| format!("ZooKeeper did not start: {e}"))?;
            (None, Vec::new(), Some(zk))
        }
        _ => (None, Vec::new(), None),
    };
    let urls = match (&lock, &zk, &pg) {
        (Some(l), _, _) => vec![l.url()],
        (_, Some(z), _) => vec![z.connect_string()],
        (_, _, Some(p)) => vec![p.url()],
        _ => nodes.iter().map(RedisServer::url).collect(),
    };
    let mut cfg = config(&backend, urls, &res_server, seed);
    cfg.keys = 4;
    cfg.duration_ms = size.pick(2000, 20_000);
    // Three processes of four tasks; the in-process table cannot span
    // processes, so `memory` runs the twelve tasks in one.
    let procs = if backend == "memory" { 1 } else { 3 };
    cfg.tasks = 12 / procs;
    let mut run = Run::new(&format!("baseline-{backend}")).map_err(|e| e.to_string())?;
    spawn_workers(&mut run, &cfg, procs)?;
    r.expected_safe = true;
    r.fault_kind = "none".into();
    describe(r, procs, &cfg);
    let findings = finish(&mut run, r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    let secs = findings.span_ns as f64 / 1e9;
    let rate = if secs > 0.0 { r.operations as f64 / secs } else { 0.0 };
    r.note(format!(
        "{rate:.0} acquisitions/s ({} in {secs:.1} s); acquire latency (call to grant, contention included) p50 {:.2} ms, p99 {:.2} ms; \
         C3 checked {} acknowledged set ids",
        r.operations, r.p50_wait_ms, r.p99_wait_ms, r.set_acked
    ));
    if r.operations == 0 {
        r.fail("no acquisition at all");
    }
    let renew_every = Duration::from_millis(cfg.lease_ms / 3);
    match backend.as_str() {
        "redis" | "redlock" => {
            let (left, refreshed) = residue_on(lock.iter().chain(&nodes), renew_every).await?;
            r.residual_keys = Some(left);
            r.refreshed_keys = Some(refreshed);
            if left > 0 || refreshed > 0 {
                r.fail(format!("{left} lock key(s) left ({refreshed} still renewed) after every worker released"));
            }
        }
        "postgres" => {
            let pg = pg.as_ref().ok_or("no PostgreSQL server")?;
            let left = crate::postgres::live_rows(pg)?;
            r.residual_keys = Some(left);
            r.note(format!("live lock rows left {left}"));
            if left > 0 {
                r.fail(format!("{left} live lock row(s) left after every worker released"));
            }
        }
        "zookeeper" => {
            let zk = zk.as_ref().ok_or("no ZooKeeper server")?;
            let (containers, nodes_left) = zk_residue(&zk.connect_string(), &format!("/{}", cfg.prefix)).await?;
            r.residual_keys = Some(nodes_left);
            r.note(format!(
                "lock nodes left {nodes_left} (lock containers {containers}: ZooKeeper reaps empty ones itself)"
            ));
            if nodes_left > 0 {
                r.fail(format!("{nodes_left} lock node(s) left after every worker released"));
            }
        }
        _ => {
            r.note("one worker process: the in-process backend cannot span processes");
            match findings.residue {
                Some(left) => {
                    r.residual_keys = Some(left);
                    if left > 0 {
                        r.fail(format!("{left} key(s) left in the in-process table after every task released"));
                    }
                }
                None => r.fail("the worker reported no residue (it did not finish)"),
            }
        }
    }
    Ok(())
}

/// C6 on ZooKeeper: (lock containers under `root`, lock nodes in them).
async fn zk_residue(connect: &str, root: &str) -> Result<(u64, u64), String> {
    use zookeeper_client as zk;
    let client = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(connect)
        .await
        .map_err(|e| format!("cannot connect to ZooKeeper at {connect}: {e}"))?;
    let containers = match client.list_children(root).await {
        Ok(c) => c,
        Err(zk::Error::NoNode) => return Ok((0, 0)),
        Err(e) => return Err(format!("list {root}: {e}")),
    };
    let mut nodes = 0;
    for c in &containers {
        match client.list_children(&format!("{root}/{c}")).await {
            Ok(children) => nodes += children.len() as u64,
            // Reaped between the two calls: empty.
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(format!("list {root}/{c}: {e}")),
        }
    }
    Ok((containers.len() as u64, nodes))
}
