//! Issue 38 item 6 (review 2026-12-07 A2): the Redis store is bounded in
//! total on a Redis Cluster too. Before, a Cluster counted only per caller
//! (one count cannot span the slots), so callers made up per request
//! (a fresh `Authorization` value each) grew the records without bound. The
//! total is now split into shards, each in a slot of its own with the
//! records and tokens of its callers; these tests fill it from many callers
//! on a real three-master Cluster.

use std::time::Duration;

use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyLimits, IdempotencyStore, RedisStore, StoredResponse};
use dlock_core::Error;

/// How many callers flood the store: enough that every shard fills.
const CALLERS: usize = 200;

/// What a claim, an answer or a token met: stored, or refused by the
/// caller's cap (`per_scope`) or by the total.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    stored: usize,
    full_total: usize,
    full_per_scope: usize,
}

impl Tally {
    fn count<T: std::fmt::Debug>(&mut self, what: &str, result: dlock_core::Result<T>, most: Duration) -> Option<T> {
        match result {
            Ok(v) => {
                self.stored += 1;
                Some(v)
            }
            Err(Error::IdempotencyFull { per_scope, retry_after }) => {
                assert!(retry_after > Duration::ZERO && retry_after <= most, "{what}: retry after {retry_after:?}");
                match per_scope {
                    true => self.full_per_scope += 1,
                    false => self.full_total += 1,
                }
                None
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

async fn store(cluster: &dlock_testing::RedisCluster, prefix: &str, limits: IdempotencyLimits) -> RedisStore {
    RedisStore::connect(&cluster.url(), prefix).await.expect("connect to the cluster").with_limits(limits)
}

/// Records: a total of 32 admits 32 keys of 200 callers, each refusal
/// `503`-shaped (`per_scope: false`) with a `Retry-After` within the
/// records' TTL; a key stored is still answered at the cap, and one
/// abandoned makes room again. One caller's own cap still holds.
#[tokio::test]
async fn records_are_capped_in_total_on_a_redis_cluster() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let ttl = Duration::from_secs(60);
    let terms = ClaimTerms::new(Duration::from_secs(30)).with_ttl(ttl);
    let store = store(&cluster, "total", IdempotencyLimits::default().with_max_records(32)).await;
    let mut tally = Tally::default();
    let mut claims = Vec::new();
    for i in 0..CALLERS {
        let caller = format!("caller-{i}");
        match tally.count("begin", store.begin(&caller, "k", "fp", terms).await, ttl + ttl / 32) {
            Some(Begin::New(claim)) => claims.push((caller, claim)),
            Some(other) => panic!("a fresh key: {other:?}"),
            None => {}
        }
    }
    assert_eq!(tally, Tally { stored: 32, full_total: CALLERS - 32, full_per_scope: 0 }, "the total holds");
    let (caller, claim) = claims.pop().expect("a claim");
    assert_eq!(store.begin(&caller, "k", "fp", terms).await.expect("at the cap"), Begin::InProgress);
    assert!(store.abandon(&claim).await.expect("abandon"));
    assert!(matches!(store.begin(&caller, "k", "fp", terms).await.expect("room again"), Begin::New(_)));

    let limits = IdempotencyLimits::default().with_max_per_scope(2).with_max_records(1_000);
    let store = self::store(&cluster, "per-scope", limits).await;
    let mut tally = Tally::default();
    for key in ["k1", "k2", "k3"] {
        tally.count("begin", store.begin("alice", key, "fp", terms).await, ttl + ttl / 32);
    }
    assert_eq!(tally, Tally { stored: 2, full_total: 0, full_per_scope: 1 }, "the caller's cap holds");
}

/// Bytes of stored answers: a total of 16 KiB keeps 16 answers of 700
/// bytes of 200 callers (each shard holds one), the others refused by the
/// total; the claims stay, as at a caller's cap.
#[tokio::test]
async fn answers_are_capped_in_bytes_in_total_on_a_redis_cluster() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let terms = ClaimTerms::new(Duration::from_secs(30));
    let store = store(&cluster, "bytes", IdempotencyLimits::default().with_max_bytes(16 * 1024)).await;
    let answer = StoredResponse::new(201, vec![], vec![b'x'; 700]);
    let mut tally = Tally::default();
    for i in 0..CALLERS {
        let caller = format!("caller-{i}");
        let Begin::New(claim) = store.begin(&caller, "k", "fp", terms).await.expect("begin") else {
            panic!("a fresh key")
        };
        let day = Duration::from_secs(24 * 3600);
        if let Some(stored) = tally.count("complete", store.complete(&claim, &answer).await, day + day / 32) {
            assert!(stored, "our own claim");
        }
    }
    assert_eq!(tally, Tally { stored: 16, full_total: CALLERS - 16, full_per_scope: 0 }, "the bytes' total holds");
}

/// Tokens bound to a caller: a total of 32 issues 32 of 200 callers' tokens.
#[tokio::test]
async fn bound_tokens_are_capped_in_total_on_a_redis_cluster() {
    let cluster = dlock_testing::RedisCluster::start(3);
    let store = store(&cluster, "tokens", IdempotencyLimits::default().with_max_records(32)).await;
    let ttl = Duration::from_secs(60);
    let mut tally = Tally::default();
    for i in 0..CALLERS {
        tally.count("issue", store.issue_token(Some(&format!("caller-{i}")), ttl).await, ttl + ttl / 32);
    }
    assert_eq!(tally, Tally { stored: 32, full_total: CALLERS - 32, full_per_scope: 0 }, "the total holds");
}
