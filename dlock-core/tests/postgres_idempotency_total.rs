//! Issue 38 item 6 (review 2026-12-07 A2) on the PostgreSQL store: every
//! store is bounded in total, records and bytes. A client that makes up a
//! caller per request (an unchecked `Authorization` value) meets a fresh
//! per-caller cap every time; only the total holds it back. Before, the
//! PostgreSQL store kept the per-caller caps and the unbound tokens' pool
//! only ("the totals of records and of bytes are not enforced").
//!
//! Each test runs both faces of the store where it has two: a claim by
//! its own statement ([`IdempotencyStore::begin`]) and one inside the
//! route's transaction ([`PostgresStore::begin_in`]), whose claim touches
//! no tally row and checks the total by reads alone.

#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_core::idempotency::{
    Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, PostgresStore, StoredResponse,
};
use dlock_core::Error;
use dlock_testing::PostgresServer;

/// Past the default TTL of a record (24 hours): the longest a refusal
/// may ask to wait when the oldest record is one of those.
const DAY: Duration = Duration::from_secs(24 * 3600 + 1);

async fn store(server: &PostgresServer, prefix: &str, limits: IdempotencyLimits) -> PostgresStore {
    PostgresStore::connect(&server.url(), prefix).await.expect("connect to the test PostgreSQL").with_limits(limits)
}

fn new(b: dlock_core::Result<Begin>) -> Claim {
    match b {
        Ok(Begin::New(c)) => c,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// `result` is the refusal of a full store: of the caller's cap
/// (`per_scope`) or of the total, to be tried again within `most`.
fn assert_full<T: std::fmt::Debug>(result: dlock_core::Result<T>, per_scope: bool, most: Duration, what: &str) {
    match result {
        Err(Error::IdempotencyFull { per_scope: p, retry_after }) => {
            assert_eq!(p, per_scope, "{what}: which cap");
            assert!(retry_after > Duration::ZERO && retry_after <= most, "{what}: retry after {retry_after:?}");
        }
        other => panic!("{what}: expected a full store (per_scope: {per_scope}), got {other:?}"),
    }
}

/// A claim inside a transaction of the store's pool, rolled back: what it
/// answered.
async fn begin_in_tx(store: &PostgresStore, scope: &str, key: &str, terms: ClaimTerms) -> dlock_core::Result<Begin> {
    let mut tx = store.pool().begin().await.expect("begin");
    let answer = store.begin_in(&mut tx, scope, key, "fp", terms).await;
    tx.rollback().await.expect("rollback");
    answer
}

/// Three callers fill a total of 3 records, each far below its own cap of
/// 10: a fourth caller's new key is refused as the store's total (503 over
/// HTTP), by its own statement and inside a transaction, while a key that
/// exists is still answered. An abandoned record gives its room back at
/// once, and so does one that expires (before any sweep: the claim at the
/// total discounts what expired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_capped_in_total_across_callers() {
    let server = PostgresServer::start();
    let limits = IdempotencyLimits::default().with_max_per_scope(10).with_max_records(3);
    let store = store(&server, "total", limits).await;
    let long = ClaimTerms::new(Duration::from_secs(30)).with_ttl(Duration::from_secs(60));
    let short = ClaimTerms::new(Duration::from_millis(400)).with_ttl(Duration::from_millis(400));

    // Below the total: every caller is let in (the control).
    let a1 = new(store.begin("alice", "a1", "fp", long).await);
    let b1 = new(store.begin("bob", "b1", "fp", long).await);
    let _c1 = new(store.begin("carol", "c1", "fp", short).await);
    assert_full(store.begin("dave", "d1", "fp", long).await, false, Duration::from_secs(1), "a fourth caller");
    assert_full(begin_in_tx(&store, "erin", "e1", long).await, false, Duration::from_secs(1), "inside a transaction");
    // What exists is still answered at the total.
    assert_eq!(store.begin("alice", "a1", "fp", long).await.expect("a retry"), Begin::InProgress);
    assert!(store.complete(&a1, &StoredResponse::new(201, vec![], b"paid".to_vec())).await.expect("complete"));
    assert!(matches!(store.begin("alice", "a1", "fp", long).await, Ok(Begin::Completed(_))), "replayed at the total");

    // Abandoned: room for one.
    assert!(store.abandon(&b1).await.expect("abandon"));
    let d1 = new(store.begin("dave", "d1", "fp", long).await);
    assert_full(store.begin("frank", "f1", "fp", long).await, false, Duration::from_secs(1), "full again");
    // c1 expires: room for one, on either face, with no sweep in between.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(matches!(begin_in_tx(&store, "erin", "e1", long).await, Ok(Begin::New(_))), "room inside a transaction");
    let f1 = new(store.begin("frank", "f1", "fp", long).await);
    assert_full(store.begin("gina", "g1", "fp", long).await, false, Duration::from_secs(61), "full once more");
    for claim in [&d1, &f1] {
        assert!(store.abandon(claim).await.expect("abandon"));
    }
}

/// A claim inside a transaction that commits counts toward the total once
/// it entered the tally (each store enters them every second): a new key
/// of another caller is then refused by its own statement too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_claimed_inside_transactions_count_toward_the_total() {
    let server = PostgresServer::start();
    let limits = IdempotencyLimits::default().with_max_per_scope(10).with_max_records(2);
    let store = store(&server, "txtotal", limits).await;
    let terms = ClaimTerms::new(Duration::from_secs(30));
    let done = StoredResponse::new(201, vec![], b"made".to_vec());
    for (scope, key) in [("alice", "a1"), ("bob", "b1")] {
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, scope, key, "fp", terms).await);
        assert!(store.complete_in(&mut tx, &claim, &done).await.expect("complete"));
        tx.commit().await.expect("commit");
    }
    // Entered within a second or two (the store's batch).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match store.begin("carol", "c1", "fp", terms).await {
            Err(Error::IdempotencyFull { per_scope: false, .. }) => break,
            Ok(Begin::New(c1)) => {
                assert!(store.abandon(&c1).await.expect("abandon"));
                assert!(tokio::time::Instant::now() < deadline, "the committed records never counted");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("a third caller: {other:?}"),
        }
    }
    assert_full(begin_in_tx(&store, "dave", "d1", terms).await, false, DAY, "inside a transaction");
}

