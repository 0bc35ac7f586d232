//! A Redis in its restart quarantine (`DLOCK_RESTART_QUARANTINE_MS`) is
//! refused with `503`, and its `Retry-After` is the time the quarantine has
//! left (issue 25), not the `1` of an outage nobody can time.

use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::routing::post;
use axum::Router;
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::backend::redis::{RedisBackend, RedisOptions};
use dlock_core::Locker;
use dlock_testing::RedisServer;
use http_body_util::BodyExt;
use tower::ServiceExt;

const QUARANTINE: Duration = Duration::from_secs(8);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_redis_says_how_long_it_has_left() {
    // A fresh server: up for less than the quarantine, and without dlock's
    // data marker, so its first grant waits the quarantine out.
    let server = RedisServer::start();
    let options = RedisOptions::default().with_restart_quarantine(QUARANTINE);
    let backend = RedisBackend::connect_with(&server.url(), "dlock", options).await.expect("connect");
    let locker = Locker::new(backend);

    // The engine's error carries what is left.
    let key = locker.key("q").part(1).build().expect("key");
    let err = locker.try_acquire(&key).await.expect_err("quarantined");
    assert!(err.is_unavailable(), "{err}");
    let left = err.retry_after().unwrap_or_else(|| panic!("no time left in {err}"));
    assert!(left <= QUARANTINE && left >= QUARANTINE - Duration::from_secs(2), "{left:?}: {err}");

    // And the 503 says it, in whole seconds rounded up.
    let app =
        Router::new().route("/r", post(|| async { "ok" }).route_layer(LockLayer::new("q"))).with_dlock(locker.clone());
    let res = app.oneshot(Request::post("/r").body(Body::empty()).expect("request")).await.expect("infallible");
    assert_eq!(res.status(), 503);
    let retry_after: u64 = res.headers()["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((5..=8).contains(&retry_after), "Retry-After: {retry_after}");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("lock_backend_unavailable"));
}
