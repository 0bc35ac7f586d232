//! The behavioural suite on a real redis-server, plus what only Redis has:
//! commands sent while waiting, a dead server, ACL permissions.

mod suite;

mod tokens;
use tokens::Consume;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::{Backend, LockMode};
use dlock_core::{AcquireOptions, ForceUnlock, Listing, LockKey, Locker, LockerOptions, LostReason};
use dlock_testing::{FaultProxy, RedisServer};
use tokio::time::Instant;

struct Redis {
    server: RedisServer,
}

async fn locker_for(url: &str, lease_ms: u64) -> Locker {
    let backend = RedisBackend::connect(url, "dlock").await.expect("connect to the test redis-server");
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(lease_ms));
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options")
}

impl suite::Harness for Redis {
    async fn client(&self) -> Locker {
        locker_for(&self.server.url(), 300).await
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(RedisBackend::connect(&self.server.url(), "dlock").await.expect("connect to the test redis-server"))
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        let deleted: u64 = redis::cmd("DEL").arg(key.as_str()).query(&mut self.server.connection()).expect("DEL");
        assert_eq!(deleted, 1, "the key was held");
    }

    async fn lock_keys_left(&self) -> usize {
        let keys: Vec<String> = redis::cmd("KEYS").arg("dlock:*").query(&mut self.server.connection()).expect("KEYS");
        // Fencing counters (`…:fence`) outlive locks on purpose.
        keys.iter().filter(|k| k.ends_with('}')).count()
    }

    async fn parked(&self, key: &LockKey) -> usize {
        subscribers(&self.server, key)
    }
}

/// Subscribers of `key`'s release channel on `server` (`PUBSUB NUMSUB`):
/// a waiter subscribes only once it found the key held and parks.
fn subscribers(server: &RedisServer, key: &LockKey) -> usize {
    let counts: Vec<(String, usize)> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(format!("{}:released", key.as_str()))
        .query(&mut server.connection())
        .expect("PUBSUB NUMSUB");
    counts.iter().map(|(_, n)| n).sum()
}

async fn redis() -> Redis {
    Redis { server: RedisServer::start() }
}

backend_suite!(redis());
primitives_suite!(redis());
mod withdrawal {
    use super::*;
    primitives_suite!(@tests redis(); a_writer_that_hangs_up_lets_readers_in);
}

/// A release publishes only when an acquire found the lock held and waits:
/// uncontended cycles cost the server no PUBLISH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_announce_themselves_only_when_someone_waits() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let k = a.key("announce").part(1).build().expect("key");
    server.reset_stats();
    for _ in 0..20 {
        let wait = AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(1));
        a.acquire(&k, wait).await.expect("free").release().await.expect("release");
    }
    let publishes = |server: &RedisServer| server.command_stats().get("publish").copied().unwrap_or(0);
    assert_eq!(publishes(&server), 0, "uncontended releases published");

    let g = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let g = b
            .acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(10)))
            .await;
        let waited = started.elapsed();
        let released = match g {
            Ok(g) => g.release().await.expect("release"),
            Err(e) => panic!("the waiter did not get the lock: {e}"),
        };
        (released, waited)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(g.release().await.expect("release"));
    let (released, waited) = waiter.await.expect("waiter");
    assert!(released);
    assert!(waited < Duration::from_secs(5), "woken by the release, not the lease: {waited:?}");
    // The holder's release, and the waiter's own: a grant won by waiting is
    // announced too, since other waiters of its process may be parked behind.
    assert_eq!(publishes(&server), 2, "awaited releases publish");
}

/// T7b: the shared subscriber connection is killed (`CLIENT KILL TYPE
/// pubsub`) while 16 tasks wait; the holder releases right after the kill
/// (the announcement is likely lost) or once the subscriber is back. Every
/// waiter still gets the lock in turn, long before any lease (30 s) or wait
/// (20 s) runs out: a reconnect wakes the waiters to try again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_survive_a_killed_subscriber_connection() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    for (round, pause_after_kill) in [Duration::ZERO, Duration::from_millis(500)].into_iter().enumerate() {
        let k = a.key("pubsub-kill").part(round).build().expect("key");
        let holder = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
        let mut waiters = Vec::new();
        for _ in 0..16 {
            let (b, k) = (b.clone(), k.clone());
            waiters.push(tokio::spawn(async move {
                let started = Instant::now();
                let opts = AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(20));
                let g = b.acquire(&k, opts).await.expect("a waiter got the lock within its wait");
                let waited = started.elapsed();
                tokio::time::sleep(Duration::from_millis(1)).await;
                assert!(g.release().await.expect("release"));
                waited
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let killed: u64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query(&mut server.connection())
            .expect("CLIENT KILL");
        // The waiters' subscriber (the holder's has no channel, so it is not
        // in pub/sub mode).
        assert_eq!(killed, 1, "the subscriber connection was killed");
        tokio::time::sleep(pause_after_kill).await;
        let released_at = Instant::now();
        assert!(holder.release().await.expect("release"));
        let mut longest = Duration::ZERO;
        for w in waiters {
            longest = longest.max(w.await.expect("waiter"));
        }
        // 16 short holds in turn; a missed wake-up would wait out 20 s.
        assert!(released_at.elapsed() < Duration::from_secs(10), "round {round}: took {:?}", released_at.elapsed());
        assert!(longest < Duration::from_secs(12), "round {round}: a waiter waited {longest:?}");
    }
}

/// While it waits, a waiter costs the server a bounded handful of commands
/// however long the wait is: no polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_sends_a_bounded_number_of_commands() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let k = a.key("quiet").part(1).build().expect("key");
    let g = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
    server.reset_stats();
    let err = b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_millis(1_500))).await.expect_err("held");
    assert!(err.is_contention(), "{err}");
    let stats = server.command_stats();
    // commandstats also counts the commands our scripts run inside EVALSHA;
    // what crosses the network is the scripts and the (un)subscriptions.
    let sent = ["evalsha", "eval", "script|load", "subscribe", "unsubscribe"];
    let total: u64 = stats.iter().filter(|(c, _)| sent.contains(&c.as_str())).map(|(_, n)| n).sum();
    eprintln!("commands while waiting 1.5 s: {stats:?}");
    // try, subscribe, try again, unsubscribe
    assert!(total <= 4, "{total} commands in 1.5 s of waiting: {stats:?}");
    g.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_server_fires_lost_and_errors_cleanly() {
    let mut server = RedisServer::start();
    let a = locker_for(&server.url(), 600).await;
    let k = a.key("killed").part(1).build().expect("key");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free");
    let fixed = a
        .acquire(
            &a.key("killed").part(2).build().expect("key"),
            AcquireOptions::new().with_lease(Duration::from_secs(60)),
        )
        .await
        .expect("free");
    server.kill();
    let started = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(5), g.lost()).await.expect("lost fires");
    assert_eq!(reason, LostReason::RenewalFailed);
    assert!(
        started.elapsed() <= Duration::from_millis(1_500),
        "fired by the end of the 600 ms lease: {:?}",
        started.elapsed()
    );

    // A new acquire fails with a backend error in bounded time, no hang.
    let started = Instant::now();
    let err = a.try_acquire(&k).await.expect_err("server is down");
    assert!(err.is_unavailable(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());

    // Dropping a guard with no server neither blocks nor panics.
    drop(fixed);
    let err = g.release().await.expect_err("server is down");
    assert!(err.is_unavailable());
    tokio::time::sleep(Duration::from_millis(200)).await;

    // And it recovers when the server is back.
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match a.try_acquire(&k).await {
            Ok(g) => {
                g.release().await.expect("release");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "no recovery: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_pubsub_permission_is_told_so() {
    let server = RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "locker", "on", ">pw", "~*", "+@all", "resetchannels"])
        .query(&mut server.connection())
        .expect("ACL SETUSER");
    let url = format!("redis://locker:pw@127.0.0.1:{}", server.port());
    let err = RedisBackend::connect(&url, "dlock").await.expect_err("no channel permission");
    assert!(err.is_misconfigured(), "{err}");
    let text = err.to_string();
    assert!(text.contains("subscribe") && text.contains("&"), "{text}");
    assert!(!text.contains("pw@"), "password leaked: {text}");

    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "locker", "&dlock:*"]).query(&mut server.connection()).expect("ACL SETUSER");
    RedisBackend::connect(&url, "dlock").await.expect("allowed now");
}