/// Tokens bound to callers are capped in total too (with the records' count,
/// apart from them); the unbound tokens keep their own pool, and a spent
/// token gives its room back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_tokens_are_capped_in_total_across_callers() {
    let server = PostgresServer::start();
    let limits = IdempotencyLimits::default().with_max_per_scope(10).with_max_records(2).with_max_unbound_tokens(5);
    let store = store(&server, "tokens", limits).await;
    let ttl = Duration::from_secs(30);
    let a1 = store.issue_token(Some("alice"), ttl).await.expect("below the total");
    store.issue_token(Some("bob"), ttl).await.expect("below the total");
    assert_full(store.issue_token(Some("carol"), ttl).await, false, ttl, "a third caller's token");
    // The unbound pool and the records are apart.
    store.issue_token(None, ttl).await.expect("an unbound token");
    new(store.begin("carol", "c1", "fp", ClaimTerms::new(ttl)).await);
    // Spent: room for one.
    let claim = match store.claim_token(&a1, Some("alice"), Duration::from_secs(10)).await.expect("claim") {
        dlock_core::idempotency::TokenClaim::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    assert!(store.spend_token(&claim).await.expect("spend"));
    store.issue_token(Some("carol"), ttl).await.expect("room after a spend");
    assert_full(store.issue_token(Some("dave"), ttl).await, false, ttl, "full again");
}

/// The bytes of stored answers are capped in total: two callers, each far
/// below its own cap, fill it; an answer that does not fit is refused as
/// the total (nothing stored, the claim stays for a smaller one), by its
/// own statement and inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_bytes_are_capped_in_total_across_callers() {
    let server = PostgresServer::start();
    // 6 bytes of status and header count, then the body: 56 bytes each.
    let answer = |n: usize| StoredResponse::new(200, vec![], vec![b'x'; n]);
    let limits = IdempotencyLimits::default().with_max_bytes_per_scope(1000).with_max_bytes(120);
    let store = store(&server, "bytes", limits).await;
    let terms = ClaimTerms::new(Duration::from_secs(30));
    let a1 = new(store.begin("alice", "a1", "fp", terms).await);
    assert!(store.complete(&a1, &answer(50)).await.expect("below the total"));
    let b1 = new(store.begin("bob", "b1", "fp", terms).await);
    assert_full(store.complete(&b1, &answer(60)).await, false, DAY, "56 + 66 > 120");
    assert_eq!(store.begin("bob", "b1", "fp", terms).await.expect("begin"), Begin::InProgress, "the claim stays");
    assert!(store.complete(&b1, &answer(50)).await.expect("56 + 56 fit"));

    let mut tx = store.pool().begin().await.expect("begin");
    let c1 = new(store.begin_in(&mut tx, "carol", "c1", "fp", terms).await);
    assert_full(store.complete_in(&mut tx, &c1, &answer(10)).await, false, DAY, "112 + 16 > 120");
    assert!(store.complete_in(&mut tx, &c1, &answer(2)).await.expect("112 + 8 fit"));
    tx.commit().await.expect("commit");
    assert!(matches!(store.begin("carol", "c1", "fp", terms).await, Ok(Begin::Completed(_))));
}

