//! The restart quarantine (`DLOCK_RESTART_QUARANTINE_MS`): a Redis that
//! restarted without persistence, or lost its data, grants nothing until
//! every lease granted before could have run out (R6; the client-quarantine
//! arms of T4 and T5c in reliability.md). Each test also runs the same moves
//! without the quarantine, to show the violation it prevents.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::{RedisBackend, RedisOptions};
use dlock_core::backend::redlock::{RedLockBackend, RedLockOptions};
use dlock_core::backend::Backend;
use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, RedisStore};
use dlock_core::{AcquireOptions, Error, LockGuard, LockKey, Locker, LockerOptions};
use dlock_testing::RedisServer;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(2);
const QUARANTINE: Duration = Duration::from_secs(2);

fn locker(backend: impl Backend) -> Locker {
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("options")
}

async fn redis_locker(url: &str, quarantine: Duration) -> Locker {
    let options = RedisOptions::default().with_restart_quarantine(quarantine);
    locker(RedisBackend::connect_with(url, "dlock", options).await.expect("connect"))
}

fn fixed() -> AcquireOptions {
    AcquireOptions::new().with_lease(LEASE)
}

/// Tries until granted (errors while the server is away or quarantined),
/// returning the guard and the refusals seen on the way.
async fn acquire_eventually(locker: &Locker, key: &LockKey) -> (LockGuard, Vec<Error>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut refusals = Vec::new();
    loop {
        match locker.acquire(key, fixed()).await {
            Ok(g) => return (g, refusals),
            Err(e) => {
                assert!(Instant::now() < deadline, "never granted; last refusal: {e}");
                refusals.push(e);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The first use of a server: its data marker is not there yet, which
/// cannot be told from a flush, so the first grant comes after one
/// quarantine (see `a_first_deploy_waits_one_quarantine_once`).
async fn first_use(locker: &Locker) {
    let k = locker.key("first-use").part(1).build().expect("key");
    let (g, _) = acquire_eventually(locker, &k).await;
    assert!(g.release().await.expect("release"));
}

fn marker_present(server: &RedisServer) -> bool {
    let n: u64 = redis::cmd("EXISTS").arg("dlock:{dlock-data-marker}").query(&mut server.connection()).expect("EXISTS");
    n == 1
}

/// A first deploy against a Redis that has long been up: its data marker
/// is not there yet, and a missing marker is what a flush leaves, whose
/// holders may still run. The first process waits one quarantine (once,
/// logged as the marker missing; issue 16 had it refused as "lost its
/// data" with no end in sight, the fix of which granted at once and so let
/// a real flush through, A1); every process after it is granted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_deploy_waits_one_quarantine_once() {
    let server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    assert!(!marker_present(&server));
    let first = redis_locker(&server.url(), QUARANTINE).await;
    let k = first.key("deploy").part(0).build().expect("key");
    let started = Instant::now();
    let (g, refusals) = acquire_eventually(&first, &k).await;
    assert!(refusals.iter().any(quarantined), "the first use sits out a quarantine: {refusals:?}");
    assert!(started.elapsed() >= QUARANTINE, "granted {:?} after the first try", started.elapsed());
    assert!(g.release().await.expect("release"));
    assert!(marker_present(&server), "the marker is set");
    for n in 1..3 {
        // A new process each time: a backend with no history of the server.
        let locker = redis_locker(&server.url(), QUARANTINE).await;
        let k = locker.key("deploy").part(n).build().expect("key");
        let g = locker.try_acquire(&k).await.unwrap_or_else(|e| panic!("process {n}: granted at once: {e}"));
        assert!(g.release().await.expect("release"));
    }
}

/// A server that has been up less than the quarantine may have lost locks
/// at its start: nothing is granted until its uptime reaches the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_server_is_quarantined_until_its_uptime_reaches_the_quarantine() {
    let server = RedisServer::start();
    let started = Instant::now();
    let locker = redis_locker(&server.url(), QUARANTINE).await;
    let k = locker.key("fresh").part(1).build().expect("key");
    let (g, refusals) = acquire_eventually(&locker, &k).await;
    assert!(refusals.iter().any(quarantined), "refused as quarantined first: {refusals:?}");
    // `uptime_in_seconds` is whole seconds: up to one second early.
    assert!(
        started.elapsed() >= QUARANTINE - Duration::from_secs(1),
        "granted {:?} after the start",
        started.elapsed()
    );
    assert!(g.release().await.expect("release"));
}

fn quarantined(e: &Error) -> bool {
    matches!(e, Error::Backend { .. }) && e.to_string().contains("DLOCK_RESTART_QUARANTINE_MS")
}

/// T4, client-quarantine arm: A holds two keys on a Redis without
/// persistence; the server restarts empty. A client without the quarantine
/// takes A's key at once (the documented violation); a client with it is
/// refused until A's lease has run out, then granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_grants_nothing_until_the_quarantine_is_over() {
    let mut server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await; // up longer than the quarantine
    let url = server.url();
    let a = redis_locker(&url, QUARANTINE).await;
    first_use(&a).await;
    let guarded = redis_locker(&url, QUARANTINE).await;
    let unguarded = redis_locker(&url, Duration::ZERO).await;
    let (k1, k2) = (a.key("restart").part(1).build().expect("key"), a.key("restart").part(2).build().expect("key"));
    let held1 = a.acquire(&k1, fixed()).await.expect("A takes k1");
    let held2 = a.acquire(&k2, fixed()).await.expect("A takes k2");
    // Both clients have talked to the server before it restarts.
    assert!(guarded.try_acquire(&k1).await.expect_err("held").is_contention());
    assert!(unguarded.try_acquire(&k2).await.expect_err("held").is_contention());

    server.restart();
    let restarted = Instant::now();

    let (stolen, control_refusals) = acquire_eventually(&unguarded, &k2).await;
    assert!(
        Instant::now() < held2.valid_until(),
        "the control took k2 while A's lease on it still ran: {:?} after the restart, {:?} before the lease's end, \
         refusals {control_refusals:?}",
        restarted.elapsed(),
        held2.valid_until().saturating_duration_since(restarted)
    );

    let (granted, refusals) = acquire_eventually(&guarded, &k1).await;
    assert!(Instant::now() >= held1.valid_until(), "granted k1 while A's lease could still run");
    assert!(restarted.elapsed() >= QUARANTINE - Duration::from_millis(100), "{:?}", restarted.elapsed());
    assert!(refusals.iter().any(quarantined), "refused as quarantined: {refusals:?}");
    assert!(granted.fencing_token() > held1.fencing_token(), "fencing tokens still grow (clock floor)");
    drop((stolen, granted, held1, held2));
}

/// A restart that kept the data marker (persistence on, but `everysec` may
/// still have lost the last writes) and that no request saw fail — the
/// connection was re-established in the background — is still caught by
/// its new `run_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_seen_only_as_a_reconnect_is_still_checked() {
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let a = redis_locker(&server.url(), QUARANTINE).await;
    first_use(&a).await;
    assert!(marker_present(&server));

    server.restart();
    tokio::time::sleep(Duration::from_millis(700)).await; // reconnected meanwhile
    assert!(marker_present(&server), "the marker survived the restart");
    let k = a.key("reconnected").part(1).build().expect("key");
    let first = a.try_acquire(&k).await.expect_err("the restarted server is quarantined");
    assert!(quarantined(&first) && first.to_string().contains("has been up only"), "{first}");
}

