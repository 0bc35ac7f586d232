//! The behavioural suite on a real ZooKeeper server, plus what only
//! ZooKeeper has: session expiry, FIFO waiters, container clean-up.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::zookeeper::{ConnectionState, ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, LockKey, Locker, LockerOptions, LostReason};
use dlock_testing::{FaultProxy, ZooKeeperEnsemble, ZooKeeperServer};
use tokio::time::Instant;
use zookeeper_client as zk;

const SESSION: Duration = Duration::from_secs(4);

struct ZooKeeper {
    server: ZooKeeperServer,
}

async fn backend(server: &ZooKeeperServer, session: Duration) -> ZooKeeperBackend {
    ZooKeeperBackend::connect_with(
        &server.connect_string(),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(session),
    )
    .await
    .expect("connect to the test ZooKeeper")
}

fn locker(backend: ZooKeeperBackend) -> Locker {
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options")
}

/// Sends dlock's and the ZooKeeper client's logs to the output of the
/// test that runs, which the harness prints only when that test fails: a
/// rare failure on a busy machine then comes with its own trace.
fn keep_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_ansi(false)
        .with_env_filter("dlock_core=debug,zookeeper_client=debug")
        .try_init();
}

async fn raw(server: &ZooKeeperServer) -> zk::Client {
    zk::Client::connect(&server.connect_string()).await.expect("raw ZooKeeper client")
}

/// Lock nodes under `/dlock`, by lock.
async fn lock_nodes(server: &ZooKeeperServer) -> Vec<(String, Vec<String>)> {
    let client = raw(server).await;
    let dirs = match client.list_children("/dlock").await {
        Ok(dirs) => dirs,
        Err(zk::Error::NoNode) => return Vec::new(),
        Err(e) => panic!("list /dlock: {e}"),
    };
    let mut out = Vec::new();
    for d in dirs {
        match client.list_children(&format!("/dlock/{d}")).await {
            Ok(children) => out.push((d, children)),
            Err(zk::Error::NoNode) => {}
            Err(e) => panic!("list /dlock/{d}: {e}"),
        }
    }
    out
}

impl suite::Harness for ZooKeeper {
    async fn client(&self) -> Locker {
        locker(backend(&self.server, SESSION).await)
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(backend(&self.server, SESSION).await)
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        let probe = backend(&self.server, SESSION).await;
        let dir = dlock_core::test_support::zookeeper_lock_path(&probe, key);
        let client = raw(&self.server).await;
        let children = client.list_children(&dir).await.expect("the lock exists");
        assert!(!children.is_empty(), "the key was held");
        for c in children {
            client.delete(&format!("{dir}/{c}"), None).await.expect("delete lock node");
        }
    }

    async fn lock_keys_left(&self) -> usize {
        lock_nodes(&self.server).await.iter().map(|(_, c)| c.len()).sum()
    }

    /// Lock nodes queued behind the holder's: a waiter's node exists once
    /// it has queued to watch its predecessor.
    async fn parked(&self, key: &LockKey) -> usize {
        let probe = backend(&self.server, SESSION).await;
        match raw(&self.server).await.list_children(&dlock_core::test_support::zookeeper_lock_path(&probe, key)).await {
            Ok(children) => children.len().saturating_sub(1),
            Err(zk::Error::NoNode) => 0,
            Err(e) => panic!("list {}: {e}", dlock_core::test_support::zookeeper_lock_path(&probe, key)),
        }
    }

    fn typical_acquire(&self) -> Duration {
        // A create and a list, each a round trip to a JVM.
        Duration::from_millis(8)
    }
}

async fn zookeeper() -> ZooKeeper {
    ZooKeeper { server: ZooKeeperServer::start() }
}

backend_suite!(zookeeper());
primitives_suite!(zookeeper());

