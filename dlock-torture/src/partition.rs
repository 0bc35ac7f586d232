//! `partition`: one worker's lock-server traffic held by a
//! [`FaultProxy`] for 2 × lease while it holds a lock.

use std::time::Duration;

use dlock_testing::{FaultProxy, RedisServer};
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::Event;
use crate::scenario::{
    config, describe, find_fresh_holder, finish, note_signalled, resource_server, spawn_workers, Size,
};

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
    cfg.duration_ms = episodes * 2600 + 1500;
    let mut cut_cfg = cfg.clone();
    // The victim's sections outlast a lease and the margin by far, and a
    // cut lands just after a grant: every cut-off hold is still in its
    // section when its lease ends, so every episode is judged (with cuts at
    // random points of shorter sections, a short run could judge none).
    cut_cfg.cs_min_ms = cfg.lease_ms * 2;
    cut_cfg.cs_max_ms = cfg.lease_ms * 3;
    cut_cfg.urls = vec![format!("redis://127.0.0.1:{}", proxy.port())];
    let victim = run.spawn(cut_cfg).map_err(|e| e.to_string())?;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs - 1)?;
    let mut done = 0;
    sleep(Duration::from_millis(300)).await;
    for _ in 0..episodes {
        let fresh = find_fresh_holder(&run, &[victim], FRESH, Duration::from_secs(2)).await?;
        if fresh.is_none() {
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
    enforce_t8e(&mut r, &run.events()?, victim, Duration::from_millis(cfg.lease_ms));
    Ok(vec![r])
}

/// How recent a victim's grant must be for a cut to land on it.
const FRESH: Duration = Duration::from_millis(50);

/// Slack on top of the lease for T8e's bound: the signal's own scheduling
/// on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(200);

/// T8e's bound (reliability.md: a holder cut off from the lock server
/// reports LOST by its session timeout), for a Redis lease: every hold of
/// the victim open when a partition began, whose section was still running
/// a lease + margin later, must have seen `lost` by then. Its last renewal
/// confirmed before the cut was sent before it, so its validity ended at
/// most a lease after the cut. Returns (holds judged, late holds as
/// "ms after the cut", or `None` when `lost` never fired).
fn losses_after_cuts(events: &[Event], victim: u32, lease: Duration) -> (usize, Vec<Option<Duration>>) {
    let bound = lease + MARGIN;
    let mut open: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
    let (mut judged, mut late) = (0, Vec::new());
    for (i, e) in events.iter().enumerate() {
        match e.op.as_str() {
            "acq_ok" if e.pid == victim => {
                open.insert(e.task, e.t);
            }
            "rel_invoke" if e.pid == victim => {
                open.remove(&e.task);
            }
            "partition" if e.target == Some(victim) => {
                let due = e.t + u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
                for task in open.keys() {
                    let later = || events[i..].iter().filter(|n| n.pid == victim && n.task == *task);
                    let released = later().find(|n| n.op == "rel_invoke").map(|n| n.t);
                    // This hold's signal: the task's `lost` before its release.
                    let lost =
                        later().find(|n| n.op == "lost").map(|n| n.t).filter(|l| released.is_none_or(|r| *l <= r));
                    let signalled = lost.is_some_and(|l| l <= due);
                    // A section that ended inside the bound stopped watching
                    // for the signal before its validity could end: not judged.
                    if released.is_some_and(|t| t <= due) && !signalled {
                        continue;
                    }
                    judged += 1;
                    if !signalled {
                        late.push(lost.map(|l| Duration::from_nanos(l.saturating_sub(e.t))));
                    }
                }
            }
            _ => {}
        }
    }
    (judged, late)
}

/// Asserts T8e's bound; a row where no hold could be judged fails, since
/// it would pass untested.
fn enforce_t8e(r: &mut Report, events: &[Event], victim: u32, lease: Duration) {
    let (judged, late) = losses_after_cuts(events, victim, lease);
    r.note(format!(
        "T8e: cut-off holds still in their section a lease + {} ms after the cut: {judged}, of which without `lost` \
         by then: {} (need 0)",
        MARGIN.as_millis(),
        late.len()
    ));
    if judged == 0 {
        r.fail("T8e: no cut-off hold outlived its lease, nothing to judge");
    }
    if !late.is_empty() {
        let shown: Vec<String> = late
            .iter()
            .map(|d| d.map_or_else(|| "never".to_owned(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3)))
            .collect();
        r.fail(format!("T8e: `lost` later than lease + {} ms after the cut: {}", MARGIN.as_millis(), shown.join(", ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t_ms: u64, pid: u32, op: &str) -> Event {
        Event { t: t_ms * 1_000_000, pid, op: op.into(), key: Some(0), ..Event::default() }
    }

    fn cut(t_ms: u64) -> Event {
        Event { t: t_ms * 1_000_000, op: "partition".into(), target: Some(1), ..Event::default() }
    }

    fn judge(events: &[Event]) -> Report {
        let mut r = Report::new("partition", "redis", 0);
        enforce_t8e(&mut r, events, 1, Duration::from_millis(400));
        r
    }

    /// `lost` within lease + margin of the cut passes; later, or never,
    /// fails; a hold released inside the bound is not judged, and a row with
    /// nothing judged fails.
    #[test]
    fn t8e_loss_bound_can_fail() {
        let on_time = [ev(0, 1, "acq_ok"), cut(10), ev(400, 1, "lost"), ev(800, 1, "rel_invoke")];
        assert!(judge(&on_time).pass, "{}", judge(&on_time).notes);
        let late = [ev(0, 1, "acq_ok"), cut(10), ev(650, 1, "lost"), ev(800, 1, "rel_invoke")];
        assert!(!judge(&late).pass && judge(&late).notes.contains("640 ms"), "{}", judge(&late).notes);
        let never = [ev(0, 1, "acq_ok"), cut(10), ev(800, 1, "rel_invoke")];
        assert!(!judge(&never).pass && judge(&never).notes.contains("never"), "{}", judge(&never).notes);
        let short = [ev(0, 1, "acq_ok"), cut(10), ev(100, 1, "rel_invoke"), ev(650, 2, "acq_ok")];
        assert!(!judge(&short).pass && judge(&short).notes.contains("nothing to judge"), "{}", judge(&short).notes);
    }
}
