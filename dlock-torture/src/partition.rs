//! `partition`: one worker's lock-server traffic held by a
//! [`FaultProxy`] for 2 × lease while it holds a lock.

use std::time::Duration;

use dlock_testing::{FaultProxy, RedisServer};
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::rng::Rng;
use crate::scenario::{config, describe, find_holder, finish, note_signalled, resource_server, spawn_workers, Size};

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let lock = RedisServer::start();
    let (res_server, resource) = resource_server().await?;
    let proxy = FaultProxy::try_start(lock.port()).map_err(|e| e.to_string())?;
    let mut run = Run::new("partition").map_err(|e| e.to_string())?;
    let episodes = size.pick(3u64, 20);
    let mut cfg = config("redis", vec![lock.url()], &res_server, seed);
    cfg.lease_ms = 400;
    cfg.cs_max_ms = 20;
    cfg.keys = 2;
    cfg.duration_ms = episodes * 1800 + 1500;
    let mut cut_cfg = cfg.clone();
    // The victim holds long enough for the cut to land inside its section.
    cut_cfg.cs_max_ms = cfg.lease_ms * 2;
    cut_cfg.urls = vec![format!("redis://127.0.0.1:{}", proxy.port())];
    let victim = run.spawn(cut_cfg).map_err(|e| e.to_string())?;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs - 1)?;
    let mut rng = Rng::new(seed);
    let mut done = 0;
    sleep(Duration::from_millis(300)).await;
    for _ in 0..episodes {
        if find_holder(&run, Some(&[victim]), Duration::from_secs(1), &mut rng).await?.is_none() {
            continue;
        }
        run.log("partition", Some(victim));
        proxy.hold();
        sleep(Duration::from_millis(cfg.lease_ms * 2)).await;
        proxy.heal();
        run.log("heal", Some(victim));
        done += 1;
        sleep(Duration::from_millis(500)).await;
    }
    let mut r = Report::new("partition", "redis", seed);
    r.expected_safe = true;
    r.faults = done;
    if done < episodes {
        r.note(format!("{} of {episodes} episode(s) found no holder to hit and were skipped", episodes - done));
    }
    r.fault_kind = "TCP proxy holds a holder's lock traffic 2 × lease".into();
    describe(&mut r, procs, &cfg);
    finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    r.note("fault injected with the in-harness TCP proxy, not network namespaces");
    note_signalled(&mut r);
    Ok(vec![r])
}
