//! The Redis server's memory follows the locks held now, not the keys ever
//! locked: released locks leave nothing of their own behind, and fencing
//! tokens still grow per key when the shared high-water mark is gone.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::test_support::prefix_fence_key;
use dlock_core::{AcquireOptions, Locker, LockerOptions};
use dlock_testing::RedisServer;

async fn locker_for(url: &str) -> Locker {
    let backend = RedisBackend::connect(url, "dlock").await.expect("connect to the test redis-server");
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options")
}

fn keys(server: &RedisServer) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut server.connection()).expect("KEYS");
    keys.sort();
    keys
}

/// 2,000 one-off locks (a key per request, as idempotency tokens make them)
/// leave one key in all: the prefix's high-water mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_off_locks_leave_only_the_high_water_mark() {
    let server = RedisServer::start();
    let locker = locker_for(&server.url()).await;
    let before = keys(&server);
    for i in 0..2_000u32 {
        let k = locker.key("order").part(i).build().expect("key");
        let g = locker.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free");
        assert!(g.release().await.expect("release"));
    }
    let mut expected = before.clone();
    expected.push(prefix_fence_key("dlock"));
    expected.sort();
    let left = keys(&server);
    assert!(
        left == expected,
        "{} keys left by 2,000 released one-off locks (expected {expected:?}), the first: {:?}",
        left.len(),
        &left[..left.len().min(5)]
    );
}

/// Many cycles of one key, faster than the server clock may tick: every
/// token is above the one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_strictly_over_quick_cycles() {
    let server = RedisServer::start();
    let locker = locker_for(&server.url()).await;
    let k = locker.key("quick").part(1).build().expect("key");
    let mut last = 0;
    for _ in 0..500 {
        let g = locker.try_acquire(&k).await.expect("free");
        assert!(g.fencing_token() > last, "{} after {last}", g.fencing_token());
        last = g.fencing_token();
        g.release().await.expect("release");
    }
}

/// A key's next token is above its last when everything the server knew
/// about fencing is gone: the lock was released (its hash, which carried
/// the token, deleted), and then the high-water mark was deleted too, or
/// the whole data set flushed (a restart without persistence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_after_the_counter_state_is_gone() {
    let server = RedisServer::start();
    let locker = locker_for(&server.url()).await;
    let k = locker.key("gone").part(1).build().expect("key");
    let mut last = 0;
    for wipe in ["DEL", "FLUSHALL", "DEL", "FLUSHALL"] {
        let g = locker.try_acquire(&k).await.expect("free");
        assert!(g.fencing_token() > last, "{} after {last} ({wipe})", g.fencing_token());
        last = g.fencing_token();
        g.release().await.expect("release");
        let mut conn = server.connection();
        let mark: Option<String> = redis::cmd("GET").arg(prefix_fence_key("dlock")).query(&mut conn).expect("GET");
        assert_eq!(mark, Some(last.to_string()), "the mark holds the last token");
        match wipe {
            "DEL" => {
                let _: u64 = redis::cmd("DEL").arg(prefix_fence_key("dlock")).query(&mut conn).expect("DEL");
            }
            _ => {
                let _: () = redis::cmd("FLUSHALL").query(&mut conn).expect("FLUSHALL");
            }
        }
        assert!(keys(&server).is_empty(), "no fencing state is left");
    }
    let g = locker.try_acquire(&k).await.expect("free");
    assert!(g.fencing_token() > last, "{} after {last}", g.fencing_token());
    g.release().await.expect("release");
}
