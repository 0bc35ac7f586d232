//! Recovery after a Redis outage (issue 16): while the server is away,
//! requests fail at once with a backend error; once it answers again, the
//! first request succeeds — the connection was re-established in the
//! background, not by a request that failed on the dead one.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, RedisStore};
use dlock_core::{Error, Locker, LockerOptions};
use dlock_testing::RedisServer;
use tokio::time::Instant;

/// How long after the restart the first request is sent.
const SETTLE: Duration = Duration::from_secs(1);

fn locker(backend: RedisBackend) -> Locker {
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("options")
}

/// A request during the outage: an error, and a prompt one.
fn assert_prompt_backend_error<T: std::fmt::Debug>(result: Result<T, Error>, took: Duration) {
    let err = result.expect_err("the server is down");
    assert!(matches!(err, Error::Backend { .. }), "a backend error (503), got {err:?}");
    assert!(took < Duration::from_millis(1_500), "failed after {took:?}, not promptly");
}

/// Stops the server for a while with no request meanwhile (an idle
/// instance), starts it again on the same port and lets it settle.
async fn outage(server: &mut RedisServer) {
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.start_again();
    tokio::time::sleep(SETTLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_acquire_after_a_restart_succeeds() {
    let mut server = RedisServer::start();
    let locker = locker(RedisBackend::connect(&server.url(), "dlock").await.expect("connect"));
    let key = locker.key("recovery").part(1).build().expect("key");
    locker.try_acquire(&key).await.expect("before the outage").release().await.expect("release");

    outage(&mut server).await;
    let guard = locker.try_acquire(&key).await.expect("the first acquire after the server is back");
    assert!(guard.release().await.expect("release"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_idempotency_begin_after_a_restart_succeeds() {
    let mut server = RedisServer::start();
    // Its own connection, and one shared with a lock backend
    // (`Config::build` does the latter).
    let own = RedisStore::connect(&server.url(), "dlock").await.expect("connect");
    let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect");
    let shared = RedisStore::from_backend(&backend);
    let stores = [&own, &shared];
    for (n, store) in stores.into_iter().enumerate() {
        let begun = store.begin("s", &format!("before-{n}"), "fp", ClaimTerms::new(Duration::from_secs(5))).await;
        assert!(matches!(begun, Ok(Begin::New(_))), "{begun:?}");
    }

    outage(&mut server).await;
    for (n, store) in stores.into_iter().enumerate() {
        let begun = store.begin("s", &format!("after-{n}"), "fp", ClaimTerms::new(Duration::from_secs(5))).await;
        assert!(matches!(begun, Ok(Begin::New(_))), "store {n}: the first begin after the restart: {begun:?}");
    }
}

/// While the server is away, every request fails at once with a backend
/// error (503), and the service recovers all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_during_an_outage_fail_promptly() {
    let mut server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect");
    let store = RedisStore::from_backend(&backend);
    let locker = locker(backend);
    let key = locker.key("recovery").part(2).build().expect("key");
    locker.try_acquire(&key).await.expect("before the outage").release().await.expect("release");

    server.kill();
    let mut slowest = Duration::ZERO;
    for _ in 0..3 {
        let started = Instant::now();
        assert_prompt_backend_error(locker.try_acquire(&key).await, started.elapsed());
        slowest = slowest.max(started.elapsed());
        let started = Instant::now();
        assert_prompt_backend_error(
            store.begin("s", "during", "fp", ClaimTerms::new(Duration::from_secs(5))).await,
            started.elapsed(),
        );
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    server.start_again();
    // `start_again` returns once the server answers PING: from then on, how
    // long until a request goes through.
    let back = Instant::now();
    loop {
        match locker.try_acquire(&key).await {
            Ok(g) => {
                assert!(g.release().await.expect("release"));
                break;
            }
            Err(e) => {
                assert!(back.elapsed() < SETTLE, "still failing {:?} after the server is back: {e}", back.elapsed());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    println!(
        "slowest refusal during the outage: {slowest:?}; first success {:?} after the server is back",
        back.elapsed()
    );
}

/// A Redis Cluster master restarts (keeping its cluster config, as a
/// restarted node does): the first acquire on its slots after it is back
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_acquire_after_a_cluster_master_restarts_succeeds() {
    let mut cluster = dlock_testing::RedisCluster::start(3);
    let locker = locker(RedisBackend::connect(&cluster.url(), "dlock").await.expect("connect"));
    let key = locker.key("recovery").part("cluster").build().expect("key");
    locker.try_acquire(&key).await.expect("before the outage").release().await.expect("release");
    let node = cluster.node_for(key.as_str());
    outage(&mut cluster.nodes[node]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !redis::cmd("CLUSTER")
        .arg("INFO")
        .query::<String>(&mut cluster.nodes[node].connection())
        .unwrap_or_default()
        .contains("cluster_state:ok")
    {
        assert!(Instant::now() < deadline, "the cluster did not heal");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let guard = locker.try_acquire(&key).await.expect("the first acquire after the master is back");
    assert!(guard.release().await.expect("release"));
}
