//! One request-lock pipeline behind both faces: every way a locked request
//! can be refused is sent to a `LockLayer` route and to a `#[lockable]`
//! handler configured alike, and both must answer with the same status,
//! `error`, `code` and headers.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use dlock_axum::{lockable, DlockExt, DlockRuntime, JsonBody, LockLayer};
use dlock_core::backend::redis::RedisBackend;
use dlock_core::{LockGuard, Locker, MemoryBackend};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::Value;
use tower::ServiceExt;

/// The body limit installed with the engine in these tests.
const LIMIT: usize = 4096;

#[derive(Debug, Deserialize)]
struct Req {
    id: String,
}

#[lockable(key = "t", fields = ["req.id"], wait_ms = 0, message = "taken", code = 4242)]
async fn at_once(JsonBody(req): JsonBody<Req>) -> String {
    req.id
}

#[lockable(key = "t", fields = ["req.id"], wait_ms = 100, message = "taken", code = 4242)]
async fn waiting(JsonBody(req): JsonBody<Req>) -> String {
    req.id
}

fn layer(wait: Duration) -> LockLayer {
    LockLayer::new("t").json("id").wait(wait).message("taken").code(4242)
}

/// Both faces, each with a route that tries once and one that waits 100 ms.
fn routes() -> Router {
    let echo = |body: String| async move { body };
    Router::new()
        .route("/layer/at-once", post(echo).layer(layer(Duration::ZERO)))
        .route("/layer/waiting", post(echo).layer(layer(Duration::from_millis(100))))
        .route("/macro/at-once", post(at_once))
        .route("/macro/waiting", post(waiting))
}

fn app(locker: &Locker) -> Router {
    routes().with_dlock(DlockRuntime::new(locker.clone()).with_max_body_bytes(LIMIT))
}

/// What must be equal between the faces.
#[derive(Debug, PartialEq)]
struct Answer {
    status: StatusCode,
    error: Value,
    code: Value,
    headers: HeaderMap,
}

async fn answer(res: Response) -> Answer {
    let (mut parts, body) = res.into_parts();
    // Follows the message, whose text may name what differs (a field path).
    parts.headers.remove("content-length");
    let bytes = body.collect().await.expect("body").to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer { status: parts.status, error: v["error"].clone(), code: v["code"].clone(), headers: parts.headers }
}

fn request(uri: &str, content_type: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(uri).header("content-type", content_type).body(body.into()).expect("request")
}

/// Sends the same request to both faces' `route` ("at-once" or "waiting")
/// and checks that they answer alike, and as `expected`.
async fn both(app: &Router, route: &str, content_type: &str, body: &str, expected: (u16, &str, u64)) {
    let layer = answer(
        app.clone()
            .oneshot(request(&format!("/layer/{route}"), content_type, body.to_owned()))
            .await
            .expect("infallible"),
    )
    .await;
    let macro_ = answer(
        app.clone()
            .oneshot(request(&format!("/macro/{route}"), content_type, body.to_owned()))
            .await
            .expect("infallible"),
    )
    .await;
    assert_eq!(layer, macro_, "the faces differ for {route} {content_type} {:.40}", body);
    let (status, error, code) = expected;
    assert_eq!(
        (layer.status.as_u16(), layer.error.as_str(), layer.code.as_u64()),
        (status, Some(error), Some(code)),
        "{body:.40}"
    );
}

async fn hold(locker: &Locker, id: &str) -> LockGuard {
    let key = locker.key("t").part(id).build().expect("key");
    locker.try_acquire(&key).await.expect("free")
}

