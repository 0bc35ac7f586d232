//! The behavioural suite on RedLock over 3 real redis-servers, and node
//! failures over 5.

mod suite;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redlock::{RedLockBackend, RedLockOptions};
use dlock_core::backend::{Backend, LockMode};
use dlock_core::{AcquireOptions, Error, LockKey, Locker, LockerOptions};
use dlock_testing::RedisServer;
use tokio::time::Instant;

struct RedLock {
    servers: Vec<RedisServer>,
}

async fn locker_for(urls: &[String], lease_ms: u64) -> Locker {
    let backend = RedLockBackend::connect(urls, "dlock").await.expect("connect to the test redis-servers");
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(lease_ms));
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options")
}

impl RedLock {
    fn urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }
}

impl suite::Harness for RedLock {
    async fn client(&self) -> Locker {
        locker_for(&self.urls(), 300).await
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(RedLockBackend::connect(&self.urls(), "dlock").await.expect("connect to the test redis-servers"))
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        for s in &self.servers {
            let _: u64 = redis::cmd("DEL").arg(key.as_str()).query(&mut s.connection()).expect("DEL");
        }
    }

    /// Lock keys on any node, once the commands still on their way have
    /// landed: a release or undo stops waiting for a node after the node
    /// timeout (100 ms) and its command lands later (`on_all`), which a
    /// loaded machine reaches. Settled within 250 ms, less than a test
    /// lease (300 ms), so a hold left behind is still seen.
    async fn lock_keys_left(&self) -> usize {
        let deadline = Instant::now() + Duration::from_millis(250);
        loop {
            let mut left = 0;
            for s in &self.servers {
                let keys: Vec<String> = redis::cmd("KEYS").arg("dlock:*").query(&mut s.connection()).expect("KEYS");
                left += keys.iter().filter(|k| k.ends_with('}')).count();
            }
            if left == 0 || Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Subscribers of `key`'s release channel, summed over the nodes
    /// (`PUBSUB NUMSUB`): a waiter subscribes only once it found the key
    /// held and parks.
    async fn parked(&self, key: &LockKey) -> usize {
        let mut n = 0;
        for s in &self.servers {
            let counts: Vec<(String, usize)> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(format!("{}:released", key.as_str()))
                .query(&mut s.connection())
                .expect("PUBSUB NUMSUB");
            n += counts.iter().map(|(_, c)| c).sum::<usize>();
        }
        n
    }
}

async fn redlock() -> RedLock {
    RedLock { servers: (0..3).map(|_| RedisServer::start()).collect() }
}

backend_suite!(redlock());
primitives_suite!(redlock(), one_permit_only);
mod withdrawal {
    use super::*;
    primitives_suite!(@tests redlock(); a_writer_that_hangs_up_lets_readers_in);
}

#[tokio::test]
async fn an_even_number_of_nodes_is_a_config_error() {
    let servers: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let err = RedLockBackend::connect(&urls, "dlock").await.expect_err("two nodes");
    assert!(err.is_misconfigured() && err.to_string().contains("DLOCK_REDLOCK_URLS"), "{err}");
}

/// The guard's validity is the lease minus the time the quorum took minus
/// the clock drift allowance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_accounts_for_elapsed_time_and_drift() {
    let h = redlock().await;
    let a = locker_for(&h.urls(), 300).await;
    let k = a.key("validity").part(1).build().expect("key");
    let before = Instant::now();
    let g = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_millis(1_000))).await.expect("free");
    let after = Instant::now();
    // valid_until = start of the attempt + lease − (1 % of lease + 2 ms),
    // and the attempt started between `before` and `after`.
    let drift = Duration::from_millis(12);
    assert!(g.valid_until() <= after + Duration::from_millis(1_000) - drift, "drift not deducted");
    assert!(g.valid_until() >= before + Duration::from_millis(1_000) - drift);
    g.release().await.expect("release");
}

