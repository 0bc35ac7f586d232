//! `#[lockable]` handlers on the in-process backend (and one on a Redis that
//! dies), driven with `oneshot`.

#[path = "lockable/shapes.rs"]
mod shapes;

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_axum::{lockable, DlockExt, DlockRuntime, LockOutcome, RequestOwner};
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
        .with_dlock(locker.clone())
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

/// Requests running now in `read_prices`, and the most seen at once.
static READERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static MOST_READERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[lockable(key = "prices", fields = ["list"], mode = "shared", wait_ms = 0)]
async fn read_prices(Path(list): Path<u64>) -> String {
    use std::sync::atomic::Ordering::SeqCst;
    MOST_READERS.fetch_max(READERS.fetch_add(1, SeqCst) + 1, SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    READERS.fetch_sub(1, SeqCst);
    format!("prices of {list}")
}

#[lockable(key = "prices", fields = ["list"], mode = "exclusive", wait_ms = 0)]
async fn reprice(Path(list): Path<u64>) -> String {
    format!("repriced {list}")
}

#[lockable(key = "export", fields = ["user"], permits = 2, wait_ms = 0)]
async fn export(Path(user): Path<u64>) -> String {
    tokio::time::sleep(Duration::from_millis(300)).await;
    format!("export of {user}")
}

#[derive(Debug, Deserialize)]
struct Transfer {
    from: u64,
    to: u64,
    /// How long the transfer takes.
    ms: u64,
}

#[lockable(key = "account", fields = ["t.from"], also(key = "account", fields = ["t.to"]), wait_ms = 20000)]
async fn transfer(Json(t): Json<Transfer>) -> String {
    tokio::time::sleep(Duration::from_millis(t.ms)).await;
    format!("{} -> {}", t.from, t.to)
}

#[lockable(key = "account", fields = ["id"], wait_ms = 0)]
async fn touch(Path(id): Path<u64>) -> String {
    id.to_string()
}

fn modes_app(locker: &Locker) -> Router {
    Router::new()
        .route("/prices/{list}", get(read_prices).post(reprice))
        .route("/export/{user}", post(export))
        .route("/transfer", post(transfer))
        .route("/account/{id}", post(touch))
        .with_dlock(locker.clone())
}

fn post_req(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).expect("request")
}

fn transfer_req(from: u64, to: u64, ms: u64) -> Request<Body> {
    Request::post("/transfer")
        .header("content-type", "application/json")
        .body(Body::from(json!({"from": from, "to": to, "ms": ms}).to_string()))
        .expect("request")
}

/// Issue 26: `mode = "shared"` handlers run together on one key, and keep
/// an exclusive one out (409) until the last has finished.
#[tokio::test]
async fn shared_handlers_run_together_and_keep_an_exclusive_one_out() {
    let app = modes_app(&Locker::new(MemoryBackend::new()));
    let readers = [
        tokio::spawn(app.clone().oneshot(get_req("/prices/1"))),
        tokio::spawn(app.clone().oneshot(get_req("/prices/1"))),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = json_of(app.clone().oneshot(post_req("/prices/1")).await.expect("infallible")).await;
    assert_eq!((status, &body["error"]), (StatusCode::CONFLICT, &json!("duplicate_submission")), "{body}");
    for r in readers {
        assert_eq!(r.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    assert_eq!(MOST_READERS.load(std::sync::atomic::Ordering::SeqCst), 2, "both readers ran at once");
    assert_eq!(app.oneshot(post_req("/prices/1")).await.expect("infallible").status(), StatusCode::OK);
}

/// Issue 26: `permits = 2` admits two requests per key at once; the third
/// is `429 lock_permits_exhausted` with `Retry-After`.
#[tokio::test]
async fn a_permits_handler_admits_two_and_answers_the_third_429() {
    let app = modes_app(&Locker::new(MemoryBackend::new()));
    let running = [
        tokio::spawn(app.clone().oneshot(post_req("/export/7"))),
        tokio::spawn(app.clone().oneshot(post_req("/export/7"))),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let res = app.clone().oneshot(post_req("/export/7")).await.expect("infallible");
    assert_eq!(res.headers()["retry-after"], "30", "the watchdog lease");
    assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })));
    let (status, body) = json_of(res).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!((&body["error"], &body["code"]), (&json!("lock_permits_exhausted"), &json!(2403)), "{body}");
    // Another user has permits of their own.
    assert_eq!(app.clone().oneshot(post_req("/export/8")).await.expect("infallible").status(), StatusCode::OK);
    for r in running {
        assert_eq!(r.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    assert_eq!(app.oneshot(post_req("/export/7")).await.expect("infallible").status(), StatusCode::OK);
}

/// Issue 26: `also(..)` holds both accounts while the transfer runs, and
/// releases both.
#[tokio::test]
async fn a_multi_key_handler_holds_every_key_and_releases_them_all() {
    let locker = Locker::new(MemoryBackend::new());
    let app = modes_app(&locker);
    let running = tokio::spawn(app.clone().oneshot(transfer_req(1, 2, 300)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    for id in [1, 2] {
        let (status, body) =
            json_of(app.clone().oneshot(post_req(&format!("/account/{id}"))).await.expect("infallible")).await;
        assert_eq!((status, &body["error"]), (StatusCode::CONFLICT, &json!("duplicate_submission")), "account {id}");
    }
    assert_eq!(app.clone().oneshot(post_req("/account/3")).await.expect("infallible").status(), StatusCode::OK);
    assert_eq!(running.await.expect("task").expect("infallible").status(), StatusCode::OK);
    for id in [1u64, 2] {
        let key = locker.key("account").part(id).build().expect("key");
        locker.try_acquire(&key).await.expect("released").release().await.expect("release");
    }
}

/// Issue 26: transfers 1→2 and 2→1 at once all complete (no deadlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_transfers_all_complete() {
    let app = modes_app(&Locker::new(MemoryBackend::new()));
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            tokio::spawn(app.clone().oneshot(if i % 2 == 0 { transfer_req(1, 2, 5) } else { transfer_req(2, 1, 5) }))
        })
        .collect();
    let results = tokio::time::timeout(Duration::from_secs(30), futures_util::future::join_all(tasks))
        .await
        .expect("no deadlock");
    for r in results {
        assert_eq!(r.expect("task").expect("infallible").status(), StatusCode::OK);
    }
}
