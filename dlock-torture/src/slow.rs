//! `redlock-slow` (reliability.md T5e): RedLock over five masters of which
//! two are slow and one is slower than a whole lease, under load from worker
//! processes.
//!
//! Every worker reaches every master through one of the harness's
//! [`dlock_testing::FaultProxy`]s. The delay is split evenly between the two
//! directions, so a node's round trip grows by the table's figure (0.4 ×
//! lease on two nodes, 1.1 × lease on one) *and* every command lands late:
//! a `SET` the client stopped waiting for still lands afterwards, and must
//! neither be taken for a grant nor be left behind.
//!
//! Checks: C1 and C2 through the usual history checker; no grant returned
//! with its validity already over (each `acq_ok` logs what was left); after
//! the run, no lock key on any master (C6), plus every lock key that Redis
//! *expired* during the run, from keyspace notifications. A holder that
//! releases within its validity deletes its keys, and so does a failed
//! attempt's undo: a lock key that expires was left behind, unless a hold of
//! that key was released only after its validity ended (a quorum that came
//! late plus the section outlasting the lease on a loaded machine), whose
//! keys expire by design. Those are counted apart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_testing::{FaultProxy, RedisServer};
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::{mono_ns, Event};
use crate::scenario::{config, describe, finish, residue_on, resource_server, spawn_workers, Size};

/// The lease; the table's delays are fractions of it.
const LEASE_MS: u64 = 500;
/// The table's size for the long run.
const LONG_TARGET: u64 = 2_000;

