//! A PostgreSQL acquire whose answer was lost is never forgotten (issue 38
//! item 2, review finding L1). The backend sends an acquire again when its
//! answer does not come in time; the first try may have committed its
//! grant all the same. When the retry then fails in another way (it cannot
//! connect, or the server refuses it), the error must still say that the
//! acquire may have run, so that the engine sends its owner-checked undo:
//! otherwise the committed grant, which nobody holds or renews, keeps every
//! other client out for a whole lease (the watchdog's 30 s here).
//!
//! Each test makes the first try's answer late with a `FaultProxy` delay
//! past the response timeout, so it commits and times out, and fails the
//! retry one way; then another client, straight to the server, must get
//! the key within a few seconds. Before the fix both failed: the other
//! client was refused (`Busy`) until the lease ended.
//!
//! The idempotency store sends its claims once (a second claim would find
//! the first's record and answer "in progress"): a claim whose answer was
//! lost returns at once with the mark, and is given back. The last test
//! holds it to that.

#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::Backend;
use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, PostgresStore};
use dlock_core::{LockKey, Locker, LockerOptions};
use dlock_testing::{FaultProxy, PostgresServer};
use tokio::time::Instant;

/// How soon another client must get a key whose grant was lost: far below
/// the watchdog's 30 s lease that an orphan grant would keep it for.
const PROMPTLY: Duration = Duration::from_secs(5);

/// A locker at `url`, with the default watchdog lease (30 s).
async fn locker(url: &str, response_timeout: Duration) -> Locker {
    let options = PostgresOptions::default().with_response_timeout(response_timeout);
    let backend = PostgresBackend::connect_with(url, "dlock", options).await.expect("connect");
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, LockerOptions::default()).expect("options")
}

/// Through `proxy` to the server.
fn proxied(proxy: &FaultProxy) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port())
}

/// Live heads of `key`: a grant that holds it.
fn live_heads(server: &PostgresServer, key: &LockKey) -> u32 {
    let sql = format!(
        "SELECT count(*) FROM dlock_locks WHERE key = '{}' AND expires_at > clock_timestamp()",
        key.as_str().replace('\'', "''")
    );
    server.psql(&sql).parse().expect("a count")
}

/// Another client, straight to the server, tries `key` until it gets it;
/// panics with what it saw when that takes longer than [`PROMPTLY`].
async fn another_client_gets(server: &PostgresServer, key: &LockKey, failed_with: &str) {
    let other = locker(&server.url(), Duration::from_secs(2)).await;
    let started = Instant::now();
    loop {
        match other.try_acquire(key).await {
            Ok(guard) => {
                assert!(guard.release().await.expect("release"));
                return;
            }
            Err(e) if e.is_contention() && started.elapsed() < PROMPTLY => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "another client still cannot get the key after {:?}: {e:?} ({} live grant(s)); the lost acquire \
                 failed with {failed_with}",
                started.elapsed(),
                live_heads(server, key)
            ),
        }
    }
}

/// The review's probe: the first try commits and its answer comes 700 ms
/// late (timeout 300 ms); the retry needs a new connection, whose
/// handshake is late too, so it cannot connect in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_acquire_whose_answer_was_lost_does_not_block_the_key() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let lossy = locker(&proxied(&proxy), Duration::from_millis(300)).await;
    let key = lossy.key("lost-answer").part(1).build().expect("key");
    // A cycle first: the first try goes out on a kept connection.
    lossy.try_acquire(&key).await.expect("free").release().await.expect("release");

    proxy.set_delay(Duration::from_millis(700));
    let err = lossy.try_acquire(&key).await.expect_err("every answer is late");
    assert!(err.is_unavailable(), "{err:?}");
    assert_eq!(live_heads(&server, &key), 1, "the first try committed its grant: {err:?}");
    proxy.set_delay(Duration::ZERO);

    another_client_gets(&server, &key, &format!("{err:?}")).await;
}

/// The retry reaches the server and is refused by it (a database error):
/// the lock table is renamed away between the first try's commit and the
/// retry, and renamed back once the acquire has failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_acquire_whose_retry_is_refused_by_the_server_does_not_block_the_key() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let timeout = Duration::from_secs(1);
    let lossy = Arc::new(locker(&proxied(&proxy), timeout).await);
    let key = lossy.key("refused-retry").part(1).build().expect("key");
    lossy.try_acquire(&key).await.expect("free").release().await.expect("release");

    // The first try's answer is late; its grant commits at once.
    proxy.set_delay(Duration::from_secs(3));
    let sent = Instant::now();
    let (l, k) = (lossy.clone(), key.clone());
    let acquire = tokio::spawn(async move { l.try_acquire(&k).await.map(drop) });
    while live_heads(&server, &key) == 0 {
        assert!(sent.elapsed() < timeout / 2, "the first try did not land in {:?}", sent.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Before the retry (at the timeout): it connects at once, and the
    // server refuses its statement.
    server.psql("ALTER TABLE dlock_locks RENAME TO dlock_locks_away");
    proxy.set_delay(Duration::ZERO);
    assert!(sent.elapsed() < timeout, "set up too late for the retry: {:?}", sent.elapsed());
    let err = acquire.await.expect("acquire task").expect_err("the retry was refused");
    server.psql("ALTER TABLE dlock_locks_away RENAME TO dlock_locks");
    assert!(format!("{err:?}").contains("dlock_locks"), "refused by the server: {err:?}");

    another_client_gets(&server, &key, &format!("{err:?}")).await;
}

/// A key claimed through the store whose answer comes 700 ms late
/// (timeout 300 ms) is given back: another client's claim of it is new
/// within moments, not `InProgress` for the claim's 20 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_store_claim_whose_answer_was_lost_is_given_back() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let options = PostgresOptions::default().with_response_timeout(Duration::from_millis(300));
    let lossy = PostgresStore::connect_with(&proxied(&proxy), "dlock", options).await.expect("store");
    let terms = ClaimTerms::new(Duration::from_secs(20));
    // A claim first: the next goes out on a kept connection.
    assert!(matches!(lossy.begin("alice", "warm-up", "fp", terms).await, Ok(Begin::New(_))));

    proxy.set_delay(Duration::from_millis(700));
    let err = lossy.begin("alice", "k", "fp", terms).await.expect_err("its answer is late");
    assert!(err.is_unavailable(), "{err:?}");
    let claimed = server.psql("SELECT count(*) FROM dlock_idem_keys WHERE key = 'k' AND owner IS NOT NULL");
    assert_eq!(claimed, "1", "the claim committed: {err:?}");
    proxy.set_delay(Duration::ZERO);

    let other = PostgresStore::connect(&server.url(), "dlock").await.expect("store");
    let started = Instant::now();
    loop {
        match other.begin("alice", "k", "fp", terms).await.expect("claim") {
            Begin::New(_) => break,
            Begin::InProgress if started.elapsed() < PROMPTLY => sleep_a_little().await,
            begun => panic!("after {:?}: {begun:?}; the lost claim failed with {err:?}", started.elapsed()),
        }
    }
}

async fn sleep_a_little() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}
