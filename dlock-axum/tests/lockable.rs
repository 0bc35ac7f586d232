//! `#[lockable]` handlers on the in-process backend (and one on a Redis that
//! dies), driven with `oneshot`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_axum::{lockable, DlockRuntime, LockOutcome, LockerExt, RequestOwner};
use dlock_core::backend::redis::RedisBackend;
use dlock_core::{AcquireOptions, Locker, MemoryBackend};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;

#[derive(Debug, Deserialize)]
struct Product {
    id: u64,
}

#[derive(Debug, Deserialize)]
struct Order {
    product: Product,
}

#[derive(Debug, Deserialize)]
struct TokenParam {
    token: Option<String>,
}

/// The seed's `createOrder`: one order per product and token at a time.
#[lockable(key = "order.create", fields = ["order.product.id", "token"], wait_ms = 0, lease_ms = 5000,
           message = "order already being placed", code = 4242)]
async fn create_order(Query(TokenParam { token }): Query<TokenParam>, Json(order): Json<Order>) -> impl IntoResponse {
    tokio::time::sleep(Duration::from_millis(300)).await;
    (StatusCode::CREATED, format!("order for {} with {token:?}", order.product.id))
}

/// Takes the same key again inside the body, as the request's owner.
#[lockable(key = "nested", fields = ["id"])]
#[axum::debug_handler]
async fn nested(
    Path(id): Path<u64>,
    axum::Extension(dlock): axum::Extension<DlockRuntime>,
    RequestOwner(owner): RequestOwner,
) -> Result<String, StatusCode> {
    let locker = dlock.locker();
    let key = locker.key("nested").part(id).build().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let inner =
        locker.acquire(&key, AcquireOptions::new().with_owner(owner)).await.map_err(|_| StatusCode::CONFLICT)?;
    inner.release().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(format!("re-entered {id}"))
}

fn validate(id: u64) -> Result<u64, StatusCode> {
    if id == 13 {
        Err(StatusCode::IM_A_TEAPOT)
    } else {
        Ok(id)
    }
}

/// Leaves early through `?`. (`#[lockable]` goes above `#[axum::debug_handler]`,
/// so that the debug checks see the handler axum really gets.)
#[lockable(key = "early", fields = ["id"], wait_ms = 0)]
#[axum::debug_handler]
async fn early(Path(id): Path<u64>) -> Result<String, StatusCode> {
    let id = validate(id)?;
    Ok(id.to_string())
}

#[lockable(key = "boom", fields = ["id"], wait_ms = 0)]
async fn boom(Path(id): Path<u64>) -> String {
    if id == 1 {
        panic!("the handler fails");
    }
    id.to_string()
}

fn app(locker: &Locker) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/nested/{id}", get(nested))
        .route("/early/{id}", get(early))
        .route("/boom/{id}", get(boom))
        .with_locker(locker.clone())
}

fn order(token: Option<&str>, product: u64) -> Request<Body> {
    let uri = match token {
        Some(t) => format!("/orders?token={t}"),
        None => "/orders".to_owned(),
    };
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Body::from(json!({"product": {"id": product}}).to_string()))
        .expect("request")
}

fn get_req(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).expect("request")
}

async fn json_of(res: Response) -> (StatusCode, Value) {
    let status = res.status();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Two requests at once; returns their responses in the order sent (the
/// second starts once the first holds the lock).
async fn concurrently(app: &Router, a: Request<Body>, b: Request<Body>) -> (Response, Response) {
    let first = tokio::spawn(app.clone().oneshot(a));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = app.clone().oneshot(b).await.expect("infallible");
    (first.await.expect("task").expect("infallible"), second)
}

#[tokio::test]
async fn a_concurrent_duplicate_gets_the_configured_409() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    let (a, b) = concurrently(&app, order(Some("t1"), 7), order(Some("t1"), 7)).await;
    assert_eq!(a.status(), StatusCode::CREATED);
    assert!(matches!(a.extensions().get::<LockOutcome>(), Some(LockOutcome::Acquired { .. })));
    assert!(matches!(b.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })));
    let (status, body) = json_of(b).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body, json!({"error": "duplicate_submission", "code": 4242, "message": "order already being placed"}));
    // Released afterwards: the same order goes through again.
    assert_eq!(app.oneshot(order(Some("t1"), 7)).await.expect("infallible").status(), StatusCode::CREATED);
}