#[tokio::test]
async fn a_bad_url_or_a_dead_port_is_a_clean_error() {
    let err = RedisBackend::connect("http://nope", "dlock").await.expect_err("bad url");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("DLOCK_REDIS_URL"));

    let port = dlock_testing::free_port();
    let started = Instant::now();
    let err = RedisBackend::connect(&format!("redis://127.0.0.1:{port}"), "dlock").await.expect_err("nobody listens");
    assert!(err.is_unavailable(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Every grant's fencing token is above the last, even after the
/// high-water mark is lost (a restart without persistence, an eviction, a
/// DEL): tokens are taken from the server clock when there is no mark. The
/// mark a single server uses is the prefix's (`prefix_fence_key`), not a
/// Cluster slot's (`fence_key`, which a single server never writes): the
/// DEL must remove a key, or the test proves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_survives_a_lost_counter() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let k = a.key("fence-lost").part(1).build().expect("key");
    let g = a.try_acquire(&k).await.expect("free");
    let first = g.fencing_token();
    g.release().await.expect("release");
    let mark = dlock_core::test_support::prefix_fence_key("dlock");
    let deleted: u64 = redis::cmd("DEL").arg(&mark).query(&mut server.connection()).expect("DEL");
    assert_eq!(deleted, 1, "the mark {mark} was there, and is gone");
    let g = a.try_acquire(&k).await.expect("free");
    assert!(g.fencing_token() > first, "{} after {first}", g.fencing_token());
    g.release().await.expect("release");
}

/// A Redis Cluster of 3 masters: locks whose keys fall in different slots
/// all work, each lock's keys stay in one slot, and a master that is down
/// fails the locks of its slots cleanly while the others keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_spreads_locks_and_survives_a_dead_master() {
    let mut cluster = dlock_testing::RedisCluster::start(3);
    let url = cluster.url();
    let (a, b) = (locker_for(&url, 300).await, locker_for(&url, 300).await);
    let keys: Vec<LockKey> = (0..60).map(|i| a.key("cluster").part(i).build().expect("key")).collect();
    let mut per_node = [0usize; 3];
    for k in &keys {
        per_node[cluster.node_for(k.as_str())] += 1;
        assert_eq!(cluster.node_for(k.as_str()), cluster.node_for(&dlock_core::test_support::fence_key(k)));
        let g = a.try_acquire(k).await.expect("free");
        assert!(b.try_acquire(k).await.expect_err("held").is_contention());
        let f = g.fencing_token();
        assert!(g.release().await.expect("release"));
        let g = b.try_acquire(k).await.expect("free again");
        assert!(g.fencing_token() > f);
        g.release().await.expect("release");
    }
    assert!(per_node.iter().all(|n| *n > 0), "keys spread over every master: {per_node:?}");

    // Wake-ups cross nodes: the waiters' subscription is on the first seed.
    let k = keys.iter().find(|k| cluster.node_for(k.as_str()) != 0).expect("a key off the first node");
    let g = a.acquire(k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
    let waiter = {
        let (b, k) = (b.clone(), k.clone());
        tokio::spawn(async move { b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(10))).await })
    };
    // Parked: subscribed (on some node) to the key's release.
    let parked_by = Instant::now() + Duration::from_secs(10);
    while cluster.nodes.iter().map(|n| subscribers(n, k)).sum::<usize>() == 0 {
        assert!(Instant::now() < parked_by, "the waiter never subscribed to the release");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let released = Instant::now();
    g.release().await.expect("release");
    waiter.await.expect("task").expect("woken by the release").release().await.expect("release");
    assert!(released.elapsed() < Duration::from_secs(2), "woken late: {:?}", released.elapsed());

    // An operator lists the held keys of every master, page by page (SCAN
    // on each master in turn), and sees and frees a lock on any of them.
    let mut held = Vec::new();
    for k in &keys[..20] {
        held.push(a.acquire(k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free"));
    }
    let (mut seen, mut listing, mut pages) = (HashSet::new(), Listing::name("cluster").limit(7), 0);
    loop {
        let page = b.list(listing.clone()).await.expect("list");
        pages += 1;
        assert!(pages < 100, "the listing never ended");
        seen.extend(page.keys);
        match page.next {
            Some(next) => listing = listing.after(next),
            None => break,
        }
    }
    assert_eq!(seen, keys[..20].iter().cloned().collect::<HashSet<_>>(), "in {pages} pages");
    let (i, k) = keys[..20].iter().enumerate().find(|(_, k)| cluster.node_for(k.as_str()) == 2).expect("on master 2");
    let state = b.inspect(k).await.expect("inspect");
    assert_eq!(state.holders.iter().map(|h| h.fencing_token).collect::<Vec<_>>(), vec![held[i].fencing_token()]);
    assert_eq!(b.force_unlock(k, ForceUnlock::all("test: on master 2")).await.expect("forced").len(), 1);
    let next = b.try_acquire(k).await.expect("freed");
    assert!(next.fencing_token() > held[i].fencing_token());
    next.release().await.expect("release");
    for g in held {
        let _ = g.release().await;
    }

    cluster.nodes[2].kill();
    let mut failed = 0;
    for k in &keys {
        let started = Instant::now();
        match a.try_acquire(k).await {
            Ok(g) => {
                assert_ne!(cluster.node_for(k.as_str()), 2);
                g.release().await.expect("release");
            }
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                failed += 1;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }
    assert_eq!(failed, per_node[2], "exactly the dead master's locks fail");
}

/// A Redis that may evict keys with a TTL (every lock is one) is named at
/// start-up; `noeviction` is not.
#[tokio::test]
async fn an_evicting_maxmemory_policy_is_warned_about() {
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("capture").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn logs_of_connect(server: &RedisServer) -> String {
        let capture = Capture::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        let _guard = dlock_testing::set_scoped(subscriber);
        RedisBackend::connect(&server.url(), "dlock").await.expect("connect");
        let bytes = capture.0.lock().expect("capture").clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    let evicting = RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru"]);
    let logs = logs_of_connect(&evicting).await;
    assert!(logs.contains("maxmemory-policy") && logs.contains("volatile-lru"), "{logs}");

    let safe = RedisServer::start();
    let logs = logs_of_connect(&safe).await;
    assert!(!logs.contains("maxmemory-policy"), "{logs}");
}

/// Through Sentinel: locks work on the master it names, and after the
/// master dies and the replica is promoted, dlock follows to the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_follows_a_failover() {
    let mut sentinel = dlock_testing::RedisSentinel::start();
    let a = locker_for(&sentinel.url(), 300).await;
    let k = a.key("sentinel").part(1).build().expect("key");
    let g = a.try_acquire(&k).await.expect("free");
    let first = g.fencing_token();
    assert!(g.release().await.expect("release"));

    let old = sentinel.master.port();
    sentinel.master.kill();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sentinel.master_port() == Some(old) {
        assert!(Instant::now() < deadline, "no failover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sentinel.master_port(), Some(sentinel.replica.port()));
    let deadline = Instant::now() + Duration::from_secs(20);
    let g = loop {
        match a.try_acquire(&k).await {
            Ok(g) => break g,
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                assert!(Instant::now() < deadline, "dlock did not follow the failover: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(g.fencing_token() > first, "tokens still grow on the new master (server time)");
    assert!(g.release().await.expect("release"));
}

/// Writes `megabytes` of 1 KiB filler keys with a TTL, as another tenant of
/// the server would; returns whether the server refused one as out of memory.
fn fill_with_ttl_keys(server: &RedisServer, megabytes: usize) -> bool {
    let mut conn = server.connection();
    let value = "x".repeat(1024);
    for batch in 0..megabytes {
        let mut pipe = redis::pipe();
        for i in 0..1024 {
            pipe.cmd("SET").arg(format!("filler:{batch}:{i}")).arg(&value).arg("EX").arg(600).ignore();
        }
        if let Err(e) = pipe.query::<()>(&mut conn) {
            assert!(e.to_string().contains("OOM"), "{e}");
            return true;
        }
    }
    false
}

/// T11d: locks are keys with a TTL, exactly what `volatile-*` policies
/// evict. The negative control shows held locks evicted and taken by others
/// (dlock warns about such a policy at start-up). Under `noeviction` a full
/// server keeps every held lock, refuses new ones with an error that says
/// why, and still lets holders release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_evicts_locks_only_under_an_evicting_policy() {
    for policy in ["volatile-lru", "noeviction"] {
        let server = RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", policy]);
        let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
        let keys: Vec<_> = (0..50).map(|i| a.key("full").part(i).build().expect("key")).collect();
        let mut guards = Vec::new();
        for k in &keys {
            guards.push(a.acquire(k, AcquireOptions::new().with_lease(Duration::from_secs(60))).await.expect("free"));
        }
        let refused = fill_with_ttl_keys(&server, 12);
        let mut stolen = 0;
        for k in &keys {
            if let Ok(g) = b.try_acquire(k).await {
                stolen += 1;
                drop(g);
            }
        }
        if policy == "volatile-lru" {
            assert!(stolen > 0, "volatile-lru evicted no held lock: the control shows nothing");
            continue;
        }
        assert!(refused, "noeviction: the filler should hit maxmemory");
        // Right at the limit a small script may still fit; be clearly over it.
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("1mb")
            .query(&mut server.connection())
            .expect("CONFIG");
        assert_eq!(stolen, 0, "noeviction: a held lock was taken by someone else");
        let fresh = a.key("full").part("new").build().expect("key");
        let err = b.try_acquire(&fresh).await.expect_err("no room for a new lock");
        assert!(err.is_unavailable(), "{err}");
        assert!(err.to_string().contains("out of memory"), "{err}");
        for g in guards {
            assert!(g.release().await.expect("a full server still lets holders release"));
        }
    }
}

/// T11b: a wrong password is a configuration error naming the variable, and
/// the password appears in no message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_names_the_variable_and_not_the_password() {
    let server = RedisServer::start();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("right-Secret-1")
        .query(&mut server.connection())
        .expect("CONFIG SET requirepass");
    let url = format!("redis://:wrong-Secret-2@127.0.0.1:{}", server.port());
    let err = RedisBackend::connect(&url, "dlock").await.expect_err("wrong password");
    let text = format!("{err} {err:?}");
    assert!(err.is_misconfigured(), "{text}");
    assert!(text.contains("DLOCK_REDIS_URL"), "{text}");
    assert!(!text.contains("Secret"), "the password leaked: {text}");
    let ok = format!("redis://:right-Secret-1@127.0.0.1:{}", server.port());
    let locker = locker_for(&ok, 300).await;
    let k = locker.key("auth").part(1).build().expect("key");
    locker.try_acquire(&k).await.expect("free").release().await.expect("release");
}

/// T11a: a user limited to the lock namespace (`~dlock:* &dlock:*`, no
/// dangerous commands) can do everything dlock needs: take, wait on a
/// release announcement, re-enter, renew with the watchdog, release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_limited_to_the_lock_namespace_is_enough() {
    let server = RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "locker",
            "on",
            ">pw",
            "resetkeys",
            "~dlock:*",
            "resetchannels",
            "&dlock:*",
            "+@all",
            "-@dangerous",
        ])
        .query(&mut server.connection())
        .expect("ACL SETUSER");
    let url = format!("redis://locker:pw@127.0.0.1:{}", server.port());
    let (a, b) = (locker_for(&url, 300).await, locker_for(&url, 300).await);
    let k = a.key("acl").part(1).build().expect("key");
    let me = dlock_core::Owner::random().expect("random");
    let outer = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect("free");
    let inner = a.acquire(&k, AcquireOptions::new().with_owner(me)).await.expect("re-entry");
    let waiter =
        tokio::spawn(async move { b.acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(5))).await });
    tokio::time::sleep(Duration::from_millis(600)).await; // two watchdog renewals
    assert!(!outer.is_lost());
    assert!(inner.release().await.expect("release inner"));
    let released = Instant::now();
    assert!(outer.release().await.expect("release outer"));
    let g = waiter.await.expect("task").expect("the waiter gets the lock");
    assert!(released.elapsed() < Duration::from_secs(2), "woken by the announcement");
    assert!(g.fencing_token() > 0);
    assert!(g.release().await.expect("release"));
}

/// Without the `tls` feature TLS is not compiled in: a `rediss://` URL is a
/// start-up error naming the variable and the feature to enable, not a
/// plain-text connection. (With the feature: `tests/redis_tls.rs`.)
#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn a_tls_url_is_refused_at_start_up() {
    let err = RedisBackend::connect("rediss://127.0.0.1:6380", "dlock").await.expect_err("no TLS support");
    assert!(err.is_misconfigured(), "{err}");
    let text = err.to_string();
    assert!(text.contains("DLOCK_REDIS_URL") && text.contains("TLS") && text.contains("`tls` feature"), "{text}");
    let cfg = dlock_core::Config::from_lookup(|v| match v {
        "DLOCK_BACKEND" => Some("redis".into()),
        "DLOCK_REDIS_URL" => Some("rediss://127.0.0.1:6380".into()),
        _ => None,
    });
    let text = cfg.expect_err("refused when the configuration is read").to_string();
    assert!(text.contains("DLOCK_REDIS_URL") && text.contains("`tls` feature"), "{text}");
}

