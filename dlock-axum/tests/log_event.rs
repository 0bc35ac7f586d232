//! One `dlock.request` event per locked request, at the same level through
//! both faces, and no request values (the key) at `INFO` or above; no
//! request secret at any level.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::routing::post;
use axum::Router;
use dlock_axum::{idempotency::IdempotencyLayer, Caller};
use dlock_axum::{lockable, DlockExt, JsonBody, LockLayer};
use dlock_core::backend::Backend;
use dlock_core::backend::{AcquireRequest, BoxFuture, Grant, Release, Renewal};
use dlock_core::idempotency::{Begin, Claim, ClaimTerms, IdempotencyStore, MemoryStore, StoredResponse, TokenClaim};
use dlock_core::{LockKey, Locker, MemoryBackend, Owner, Result};
use dlock_testing::{capture_logs, LogCapture};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The `dlock.request` lines written since the last call.
fn take_events(captured: &LogCapture) -> Vec<String> {
    captured.take_lines().into_iter().filter(|l| l.contains("dlock.request")).collect()
}

#[derive(Deserialize)]
struct Req {
    id: String,
}

#[lockable(key = "t", fields = ["req.id"], wait_ms = 0)]
async fn by_macro(JsonBody(req): JsonBody<Req>) -> String {
    req.id
}

fn request(uri: &str) -> Request<Body> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id": "secret-7"}"#))
        .expect("request")
}

#[tokio::test(flavor = "current_thread")]
async fn one_event_per_request_at_the_same_level_through_both_faces() {
    let (captured, _default) = capture_logs();

    let locker = Locker::new(MemoryBackend::new());
    let app = Router::new()
        .route("/layer", post(|body: String| async move { body }).layer(LockLayer::new("t").json("id")))
        .route("/macro", post(by_macro))
        .with_dlock(locker.clone());

    for (outcome, level) in [("acquired", "DEBUG"), ("busy", "DEBUG")] {
        let held = if outcome == "busy" {
            let key = locker.key("t").part("secret-7").build().expect("key");
            Some(locker.try_acquire(&key).await.expect("free"))
        } else {
            None
        };
        let mut seen = Vec::new();
        for uri in ["/layer", "/macro"] {
            app.clone().oneshot(request(uri)).await.expect("infallible");
            let events = take_events(&captured);
            assert_eq!(events.len(), 1, "{uri} {outcome}: {events:#?}");
            assert!(events[0].contains(&format!("outcome=\"{outcome}\"")), "{uri}: {}", events[0]);
            seen.push(events[0].split_whitespace().nth(1).map(str::to_owned));
        }
        assert_eq!(seen, vec![Some(level.to_owned()), Some(level.to_owned())], "{outcome}");
        if let Some(guard) = held {
            guard.release().await.expect("release");
        }
    }

    // Without an engine: an error, the same through both, naming no value.
    let bare = Router::new()
        .route("/layer", post(|body: String| async move { body }).layer(LockLayer::new("t").json("id")))
        .route("/macro", post(by_macro));
    for uri in ["/layer", "/macro"] {
        bare.clone().oneshot(request(uri)).await.expect("infallible");
        let events = take_events(&captured);
        assert_eq!(events.len(), 1, "{uri}: {events:#?}");
        assert!(events[0].contains("ERROR") && events[0].contains("outcome=\"misconfigured\""), "{}", events[0]);
        assert!(!events[0].contains("secret-7"), "no request value above DEBUG: {}", events[0]);
    }
}

