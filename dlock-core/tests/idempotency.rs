//! One behavioural suite for the idempotency stores, run against the memory
//! store and a real redis-server (and a Redis Cluster).

mod tokens;
use tokens::Consume;

use std::sync::Arc;
use std::time::Duration;

use dlock_core::idempotency::{
    fingerprint, release_claim, Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, MemoryStore,
    RecordState, RecordView, RedisStore, StoredResponse, TokenClaim,
};
use dlock_core::Error;

async fn suite(store: Arc<dyn IdempotencyStore>) {
    tokens(&store).await;
    keys(&store).await;
    owner_checks(&store).await;
    lease_expiry(&store).await;
    response_expiry(&store).await;
    concurrent_tokens(store.clone()).await;
    claimed_tokens(&store).await;
    token_leases(&store).await;
    bound_tokens(&store).await;
    concurrent_claims(store.clone()).await;
    operator_view(&store).await;
    concurrent_begin(store).await;
}

/// Issue 40: an operator sees a record (its state, size, time left and a
/// claim's age), the claims stuck past their lease, longest first, a
/// caller's records and bytes against its caps, and releases a stuck claim
/// on purpose: the retry then runs. A completed record is no claim; a
/// reason is required.
async fn operator_view(store: &Arc<dyn IdempotencyStore>) {
    let (scope, fp) = ("operator-caller", fingerprint(&["operator"]));
    let (short, long) = (ClaimTerms::new(Duration::from_millis(150)), ClaimTerms::new(Duration::from_secs(30)));
    assert_eq!(store.usage(Some(scope)).await.expect("usage").records, 0);
    let Begin::New(done) = store.begin(scope, "done", &fp, long).await.expect("begin") else { panic!("claim") };
    let answer = StoredResponse::new(201, vec![], b"paid".to_vec());
    assert!(store.complete(&done, &answer).await.expect("complete"));
    let Begin::New(_dead) = store.begin(scope, "dead", &fp, short).await.expect("begin") else { panic!("claim") };
    let Begin::New(live) = store.begin(scope, "live", &fp, long).await.expect("begin") else { panic!("claim") };

    let completed = store.inspect_record(scope, "done").await.expect("inspect").expect("a record");
    assert_eq!(completed.state, RecordState::Completed { status: 201 }, "{completed:?}");
    assert!(completed.bytes > 0 && completed.expires_in > Duration::from_secs(3600), "{completed:?}");
    let running = store.inspect_record(scope, "live").await.expect("inspect").expect("a record");
    assert!(
        matches!(running.state, RecordState::InProgress { lease_left: Some(left) } if left > Duration::from_secs(20)),
        "{running:?}"
    );
    assert!(store.inspect_record(scope, "nothing").await.expect("inspect").is_none());
    let usage = store.usage(Some(scope)).await.expect("usage");
    assert_eq!((usage.records, usage.bytes), (3, completed.bytes), "{usage:?}");
    assert!(usage.max_records > 0 && usage.max_bytes > 0, "{usage:?}");
    let total = store.usage(None).await.expect("usage");
    assert!(total.records >= 3 && total.max_records >= usage.max_records, "{total:?}");

    assert!(running.age.is_some_and(|age| age < Duration::from_secs(20)), "a claim's age: {running:?}");
    tokio::time::sleep(Duration::from_millis(250)).await;
    let stuck = store.inspect_record(scope, "dead").await.expect("inspect").expect("a record");
    assert!(stuck.is_stuck(), "{stuck:?}");
    assert!(stuck.age.is_some_and(|age| age >= Duration::from_millis(240)), "its age since its claim: {stuck:?}");
    // A second stuck claim, newer: listed after the first.
    let Begin::New(_newer) = store.begin(scope, "dead-too", &fp, short).await.expect("begin") else { panic!("claim") };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let listed = store.stuck_records(1000).await.expect("stuck");
    assert!(listed.iter().all(RecordView::is_stuck), "{listed:?}");
    let at = |key: &str| listed.iter().position(|r| r.scope == scope && r.key == key);
    assert!(matches!((at("dead"), at("dead-too")), (Some(a), Some(b)) if a < b), "longest first: {listed:?}");
    assert!(!listed.iter().any(|r| r.key == "live" || r.key == "done"), "{listed:?}");
    let first = store.stuck_records(1).await.expect("stuck");
    assert_eq!(first.len(), 1, "limit: {first:?}");
    let refused = release_claim(store.as_ref(), scope, "dead", " ").await.expect_err("no reason");
    assert!(matches!(refused, Error::InvalidArgument { .. }), "{refused:?}");
    assert!(release_claim(store.as_ref(), scope, "done", "test").await.expect("release").is_none(), "no claim");
    let released = release_claim(store.as_ref(), scope, "dead", "test: its instance died").await.expect("release");
    assert!(released.is_some_and(|r| r.is_stuck()));
    assert!(matches!(store.begin(scope, "dead", &fp, long).await.expect("begin"), Begin::New(_)), "the retry runs");
    // A claim in progress, released on purpose: its request can no longer settle it.
    assert!(release_claim(store.as_ref(), scope, "live", "test: dead instance").await.expect("release").is_some());
    assert!(!store.complete(&live, &answer).await.expect("complete"), "no longer its claim");
}

/// The lease of the token claims of these tests.
const LEASE: Duration = Duration::from_secs(30);

/// The claim of a `TokenClaim::Claimed`.
fn claimed(answer: TokenClaim) -> Claim {
    match answer {
        TokenClaim::Claimed(claim) => claim,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Issue 15 item 5: a token claimed for a running request can be given back
/// (the route did not run or failed) or spent; while claimed nobody else
/// takes it, by claim or by consume; only the claim's owner settles it.
async fn claimed_tokens(store: &Arc<dyn IdempotencyStore>) {
    let t = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    let first = claimed(store.claim_token(&t, None, LEASE).await.expect("claim"));
    assert_eq!(store.claim_token(&t, None, LEASE).await.expect("claim"), TokenClaim::InUse);
    assert!(!store.consume(&t).await.expect("consume"), "a claimed token is not consumed by another");
    assert!(store.return_token(&first).await.expect("return"));
    assert!(!store.return_token(&first).await.expect("return"), "given back once");
    let second = claimed(store.claim_token(&t, None, LEASE).await.expect("claim"));
    assert!(!store.return_token(&first).await.expect("return"), "a stale claim gives nothing back");
    assert!(!store.spend_token(&first).await.expect("spend"), "a stale claim spends nothing");
    assert!(store.spend_token(&second).await.expect("spend")); // DEL 1
    assert_eq!(store.claim_token(&t, None, LEASE).await.expect("claim"), TokenClaim::Unknown);
    assert!(!store.return_token(&second).await.expect("return"), "a spent token stays spent");
    assert!(!store.consume(&t).await.expect("consume"));
    assert_eq!(store.claim_token("not-a-token", None, LEASE).await.expect("claim"), TokenClaim::Unknown);
    // The claim keeps the token's TTL: a claimed token still expires.
    let short = store.issue_token(None, Duration::from_millis(80)).await.expect("issue");
    let claim = claimed(store.claim_token(&short, None, LEASE).await.expect("claim"));
    tokio::time::sleep(Duration::from_millis(160)).await;
    assert!(!store.return_token(&claim).await.expect("return"), "expired while claimed");
    assert_eq!(store.claim_token(&short, None, LEASE).await.expect("claim"), TokenClaim::Unknown);
}

/// Issue 24: a token claim renewed while its route runs outlives its first
/// lease; one whose instance died answers "outcome unknown" once its lease
/// ends (it counts as spent: never run twice), and its owner may still
/// settle it late.
async fn token_leases(store: &Arc<dyn IdempotencyStore>) {
    let lease = Duration::from_millis(150);
    let t = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    let alive = claimed(store.claim_token(&t, None, lease).await.expect("claim"));
    for _ in 0..4 {
        tokio::time::sleep(lease / 3).await;
        assert!(store.renew(&alive, lease).await.expect("renew"));
    }
    assert_eq!(store.claim_token(&t, None, lease).await.expect("claim"), TokenClaim::InUse);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    assert_eq!(store.claim_token(&t, None, lease).await.expect("claim"), TokenClaim::OutcomeUnknown);
    assert!(!store.consume(&t).await.expect("consume"), "still claimed");
    assert!(!store.renew(&alive, lease).await.expect("renew"), "a lease that ran out is not renewed");
    assert!(store.spend_token(&alive).await.expect("spend"), "its owner settles it late");
    assert_eq!(store.claim_token(&t, None, lease).await.expect("claim"), TokenClaim::Unknown);
}

/// Issue 15 item 3: a token bound to a caller is taken by that caller's
/// claims only: not by another caller, not unbound, not by `consume_token`.
async fn bound_tokens(store: &Arc<dyn IdempotencyStore>) {
    let t = store.issue_token(Some("alice"), Duration::from_secs(30)).await.expect("issue");
    assert_eq!(store.claim_token(&t, Some("bob"), LEASE).await.expect("claim"), TokenClaim::Unknown);
    assert_eq!(store.claim_token(&t, None, LEASE).await.expect("claim"), TokenClaim::Unknown);
    assert!(!store.consume(&t).await.expect("consume"), "an unbound consume does not take it"); // DEL 0
    let first = claimed(store.claim_token(&t, Some("alice"), LEASE).await.expect("claim"));
    assert_eq!(first.principal(), Some("alice"));
    assert!(store.return_token(&first).await.expect("return"));
    let second = claimed(store.claim_token(&t, Some("alice"), LEASE).await.expect("claim"));
    assert!(!store.spend_token(&first).await.expect("spend"), "a stale claim cannot spend the live one"); // DEL 0
    assert!(store.spend_token(&second).await.expect("spend")); // DEL 1
    assert_eq!(store.claim_token(&t, Some("alice"), LEASE).await.expect("claim"), TokenClaim::Unknown);
}

async fn concurrent_claims(store: Arc<dyn IdempotencyStore>) {
    let token = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (store, token) = (store.clone(), token.clone());
            tokio::spawn(async move { store.claim_token(&token, None, LEASE).await.expect("claim") })
        })
        .collect();
    let mut claims = 0;
    for t in tasks {
        match t.await.expect("task") {
            TokenClaim::Claimed(_) => claims += 1,
            TokenClaim::InUse => {}
            other => panic!("a live token answered {other:?}"),
        }
    }
    assert_eq!(claims, 1, "exactly one claimant");
}