/// A1 of the 2026-11-27 review: process A sees a flush and is quarantined;
/// after the quarantine, process C is the one that sets the data marker
/// again. A then grants (the marker is back), and must not keep any notion
/// of "my quarantine is done": a second flush, while C holds k2, is
/// quarantined for A like the first. (Before, A stayed "wait done" and
/// answered the second flush by setting the marker and granting k2 at
/// once, to a second holder.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_flush_is_quarantined_even_after_another_process_ended_the_first() {
    let server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let url = server.url();
    let a = redis_locker(&url, QUARANTINE).await;
    first_use(&a).await;
    let c = redis_locker(&url, QUARANTINE).await;
    let holder = redis_locker(&url, QUARANTINE).await;
    let key = |n: u32| a.key("second-flush").part(n).build().expect("key");
    let (k1, k2, k3) = (key(1), key(2), key(3));
    let held1 = holder.acquire(&k1, fixed()).await.expect("the holder takes k1");
    // A and C have both seen the marker.
    assert!(a.try_acquire(&k1).await.expect_err("held").is_contention());
    assert!(c.try_acquire(&k1).await.expect_err("held").is_contention());

    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let first = a.try_acquire(&k1).await.expect_err("A sees the first flush");
    assert!(quarantined(&first), "{first}");

    // C, not A, ends the first quarantine (sets the marker again).
    let (held2, _) = acquire_eventually(&c, &k2).await;
    assert!(Instant::now() >= held1.valid_until(), "C granted while the holder's lease on k1 could still run");
    assert!(marker_present(&server), "C set the marker again");
    // A grants again: the marker is back.
    let g3 = a.acquire(&k3, fixed()).await.expect("A grants once the marker is back");
    assert!(g3.release().await.expect("release"));

    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let flushed = Instant::now();
    match a.try_acquire(&k2).await {
        Ok(stolen) => panic!(
            "A granted k2 (token {}) right after a flush it saw, while C still holds it (token {}, {:?} of its \
             lease left)",
            stolen.fencing_token(),
            held2.fencing_token(),
            held2.valid_until().saturating_duration_since(Instant::now())
        ),
        Err(e) => assert!(quarantined(&e), "{e}"),
    }
    let (granted, _) = acquire_eventually(&a, &k2).await;
    assert!(Instant::now() >= held2.valid_until(), "A granted k2 while C's lease could still run");
    assert!(flushed.elapsed() >= QUARANTINE, "granted {:?} after the second flush", flushed.elapsed());
    drop((granted, held1, held2));
}