/// One session watcher speaks for every guard of its session: guards of
/// many keys, a re-entry of one of them and a watcher holding only a
/// `LostSignal` all learn that the session may be over, each with the
/// session's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_guard_of_a_lost_session_learns_it() {
    keep_logs();
    let server = ZooKeeperServer::start();
    let proxy = FaultProxy::start(server.port());
    // A session of 1 s gives its first connect about that long: on a loaded
    // machine a JVM that just started may not answer in time (a CI run saw
    // three refused session requests), so connecting is retried a while.
    let started = std::time::Instant::now();
    let backend = loop {
        let options = ZooKeeperOptions::default().with_session_timeout(Duration::from_millis(1_000));
        match ZooKeeperBackend::connect_with(&format!("127.0.0.1:{}", proxy.port()), "dlock", options).await {
            Ok(backend) => break backend,
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                eprintln!("connect through the proxy: {e}; again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("connect through the proxy: {e}"),
        }
    };
    let holder = locker(backend);
    let owner = dlock_core::Owner::random().expect("owner");
    let fixed = || AcquireOptions::new().with_lease(Duration::from_secs(60)).with_owner(owner.clone());
    let mut guards = Vec::new();
    for i in 0..6 {
        let k = holder.key("many").part(i).build().expect("key");
        guards.push(holder.acquire(&k, fixed()).await.expect("free"));
    }
    // Re-entries join their hold: no task of their own, however many.
    let first = guards[0].key().clone();
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();
    for _ in 0..20 {
        guards.push(holder.acquire(&first, fixed()).await.expect("re-entry"));
    }
    let extra = metrics.num_alive_tasks().saturating_sub(tasks_before);
    assert!(extra < 5, "{extra} tasks for 20 guards of one hold");
    let signals: Vec<_> = guards.iter().map(|g| g.lost_signal()).collect();
    assert!(guards.iter().all(|g| !g.is_lost()), "connected: nothing lost");

    proxy.cut();
    for (g, signal) in guards.iter().zip(&signals) {
        let reason = tokio::time::timeout(Duration::from_secs(10), g.lost()).await.expect("lost fires");
        assert_eq!(reason, LostReason::SessionExpired, "{}", g.key());
        assert_eq!(signal.reason(), Some(LostReason::SessionExpired), "the detached signal agrees");
    }
    drop(guards);
}

/// A partition longer than the session timeout: the session expires, the
/// holder's lost signal fires, and another client takes the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_fires_lost_and_frees_the_lock() {
    let server = ZooKeeperServer::start();
    // The holder reaches the server through a proxy we can cut; the other
    // client connects directly.
    let proxy = FaultProxy::start(server.port());
    let holder_backend = ZooKeeperBackend::connect_with(
        &format!("127.0.0.1:{}", proxy.port()),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(Duration::from_millis(1_000)),
    )
    .await
    .expect("connect through the proxy");
    let mut state = holder_backend.connection_state();
    let holder = locker(holder_backend);
    let other = locker(backend(&server, SESSION).await);
    let k = holder.key("expiry").part(1).build().expect("key");
    let g = holder.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free");

    let waiter = {
        let (other, k) = (other.clone(), k.clone());
        tokio::spawn(async move { other.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(20))).await })
    };
    proxy.cut();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), state.wait_for(|s| *s != ConnectionState::Connected))
        .await
        .expect("the cut is noticed")
        .expect("state channel");
    let reason = tokio::time::timeout(Duration::from_secs(10), g.lost()).await.expect("lost fires");
    assert!(matches!(reason, LostReason::SessionExpired | LostReason::Stolen), "{reason:?}");
    eprintln!("lost after {:?}: {reason:?}", started.elapsed());
    tokio::time::timeout(Duration::from_secs(5), state.wait_for(|s| *s == ConnectionState::Lost))
        .await
        .expect("the session is reported lost")
        .expect("state channel");
    let g2 = waiter.await.expect("task").expect("the other client acquires");
    let second = g2.fencing_token();
    assert!(second > g.fencing_token());
    g2.release().await.expect("release");

    // Once the partition heals, the holder's backend opens a new session
    // and locks again: one long pause must not disable it for good.
    proxy.heal();
    tokio::time::timeout(Duration::from_secs(15), state.wait_for(|s| *s == ConnectionState::Connected))
        .await
        .expect("a new session after the partition heals")
        .expect("state channel");
    let g3 = holder
        .acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(10)))
        .await
        .expect("the holder locks again");
    assert!(g3.fencing_token() > second);
    assert!(g3.release().await.expect("release"));
    assert!(!g.release().await.expect("release of the lost guard"), "the old guard's lock is gone");
}