/// A slow server neither queues waiters behind each other nor stretches a
/// wait. 16 waiters on 16 held keys start at once through a proxy that makes
/// every round trip 300 ms long; the keys are released 1.2 s later. Every
/// waiter must be subscribed by then and take its key: when the subscriber
/// sent (un)subscribes one at a time, awaiting each confirmation, the last
/// waiters were still queued for their subscription when their 3 s wait
/// ran out (seen with a slow RedLock node in the `redlock-slow` scenario).
/// A 17th waiter, on a key never released, must give up on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_server_queues_no_waiter_and_stretches_no_wait() {
    let server = RedisServer::start();
    let holder = locker_for(&server.url(), 30_000).await;
    let keys: Vec<LockKey> = (0..17).map(|i| holder.key("slow-server").part(i).build().expect("key")).collect();
    let mut guards = Vec::new();
    for k in &keys {
        guards.push(holder.acquire(k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free"));
    }
    let proxy = FaultProxy::start(server.port());
    let waiter = locker_for(&format!("redis://127.0.0.1:{}", proxy.port()), 30_000).await;
    proxy.set_request_delay(Duration::from_millis(150));
    proxy.set_delay(Duration::from_millis(150));
    let started = Instant::now();
    let tasks: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let (waiter, k) = (waiter.clone(), k.clone());
            let wait = Duration::from_secs(if i == 16 { 1 } else { 3 });
            tokio::spawn(async move {
                let result =
                    waiter.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(wait)).await;
                (result, started.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let never = guards.pop().expect("17 guards");
    for g in guards {
        assert!(g.release().await.expect("release"));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let (result, took) = task.await.expect("task");
        if i == 16 {
            assert!(matches!(result, Err(dlock_core::Error::Timeout { .. })), "{result:?}");
            // The wait, plus the one round trip that may be in flight at its end.
            assert!(took < Duration::from_millis(2_000), "a 1 s wait took {took:?}");
        } else {
            let guard =
                result.unwrap_or_else(|e| panic!("waiter {i} did not get its released key after {took:?}: {e}"));
            drop(guard);
        }
    }
    drop(never);
}

/// Connections open on the server, ours and the probe's own.
fn connected_clients(server: &RedisServer) -> usize {
    let info: String = redis::cmd("INFO").arg("clients").query(&mut server.connection()).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("connected_clients in INFO")
}

/// One configuration builds the engine and the idempotency store over the
/// same Redis connections: the store opens none of its own, and its
/// records live under the engine's prefix.
#[tokio::test]
async fn one_config_builds_locks_and_idempotency_over_shared_connections() {
    let server = RedisServer::start();
    let url = server.url();
    let config = dlock_core::Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("redis".into()),
        "DLOCK_REDIS_URL" => Some(url.clone()),
        "DLOCK_PREFIX" => Some("shop".into()),
        _ => None,
    })
    .expect("config");
    let before = connected_clients(&server);
    let dlock = config.build().await.expect("runtime");
    let with_runtime = connected_clients(&server);
    let engine_alone = RedisBackend::connect(&url, "shop").await.expect("engine");
    let with_engine = connected_clients(&server);
    assert_eq!(with_runtime - before, with_engine - with_runtime, "the store opened no connection of its own");
    // The negative control: records in another database of the same server
    // are a store of its own, with connections of its own.
    let mut apart = config.clone();
    apart.idempotency_redis_url = Some(format!("{url}/1"));
    let apart = apart.build().await.expect("records apart");
    assert!(connected_clients(&server) - with_engine > with_runtime - before, "a store apart connects on its own");
    drop((engine_alone, apart));
    let store = dlock.idempotency_store().expect("records");
    assert_eq!(store.name(), "redis");
    assert_eq!(dlock.locker().options().prefix(), "shop");

    let key = dlock.locker().key("order").part(1).build().expect("key");
    let guard = dlock.locker().try_acquire(&key).await.expect("free");
    let token = store.issue_token(None, Duration::from_secs(60)).await.expect("token");
    let keys: Vec<String> = redis::cmd("KEYS").arg("shop:idem:t:*").query(&mut server.connection()).expect("KEYS");
    assert_eq!(keys.len(), 1, "the token lives under the one prefix: {keys:?}");
    assert!(store.consume(&token).await.expect("consume"));
    assert!(guard.release().await.expect("release"));
}

/// The prefix is given once: options that name another prefix than the
/// backend was connected for are refused, and `Locker::new` takes the
/// backend's.
#[tokio::test]
async fn the_engine_refuses_a_prefix_the_backend_was_not_connected_for() {
    let server = RedisServer::start();
    let backend = Arc::new(RedisBackend::connect(&server.url(), "shop").await.expect("connect"));
    let err = Locker::with_options(backend.clone(), LockerOptions::default()).expect_err("dlock is not shop");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("shop"), "{err}");
    let agreed = Locker::with_options(backend, LockerOptions::default().with_prefix("shop")).expect("same prefix");
    assert_eq!(agreed.options().prefix(), "shop");
    let adopted = Locker::new(RedisBackend::connect(&server.url(), "shop").await.expect("connect"));
    assert_eq!(adopted.options().prefix(), "shop");
    let bad = RedisBackend::connect(&server.url(), "sh{op}").await.expect_err("braces are the hash tag");
    assert!(bad.is_misconfigured(), "{bad}");
}