/// A1, wider: a process that never saw the data marker (a fresh one: a
/// deploy, a scale-out) and whose first acquire after a `FLUSHALL` comes
/// before any watching process's next one must not take the missing marker
/// for a first use: it is quarantined, and so is every other process, which
/// learns of the flush from the server. (Before, it set the marker and
/// granted at once, and the watching processes never learnt of the flush.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_first_seen_by_a_fresh_process_is_quarantined_for_every_process() {
    let server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let url = server.url();
    let a = redis_locker(&url, QUARANTINE).await;
    first_use(&a).await;
    let holder = redis_locker(&url, QUARANTINE).await;
    let k = a.key("fresh-after-flush").part(1).build().expect("key");
    let held = holder.acquire(&k, fixed()).await.expect("the holder takes k");
    assert!(a.try_acquire(&k).await.expect_err("held").is_contention(), "A watches the server");

    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let flushed = Instant::now();
    let fresh = redis_locker(&url, QUARANTINE).await;
    match fresh.try_acquire(&k).await {
        Ok(stolen) => panic!(
            "a fresh process granted k (token {}) right after a flush, while its holder still runs (token {}, \
             {:?} of its lease left)",
            stolen.fencing_token(),
            held.fencing_token(),
            held.valid_until().saturating_duration_since(Instant::now())
        ),
        Err(e) => assert!(quarantined(&e), "{e}"),
    }
    let other = a.key("fresh-after-flush").part(2).build().expect("key");
    match a.try_acquire(&other).await {
        Ok(_) => panic!("the watching process did not learn of the flush: granted at once"),
        Err(e) => assert!(quarantined(&e), "{e}"),
    }
    let (granted, _) = acquire_eventually(&fresh, &k).await;
    assert!(Instant::now() >= held.valid_until(), "granted k while its holder's lease could still run");
    assert!(flushed.elapsed() >= QUARANTINE, "granted {:?} after the flush", flushed.elapsed());
    drop((granted, held));
}

/// The data marker: a flush that no connection error announced is caught
/// by the acquire script, and quarantined from the moment it is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_server_is_quarantined_from_when_the_loss_is_seen() {
    let server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let url = server.url();
    let a = redis_locker(&url, QUARANTINE).await;
    first_use(&a).await;
    let b = redis_locker(&url, QUARANTINE).await;
    let k = a.key("flushed").part(1).build().expect("key");
    let held = a.acquire(&k, fixed()).await.expect("A takes k");
    assert!(b.try_acquire(&k).await.expect_err("held").is_contention(), "B has checked the server");

    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let flushed = Instant::now();
    let first = b.try_acquire(&k).await.expect_err("the loss is seen");
    assert!(quarantined(&first), "{first}");
    assert!(first.to_string().contains("lost its data"), "{first}");

    let (granted, _) = acquire_eventually(&b, &k).await;
    assert!(flushed.elapsed() >= QUARANTINE, "granted {:?} after the flush", flushed.elapsed());
    assert!(Instant::now() >= held.valid_until());
    drop((granted, held));
}

