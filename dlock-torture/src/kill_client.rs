//! `kill-client` (reliability.md T2): holders killed with `kill -9`.

use std::time::Duration;

use dlock_testing::RedisServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::rng::Rng;
use crate::scenario::{
    config, describe, finish, kill_holders, redlock_masters, residue_on, resource_server, spawn_workers, Size,
};

/// T2 on Redis and on RedLock (5 masters, AOF always): holders killed with
/// `kill -9` must leave no lock behind past their lease.
pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let mut rows = Vec::new();
    for redlock in [false, true] {
        rows.push(kill_client_on(redlock, size, seed).await?);
    }
    Ok(rows)
}

async fn kill_client_on(redlock: bool, size: Size, seed: u64) -> Result<Report, String> {
    let lock: Vec<RedisServer> = if redlock { redlock_masters() } else { vec![RedisServer::start()] };
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new("kill-client").map_err(|e| e.to_string())?;
    let kills = size.pick(4u64, 40);
    let backend = if redlock { "redlock" } else { "redis" };
    let mut cfg = config(backend, lock.iter().map(RedisServer::url).collect(), &res_server, seed);
    cfg.lease_ms = 500;
    cfg.keys = 3;
    cfg.cs_max_ms = 10;
    cfg.duration_ms = kills * 700 + 1500;
    let procs = 4;
    spawn_workers(&mut run, &cfg, procs)?;
    let mut rng = Rng::new(seed);
    let done = kill_holders(&mut run, &cfg, kills, Duration::from_millis(500), 500, &mut rng).await?;
    let label = if redlock { "redlock (5 nodes, AOF always)" } else { "redis" };
    let mut r = Report::new("kill-client", label, seed);
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
    let (left, refreshed) = residue_on(&lock, Duration::from_millis(cfg.lease_ms / 3)).await?;
    r.residual_keys = Some(left);
    r.refreshed_keys = Some(refreshed);
    if left > 0 {
        r.fail("lock keys of killed holders outlived their lease");
    }
    Ok(r)
}

/// T2's bound: every killed holder's key granted again within `bound` ms.
/// No measurement at all (no kill hit a holder whose key was granted
/// again) fails too: the bound was then never checked.
pub(crate) fn judge_recovery(r: &mut Report, bound: f64) {
    match r.recovery_max_ms {
        Some(rec) => {
            r.note(format!(
                "orphan recovery (kill -> next grant of the victim's key) max {rec:.0} ms, bound {bound:.0} ms"
            ));
            if rec > bound {
                r.fail(format!("orphan recovery {rec:.0} ms > lease + 1 s"));
            }
        }
        None => r.fail("no orphan recovery was measured (no killed holder's key was granted again)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recovery_bound_fails_when_missed_or_unmeasured() {
        let mut r = Report::new("kill-client", "redis", 0);
        r.recovery_max_ms = Some(900.0);
        judge_recovery(&mut r, 1500.0);
        assert!(r.pass, "{}", r.notes);
        r.recovery_max_ms = Some(1600.0);
        judge_recovery(&mut r, 1500.0);
        assert!(!r.pass);
        let mut none = Report::new("kill-client", "redis", 0);
        judge_recovery(&mut none, 1500.0);
        assert!(!none.pass && none.notes.contains("no orphan recovery"), "{}", none.notes);
    }
}
