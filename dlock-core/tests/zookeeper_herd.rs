//! T8c (reliability.md §9): the herd effect, on dlock's own ZooKeeper
//! backend, counted outside dlock.
//!
//! Many waiters queue on one key, each in its own ZooKeeper session (its own
//! `Locker` and backend). With the predecessor watch each release should wake
//! exactly one waiter; a recipe where every waiter watches the lowest node
//! wakes them all. The counts come from the server (`mntr`: watchers fired)
//! and from the wire (a [`ZooKeeperProxy`] in front of every session counts
//! `getChildren` requests and watch notifications), never from dlock's own
//! bookkeeping. The broken recipe runs in the same test as a negative
//! control: the counters must see about N wake-ups per release there, or a
//! "1 per release" for dlock would prove nothing.
//!
//! Size: `DLOCK_T8C_WAITERS` (default 20) waiters sharing
//! `DLOCK_T8C_RELEASES` (default 100) releases; the long form of
//! reliability.md is 50 and 500.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::zookeeper::{ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, Locker, LockerOptions};
use dlock_testing::{watches_fired, ZooKeeperProxy, ZooKeeperServer, GET_CHILDREN, GET_CHILDREN2};
use tokio::time::Instant;
use zookeeper_client as zk;

fn setting(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name} must be a positive integer, not `{v}`")),
        Err(_) => default,
    }
}

/// What the server and the wire saw between two instants.
#[derive(Debug, Clone, Copy)]
struct Counters {
    /// Watchers the server fired (`mntr`, every event kind).
    watches: u64,
    /// Watch notifications the proxy passed to clients.
    notifications: u64,
    /// Of those, a client told of its own delete.
    own: u64,
    /// `getChildren` and `getChildren2` requests on the wire.
    get_children: u64,
}

fn counters(server: &ZooKeeperServer, proxy: &ZooKeeperProxy) -> (Counters, BTreeMap<String, String>) {
    let metrics = server.mntr().expect("mntr answers (whitelisted in dlock-testing's zoo.cfg)");
    let watches = watches_fired(&metrics).expect("ZooKeeper 3.6+ reports zk_sum_node_*_watch_count in mntr");
    let c = Counters {
        watches,
        notifications: proxy.notifications(),
        own: proxy.own_delete_notifications(),
        get_children: proxy.requests_of(GET_CHILDREN) + proxy.requests_of(GET_CHILDREN2),
    };
    (c, metrics)
}

impl std::ops::Sub for Counters {
    type Output = Counters;
    fn sub(self, before: Counters) -> Counters {
        Counters {
            watches: self.watches - before.watches,
            notifications: self.notifications - before.notifications,
            own: self.own - before.own,
            get_children: self.get_children - before.get_children,
        }
    }
}

/// Waits until the server's count of fired watchers is matched by the
/// notifications the proxy passed on (a notification of the last release
/// may still be on its way), then returns the counters.
async fn settled(
    server: &ZooKeeperServer,
    proxy: &ZooKeeperProxy,
    before: Counters,
) -> (Counters, BTreeMap<String, String>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (now, metrics) = counters(server, proxy);
        let d = now - before;
        if d.notifications >= d.watches || Instant::now() >= deadline {
            return (d, metrics);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn children(admin: &zk::Client, dir: &str) -> usize {
    match admin.list_children(dir).await {
        Ok(c) => c.len(),
        Err(zk::Error::NoNode) => 0,
        Err(e) => panic!("list {dir}: {e}"),
    }
}

/// Waits until `n` contenders have nodes under `dir`.
async fn queued(admin: &zk::Client, dir: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while children(admin, dir).await < n {
        assert!(Instant::now() < deadline, "{n} contenders did not queue under {dir} within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// dlock's backend: `waiters` sessions take the lock `rounds` times each,
/// queueing behind a gate holder first so every release has a full queue
/// behind it until the last rounds. Returns (releases, counters).
async fn dlock_run(server: &ZooKeeperServer, proxy: &ZooKeeperProxy, waiters: usize, rounds: usize) -> (u64, Counters) {
    let mut lockers = Vec::new();
    for _ in 0..=waiters {
        let backend = ZooKeeperBackend::connect_with(
            &proxy.connect_string(),
            "dlock",
            ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("connect through the proxy");
        lockers.push(
            Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("options"),
        );
    }
    let gate_locker = lockers.pop().expect("one locker for the gate");
    let key = gate_locker.key("herd").part(1).build().expect("key");
    let probe = ZooKeeperBackend::connect_with(
        &server.connect_string(),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("probe");
    let dir = dlock_core::test_support::zookeeper_lock_path(&probe, &key);
    let admin = zk::Client::connect(&server.connect_string()).await.expect("admin session");

    let gate = gate_locker.try_acquire(&key).await.expect("the key is free");
    let wait = AcquireOptions::new().with_wait(Duration::from_secs(120));
    let tasks: Vec<_> = lockers
        .into_iter()
        .map(|l| {
            let (key, wait) = (key.clone(), wait.clone());
            tokio::spawn(async move {
                for _ in 0..rounds {
                    let g = l.acquire(&key, wait.clone()).await.expect("acquire");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    assert!(g.release().await.expect("release"), "the lock was ours until released");
                }
            })
        })
        .collect();
    queued(&admin, &dir, waiters + 1).await;
    let (before, _) = counters(server, proxy);
    assert!(gate.release().await.expect("release the gate"));
    for t in tasks {
        t.await.expect("waiter task");
    }
    let (d, _) = settled(server, proxy, before).await;
    (1 + (waiters * rounds) as u64, d)
}

/// The broken recipe of the torture harness's self-test (every waiter
/// watches the lowest node), with raw sessions through the same proxy.
async fn herd_run(server: &ZooKeeperServer, proxy: &ZooKeeperProxy, waiters: usize, rounds: usize) -> (u64, Counters) {
    let dir = "/herd-control";
    let admin = zk::Client::connect(&server.connect_string()).await.expect("admin session");
    admin
        .create(dir, &[], &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()))
        .await
        .expect("create the lock node");
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (_, gate_seq) = admin.create(&format!("{dir}/n-"), &[], &ephemeral).await.expect("the gate's node");
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let client = zk::Client::connect(&proxy.connect_string()).await.expect("a contender's session");
        let ephemeral = ephemeral.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let (_, seq) = client.create(&format!("{dir}/n-"), &[], &ephemeral).await.expect("create");
                let ours = format!("n-{seq}");
                loop {
                    let mut nodes = client.list_children(dir).await.expect("list");
                    // Sequence numbers are zero-padded: text order is creation order.
                    nodes.sort();
                    let pos = nodes.iter().position(|c| *c == ours).expect("our node");
                    if pos == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        client.delete(&format!("{dir}/{ours}"), None).await.expect("release");
                        break;
                    }
                    // The herd: everybody watches the holder's node.
                    let (stat, watcher) =
                        client.check_and_watch_stat(&format!("{dir}/{}", nodes[0])).await.expect("watch");
                    if stat.is_some() {
                        watcher.changed().await;
                    }
                }
            }
        }));
    }
    queued(&admin, dir, waiters + 1).await;
    let (before, _) = counters(server, proxy);
    admin.delete(&format!("{dir}/n-{gate_seq}"), None).await.expect("release the gate");
    for t in tasks {
        t.await.expect("contender task");
    }
    let (d, _) = settled(server, proxy, before).await;
    (1 + (waiters * rounds) as u64, d)
}