/// T5c, mitigation arm: A holds a quorum {1, 2, 3} of five masters; 3, 4
/// and 5 restart empty; B, connecting after, would get a second quorum
/// {3, 4, 5} (see `a_node_restarted_empty_can_grant_a_second_quorum`). With
/// the quarantine the restarted nodes grant nothing until A's lease is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_redlock_nodes_are_quarantined() {
    let mut servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let redlock = |urls: Vec<String>, options: RedisOptions| async move {
        let options = RedLockOptions::default().with_node_timeout(Duration::from_millis(100)).with_redis(options);
        let backend = RedLockBackend::connect_with(&urls, "dlock", options).await.expect("connect");
        locker(backend)
    };
    let a = redlock(urls.clone(), options.clone()).await;
    first_use(&a).await;
    // A quorum answered that first use; the nodes that were not waited for
    // may be sitting out their own first quarantine. Use them until every
    // node has its marker.
    let marked = marker_present;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !servers.iter().all(marked) {
        assert!(Instant::now() < deadline, "every node gets its data marker");
        let k = a.key("first-use").part(2).build().expect("key");
        let (g, _) = acquire_eventually(&a, &k).await;
        assert!(g.release().await.expect("release"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let k = a.key("restarted-empty").part(1).build().expect("key");
    servers[3].kill();
    servers[4].kill();
    let held = a.acquire(&k, fixed()).await.expect("quorum of nodes 1-3");
    servers[3].start_again();
    servers[4].start_again();
    servers[2].restart();
    let restarted = Instant::now();

    let b = redlock(urls, options).await;
    let first = b.try_acquire(&k).await.expect_err("nodes 3-5 are quarantined, 1-2 held");
    assert!(!first.is_contention() || first.to_string().contains("quorum"), "{first}");
    let (granted, _) = acquire_eventually(&b, &k).await;
    assert!(Instant::now() >= held.valid_until(), "a second quorum while A's lease ran");
    assert!(restarted.elapsed() >= QUARANTINE - Duration::from_millis(100));
    drop((granted, held));
}

/// `DLOCK_RESTART_QUARANTINE_MS`: off by default, a number of milliseconds.
#[test]
fn the_quarantine_is_a_config_option_with_a_default_of_off() {
    let cfg = dlock_core::Config::from_lookup(|v| (v == "DLOCK_RESTART_QUARANTINE_MS").then(|| "30000".into()))
        .expect("valid");
    assert_eq!(cfg.restart_quarantine, Duration::from_secs(30));
    let cfg = dlock_core::Config::from_lookup(|_| None).expect("valid");
    assert!(cfg.restart_quarantine.is_zero());
    let err = dlock_core::Config::from_lookup(|v| (v == "DLOCK_RESTART_QUARANTINE_MS").then(|| "soon".into()))
        .expect_err("not a number");
    assert!(err.to_string().contains("DLOCK_RESTART_QUARANTINE_MS"), "{err}");
}

/// The quarantine needs one slot for its marker: with Redis Cluster it is a
/// start-up error naming the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quarantine_is_refused_with_redis_cluster() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let err = RedisBackend::connect_with(&cluster.url(), "dlock", options).await.expect_err("not with a cluster");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("DLOCK_RESTART_QUARANTINE_MS"), "{err}");
}

/// The quarantine reads `INFO server`, which the ACL of `docs/backends.md`
/// (`-@dangerous`) refuses: `connect` says so, naming the variable and the
/// fix, instead of every acquire failing later; with `+info` it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quarantine_under_an_acl_without_info_is_a_startup_error() {
    let server = RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "locker", "on", ">pw", "~dlock:*", "&dlock:*", "+@all", "-@dangerous"])
        .query(&mut server.connection())
        .expect("ACL SETUSER");
    let url = format!("redis://locker:pw@127.0.0.1:{}", server.port());
    RedisBackend::connect(&url, "dlock").await.expect("without the quarantine the ACL is enough");

    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let err = RedisBackend::connect_with(&url, "dlock", options.clone()).await.expect_err("INFO is refused");
    assert!(err.is_misconfigured(), "{err}");
    let text = err.to_string();
    assert!(text.contains("DLOCK_RESTART_QUARANTINE_MS") && text.contains("ACL SETUSER <user> +info"), "{text}");
    assert!(!text.contains("pw@"), "password leaked: {text}");

    let _: () = redis::cmd("ACL").arg(&["SETUSER", "locker", "+info"]).query(&mut server.connection()).expect("+info");
    let locker = locker(RedisBackend::connect_with(&url, "dlock", options).await.expect("allowed now"));
    let k = locker.key("acl").part(1).build().expect("key");
    // A fresh server: refused as quarantined (not as NOPERM) until its
    // uptime reaches the quarantine, then granted.
    let (g, refusals) = acquire_eventually(&locker, &k).await;
    assert!(refusals.iter().all(quarantined), "{refusals:?}");
    assert!(g.release().await.expect("release"));
}