/// Waiters are served in arrival order, each watching only its predecessor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_order() {
    let server = ZooKeeperServer::start();
    let lockers: Vec<Locker> = {
        let mut v = Vec::new();
        for _ in 0..6 {
            v.push(locker(backend(&server, SESSION).await));
        }
        v
    };
    let k = lockers[0].key("fifo").part(1).build().expect("key");
    let first = lockers[0].try_acquire(&k).await.expect("free");
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, l) in lockers.iter().enumerate().skip(1) {
        let (l, k, order) = (l.clone(), k.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let g = l.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(30))).await.expect("acquire");
            order.lock().expect("order").push(i);
            tokio::time::sleep(Duration::from_millis(20)).await;
            g.release().await.expect("release");
        }));
        // Each one queues (creates its node) before the next starts.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    first.release().await.expect("release");
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(*order.lock().expect("order"), vec![1, 2, 3, 4, 5]);
}

/// One-off keys leave no nodes behind: our node is deleted on release and
/// the lock's (container) node with it when empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_locks_leave_no_nodes() {
    let server = ZooKeeperServer::start();
    let l = locker(backend(&server, SESSION).await);
    for i in 0..50 {
        let k = l.key("one-off").part(i).build().expect("key");
        l.try_acquire(&k).await.expect("free").release().await.expect("release");
    }
    assert!(lock_nodes(&server).await.is_empty(), "{:?}", lock_nodes(&server).await);
}

#[tokio::test]
async fn a_dead_server_is_a_clean_error() {
    let port = dlock_testing::free_port();
    let started = Instant::now();
    let err = ZooKeeperBackend::connect_with(
        &format!("127.0.0.1:{port}"),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(2)),
    )
    .await
    .expect_err("nobody listens");
    assert!(err.is_unavailable() || err.is_misconfigured(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(6), "{:?}", started.elapsed());
}

/// Every lock node under `/dlock`, ignoring empty lock directories (the
/// server reaps those on its own schedule).
async fn live_lock_nodes(server: &ZooKeeperServer) -> Vec<(String, Vec<String>)> {
    lock_nodes(server).await.into_iter().filter(|(_, children)| !children.is_empty()).collect()
}

/// With the server cut off, zookeeper-client holds a request until it
/// learns the session's fate (4/3 of the session timeout). An acquire
/// answers within its wait plus the response timeout (2/3 of the session
/// by default), a release within the response timeout, each with an
/// `unavailable` error; once the server is back, the session's locks are
/// gone with it, and a waiting acquire waits for the new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_server_answers_within_the_wait_plus_the_response_timeout() {
    let server = ZooKeeperServer::start();
    let proxy = FaultProxy::start(server.port());
    let session = Duration::from_secs(4);
    let response = session * 2 / 3;
    let slack = Duration::from_millis(1500);
    let b = ZooKeeperBackend::connect_with(
        &format!("127.0.0.1:{}", proxy.port()),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(session),
    )
    .await
    .expect("connect");
    let l = locker(b);
    let held_key = l.key("cut").part("held").build().expect("key");
    let key = l.key("cut").part("free").build().expect("key");
    let held = l.acquire(&held_key, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free");
    proxy.cut();

    let t = Instant::now();
    let err = l.acquire(&key, AcquireOptions::new().with_wait(Duration::ZERO)).await.expect_err("no server");
    assert!(err.is_unavailable(), "{err}");
    assert!(
        t.elapsed() <= response + slack,
        "a try-once acquire took {:?} (response timeout {response:?})",
        t.elapsed()
    );

    let t = Instant::now();
    let err = held.release().await.expect_err("no server");
    assert!(err.is_unavailable(), "{err}");
    assert!(t.elapsed() <= response + slack, "a release took {:?} (response timeout {response:?})", t.elapsed());

    let wait = Duration::from_secs(1);
    let t = Instant::now();
    let err = l.acquire(&key, AcquireOptions::new().with_wait(wait)).await.expect_err("no server");
    assert!(err.is_unavailable(), "{err}");
    assert!(
        t.elapsed() <= wait + response + slack,
        "a 1 s acquire took {:?} (response timeout {response:?})",
        t.elapsed()
    );

    // Past the session timeout: the session is gone, and its nodes with it.
    tokio::time::sleep(session).await;
    proxy.heal();
    // A waiting acquire waits for the backend's new session.
    let g = l
        .acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(20)))
        .await
        .expect("a new session within the wait");
    assert!(g.release().await.expect("release"));
    let other = locker(backend(&server, SESSION).await);
    let g = other
        .acquire(&held_key, AcquireOptions::new().with_wait(Duration::from_secs(10)))
        .await
        .expect("the old hold went with its session");
    assert!(g.release().await.expect("release"));
    assert!(live_lock_nodes(&server).await.is_empty(), "{:?}", live_lock_nodes(&server).await);
}