fn per(n: u64, releases: u64) -> f64 {
    n as f64 / releases as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_release_wakes_one_waiter_as_the_server_counts_it() {
    let waiters = setting("DLOCK_T8C_WAITERS", 20).max(2);
    let rounds = (setting("DLOCK_T8C_RELEASES", 100) / waiters).max(1);
    let server = ZooKeeperServer::start();
    let proxy = ZooKeeperProxy::start(server.port());

    let started = Instant::now();
    let (releases, d) = dlock_run(&server, &proxy, waiters, rounds).await;
    let max_per_delete: u64 =
        server.mntr().expect("mntr")["zk_max_node_deleted_watch_count"].parse().expect("a number");
    let wakeups = d.watches - d.own;
    eprintln!(
        "T8c dlock backend: {waiters} waiters, {releases} releases in {:?}: server fired {} watchers ({:.2}/release), \
         of which {} told a holder of its own release ({:.2}/release) and {wakeups} woke a waiter ({:.2}/release); \
         most watchers fired by one delete: {max_per_delete}; proxy passed {} notifications; \
         getChildren {:.2}/release",
        started.elapsed(),
        d.watches,
        per(d.watches, releases),
        d.own,
        per(d.own, releases),
        per(wakeups, releases),
        d.notifications,
        per(d.get_children, releases),
    );

    // A server of its own: the first run's sessions may linger for a while
    // and ZooKeeper admits only 60 connections per client address.
    drop((server, proxy));
    let server = ZooKeeperServer::start();
    let proxy = ZooKeeperProxy::start(server.port());
    let started = Instant::now();
    let (control_releases, c) = herd_run(&server, &proxy, waiters, rounds).await;
    let control_max: u64 = server.mntr().expect("mntr")["zk_max_node_deleted_watch_count"].parse().expect("a number");
    eprintln!(
        "T8c herd control (every waiter watches the lowest node): {waiters} waiters, {control_releases} releases in {:?}: \
         server fired {} watchers ({:.2}/release), own-release notifications {}; most watchers fired by one delete: \
         {control_max}; proxy passed {} notifications; getChildren {:.2}/release",
        started.elapsed(),
        c.watches,
        per(c.watches, control_releases),
        c.own,
        c.notifications,
        per(c.get_children, control_releases),
    );

    // The measurement works: the server and the wire agree, and the herd shows.
    assert_eq!(d.notifications, d.watches, "every watcher the server fired reached a client through the proxy");
    assert_eq!(c.notifications, c.watches, "every watcher the server fired reached a client through the proxy");
    assert_eq!(c.own, 0, "the broken recipe never watches its own node");
    let control_per_release = per(c.watches, control_releases);
    assert!(
        control_per_release >= waiters as f64 / 3.0,
        "the control must show the herd (about {waiters} wake-ups per release), saw {control_per_release:.2}"
    );
    assert!(control_max >= (waiters as u64) - 1, "one delete woke every other waiter in the control: {control_max}");

    // dlock: one waiter woken per release. The holder's own watch on its
    // node (how its guard learns of a loss) also fires when it deletes the
    // node, at most once per release and never for anyone else.
    let wake_per_release = per(wakeups, releases);
    assert!(wake_per_release <= 1.05, "more than one waiter woken per release: {wake_per_release:.2}");
    assert!(wake_per_release >= 0.5, "waiters must have been woken by watches: {wake_per_release:.2}");
    assert!(d.own <= releases, "at most one own-node notification per release: {} in {releases}", d.own);
    assert!(max_per_delete <= 2, "a delete fired {max_per_delete} watchers (holder's own + one successor at most)");
    assert!(per(d.get_children, releases) <= 2.05, "getChildren per release {:.2}", per(d.get_children, releases));
    assert!(
        control_per_release >= 5.0 * per(d.watches, releases),
        "the control herds at least 5× more: {control_per_release:.2} vs {:.2}",
        per(d.watches, releases)
    );
}
