//! LockLayer against the in-process backend, driven with `oneshot`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use dlock_axum::{Caller, DlockExt, FencingToken, LockLayer, LockOutcome, RequestOwner};
use dlock_core::backend::Backend;
use dlock_core::backend::{AcquireRequest, BoxFuture, Grant, Release, Renewal};
use dlock_core::{AcquireOptions, LockKey, Locker, MemoryBackend, Owner};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::sync::CancellationToken;
use tower::{Layer, Service, ServiceExt};

const LONG: Duration = Duration::from_secs(30);

fn locker() -> Locker {
    Locker::new(MemoryBackend::new())
}

/// Echoes the body it got and counts its calls.
fn echo_app(locker: &Locker, layer: LockLayer, calls: Arc<AtomicUsize>) -> Router {
    let handler = move |FencingToken(fence): FencingToken, body: Bytes| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            ([("x-fence", fence.to_string())], body)
        }
    };
    Router::new().route("/r", post(handler).layer(layer)).with_dlock(locker.clone())
}

fn post_json(uri: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(uri).header("content-type", "application/json").body(body.into()).expect("request")
}

async fn body_json(res: Response) -> Value {
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes)))
}

async fn assert_rejection(res: Response, status: u16, error: &str) -> Value {
    assert_eq!(res.status().as_u16(), status, "expected {error}");
    assert_eq!(res.headers()["content-type"], "application/json");
    let v = body_json(res).await;
    assert_eq!(v["error"], error, "{v}");
    assert!(v["code"].is_u64(), "{v}");
    assert!(v["message"].is_string(), "{v}");
    v
}