/// Issue 17: an uncontended cycle costs the server `TIME`, `SET … GET` (the
/// high-water mark) and `SET … NX PX GET` to take the lock, `GET` and `DEL`
/// to give it back, in two script calls; nothing else (no hash, no
/// `PEXPIRE`, no `PUBLISH` when nobody waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_cycle_costs_five_server_commands() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let fixed = || AcquireOptions::new().with_lease(Duration::from_secs(30));
    // The first cycle loads the scripts.
    let warm = a.key("lean").part("warm").build().expect("key");
    a.acquire(&warm, fixed()).await.expect("free").release().await.expect("release");
    server.reset_stats();
    const CYCLES: u64 = 50;
    for i in 0..CYCLES {
        let k = a.key("lean").part(i).build().expect("key");
        assert!(a.acquire(&k, fixed()).await.expect("free").release().await.expect("release"));
    }
    let mut stats = server.command_stats();
    stats.retain(|c, _| !c.starts_with("info") && !c.starts_with("config"));
    let expected: std::collections::HashMap<String, u64> =
        [("evalsha", 2 * CYCLES), ("time", CYCLES), ("set", 2 * CYCLES), ("get", CYCLES), ("del", CYCLES)]
            .into_iter()
            .map(|(c, n)| (c.to_owned(), n))
            .collect();
    assert_eq!(stats, expected, "server commands for {CYCLES} cycles");
}

/// Issue 17: re-entry is counted in the client, so a process's re-entries
/// and the releases that are not its last send nothing to the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reentries_reach_the_server_only_at_the_first_acquire_and_the_last_release() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let k = a.key("local-reentry").part(1).build().expect("key");
    let me = dlock_core::Owner::random().expect("random");
    let as_me = || AcquireOptions::new().with_owner(me.clone());
    let outer = a.acquire(&k, as_me()).await.expect("free");
    server.reset_stats();
    for _ in 0..20 {
        let inner = a.acquire(&k, as_me()).await.expect("re-entry");
        assert_eq!(inner.fencing_token(), outer.fencing_token(), "a re-entry joins the hold");
        assert!(inner.release().await.expect("release inner"));
    }
    assert_eq!(server.command_calls("evalsha"), 0, "{:?}", server.command_stats());
    assert!(b.try_acquire(&k).await.is_err(), "still held by the outer hold");
    assert!(outer.release().await.expect("release outer"));
    b.try_acquire(&k).await.expect("free after the last release").release().await.expect("release");
}

/// Issue 17: an owner shared by two processes (here two backends) shares
/// the server's one hold but not the count: the second joins the first's
/// hold with its token, and the first last-release frees the key for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shared_across_processes_shares_one_hold() {
    let server = RedisServer::start();
    let (a, b, c) = (
        locker_for(&server.url(), 300).await,
        locker_for(&server.url(), 300).await,
        locker_for(&server.url(), 300).await,
    );
    let k = a.key("shared-owner").part(1).build().expect("key");
    let me = dlock_core::Owner::random().expect("random");
    let in_a = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect("free");
    let in_b = b.acquire(&k, AcquireOptions::new().with_owner(me)).await.expect("joins");
    assert_eq!(in_b.fencing_token(), in_a.fencing_token(), "the second process joins the same grant");
    assert!(c.try_acquire(&k).await.is_err(), "others are excluded");
    assert!(in_b.release().await.expect("release in b"));
    c.try_acquire(&k).await.expect("the first last-release frees it for both").release().await.expect("release");
    assert!(!in_a.release().await.expect("release in a"), "a's hold went with b's release");
}

/// Issue 17: a re-entry that must ask the server (its hold has less than
/// half the lease left) races the hold's last release: the join is sent
/// first, so it lands before the release deletes the key. The acquire must
/// not count that join as a hold: it waits for the release and takes the
/// key afresh, so the server has the hold it believes it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_racing_the_last_release_is_not_a_hold() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let k = a.key("join-race").part(1).build().expect("key");
    let me = dlock_core::Owner::random().expect("random");
    let lease = Duration::from_millis(1_000);
    let fixed = || AcquireOptions::new().with_owner(me.clone()).with_lease(lease);
    let outer = a.acquire(&k, fixed()).await.expect("free");
    tokio::time::sleep(lease * 6 / 10).await;
    // `join!` polls the acquire first: its script call is queued on the
    // connection before the release's.
    let (inner, released) = tokio::join!(a.acquire(&k, fixed()), outer.release());
    assert!(released.expect("release"), "the outer hold was ours");
    let inner = inner.expect("acquire");
    let value: Option<String> = redis::cmd("GET").arg(k.as_str()).query(&mut server.connection()).expect("GET");
    assert!(value.is_some_and(|v| v.ends_with(me.as_str())), "the server has the hold the guard believes in");
    assert!(inner.release().await.expect("release"), "still ours when released");
}