/// 5 masters: with 2 down locks keep working and stay exclusive; with 3
/// down acquisitions fail with a quorum error within the wait, and no two
/// holders ever overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_masters_survive_two_failures_and_refuse_at_three() {
    let mut servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let lockers = [locker_for(&urls, 500).await, locker_for(&urls, 500).await];
    let k = lockers[0].key("five").part(1).build().expect("key");

    let inside = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU64::new(0));
    let acquired = Arc::new(AtomicU64::new(0));
    let quorum_errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let locker = lockers[t % 2].clone();
        let (k, inside, overlaps, acquired, quorum_errors, stop) =
            (k.clone(), inside.clone(), overlaps.clone(), acquired.clone(), quorum_errors.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match locker.acquire(&k, AcquireOptions::new().with_wait(Duration::from_millis(500))).await {
                    Ok(g) => {
                        if inside.swap(true, Ordering::SeqCst) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        inside.store(false, Ordering::SeqCst);
                        acquired.fetch_add(1, Ordering::SeqCst);
                        let _ = g.release().await;
                    }
                    Err(Error::QuorumUnavailable { .. }) => {
                        quorum_errors.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) if e.is_contention() => {}
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
        }));
    }
    let phase = |name: &'static str| {
        let acquired = acquired.clone();
        async move {
            let before = acquired.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let n = acquired.load(Ordering::SeqCst) - before;
            eprintln!("{name}: {n} acquisitions");
            n
        }
    };
    assert!(phase("5 of 5 up").await > 20);
    servers[0].kill();
    servers[1].kill();
    // Slower than with 5 up: a try that fails (the key is held) still sends
    // its undo to the dead nodes, whose command might land late, and waits
    // the node timeout (100 ms) for them.
    assert!(phase("3 of 5 up").await > 5, "a majority must keep working");
    servers[2].kill();
    tokio::time::sleep(Duration::from_millis(600)).await; // leases of holders end
    let errors_before = quorum_errors.load(Ordering::SeqCst);
    assert_eq!(phase("2 of 5 up").await, 0, "no grants without a quorum");
    assert!(quorum_errors.load(Ordering::SeqCst) > errors_before, "clients are told why");

    // A caller sees the typed error within its wait.
    let started = Instant::now();
    let err =
        lockers[0].acquire(&k, AcquireOptions::new().with_wait(Duration::from_secs(2))).await.expect_err("no quorum");
    assert!(matches!(err, Error::QuorumUnavailable { nodes: 5, needed: 3, .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));

    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
}

/// Renewal needs a quorum too: when a watchdog-mode holder loses its
/// majority, its lost signal fires by the end of the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_quorum_fires_lost() {
    let mut servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    // A lease long enough, and a node timeout far above the default 50 ms,
    // so that a loaded 2-core machine (the whole suite runs at once in CI)
    // still renews through both live nodes in time: the point is quorum
    // arithmetic, not timer precision.
    let options = RedLockOptions::default().with_node_timeout(Duration::from_millis(500));
    let backend = RedLockBackend::connect_with(&urls, "dlock", options).await.expect("connect");
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(2_000));
    let a = Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options");
    let k = a.key("quorum-lost").part(1).build().expect("key");
    let g = a.acquire(&k, AcquireOptions::new()).await.expect("free");
    servers[0].kill();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(!g.is_lost(), "2 of 3 is still a quorum: renewals carried the lock past its first lease");
    servers[1].kill();
    let started = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(5), g.lost()).await.expect("lost fires");
    assert_eq!(reason, dlock_core::LostReason::RenewalFailed);
    assert!(started.elapsed() < Duration::from_millis(3_000), "no later than the lease: {:?}", started.elapsed());
}

/// Many waiters of one process on one key are each woken by some release:
/// with 30 s leases, every task must get its turn long before a lease could
/// run out. (Each node's subscriber keeps one wake-up per channel, so every
/// local waiter must share it; a waiter with a private one slept until its
/// wait ended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_waiters_are_all_woken_by_releases() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locker = locker_for(&urls, 30_000).await;
    let k = locker.key("local-waiters").part(1).build().expect("key");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (locker, k) = (locker.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let opts = AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(60));
                let g = locker.acquire(&k, opts).await.expect("acquire");
                tokio::time::sleep(Duration::from_millis(2)).await;
                assert!(g.release().await.expect("release"));
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("no waiter sleeps until its lease ends")
            .expect("task");
    }
    eprintln!("40 handoffs among 8 local waiters in {:?}", started.elapsed());
}