#[tokio::test]
async fn different_field_values_do_not_contend() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    let (a, b) = concurrently(&app, order(Some("t1"), 7), order(Some("t1"), 8)).await;
    assert_eq!((a.status(), b.status()), (StatusCode::CREATED, StatusCode::CREATED));
    let (a, b) = concurrently(&app, order(Some("t1"), 7), order(Some("t2"), 7)).await;
    assert_eq!((a.status(), b.status()), (StatusCode::CREATED, StatusCode::CREATED));
}

#[tokio::test]
async fn a_missing_option_is_not_the_string_none_or_null() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    for text in ["None", "null", ""] {
        let (a, b) = concurrently(&app, order(None, 7), order(Some(text), 7)).await;
        assert_eq!((a.status(), b.status()), (StatusCode::CREATED, StatusCode::CREATED), "None vs {text:?}");
    }
    // …while two requests without a token do contend.
    let (a, b) = concurrently(&app, order(None, 7), order(None, 7)).await;
    assert_eq!((a.status(), b.status()), (StatusCode::CREATED, StatusCode::CONFLICT));
}

#[tokio::test]
async fn a_nested_lock_on_the_same_key_in_one_request_re_enters() {
    let locker = Locker::new(MemoryBackend::new());
    let res = app(&locker).oneshot(get_req("/nested/5")).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    let key = locker.key("nested").part(5u64).build().expect("key");
    locker.try_acquire(&key).await.expect("released after the request").release().await.expect("release");
}

#[tokio::test]
async fn an_early_return_releases_the_lock() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    for _ in 0..3 {
        let res = app.clone().oneshot(get_req("/early/13")).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::IM_A_TEAPOT, "the handler's own error, not a 409");
    }
    let key = locker.key("early").part(13u64).build().expect("key");
    locker.try_acquire(&key).await.expect("free").release().await.expect("release");
}

#[tokio::test]
async fn a_panicking_body_releases_the_lock() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    let crashed = tokio::spawn(app.clone().oneshot(get_req("/boom/1"))).await;
    assert!(crashed.expect_err("the handler panicked").is_panic());
    let key = locker.key("boom").part(1u64).build().expect("key");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        match locker.try_acquire(&key).await {
            Ok(g) => {
                g.release().await.expect("release");
                break;
            }
            Err(e) if e.is_contention() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("the dropped guard must release the key: {e}"),
        }
    }
}

#[tokio::test]
async fn no_installed_engine_is_a_500_json_error() {
    let app = Router::new().route("/orders", post(create_order));
    let (status, body) = json_of(app.oneshot(order(Some("t"), 1)).await.expect("infallible")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body["error"], "lock_misconfigured");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lock_service_is_a_quick_503() {
    let mut server = dlock_testing::RedisServer::start();
    let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect");
    let locker = Locker::new(backend);
    let app = app(&locker);
    assert_eq!(app.clone().oneshot(get_req("/early/1")).await.expect("infallible").status(), StatusCode::OK);
    server.kill();
    let started = std::time::Instant::now();
    let (status, body) = json_of(app.oneshot(get_req("/early/2")).await.expect("infallible")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"], "lock_backend_unavailable");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// The compile errors, each pointing at the offending token, each alone: the
/// handler is emitted unchanged beside the error, so nothing else fails.
///
/// The `.stderr` files hold only dlock's own messages and their spans (no
/// warnings, no notes of rustc's lints, whose wording changes between
/// toolchains), so they hold on every stable toolchain CI uses.
#[test]
fn attribute_misuse_is_a_compile_error() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