/// A server that forgot the lock scripts (`SCRIPT FLUSH`, as a restart
/// does) answers `NOSCRIPT`: the call loads the script and is sent again,
/// for the acquire and the release alike, and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_forgot_the_scripts_gets_them_again() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let k = a.key("script-flush").part(1).build().expect("key");
    let fixed = || AcquireOptions::new().with_lease(Duration::from_secs(30));
    a.acquire(&k, fixed()).await.expect("free").release().await.expect("release");
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.connection()).expect("SCRIPT FLUSH");
    server.reset_stats();
    let held = a.acquire(&k, fixed()).await.expect("acquired after the flush");
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.connection()).expect("SCRIPT FLUSH");
    assert!(held.release().await.expect("released after the flush"), "still ours");
    let stats = server.command_stats();
    assert_eq!(server.command_calls("script|load"), 2, "one load per forgotten script: {stats:?}");
    assert_eq!(server.command_calls("evalsha"), 4, "each call sent again once: {stats:?}");
}

/// A release the caller gives up on while it is on its way (a timeout
/// around `release()`, here while the server pauses writes) must neither
/// leave later acquires of the same owner waiting for it for good, nor let
/// them overtake it: the next acquire takes the key after the release
/// landed, and the server has the hold the guard believes in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_given_up_on_its_way_lets_its_owner_acquire_again() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let k = a.key("given-up-release").part(1).build().expect("key");
    let me = dlock_core::Owner::random().expect("random");
    let fixed = || AcquireOptions::new().with_owner(me.clone()).with_lease(Duration::from_secs(30));
    let held = a.acquire(&k, fixed()).await.expect("free");
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(400).arg("WRITE").query(&mut server.connection()).expect("PAUSE");
    let gave_up = tokio::time::timeout(Duration::from_millis(50), held.release()).await;
    assert!(gave_up.is_err(), "the release waits for the paused server");
    let again = tokio::time::timeout(Duration::from_secs(5), a.acquire(&k, fixed().with_wait(Duration::from_secs(2))))
        .await
        .expect("the acquire does not wait for the given-up release for good")
        .expect("the key is free once the release landed");
    let value: Option<String> = redis::cmd("GET").arg(k.as_str()).query(&mut server.connection()).expect("GET");
    assert!(value.is_some_and(|v| v.ends_with(me.as_str())), "the server has the hold the guard believes in");
    assert!(again.release().await.expect("release"), "still ours when released");
}

/// Issue 17 (coalescing): acquires and releases of many tasks at once share
/// script calls — one `TIME` and one high-water mark update per call, with
/// consecutive tokens — and every grant still has a token of its own above
/// the mark it found, the mark ending at the largest; also when the mark is
/// ahead of the server clock (as after a clock step back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_and_releases_share_script_calls() {
    let server = RedisServer::start();
    let a = Arc::new(locker_for(&server.url(), 300).await);
    let warm = a.key("coalesce").part("warm").build().expect("key");
    let fixed = || AcquireOptions::new().with_lease(Duration::from_secs(30));
    a.acquire(&warm, fixed()).await.expect("free").release().await.expect("release");
    let mark_key = dlock_core::test_support::prefix_fence_key("dlock");
    let mark = |server: &RedisServer| -> u64 {
        let v: String = redis::cmd("GET").arg(&mark_key).query(&mut server.connection()).expect("GET");
        v.parse().expect("a number")
    };
    for ahead in [false, true] {
        if ahead {
            let _: () =
                redis::cmd("SET").arg(&mark_key).arg("9000000000000000").query(&mut server.connection()).expect("SET");
        }
        let before = mark(&server);
        server.reset_stats();
        const TASKS: u64 = 64;
        let start = Arc::new(tokio::sync::Barrier::new(TASKS as usize));
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| {
                let (a, start) = (a.clone(), start.clone());
                tokio::spawn(async move {
                    let k = a.key("coalesce").part(i).build().expect("key");
                    start.wait().await;
                    let g = a.acquire(&k, fixed()).await.expect("free");
                    let token = g.fencing_token();
                    start.wait().await;
                    assert!(g.release().await.expect("release"), "held until released");
                    token
                })
            })
            .collect();
        let mut tokens = Vec::new();
        for t in tasks {
            tokens.push(t.await.expect("task"));
        }
        let stats = server.command_stats();
        let calls = server.command_calls("evalsha");
        assert!(calls < 2 * TASKS, "{calls} script calls for {TASKS} acquires and releases: {stats:?}");
        assert!(server.command_calls("time") < TASKS, "one TIME per call: {stats:?}");
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len() as u64, TASKS, "every grant has a token of its own");
        assert!(tokens[0] > before, "{} above the mark found, {before}", tokens[0]);
        assert_eq!(mark(&server), *tokens.last().expect("tokens"), "the mark holds the last token");
        let keys: Vec<String> =
            redis::cmd("KEYS").arg("dlock:{coalesce*").query(&mut server.connection()).expect("KEYS");
        assert!(keys.is_empty(), "released: {keys:?}");
    }
}