/// T5c, scripted (the Redis docs' RedLock caveat): A holds on nodes 1-3
/// (4 and 5 are down when it locks, then come back empty); node 3 restarts
/// empty. B then gets 3, 4, 5, a majority, while A's grant is still valid:
/// RedLock without persistence is not mutually exclusive across restarts,
/// and this test documents it. With AOF `appendfsync always` node 3 comes
/// back with A's key and B is refused. (The fencing tokens still order the
/// two: B's is higher, so a fenced resource refuses A.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_can_grant_a_second_quorum() {
    for persistence in [&[][..], &["--appendonly", "yes", "--appendfsync", "always"][..]] {
        let mut servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start_with(persistence)).collect();
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let a = locker_for(&urls, 300).await;
        let k = a.key("restarted-empty").part(1).build().expect("key");
        servers[3].kill();
        servers[4].kill();
        let held =
            a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("quorum of 1-3");
        servers[3].start_again();
        servers[4].start_again();
        servers[2].kill();
        servers[2].start_again();
        // B is another process, connecting after the restarts.
        let b = locker_for(&urls, 300).await;
        let second = b.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await;
        if persistence.is_empty() {
            let second = second.expect("documented unsafety: nodes 3-5 grant B while A holds");
            assert!(!held.is_lost(), "A still believes it holds the lock");
            assert!(second.fencing_token() > held.fencing_token(), "fencing still orders them");
            drop(second);
        } else {
            let err = second.expect_err("node 3 kept A's key");
            assert!(err.is_contention(), "{err}");
        }
        // A's connections to the restarted nodes broke; the answer does not matter.
        let _ = held.release().await;
    }
}

/// A grant reaches every live node, not only the quorum that answered
/// first: the steps not waited for still run to the end. (redis-rs drops a
/// queued command whose reply nobody awaits; when the backend dropped them,
/// a lock often lived on a bare quorum, and one node lost took it away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_reaches_every_live_node() {
    let servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let locker = locker_for(&urls, 30_000).await;
    let mut guards = Vec::new();
    for i in 0..100u32 {
        let k = locker.key("every-node").part(i).build().expect("key");
        guards.push((
            k.clone(),
            locker.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free"),
        ));
    }
    // Let the last commands not waited for land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (n, server) in servers.iter().enumerate() {
        let mut conn = server.connection();
        let missing: Vec<&str> = guards
            .iter()
            .filter(|(k, _)| redis::cmd("EXISTS").arg(k.as_str()).query::<u32>(&mut conn).expect("EXISTS") == 0)
            .map(|(k, _)| k.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "node {n} lacks {} of 100 granted locks, e.g. {:?}",
            missing.len(),
            missing.first()
        );
    }
}

/// Issue 17: RedLock counts re-entries in the client too: re-entries and
/// releases other than the last send nothing to any node, and an
/// uncontended cycle costs each node the same 5 commands as a single Redis,
/// plus the fencing token's write-back (a GET and a SET of the mark in one
/// more script call) on the nodes whose own token was below the quorum's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reentries_reach_no_node_and_a_cycle_costs_each_node_five_commands_and_a_write_back() {
    let r = redlock().await;
    let a = locker_for(&r.urls(), 300).await;
    let me = dlock_core::Owner::random().expect("random");
    let as_me = || AcquireOptions::new().with_owner(me.clone()).with_lease(Duration::from_secs(30));
    let k = a.key("lean").part(1).build().expect("key");
    // Loads nothing new (the scripts are loaded at connect), but warms up.
    a.acquire(&k, as_me()).await.expect("free").release().await.expect("release");
    let calls = |command: &str| r.servers.iter().map(|s| s.command_calls(command)).collect::<Vec<_>>();
    r.servers.iter().for_each(RedisServer::reset_stats);
    let outer = a.acquire(&k, as_me()).await.expect("free");
    for _ in 0..10 {
        let inner = a.acquire(&k, as_me()).await.expect("re-entry");
        assert_eq!(inner.fencing_token(), outer.fencing_token());
        assert!(inner.release().await.expect("release inner"));
    }
    let token = outer.fencing_token();
    // Release waits for every node, so each has run what it was sent.
    assert!(outer.release().await.expect("release outer"));
    let (evalsha, get, set) = (calls("evalsha"), calls("get"), calls("set"));
    // 1 where the write-back ran: every node but the one(s) whose own token
    // was the quorum's.
    let raised: Vec<u64> = evalsha.iter().map(|c| c.checked_sub(2).expect("at least 2 calls")).collect();
    assert!(raised.iter().all(|n| *n <= 1), "the first acquire, one write-back, the last release: {raised:?}");
    assert!(raised.contains(&0), "the node that gave the token needs no write-back: {raised:?}");
    for command in ["time", "del"] {
        assert_eq!(calls(command), vec![1; 3], "{command}");
    }
    assert_eq!(get, raised.iter().map(|n| 1 + n).collect::<Vec<_>>(), "the release's, and the write-back's");
    for (n, (set, raised)) in set.iter().zip(&raised).enumerate() {
        // A node the quorum did not wait for may have answered above the
        // token: its mark is not lowered.
        assert!((2..=2 + raised).contains(set), "node {n}: the mark and the lock, and the write-back: {set}");
    }
    let mark = dlock_core::test_support::prefix_fence_key("dlock");
    for (n, server) in r.servers.iter().enumerate() {
        let at: u64 = redis::cmd("GET").arg(&mark).query(&mut server.connection()).expect("GET mark");
        assert!(at >= token, "node {n}'s mark {at} is at least the granted token {token}");
    }
    for command in ["hset", "hget", "hmget", "pexpire", "publish"] {
        assert_eq!(calls(command), vec![0; 3], "{command}");
    }
}