/// An acquire cut short by the response timeout while the session lives
/// on: its create still reaches the server, and the node it makes would
/// sort ahead of every later contender for as long as the session lives.
/// The background sweep deletes it, so the key is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_cut_short_leaves_no_node_behind() {
    let server = ZooKeeperServer::start();
    let proxy = FaultProxy::start(server.port());
    let response = Duration::from_millis(500);
    let options =
        ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(20)).with_response_timeout(response);
    let b = ZooKeeperBackend::connect_with(&format!("127.0.0.1:{}", proxy.port()), "dlock", options)
        .await
        .expect("connect");
    let l = locker(b);
    let key = l.key("cut-short").part(1).build().expect("key");
    // Held by another process, so the lock's directory exists and the
    // cut-short attempt's create makes a node (behind this one).
    let other = locker(backend(&server, SESSION).await);
    let held = other.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free");
    // Every reply reaches us 3 s late: the create makes its node at once,
    // and the attempt gives up while it waits to hear so.
    let late = Duration::from_secs(3);
    proxy.set_delay(late);
    let t = Instant::now();
    let err = l.acquire(&key, AcquireOptions::new().with_wait(Duration::ZERO)).await.expect_err("no answer in time");
    assert!(err.is_unavailable(), "{err}");
    assert!(t.elapsed() <= response + Duration::from_millis(1500), "took {:?}", t.elapsed());
    proxy.set_delay(Duration::ZERO);
    // Replies already held back still come late, in order.
    tokio::time::sleep(late).await;
    assert!(held.release().await.expect("release"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !live_lock_nodes(&server).await.is_empty() {
        assert!(Instant::now() < deadline, "the cut-short attempt left {:?}", live_lock_nodes(&server).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let g = other.try_acquire(&key).await.expect("nothing sorts ahead of a new contender");
    assert!(g.release().await.expect("release"));
}

/// A server restart shorter than the session timeout suspends the session
/// (reported as such) without losing the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_suspends_without_losing_the_lock() {
    let mut server = ZooKeeperServer::start();
    let b = backend(&server, Duration::from_secs(15)).await;
    let mut state = b.connection_state();
    let l = locker(b);
    let k = l.key("suspend").part(1).build().expect("key");
    let g = l.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(120))).await.expect("free");
    server.kill();
    tokio::time::timeout(Duration::from_secs(10), state.wait_for(|s| *s == ConnectionState::Suspended))
        .await
        .expect("reported suspended")
        .expect("state channel");
    assert!(!g.is_lost(), "suspended is not lost");
    server.restart();
    tokio::time::timeout(Duration::from_secs(15), state.wait_for(|s| *s == ConnectionState::Connected))
        .await
        .expect("reconnected within the session")
        .expect("state channel");
    assert!(!g.is_lost());
    assert!(g.release().await.expect("release"), "the lock survived the outage");
}