/// Issue 26: a multi-key route refused for its second key logs the busy
/// key by its log id, and not the free one (the answer names neither).
#[tokio::test(flavor = "current_thread")]
async fn a_multi_key_refusal_logs_the_busy_key_only() {
    let (captured, _default) = capture_logs();
    let locker = Locker::new(MemoryBackend::new());
    let layer = LockLayer::new("account").json("from").also("account").json("to");
    let app = Router::new()
        .route("/transfer", post(|body: String| async move { body }).layer(layer))
        .with_dlock(locker.clone());
    let (from, to) = (
        locker.key("account").part(7u64).build().expect("key"),
        locker.key("account").part(8u64).build().expect("key"),
    );
    let held = locker.try_acquire(&to).await.expect("free");
    take_events(&captured);
    let req = Request::post("/transfer")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"from": 7, "to": 8}"#))
        .expect("request");
    let res = app.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), axum::http::StatusCode::CONFLICT);
    let events = take_events(&captured);
    assert_eq!(events.len(), 1, "{events:#?}");
    assert!(events[0].contains(&to.log_id().to_string()), "the busy key: {events:?}");
    assert!(!events[0].contains(&from.log_id().to_string()), "not the free one: {events:?}");
    held.release().await.expect("release");
    locker.try_acquire(&from).await.expect("not left held").release().await.expect("release");
}

/// A lock service that grants and renews but cannot release, as during an
/// outage: the paths that log at `WARN`.
#[derive(Debug)]
struct NoRelease(MemoryBackend);

impl Backend for NoRelease {
    fn name(&self) -> &'static str {
        "no-release"
    }
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        self.0.ready()
    }
    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        self.0.acquire(req, cancel)
    }
    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        self.0.renew(key, owner, lease)
    }
    fn release<'a>(&'a self, _: &'a LockKey, _: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async { Err(dlock_core::Error::backend("no-release", "connection reset")) })
    }
}

/// An idempotency store that cannot store a response.
#[derive(Debug)]
struct NoComplete(MemoryStore);

impl IdempotencyStore for NoComplete {
    fn name(&self) -> &'static str {
        "no-complete"
    }
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        self.0.ready()
    }
    fn issue_token<'a>(&'a self, principal: Option<&'a str>, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        self.0.issue_token(principal, ttl)
    }
    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>> {
        self.0.claim_token(token, principal, lease)
    }
    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        self.0.spend_token(claim)
    }
    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        self.0.return_token(claim)
    }
    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fp: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>> {
        self.0.begin(scope, key, fp, terms)
    }
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        self.0.renew(claim, lease)
    }
    fn complete<'a>(&'a self, _: &'a Claim, _: &'a StoredResponse) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async { Err(dlock_core::Error::backend("no-complete", "connection reset")) })
    }
    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        self.0.abandon(claim)
    }
}

/// Key parts from the request (a one-time token here) and `Idempotency-Key`s
/// are secrets: no log line at any level writes them, only a short hash,
/// also on the `WARN` paths of a failing lock service and store.
#[tokio::test(flavor = "current_thread")]
async fn no_request_secret_is_logged_at_any_level() {
    let (captured, _default) = capture_logs();

    let locker = Locker::new(NoRelease(MemoryBackend::new()));
    let idem: Arc<dyn IdempotencyStore> = Arc::new(NoComplete(MemoryStore::new()));
    let app = Router::new()
        .route("/layer", post(|| async { "ok" }).layer(LockLayer::new("t").query("token")))
        .route(
            "/pay",
            post(|| async { "paid" }).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
        )
        .with_dlock(locker.clone());

    let req = Request::post("/layer?token=tok-s3cr3t").body(Body::empty()).expect("request");
    assert_eq!(app.clone().oneshot(req).await.expect("infallible").status(), 200);
    let req = Request::post("/pay").header("idempotency-key", "idem-s3cr3t").body(Body::empty()).expect("request");
    assert_eq!(app.oneshot(req).await.expect("infallible").status(), 200);
    // Background releases and frees log on their own tasks.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let log = captured.take();
    assert!(log.contains("WARN"), "the failure paths ran: {log}");
    assert!(log.contains("dlock.release failed"), "{log}");
    assert!(log.contains("storing the idempotent response failed"), "{log}");
    for line in log.lines() {
        assert!(!line.contains("s3cr3t"), "a secret in the log: {line}");
    }
    // The lock is still named, and its key stands as a short hash that is
    // the same in every line (and every process).
    let id = locker.key("t").part("tok-s3cr3t").build().expect("key").log_id().to_string();
    assert!(id.starts_with("t#") && id.len() == 2 + 12, "{id}");
    assert!(log.lines().filter(|l| l.contains(&id)).count() >= 2, "{id} in {log}");
}