#[tokio::test]
async fn body_reaches_the_handler_unchanged() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("stock").json("product_id"), calls.clone());
    // Odd spacing, key order and unicode: the handler must see these exact bytes.
    let raw = "{ \"quantity\":1,\n  \"product_id\" : \"p\u{e9}:1\" , \"x\": [1,2] }";
    let res = app.oneshot(post_json("/r", raw)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers()["x-fence"].to_str().expect("ascii").parse::<u64>().expect("number") > 0);
    assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Acquired { .. })));
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(bytes, raw.as_bytes());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn missing_field_is_400_and_the_handler_does_not_run() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("stock").json("product.id"), calls.clone());
    let res = app.clone().oneshot(post_json("/r", r#"{"product": {"sku": 1}}"#)).await.expect("infallible");
    let v = assert_rejection(res, 400, "lock_key_field_missing").await;
    assert!(v["message"].as_str().unwrap_or_default().contains("product.id"), "{v}");
    // null is a value, not a missing field
    let res = app.oneshot(post_json("/r", r#"{"product": {"id": null}}"#)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn invalid_json_is_400() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("stock").json("product_id"), calls.clone());
    for bad in ["{\"product_id\": ", "", "not json"] {
        let res = app.clone().oneshot(post_json("/r", bad)).await.expect("infallible");
        assert_rejection(res, 400, "invalid_json").await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn large_bodies_are_413_with_or_without_content_length() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("stock").json("product_id").max_body_bytes(64), calls.clone());
    let big = format!(r#"{{"product_id": 1, "pad": "{}"}}"#, "x".repeat(100));

    // Declared up front.
    let req = Request::post("/r").header("content-length", big.len()).body(Body::from(big.clone())).expect("request");
    assert_rejection(app.clone().oneshot(req).await.expect("infallible"), 413, "payload_too_large").await;

    // Streamed in chunks with no length: found while reading.
    let chunks: Vec<Result<Bytes, Infallible>> =
        big.as_bytes().chunks(10).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    let req = Request::post("/r").body(Body::from_stream(futures_util::stream::iter(chunks))).expect("request");
    assert_rejection(app.clone().oneshot(req).await.expect("infallible"), 413, "payload_too_large").await;

    // Exactly at the limit is fine.
    let fits = format!(r#"{{"product_id": 1, "p": "{}"}}"#, "x".repeat(64 - 26));
    assert_eq!(fits.len(), 64);
    let res = app.oneshot(post_json("/r", fits)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A handler that tells the test it is running and waits to be let go.
fn gated_app(locker: &Locker, layer: LockLayer) -> (Router, mpsc::UnboundedReceiver<oneshot::Sender<()>>) {
    let (entered_tx, entered_rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    let handler = move |body: Bytes| {
        let entered_tx = entered_tx.clone();
        async move {
            let (go_tx, go_rx) = oneshot::channel();
            let _ = entered_tx.send(go_tx);
            let _ = go_rx.await;
            body
        }
    };
    (Router::new().route("/r", post(handler).layer(layer)).with_dlock(locker.clone()), entered_rx)
}

#[tokio::test]
async fn two_concurrent_requests_on_one_key_give_one_409() {
    let layer = LockLayer::new("stock").json("product_id").message("busy, try later").code(4242);
    let (app, mut entered) = gated_app(&locker(), layer);
    let first = tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"product_id": 1}"#)));
    let go = tokio::time::timeout(LONG, entered.recv()).await.expect("first request runs").expect("channel");

    // While the first holds the lock: same key refused, another key served.
    let res = app.clone().oneshot(post_json("/r", r#"{"product_id": 1}"#)).await.expect("infallible");
    assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })));
    let v = assert_rejection(res, 409, "duplicate_submission").await;
    assert_eq!(v, json!({"error": "duplicate_submission", "code": 4242, "message": "busy, try later"}));

    let other = tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"product_id": 2}"#)));
    let go_other = tokio::time::timeout(LONG, entered.recv()).await.expect("other key runs").expect("channel");
    let _ = go_other.send(());
    assert_eq!(other.await.expect("task").expect("infallible").status(), StatusCode::OK);

    let _ = go.send(());
    assert_eq!(first.await.expect("task").expect("infallible").status(), StatusCode::OK);

    // Released after the response: the key is free again.
    let again = tokio::spawn(app.oneshot(post_json("/r", r#"{"product_id": 1}"#)));
    let go = tokio::time::timeout(LONG, entered.recv()).await.expect("runs again").expect("channel");
    let _ = go.send(());
    assert_eq!(again.await.expect("task").expect("infallible").status(), StatusCode::OK);
}

/// Issue 15 item 4: a held lock on a route that does not wait, and a wait
/// that ran out on a queueing route, are two answers a client can tell
/// apart; both say when to retry, and only the first takes the layer's
/// configured message and code (the seed's duplicate-submission answer).
#[tokio::test]
async fn busy_and_wait_timeout_are_told_apart_and_both_say_retry_after() {
    let locker = locker();
    let busy_layer = LockLayer::new("stock").json("product_id").message("busy, try later").code(4242);
    let queue_layer = LockLayer::new("stock")
        .json("product_id")
        .message("busy, try later")
        .code(4242)
        .wait(Duration::from_millis(100));
    let (app, mut entered) = gated_app(&locker, busy_layer);
    let (queue, _queue_entered) = gated_app(&locker, queue_layer);
    let first = tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"product_id": 1}"#)));
    let go = tokio::time::timeout(LONG, entered.recv()).await.expect("first request runs").expect("channel");

    let res = app.clone().oneshot(post_json("/r", r#"{"product_id": 1}"#)).await.expect("infallible");
    // The watchdog lease (30 s): how long the lock may last if its holder died.
    assert_eq!(res.headers()["retry-after"], "30");
    let v = assert_rejection(res, 409, "duplicate_submission").await;
    assert_eq!(v["code"], 4242);

    let res = queue.oneshot(post_json("/r", r#"{"product_id": 1}"#)).await.expect("infallible");
    assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })));
    assert_eq!(res.headers()["retry-after"], "30");
    assert_eq!(dlock_axum::Rejection::of(&res).map(|r| r.is_dlock()), Some(true));
    let v = assert_rejection(res, 409, "lock_wait_timeout").await;
    assert_eq!(v["code"], 2103, "a wait that ran out keeps its own code: {v}");

    let _ = go.send(());
    assert_eq!(first.await.expect("task").expect("infallible").status(), StatusCode::OK);
}

#[tokio::test]
async fn many_concurrent_requests_never_overlap() {
    // The counter is read, the task yields, then it is written back: without
    // the lock concurrent requests would lose updates.
    let counter = Arc::new(Mutex::new(0u64));
    let inside = Arc::new(AtomicUsize::new(0));
    let max_inside = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (counter, inside, max_inside) = (counter.clone(), inside.clone(), max_inside.clone());
        move || {
            let (counter, inside, max_inside) = (counter.clone(), inside.clone(), max_inside.clone());
            async move {
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max_inside.fetch_max(now, Ordering::SeqCst);
                let read = *counter.lock().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
                *counter.lock().await = read + 1;
                inside.fetch_sub(1, Ordering::SeqCst);
                "ok"
            }
        }
    };
    let layer = LockLayer::new("counter").json("id").wait(LONG);
    let app: Router = Router::new().route("/r", post(handler).layer(layer)).with_dlock(locker());
    let tasks: Vec<_> = (0..50).map(|_| tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"id": "c"}"#)))).collect();
    for t in tasks {
        assert_eq!(t.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    assert_eq!(*counter.lock().await, 50);
    assert_eq!(max_inside.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_waiting_request_gets_the_lock_after_the_holder_answers() {
    let (app, mut entered) = gated_app(&locker(), LockLayer::new("stock").json("product_id").wait(LONG));
    let first = tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"product_id": 1}"#)));
    let go_first = tokio::time::timeout(LONG, entered.recv()).await.expect("first runs").expect("channel");
    let second = tokio::spawn(app.oneshot(post_json("/r", r#"{"product_id": 1}"#)));
    // The second must not enter while the first holds the lock.
    assert!(tokio::time::timeout(Duration::from_millis(200), entered.recv()).await.is_err());
    let _ = go_first.send(());
    assert_eq!(first.await.expect("task").expect("infallible").status(), StatusCode::OK);
    let go_second = tokio::time::timeout(LONG, entered.recv()).await.expect("second runs").expect("channel");
    let _ = go_second.send(());
    assert_eq!(second.await.expect("task").expect("infallible").status(), StatusCode::OK);
}

#[tokio::test]
async fn key_parts_come_from_json_query_path_and_header_in_order() {
    let locker = locker();
    let layer = LockLayer::new("order.create").json("product.id").query("token").path("shop").header("x-user-id");
    let app: Router =
        Router::new().route("/shops/{shop}/orders", post(|| async { "ok" }).layer(layer)).with_dlock(locker.clone());
    let req = |token: &str, user: &str| {
        Request::post(format!("/shops/s%3A1/orders?x=1&token={token}"))
            .header("x-user-id", user)
            .body(Body::from(r#"{"product": {"id": 7}}"#))
            .expect("request")
    };
    // Hold exactly the key the layer must build, as another owner.
    let key = locker.key("order.create").part(7).part("t 1").part("s:1").part("u1").build().expect("key");
    let held = locker.try_acquire(&key).await.expect("free");
    assert_eq!(key.as_str(), "dlock:{order.create:7:t 1:s%3A1:u1}");

    let res = app.clone().oneshot(req("t+1", "u1")).await.expect("infallible");
    assert_rejection(res, 409, "duplicate_submission").await;
    let res = app.clone().oneshot(req("t+1", "u2")).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK, "another user is another key");
    let res = app.clone().oneshot(req("t+2", "u1")).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK, "another token is another key");
    held.release().await.expect("release");
    let res = app.clone().oneshot(req("t+1", "u1")).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);

    // Each missing source is named.
    let no_token = Request::post("/shops/s/orders")
        .header("x-user-id", "u")
        .body(Body::from(r#"{"product": {"id": 7}}"#))
        .expect("request");
    let v =
        assert_rejection(app.clone().oneshot(no_token).await.expect("infallible"), 400, "lock_key_field_missing").await;
    assert!(v["message"].as_str().unwrap_or_default().contains("token"), "{v}");
    let no_header =
        Request::post("/shops/s/orders?token=t").body(Body::from(r#"{"product": {"id": 7}}"#)).expect("request");
    let v = assert_rejection(app.oneshot(no_header).await.expect("infallible"), 400, "lock_key_field_missing").await;
    assert!(v["message"].as_str().unwrap_or_default().contains("x-user-id"), "{v}");
}

/// An empty (or blank) header is no value: taken as the key part `""`, it
/// would put every request without a real value under one lock.
#[tokio::test]
async fn an_empty_header_is_refused_as_a_missing_one() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("report").header("x-tenant-id"), calls.clone());
    let req =
        |value: &'static str| Request::post("/r").header("x-tenant-id", value).body(Body::empty()).expect("request");
    for value in ["", " ", " \t "] {
        let res = app.clone().oneshot(req(value)).await.expect("infallible");
        let v = assert_rejection(res, 400, "lock_key_field_missing").await;
        assert_eq!(v["code"], 2001, "{v}");
        assert!(v["message"].as_str().unwrap_or_default().contains("x-tenant-id"), "{value:?}: {v}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no blank value reached the route");
    assert_eq!(app.oneshot(req("t1")).await.expect("infallible").status(), StatusCode::OK);
}

/// The same for a query parameter of the key: `?tenant=` (or `%20`, or a
/// `+`, a space once decoded) is no value.
#[tokio::test]
async fn an_empty_query_parameter_is_refused_as_a_missing_one() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&locker(), LockLayer::new("report").query("tenant"), calls.clone());
    let req = |query: &str| Request::post(format!("/r?{query}")).body(Body::empty()).expect("request");
    for query in ["tenant=", "tenant", "tenant=%20", "tenant=+&x=1"] {
        let res = app.clone().oneshot(req(query)).await.expect("infallible");
        let v = assert_rejection(res, 400, "lock_key_field_missing").await;
        assert!(v["message"].as_str().unwrap_or_default().contains("tenant"), "{query:?}: {v}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no blank value reached the route");
    assert_eq!(app.oneshot(req("tenant=t1")).await.expect("infallible").status(), StatusCode::OK);
}

#[tokio::test]
async fn a_key_that_is_too_long_is_400_lock_key_invalid() {
    let app = echo_app(&locker(), LockLayer::new("stock").json("product_id"), Arc::new(AtomicUsize::new(0)));
    let body = json!({"product_id": "x".repeat(2000)}).to_string();
    assert_rejection(app.oneshot(post_json("/r", body)).await.expect("infallible"), 400, "lock_key_invalid").await;
}

#[tokio::test]
async fn no_engine_is_500_lock_misconfigured() {
    let app: Router = Router::new().route("/r", post(|| async { "ok" }).layer(LockLayer::new("x")));
    assert_rejection(app.oneshot(post_json("/r", "{}")).await.expect("infallible"), 500, "lock_misconfigured").await;
}

#[tokio::test]
async fn a_locker_given_to_the_layer_needs_no_extension() {
    let app: Router = Router::new().route("/r", post(|| async { "ok" }).layer(LockLayer::new("x").locker(locker())));
    assert_eq!(app.oneshot(post_json("/r", "{}")).await.expect("infallible").status(), StatusCode::OK);
}

#[tokio::test]
async fn nested_locks_on_one_key_reenter_within_a_request() {
    let owners = Arc::new(std::sync::Mutex::new(Vec::<Owner>::new()));
    let handler = {
        let owners = owners.clone();
        move |RequestOwner(owner): RequestOwner| {
            let owners = owners.clone();
            async move {
                owners.lock().map(|mut o| o.push(owner)).expect("not poisoned");
                "ok"
            }
        }
    };
    // Two layers on the same key and no wait: without reentrancy the inner
    // one would find the lock held and answer 409.
    let inner = LockLayer::new("stock").json("product_id");
    let outer = LockLayer::new("stock").json("product_id");
    let app: Router =
        Router::new().route("/r", post(handler).layer::<_, Infallible>(inner).layer(outer)).with_dlock(locker());
    let res = app.oneshot(post_json("/r", r#"{"product_id": 3}"#)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(owners.lock().expect("not poisoned").len(), 1);
}

#[tokio::test]
async fn a_dropped_request_releases_its_lock() {
    let locker = locker();
    let (app, mut entered) = gated_app(&locker, LockLayer::new("stock").json("product_id"));
    let mut pending = Box::pin(app.clone().oneshot(post_json("/r", r#"{"product_id": 9}"#)));
    tokio::select! {
        _ = &mut pending => panic!("the gated handler cannot finish"),
        go = entered.recv() => drop(go),
    }
    drop(pending); // the client went away mid-request
    let key = locker.key("stock").part(9).build().expect("key");
    let guard = locker.acquire(&key, AcquireOptions::new().with_wait(LONG)).await.expect("freed by the dropped guard");
    guard.release().await.expect("release");
}

/// A backend whose server is down.
#[derive(Debug)]
struct Down;

impl Backend for Down {
    fn name(&self) -> &'static str {
        "down"
    }
    fn acquire<'a>(
        &'a self,
        _: &'a AcquireRequest,
        _: &'a CancellationToken,
    ) -> BoxFuture<'a, dlock_core::Result<Grant>> {
        Box::pin(async { Err(dlock_core::Error::backend("down", "connection refused")) })
    }
    fn renew<'a>(&'a self, _: &'a LockKey, _: &'a Owner, _: Duration) -> BoxFuture<'a, dlock_core::Result<Renewal>> {
        Box::pin(async { Err(dlock_core::Error::backend("down", "connection refused")) })
    }
    fn release<'a>(&'a self, _: &'a LockKey, _: &'a Owner) -> BoxFuture<'a, dlock_core::Result<Release>> {
        Box::pin(async { Err(dlock_core::Error::backend("down", "connection refused")) })
    }
    fn ready(&self) -> BoxFuture<'_, dlock_core::Result<()>> {
        Box::pin(async { Err(dlock_core::Error::backend("down", "connection refused")) })
    }
}

/// The readiness probe says which part is down and why: `503` with the
/// backend's error, `200` for the same route over a live backend.
#[tokio::test]
async fn the_readiness_probe_names_what_is_down() {
    let probe =
        |locker: Locker| Router::new().route("/ready", axum::routing::get(dlock_axum::ready)).with_dlock(locker);
    let ask = || Request::get("/ready").body(Body::empty()).expect("request");
    let res = probe(Locker::new(Down)).oneshot(ask()).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    let body: Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["checks"][0]["part"], "locks", "{body}");
    assert_eq!(body["checks"][0]["backend"], "down", "{body}");
    assert!(body["checks"][0]["problem"].as_str().is_some_and(|p| p.contains("connection refused")), "{body}");
    assert_eq!(body["checks"][1]["part"], "idempotency", "{body}");
    assert_eq!(body["checks"][1]["ok"], true, "{body}");
    let res = probe(locker()).oneshot(ask()).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn an_unreachable_backend_is_503_and_the_handler_does_not_run() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = echo_app(&Locker::new(Down), LockLayer::new("stock").json("product_id").wait(LONG), calls.clone());
    let res = tokio::time::timeout(Duration::from_secs(10), app.oneshot(post_json("/r", r#"{"product_id": 1}"#)))
        .await
        .expect("no hang")
        .expect("infallible");
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(res.extensions().get::<LockOutcome>(), Some(&LockOutcome::Unavailable));
    assert_rejection(res, 503, "lock_backend_unavailable").await;
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[derive(Debug, PartialEq)]
struct InnerError(&'static str);

#[tokio::test]
async fn the_inner_services_error_passes_through() {
    let inner = tower::service_fn(|_req: Request<Body>| async { Err::<Response, _>(InnerError("boom")) });
    let mut svc = LockLayer::new("x").locker(locker()).layer(inner);
    let err = svc.ready().await.expect("ready").call(post_json("/r", "{}")).await.expect_err("inner error");
    assert_eq!(err, InnerError("boom"));
    // The lock was released all the same: a held lock would answer 409 here
    // instead of reaching the inner service.
    let res = svc.ready().await.expect("ready").call(post_json("/r", "{}")).await;
    assert!(res.is_err());
}

#[test]
fn layer_is_clone_and_debug() {
    let layer = LockLayer::new("stock").json("product_id").wait(Duration::from_secs(5));
    let text = format!("{:?}", layer.clone());
    assert!(text.contains("product_id") && text.contains("stock"), "{text}");
}

#[tokio::test]
async fn path_parts_work_under_router_layer_but_not_around_the_router() {
    let locker = locker();
    // `Router::layer` wraps each route, after the path was matched.
    let app: Router = Router::new()
        .route("/items/{id}", post(|| async { "ok" }))
        .layer(LockLayer::new("item").path("id"))
        .with_dlock(locker.clone());
    let held = locker.try_acquire(&locker.key("item").part("1").build().expect("key")).await.expect("free");
    let res = app.clone().oneshot(post_json("/items/1", "{}")).await.expect("infallible");
    assert_rejection(res, 409, "duplicate_submission").await;
    assert_eq!(app.clone().oneshot(post_json("/items/2", "{}")).await.expect("infallible").status(), StatusCode::OK);
    held.release().await.expect("release");

    // Wrapped around the whole router, the layer runs before routing.
    let outside = LockLayer::new("item").path("id").locker(locker).layer(app);
    let res = outside.oneshot(post_json("/items/1", "{}")).await.expect("infallible");
    assert_rejection(res, 500, "lock_misconfigured").await;
}

#[tokio::test]
async fn a_path_parameter_that_is_not_utf8_is_a_400_not_a_500() {
    let app: Router = Router::new()
        .route("/items/{id}", post(|| async { "ok" }).layer(LockLayer::new("item").path("id")))
        .with_dlock(locker());
    let res = app.oneshot(post_json("/items/%FF%FE", "{}")).await.expect("infallible");
    assert_rejection(res, 400, "lock_key_invalid").await;
}

/// A handler stuck past the layer's `max_hold` stops holding the lock: the
/// watchdog (lease 200 ms) stops renewing at 300 ms, and a request for the
/// same key gets through while the first is still stuck, with a higher
/// fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_frees_the_lock_of_a_stuck_handler() {
    let locker = Locker::with_options(
        Arc::new(MemoryBackend::new()),
        dlock_core::LockerOptions::default().with_watchdog_lease(Duration::from_millis(200)),
    )
    .expect("options");
    let handler = |FencingToken(fence): FencingToken, body: Bytes| async move {
        if body.as_ref() == b"{\"id\":1,\"stuck\":true}" {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        fence.to_string()
    };
    let layer = LockLayer::new("stuck").json("id").max_hold(Duration::from_millis(300));
    let app = Router::new().route("/r", post(handler).layer(layer)).with_dlock(locker);
    let stuck = tokio::spawn(app.clone().oneshot(post_json("/r", r#"{"id":1,"stuck":true}"#)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let res = app.clone().oneshot(post_json("/r", r#"{"id":1}"#)).await.expect("infallible");
    assert_rejection(res, 409, "duplicate_submission").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let res = app.clone().oneshot(post_json("/r", r#"{"id":1}"#)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK, "freed after max_hold + lease");
    let later: u64 = String::from_utf8(res.into_body().collect().await.expect("body").to_bytes().to_vec())
        .expect("utf-8")
        .parse()
        .expect("fence");
    let first = stuck.await.expect("task").expect("infallible");
    assert_eq!(first.status(), StatusCode::OK);
    let first: u64 = String::from_utf8(first.into_body().collect().await.expect("body").to_bytes().to_vec())
        .expect("utf-8")
        .parse()
        .expect("fence");
    assert!(later > first, "the later holder's fence {later} is above the stuck one's {first}");
}

/// T11e: one caller asks for 10,000 locks at once. Only the cap's worth
/// is taken (the rest are refused with 429 before any lock is asked for),
/// another caller is served meanwhile, the stuck holds end at `max_hold`
/// so their keys are free to others, and the cap is given back when the
/// requests finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_cannot_hold_more_locks_than_its_cap() {
    const CAP: usize = 100;
    const ASKED: usize = 10_000;
    let locker = Locker::with_options(
        Arc::new(MemoryBackend::new()),
        dlock_core::LockerOptions::default().with_watchdog_lease(Duration::from_millis(200)),
    )
    .expect("options");
    let (let_go, go) = tokio::sync::watch::channel(false);
    let entered = Arc::new(AtomicUsize::new(0));
    let handler = {
        let entered = entered.clone();
        move |body: Bytes| {
            let (mut go, entered) = (go.clone(), entered.clone());
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                if body.as_ref().starts_with(b"{\"id\":\"greedy") {
                    let _ = go.wait_for(|go| *go).await;
                }
                body
            }
        }
    };
    let layer = LockLayer::new("report")
        .json("id")
        .max_holds_per(CAP, Caller::header("x-user-id"))
        .max_hold(Duration::from_millis(300));
    let app = Router::new().route("/r", post(handler).layer(layer)).with_dlock(locker.clone());
    let as_user = |user: &str, id: String| {
        Request::post("/r").header("x-user-id", user).body(Body::from(format!("{{\"id\":\"{id}\"}}"))).expect("request")
    };

    let greedy: Vec<_> =
        (0..ASKED).map(|i| tokio::spawn(app.clone().oneshot(as_user("greedy", format!("greedy-{i}"))))).collect();
    let deadline = tokio::time::Instant::now() + LONG;
    while entered.load(Ordering::SeqCst) < CAP && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Others are not affected by the greedy caller's cap.
    let res = app.clone().oneshot(as_user("other", "other-1".into())).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);

    // Wait for every refusal to come back; the holders stay stuck.
    while greedy.iter().filter(|t| t.is_finished()).count() < ASKED - CAP && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (mut held, mut refused) = (Vec::new(), 0);
    for t in greedy {
        if t.is_finished() {
            let res = t.await.expect("task").expect("infallible");
            assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::OverQuota)));
            assert_rejection(res, 429, "too_many_locks").await;
            refused += 1;
        } else {
            held.push(t);
        }
    }
    assert_eq!((held.len(), refused), (CAP, ASKED - CAP), "exactly the cap is held");
    assert_eq!(entered.load(Ordering::SeqCst), CAP + 1, "the refused never reached the handler");

    // The stuck holds end at max_hold: their keys are free to others while
    // the greedy requests are still running.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut taken = 0;
    for i in 0..ASKED {
        let key = locker.key("report").part(format!("greedy-{i}")).build().expect("key");
        if let Ok(g) = locker.try_acquire(&key).await {
            taken += 1;
            g.release().await.expect("release");
        }
    }
    assert_eq!(taken, ASKED, "no greedy hold outlived max_hold");

    // Finished requests give their holds back.
    let _ = let_go.send(true);
    for t in held {
        assert_eq!(t.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    let res = app.oneshot(as_user("greedy", "greedy-again".into())).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK, "the cap is free again");
}

/// Set by the service's authentication (here, for every request).
#[derive(Clone)]
struct User(&'static str);

/// A cap keyed on the caller the application established holds however
/// the client varies its headers; a cap on a header the client chooses
/// (no trusted proxy in front) gives each made-up value a cap of its own.
#[tokio::test]
async fn a_cap_keyed_on_the_apps_caller_ignores_client_headers() {
    let by_app = LockLayer::new("report")
        .json("id")
        .max_holds_per(2, Caller::from_fn(|parts| parts.extensions.get::<User>().map(|u| u.0.to_owned())));
    assert_eq!(third_of_one_user(by_app).await, 429, "keyed on the app's caller: capped");
    let by_header = LockLayer::new("report").json("id").max_holds_per(2, Caller::header("x-user-id"));
    assert_eq!(third_of_one_user(by_header).await, 200, "keyed on a client-chosen header: bypassed");
}

/// One authenticated user sends three requests, each with a made-up
/// `x-user-id`, while its first two hold their locks: the third's status.
async fn third_of_one_user(layer: LockLayer) -> u16 {
    let (app, mut entered) = gated_app(&locker(), layer);
    let app = app.layer(axum::Extension(User("mallory")));
    let as_header = |user: &str, id: u32| {
        Request::post("/r").header("x-user-id", user).body(Body::from(format!("{{\"id\":{id}}}"))).expect("request")
    };
    let first = tokio::spawn(app.clone().oneshot(as_header("u1", 1)));
    let second = tokio::spawn(app.clone().oneshot(as_header("u2", 2)));
    let mut gates = Vec::new();
    for _ in 0..2 {
        gates.push(tokio::time::timeout(LONG, entered.recv()).await.expect("holds").expect("channel"));
    }
    let third = tokio::spawn(app.clone().oneshot(as_header("u3", 3)));
    // A third that got past the cap reaches the handler: let it go too.
    if let Ok(Some(gate)) = tokio::time::timeout(Duration::from_millis(500), entered.recv()).await {
        gates.push(gate);
    }
    for gate in gates {
        let _ = gate.send(());
    }
    let res = third.await.expect("task").expect("infallible");
    let status = res.status().as_u16();
    if status == 429 {
        assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::OverQuota)));
        let v = assert_rejection(res, 429, "too_many_locks").await;
        assert!(!v["message"].as_str().unwrap_or_default().contains("mallory"), "names no caller: {v}");
    }
    for t in [first, second] {
        assert_eq!(t.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    status
}

/// A capped route refuses a request that names no caller with
/// `400 lock_caller_missing`, before any lock is asked for and without
/// counting it anywhere: neither a way around the cap nor a bucket one
/// client can fill for all the others.
#[tokio::test]
async fn a_capped_route_refuses_a_request_without_a_caller() {
    let locker = locker();
    let calls = Arc::new(AtomicUsize::new(0));
    let by_user = Caller::from_fn(|parts| parts.extensions.get::<User>().map(|u| u.0.to_owned()));
    let by_header = Caller::header("x-user-id");
    for (caller, user_header) in [(by_user, None), (by_header.clone(), None), (by_header, Some(" "))] {
        let layer = LockLayer::new("report").json("id").max_holds_per(1, caller);
        let app = echo_app(&locker, layer, calls.clone());
        for id in 0..3 {
            let mut req = Request::post("/r").header("content-type", "application/json");
            if let Some(value) = user_header {
                req = req.header("x-user-id", value);
            }
            let res = app.clone().oneshot(req.body(Body::from(format!("{{\"id\":{id}}}"))).expect("request"));
            let res = res.await.expect("infallible");
            assert!(
                matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Invalid { error }) if error == "lock_caller_missing"),
                "{:?}",
                res.extensions().get::<LockOutcome>()
            );
            assert_rejection(res, 400, "lock_caller_missing").await;
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
    let key = locker.key("report").part("0").build().expect("key");
    locker.try_acquire(&key).await.expect("no lock was taken").release().await.expect("release");

    // The same route serves a request that names its caller.
    let layer = LockLayer::new("report").json("id").max_holds_per(1, Caller::header("x-user-id"));
    let res = echo_app(&locker, layer, calls.clone())
        .oneshot(Request::post("/r").header("x-user-id", "u1").body(Body::from("{\"id\":0}")).expect("request"))
        .await
        .expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Several routes on one locker, each gated like [`gated_app`]: a request
/// says it runs (with its path) and waits to be let go.
fn gated_routes(locker: &Locker, routes: Vec<(&'static str, LockLayer)>) -> (Router, mpsc::UnboundedReceiver<Entered>) {
    let (entered_tx, entered_rx) = mpsc::unbounded_channel::<Entered>();
    let mut app = Router::new();
    for (path, layer) in routes {
        let entered_tx = entered_tx.clone();
        let handler = move |body: Bytes| {
            let entered_tx = entered_tx.clone();
            async move {
                let (go_tx, go_rx) = oneshot::channel();
                let _ = entered_tx.send(Entered { path, go: go_tx });
                let _ = go_rx.await;
                body
            }
        };
        app = app.route(path, post(handler).route_layer(layer));
    }
    (app.with_dlock(locker.clone()), entered_rx)
}

/// A gated request that runs, and lets it finish.
struct Entered {
    path: &'static str,
    go: oneshot::Sender<()>,
}

/// A request expected to be refused: its answer, or a failure when it runs
/// (it would wait at the gate for ever) instead.
async fn refused(answer: impl std::future::Future<Output = Result<Response, Infallible>>) -> Response {
    tokio::time::timeout(Duration::from_secs(5), answer).await.expect("refused, not let in").expect("infallible")
}

async fn next_entered(entered: &mut mpsc::UnboundedReceiver<Entered>) -> Entered {
    tokio::time::timeout(LONG, entered.recv()).await.expect("a request runs").expect("channel")
}

/// Issue 26: shared requests on one key run together; an exclusive one is
/// refused while they run (409, as any held lock), and runs once they end;
/// a shared one is refused while an exclusive one runs.
#[tokio::test]
async fn shared_requests_run_together_and_keep_an_exclusive_one_out() {
    let (app, mut entered) = gated_routes(
        &locker(),
        vec![
            ("/read", LockLayer::new("price.list").json("list").shared().wait(Duration::ZERO)),
            ("/write", LockLayer::new("price.list").json("list").wait(Duration::ZERO)),
        ],
    );
    let send = |path: &str| app.clone().oneshot(post_json(path, r#"{"list": 1}"#));
    let readers = [tokio::spawn(send("/read")), tokio::spawn(send("/read"))];
    // Both readers run at once: neither is let go before the other entered.
    let (a, b) = (next_entered(&mut entered).await, next_entered(&mut entered).await);
    assert_eq!((a.path, b.path), ("/read", "/read"));

    let res = refused(send("/write")).await;
    assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })));
    assert_eq!(res.headers()["retry-after"], "30", "the watchdog lease");
    assert_rejection(res, 409, "duplicate_submission").await;

    let _ = (a.go.send(()), b.go.send(()));
    for reader in readers {
        assert_eq!(reader.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }

    // Now the writer runs, alone: a reader is refused meanwhile.
    let writer = tokio::spawn(send("/write"));
    let w = next_entered(&mut entered).await;
    assert_eq!(w.path, "/write");
    assert_rejection(refused(send("/read")).await, 409, "duplicate_submission").await;
    let _ = w.go.send(());
    assert_eq!(writer.await.expect("task").expect("infallible").status(), StatusCode::OK);
}

/// Issue 26: a semaphore of 2 admits exactly two requests per key at once;
/// the third is `429 lock_permits_exhausted` with `Retry-After`, whether
/// the route waits or not; another key has its own permits; a permit given
/// back admits the next request.
#[tokio::test]
async fn a_semaphore_admits_n_at_once_and_answers_the_next_429() {
    let export = || LockLayer::new("export").header("x-user-id").permits(2);
    let locker = locker();
    let (app, mut entered) = gated_routes(
        &locker,
        vec![
            ("/export", export().wait(Duration::ZERO)),
            ("/export-waiting", export().wait(Duration::from_millis(100))),
        ],
    );
    let as_user = |path: &str, user: &str| {
        let req = Request::post(path).header("x-user-id", user).body(Body::empty()).expect("request");
        app.clone().oneshot(req)
    };
    let running = [tokio::spawn(as_user("/export", "u1")), tokio::spawn(as_user("/export", "u1"))];
    let held = [next_entered(&mut entered).await, next_entered(&mut entered).await];

    for path in ["/export", "/export-waiting"] {
        let res = refused(as_user(path, "u1")).await;
        assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })), "{path}");
        assert_eq!(res.headers()["retry-after"], "30", "{path}: the watchdog lease");
        let v = assert_rejection(res, 429, "lock_permits_exhausted").await;
        assert_eq!(v["code"], 2403, "{path}: {v}");
    }
    assert!(entered.try_recv().is_err(), "no third request ran");

    // Another user's exports are counted apart.
    let other = tokio::spawn(as_user("/export", "u2"));
    let o = next_entered(&mut entered).await;
    let _ = o.go.send(());
    assert_eq!(other.await.expect("task").expect("infallible").status(), StatusCode::OK);

    // One permit given back: the next request of u1 runs.
    let [first, second] = held;
    let _ = first.go.send(());
    let next = tokio::spawn(as_user("/export", "u1"));
    let n = next_entered(&mut entered).await;
    let _ = (second.go.send(()), n.go.send(()));
    for task in running.into_iter().chain([next]) {
        assert_eq!(task.await.expect("task").expect("infallible").status(), StatusCode::OK);
    }
}

/// Issue 26: a multi-key route holds every key while it runs (a request on
/// either is refused, one on a third key is not) and releases them all.
/// The refusal names no key (the log names the busy one by its log id:
/// `log_event.rs`, whose tests all capture logs).
#[tokio::test(flavor = "current_thread")]
async fn a_multi_key_route_holds_every_key_and_releases_them_all() {
    let locker = locker();
    let (app, mut entered) = gated_routes(
        &locker,
        vec![
            ("/transfer", LockLayer::new("account").json("from").also("account").json("to").wait(Duration::ZERO)),
            ("/account", LockLayer::new("account").json("id").wait(Duration::ZERO)),
        ],
    );
    let send = |path: &str, body: Value| app.clone().oneshot(post_json(path, body.to_string()));
    let transfer = tokio::spawn(send("/transfer", json!({"from": 1, "to": 2, "amount": 5})));
    let t = next_entered(&mut entered).await;
    assert_eq!(t.path, "/transfer");
    for id in [1, 2] {
        let v = assert_rejection(refused(send("/account", json!({"id": id}))).await, 409, "duplicate_submission").await;
        assert_eq!(v["message"], dlock_axum::DEFAULT_DUPLICATE_MESSAGE);
    }
    let third = tokio::spawn(send("/account", json!({"id": 3})));
    let a3 = next_entered(&mut entered).await;
    let _ = a3.go.send(());
    assert_eq!(third.await.expect("task").expect("infallible").status(), StatusCode::OK);

    let _ = t.go.send(());
    assert_eq!(transfer.await.expect("task").expect("infallible").status(), StatusCode::OK);
    for id in [1u64, 2] {
        let key = locker.key("account").part(id).build().expect("key");
        locker.try_acquire(&key).await.expect("released with the transfer").release().await.expect("release");
    }

    // The second key busy: refused, the body names no key, the log names
    // the busy key (by its log id), not the free one.
    let (from, to) = (
        locker.key("account").part(7u64).build().expect("key"),
        locker.key("account").part(8u64).build().expect("key"),
    );
    let held = locker.try_acquire(&to).await.expect("free");
    let res = refused(send("/transfer", json!({"from": 7, "to": 8, "amount": 5}))).await;
    let v = assert_rejection(res, 409, "duplicate_submission").await;
    assert!(!v.to_string().contains("account"), "no key in the answer: {v}");
    held.release().await.expect("release");
    // All or none: the free key was not kept by the refused request.
    locker.try_acquire(&from).await.expect("not left held").release().await.expect("release");
}

/// Issue 26: transfers A→B and B→A at the same time all complete: the keys
/// are taken in one order, whatever order the request names them in, so no
/// two requests wait for each other in a cycle. No two run on one account
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_multi_key_requests_never_deadlock_nor_overlap() {
    let busy: Arc<std::sync::Mutex<std::collections::HashSet<u64>>> = Arc::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (busy, overlaps) = (busy.clone(), overlaps.clone());
        move |body: Bytes| {
            let (busy, overlaps) = (busy.clone(), overlaps.clone());
            async move {
                let t: Value = serde_json::from_slice(&body).expect("json");
                let accounts = [t["from"].as_u64().expect("from"), t["to"].as_u64().expect("to")];
                for a in accounts {
                    if !busy.lock().expect("set").insert(a) {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                for a in accounts {
                    busy.lock().expect("set").remove(&a);
                }
                body
            }
        }
    };
    let layer = LockLayer::new("account").json("from").also("account").json("to").wait(Duration::from_secs(20));
    let app = Router::new().route("/transfer", post(handler).route_layer(layer)).with_dlock(locker());
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let body = if i % 2 == 0 { json!({"from": 1, "to": 2}) } else { json!({"from": 2, "to": 1}) };
            tokio::spawn(app.clone().oneshot(post_json("/transfer", body.to_string())))
        })
        .collect();
    let all = futures_util::future::join_all(tasks);
    let results = tokio::time::timeout(LONG, all).await.expect("no deadlock: every transfer answers");
    for r in results {
        assert_eq!(r.expect("task").expect("infallible").status(), StatusCode::OK);
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two transfers ran on one account at once");
}