/// Under a total far away, each caller's own caps still hold, on both
/// faces: records, and bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_callers_caps_still_hold_under_the_total() {
    let server = PostgresServer::start();
    let limits = IdempotencyLimits::default().with_max_per_scope(2).with_max_records(100).with_max_bytes_per_scope(100);
    let store = store(&server, "scope", limits).await;
    let terms = ClaimTerms::new(Duration::from_secs(30));
    let a1 = new(store.begin("alice", "a1", "fp", terms).await);
    new(store.begin("alice", "a2", "fp", terms).await);
    assert_full(store.begin("alice", "a3", "fp", terms).await, true, DAY, "alice's third key");
    assert_full(begin_in_tx(&store, "alice", "a3", terms).await, true, DAY, "inside a transaction");
    new(store.begin("bob", "b1", "fp", terms).await);
    let big = StoredResponse::new(200, vec![], vec![b'x'; 120]);
    assert_full(store.complete(&a1, &big).await, true, DAY, "alice's bytes");
}

/// The control: with the default caps, callers by the dozen are let in on
/// both faces, and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_default_caps_many_callers_are_let_in() {
    let server = PostgresServer::start();
    let store = store(&server, "plenty", IdempotencyLimits::default()).await;
    let terms = ClaimTerms::new(Duration::from_secs(30));
    for i in 0..40 {
        let scope = format!("caller-{i}");
        let claim = new(store.begin(&scope, "k", "fp", terms).await);
        assert!(store.complete(&claim, &StoredResponse::new(200, vec![], b"ok".to_vec())).await.expect("complete"));
        assert!(matches!(begin_in_tx(&store, &scope, "t", terms).await, Ok(Begin::New(_))));
        store.issue_token(Some(&scope), Duration::from_secs(30)).await.expect("a token");
    }
}

/// A database whose tally an earlier build kept (callers' pools, no
/// totals): the first start of this one sums the callers' pools into the
/// totals, so the records and tokens made before count toward them. The
/// earlier tally is made here by deleting the totals' rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tally_kept_without_totals_gets_them_at_start() {
    let server = PostgresServer::start();
    let limits = IdempotencyLimits::default().with_max_per_scope(10).with_max_records(3);
    let before = store(&server, "earlier", limits).await;
    let terms = ClaimTerms::new(Duration::from_secs(30));
    for scope in ["alice", "bob", "carol"] {
        let claim = new(before.begin(scope, "k", "fp", terms).await);
        assert!(before.complete(&claim, &StoredResponse::new(200, vec![], b"ok".to_vec())).await.expect("complete"));
        before.issue_token(Some(scope), Duration::from_secs(30)).await.expect("a token");
    }
    drop(before);
    server.psql("DELETE FROM earlier_idem_tally WHERE pool IN ('k', 't')");

    let after = store(&server, "earlier", limits).await;
    let sums = |filter: &str| {
        server.psql(&format!(
            "SELECT coalesce(sum(records), 0) || ':' || coalesce(sum(bytes), 0) FROM earlier_idem_tally WHERE {filter}"
        ))
    };
    assert_eq!(sums("pool = 'k'"), sums("pool LIKE 'k:%'"), "records and bytes");
    assert_eq!(sums("pool = 't'"), sums("pool LIKE 't:%'"), "bound tokens");
    assert_full(after.begin("dave", "k", "fp", terms).await, false, DAY, "the earlier records count");
    assert_full(after.issue_token(Some("dave"), Duration::from_secs(30)).await, false, DAY, "the earlier tokens count");
    // Summed once: a second start keeps the totals as they are.
    server.psql("UPDATE earlier_idem_tally SET records = records + 100 WHERE pool = 'k'");
    drop(store(&server, "earlier", limits).await);
    assert_ne!(sums("pool = 'k'"), sums("pool LIKE 'k:%'"), "summed again at a later start");
}