/// A2 of the 2026-11-27 review: RedLock tokens must grow for every later
/// holder even when the nodes' clocks (or marks) are offset, with no data
/// lost and no clock stepping back. Node B runs 10 s ahead (emulated by its
/// high-water mark). Client 1's quorum is A and B (C is down for that
/// acquire): its token comes from B. Client 1 releases. Client 2's quorum
/// is A and C (B is down for that acquire). Taking the maximum over client
/// 2's quorum alone gives A's or C's clock, 10 s below client 1's token; a
/// register fenced on tokens would then refuse the current holder and take
/// the earlier one's late writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_tokens_grow_when_one_node_clock_runs_ahead() {
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let mut servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_with(&aof)).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let (b, c) = (1, 2);
    let time: (u64, u64) = redis::cmd("TIME").query(&mut servers[b].connection()).expect("TIME");
    let ahead = time.0 * 1_000_000 + time.1 + 10_000_000;
    let mark = dlock_core::test_support::prefix_fence_key("dlock");
    let _: () = redis::cmd("SET").arg(&mark).arg(ahead).query(&mut servers[b].connection()).expect("SET mark");
    let (first, second) = (locker_for(&urls, 300).await, locker_for(&urls, 300).await);
    let k = first.key("skewed").part(1).build().expect("key");
    let lease = || AcquireOptions::new().with_lease(Duration::from_secs(30));

    servers[c].kill();
    let g1 = first.acquire(&k, lease()).await.expect("a quorum of A and B");
    let t1 = g1.fencing_token();
    assert!(t1 > ahead, "client 1's quorum includes B: token {t1}, B's mark {ahead}");
    assert!(g1.release().await.expect("release"), "freed on A and B");
    servers[c].start_again();

    servers[b].kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    let g2 = loop {
        // C's connection comes back within its reconnect backoff.
        match second.acquire(&k, lease()).await {
            Ok(g) => break g,
            Err(e) => assert!(Instant::now() < deadline, "no quorum of A and C: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let t2 = g2.fencing_token();
    assert!(t2 > t1, "client 2 (quorum A and C) got token {t2} after client 1's {t1} (B's mark ran 10 s ahead)");
    assert!(g2.release().await.expect("release"));
}

fn in_mode(mode: LockMode) -> AcquireOptions {
    AcquireOptions::new().with_mode(mode).with_lease(Duration::from_secs(30)).with_wait(Duration::ZERO)
}

/// Issue 26: RedLock refuses a semaphore of 2 or more permits, saying why
/// (majorities cannot count holders), and keeps one permit as a mutex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_a_semaphore_and_keeps_one_permit() {
    let r = redlock().await;
    let (a, b) = (locker_for(&r.urls(), 300).await, locker_for(&r.urls(), 300).await);
    let k = a.key("rl-sem").part(1).build().expect("key");
    // Asked at start-up, before any lock: the same refusal.
    let at_start = a.supports(LockMode::permits(2)).expect_err("refused at start-up");
    assert!(matches!(at_start, Error::InvalidArgument { .. }), "{at_start:?}");
    a.supports(LockMode::permits(1)).expect("one permit");
    a.supports(LockMode::Shared).expect("shared");
    match a.acquire(&k, in_mode(LockMode::permits(2))).await {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("2 permits") && reason.contains("majority"), "{reason}");
        }
        other => panic!("a semaphore of 2 on RedLock: {other:?}"),
    }
    let one = a.acquire(&k, in_mode(LockMode::permits(1))).await.expect("one permit: a mutex");
    assert!(b.acquire(&k, in_mode(LockMode::permits(1))).await.expect_err("taken").is_contention());
    assert!(one.release().await.expect("release"));
    b.acquire(&k, in_mode(LockMode::permits(1))).await.expect("free again").release().await.expect("release");
}

