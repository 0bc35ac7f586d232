//! T8d (ZOOKEEPER-1262): the reply of a `create` is lost after the server
//! made the node. A lock recipe that does not find its node again leaves an
//! orphan that sorts first and blocks every other contender until its
//! session ends, which, with a client that reconnects to the same session,
//! is never. dlock names each node with a random prefix and looks for it
//! after `ConnectionLoss`; here a protocol-aware proxy really loses those
//! replies, on a real ZooKeeper. Half of the lost replies end the
//! connection with a close (the client reads end-of-stream) and half with a
//! reset (`ECONNRESET`); each contender also loses the reply of one create
//! of the lock's container node. Every third release loses the reply of its
//! delete, which must still count as freeing the lock.
//!
//! `DLOCK_T8D_DROPS` sets how many successful creates lose their reply
//! (default 200, a few seconds; the research plan's CI size is 50, its long
//! arm 500).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::zookeeper::{ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, Locker, LockerOptions};
use dlock_testing::{Hangup, ZooKeeperProxy, ZooKeeperServer, CREATE_CONTAINER, CREATE_OP_CODES, DELETE};
use tokio::time::Instant;
use zookeeper_client as zk;

const CONTENDERS: usize = 4;
const DEFAULT_DROPS: u64 = 200;
/// Every acquisition must end well within this (a deadlock shows as a
/// `Timeout` error, a hang as the outer timeout).
const WAIT: Duration = Duration::from_secs(20);

fn target_drops() -> u64 {
    match std::env::var("DLOCK_T8D_DROPS") {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("DLOCK_T8D_DROPS must be a whole number, not `{v}`")),
        Err(_) => DEFAULT_DROPS,
    }
}

/// What the contenders saw, for the assertions at the end.
#[derive(Default)]
struct Record {
    /// The shared register, updated non-atomically under the lock.
    counter: AtomicU64,
    acquisitions: AtomicU64,
    inside: AtomicUsize,
    overlaps: AtomicU64,
    /// Every grant's fencing token, in grant order.
    fences: Mutex<Vec<u64>>,
    max_wait_ms: AtomicU64,
}

fn dropped_successful(proxies: &[ZooKeeperProxy]) -> u64 {
    proxies.iter().map(ZooKeeperProxy::dropped_successful_creates).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_create_replies_leave_no_orphans_and_no_deadlock() {
    let target = target_drops();
    let server = ZooKeeperServer::start();
    let proxies: Arc<Vec<ZooKeeperProxy>> =
        Arc::new((0..CONTENDERS).map(|_| ZooKeeperProxy::start(server.port())).collect());
    let mut backends = Vec::new();
    for proxy in proxies.iter() {
        let backend = ZooKeeperBackend::connect_with(
            &proxy.connect_string(),
            "dlock",
            ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("connect through the proxy");
        backends.push(Arc::new(backend));
    }
    let sessions: Vec<_> = backends.iter().map(|b| dlock_core::test_support::zookeeper_session(b).id().0).collect();
    let lockers: Vec<Locker> = backends
        .iter()
        .map(|b| {
            let opts = LockerOptions::default().with_watchdog_lease(Duration::from_secs(2));
            Locker::with_options(b.clone() as Arc<dyn Backend>, opts).expect("valid options")
        })
        .collect();
    let key = lockers[0].key("t8d").part("register").build().expect("key");
    let dir = dlock_core::test_support::zookeeper_lock_path(&backends[0], &key);
    let record = Arc::new(Record::default());
    let started = Instant::now();

    let mut tasks = Vec::new();
    for (c, locker) in lockers.iter().cloned().enumerate() {
        let (proxies, record, key) = (proxies.clone(), record.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = 0u64;
            let hangup = |n: u64| if n.is_multiple_of(2) { Hangup::Close } else { Hangup::Reset };
            // Used when this contender next makes the container node
            // (the first acquisition, or after the lock node was emptied
            // and removed).
            proxies[c].drop_replies(&[CREATE_CONTAINER], 1, hangup(c as u64));
            while dropped_successful(&proxies) < target {
                round += 1;
                // Every other acquisition of each contender loses its
                // create's reply, so lost replies meet normal grants and
                // waits on nodes that were found again.
                if (round + c as u64).is_multiple_of(2) {
                    proxies[c].drop_replies(&CREATE_OP_CODES, 1, hangup(round / 2));
                }
                let asked = Instant::now();
                let guard = tokio::time::timeout(
                    WAIT + Duration::from_secs(5),
                    locker.acquire(&key, AcquireOptions::new().with_wait(WAIT)),
                )
                .await
                .unwrap_or_else(|_| panic!("contender {c}: acquire hung past its deadline (round {round})"))
                .unwrap_or_else(|e| panic!("contender {c}: acquire failed in round {round}: {e}"));
                let waited = asked.elapsed();
                assert!(waited < WAIT, "contender {c}: granted after the deadline ({waited:?})");
                record.max_wait_ms.fetch_max(waited.as_millis() as u64, Ordering::SeqCst);
                record.fences.lock().expect("fences").push(guard.fencing_token());
                if record.inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    record.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                // A read-modify-write with an await in the middle: any
                // second holder in this window loses an update.
                let seen = record.counter.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                record.counter.store(seen + 1, Ordering::SeqCst);
                record.acquisitions.fetch_add(1, Ordering::SeqCst);
                record.inside.fetch_sub(1, Ordering::SeqCst);
                if (round + c as u64).is_multiple_of(3) {
                    proxies[c].drop_replies(&[DELETE], 1, hangup(round / 3));
                }
                let freed = guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("contender {c}: release failed in round {round}: {e}"));
                assert!(freed, "contender {c}: release in round {round} says the lock was no longer held");
            }
            proxies[c].disarm();
        }));
    }
    for t in tasks {
        t.await.expect("contender task");
    }
    let elapsed = started.elapsed();

    // Orphans are ephemeral: look while every session is still open, with a
    // plain client that goes around the proxies.
    let raw = zk::Client::connect(&server.connect_string()).await.expect("plain ZooKeeper client");
    let orphans = match raw.list_children(&dir).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("list {dir}: {e}"),
    };

    let acquisitions = record.acquisitions.load(Ordering::SeqCst);
    let counter = record.counter.load(Ordering::SeqCst);
    let dropped: u64 = proxies.iter().map(ZooKeeperProxy::dropped_replies).sum();
    let dropped_ok = dropped_successful(&proxies);
    let dropped_containers: u64 = proxies.iter().map(|p| p.dropped_replies_of(CREATE_CONTAINER)).sum();
    let dropped_deletes: u64 = proxies.iter().map(|p| p.dropped_replies_of(DELETE)).sum();
    let reconnects: u64 = proxies.iter().map(|p| p.connections().saturating_sub(1)).sum();
    let fences = record.fences.lock().expect("fences").clone();
    eprintln!(
        "T8d: {acquisitions} acquisitions by {CONTENDERS} contenders in {elapsed:?}; replies lost: {dropped} \
         ({dropped_ok} of created lock nodes, {dropped_containers} of container creates, {dropped_deletes} of deletes); reconnects {reconnects}; overlaps {}; counter {counter}; \
         orphans {}; longest wait {} ms",
        record.overlaps.load(Ordering::SeqCst),
        orphans.len(),
        record.max_wait_ms.load(Ordering::SeqCst),
    );

    assert!(dropped_ok >= target, "only {dropped_ok} successful creates lost their reply, wanted {target}");
    assert!(dropped_containers >= 1, "no container create lost its reply");
    assert!(dropped_deletes >= 1, "no delete lost its reply");
    assert!(
        reconnects >= dropped,
        "each lost reply closes the connection: {reconnects} reconnects for {dropped} drops"
    );
    let after: Vec<_> = backends.iter().map(|b| dlock_core::test_support::zookeeper_session(b).id().0).collect();
    assert_eq!(after, sessions, "the clients resumed their sessions; none expired");
    assert_eq!(record.overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(counter, acquisitions, "lost updates on the register (C1)");
    assert!(orphans.is_empty(), "orphan lock nodes left under {dir}: {orphans:?}");
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "fencing tokens must grow with every grant: {fences:?}");
    drop(lockers);
}