#[tokio::test]
async fn every_refusal_is_the_same_through_both_faces() {
    let locker = Locker::new(MemoryBackend::new());
    let app = app(&locker);
    const JSON: &str = "application/json";

    // The request cannot be turned into a key.
    // A key field missing from the body: the layer reads the key and says
    // so; `JsonBody` reads a type and cannot know which of its fields the key
    // uses (issue 25: a missing field that is no key part is no
    // `lock_key_field_missing`), so it says the body does not fit the type,
    // naming the field. Both are 400s that name `id`.
    for (face, expected) in [("layer", ("lock_key_field_missing", 2001)), ("macro", ("invalid_json", 2002))] {
        let res = app.clone().oneshot(request(&format!("/{face}/at-once"), JSON, "{}")).await.expect("infallible");
        assert_eq!(res.status(), 400, "{face}");
        let v: Value =
            serde_json::from_slice(&res.into_body().collect().await.expect("body").to_bytes()).expect("json");
        assert_eq!((v["error"].as_str(), v["code"].as_u64()), (Some(expected.0), Some(expected.1)), "{face}: {v}");
        assert!(v["message"].as_str().is_some_and(|m| m.contains("`id` is missing")), "{face}: {v}");
    }
    both(&app, "at-once", JSON, r#"{"id": "#, (400, "invalid_json", 2002)).await;
    both(&app, "at-once", "text/plain", r#"{"id": "7"}"#, (415, "unsupported_media_type", 2302)).await;
    let oversize = format!(r#"{{"id": "{}"}}"#, "x".repeat(LIMIT));
    both(&app, "at-once", JSON, &oversize, (413, "payload_too_large", 2301)).await;
    let too_long_key = format!(r#"{{"id": "{}"}}"#, "x".repeat(2000));
    both(&app, "at-once", JSON, &too_long_key, (400, "lock_key_invalid", 2006)).await;

    // The lock is held elsewhere: at once, and after a wait.
    let guard = hold(&locker, "7").await;
    both(&app, "at-once", JSON, r#"{"id": "7"}"#, (409, "duplicate_submission", 4242)).await;
    // A wait that ran out is its own answer (issue 15: nothing was
    // duplicated), without the configured duplicate message and code.
    both(&app, "waiting", JSON, r#"{"id": "7"}"#, (409, "lock_wait_timeout", 2103)).await;
    // A body the route cannot read is refused before the lock is asked for.
    both(&app, "waiting", "text/plain", r#"{"id": "7"}"#, (415, "unsupported_media_type", 2302)).await;
    guard.release().await.expect("release");

    // And with the lock free, both answer the route's own 200.
    for route in ["at-once", "waiting"] {
        let layer =
            app.clone().oneshot(request(&format!("/layer/{route}"), JSON, r#"{"id": "7"}"#)).await.expect("infallible");
        let macro_ =
            app.clone().oneshot(request(&format!("/macro/{route}"), JSON, r#"{"id": "7"}"#)).await.expect("infallible");
        assert_eq!((layer.status(), macro_.status()), (StatusCode::OK, StatusCode::OK));
    }
}

#[tokio::test]
async fn no_engine_is_the_same_through_both_faces() {
    both(&routes(), "at-once", "application/json", r#"{"id": "7"}"#, (500, "lock_misconfigured", 2901)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backend_is_the_same_through_both_faces() {
    let mut server = dlock_testing::RedisServer::start();
    let locker = Locker::new(RedisBackend::connect(&server.url(), "dlock").await.expect("connect"));
    let app = app(&locker);
    server.kill();
    both(&app, "at-once", "application/json", r#"{"id": "7"}"#, (503, "lock_backend_unavailable", 2501)).await;
    both(&app, "waiting", "application/json", r#"{"id": "7"}"#, (503, "lock_backend_unavailable", 2501)).await;
    let res = app.oneshot(request("/macro/at-once", "application/json", r#"{"id": "7"}"#)).await.expect("infallible");
    assert_eq!(res.headers()["retry-after"], "1", "set once, by the rejection");
}

/// The body limit comes with the installed engine, for the lock layer and
/// the idempotency layer alike; a layer's own limit wins.
#[tokio::test]
async fn the_installed_body_limit_reaches_every_layer() {
    use dlock_axum::idempotency::IdempotencyLayer;
    use dlock_core::idempotency::MemoryStore;
    let idem: std::sync::Arc<dyn dlock_core::idempotency::IdempotencyStore> = std::sync::Arc::new(MemoryStore::new());
    let echo = |body: String| async move { body };
    let app = Router::new()
        .route("/lock", post(echo).layer(LockLayer::new("t").json("id")))
        .route("/lock-own", post(echo).layer(LockLayer::new("t").json("id").max_body_bytes(200)))
        .route("/idem", post(echo).layer(IdempotencyLayer::new().store(idem.clone())))
        .route("/idem-own", post(echo).layer(IdempotencyLayer::new().store(idem.clone()).max_body_bytes(200)))
        .with_dlock(DlockRuntime::new(Locker::new(MemoryBackend::new())).with_max_body_bytes(100));
    let body = format!(r#"{{"id": "{}"}}"#, "x".repeat(120));
    for (uri, status) in [("/lock", 413), ("/idem", 413), ("/lock-own", 200), ("/idem-own", 200)] {
        let req = Request::post(uri)
            .header("content-type", "application/json")
            .header("idempotency-key", "k")
            .header("authorization", "Bearer alice")
            .body(Body::from(body.clone()))
            .expect("request");
        let res = app.clone().oneshot(req).await.expect("infallible");
        assert_eq!(res.status().as_u16(), status, "{uri}");
    }
}

/// Issue 15 item 7: one hook renders the refusals of every dlock layer and
/// of the macro, found by the `Rejection` each response carries; the lock
/// outcome and `Retry-After` survive the rendering.
#[tokio::test]
async fn one_hook_renders_every_refusal_as_problem_details() {
    use dlock_axum::idempotency::{IdempotencyLayer, TokenLayer};
    use dlock_axum::{LockOutcome, RenderRejections};
    use dlock_core::idempotency::MemoryStore;
    let locker = Locker::new(MemoryBackend::new());
    let idem: std::sync::Arc<dyn dlock_core::idempotency::IdempotencyStore> = std::sync::Arc::new(MemoryStore::new());
    let echo = |body: String| async move { body };
    let app = routes()
        .route("/idem", post(echo).layer(IdempotencyLayer::new().store(idem.clone())))
        .route("/token", post(echo).layer(TokenLayer::new().store(idem.clone())))
        .route(
            "/own",
            post(|| async { dlock_axum::Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "none left") }),
        )
        .layer(RenderRejections::problem_details())
        .with_dlock(DlockRuntime::new(locker.clone()).with_max_body_bytes(LIMIT));
    let guard = hold(&locker, "7").await;
    let cases = [
        ("/layer/at-once", r#"{"id": "7"}"#, 409, "taken", "duplicate_submission"),
        ("/macro/waiting", r#"{"id": "7"}"#, 409, "lock_wait_timeout", "lock_wait_timeout"),
        ("/idem", "{}", 400, "idempotency_key_missing", "idempotency_key_missing"),
        ("/token", "{}", 400, "idempotency_token_missing", "idempotency_token_missing"),
        ("/own", "{}", 409, "sold_out", "sold_out"),
    ];
    for (uri, body, status, _, error) in cases {
        let res = app.clone().oneshot(request(uri, "application/json", body.to_owned())).await.expect("infallible");
        assert_eq!(res.status().as_u16(), status, "{uri}");
        assert_eq!(res.headers()["content-type"], "application/problem+json", "{uri}");
        assert_eq!(dlock_axum::Rejection::of(&res).map(|r| r.error().to_owned()).as_deref(), Some(error), "{uri}");
        if uri.contains("at-once") || uri.contains("waiting") {
            assert!(matches!(res.extensions().get::<LockOutcome>(), Some(LockOutcome::Busy { .. })), "{uri}");
            assert_eq!(res.headers()["retry-after"], "30", "{uri}: the watchdog lease");
        }
        let v: Value =
            serde_json::from_slice(&res.into_body().collect().await.expect("body").to_bytes()).expect("json");
        assert_eq!(
            (v["status"].as_u64(), v["error"].as_str(), v["type"].as_str()),
            (Some(status as u64), Some(error), Some("about:blank")),
            "{uri}: {v}"
        );
        assert!(v["code"].is_u64() && v["title"].is_string() && v["detail"].is_string(), "{uri}: {v}");
    }
    guard.release().await.expect("release");
}