async fn tokens(store: &Arc<dyn IdempotencyStore>) {
    let a = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    let b = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    assert_ne!(a, b);
    assert_eq!(a.len(), 32, "128 bits as hex");
    assert!(store.consume(&a).await.expect("consume"));
    assert!(!store.consume(&a).await.expect("consume"), "used twice");
    assert!(!store.consume("not-a-token").await.expect("consume"));
    assert!(!store.consume(&"0".repeat(32)).await.expect("consume"), "never issued");
    let short = store.issue_token(None, Duration::from_millis(50)).await.expect("issue");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(!store.consume(&short).await.expect("consume"), "expired");
    assert!(store.consume(&b).await.expect("consume"));
}

async fn keys(store: &Arc<dyn IdempotencyStore>) {
    let lease = Duration::from_secs(30);
    let fp = fingerprint(&["POST", "/pay", "{\"a\":1}"]);
    let other = fingerprint(&["POST", "/pay", "{\"a\":2}"]);
    let Begin::New(claim) = store.begin("alice", "k1", &fp, ClaimTerms::new(lease)).await.expect("begin") else {
        panic!("first begin must claim")
    };
    assert_eq!(store.begin("alice", "k1", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::InProgress);
    assert_eq!(store.begin("alice", "k1", &other, ClaimTerms::new(lease)).await.expect("begin"), Begin::Mismatch);
    // Another scope is another key.
    let Begin::New(bob) = store.begin("bob", "k1", &fp, ClaimTerms::new(lease)).await.expect("begin") else {
        panic!("scoped")
    };
    let response = StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec()), ("x-bin".into(), vec![0, 255, 10])],
        b"{\"payment_id\":\"p1\"}\0\xff".to_vec(),
    );
    assert!(store.complete(&claim, &response).await.expect("complete"));
    assert!(!store.complete(&claim, &response).await.expect("complete"), "only once");
    assert_eq!(
        store.begin("alice", "k1", &fp, ClaimTerms::new(lease)).await.expect("begin"),
        Begin::Completed(response.clone())
    );
    assert_eq!(store.begin("alice", "k1", &other, ClaimTerms::new(lease)).await.expect("begin"), Begin::Mismatch);
    assert_eq!(store.begin("bob", "k1", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::InProgress);
    // Abandon frees the key; a retry claims it again.
    assert!(store.abandon(&bob).await.expect("abandon"));
    assert!(!store.abandon(&bob).await.expect("abandon"), "already freed");
    let Begin::New(again) = store.begin("bob", "k1", &other, ClaimTerms::new(lease)).await.expect("begin") else {
        panic!("freed key can be claimed, even with another payload")
    };
    assert!(store.abandon(&again).await.expect("abandon"));
    // Scope/key boundaries cannot be shifted to reach another record.
    assert!(matches!(store.begin("alic", "ek1", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::New(_)));
}

async fn owner_checks(store: &Arc<dyn IdempotencyStore>) {
    let fp = fingerprint(&["x"]);
    let Begin::New(first) =
        store.begin("s", "lease", &fp, ClaimTerms::new(Duration::from_millis(60))).await.expect("begin")
    else {
        panic!("claim")
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(!store.renew(&first, Duration::from_secs(30)).await.expect("renew"), "a lease that ran out is not renewed");
    let taking_over = ClaimTerms::new(Duration::from_secs(30)).run_again_after_lease();
    let Begin::New(second) = store.begin("s", "lease", &fp, taking_over).await.expect("begin") else {
        panic!("lease ran out, and these terms take the key over")
    };
    let resp = StoredResponse::new(200, vec![], b"late".to_vec());
    assert!(!store.complete(&first, &resp).await.expect("complete"), "stale owner");
    assert!(!store.abandon(&first).await.expect("abandon"), "stale owner");
    assert!(!store.renew(&first, Duration::from_secs(30)).await.expect("renew"), "stale owner");
    assert!(store.renew(&second, Duration::from_secs(30)).await.expect("renew"), "the live claim is renewed");
    assert_eq!(
        store.begin("s", "lease", &fp, ClaimTerms::new(Duration::from_secs(30))).await.expect("begin"),
        Begin::InProgress
    );
    assert!(store.complete(&second, &resp).await.expect("complete"));
}

/// Issue 24: a claim renewed while its route runs outlives its first lease;
/// one whose instance died answers "outcome unknown" once its lease ends,
/// for the record's TTL (or is taken afresh, when the terms say so); and
/// its owner may still complete it late, as nobody took it over.
async fn lease_expiry(store: &Arc<dyn IdempotencyStore>) {
    let fp = fingerprint(&["crash"]);
    let lease = Duration::from_millis(150);
    // Renewed: still in progress well after the first lease.
    let Begin::New(alive) = store.begin("s", "alive", &fp, ClaimTerms::new(lease)).await.expect("begin") else {
        panic!("claim")
    };
    for _ in 0..4 {
        tokio::time::sleep(lease / 3).await;
        assert!(store.renew(&alive, lease).await.expect("renew"));
    }
    assert_eq!(store.begin("s", "alive", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::InProgress);
    // A crashed instance: claimed, never renewed, completed nor abandoned.
    assert!(matches!(store.begin("s", "crash", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::New(_)));
    assert_eq!(store.begin("s", "crash", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::InProgress);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    assert_eq!(store.begin("s", "crash", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::OutcomeUnknown);
    assert_eq!(store.begin("s", "crash", "other", ClaimTerms::new(lease)).await.expect("begin"), Begin::Mismatch);
    assert_eq!(
        store.begin("s", "crash", &fp, ClaimTerms::new(lease)).await.expect("begin"),
        Begin::OutcomeUnknown,
        "final"
    );
    assert!(matches!(
        store.begin("s", "crash", &fp, ClaimTerms::new(lease).run_again_after_lease()).await.expect("begin"),
        Begin::New(_)
    ));
    // A slow owner whose lease ran out, not taken over, still completes.
    let Begin::New(slow) =
        store.begin("s", "slow", &fp, ClaimTerms::new(Duration::from_millis(50))).await.expect("begin")
    else {
        panic!("claim")
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let resp = StoredResponse::new(201, vec![], b"late".to_vec());
    assert!(store.complete(&slow, &resp).await.expect("complete"));
    assert_eq!(store.begin("s", "slow", &fp, ClaimTerms::new(lease)).await.expect("begin"), Begin::Completed(resp));
}

async fn response_expiry(store: &Arc<dyn IdempotencyStore>) {
    let fp = fingerprint(&["ttl"]);
    // A record lives its terms' TTL from its claim, answered or not.
    let terms = ClaimTerms::new(Duration::from_millis(50)).with_ttl(Duration::from_millis(80));
    let Begin::New(c) = store.begin("s", "ttl", &fp, terms).await.expect("begin") else { panic!("claim") };
    let resp = StoredResponse::new(204, vec![], vec![]);
    assert!(store.complete(&c, &resp).await.expect("complete"));
    assert_eq!(
        store.begin("s", "ttl", &fp, ClaimTerms::new(Duration::from_secs(5))).await.expect("begin"),
        Begin::Completed(resp)
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(matches!(
        store.begin("s", "ttl", &fp, ClaimTerms::new(Duration::from_secs(5))).await.expect("begin"),
        Begin::New(_)
    ));
}

async fn concurrent_tokens(store: Arc<dyn IdempotencyStore>) {
    let token = store.issue_token(None, Duration::from_secs(30)).await.expect("issue");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (store, token) = (store.clone(), token.clone());
            tokio::spawn(async move { store.consume(&token).await.expect("consume") })
        })
        .collect();
    let mut won = 0;
    for t in tasks {
        won += usize::from(t.await.expect("task"));
    }
    assert_eq!(won, 1, "exactly one consumer");
}

async fn concurrent_begin(store: Arc<dyn IdempotencyStore>) {
    let fp = fingerprint(&["storm"]);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (store, fp) = (store.clone(), fp.clone());
            tokio::spawn(async move {
                store.begin("s", "storm", &fp, ClaimTerms::new(Duration::from_secs(30))).await.expect("begin")
            })
        })
        .collect();
    let mut new = 0;
    for t in tasks {
        match t.await.expect("task") {
            Begin::New(_) => new += 1,
            Begin::InProgress => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(new, 1, "exactly one claim");
}

/// The caps of these tests: 2 live records per caller, 3 in all.
fn small() -> IdempotencyLimits {
    IdempotencyLimits::default().with_max_per_scope(2).with_max_records(3).with_max_unbound_tokens(2)
}

/// `d`, and the width of a bucket of the Redis store's pools (a 64th of
/// it, ledger.lua), by which a full pool's `Retry-After` may pass the
/// oldest entry's expiry.
fn bucketed(d: Duration) -> Duration {
    d + d / 32
}

/// Whether `result` is the refusal of a full store, of the caller's cap
/// (`per_scope`) or of the total, with a `Retry-After` within `most`.
fn assert_full<T: std::fmt::Debug>(result: dlock_core::Result<T>, per_scope: bool, most: Duration) {
    match result {
        Err(Error::IdempotencyFull { per_scope: p, retry_after }) => {
            assert_eq!(p, per_scope, "which cap");
            assert!(retry_after > Duration::ZERO && retry_after <= most, "retry after {retry_after:?}");
        }
        other => panic!("expected a full store (per_scope: {per_scope}), got {other:?}"),
    }
}

/// Issue 16: records are capped per scope and in total, atomically; a key
/// that exists is still answered at the cap; expiry, abandon and complete
/// never leak a count. `total`: whether the store has one total to reach
/// here (not on Redis Cluster, whose total is split into shards: see
/// tests/idempotency_cluster_total.rs).
async fn record_caps(store: &Arc<dyn IdempotencyStore>, total: bool) {
    let (fp, lease, ttl) = (fingerprint(&["caps"]), Duration::from_secs(30), Duration::from_secs(60));
    // An in-progress record lives for the terms' TTL: here, its lease.
    let terms = ClaimTerms::new(lease).with_ttl(lease);
    let new = |b: Begin| match b {
        Begin::New(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    };
    let k1 = new(store.begin("alice", "k1", &fp, terms).await.expect("begin"));
    let k2 = new(store.begin("alice", "k2", &fp, terms).await.expect("begin"));
    assert_full(store.begin("alice", "k3", &fp, terms).await, true, bucketed(lease));
    // At the cap, what exists is still answered: a retry is replayed.
    let resp = StoredResponse::new(201, vec![], b"paid".to_vec());
    assert!(store.complete(&k1, &resp).await.expect("complete"));
    assert_eq!(store.begin("alice", "k1", &fp, terms).await.expect("replay"), Begin::Completed(resp));
    assert_eq!(store.begin("alice", "k2", &fp, terms).await.expect("begin"), Begin::InProgress);
    assert_eq!(store.begin("alice", "k2", "other", terms).await.expect("begin"), Begin::Mismatch);
    // Completing kept the count at 2 (no double count), abandoning frees one.
    assert_full(store.begin("alice", "k3", &fp, terms).await, true, ttl);
    assert!(store.abandon(&k2).await.expect("abandon"));
    let short = Duration::from_millis(300);
    let _k3 =
        new(store.begin("alice", "k3", &fp, ClaimTerms::new(short).with_ttl(short)).await.expect("room after abandon"));
    // Another caller has a cap of its own; the total is 3 (k1, k3, b1).
    let _b1 = new(store.begin("bob", "b1", &fp, terms).await.expect("begin"));
    if total {
        assert_full(store.begin("carol", "c1", &fp, terms).await, false, Duration::from_secs(1));
    } else {
        let c1 = new(store.begin("carol", "c1", &fp, terms).await.expect("no total cap here"));
        assert!(store.abandon(&c1).await.expect("abandon"));
    }
    // A record that expires by its TTL stops counting.
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    let c1 = new(store.begin("carol", "c1", &fp, terms).await.expect("room after expiry"));
    assert!(store.abandon(&c1).await.expect("abandon"));
    let k4 = new(store.begin("alice", "k4", &fp, terms).await.expect("alice's room after expiry"));
    assert_full(store.begin("alice", "k5", &fp, terms).await, true, ttl);
    assert!(store.abandon(&k4).await.expect("abandon"));
}

/// Issue 16: tokens are capped the same way: bound ones per caller and in
/// total; consume and spend free room, a claim or a return does not,
/// expiry does. Issue 24: unbound tokens (issued to nobody in particular)
/// come from a pool of their own, on a Cluster too, and filling it leaves
/// identified callers' tokens and records alone.
async fn token_caps(store: &Arc<dyn IdempotencyStore>, total: bool) {
    let (ttl, short) = (Duration::from_secs(30), Duration::from_millis(300));
    let a1 = store.issue_token(Some("alice"), ttl).await.expect("issue");
    let _a2 = store.issue_token(Some("alice"), short).await.expect("issue");
    assert_full(store.issue_token(Some("alice"), ttl).await, true, bucketed(short));
    // Claimed and given back: still live, still counted.
    let claim = claimed(store.claim_token(&a1, Some("alice"), LEASE).await.expect("claim"));
    assert_full(store.issue_token(Some("alice"), ttl).await, true, bucketed(short));
    assert!(store.return_token(&claim).await.expect("return"));
    assert_full(store.issue_token(Some("alice"), ttl).await, true, bucketed(short));
    // Spent: room for one more.
    let claim = claimed(store.claim_token(&a1, Some("alice"), LEASE).await.expect("claim"));
    assert!(store.spend_token(&claim).await.expect("spend"));
    let a3 = store.issue_token(Some("alice"), ttl).await.expect("room after spend");
    // Bound total: a2, a3 and b1 make 3.
    let b1 = store.issue_token(Some("bob"), ttl).await.expect("issue");
    if total {
        assert_full(store.issue_token(Some("carol"), ttl).await, false, bucketed(short));
    }
    // Unbound: a pool of 2, apart; full, it refuses unbound tokens only.
    let u1 = store.issue_token(None, ttl).await.expect("issue");
    let _u2 = store.issue_token(None, ttl).await.expect("issue");
    assert_full(store.issue_token(None, ttl).await, false, bucketed(ttl));
    assert!(
        matches!(store.begin("dave", "d1", "fp", ClaimTerms::new(ttl)).await, Ok(Begin::New(_))),
        "records unaffected"
    );
    assert!(store.consume(&u1).await.expect("consume"));
    let _u3 = store.issue_token(None, ttl).await.expect("room after consume");
    let claim = claimed(store.claim_token(&b1, Some("bob"), LEASE).await.expect("claim"));
    assert!(store.spend_token(&claim).await.expect("spend"));
    // a2 expires: alice has room again.
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    let a4 = store.issue_token(Some("alice"), ttl).await.expect("room after expiry");
    assert_full(store.issue_token(Some("alice"), ttl).await, true, bucketed(ttl));
    for t in [a3, a4] {
        let claim = claimed(store.claim_token(&t, Some("alice"), LEASE).await.expect("claim"));
        assert!(store.spend_token(&claim).await.expect("spend"));
    }
}

/// Issue 24: the bytes of stored answers are capped per caller and in
/// total: an answer that does not fit is refused (nothing stored, the claim
/// stays, so the layer can keep a small refusal instead); abandoning or
/// expiring gives the bytes back.
async fn byte_caps(store: &Arc<dyn IdempotencyStore>, total: bool) {
    let terms = ClaimTerms::new(Duration::from_secs(30));
    let new = |b: Begin| match b {
        Begin::New(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    };
    let kib = |n: usize| StoredResponse::new(200, vec![], vec![b'x'; n * 1024]);
    let e1 = new(store.begin("erin", "e1", "fp", terms).await.expect("begin"));
    assert!(store.complete(&e1, &kib(6)).await.expect("complete"));
    let e2 = new(store.begin("erin", "e2", "fp", terms).await.expect("begin"));
    assert_full(store.complete(&e2, &kib(6)).await, true, bucketed(Duration::from_secs(24 * 3600)));
    assert_eq!(store.begin("erin", "e2", "fp", terms).await.expect("begin"), Begin::InProgress, "the claim stays");
    assert!(store.complete(&e2, &kib(1)).await.expect("a small answer fits"));
    if total {
        let f1 = new(store.begin("frank", "f1", "fp", terms).await.expect("begin"));
        assert_full(store.complete(&f1, &kib(9)).await, false, bucketed(Duration::from_secs(24 * 3600)));
        assert!(store.abandon(&f1).await.expect("abandon"));
    }
}

async fn caps(store: Arc<dyn IdempotencyStore>, total: bool) {
    record_caps(&store, total).await;
    token_caps(&store, total).await;
}

/// The byte caps of these tests: 10 KiB per caller, 16 KiB in all.
fn small_bytes() -> IdempotencyLimits {
    IdempotencyLimits::default().with_max_bytes_per_scope(10 * 1024).with_max_bytes(16 * 1024)
}

#[tokio::test]
async fn memory_store_byte_caps() {
    byte_caps(&(Arc::new(MemoryStore::new().with_limits(small_bytes())) as Arc<dyn IdempotencyStore>), true).await;
}

#[tokio::test]
async fn redis_store_byte_caps() {
    let redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "bytes").await.expect("connect").with_limits(small_bytes());
    byte_caps(&(Arc::new(store) as Arc<dyn IdempotencyStore>), true).await;
}

/// A Cluster splits the total into 16 shards (each in a slot of its own),
/// tested apart (tests/idempotency_cluster_total.rs): here each shard holds
/// twice the single server's whole total, more than these tests ever keep,
/// so that the callers' caps are what they meet.
fn sharded(limits: IdempotencyLimits) -> IdempotencyLimits {
    limits.with_max_records(limits.max_records() * 32).with_max_bytes(limits.max_bytes() * 32)
}

#[tokio::test]
async fn redis_cluster_store_byte_caps() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let limits = sharded(small_bytes());
    let store = RedisStore::connect(&cluster.url(), "bytes").await.expect("connect").with_limits(limits);
    byte_caps(&(Arc::new(store) as Arc<dyn IdempotencyStore>), false).await;
}

#[tokio::test]
async fn memory_store_caps() {
    caps(Arc::new(MemoryStore::new().with_limits(small())), true).await;
}

#[tokio::test]
async fn redis_store_caps() {
    let redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "caps").await.expect("connect").with_limits(small());
    caps(Arc::new(store), true).await;
    // The pools count exactly what lives: k1 (completed), b1 (running) and
    // d1 (running); no bound token, and u2 and u3 unbound.
    let mut conn = redis.connection();
    let mut count = |pattern: &str| -> usize {
        let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(&mut conn).expect("keys");
        keys.len()
    };
    let (records, unbound) = (count("caps:idem:r:*"), count("caps:idem:t:{anon}:*"));
    let bound = count("caps:idem:t:*") + count("caps:idem:tu:*") - unbound;
    let counted = |key: &str| -> String {
        let mut conn = redis.connection();
        let total: Option<String> = redis::cmd("HGET").arg(key).arg("t").query(&mut conn).expect("HGET");
        total.unwrap_or_default()
    };
    assert_eq!((records, counted("caps:idem:rp:all").split(':').next()), (3, Some("3")), "records live and counted");
    assert_eq!((bound, counted("caps:idem:tp:all").split(':').next()), (0, Some("0")), "bound tokens live and counted");
    assert_eq!((unbound, counted("caps:idem:tp:{anon}").split(':').next()), (2, Some("2")), "unbound tokens");
}

#[tokio::test]
async fn redis_cluster_store_caps() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url(), "caps").await.expect("connect").with_limits(sharded(small()));
    caps(Arc::new(store), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store() {
    suite(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store() {
    let redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "t").await.expect("connect");
    let store: Arc<dyn IdempotencyStore> = Arc::new(store);
    suite(store.clone()).await;
    // Claiming is one script call that decides, never a GET then a write
    // from the client (two callers could both see the token fresh): 3 fresh
    // tokens claimed and 2 of them asked again (in use), 5 calls in all.
    let live = [0; 3].map(|_| store.issue_token(None, Duration::from_secs(30)));
    let mut tokens = Vec::new();
    for t in live {
        tokens.push(t.await.expect("issue"));
    }
    redis.reset_stats();
    let lease = Duration::from_secs(10);
    for t in &tokens {
        assert!(matches!(store.claim_token(t, None, lease).await.expect("claim"), TokenClaim::Claimed(_)));
    }
    for t in &tokens[..2] {
        assert!(matches!(store.claim_token(t, None, lease).await.expect("claim"), TokenClaim::InUse));
    }
    assert_eq!(redis.command_calls("evalsha"), 5, "one script call per claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster_store() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url(), "t").await.expect("connect");
    suite(Arc::new(store)).await;
}

#[tokio::test]
async fn dead_redis_is_an_error_not_a_hang() {
    let mut redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "t").await.expect("connect");
    redis.kill();
    let started = std::time::Instant::now();
    let err = store.consume(&"a".repeat(32)).await.expect_err("server is down");
    assert!(err.is_unavailable(), "{err}");
    let err = store.begin("s", "k", "fp", ClaimTerms::new(Duration::from_secs(1))).await.expect_err("server is down");
    assert!(err.is_unavailable(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// The caps of the configuration reach the stores it builds: in process,
/// and in the lock backend's Redis, both through `Config::build`.
#[tokio::test]
async fn configured_caps_reach_the_store() {
    let redis = dlock_testing::RedisServer::start();
    let url = redis.url();
    let vars = move |backend: bool| {
        let url = url.clone();
        dlock_core::Config::from_lookup(move |var| match var {
            "DLOCK_IDEMPOTENCY_MAX_PER_SCOPE" => Some("1".into()),
            "DLOCK_BACKEND" if backend => Some("redis".into()),
            "DLOCK_REDIS_URL" if backend => Some(url.clone()),
            _ => None,
        })
        .expect("config")
    };
    let in_process = vars(false).build().await.expect("memory").idempotency_store().expect("memory store").clone();
    let shared = vars(true).build().await.expect("redis").idempotency_store().expect("redis store").clone();
    for store in [in_process, shared] {
        let lease = Duration::from_secs(5);
        let terms = ClaimTerms::new(lease).with_ttl(lease);
        assert!(matches!(store.begin("alice", "k1", "fp", terms).await.expect("begin"), Begin::New(_)));
        assert_full(store.begin("alice", "k2", "fp", terms).await, true, bucketed(lease));
    }
}

/// Issue 16: records in the lock keyspace of a Redis that evicts keys would
/// let a flood of records evict held locks, so that is a start-up error
/// naming `DLOCK_IDEMPOTENCY_REDIS_URL`; another database starts (with a
/// warning), `noeviction` starts, and a policy the ACL hides starts (with a
/// warning: the caps are what is left).
#[tokio::test]
async fn records_never_share_an_evicting_lock_keyspace() {
    let evicting = dlock_testing::RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
    let config = |lock: String, records: Option<String>| {
        dlock_core::Config::from_lookup(move |var| match var {
            "DLOCK_BACKEND" => Some("redis".into()),
            "DLOCK_REDIS_URL" => Some(lock.clone()),
            "DLOCK_IDEMPOTENCY_REDIS_URL" => records.clone(),
            _ => None,
        })
        .expect("config")
    };
    let refused = |e: Error| match e {
        Error::Config { var, reason } => {
            assert_eq!(var, "DLOCK_IDEMPOTENCY_REDIS_URL");
            assert!(reason.contains("volatile-lru") && reason.contains("redis://host:6379/1"), "{reason}");
        }
        other => panic!("expected a configuration error, got {other}"),
    };
    // By default, and named explicitly (as `localhost`): the lock keyspace.
    let url = evicting.url();
    refused(config(url.clone(), None).build().await.expect_err("shared by default"));
    let same = url.replace("127.0.0.1", "localhost") + "/0";
    refused(config(url.clone(), Some(same.clone())).build().await.expect_err("own connection, same place"));
    // Another database of the same server.
    let dlock = config(url.clone(), Some(format!("{url}/1"))).build().await.expect("another database");
    let store = dlock.idempotency_store().expect("records");
    let Begin::New(_) = store.begin("s", "k", "fp", ClaimTerms::new(Duration::from_secs(5))).await.expect("begin")
    else {
        panic!("a fresh key is claimed")
    };
    // `noeviction` beside the locks: allowed, the caps guard it.
    let noeviction = dlock_testing::RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    config(noeviction.url(), None).build().await.expect("noeviction is allowed");
    // A user the ACL does not let read CONFIG: allowed, with a warning.
    let mut admin = evicting.connection();
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config"][..])
        .query(&mut admin)
        .expect("acl");
    let app = url.replace("redis://", "redis://app:pw@");
    config(app.clone(), None).build().await.expect("policy unknown: the caps are what is left");
}

/// Issue 16, the threat itself: a flood of new keys from many callers into
/// the lock Redis (`noeviction`, 4 MB). The total cap stops the records long
/// before the server is full, so locks are still granted; without it (the
/// cap set above what fits) the flood fills the server and locking fails.
#[tokio::test]
async fn a_flood_of_records_cannot_fill_the_lock_redis() {
    let server = dlock_testing::RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]);
    let url = server.url();
    let services = dlock_core::Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("redis".into()),
        "DLOCK_REDIS_URL" => Some(url.clone()),
        "DLOCK_IDEMPOTENCY_MAX_RECORDS" => Some("1000".into()),
        _ => None,
    })
    .expect("config")
    .build()
    .await
    .expect("noeviction beside the locks is allowed");
    let (store, locker) = (services.idempotency_store().expect("records").clone(), services.locker().clone());
    let response = StoredResponse::new(201, vec![], vec![b'x'; 1024]);
    let (mut stored, mut full) = (0, 0);
    for i in 0..5000 {
        match store.begin(&format!("caller-{i}"), "k", "fp", ClaimTerms::new(Duration::from_secs(60))).await {
            Ok(Begin::New(claim)) => {
                assert!(store.complete(&claim, &response).await.expect("complete"));
                stored += 1;
            }
            Err(Error::IdempotencyFull { per_scope: false, .. }) => full += 1,
            other => panic!("record {i}: {other:?}"),
        }
    }
    assert_eq!((stored, full), (1000, 4000), "the total cap holds");
    let key = locker.key("after-the-flood").build().expect("key");
    let guard = locker.try_acquire(&key).await.expect("a lock is still granted");
    assert!(guard.release().await.expect("release"));
}

/// A caller's counting set lives exactly as long as its last record: its
/// first record gives it a TTL, a record that lives longer extends it, and
/// one that lives shorter does not shorten it (issue 17: one `PEXPIREAT …
/// GT` instead of reading the set's last member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_counting_set_lives_as_long_as_its_last_record() {
    let redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "t").await.expect("connect");
    let fp = fingerprint(&["POST", "/pay", "{}"]);
    let set_ttl = || -> i64 {
        let mut conn = redis.connection();
        let sets: Vec<String> = redis::cmd("KEYS").arg("t:idem:rp:{*}").query(&mut conn).expect("KEYS");
        assert_eq!(sets.len(), 1, "one caller, one pool: {sets:?}");
        redis::cmd("PTTL").arg(&sets[0]).query(&mut conn).expect("PTTL")
    };
    // A record lives its terms' TTL; its pool until the record's bucket
    // ends, at most a 64th of that later.
    let claim_for = |secs| ClaimTerms::new(Duration::from_secs(1)).with_ttl(Duration::from_secs(secs));
    let Begin::New(first) = store.begin("alice", "k1", &fp, claim_for(30)).await.expect("begin") else {
        panic!("first begin must claim")
    };
    let ttl = set_ttl();
    assert!((29_000..=31_000).contains(&ttl), "a new pool gets its first record's TTL: {ttl} ms");
    let response = StoredResponse::new(201, Vec::new(), b"{}".to_vec());
    assert!(store.complete(&first, &response).await.expect("complete"));
    let Begin::New(_long) = store.begin("alice", "k2", &fp, claim_for(60)).await.expect("begin") else {
        panic!("a second key claims")
    };
    let ttl = set_ttl();
    assert!((59_000..=61_000).contains(&ttl), "a longer-lived record extends it: {ttl} ms");
    let Begin::New(_short) = store.begin("alice", "k3", &fp, claim_for(1)).await.expect("begin") else {
        panic!("a third key claims")
    };
    let ttl = set_ttl();
    assert!((59_000..=61_000).contains(&ttl), "a shorter-lived one does not shorten it: {ttl} ms");
}

/// Issue 24: a claim whose answer timed out (Redis stalled past the
/// response timeout: the request is told to retry) ran on the server all
/// the same; the store gives it back in the background, owner-checked, so
/// the retry claims the key at once instead of being told "in progress"
/// for a lease. The replies come late through a proxy: the script runs on
/// time, its answer misses the response timeout (1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_timed_out_does_not_block_the_key() {
    let server = dlock_testing::RedisServer::start();
    let proxy = dlock_testing::FaultProxy::start(server.port());
    let a = RedisStore::connect(&format!("redis://127.0.0.1:{}", proxy.port()), "stall").await.expect("connect");
    let b = RedisStore::connect(&server.url(), "stall").await.expect("connect");
    let (fp, terms) = (fingerprint(&["stalled"]), ClaimTerms::new(Duration::from_secs(30)));
    // Warm the script, so the late answer is the claim itself.
    let Begin::New(warm) = a.begin("s", "warm", &fp, terms).await.expect("begin") else { panic!("claim") };
    assert!(a.abandon(&warm).await.expect("abandon"));
    proxy.set_delay(Duration::from_millis(1_500));
    let err = a.begin("s", "stalled", &fp, terms).await.expect_err("the answer times out");
    assert!(err.is_unavailable(), "{err}");
    proxy.set_delay(Duration::ZERO);
    let records =
        || -> Vec<String> { redis::cmd("KEYS").arg("stall:idem:r:*").query(&mut server.connection()).expect("KEYS") };
    let claimed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match b.begin("s", "stalled", &fp, terms).await.expect("begin") {
                Begin::New(claim) => return claim,
                Begin::InProgress => tokio::time::sleep(Duration::from_millis(20)).await,
                other => panic!("{other:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the key stayed claimed after the timed-out begin: {:?}", records()));
    assert!(b.abandon(&claimed).await.expect("abandon"));
}

/// Issue 24: a token claim whose answer timed out ran on the server all the
/// same; the store gives it back, owner-checked, so the resubmit can use the
/// token instead of being told "in progress" (and then "outcome unknown").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_claim_whose_answer_timed_out_gives_the_token_back() {
    let server = dlock_testing::RedisServer::start();
    let proxy = dlock_testing::FaultProxy::start(server.port());
    let a = RedisStore::connect(&format!("redis://127.0.0.1:{}", proxy.port()), "stall").await.expect("connect");
    let b = RedisStore::connect(&server.url(), "stall").await.expect("connect");
    // Warm the script, so the late answer is the claim itself.
    let warm = a.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    let claim = claimed(a.claim_token(&warm, None, LEASE).await.expect("claim"));
    assert!(a.spend_token(&claim).await.expect("spend"));
    let token = a.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    proxy.set_delay(Duration::from_millis(1_500));
    let err = a.claim_token(&token, None, LEASE).await.expect_err("the answer times out");
    assert!(err.is_unavailable(), "{err}");
    proxy.set_delay(Duration::ZERO);
    let claim = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match b.claim_token(&token, None, LEASE).await.expect("claim") {
                TokenClaim::Claimed(claim) => return claim,
                TokenClaim::InUse => tokio::time::sleep(Duration::from_millis(20)).await,
                other => panic!("{other:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the token stayed claimed after the timed-out claim"));
    assert!(b.spend_token(&claim).await.expect("spend"));
}

/// Issue 24 (the review's probe C3): unbound tokens are capped on Redis
/// Cluster too. They were counted only in the total, which a Cluster cannot
/// count, so 50 of 50 were issued with every cap at 10; they now live in
/// one slot with their own pool.
#[tokio::test]
async fn unbound_tokens_are_capped_on_a_redis_cluster() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let limits = IdempotencyLimits::default().with_max_per_scope(10).with_max_records(10).with_max_unbound_tokens(10);
    let store = RedisStore::connect(&cluster.url(), "anon").await.expect("connect").with_limits(limits);
    let mut issued = 0;
    for _ in 0..50 {
        match store.issue_token(None, Duration::from_secs(60)).await {
            Ok(_) => issued += 1,
            Err(Error::IdempotencyFull { per_scope: false, .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(issued, 10, "the unbound pool holds");
    // Identified callers are not affected by the anonymous pool being full.
    store.issue_token(Some("alice"), Duration::from_secs(60)).await.expect("a bound token");
}

/// The PostgreSQL store runs the same suite, its totals included.
#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use dlock_core::idempotency::PostgresStore;
    use dlock_testing::PostgresServer;

    async fn store(server: &PostgresServer, prefix: &str, limits: IdempotencyLimits) -> Arc<dyn IdempotencyStore> {
        let store = PostgresStore::connect(&server.url(), prefix).await.expect("connect to the test PostgreSQL");
        Arc::new(store.with_limits(limits))
    }

    /// A request of a store on its own pool is its statement's round trip
    /// and no more: the connection is kept for the next request, not given
    /// back to sqlx's pool, which would test it with a round trip of its
    /// own first. A proxy holds every answer 40 ms, on a pool of one
    /// connection: 4 claims and their answers take 8 answers (16 with the
    /// connection given back after each request: seen).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_request_costs_one_round_trip_on_a_kept_connection() {
        use dlock_core::backend::postgres::PostgresOptions;
        let server = PostgresServer::start();
        let proxy = dlock_testing::FaultProxy::start(server.port());
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
        let options = PostgresOptions::default().with_max_connections(1);
        let store = PostgresStore::connect_with(&url, "kept", options).await.expect("connect");
        let (fp, answer) = (fingerprint(&["POST", "/pay"]), StoredResponse::new(201, vec![], b"paid".to_vec()));
        let request = |key: String| {
            let (store, fp, answer) = (&store, &fp, &answer);
            async move {
                let terms = ClaimTerms::new(Duration::from_secs(30));
                let Begin::New(claim) = store.begin("alice", &key, fp, terms).await.expect("begin") else {
                    panic!("a new key is claimed")
                };
                assert!(store.complete(&claim, answer).await.expect("complete"));
            }
        };
        request("warm".into()).await; // The statements are prepared on the connection.
        let delay = Duration::from_millis(40);
        proxy.set_delay(delay);
        let started = tokio::time::Instant::now();
        for i in 0..4 {
            request(format!("k{i}")).await;
        }
        let took = started.elapsed();
        assert!(took >= 8 * delay, "every answer was held: {took:?}");
        assert!(took < 12 * delay, "more than the statements' round trips: {took:?} for 8 answers of {delay:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_store() {
        let server = PostgresServer::start();
        suite(store(&server, "t", IdempotencyLimits::default()).await).await;
        caps(store(&server, "caps", small()).await, true).await;
        byte_caps(&store(&server, "bytes", small_bytes()).await, true).await;
        // The pools count what lives: k1, b1, d1 (records), u2 and u3 (unbound).
        let live = |table: &str| server.psql(&format!("SELECT count(*) FROM {table} WHERE expires_at > now()"));
        assert_eq!(live("caps_idem_keys"), "3", "records");
        assert_eq!(live("caps_idem_tokens"), "2", "tokens");
        for prefix in ["t", "caps", "bytes"] {
            tallies_match(&server, prefix);
        }
    }

    /// Through PgBouncer in transaction mode, where each statement outside
    /// a transaction may run on another server session: the store's suite,
    /// and a claim inside the route's transaction that rolls back and then
    /// commits, every step of it on the session of that transaction. The
    /// tallies still match the rows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_store_works_through_a_transaction_pool() {
        let server = PostgresServer::start();
        let pooler = dlock_testing::PgBouncer::start(&server);
        let url = pooler.url();
        let store = PostgresStore::connect(&url, "pooled").await.expect("connect through PgBouncer");
        suite(Arc::new(store)).await;
        let store = PostgresStore::connect(&url, "pooled").await.expect("connect through PgBouncer");
        server.psql("CREATE TABLE payments (id text PRIMARY KEY)");
        let terms = ClaimTerms::new(Duration::from_secs(10));
        let paid = StoredResponse::new(201, vec![], b"paid".to_vec());
        for commit in [false, true] {
            let mut tx = store.pool().begin().await.expect("begin");
            let claim = new(store.begin_in(&mut tx, "alice", "tx", "fp", terms).await.expect("claim"));
            sqlx::query("INSERT INTO payments VALUES ('p1')").execute(&mut *tx).await.expect("write");
            assert_eq!(store.begin("alice", "tx", "fp", terms).await.expect("dup"), Begin::InProgress);
            assert!(store.complete_in(&mut tx, &claim, &paid).await.expect("complete"));
            if commit {
                tx.commit().await.expect("commit");
            } else {
                tx.rollback().await.expect("rollback");
                assert_eq!(server.psql("SELECT count(*) FROM pooled_idem_keys WHERE key LIKE '%tx%'"), "0");
            }
        }
        assert_eq!(server.psql("SELECT count(*) FROM payments"), "1");
        assert_eq!(store.begin("alice", "tx", "fp", terms).await.expect("replay"), Begin::Completed(paid));
        enter(&server, "pooled");
        tallies_match(&server, "pooled");
    }

    /// Runs the batch that enters committed records in the tallies (each
    /// store runs it every second), and answers how many it entered.
    fn enter(server: &PostgresServer, prefix: &str) -> String {
        server.psql(&format!("SELECT \"{prefix}_ik_enter_v2\"()"))
    }

    /// The tallies count exactly the rows there are (expired ones included
    /// until they are swept), and the bytes of their answers; a row of a
    /// transaction that did not enter the tally yet counts as what it
    /// carries (what an expired row it overwrote still has there). The
    /// totals ('k' records, 't' bound tokens) are their callers' pools summed.
    fn tallies_match(server: &PostgresServer, prefix: &str) {
        let rows = server.psql(&format!(
            "SELECT (SELECT coalesce(sum(CASE WHEN counted THEN 1 ELSE carried_records END), 0) FROM {prefix}_idem_keys) \
             || ':' || (SELECT coalesce(sum(CASE WHEN counted THEN bytes ELSE carried END), 0) FROM {prefix}_idem_keys) \
             || ':' || (SELECT count(*) FROM {prefix}_idem_tokens)"
        ));
        let tally = server.psql(&format!(
            "SELECT coalesce(sum(records) FILTER (WHERE pool LIKE 'k:%'), 0) || ':' \
             || coalesce(sum(bytes) FILTER (WHERE pool LIKE 'k:%'), 0) || ':' \
             || coalesce(sum(records) FILTER (WHERE pool LIKE 't:%' OR pool = 'u'), 0) FROM {prefix}_idem_tally"
        ));
        assert_eq!(tally, rows, "{prefix}: the tally (records:bytes:tokens) against the rows");
        let totals = server.psql(&format!(
            "SELECT coalesce(sum(records) FILTER (WHERE pool = 'k'), 0) || ':' \
             || coalesce(sum(bytes) FILTER (WHERE pool = 'k'), 0) || ':' \
             || coalesce(sum(records) FILTER (WHERE pool = 't'), 0) || ' = ' \
             || coalesce(sum(records) FILTER (WHERE pool LIKE 'k:%'), 0) || ':' \
             || coalesce(sum(bytes) FILTER (WHERE pool LIKE 'k:%'), 0) || ':' \
             || coalesce(sum(records) FILTER (WHERE pool LIKE 't:%'), 0) FROM {prefix}_idem_tally"
        ));
        let (kept, summed) = totals.split_once(" = ").expect("two sides");
        assert_eq!(kept, summed, "{prefix}: the totals (records:bytes:bound tokens) against the callers' pools");
    }

    /// A claim inside a transaction enters its caller's tally after its
    /// commit (in the batch each store runs every second), once, and not
    /// at all when it rolls back; at the cap, it is refused like any other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_inside_transactions_keep_the_tally() {
        let server = PostgresServer::start();
        let limits = IdempotencyLimits::default().with_max_per_scope(2);
        let store = PostgresStore::connect(&server.url(), "tally").await.expect("connect").with_limits(limits);
        let terms = ClaimTerms::new(Duration::from_secs(10));
        let done = StoredResponse::new(200, vec![], b"ok".to_vec());
        for (key, commit) in [("k1", false), ("k1", true), ("k2", true)] {
            let mut tx = store.pool().begin().await.expect("begin");
            let claim = new(store.begin_in(&mut tx, "erin", key, "fp", terms).await.expect("claim"));
            assert!(store.complete_in(&mut tx, &claim, &done).await.expect("complete"));
            if commit {
                tx.commit().await.expect("commit");
                // Entered by this call or by the store's own batch, once:
                // the tally matches the rows after a second call too.
                enter(&server, "tally");
                enter(&server, "tally");
            } else {
                tx.rollback().await.expect("rollback");
            }
            tallies_match(&server, "tally");
        }
        let mut tx = store.pool().begin().await.expect("begin");
        let full = store.begin_in(&mut tx, "erin", "k3", "fp", terms).await;
        assert!(matches!(full, Err(Error::IdempotencyFull { per_scope: true, .. })), "{full:?}");
        drop(tx);
        // An expired record of a key, claimed again inside a transaction,
        // stays one record; its old answer's bytes leave the tally.
        let short = ClaimTerms::new(Duration::from_millis(100)).with_ttl(Duration::from_millis(100));
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "fred", "f1", "fp", short).await.expect("claim"));
        assert!(store.complete_in(&mut tx, &claim, &done).await.expect("complete"));
        tx.commit().await.expect("commit");
        enter(&server, "tally");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "fred", "f1", "fp", terms).await.expect("expired: claimed again"));
        let bigger = StoredResponse::new(200, vec![], b"a longer answer".to_vec());
        assert!(store.complete_in(&mut tx, &claim, &bigger).await.expect("complete"));
        tx.commit().await.expect("commit");
        enter(&server, "tally");
        tallies_match(&server, "tally");
        // One that expires before it entered the tally: the sweep of its
        // row takes out nothing more than what the tally holds for it.
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "fred", "f2", "fp", short).await.expect("claim"));
        assert!(store.complete_in(&mut tx, &claim, &done).await.expect("complete"));
        tx.commit().await.expect("commit");
        tokio::time::sleep(Duration::from_millis(200)).await;
        server.psql("SELECT \"tally_ik_sweep_v2\"(NULL, 0)");
        assert_eq!(server.psql("SELECT count(*) FROM tally_idem_keys WHERE scope = 'fred'"), "1", "f1 lives, f2 swept");
        tallies_match(&server, "tally");
    }

    /// The index of the rows still to enter the tally is on the key, so
    /// that one caller's claims do not all insert at one leaf page; the
    /// index an earlier build made on the caller is dropped at connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_index_of_rows_to_enter_the_tally_is_on_the_key() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "shape").await.expect("connect");
        drop(store);
        server.psql("CREATE INDEX \"shape_idem_keys_pending\" ON shape_idem_keys (scope) WHERE NOT counted");
        let store = PostgresStore::connect(&server.url(), "shape").await.expect("connect again");
        let indexes = server.psql(
            "SELECT string_agg(indexname || ': ' || indexdef, E'\n' ORDER BY indexname) FROM pg_indexes \
             WHERE tablename = 'shape_idem_keys' AND indexdef LIKE '%WHERE%'",
        );
        assert!(!indexes.contains("shape_idem_keys_pending"), "the earlier index stays: {indexes}");
        assert!(indexes.contains("shape_idem_keys_todo") && indexes.contains("(key) WHERE (NOT counted)"), "{indexes}");
        drop(store);
    }

    /// A table an earlier build made, without the claims' times, gains the
    /// column at connect: its old rows show no age, a new claim shows its
    /// own, and the claim made inside a route's transaction too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_table_of_an_earlier_build_gains_the_claims_times() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "aged").await.expect("connect");
        drop(store);
        server.psql("ALTER TABLE aged_idem_keys DROP COLUMN claimed_at");
        server.psql(
            "INSERT INTO aged_idem_keys (scope, key, fingerprint, owner, lease_until, expires_at) \
             VALUES ('ivan', 'old', 'fp', 'someone', now() + interval '1 minute', now() + interval '1 hour')",
        );
        let store = PostgresStore::connect(&server.url(), "aged").await.expect("connect again");
        let old = store.inspect_record("ivan", "old").await.expect("inspect").expect("the old row");
        assert_eq!(old.age, None, "{old:?}");
        let terms = ClaimTerms::new(Duration::from_secs(10));
        new(store.begin("ivan", "new", "fp", terms).await.expect("claim"));
        let mut tx = store.pool().begin().await.expect("begin");
        new(store.begin_in(&mut tx, "ivan", "in-tx", "fp", terms).await.expect("claim"));
        tx.commit().await.expect("commit");
        tokio::time::sleep(Duration::from_millis(50)).await;
        for key in ["new", "in-tx"] {
            let view = store.inspect_record("ivan", key).await.expect("inspect").expect("a record");
            assert!(view.age.is_some_and(|age| age >= Duration::from_millis(40)), "{key}: {view:?}");
        }
    }

    /// Records committed inside transactions enter the tally however fast
    /// they come: a backlog of several batches (here 2,500 rows, as if
    /// committed since the last tick) is entered by one tick, not by one
    /// batch of 1,000 a second, which would let a caller's cap hold late.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_backlog_of_committed_claims_enters_the_tally_in_one_tick() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "backlog").await.expect("connect");
        server.psql(
            "INSERT INTO backlog_idem_keys (scope, key, fingerprint, owner, response, bytes, expires_at, counted) \
             SELECT 'hana', 'k' || g, 'fp', NULL, 'ok', 2, now() + interval '1 hour', false \
             FROM generate_series(1, 2500) AS g",
        );
        // The store's first tick comes a second after it connected.
        tokio::time::sleep(Duration::from_millis(1700)).await;
        let pending = server.psql("SELECT count(*) FROM backlog_idem_keys WHERE NOT counted");
        assert_eq!(pending, "0", "rows left out of the tally after one tick");
        tallies_match(&server, "backlog");
        drop(store);
    }

    /// The caller's byte cap holds for answers stored inside transactions,
    /// counting the answers of the caller's committed transactions once
    /// they entered the tally: an answer over it is refused, nothing is
    /// stored, and the claim stays for a smaller one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn answers_inside_transactions_keep_the_byte_cap() {
        let server = PostgresServer::start();
        let limits = IdempotencyLimits::default().with_max_bytes_per_scope(100);
        let store = PostgresStore::connect(&server.url(), "bytes").await.expect("connect").with_limits(limits);
        let terms = ClaimTerms::new(Duration::from_secs(10));
        // 6 bytes of status and header count, then the body.
        let half = StoredResponse::new(200, vec![], vec![b'h'; 50]);
        let small = StoredResponse::new(200, vec![], b"ok".to_vec());
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "gina", "g1", "fp", terms).await.expect("claim"));
        let over = StoredResponse::new(200, vec![], vec![b'x'; 200]);
        let refused = store.complete_in(&mut tx, &claim, &over).await;
        assert!(matches!(refused, Err(Error::IdempotencyFull { per_scope: true, .. })), "{refused:?}");
        assert!(store.complete_in(&mut tx, &claim, &half).await.expect("56 bytes of 100 fit"));
        tx.commit().await.expect("commit");
        enter(&server, "bytes");
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "gina", "g2", "fp", terms).await.expect("claim"));
        let refused = store.complete_in(&mut tx, &claim, &half).await;
        assert!(matches!(refused, Err(Error::IdempotencyFull { per_scope: true, .. })), "56 + 56 > 100: {refused:?}");
        assert!(store.complete_in(&mut tx, &claim, &small).await.expect("56 + 8 fit"));
        tx.commit().await.expect("commit");
        assert_eq!(store.begin("gina", "g1", "fp", terms).await.expect("replay"), Begin::Completed(half));
        assert_eq!(store.begin("gina", "g2", "fp", terms).await.expect("replay"), Begin::Completed(small));
        enter(&server, "bytes");
        tallies_match(&server, "bytes");
    }

    /// The common claim and answer inside a transaction (a new key, under
    /// the caps) are plain statements, with one read of the caller's tally
    /// between them: with the two functions that answer every other case
    /// renamed away, they still claim, answer and commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_common_claim_and_answer_in_a_transaction_call_no_function() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "plain").await.expect("connect");
        let terms = ClaimTerms::new(Duration::from_secs(10));
        let rename = |away: bool| {
            let [(begin_from, begin_to), (done_from, done_to)] =
                if away { [("v3", "away"), ("v2", "away")] } else { [("away", "v3"), ("away", "v2")] };
            server.psql(&format!(
                "ALTER FUNCTION \"plain_ik_begin_{begin_from}\" RENAME TO \"plain_ik_begin_{begin_to}\"; \
                 ALTER FUNCTION \"plain_ik_done_{done_from}\" RENAME TO \"plain_ik_done_{done_to}\""
            ))
        };
        rename(true);
        let done = StoredResponse::new(201, vec![], b"made".to_vec());
        for key in ["p1", "p2"] {
            let mut tx = store.pool().begin().await.expect("begin");
            let claim = new(store.begin_in(&mut tx, "paula", key, "fp", terms).await.expect("a plain claim"));
            assert!(store.complete_in(&mut tx, &claim, &done).await.expect("a plain answer"));
            tx.commit().await.expect("commit");
        }
        rename(false);
        assert_eq!(store.begin("paula", "p2", "fp", terms).await.expect("replay"), Begin::Completed(done));
        enter(&server, "plain");
        tallies_match(&server, "plain");
    }

    fn new(b: Begin) -> Claim {
        match b {
            Begin::New(c) => c,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    /// Issue 27 item 2: a claim made inside a transaction lives and dies
    /// with it. Rolled back (a panic, an error, a dead instance), it leaves
    /// no record and the next request runs; committed with its answer, the
    /// answer is there for every retry; while it runs, a duplicate is told
    /// "in progress" at once, whichever way it claims.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_claim_inside_a_transaction_commits_or_rolls_back_with_it() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "tx").await.expect("connect");
        server.psql("CREATE TABLE payments (id text PRIMARY KEY)");
        let terms = ClaimTerms::new(Duration::from_secs(10));
        let paid = StoredResponse::new(201, vec![], b"paid".to_vec());

        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "alice", "k1", "fp", terms).await.expect("claim"));
        sqlx::query("INSERT INTO payments VALUES ('p1')").execute(&mut *tx).await.expect("write");
        // A duplicate meanwhile: in progress, by either way of claiming,
        // without waiting for the transaction.
        let mut other = store.pool().begin().await.expect("begin");
        let started = std::time::Instant::now();
        assert_eq!(store.begin_in(&mut other, "alice", "k1", "fp", terms).await.expect("dup"), Begin::InProgress);
        assert_eq!(store.begin("alice", "k1", "fp", terms).await.expect("dup"), Begin::InProgress);
        assert!(started.elapsed() < Duration::from_secs(1), "a duplicate never waits for the running one");
        drop(other);
        assert!(store.complete_in(&mut tx, &claim, &paid).await.expect("complete"));
        tx.rollback().await.expect("rollback");
        assert_eq!(server.psql("SELECT count(*) FROM payments"), "0");
        assert_eq!(server.psql("SELECT count(*) FROM tx_idem_keys"), "0", "no record after a rollback");

        // The retry runs, commits: writes and answer together.
        let mut tx = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut tx, "alice", "k1", "fp", terms).await.expect("the retry runs"));
        sqlx::query("INSERT INTO payments VALUES ('p1')").execute(&mut *tx).await.expect("write");
        assert!(store.complete_in(&mut tx, &claim, &paid).await.expect("complete"));
        tx.commit().await.expect("commit");
        assert_eq!(server.psql("SELECT count(*) FROM payments"), "1");
        assert_eq!(store.begin("alice", "k1", "fp", terms).await.expect("replay"), Begin::Completed(paid.clone()));
        let mut tx = store.pool().begin().await.expect("begin");
        assert_eq!(store.begin_in(&mut tx, "alice", "k1", "fp", terms).await.expect("replay"), Begin::Completed(paid));
        assert_eq!(store.begin_in(&mut tx, "alice", "k1", "other", terms).await.expect("mismatch"), Begin::Mismatch);
    }

    /// A transaction whose instance stopped (here: a task that holds it
    /// and sleeps) is ended by the server once it stays idle for the
    /// lease: the key is free again, and the stopped one cannot commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stopped_transaction_loses_its_claim_after_the_lease() {
        let server = PostgresServer::start();
        let store = PostgresStore::connect(&server.url(), "tx").await.expect("connect");
        let terms = ClaimTerms::new(Duration::from_millis(500));
        let mut stopped = store.pool().begin().await.expect("begin");
        let claim = new(store.begin_in(&mut stopped, "bob", "k", "fp", terms).await.expect("claim"));
        assert_eq!(store.begin("bob", "k", "fp", terms).await.expect("dup"), Begin::InProgress);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut tx = store.pool().begin().await.expect("begin");
        let retry = new(store.begin_in(&mut tx, "bob", "k", "fp", terms).await.expect("free after the lease"));
        let done = StoredResponse::new(200, vec![], b"ok".to_vec());
        assert!(store.complete_in(&mut tx, &retry, &done).await.expect("complete"));
        tx.commit().await.expect("commit");
        // The stopped instance wakes up: its transaction is gone.
        let late = store.complete_in(&mut stopped, &claim, &done).await;
        let committed = match late {
            Ok(_) => stopped.commit().await.is_ok(),
            Err(_) => false,
        };
        assert!(!committed, "a transaction ended by the server cannot commit");
        assert_eq!(store.begin("bob", "k", "fp", terms).await.expect("replay"), Begin::Completed(done));
    }
}