/// Issue 17 (coalescing): up to 16 operations of a kind in flight go out
/// alone, each in a call of its own: at that concurrency the server is the
/// limit and a batch would only add the wait for the call ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_concurrent_acquires_are_not_held_back_for_a_batch() {
    let server = RedisServer::start();
    let a = Arc::new(locker_for(&server.url(), 300).await);
    let fixed = || AcquireOptions::new().with_lease(Duration::from_secs(30));
    // Loads the scripts, so that no NOSCRIPT retry is counted below.
    let warm = a.key("alone").part("warm").build().expect("key");
    a.acquire(&warm, fixed()).await.expect("free").release().await.expect("release");
    server.reset_stats();
    const TASKS: u64 = 8;
    let start = Arc::new(tokio::sync::Barrier::new(TASKS as usize));
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (a, start) = (a.clone(), start.clone());
            tokio::spawn(async move {
                let k = a.key("alone").part(i).build().expect("key");
                start.wait().await;
                let g = a.acquire(&k, fixed()).await.expect("free");
                start.wait().await;
                assert!(g.release().await.expect("release"), "held until released");
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    let stats = server.command_stats();
    assert_eq!(server.command_calls("evalsha"), 2 * TASKS, "a call per acquire and per release: {stats:?}");
    assert_eq!(server.command_calls("time"), TASKS, "a TIME per acquire, none shared: {stats:?}");
}

/// Issue 17 (handoff): a task that starts waiting for a key other tasks of
/// its process already wait for subscribes first and tries once, so a
/// contended acquisition costs one script call less; it still gets the lock
/// when it comes free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_others_tries_once_before_it_parks() {
    let server = RedisServer::start();
    let a = Arc::new(locker_for(&server.url(), 300).await);
    let k = a.key("queue").part(1).build().expect("key");
    let fixed = AcquireOptions::new().with_lease(Duration::from_secs(30));
    let holder = a.acquire(&k, fixed.clone()).await.expect("free");
    let waiting = fixed.with_wait(Duration::from_secs(10));
    let first = tokio::spawn({
        let (a, k, waiting) = (a.clone(), k.clone(), waiting.clone());
        async move { a.acquire(&k, waiting).await.map(|g| g.fencing_token()) }
    });
    // The first waiter has tried, subscribed, tried again and parked.
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.reset_stats();
    let second = tokio::spawn({
        let (a, k) = (a.clone(), k.clone());
        async move {
            let g = a.acquire(&k, waiting).await?;
            let token = g.fencing_token();
            g.release().await?;
            Ok::<_, dlock_core::Error>(token)
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stats = server.command_stats();
    assert_eq!(server.command_calls("evalsha"), 1, "one try before parking behind the first waiter: {stats:?}");
    assert_eq!(server.command_calls("subscribe"), 0, "the channel was subscribed already: {stats:?}");
    let held = holder.fencing_token();
    assert!(holder.release().await.expect("release"));
    let first = first.await.expect("task").expect("the first waiter gets it");
    let second = second.await.expect("task").expect("the second waiter gets it after the first");
    assert!(held < first && first < second, "tokens in handoff order: {held} {first} {second}");
}

/// Issue 17 (coalescing): the restart quarantine's data marker is checked
/// by coalesced acquires too: after a flush, none of many concurrent
/// acquires is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_acquires_respect_the_restart_quarantine() {
    let server = RedisServer::start();
    let options = dlock_core::backend::redis::RedisOptions::default().with_restart_quarantine(Duration::from_secs(1));
    let backend = RedisBackend::connect_with(&server.url(), "dlock", options).await.expect("connect");
    let a =
        Arc::new(Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("ok"));
    // A server without the marker is quarantined first.
    let first = a.key("first-use").part(1).build().expect("key");
    let until = Instant::now() + Duration::from_secs(5);
    let g = loop {
        match a.acquire(&first, AcquireOptions::new().with_lease(Duration::from_secs(30))).await {
            Ok(g) => break g,
            Err(e) => assert!(Instant::now() < until, "never granted: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    g.release().await.expect("release");
    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let tasks: Vec<_> = (0..32u32)
        .map(|i| {
            let a = a.clone();
            tokio::spawn(async move {
                let k = a.key("after-flush").part(i).build().expect("key");
                a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30)))
                    .await
                    .map(|g| g.fencing_token())
            })
        })
        .collect();
    let mut granted = Vec::new();
    for t in tasks {
        if let Ok(token) = t.await.expect("task") {
            granted.push(token);
        }
    }
    assert!(granted.is_empty(), "{} acquires granted during the quarantine", granted.len());
}

/// An acquire whose answer timed out may still have run on the server: the
/// engine sends an owner-checked release after it, so the key is free at
/// once, instead of held by nobody for a whole lease (30 s in watchdog
/// mode). The replies come late through a proxy: the script runs on time,
/// its answer misses the response timeout (1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_answer_timed_out_does_not_block_the_key_for_a_lease() {
    let server = RedisServer::start();
    let proxy = dlock_testing::FaultProxy::start(server.port());
    let a = locker_for(&format!("redis://127.0.0.1:{}", proxy.port()), 30_000).await;
    let b = locker_for(&server.url(), 30_000).await;
    let k = a.key("timed-out-acquire").part(1).build().expect("key");
    // Warm the scripts, so the late answer is the grant itself (a cold
    // EVALSHA's NOSCRIPT answer would time out first and never run).
    a.try_acquire(&k).await.expect("free").release().await.expect("release");
    proxy.set_delay(Duration::from_millis(1_500));
    let err = a.try_acquire(&k).await.expect_err("the answer times out");
    assert!(err.is_unavailable(), "{err}");
    proxy.set_delay(Duration::ZERO);
    let value: Option<String> = redis::cmd("GET").arg(k.as_str()).query(&mut server.connection()).expect("GET");
    assert!(value.is_some(), "the acquire ran on the server, only its answer was late");
    let other = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match b.try_acquire(&k).await {
                Ok(g) => return g,
                Err(e) if e.is_contention() => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        let pttl: i64 = redis::cmd("PTTL").arg(k.as_str()).query(&mut server.connection()).expect("PTTL");
        panic!("the key stayed held after the timed-out acquire (PTTL {pttl} ms)")
    });
    assert!(other.release().await.expect("release"));
}

/// An acquire refused before it was sent (the server is down) ran nothing,
/// so nothing is undone: a dead server does not collect one background
/// release per failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_refused_by_a_dead_server_leave_no_release_behind() {
    let mut server = RedisServer::start();
    let a = locker_for(&server.url(), 30_000).await;
    let k = a.key("dead-server").part(1).build().expect("key");
    a.try_acquire(&k).await.expect("free").release().await.expect("release");
    server.kill();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    for i in 0..50 {
        let k = a.key("dead-server").part(i).build().expect("key");
        let err = a.try_acquire(&k).await.expect_err("the server is down");
        assert!(err.is_unavailable(), "{err}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let extra = metrics.num_alive_tasks().saturating_sub(before);
    assert!(extra < 10, "{extra} tasks left behind by 50 refused acquires");
}

/// Which Redis could not be reached, and where: the lock Redis and the
/// records' Redis are told apart by their variable, the address is named
/// and the password is not.
#[tokio::test]
async fn a_redis_that_cannot_be_reached_is_named_by_its_variable_and_address() {
    let server = RedisServer::start();
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    }; // closed again: nobody listens there now
    let dead_url = format!("redis://app:s3cret@127.0.0.1:{dead}");
    let build = |lock: String, records: Option<String>| async move {
        let config = dlock_core::Config::from_lookup(|var| match var {
            "DLOCK_BACKEND" => Some("redis".into()),
            "DLOCK_REDIS_URL" => Some(lock.clone()),
            "DLOCK_IDEMPOTENCY_REDIS_URL" => records.clone(),
            _ => None,
        })
        .expect("config");
        config.build().await.map(|_| ()).expect_err("one Redis is down").to_string()
    };
    let records_down = build(server.url(), Some(dead_url.clone())).await;
    assert!(
        records_down.contains(&format!("DLOCK_IDEMPOTENCY_REDIS_URL (redis://***@127.0.0.1:{dead})")),
        "{records_down}"
    );
    let locks_down = build(dead_url, None).await;
    assert!(locks_down.contains(&format!("DLOCK_REDIS_URL (redis://***@127.0.0.1:{dead})")), "{locks_down}");
    for text in [records_down, locks_down] {
        assert!(!text.contains("s3cret"), "{text}");
    }
}

/// Issue 26: a locker and its backend, to count the backend's waiters.
async fn locker_and_backend(url: &str) -> (Locker, Arc<RedisBackend>) {
    let backend = Arc::new(RedisBackend::connect(url, "dlock").await.expect("connect to the test redis-server"));
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
    let locker = Locker::with_options(backend.clone() as Arc<dyn Backend>, opts).expect("valid options");
    (locker, backend)
}

fn in_mode(mode: LockMode) -> AcquireOptions {
    AcquireOptions::new().with_mode(mode).with_lease(Duration::from_secs(30)).with_wait(Duration::ZERO)
}