pub(crate) async fn run(size: Size, seed: u64) -> Result<Report, String> {
    let nodes: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let (res_server, resource) = resource_server().await?;
    let lease = Duration::from_millis(LEASE_MS);
    // Round-trip delays per node: two fast, two at 0.4 × lease, one at 1.1 ×.
    let round_trips = [Duration::ZERO, Duration::ZERO, lease * 2 / 5, lease * 2 / 5, lease * 11 / 10];
    let proxies: Vec<FaultProxy> = nodes.iter().map(|n| FaultProxy::start(n.port())).collect();
    for (proxy, rtt) in proxies.iter().zip(round_trips) {
        proxy.set_request_delay(rtt / 2);
        proxy.set_delay(rtt / 2);
    }
    let expiries = ExpiryWatch::start(&nodes)?;

    let mut run = Run::new("redlock-slow").map_err(|e| e.to_string())?;
    // The delays hold for the whole run: one band on the timeline.
    run.log("slow", None);
    let urls = proxies.iter().map(|p| format!("redis://127.0.0.1:{}", p.port())).collect();
    let mut cfg = config("redlock", urls, &res_server, seed);
    cfg.lease_ms = LEASE_MS;
    // Fixed leases: the validity each grant returns is what is checked.
    cfg.watchdog = false;
    // Above the slow nodes' round trip (a quorum needs one of them), below
    // the lease: an attempt's wait for the slowest node is cut short at its
    // validity anyway.
    cfg.node_timeout_ms = LEASE_MS * 4 / 5;
    // Many keys and tasks: every acquire waits ~0.4 × lease for its quorum
    // and every release up to the node timeout, so throughput comes from
    // parallel holds, with enough contention for failed attempts to undo.
    cfg.keys = 32;
    cfg.tasks = 8;
    cfg.cs_max_ms = 20;
    cfg.wait_ms = LEASE_MS * 5;
    cfg.duration_ms = size.pick(32_000, 150_000);
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    // The delays as the workers meet them, measured while they run.
    let measured_early = probe_all(&proxies).await;
    let mut r = Report::new("redlock-slow", "redlock (5 nodes, 2 at 0.4 × lease, 1 at 1.1 × lease)", seed);
    r.expected_safe = true;
    r.fault_kind = "delay requests and replies: +0.4 × lease round trip on 2 nodes, +1.1 × lease on 1".into();
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(20)).await?;
    let measured_late = probe_all(&proxies).await;
    r.faults = count_delaying(&round_trips, &measured_early, &measured_late);
    r.note(format!(
        "PING round trips through each node's proxy at the start / end of the run, ms: {}; nodes delaying as set: {} of \
         3",
        round_trips
            .iter()
            .zip(measured_early.iter().zip(&measured_late))
            .map(|(set, (a, b))| format!("{}→{}/{}", set.as_millis(), show_ms(*a), show_ms(*b)))
            .collect::<Vec<_>>()
            .join(", "),
        r.faults
    ));
    if r.faults < 3 {
        r.fail(format!("only {} of the 3 slow nodes were measured delaying their traffic", r.faults));
    }

    // Every worker has exited; their last commands may still sit in a
    // proxy for up to half the slowest round trip. Once those have landed,
    // a lock key still on a node is a leftover; it would live on for up to
    // a lease, so the count is taken well inside that.
    sleep(round_trips[4] / 2 + Duration::from_millis(100)).await;
    let (left, _) = residue_on(&nodes, Duration::ZERO).await?;
    r.residual_keys = Some(left);
    // A leftover of the run's last lease needs that lease to expire.
    sleep(lease + Duration::from_millis(200)).await;
    let expired = tokio::task::block_in_place(|| expiries.finish())?;
    let events = run.events()?;
    let late = late_releases(&events);
    let (explained, leftovers): (Vec<&Expiry>, Vec<&Expiry>) = expired.iter().partition(|x| {
        late.iter()
            .any(|h| Some(h.key) == x.key && x.t + 10_000_000 >= h.valid_until && x.t <= h.valid_until + lease_ns())
    });

    let (waited, overran, worst) = overruns(&events, Duration::from_millis(cfg.wait_ms));
    r.note(format!(
        "acquires that found the key held at least once (each such try undoes what it sent): {waited}; acquires \
         that returned more than one lease after their {} ms wait: {overran}, the latest {:.0} ms after it",
        cfg.wait_ms,
        worst.as_secs_f64() * 1e3
    ));
    let expired_on_return = r.expired_on_return.unwrap_or(0);
    if findings.validity_logged < findings.acquisitions {
        r.fail(format!(
            "only {} of {} grants logged their validity left on return",
            findings.validity_logged, findings.acquisitions
        ));
    }
    r.note(format!("acquisitions with invalid validity: {expired_on_return}; residual keys: {left}"));
    if let Some(min) = findings.min_left_us {
        r.note(format!("smallest validity left on return {:.1} ms of a {LEASE_MS} ms lease", min as f64 / 1000.0));
    }
    r.note(format!(
        "holds released only after their validity ended (section + a slow quorum past the lease; their keys expire by \
         design): {}; lock keys Redis expired during the run: {}, of which explained by those holds {}, left behind {}",
        late.len(),
        expired.len(),
        explained.len(),
        leftovers.len()
    ));
    if expired_on_return > 0 {
        r.fail("an acquire returned a guard whose validity was already over");
    }
    if left > 0 {
        r.fail("lock keys left on a node after every worker finished");
    }
    if !leftovers.is_empty() {
        r.fail(format!(
            "lock keys left to expire by a failed attempt or a release (key index, node): {:?}",
            leftovers.iter().take(5).map(|x| (x.key, x.node)).collect::<Vec<_>>()
        ));
    }
    if !size.short && r.operations < LONG_TARGET {
        r.note(format!("only {} acquisitions, below the table's {LONG_TARGET}", r.operations));
    }
    drop(proxies);
    Ok(r)
}

/// One `PING` round trip through each proxy, on a fresh connection; `None`
/// when a node did not answer within 5 s.
async fn probe_all(proxies: &[FaultProxy]) -> Vec<Option<Duration>> {
    futures_util::future::join_all(proxies.iter().map(|p| ping_rtt(p.port()))).await
}

