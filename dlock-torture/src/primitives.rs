//! `primitives`: semaphores and read-write locks under `kill -9`.
//!
//! Every task of every worker takes one of two keys as one of 2 permits
//! (`permits:2`), or as a reader or a writer (`rw`: a quarter writers), and
//! holders are killed now and then; a fresh worker replaces each victim,
//! on ZooKeeper, Redis and PostgreSQL. C1 judges every moment by the mode
//! of the holds believed then: never more than 2 permit holders of a key,
//! never a writer beside anyone (`checker::admits`). The semaphore row must also have reached its limit
//! (two permit holders at once somewhere), or it tested nothing; killed
//! holders' permits must come back (orphan recovery). A `rw` row also
//! judges writer preference and withdrawn intents ([`crate::preference`]):
//! half its writers are given up 50 to 250 ms into their wait, and it must
//! have seen a writer wait behind readers and one give up there. Their
//! broken twins (dlock's own ZooKeeper turn rule or Redis acquire script
//! and PostgreSQL acquire functions broken by a switch, see
//! [`crate::own_bugs`]: permits over the limit, readers passing a waiting
//! writer, on Redis and PostgreSQL also an intent never withdrawn) run the same workload in `checker-self-test` and must be
//! caught.

use std::time::Duration;

use dlock_testing::{PostgresServer, RedisServer, ZooKeeperServer};
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::rng::Rng;
use crate::scenario::{config, describe, finish, kill_holders, resource_server, spawn_workers, Size};

/// The semaphore's limit in every row.
const LIMIT: u64 = 2;

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let mut rows = Vec::new();
    for backend in ["zookeeper", "redis", "postgres"] {
        for mode in ["permits:2", "rw"] {
            rows.push(row("primitives", backend, mode, size, seed).await?);
        }
    }
    Ok(rows)
}

/// The lock servers of a row: ZooKeeper's connect string, one Redis or
/// one PostgreSQL.
enum Servers {
    ZooKeeper(ZooKeeperServer),
    Redis(RedisServer),
    Postgres(PostgresServer),
}

impl Servers {
    async fn start(backend: &str) -> Result<Servers, String> {
        match backend {
            "redis" => return Ok(Servers::Redis(RedisServer::start())),
            "postgres" => {
                let pg = tokio::task::spawn_blocking(PostgresServer::start)
                    .await
                    .map_err(|e| format!("PostgreSQL did not start: {e}"))?;
                return Ok(Servers::Postgres(pg));
            }
            _ => {}
        }
        let zk = tokio::task::spawn_blocking(ZooKeeperServer::start)
            .await
            .map_err(|e| format!("ZooKeeper did not start: {e}"))?;
        Ok(Servers::ZooKeeper(zk))
    }

    fn url(&self) -> String {
        match self {
            Servers::ZooKeeper(zk) => zk.connect_string(),
            Servers::Redis(redis) => redis.url(),
            Servers::Postgres(pg) => pg.url(),
        }
    }
}

/// One row: `backend` is `zookeeper`, `redis`, `postgres` or a broken variant (the
/// self-test's), under `mode` (`permits:2` or `rw`). A broken variant runs
/// on the backend its switch breaks.
pub(crate) async fn row(scenario: &str, backend: &str, mode: &str, size: Size, seed: u64) -> Result<Report, String> {
    let on = crate::own_bugs::find(backend).map_or(backend, |bug| bug.backend);
    let servers = Servers::start(on).await?;
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new(&format!("{scenario}-{backend}-{}", mode.replace(':', ""))).map_err(|e| e.to_string())?;
    let kills = size.pick(3u64, 30);
    let mut cfg = config(backend, vec![servers.url()], &res_server, seed);
    cfg.mode = mode.to_owned();
    cfg.keys = 2;
    cfg.tasks = 3;
    cfg.lease_ms = 500;
    cfg.session_ms = 1000;
    cfg.wait_ms = 3000;
    // Readers hold long enough for a writer to wait behind them, and to be
    // given up there (`cancel_writers`), for the preference checks.
    (cfg.cs_min_ms, cfg.cs_max_ms) = if mode == "rw" { (20, 300) } else { (5, 30) };
    cfg.duration_ms = kills * 1200 + 2000;
    cfg.cancel_writers = mode == "rw";
    if backend.ends_with("intent-never-withdrawn") {
        // A stale intent shows only when a writer gives up with readers
        // waiting and no other writer about: give it three times the time.
        cfg.duration_ms *= 3;
    } else if mode == "rw" && on == "zookeeper" {
        // ZooKeeper's acquires are the slowest (a node made, the line read,
        // a watch set): a short run on a loaded machine saw 6 writers wait
        // behind readers and none given up there, a row that judged no
        // withdrawn intent. Twice the time.
        cfg.duration_ms *= 2;
    }
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    let mut rng = Rng::new(seed);
    sleep(Duration::from_millis(if on == "zookeeper" { 1500 } else { 500 })).await;
    let done = kill_holders(&mut run, &cfg, kills, Duration::from_millis(800), 1000, &mut rng).await?;
    let broken = on != backend;
    let mut r = Report::new(scenario, &if broken { backend.to_owned() } else { format!("{backend} ({mode})") }, seed);
    r.expected_safe = !broken;
    r.faults = done;
    if done < kills {
        r.note(format!("{} of {kills} episode(s) found no holder to hit and were skipped", kills - done));
    }
    r.fault_kind =
        if on == "zookeeper" { "kill -9 a holder, session 1000 ms" } else { "kill -9 a holder, lease 500 ms" }.into();
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    if !broken {
        judge_reach(&mut r, mode, findings.most_holders);
    }
    if mode == "rw" {
        // A killed process's ZooKeeper nodes go with its session, in the
        // server's tick (100 ms) after the timeout.
        let after = crate::preference::Afterlife {
            wait_ns: cfg.wait_ms * 1_000_000,
            lease_ns: cfg.lease_ms * 1_000_000,
            session_ns: (on == "zookeeper").then_some((cfg.session_ms + 2 * 100) * 1_000_000),
        };
        let found = crate::preference::check(&run.events()?, after);
        crate::preference::judge(&mut r, &found);
    }
    Ok(r)
}

/// A row must have shown what its mode lets through: the semaphore's
/// limit reached, readers sharing a key. Otherwise its C1 checked nothing
/// the exclusive rows do not.
fn judge_reach(r: &mut Report, mode: &str, most: u64) {
    r.note(format!("most holders of one key at once: {most}"));
    let needed = if mode == "rw" { 2 } else { LIMIT };
    if most < needed {
        r.fail(format!("never {needed} holders at once: the mode's sharing was not exercised"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_that_never_shared_a_key_fails() {
        let mut r = Report::new("primitives", "zookeeper", 0);
        judge_reach(&mut r, "permits:2", 1);
        assert!(!r.pass);
        let mut r = Report::new("primitives", "zookeeper", 0);
        judge_reach(&mut r, "permits:2", 2);
        assert!(r.pass, "{}", r.notes);
    }
}