/// Waits until `n` acquires of `backend` wait for `key` (no sleep-and-hope).
async fn until_waiting(backend: &RedisBackend, key: &LockKey, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while dlock_core::test_support::redis_waiters(backend, key) < n {
        assert!(Instant::now() < deadline, "{n} waiters never parked on {key}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Issue 26: readers share a key, from several processes, and keep a
/// writer out; once they are gone the writer gets it (with a higher token)
/// and keeps readers out in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_a_key_and_exclude_a_writer() {
    let server = RedisServer::start();
    let (a, b, c) = (
        locker_for(&server.url(), 300).await,
        locker_for(&server.url(), 300).await,
        locker_for(&server.url(), 300).await,
    );
    let k = a.key("rw").part(1).build().expect("key");
    let r1 = a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free");
    let r2 = b.acquire(&k, in_mode(LockMode::Shared)).await.expect("readers share");
    assert!(r2.fencing_token() > r1.fencing_token(), "every grant has its own, growing token");
    let err = c.acquire(&k, in_mode(LockMode::Exclusive)).await.expect_err("readers keep a writer out");
    assert!(err.is_contention(), "{err:?}");
    assert!(r1.release().await.expect("release"));
    assert!(c.acquire(&k, in_mode(LockMode::Exclusive)).await.expect_err("one reader is left").is_contention());
    let last_read = r2.fencing_token();
    assert!(r2.release().await.expect("release"));
    let w = c.acquire(&k, in_mode(LockMode::Exclusive)).await.expect("the readers are gone");
    assert!(w.fencing_token() > last_read);
    assert!(a.acquire(&k, in_mode(LockMode::Shared)).await.expect_err("a writer keeps readers out").is_contention());
    assert!(w.release().await.expect("release"));
    a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free again").release().await.expect("release");
    let keys: Vec<String> = redis::cmd("KEYS").arg("dlock:*}").query(&mut server.connection()).expect("KEYS");
    assert!(keys.is_empty(), "released locks leave nothing behind: {keys:?}");
}

/// Issue 26: a writer that waits for readers is not starved by new ones:
/// once it waits, a new reader is refused (and one that waits queues
/// behind it); when the readers it waited for leave, the writer gets the
/// key before the reader that came after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_is_not_starved_by_new_readers() {
    let server = RedisServer::start();
    let (a, _) = locker_and_backend(&server.url()).await;
    let (w, w_backend) = locker_and_backend(&server.url()).await;
    let (r, r_backend) = locker_and_backend(&server.url()).await;
    let k = a.key("writer-first").part(1).build().expect("key");
    let reader = a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free");
    let writer = {
        let (w, k) = (w.clone(), k.clone());
        tokio::spawn(async move {
            let g = w.acquire(&k, in_mode(LockMode::Exclusive).with_wait(Duration::from_secs(20))).await;
            let g = g.expect("the writer gets the key when the reader leaves");
            let token = g.fencing_token();
            assert!(g.release().await.expect("release"));
            token
        })
    };
    until_waiting(&w_backend, &k, 1).await;
    // Registered before its first try after subscribing: the intent is
    // recorded by that try, which may still be on its way.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let intent: bool =
            redis::cmd("HEXISTS").arg(k.as_str()).arg("i").query(&mut server.connection()).expect("HEXISTS");
        if intent {
            break;
        }
        assert!(Instant::now() < deadline, "the waiting writer never recorded its intent");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let err = r.acquire(&k, in_mode(LockMode::Shared)).await.expect_err("a new reader waits behind the writer");
    assert!(err.is_contention(), "{err:?}");
    let late_reader = {
        let (r, k) = (r.clone(), k.clone());
        tokio::spawn(async move {
            let g = r.acquire(&k, in_mode(LockMode::Shared).with_wait(Duration::from_secs(20))).await;
            let g = g.expect("the late reader gets the key after the writer");
            let token = g.fencing_token();
            assert!(g.release().await.expect("release"));
            token
        })
    };
    until_waiting(&r_backend, &k, 1).await;
    assert!(reader.release().await.expect("release"));
    let writer_token = writer.await.expect("writer task");
    let reader_token = late_reader.await.expect("reader task");
    assert!(writer_token < reader_token, "the writer went first: {writer_token} vs {reader_token}");
}

/// Issue 26: `limit` permits from several processes, many tasks each, never
/// more holders at once than the limit, and the limit reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_are_never_exceeded_under_contention() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const LIMIT: u32 = 3;
    let server = RedisServer::start();
    let (current, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    let mut k = None;
    for _ in 0..4 {
        let locker = locker_for(&server.url(), 300).await;
        let key = k.get_or_insert_with(|| locker.key("sem").part(1).build().expect("key")).clone();
        for _ in 0..4 {
            let (locker, key, current, most) = (locker.clone(), key.clone(), current.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let opts = in_mode(LockMode::permits(LIMIT)).with_wait(Duration::from_secs(30));
                    let g = locker.acquire(&key, opts).await.expect("a permit within the wait");
                    let now = current.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    current.fetch_sub(1, Ordering::SeqCst);
                    assert!(g.release().await.expect("release"), "the permit was still ours");
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(most.load(Ordering::SeqCst), LIMIT as usize, "holders at once: at most the limit, and reached");
}

/// Issue 26: a semaphore's limit is fixed by its first holder: another
/// limit, an exclusive or a shared hold of its key is a mode conflict
/// naming what does not fit, never contention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_key_asked_for_otherwise_is_a_mode_conflict() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let k = a.key("sem-conflict").part(1).build().expect("key");
    let g = a.acquire(&k, in_mode(LockMode::permits(2))).await.expect("free");
    match b.acquire(&k, in_mode(LockMode::permits(3))).await {
        Err(dlock_core::Error::ModeConflict { reason, .. }) => {
            assert!(reason.contains("semaphore of 2 permits") && reason.contains("one of 3"), "{reason}");
        }
        other => panic!("another limit: {other:?}"),
    }
    for mode in [LockMode::Exclusive, LockMode::Shared] {
        let err = b.acquire(&k, in_mode(mode).with_wait(Duration::from_secs(5))).await.expect_err("conflict");
        assert!(matches!(err, dlock_core::Error::ModeConflict { .. }), "{mode}: {err:?}");
    }
    // A read-write key asked for as a semaphore is one too.
    let rw = a.key("sem-conflict").part(2).build().expect("key");
    let reader = a.acquire(&rw, in_mode(LockMode::Shared)).await.expect("free");
    let err = b.acquire(&rw, in_mode(LockMode::permits(2))).await.expect_err("conflict");
    assert!(matches!(err, dlock_core::Error::ModeConflict { .. }), "{err:?}");
    // Once nobody holds it, the next holder fixes the mode anew.
    assert!(g.release().await.expect("release"));
    assert!(reader.release().await.expect("release"));
    b.acquire(&k, in_mode(LockMode::permits(3))).await.expect("a new limit").release().await.expect("release");
    b.acquire(&k, in_mode(LockMode::Exclusive)).await.expect("exclusive").release().await.expect("release");
}

/// Issue 26: a permit with a fixed lease whose holder vanishes comes back
/// when the lease runs out; the waiter learns when from the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_with_a_fixed_lease_comes_back_after_the_lease() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let k = a.key("sem-lease").part(1).build().expect("key");
    let short = || in_mode(LockMode::permits(2)).with_lease(Duration::from_millis(300));
    let (p1, p2) = (a.acquire(&k, short()).await.expect("free"), a.acquire(&k, short()).await.expect("second permit"));
    // The holders vanish without releasing (as a crashed process would).
    std::mem::forget(p1);
    std::mem::forget(p2);
    let err = b.acquire(&k, in_mode(LockMode::permits(2))).await.expect_err("both permits taken");
    assert!(err.is_contention(), "{err:?}");
    let started = Instant::now();
    let g =
        b.acquire(&k, in_mode(LockMode::permits(2)).with_wait(Duration::from_secs(10))).await.expect("after the lease");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(5), "woken at the lease's end, not the wait's: {waited:?}");
    let g2 = b.acquire(&k, in_mode(LockMode::permits(2))).await.expect("the other permit came back too");
    assert!(g.release().await.expect("release") && g2.release().await.expect("release"));
}

/// Issue 26: waiters are woken by the release announcement, not the
/// holder's lease (30 s, past their wait): every reader of one process
/// parked behind a writer, a writer parked behind readers, and a waiter
/// for a permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_shared_keys_and_permits_are_woken_by_the_release() {
    let server = RedisServer::start();
    let a = locker_for(&server.url(), 300).await;
    let (b, b_backend) = locker_and_backend(&server.url()).await;
    let wait = |mode| in_mode(mode).with_wait(Duration::from_secs(10));
    // Each waiter keeps what it got until `together` of them have it, so a
    // wake-up of one that the others would only get from its release is
    // not enough.
    let spawn = |k: &LockKey, mode: LockMode, together: &Arc<tokio::sync::Barrier>| {
        let (b, k, together) = (b.clone(), k.clone(), together.clone());
        tokio::spawn(async move {
            let g = b.acquire(&k, wait(mode)).await.expect("woken by the release");
            let all_in = tokio::time::timeout(Duration::from_secs(20), together.wait()).await;
            assert!(g.release().await.expect("release"));
            all_in.expect("the others got it too, without this one's release");
        })
    };
    let alone = Arc::new(tokio::sync::Barrier::new(1));

    let k = a.key("wake").part("readers").build().expect("key");
    let writer = a.acquire(&k, in_mode(LockMode::Exclusive)).await.expect("free");
    let all_three = Arc::new(tokio::sync::Barrier::new(3));
    let readers: Vec<_> = (0..3).map(|_| spawn(&k, LockMode::Shared, &all_three)).collect();
    until_waiting(&b_backend, &k, 3).await;
    assert!(writer.release().await.expect("release"));
    for r in readers {
        r.await.expect("reader task");
    }

    let k = a.key("wake").part("writer").build().expect("key");
    let held: Vec<_> = [a.acquire(&k, in_mode(LockMode::Shared)).await, a.acquire(&k, in_mode(LockMode::Shared)).await]
        .into_iter()
        .map(|g| g.expect("readers share"))
        .collect();
    let writer = spawn(&k, LockMode::Exclusive, &alone);
    until_waiting(&b_backend, &k, 1).await;
    for g in held {
        assert!(g.release().await.expect("release"));
    }
    writer.await.expect("writer task");

    let k = a.key("wake").part("permit").build().expect("key");
    let permit = a.acquire(&k, in_mode(LockMode::permits(1))).await.expect("free");
    let waiters: Vec<_> = (0..2).map(|_| spawn(&k, LockMode::permits(1), &alone)).collect();
    until_waiting(&b_backend, &k, 2).await;
    assert!(permit.release().await.expect("release"));
    for w in waiters {
        w.await.expect("permit waiter");
    }
}