pub(crate) async fn ping_rtt(port: u16) -> Option<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let started = tokio::time::Instant::now();
        conn.write_all(b"PING\r\n").await.ok()?;
        let mut reply = [0u8; 7];
        conn.read_exact(&mut reply).await.ok()?;
        (&reply == b"+PONG\r\n").then(|| started.elapsed())
    };
    tokio::time::timeout(Duration::from_secs(5), probe).await.ok().flatten()
}

fn show_ms(rtt: Option<Duration>) -> String {
    rtt.map_or_else(|| "none".to_owned(), |d| format!("{:.0}", d.as_secs_f64() * 1e3))
}

/// The nodes meant to be slow whose measured round trip, at both ends of
/// the run, was at least 0.9 × the delay set: a fault counted only when the
/// proxy was seen delaying bytes, not because it was told to.
fn count_delaying(set: &[Duration], early: &[Option<Duration>], late: &[Option<Duration>]) -> u64 {
    set.iter()
        .zip(early.iter().zip(late))
        .filter(|(set, (a, b))| {
            !set.is_zero() && [a, b].iter().all(|m| m.is_some_and(|m| m.as_micros() * 10 >= set.as_micros() * 9))
        })
        .count() as u64
}

/// From the history: acquires that took longer than one uncontended round
/// (they found the key held at least once), acquires that returned more
/// than a lease after their wait was over, and the largest such overrun.
fn overruns(events: &[Event], wait: Duration) -> (u64, u64, Duration) {
    let lease = Duration::from_millis(LEASE_MS);
    let mut invoked: HashMap<(u32, u32), u64> = HashMap::new();
    let (mut waited, mut overran, mut worst) = (0, 0, Duration::ZERO);
    for e in events {
        match e.op.as_str() {
            "acq_invoke" => {
                invoked.insert((e.pid, e.task), e.t);
            }
            "acq_ok" | "acq_fail" => {
                let Some(t0) = invoked.remove(&(e.pid, e.task)) else { continue };
                let took = Duration::from_nanos(e.t.saturating_sub(t0));
                // An uncontended grant takes one slow round trip (0.4 × lease).
                if took > lease * 3 / 4 {
                    waited += 1;
                }
                let over = took.saturating_sub(wait);
                if over > lease {
                    overran += 1;
                }
                worst = worst.max(over);
            }
            _ => {}
        }
    }
    (waited, overran, worst)
}

fn lease_ns() -> u64 {
    LEASE_MS * 1_000_000
}

/// A hold whose release began after its fixed lease's validity had ended.
struct LateHold {
    key: u32,
    valid_until: u64,
}

/// Holds released (or left unreleased) after their validity ended: the
/// section plus a quorum that came late can outlast a lease on a loaded
/// machine. Their keys expire on the nodes by design, not as leftovers.
fn late_releases(events: &[Event]) -> Vec<LateHold> {
    let mut open: HashMap<(u32, u32), (u32, u64)> = HashMap::new();
    let mut late = Vec::new();
    for e in events {
        match e.op.as_str() {
            "acq_ok" => {
                if let (Some(key), Some(vu)) = (e.key, e.vu) {
                    open.insert((e.pid, e.task), (key, vu));
                }
            }
            "rel_invoke" => {
                if let Some((key, vu)) = open.remove(&(e.pid, e.task))
                    && e.t >= vu
                {
                    late.push(LateHold { key, valid_until: vu });
                }
            }
            _ => {}
        }
    }
    late.extend(open.into_values().map(|(key, valid_until)| LateHold { key, valid_until }));
    late
}

/// A lock key Redis expired: its key index, node and when (`mono_ns`).
#[derive(Debug)]
struct Expiry {
    key: Option<u32>,
    node: usize,
    t: u64,
}

/// The worker's key index in a lock key's name, `torture:{torture:<k>}`.
fn key_index(name: &str) -> Option<u32> {
    name.strip_prefix("torture:{torture:")?.strip_suffix('}')?.parse().ok()
}

