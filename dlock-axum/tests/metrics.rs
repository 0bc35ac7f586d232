//! The HTTP face's metrics and spans: after a known set of requests, the
//! refusals by `error` code and the idempotency outcomes a recording
//! recorder holds are those requests'; each request's `dlock.http.request` span
//! carries its outcome.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::IdempotencyLayer;
use dlock_axum::{Caller, DlockExt, LockLayer};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use dlock_core::{Locker, MemoryBackend};
use dlock_testing::metrics::{recording, Recorded};
use tower::ServiceExt;

fn refusals(name: &str, error: &str) -> String {
    format!("dlock.http.refusals{{dlock.lock.name={name},error={error}}}")
}

fn idempotency(outcome: &str) -> String {
    format!("dlock.idempotency.requests{{dlock.face=idempotency_key,dlock.outcome={outcome}}}")
}

async fn status(app: &Router, req: Request<Body>) -> StatusCode {
    app.clone().oneshot(req).await.expect("infallible").status()
}

/// The tests of this file, one at a time: `tracing` caches whether a span is
/// wanted once for the whole process, asked of the thread that reaches it
/// first, so a request made without a subscriber beside the span test can
/// leave `dlock.http.request` unrecorded in it (the CI failure of 2026-12-07).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pay(key: &str, body: &str) -> Request<Body> {
    Request::post("/pay").header("idempotency-key", key).body(Body::from(body.to_owned())).expect("request")
}

#[test]
fn refusals_and_idempotency_outcomes_are_counted() {
    let _alone = one_at_a_time();
    let recorded = Recorded::default();
    recording(&recorded, async {
        let locker = Locker::new(MemoryBackend::new());
        let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
        let slow = || async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            (StatusCode::CREATED, "done")
        };
        let app = Router::new()
            .route("/stock/{sku}", post(slow).layer(LockLayer::new("stock").path("sku")))
            .route("/pay", post(slow).layer(IdempotencyLayer::new().caller(Caller::shared()).store(store)))
            .with_dlock(locker);

        // The lock: one acquired, one busy beside it, one without its key field.
        let stock = || Request::post("/stock/sku-secret").body(Body::empty()).expect("request");
        let (first, second) = tokio::join!(status(&app, stock()), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            status(&app, stock()).await
        });
        assert_eq!((first, second), (StatusCode::CREATED, StatusCode::CONFLICT));

        // Idempotency: executed, in progress beside it, replayed, mismatch, key missing.
        let (first, second) = tokio::join!(status(&app, pay("k-secret", "a")), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            status(&app, pay("k-secret", "a")).await
        });
        assert_eq!((first, second), (StatusCode::CREATED, StatusCode::CONFLICT));
        assert_eq!(status(&app, pay("k-secret", "a")).await, StatusCode::CREATED, "replayed");
        assert_eq!(status(&app, pay("k-secret", "b")).await, StatusCode::UNPROCESSABLE_ENTITY);
        let missing = Request::post("/pay").body(Body::from("a")).expect("request");
        assert_eq!(status(&app, missing).await, StatusCode::BAD_REQUEST);
    });
    assert_eq!(recorded.counter(&refusals("stock", "duplicate_submission")), 1, "{:?}", recorded.series());
    assert_eq!(recorded.counter(&idempotency("executed")), 1);
    assert_eq!(recorded.counter(&idempotency("in_progress")), 1);
    assert_eq!(recorded.counter(&idempotency("replayed")), 1);
    assert_eq!(recorded.counter(&idempotency("mismatch")), 1);
    assert_eq!(recorded.counter(&idempotency("refused")), 1);
    assert_eq!(recorded.counter(&refusals("idempotency_key", "idempotency_key_missing")), 1);
    assert_eq!(recorded.counter(&refusals("idempotency_key", "idempotency_request_in_progress")), 1);
    assert_eq!(recorded.counter(&refusals("idempotency_key", "idempotency_key_mismatch")), 1);
    // The engine's own figures come through the same recorder.
    let acquired = "dlock.lock.acquire.duration{dlock.backend=memory,dlock.lock.mode=exclusive,dlock.lock.name=stock,dlock.outcome=acquired}";
    assert_eq!(recorded.count(acquired), 1);
    for series in recorded.series() {
        assert!(!series.contains("secret"), "a request value in a label: {series}");
    }
}

#[test]
fn each_request_span_carries_its_outcome() {
    let _alone = one_at_a_time();
    let logs = dlock_testing::LogCapture::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    let _logging = dlock_testing::set_scoped(subscriber);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let app = Router::new()
            .route("/stock/{sku}", post(|| async { "ok" }).layer(LockLayer::new("stock").path("sku")))
            .with_dlock(locker);
        let stock = Request::post("/stock/1").body(Body::empty()).expect("request");
        assert_eq!(status(&app, stock).await, StatusCode::OK);
    });
    let text = logs.take();
    // The line that closes a span names the module that made it.
    let closed = text.lines().find(|l| l.contains("dlock_axum::observe: close")).unwrap_or_default();
    for field in [
        "dlock.face=\"lock\"",
        "dlock.lock.name=\"stock\"",
        "dlock.outcome=\"acquired\"",
        "http.response.status_code=200",
    ] {
        assert!(closed.contains(field), "{field} in the closed span: {text}");
    }
    let acquire = text.lines().find(|l| l.contains("dlock_core::engine::locker: close")).unwrap_or_default();
    for field in ["dlock.outcome=\"acquired\"", "dlock.fence=1", "dlock.backend=\"memory\""] {
        assert!(acquire.contains(field), "{field} in the acquire span: {text}");
    }
}