/// Claims `key` once the store's quarantine refusals stop (at most 20 s).
async fn claim_after_quarantine(store: &RedisStore, key: &str, lease: Duration) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match store.begin("s", key, "fp", ClaimTerms::new(lease)).await {
            Ok(Begin::New(_)) => return,
            Err(e) if quarantined(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Idempotency records under the same rule: a Redis restarted without
/// persistence has forgotten which keys already ran; with the quarantine
/// on, `begin` refuses (503) until the server's uptime reaches it, instead
/// of answering "new" and running a completed request again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_claims_are_quarantined_after_a_restart() {
    use dlock_core::idempotency::StoredResponse;

    let mut server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let store = RedisStore::connect_with(&server.url(), "dlock", options).await.expect("connect");
    let lease = Duration::from_secs(5);
    claim_after_quarantine(&store, "first", lease).await; // the first use's quarantine
    let Ok(Begin::New(claim)) = store.begin("s", "k", "fp", ClaimTerms::new(lease)).await else {
        panic!("a new key is claimed")
    };
    let response = StoredResponse::new(200, Vec::new(), b"done".to_vec());
    assert!(store.complete(&claim, &response).await.expect("complete"));
    assert!(matches!(store.begin("s", "k", "fp", ClaimTerms::new(lease)).await, Ok(Begin::Completed(_))));

    server.restart();
    let restarted = Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await; // reconnected meanwhile
    let err = store.begin("s", "k", "fp", ClaimTerms::new(lease)).await.expect_err("the record is gone: no claim yet");
    assert!(quarantined(&err), "{err}");
    claim_after_quarantine(&store, "k", lease).await;
    assert!(restarted.elapsed() >= QUARANTINE - Duration::from_secs(1), "{:?}", restarted.elapsed());
}

/// A flush this store saw (the data marker was there, now it is gone, the
/// server never restarted): `begin` is refused for a whole quarantine, as
/// a grant is. The begin script itself checks the marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_claims_are_quarantined_after_a_flush() {
    let server = RedisServer::start();
    tokio::time::sleep(QUARANTINE + Duration::from_millis(1_100)).await;
    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let store = RedisStore::connect_with(&server.url(), "dlock", options).await.expect("connect");
    let lease = Duration::from_secs(5);
    // The first use sits out one quarantine, as a lock's does.
    claim_after_quarantine(&store, "first", lease).await;
    assert!(marker_present(&server), "the first claim set the data marker");
    assert!(
        matches!(store.begin("s", "seen", "fp", ClaimTerms::new(lease)).await, Ok(Begin::New(_))),
        "the marker is seen"
    );

    let _: () = redis::cmd("FLUSHALL").query(&mut server.connection()).expect("FLUSHALL");
    let flushed = Instant::now();
    let err =
        store.begin("s", "first", "fp", ClaimTerms::new(lease)).await.expect_err("the records are gone: no claim yet");
    assert!(quarantined(&err), "{err}");
    claim_after_quarantine(&store, "first", lease).await;
    assert!(flushed.elapsed() >= QUARANTINE - Duration::from_millis(100), "{:?}", flushed.elapsed());
}