/// T8b, long arm: the server is down longer than the session timeout (and
/// comes back with its data). The holder must count its session as lost
/// (like Curator's LOST) before anyone else can be granted the lock, and the
/// next holder's token is higher: no double grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_session_loses_the_lock_before_anyone_else_gets_it() {
    let mut server = ZooKeeperServer::start();
    let session = Duration::from_secs(3);
    let a = locker(backend(&server, session).await);
    let k = a.key("long-outage").part(1).build().expect("key");
    let held = a.acquire(&k, AcquireOptions::new()).await.expect("free");
    server.kill();
    tokio::time::sleep(session + Duration::from_millis(1500)).await;
    // A session timeout of silence: A must know from its own clock, before
    // the server is back and long before anyone else can be granted it.
    assert!(held.is_lost(), "A did not know its session may be over after a session timeout of silence");
    server.restart();
    let lost =
        tokio::time::timeout(Duration::from_secs(15), held.lost()).await.expect("lost fired after the long outage");
    assert!(matches!(lost, LostReason::SessionExpired | LostReason::RenewalFailed | LostReason::Stolen), "{lost:?}");
    let b = locker(backend(&server, SESSION).await);
    let next = b
        .acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(20)))
        .await
        .expect("free once A's session is gone");
    assert!(next.fencing_token() > held.fencing_token());
    assert!(next.release().await.expect("release"));
    assert!(!held.release().await.unwrap_or(false), "A no longer holds it");
}

/// The same recipe on a 3-server ensemble: a minority down does not stop
/// locking, and a holder partitioned from every server loses its session
/// (lost fires) while the next waiter gets the lock with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_server_ensemble_survives_a_member_and_expires_a_partitioned_holder() {
    keep_logs();
    let mut ensemble = ZooKeeperEnsemble::start(3);
    let proxies: Vec<FaultProxy> = (0..3).map(|i| FaultProxy::start(ensemble.port(i))).collect();
    let via: Vec<String> = proxies.iter().map(|p| format!("127.0.0.1:{}", p.port())).collect();
    let holder = locker(
        ZooKeeperBackend::connect_with(
            &via.join(","),
            "dlock",
            ZooKeeperOptions::default().with_session_timeout(Duration::from_millis(1_500)),
        )
        .await
        .expect("connect through the proxies"),
    );
    let other = locker(
        ZooKeeperBackend::connect_with(
            &ensemble.connect_string(),
            "dlock",
            ZooKeeperOptions::default().with_session_timeout(SESSION),
        )
        .await
        .expect("connect directly"),
    );
    let k = holder.key("ensemble").part(1).build().expect("key");
    let wait = AcquireOptions::new().with_wait(Duration::from_secs(10));

    ensemble.kill(2);
    // Clients that were on the dead member move to another one; give them
    // that long, then every round must succeed.
    let moved = Instant::now() + Duration::from_secs(20);
    loop {
        let round = async {
            holder.acquire(&k, wait.clone()).await?.release().await?;
            other.acquire(&k, wait.clone()).await?.release().await
        };
        match round.await {
            Ok(_) => break,
            Err(e) if e.is_unavailable() && Instant::now() < moved => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("a 2-of-3 ensemble must keep serving: {e}"),
        }
    }
    for _ in 0..5 {
        assert!(holder.acquire(&k, wait.clone()).await.expect("holder").release().await.expect("release"));
        assert!(other.acquire(&k, wait.clone()).await.expect("other").release().await.expect("release"));
    }

    let g = holder.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free");
    let waiter = {
        let (other, k) = (other.clone(), k.clone());
        tokio::spawn(async move { other.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(30))).await })
    };
    for p in &proxies {
        p.cut();
    }
    let reason = tokio::time::timeout(Duration::from_secs(15), g.lost()).await.expect("lost fires");
    assert!(matches!(reason, LostReason::SessionExpired | LostReason::Stolen), "{reason:?}");
    let g2 = waiter.await.expect("task").expect("the other client acquires once the session expires");
    assert!(g2.fencing_token() > g.fencing_token());
    assert!(g2.release().await.expect("release"));
}
