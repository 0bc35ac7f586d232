//! A release that fails on an outage is retried in the background (issue
//! 16): with a long lease, the key is free soon after the server is back,
//! instead of staying held (409 for every request on it) until the lease
//! runs out. The server keeps its data (AOF, `appendfsync always`), so the
//! lock survives the restart and only the retried release can free it.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, LockKey, Locker, LockerOptions};
use dlock_testing::RedisServer;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(20);
/// How soon after the restart the key must be free again.
const FREED_WITHIN: Duration = Duration::from_secs(2);

fn persistent() -> RedisServer {
    RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
}

async fn locker(url: &str) -> Locker {
    let backend = RedisBackend::connect(url, "dlock").await.expect("connect");
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("options")
}

/// Polls `key` from another client until it is granted; returns how long it
/// took, or `None` when it was still held after `FREED_WITHIN`.
async fn freed_after(other: &Locker, key: &LockKey) -> Option<Duration> {
    let started = Instant::now();
    loop {
        match other.try_acquire(key).await {
            Ok(g) => {
                assert!(g.release().await.expect("release"));
                return Some(started.elapsed());
            }
            Err(e) if started.elapsed() < FREED_WITHIN => {
                assert!(e.is_contention() || e.is_unavailable(), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_hit_an_outage_frees_the_key_once_the_server_is_back() {
    let mut server = persistent();
    let url = server.url();
    let (a, b) = (locker(&url).await, locker(&url).await);
    let released = a.key("retry").part("released").build().expect("key");
    let dropped = a.key("retry").part("dropped").build().expect("key");
    let fixed = AcquireOptions::new().with_lease(LEASE);
    let g1 = a.acquire(&released, fixed.clone()).await.expect("take");
    let g2 = a.acquire(&dropped, fixed).await.expect("take");

    server.kill();
    let err = g1.release().await.expect_err("the server is down");
    assert!(err.is_unavailable(), "{err}");
    drop(g2); // its release in the background fails the same way
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.start_again();

    // The keys survived the restart (persistence on): only the retries free them.
    for key in [&released, &dropped] {
        let took = freed_after(&b, key).await;
        assert!(took.is_some(), "{key} still held {FREED_WITHIN:?} after the restart (lease {LEASE:?})");
        println!("{key} free {took:?} after the restart (lease {LEASE:?})");
    }
}

/// The retries stop when the lease ends: a server that stays away past the
/// lease leaves no retry behind that could release a later holder's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retries_stop_with_the_lease() {
    let mut server = persistent();
    let url = server.url();
    let a = locker(&url).await;
    let key = a.key("retry").part("short").build().expect("key");
    let g = a.acquire(&key, AcquireOptions::new().with_lease(Duration::from_millis(800))).await.expect("take");
    server.kill();
    g.release().await.expect_err("the server is down");
    tokio::time::sleep(Duration::from_millis(1_200)).await; // past the lease
    server.start_again();

    // The key expired with its lease; B takes it, and keeps it: no retried
    // release of A's arrives (it would be refused anyway, as not A's).
    let b = locker(&url).await;
    let held = b.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await.expect("free");
    let before = server.command_calls("evalsha");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(server.command_calls("evalsha"), before, "no release after the lease");
    assert!(held.release().await.expect("release"), "B still held it");
}

/// A release retried in the background keeps its owner's turn: an acquire
/// of the same key and owner made meanwhile waits for the retry to end,
/// instead of joining the hold on the server just before the retry deletes
/// it (which let another owner in while the new guard was never told it
/// lost the lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_does_not_free_a_later_hold_of_the_same_owner() {
    let mut server = persistent();
    let url = server.url();
    let (a, b) = (locker(&url).await, locker(&url).await);
    let owner = dlock_core::Owner::random().expect("owner");
    let key = a.key("retry").part("same-owner").build().expect("key");
    let mine = AcquireOptions::new().with_owner(owner).with_lease(LEASE);
    let first = a.acquire(&key, mine.clone()).await.expect("take");
    server.kill();
    assert!(first.release().await.expect_err("the server is down").is_unavailable());
    server.start_again();

    // A's connection heals from the restart too: an acquire may meet it
    // broken once.
    let mut again = None;
    for _ in 0..50 {
        match a.acquire(&key, mine.clone().with_wait(Duration::from_secs(5))).await {
            Ok(g) => {
                again = Some(g);
                break;
            }
            Err(e) if e.is_unavailable() => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("{e}"),
        }
    }
    let again = again.expect("the same owner again");
    // The retry has landed by now, before or after this grant: another
    // owner must still find the key held, for as long as the guard lives.
    let until = Instant::now() + Duration::from_millis(1_500);
    let mut refused = 0;
    while Instant::now() < until {
        match b.try_acquire(&key).await {
            Err(e) if e.is_contention() => refused += 1,
            // B's connection heals from the restart.
            Err(e) if e.is_unavailable() => {}
            Ok(_) => panic!("another owner was granted the key under a live guard (lost: {})", again.is_lost()),
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused >= 10, "only {refused} answers from the server to judge by");
    assert!(!again.is_lost());
    assert!(again.release().await.expect("release"), "still ours");
}