/// Counts lock keys that Redis expires on any of the nodes, from keyspace
/// notifications (`notify-keyspace-events Ex`). Unlike a count at the end,
/// this sees leftovers from the whole run. One thread per node, on its own
/// blocking connection, because a subscribed connection can do nothing else.
struct ExpiryWatch {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<Expiry>>>,
}

impl ExpiryWatch {
    fn start(nodes: &[RedisServer]) -> Result<Self, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (node_no, node) in nodes.iter().enumerate() {
            let client = redis::Client::open(node.url()).map_err(|e| e.to_string())?;
            let mut conn = client.get_connection().map_err(|e| format!("expiry watch: {e}"))?;
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("notify-keyspace-events")
                .arg("Ex")
                .query::<()>(&mut conn)
                .map_err(|e| format!("expiry watch: cannot enable notifications: {e}"))?;
            let stop_thread = stop.clone();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            threads.push(std::thread::spawn(move || {
                let mut pubsub = conn.as_pubsub();
                let subscribed = pubsub.subscribe("__keyevent@0__:expired").is_ok()
                    && pubsub.set_read_timeout(Some(Duration::from_millis(100))).is_ok();
                let _ = ready_tx.send(subscribed);
                let mut expired = Vec::new();
                while subscribed && !stop_thread.load(Ordering::SeqCst) {
                    if let Ok(msg) = pubsub.get_message() {
                        let t = mono_ns();
                        // Lock hashes end in `}`; fencing counters (`…:fence`)
                        // outlive locks and expire by design.
                        if let Ok(k) = msg.get_payload::<String>()
                            && k.starts_with("torture")
                            && k.ends_with('}')
                        {
                            expired.push(Expiry { key: key_index(&k), node: node_no + 1, t });
                        }
                    }
                }
                expired
            }));
            if ready_rx.recv().ok() != Some(true) {
                stop.store(true, Ordering::SeqCst);
                return Err("expiry watch: cannot subscribe to expiry notifications".into());
            }
        }
        Ok(ExpiryWatch { stop, threads })
    }

    /// Stops watching; returns every lock key that expired. A watcher that
    /// panicked saw an unknown number: an error, not zero.
    fn finish(self) -> Result<Vec<Expiry>, String> {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for t in self.threads {
            all.extend(t.join().map_err(|_| "an expiry watcher thread panicked")?);
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node counts as a fault only when it was set slow and measured slow
    /// at both ends; a node that answered fast, or not at all, does not.
    #[test]
    fn only_nodes_measured_slow_count_as_faults() {
        let ms = Duration::from_millis;
        let set = [Duration::ZERO, ms(200), ms(200), ms(550)];
        let slow = [Some(ms(1)), Some(ms(205)), Some(ms(230)), Some(ms(560))];
        assert_eq!(count_delaying(&set, &slow, &slow), 3);
        let one_fast_at_the_end = [Some(ms(1)), Some(ms(205)), Some(ms(3)), Some(ms(560))];
        assert_eq!(count_delaying(&set, &slow, &one_fast_at_the_end), 2);
        let none_answered = [None, None, None, None];
        assert_eq!(count_delaying(&set, &none_answered, &slow), 0);
    }

    /// The probe measures what a proxy really does to a real Redis.
    #[test]
    fn the_probe_sees_a_proxy_delay() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let node = RedisServer::start();
        let proxy = FaultProxy::start(node.port());
        let fast = rt.block_on(ping_rtt(proxy.port())).expect("PING through the proxy");
        proxy.set_request_delay(Duration::from_millis(100));
        proxy.set_delay(Duration::from_millis(100));
        let slow = rt.block_on(ping_rtt(proxy.port())).expect("PING through the slow proxy");
        assert!(fast < Duration::from_millis(100), "{fast:?}");
        assert!(slow >= Duration::from_millis(180), "{slow:?}");
    }
}
