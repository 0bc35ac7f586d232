//! `zk-expire`: a ZooKeeper holder stopped for longer than its session.

use std::time::Duration;

use dlock_testing::ZooKeeperServer;
use rustix::process::Signal;
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::{mono_ns, Event};
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
    // Stops that found the holder already past its release once stopped
    // (it moved on between the history read and the signal): let go at
    // once, not counted as an episode, and tried again.
    let mut missed = 0;
    for _ in 0..episodes {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(3);
        let mut victim = None;
        while victim.is_none() && tokio::time::Instant::now() < give_up {
            let Some(pid) = find_holder(&run, None, Duration::from_secs(1), &mut rng).await? else { continue };
            run.signal(pid, Signal::STOP, "stop");
            // The stopped process's history is frozen once the signal lands.
            sleep(Duration::from_millis(5)).await;
            if tokio::task::block_in_place(|| run.holders(Some(&[pid]), false))?.contains(&pid) {
                victim = Some(pid);
            } else {
                run.signal(pid, Signal::CONT, "cont");
                missed += 1;
            }
        }
        let Some(pid) = victim else { continue };
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
    if missed > 0 {
        r.note(format!(
            "{missed} stop(s) found the holder past its release once stopped; let go at once and not counted"
        ));
    }
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
    enforce_t8a(&mut r, &events, Duration::from_millis(cfg.session_ms));
    drop(zk);
    Ok(vec![r])
}

/// The test server's `tickTime` (`dlock-testing`): ZooKeeper expires
/// sessions on tick boundaries.
const TICK: Duration = Duration::from_millis(100);

/// T8a's bound (reliability.md): the next waiter is granted a key the
/// stopped holder held within session timeout + 2 ticks + 200 ms. Counted
/// from the `SIGSTOP`, the moment the holder went silent: its session
/// cannot outlive its last heartbeat, sent before that, by more than the
/// timeout, so the bound holds from the expiry as well.
fn t8a_bound(session: Duration) -> Duration {
    session + TICK * 2 + Duration::from_millis(200)
}

/// For every `stop` of the nemesis: each key the victim held at that
/// moment, and how long until another process was granted it (`None`:
/// never, before the history ends).
fn handovers(events: &[Event]) -> Vec<(u32, Option<Duration>)> {
    let mut held: std::collections::HashMap<(u32, u32), u32> = std::collections::HashMap::new();
    let mut out = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match e.op.as_str() {
            "acq_ok" => {
                held.insert((e.pid, e.task), e.key.unwrap_or(0));
            }
            "rel_invoke" => {
                held.remove(&(e.pid, e.task));
            }
            "stop" => {
                let Some(victim) = e.target else { continue };
                let mut keys: Vec<u32> = held.iter().filter(|((pid, _), _)| *pid == victim).map(|(_, k)| *k).collect();
                keys.sort_unstable();
                keys.dedup();
                for key in keys {
                    let next = events[i..]
                        .iter()
                        .find(|n| n.op == "acq_ok" && n.pid != victim && n.key.unwrap_or(0) == key)
                        .map(|n| Duration::from_nanos(n.t.saturating_sub(e.t)));
                    out.push((key, next));
                }
            }
            _ => {}
        }
    }
    out
}

/// Asserts T8a's bound on every handover; a stop that found the victim
/// holding nothing is not judged, and a row where nothing could be judged
/// fails, since it would pass untested.
fn enforce_t8a(r: &mut Report, events: &[Event], session: Duration) {
    let bound = t8a_bound(session);
    let got = handovers(events);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let worst = got.iter().filter_map(|(_, d)| *d).max();
    let late: Vec<String> = got
        .iter()
        .filter(|(_, d)| d.is_none_or(|d| d > bound))
        .map(|(k, d)| d.map_or_else(|| format!("key {k}: never"), |d| format!("key {k}: {:.0} ms", ms(d))))
        .collect();
    r.note(format!(
        "T8a: stop → next grant of the stopped holder's key to another client: {} handover(s), max {}, bound {:.0} ms \
         (session + 2 ticks + 200 ms)",
        got.len(),
        worst.map_or_else(|| "-".to_owned(), |w| format!("{:.0} ms", ms(w))),
        ms(bound)
    ));
    if got.is_empty() {
        r.fail("T8a: no stopped holder's key to judge the handover on");
    }
    if !late.is_empty() {
        r.fail(format!("T8a: handover over the bound: {}", late.join(", ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t_ms: u64, pid: u32, op: &str, key: u32) -> Event {
        Event { t: t_ms * 1_000_000, pid, op: op.into(), key: Some(key), ..Event::default() }
    }

    fn stop(t_ms: u64, victim: u32) -> Event {
        Event { t: t_ms * 1_000_000, op: "stop".into(), target: Some(victim), ..Event::default() }
    }

    fn judged(next_grant_ms: u64) -> Report {
        let events = vec![
            ev(0, 1, "acq_ok", 0),
            ev(5, 2, "acq_ok", 1),
            stop(10, 1),
            ev(20, 2, "rel_invoke", 1),
            ev(10 + next_grant_ms, 3, "acq_ok", 0),
        ];
        let mut r = Report::new("zk-expire", "zookeeper", 0);
        enforce_t8a(&mut r, &events, Duration::from_millis(1000));
        r
    }

    /// A handover within session + 2 ticks + 200 ms passes, one past it
    /// fails, and a history with no handover to judge fails too.
    #[test]
    fn t8a_handover_bound_can_fail() {
        assert!(judged(1350).pass, "{}", judged(1350).notes);
        let late = judged(1450);
        assert!(!late.pass && late.notes.contains("key 0: 1450 ms"), "{}", late.notes);
        let mut nothing = Report::new("zk-expire", "zookeeper", 0);
        enforce_t8a(&mut nothing, &[stop(10, 1)], Duration::from_millis(1000));
        assert!(!nothing.pass, "{}", nothing.notes);
        let mut never = Report::new("zk-expire", "zookeeper", 0);
        enforce_t8a(&mut never, &[ev(0, 1, "acq_ok", 0), stop(10, 1)], Duration::from_millis(1000));
        assert!(!never.pass && never.notes.contains("never"), "{}", never.notes);
    }
}