/// Issue 26: readers share a key on a quorum and keep a writer out; a
/// writer keeps readers out; every grant's token grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_readers_share_and_exclude_a_writer() {
    let r = redlock().await;
    let (a, b) = (locker_for(&r.urls(), 300).await, locker_for(&r.urls(), 300).await);
    let k = a.key("rl-rw").part(1).build().expect("key");
    let r1 = a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free");
    let r2 = b.acquire(&k, in_mode(LockMode::Shared)).await.expect("readers share");
    assert!(r2.fencing_token() > r1.fencing_token());
    assert!(b.acquire(&k, in_mode(LockMode::Exclusive)).await.expect_err("readers hold it").is_contention());
    let last_read = r2.fencing_token();
    assert!(r1.release().await.expect("release") && r2.release().await.expect("release"));
    let w = b.acquire(&k, in_mode(LockMode::Exclusive)).await.expect("the readers are gone");
    assert!(w.fencing_token() > last_read);
    assert!(a.acquire(&k, in_mode(LockMode::Shared)).await.expect_err("a writer holds it").is_contention());
    // A reader that waits is woken by the writer's release (its lease is 30 s).
    let reader = {
        let (a, k) = (a.clone(), k.clone());
        tokio::spawn(async move { a.acquire(&k, in_mode(LockMode::Shared).with_wait(Duration::from_secs(10))).await })
    };
    suite::until_parked(&r, &k).await;
    assert!(w.release().await.expect("release"));
    reader.await.expect("task").expect("woken by the release").release().await.expect("release");
}

/// A writer that waited records its intent on every node that refused it,
/// and keeps new readers out there. Granted by a quorum while one node's
/// reader still held on, its intent stayed on that node after its release
/// until its wait would have ended: that node refused every reader for the
/// whole wait. Its release takes the intent with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writers_release_takes_its_intent_from_a_node_it_was_refused_on() {
    use dlock_core::backend::redis::RedisBackend;
    let r = redlock().await;
    let (a, b) = (locker_for(&r.urls(), 300).await, locker_for(&r.urls(), 300).await);
    let urls = r.urls();
    let single = |url: String| async move {
        let backend = RedisBackend::connect(&url, "dlock").await.expect("connect to one node");
        Locker::new(backend)
    };
    let (last_node, last_node_too) = (single(urls[2].clone()).await, single(urls[2].clone()).await);
    let k = a.key("rl-intent").part(1).build().expect("key");
    let reader = a.acquire(&k, in_mode(LockMode::Shared)).await.expect("free");
    // A reader of the last node alone, which outlasts the others there.
    let local_reader = last_node.acquire(&k, in_mode(LockMode::Shared)).await.expect("readers share");
    let writer = {
        let (b, k) = (b.clone(), k.clone());
        tokio::spawn(
            async move { b.acquire(&k, in_mode(LockMode::Exclusive).with_wait(Duration::from_secs(20))).await },
        )
    };
    suite::until_parked(&r, &k).await;
    assert!(reader.release().await.expect("release"));
    let writer = writer.await.expect("task").expect("a quorum is free once the reader left");
    assert!(local_reader.release().await.expect("release"));
    assert!(writer.release().await.expect("release"));
    // Nothing is left of the writer: the last node lets a reader in at once.
    assert_eq!(suite::Harness::lock_keys_left(&r).await, 0, "the writer's intent outlived its release");
    let late = last_node_too.acquire(&k, in_mode(LockMode::Shared)).await.expect("no intent keeps readers out");
    assert!(late.release().await.expect("release"));
}