/// The create's reply is lost and so are the replies of every look for the
/// node that follows, so the acquire cannot tell whether it made one and
/// fails. The node it did make must not stay: it would sort first and
/// block every other contender for as long as the session lives, and the
/// session survives the reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_be_found_again_is_swept_up() {
    const GET_CHILDREN: i32 = 8;
    let server = ZooKeeperServer::start();
    let proxy = ZooKeeperProxy::start(server.port());
    let unlucky = Arc::new(
        ZooKeeperBackend::connect_with(
            &proxy.connect_string(),
            "dlock",
            ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("connect through the proxy"),
    );
    let session = dlock_core::test_support::zookeeper_session(&unlucky).id().0;
    let other = ZooKeeperBackend::connect_with(
        &server.connect_string(),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("connect");
    let (unlucky_locker, other) = (
        Locker::with_options(unlucky.clone() as Arc<dyn Backend>, LockerOptions::default()).expect("locker"),
        Locker::with_options(Arc::new(other) as Arc<dyn Backend>, LockerOptions::default()).expect("locker"),
    );
    let key = other.key("t8d").part("sweep").build().expect("key");
    let dir = dlock_core::test_support::zookeeper_lock_path(&unlucky, &key);

    // The lock's node exists, so the create makes our node at once.
    let first = other.acquire(&key, AcquireOptions::new()).await.expect("free");
    proxy.drop_create_replies(1);
    proxy.drop_replies(&[GET_CHILDREN], 6, Hangup::Reset);
    let err = unlucky_locker
        .acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(5)))
        .await
        .expect_err("the lookups all fail");
    eprintln!("acquire after a lost create and lost lookups: {err}");
    assert_eq!(proxy.dropped_successful_creates(), 1, "the node was made and its reply lost");
    assert_eq!(proxy.dropped_replies_of(GET_CHILDREN), 6);
    first.release().await.expect("release");

    // Without the sweep, the orphan sorts first and this waits it out.
    let started = Instant::now();
    let g = other
        .acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(15)))
        .await
        .expect("the orphan is swept up and the lock granted");
    eprintln!("granted {:?} after the release", started.elapsed());
    g.release().await.expect("release");
    let raw = zk::Client::connect(&server.connect_string()).await.expect("plain client");
    let left = match raw.list_children(&dir).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("list {dir}: {e}"),
    };
    assert!(left.is_empty(), "nodes left: {left:?}");
    assert_eq!(
        dlock_core::test_support::zookeeper_session(&unlucky).id().0,
        session,
        "the session survived, so only the sweep removed the node"
    );
}
