//! The RedLock fault scenarios: `redlock-minority` and `redlock-majority`
//! (masters killed for a while) and `redlock-restart` (masters that rejoin
//! empty).

use std::time::Duration;

use dlock_testing::RedisServer;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::mono_ns;
use crate::rng::Rng;
use crate::scenario::{
    config, describe, finish, redlock_masters, resource_server, spawn_workers, workers_started, Size,
};

/// T5b: the most a RedLock acquire may take to answer "unavailable" while a
/// majority is down: one attempt bounded by the node timeout (50 ms here)
/// and its undo, well under the workers' 500 ms wait; a second is room for
/// a loaded 2-core machine, and still tells a typed error from a hang.
const UNAVAILABLE_BOUND_MS: f64 = 1_000.0;

pub(crate) async fn outage(size: Size, seed: u64, majority: bool) -> Result<Vec<Report>, String> {
    let mut nodes = redlock_masters();
    let (res_server, resource) = resource_server().await?;
    let name = if majority { "redlock-majority" } else { "redlock-minority" };
    let mut run = Run::new(name).map_err(|e| e.to_string())?;
    let rounds = size.pick(2u64, 10);
    let outage = Duration::from_millis(if majority { 2000 } else { 1000 });
    let mut cfg = config("redlock", nodes.iter().map(RedisServer::url).collect(), &res_server, seed);
    cfg.keys = 3;
    cfg.wait_ms = 500;
    cfg.duration_ms = rounds * (u64::try_from(outage.as_millis()).unwrap_or(0) + 1500) + 1000;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(5)).await?;
    let mut rng = Rng::new(seed);
    let mut windows = Vec::new();
    let victims = if majority { 3 } else { 2 };
    let mut killed = 0u64;
    for _ in 0..rounds {
        sleep(Duration::from_millis(1000)).await;
        let mut ids: Vec<usize> = (0..5).collect();
        for i in (1..ids.len()).rev() {
            let j = usize::try_from(rng.below(i as u64 + 1)).unwrap_or(0);
            ids.swap(i, j);
        }
        let down = &ids[..victims];
        run.log("kill", None);
        tokio::task::block_in_place(|| down.iter().for_each(|&i| nodes[i].kill()));
        // Counted once the node is seen down (its port refuses), not
        // because it was told to die.
        killed += tokio::task::block_in_place(|| down.iter().filter(|&&i| refuses(nodes[i].port())).count() as u64);
        // The quorum is gone once the last victim is reaped (each kill waits
        // for its process; three can take over 100 ms on a loaded machine),
        // not when the first signal was sent.
        let from = mono_ns();
        sleep(outage).await;
        let to = mono_ns();
        tokio::task::block_in_place(|| down.iter().for_each(|&i| nodes[i].restart()));
        run.log("restart", None);
        windows.push((from, to));
        sleep(Duration::from_millis(500)).await;
    }
    let mut r = Report::new(name, "redlock (5 nodes, AOF always)", seed);
    r.expected_safe = true;
    r.faults = killed;
    if killed < rounds * victims as u64 {
        r.note(format!("only {killed} of {} kills left the node refusing connections", rounds * victims as u64));
    }
    r.fault_kind = format!("kill -9 {victims} of 5 for {} ms", outage.as_millis());
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
    let slowest = crate::checker::percentile_ms(&findings.unavailable_ns, 1.0);
    if majority && slowest > UNAVAILABLE_BOUND_MS {
        r.fail(format!(
            "an acquire took {slowest:.0} ms to report the quorum unavailable (bound {UNAVAILABLE_BOUND_MS} ms)"
        ));
    }
    let events = run.events()?;
    // A grant needs 3 live nodes; allow 100 ms for replies already in flight.
    let during: usize = windows
        .iter()
        .map(|(from, to)| events.iter().filter(|e| e.op == "acq_ok" && e.t > from + 100_000_000 && e.t < *to).count())
        .sum();
    let recovery: Vec<u64> = windows
        .iter()
        .filter_map(|(_, to)| events.iter().find(|e| e.op == "acq_ok" && e.t > *to).map(|e| e.t - to))
        .collect();
    if majority {
        r.note(format!(
            "grants during majority outages: {during}; unavailable answers: {}; recovery after restart max {:.0} ms",
            r.acq_failures,
            crate::checker::percentile_ms(&recovery, 1.0)
        ));
        if during > 0 {
            r.fail("locks granted without a quorum");
        }
    } else {
        r.note(format!("grants during minority outages: {during} (must be > 0: the quorum survives)"));
        if during == 0 {
            r.fail("no grant during a minority outage: a quorum of 3 live masters must keep granting");
        }
    }
    Ok(vec![r])
}

