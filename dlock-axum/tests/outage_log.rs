//! During an outage of the lock service the log says so once, counts what
//! it refused, and says when it is over (issue 25): not a `WARN` line (or
//! two) per refused request. Its own test binary: the outage log is one per
//! process, and another test's grants would end this one's outage.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::{idempotency::IdempotencyLayer, Caller};
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::backend::redis::RedisBackend;
use dlock_core::idempotency::{IdempotencyStore, RedisStore};
use dlock_core::Locker;
use dlock_testing::{capture_logs, RedisServer};
use tower::ServiceExt;

async fn status(app: &Router, uri: &str) -> StatusCode {
    // A new Idempotency-Key each time: every payment is a first one.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let key = format!("k-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let req = Request::post(uri).header("idempotency-key", key).body(Body::empty()).expect("request");
    app.clone().oneshot(req).await.expect("infallible").status()
}

/// The number a `field=n` of `line` holds.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!("{name}="))? + name.len() + 1;
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[tokio::test(flavor = "current_thread")]
async fn an_outage_is_one_warning_a_count_and_an_end() {
    let (logs, _guard) = capture_logs();
    let mut server = RedisServer::start();
    let locker = Locker::new(RedisBackend::connect(&server.url(), "dlock").await.expect("connect"));
    let idem: Arc<dyn IdempotencyStore> = Arc::new(RedisStore::connect(&server.url(), "dlock").await.expect("store"));
    let app = Router::new()
        .route("/r", post(|| async { "ok" }).route_layer(LockLayer::new("o")))
        .route(
            "/pay",
            post(|| async { "paid" }).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
        )
        .with_dlock(locker);
    assert_eq!(status(&app, "/r").await, StatusCode::OK);
    assert_eq!(status(&app, "/pay").await, StatusCode::OK);
    logs.take();

    server.kill();
    const REFUSED: u64 = 20;
    for _ in 0..REFUSED {
        assert_eq!(status(&app, "/r").await, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(&app, "/pay").await, StatusCode::SERVICE_UNAVAILABLE);
    }
    let lines = logs.take_lines();
    // The backend says that it lost its connections (its own events, from
    // `dlock_core`, not a request's; how many were logged by now depends on
    // when its tasks ran); the requests' outage is one warning more.
    // A request's events carry its span (`dlock.http.request{…}:`) before their target.
    let warnings: Vec<&String> = lines.iter().filter(|l| l.contains(" WARN ") && l.contains(" dlock_axum::")).collect();
    assert_eq!(warnings.len(), 2, "one warning for each service's outage, not one per request: {warnings:#?}");
    for service in ["the lock service", "the idempotency store"] {
        let told = warnings.iter().filter(|l| l.contains(&format!("{service} is unavailable"))).count();
        assert_eq!(told, 1, "{service}: {warnings:#?}");
    }
    // The backends' own "connection lost", once for each connection.
    assert!(lines.iter().filter(|l| l.contains("Redis connection lost")).count() <= 4, "{lines:#?}");
    // Each refusal is still an event, below WARN, for whoever wants them.
    let refusals = lines.iter().filter(|l| l.contains("dlock.request") && l.contains("unavailable")).count();
    assert_eq!(refusals as u64, REFUSED, "{lines:#?}");

    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(20);
    for uri in ["/r", "/pay"] {
        while status(&app, uri).await != StatusCode::OK {
            assert!(Instant::now() < deadline, "{uri} never recovered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let lines = logs.take_lines();
    for service in ["the lock service", "the idempotency store"] {
        let end: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains(" INFO ") && l.contains(&format!("{service} is available again")))
            .collect();
        assert_eq!(end.len(), 1, "one line for the end of the outage of {service}: {lines:#?}");
        let refused = field(end[0], "refused").unwrap_or_else(|| panic!("no count in {}", end[0]));
        assert!(refused >= REFUSED, "{refused} refused: {}", end[0]);
    }
    assert!(!lines.iter().any(|l| l.contains(" WARN ") && l.contains("dlock.request")), "{lines:#?}");
}
