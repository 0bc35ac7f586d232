//! `zk-expire`: a ZooKeeper holder stopped for longer than its session.

use std::time::Duration;

use dlock_testing::ZooKeeperServer;
use rustix::process::Signal;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::mono_ns;
use crate::rng::Rng;
use crate::scenario::{config, describe, find_holder, finish, note_signalled, resource_server, spawn_workers, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let zk = tokio::task::spawn_blocking(ZooKeeperServer::start)
        .await
        .map_err(|e| format!("ZooKeeper did not start: {e}"))?;
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new("zk-expire").map_err(|e| e.to_string())?;
    let episodes = size.pick(2u64, 20);
    let mut cfg = config("zookeeper", vec![zk.connect_string()], &res_server, seed);
    cfg.session_ms = 1000;
    cfg.cs_max_ms = 20;
    cfg.keys = 2;
    cfg.tasks = 2;
    cfg.wait_ms = 3000;
    cfg.duration_ms = episodes * 5500 + 2500;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    let mut rng = Rng::new(seed);
    let mut done = 0;
    let started = mono_ns();
    let total = cfg.duration_ms;
    // (victim, time of SIGCONT) for the liveness check below.
    let mut resumed = Vec::new();
    sleep(Duration::from_millis(1500)).await;
    for _ in 0..episodes {
        let Some(pid) = find_holder(&run, None, Duration::from_secs(2), &mut rng).await? else { continue };
        run.signal(pid, Signal::STOP, "stop");
        sleep(Duration::from_millis(2500)).await;
        run.signal(pid, Signal::CONT, "cont");
        resumed.push((pid, mono_ns()));
        done += 1;
        // Give the resumed client time to see the expiry, finish its stale
        // section and take a lock again on a new session; then replace it,
        // so every episode has live contenders.
        sleep(Duration::from_millis(2000)).await;
        tokio::task::block_in_place(|| run.kill(pid));
        let mut again = cfg.clone();
        again.duration_ms = total.saturating_sub((mono_ns() - started) / 1_000_000).max(1000);
        run.spawn(again).map_err(|e| e.to_string())?;
    }
    let mut r = Report::new("zk-expire", "zookeeper (czxid tokens)", seed);
    r.expected_safe = true;
    r.overlaps_informational = true;
    r.faults = done;
    if done < episodes {
        r.note(format!("{} of {episodes} episode(s) found no holder to hit and were skipped", episodes - done));
    }
    r.fault_kind = "SIGSTOP holder 2500 ms > session 1000 ms".into();
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
    note_signalled(&mut r);
    let events = run.events()?;
    let recovered = resumed
        .iter()
        .filter(|(pid, cont)| events.iter().any(|e| e.pid == *pid && e.op == "acq_ok" && e.t > *cont))
        .count();
    r.note(format!(
        "liveness: {recovered}/{} paused clients took a lock again within 2 s of resuming (on a new session: the \
         expired one cannot)",
        resumed.len()
    ));
    drop(zk);
    Ok(vec![r])
}