/// T5c's random arm: RedLock masters *without* persistence; under load, 2
/// of 5 random masters are killed and rejoin at once, empty. A rejoined
/// master can hand a second quorum the key a holder still has on its
/// others: not promised, and the arm is the negative control that shows it
/// (with [`restart_probe`]: it fails when nothing overlapped). The same with
/// every client quarantining restarted masters
/// (`DLOCK_RESTART_QUARANTINE_MS` = 1.3 s > the 1 s lease): promised safe.
/// Neither promises growing tokens: a master that lost its mark answers
/// from its clock alone.
pub(crate) async fn restart(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let mut rows = Vec::new();
    for quarantine in [Duration::ZERO, Duration::from_millis(1300)] {
        let mut nodes: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
        let (res_server, resource) = resource_server().await?;
        let mut run = Run::new("redlock-restart").map_err(|e| e.to_string())?;
        let rounds = size.pick(3u64, 15);
        let mut restarted = 0u64;
        let mut cfg = config("redlock", nodes.iter().map(RedisServer::url).collect(), &res_server, seed);
        // One key held for up to 300 ms at a time: a restart then often
        // empties masters of a live hold while others wait for the key.
        cfg.keys = 1;
        cfg.cs_max_ms = 300;
        cfg.wait_ms = 500;
        cfg.quarantine_ms = u64::try_from(quarantine.as_millis()).unwrap_or(0);
        let pace = Duration::from_millis(700) + quarantine;
        // The first use of each master sits out a quarantine too.
        cfg.duration_ms =
            u64::try_from((pace * u32::try_from(rounds).unwrap_or(1) + quarantine).as_millis()).unwrap_or(0) + 1500;
        let procs = 3;
        spawn_workers(&mut run, &cfg, procs)?;
        workers_started(&run, procs as usize, Duration::from_secs(5)).await?;
        let mut rng = Rng::new(seed);
        sleep(Duration::from_millis(700) + quarantine).await;
        for _ in 0..rounds {
            let mut ids: Vec<usize> = (0..5).collect();
            for i in (1..ids.len()).rev() {
                let j = usize::try_from(rng.below(i as u64 + 1)).unwrap_or(0);
                ids.swap(i, j);
            }
            run.log("restart", None);
            // Counted when the node answers with a new run id (a new,
            // empty process), not because it was told to restart.
            restarted += tokio::task::block_in_place(|| {
                ids[..2]
                    .iter()
                    .filter(|&&i| {
                        let before = run_id(&nodes[i]);
                        nodes[i].restart();
                        let after = run_id(&nodes[i]);
                        before.is_some() && after.is_some() && before != after
                    })
                    .count() as u64
            });
            sleep(pace).await;
        }
        let label = if quarantine.is_zero() {
            "redlock (5 nodes, no persistence), 2 rejoin empty"
        } else {
            "redlock (5 nodes, no persistence), 2 rejoin empty, client quarantine"
        };
        let mut r = Report::new("redlock-restart", label, seed);
        r.expected_safe = !quarantine.is_zero();
        r.tokens_promised = false;
        r.faults = restarted;
        if restarted < rounds * 2 {
            r.note(format!("only {restarted} of {} restarts were seen (a new run id)", rounds * 2));
        }
        r.fault_kind = "kill -9 + immediate restart of 2 of 5".into();
        describe(&mut r, procs, &cfg);
        finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
        let probe = restart_probe(&mut nodes, quarantine).await?;
        r.faults += 1;
        r.overlaps += u64::from(probe);
        r.note(format!(
            "probe (A holds on a bare quorum, one of its masters rejoins empty, B asks at once): B granted while A \
             still believed it held: {}",
            if probe { "yes" } else { "no" }
        ));
        if !r.safety_ok() && r.pass && r.expected_safe {
            r.fail("overlap although restarted masters were quarantined");
        }
        if quarantine.is_zero() && r.overlaps == 0 {
            r.fail("negative control: no second quorum formed, probe included (the documented unsafety was NOT reproduced)");
        }
        rows.push(r);
    }
    Ok(rows)
}