/// Issue 26 on Redis Cluster: a counted key lives in its lock's slot, so
/// readers share and permits count there as on one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_keeps_shared_holds_and_permits() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let url = cluster.url();
    let (a, b) = (locker_for(&url, 300).await, locker_for(&url, 300).await);
    for i in 0..6 {
        let k = a.key("cluster-rw").part(i).build().expect("key");
        let r1 = a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free");
        let r2 = b.acquire(&k, in_mode(LockMode::Shared)).await.expect("readers share");
        assert!(b.acquire(&k, in_mode(LockMode::Exclusive)).await.expect_err("readers").is_contention());
        assert!(r1.release().await.expect("release") && r2.release().await.expect("release"));
        b.acquire(&k, in_mode(LockMode::Exclusive)).await.expect("free again").release().await.expect("release");

        let s = a.key("cluster-sem").part(i).build().expect("key");
        let p = || in_mode(LockMode::permits(2));
        let (p1, p2) = (a.acquire(&s, p()).await.expect("free"), b.acquire(&s, p()).await.expect("second"));
        assert!(b.acquire(&s, p()).await.expect_err("both taken").is_contention());
        assert!(p1.release().await.expect("release"));
        let p3 = b.acquire(&s, p()).await.expect("a permit came back");
        assert!(p3.fencing_token() > p2.fencing_token(), "one high-water mark for every grant");
        assert!(p2.release().await.expect("release") && p3.release().await.expect("release"));
    }
}

/// Issue 26: the watchdog renews a shared hold and a permit by key and
/// owner, like an exclusive one: both outlive many leases of 300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_renews_shared_holds_and_permits() {
    let server = RedisServer::start();
    let (a, b) = (locker_for(&server.url(), 300).await, locker_for(&server.url(), 300).await);
    let rw = a.key("renew-counted").part("rw").build().expect("key");
    let sem = a.key("renew-counted").part("sem").build().expect("key");
    let watchdog = |mode| AcquireOptions::new().with_mode(mode).with_wait(Duration::ZERO);
    let reader = a.acquire(&rw, watchdog(LockMode::Shared)).await.expect("free");
    let permit = a.acquire(&sem, watchdog(LockMode::permits(1))).await.expect("free");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert!(!reader.is_lost() && !permit.is_lost(), "renewed");
    assert!(b.acquire(&rw, in_mode(LockMode::Exclusive)).await.expect_err("still read").is_contention());
    assert!(b.acquire(&sem, in_mode(LockMode::permits(1))).await.expect_err("still taken").is_contention());
    assert!(reader.release().await.expect("release") && permit.release().await.expect("release"));
}

/// The field `field` of counted key `key` on `server`, if any.
fn hash_field(server: &RedisServer, key: &LockKey, field: &str) -> Option<String> {
    redis::cmd("HGET").arg(key.as_str()).arg(field).query(&mut server.connection()).expect("HGET")
}

/// Review 2026-12-07 D4: a semaphore's limit is fixed while anyone holds
/// *or waits for* its key. A waiter for one of 2 permits keeps the key a
/// semaphore of 2 once its holders are gone: a newcomer asking for one of 3
/// is told so (`ModeConflict`), and the waiter gets its permit. (Before, the
/// key was free once the holders left: the newcomer took it as a semaphore
/// of 3, and the waiter was told that *its* limit did not fit.) A waiter
/// that gives up takes its place back at once: then the next holder fixes
/// a new limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_semaphore_keeps_its_limit_against_a_newcomer() {
    let server = RedisServer::start();
    // The waiter's process reaches the server through a proxy that can hold
    // its bytes: the holders leave and the newcomer comes before the waiter
    // hears of it, whatever the scheduling.
    let proxy = FaultProxy::start(server.port());
    let holders = locker_for(&server.url(), 300).await;
    let w = locker_for(&format!("redis://127.0.0.1:{}", proxy.port()), 300).await;
    let k = holders.key("sem-waiter").part(1).build().expect("key");
    let two = || in_mode(LockMode::permits(2));
    let three = || in_mode(LockMode::permits(3));
    // Its try after parking has landed once it marked the key awaited.
    let until_awaited = || async {
        let deadline = Instant::now() + Duration::from_secs(10);
        while hash_field(&server, &k, "w").as_deref() != Some("1") {
            assert!(Instant::now() < deadline, "the waiter never tried after parking");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let spawn_waiter = || {
        let (w, k) = (w.clone(), k.clone());
        tokio::spawn(async move { w.acquire(&k, two().with_wait(Duration::from_secs(20))).await })
    };

    let (p1, p2) = (holders.acquire(&k, two()).await.expect("free"), holders.acquire(&k, two()).await.expect("second"));
    let waiter = spawn_waiter();
    until_awaited().await;
    proxy.hold();
    assert!(p1.release().await.expect("release") && p2.release().await.expect("release"));
    let newcomer = holders.acquire(&k, three()).await;
    proxy.heal();
    match newcomer {
        Err(dlock_core::Error::ModeConflict { reason, .. }) => {
            assert!(reason.contains("semaphore of 2 permits") && reason.contains("one of 3"), "{reason}");
        }
        other => panic!("newcomer (3 permits) while a waiter for one of 2 waits: {other:?}"),
    }
    let g = waiter.await.expect("waiter task");
    let g = g.expect("the waiter keeps its limit and gets its permit");
    assert!(g.release().await.expect("release"));

    // A waiter that gives up takes its place back with it.
    let (p1, p2) = (holders.acquire(&k, two()).await.expect("free"), holders.acquire(&k, two()).await.expect("second"));
    let waiter = spawn_waiter();
    until_awaited().await;
    let gave_up = Instant::now();
    waiter.abort();
    assert!(waiter.await.expect_err("aborted").is_cancelled(), "the waiter was still waiting");
    assert!(p1.release().await.expect("release") && p2.release().await.expect("release"));
    let newcomer = loop {
        match holders.acquire(&k, three()).await {
            Ok(g) => break g,
            Err(dlock_core::Error::ModeConflict { .. }) if gave_up.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => panic!("{:?} after the waiter gave up (its wait: 20 s): {e:?}", gave_up.elapsed()),
        }
    };
    assert!(newcomer.release().await.expect("release"));
    let keys: Vec<String> = redis::cmd("KEYS").arg("dlock:*}").query(&mut server.connection()).expect("KEYS");
    assert!(keys.is_empty(), "nothing of the waiters is left: {keys:?}");
}
