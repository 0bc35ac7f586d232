//! `pause`: a Redis lock holder stopped (`SIGSTOP`) for longer than its lease.

use std::time::Duration;

use dlock_testing::RedisServer;
use rustix::process::Signal;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::rng::Rng;
use crate::scenario::{config, describe, find_holder, finish, note_signalled, resource_server, spawn_workers, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let lock = RedisServer::start();
    let (res_server, resource) = resource_server().await?;
    let mut run = Run::new("pause").map_err(|e| e.to_string())?;
    let episodes = size.pick(4u64, 30);
    let mut cfg = config("redis", vec![lock.url()], &res_server, seed);
    cfg.lease_ms = 300;
    cfg.cs_max_ms = 20;
    cfg.keys = 2;
    cfg.duration_ms = episodes * 1500 + 1500;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    let mut rng = Rng::new(seed);
    let mut done = 0;
    sleep(Duration::from_millis(300)).await;
    for _ in 0..episodes {
        let Some(pid) = find_holder(&run, None, Duration::from_secs(1), &mut rng).await? else { continue };
        run.signal(pid, Signal::STOP, "stop");
        sleep(Duration::from_millis(1000)).await;
        run.signal(pid, Signal::CONT, "cont");
        done += 1;
        sleep(Duration::from_millis(400)).await;
    }
    let mut r = Report::new("pause", "redis", seed);
    r.expected_safe = true;
    r.overlaps_informational = true;
    r.faults = done;
    if done < episodes {
        r.note(format!("{} of {episodes} episode(s) found no holder to hit and were skipped", episodes - done));
    }
    r.fault_kind = "SIGSTOP holder 1000 ms > lease 300 ms".into();
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    if r.stale_writes_refused == 0 && r.unfenced_lost == 0 {
        r.note("the pauses did not bite this run (no stale access, no unfenced loss)");
    }
    note_signalled(&mut r);
    Ok(vec![r])
}