/// The deterministic RedLock restart probe: A acquires while another
/// owner holds the key on masters 3 and 4, so it holds on exactly 0, 1 and
/// 2 (a fixed 1 s lease); that owner lets go, and master 0 restarts empty
/// (no persistence); B asks at once. Without a quarantine 0, 3 and 4 make
/// B a quorum while A still believes it holds: returns whether that
/// happened. With one, the restarted master refuses B until A's lease is
/// over.
async fn restart_probe(nodes: &mut [RedisServer], quarantine: Duration) -> Result<bool, String> {
    use dlock_core::backend::redlock::{RedLockBackend, RedLockOptions};
    use dlock_core::{AcquireOptions, Locker, LockerOptions};
    use std::sync::Arc;
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let connect = |urls: Vec<String>| async move {
        let options = RedLockOptions::default()
            .with_node_timeout(Duration::from_millis(50))
            .with_redis(dlock_core::backend::redis::RedisOptions::default().with_restart_quarantine(quarantine));
        let b = RedLockBackend::connect_with(&urls, "torture", options).await.map_err(|e| e.to_string())?;
        Locker::with_options(Arc::new(b), LockerOptions::default().with_prefix("torture")).map_err(|e| e.to_string())
    };
    let (a, b) = (connect(urls.clone()).await?, connect(urls).await?);
    let key = a.key("probe").part("redlock").build().map_err(|e| e.to_string())?;
    let other = |c: &mut redis::Connection, del: bool| -> redis::RedisResult<()> {
        if del {
            redis::cmd("DEL").arg(key.as_str()).query(c)
        } else {
            redis::cmd("SET").arg(key.as_str()).arg("1:0:someone-else").arg("PX").arg(10_000).query(c)
        }
    };
    for node in &nodes[3..] {
        other(&mut node.connection(), false).map_err(|e| format!("hold masters 3-4: {e}"))?;
    }
    let lease = AcquireOptions::new().with_lease(Duration::from_millis(1000));
    // A quarantine still running from the workload's last restarts first.
    let deadline = tokio::time::Instant::now() + quarantine + Duration::from_secs(3);
    let ga = loop {
        match a.acquire(&key, lease.clone().with_wait(Duration::from_millis(200))).await {
            Ok(g) => break g,
            Err(_) if tokio::time::Instant::now() < deadline => sleep(Duration::from_millis(20)).await,
            Err(e) => return Err(format!("A cannot acquire on masters 0-2: {e}")),
        }
    };
    tokio::task::block_in_place(|| {
        for node in &nodes[3..] {
            other(&mut node.connection(), true).map_err(|e| format!("free masters 3-4: {e}"))?;
        }
        nodes[0].restart();
        Ok::<_, String>(())
    })?;
    let deadline = tokio::time::Instant::now() + quarantine + Duration::from_secs(3);
    let overlapped = loop {
        match b.acquire(&key, lease.clone().with_wait(Duration::from_millis(100))).await {
            Ok(gb) => {
                let overlapped = !ga.is_lost();
                let _ = gb.release().await;
                break overlapped;
            }
            Err(_) if tokio::time::Instant::now() < deadline => sleep(Duration::from_millis(20)).await,
            Err(_) => break false,
        }
    };
    drop(ga);
    Ok(overlapped)
}

/// Whether nothing accepts connections on the loopback `port` (a killed
/// node's).
pub(crate) fn refuses(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .is_err()
}

/// The Redis process's `run_id` (new on every start), or `None` when it
/// does not answer.
fn run_id(node: &RedisServer) -> Option<String> {
    let client = redis::Client::open(node.url()).ok()?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(2)).ok()?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn).ok()?;
    info.lines().find_map(|l| l.strip_prefix("run_id:")).map(|id| id.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A running node accepts, a killed one refuses; a restart gives a new
    /// run id. What the two fault counts rest on.
    #[test]
    fn kills_and_restarts_are_seen_on_the_node() {
        let mut node = RedisServer::start();
        assert!(!refuses(node.port()));
        let first = run_id(&node).expect("run id");
        node.restart();
        let second = run_id(&node).expect("run id after the restart");
        assert_ne!(first, second);
        node.kill();
        assert!(refuses(node.port()));
        assert_eq!(run_id(&node), None);
    }
}
