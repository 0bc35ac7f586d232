//! IdempotencyLayer and TokenLayer on the memory store, driven with oneshot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use dlock_axum::idempotency::{token_handler, IdempotencyLayer, TokenLayer};
use dlock_axum::DlockExt;
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use tower::ServiceExt;

fn idem() -> Arc<dyn IdempotencyStore> {
    Arc::new(MemoryStore::new())
}

/// A runtime whose records are `store`: where token endpoints find it.
fn runtime_of(store: &Arc<dyn IdempotencyStore>) -> dlock_axum::DlockRuntime {
    let locker = dlock_core::Locker::new(dlock_core::MemoryBackend::new());
    dlock_axum::DlockRuntime::new(locker).with_idempotency_store(store.clone())
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let res = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = res.into_parts();
    (parts.status, parts.headers, to_bytes(body, usize::MAX).await.expect("body").to_vec())
}

fn error_of(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).expect("json error");
    v["error"].as_str().expect("error field").to_owned()
}

/// A `POST /pay` of the caller `Bearer alice` (the layer's default scope is
/// the `Authorization` header).
fn pay(key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::post("/pay").header("authorization", "Bearer alice");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body.to_owned())).expect("request")
}

/// A route that counts its runs and answers 201 with a fresh id.
fn counting_app(layer: IdempotencyLayer, runs: Arc<AtomicUsize>, delay: Duration) -> Router {
    Router::new().route(
        "/pay",
        post(move |body: String| {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(delay).await;
                (
                    StatusCode::CREATED,
                    [("content-type", "application/json"), ("location", "/pay/1"), ("x-not-stored", "1")],
                    format!("{{\"run\":{n},\"echo\":{body:?}}}"),
                )
            }
        })
        .layer(layer),
    )
}

#[tokio::test]
async fn missing_and_malformed_keys_are_400() {
    let app = counting_app(IdempotencyLayer::new().store(idem()), Arc::default(), Duration::ZERO);
    let (s, _, b) = send(&app, pay(None, "{}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_key_missing"));
    for bad in ["", "has space", &"x".repeat(256), "tab\tkey"] {
        let (s, _, b) = send(&app, pay(Some(bad), "{}")).await;
        assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_key_invalid"), "{bad:?}");
    }
    let (s, _, _) = send(&app, pay(Some(&"x".repeat(255)), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
}

#[tokio::test]
async fn replay_is_byte_for_byte_with_stored_headers() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::ZERO);
    let (s1, h1, b1) = send(&app, pay(Some("k"), "{\"a\":1}")).await;
    let (s2, h2, b2) = send(&app, pay(Some("k"), "{\"a\":1}")).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!((s1, &b1), (s2, &b2));
    assert_eq!(h2["content-type"], h1["content-type"]);
    assert_eq!(h2["location"], "/pay/1");
    assert_eq!(h2["idempotent-replayed"], "true");
    assert!(h1.get("idempotent-replayed").is_none());
    assert!(h2.get("x-not-stored").is_none(), "only selected headers are stored");
}

#[tokio::test]
async fn mismatch_is_422_and_in_progress_is_409() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::from_millis(200));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(Some("k"), "{\"a\":1}")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (s, _, b) = send(&app, pay(Some("k"), "{\"a\":1}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_request_in_progress"));
    let (s, _, b) = send(&app, pay(Some("k"), "{\"a\":2}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"));
    assert_eq!(first.await.expect("task").0, StatusCode::CREATED);
    let (s, _, b) = send(&app, pay(Some("k"), "{\"a\":2}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scopes_keep_callers_apart() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::ZERO);
    let as_user = |auth: &str| {
        Request::post("/pay")
            .header("idempotency-key", "same")
            .header("authorization", auth)
            .body(Body::from("{}"))
            .expect("req")
    };
    let (_, _, alice) = send(&app, as_user("Bearer alice")).await;
    let (_, h, bob) = send(&app, as_user("Bearer bob")).await;
    assert_ne!(alice, bob, "bob must not get alice's response");
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let (_, h, again) = send(&app, as_user("Bearer alice")).await;
    assert_eq!((again, h["idempotent-replayed"].to_str().expect("ascii")), (alice, "true"));
}

/// Issue 15 item 1 changes this test: a `400` of the route was stored and
/// replayed; now only results are (here the route's own `409`), and a `400`
/// frees the key, as Stripe does for a request that failed validation.
#[tokio::test]
async fn server_errors_and_refusals_free_the_key_results_are_stored() {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/pay",
        post(move |body: String| {
            let n = r.fetch_add(1, Ordering::SeqCst);
            async move {
                if body == "flaky" && n == 0 {
                    StatusCode::SERVICE_UNAVAILABLE.into_response()
                } else if body == "paid" {
                    (StatusCode::CONFLICT, "already paid").into_response()
                } else if body == "bad" {
                    (StatusCode::BAD_REQUEST, "bad amount").into_response()
                } else {
                    (StatusCode::CREATED, "ok").into_response()
                }
            }
        })
        .layer(IdempotencyLayer::new().store(idem())),
    );
    assert_eq!(send(&app, pay(Some("f"), "flaky")).await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(send(&app, pay(Some("f"), "flaky")).await.0, StatusCode::CREATED, "503 freed the key");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(send(&app, pay(Some("c"), "paid")).await.0, StatusCode::CONFLICT);
    let (s, h, b) = send(&app, pay(Some("c"), "paid")).await;
    assert_eq!(
        (s, b.as_slice(), h["idempotent-replayed"].to_str().expect("ascii")),
        (StatusCode::CONFLICT, &b"already paid"[..], "true")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(send(&app, pay(Some("b"), "bad")).await.0, StatusCode::BAD_REQUEST);
    let (s, h, _) = send(&app, pay(Some("b"), "bad")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(h.get("idempotent-replayed").is_none(), "a 400 is not stored");
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

/// Issue 15 item 1: axum's own 415 (no `Content-Type` for `Json`) is a
/// refusal before the work; the retry with the header fixed runs the route
/// instead of getting the 415 replayed.
#[tokio::test]
async fn an_extractor_rejection_is_not_replayed_to_the_fixed_retry() {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/pay",
        post(move |axum::Json(v): axum::Json<serde_json::Value>| {
            r.fetch_add(1, Ordering::SeqCst);
            async move { (StatusCode::CREATED, v.to_string()) }
        })
        .layer(IdempotencyLayer::new().store(idem())),
    );
    assert_eq!(send(&app, pay(Some("x"), "{}")).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let fixed = Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "x")
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .expect("request");
    let (s, h, _) = send(&app, fixed).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Issue 15 item 1: a `LockLayer` inside the idempotency layer answers a held
/// lock with `409 duplicate_submission`, "please retry later"; that refusal
/// is dlock's own and is not stored, so the retry it invites runs.
#[tokio::test]
async fn a_lock_refusal_inside_is_not_replayed_to_the_retry_it_invites() {
    use dlock_axum::{DlockExt, LockLayer};
    use dlock_core::{Locker, MemoryBackend};
    let locker = Locker::new(MemoryBackend::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let route = post(move || {
        r.fetch_add(1, Ordering::SeqCst);
        async { (StatusCode::CREATED, "paid") }
    })
    .layer::<_, std::convert::Infallible>(LockLayer::new("pay").header("authorization"))
    .layer::<_, std::convert::Infallible>(IdempotencyLayer::new().store(idem()));
    let app = Router::new().route("/pay", route).with_dlock(locker.clone());
    let key = locker.key("pay").part("Bearer alice").build().expect("key");
    let held = locker.try_acquire(&key).await.expect("free");
    let (s, h, b) = send(&app, pay(Some("l"), "{}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "duplicate_submission"));
    assert_eq!(h["retry-after"], "30", "the watchdog lease: how long the lock may last");
    held.release().await.expect("release");
    let (s, h, _) = send(&app, pay(Some("l"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Issue 15 item 1: the app decides what is stored.
#[tokio::test]
async fn the_app_can_set_what_is_stored() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new().store(idem()).store_when(|res| res.status() != StatusCode::CREATED);
    let app = counting_app(layer, runs.clone(), Duration::ZERO);
    send(&app, pay(Some("s"), "{}")).await;
    let (_, h, _) = send(&app, pay(Some("s"), "{}")).await;
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Issue 15 item 2: on a whole router, only POST and PATCH need a key.
#[tokio::test]
async fn on_a_router_other_methods_pass_through() {
    use axum::http::Method;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::ZERO)
        .route("/health", get(|| async { "ok" }))
        .layer(IdempotencyLayer::new().store(idem()));
    let plain =
        |method: Method, uri: &str| Request::builder().method(method).uri(uri).body(Body::empty()).expect("req");
    assert_eq!(send(&app, plain(Method::GET, "/health")).await.0, StatusCode::OK);
    assert_eq!(send(&app, plain(Method::OPTIONS, "/pay")).await.0, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(send(&app, plain(Method::GET, "/nowhere")).await.0, StatusCode::NOT_FOUND);
    let (s, _, b) = send(&app, plain(Method::PATCH, "/pay")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_key_missing"));
    let only_put =
        counting_app(IdempotencyLayer::new().store(idem()).methods([Method::PUT]), runs.clone(), Duration::ZERO);
    assert_eq!(send(&only_put, pay(None, "{}")).await.0, StatusCode::CREATED, "POST is not guarded here");
}

/// Issue 15 item 3: callers of a cookie-session service never share records;
/// without a scope the request is refused, never put in a shared one.
#[tokio::test]
async fn scope_is_the_callers_and_never_a_shared_anonymous_one() {
    use dlock_axum::Caller;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(
        IdempotencyLayer::new().store(idem()).caller(Caller::cookie("session")),
        runs.clone(),
        Duration::ZERO,
    );
    let as_session = |cookie: &str| {
        Request::post("/pay")
            .header("idempotency-key", "1")
            .header("cookie", cookie)
            .body(Body::from("{}"))
            .expect("req")
    };
    let (_, _, one) = send(&app, as_session("theme=dark; session=user1")).await;
    let (_, h, two) = send(&app, as_session("session=user2")).await;
    assert_ne!(one, two, "user2 must not get user1's response");
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let (s, _, b) = send(&app, as_session("theme=dark")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));

    // The default scope is Authorization, and a request without it is refused.
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::ZERO);
    let anonymous = Request::post("/pay").header("idempotency-key", "1").body(Body::from("{}")).expect("req");
    let (s, _, b) = send(&app, anonymous).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_panicking_handler_frees_its_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/pay",
        post(move || {
            let n = r.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    panic!("handler bug");
                }
                (StatusCode::CREATED, "ok")
            }
        })
        .layer(IdempotencyLayer::new().store(idem())),
    );
    let panicked = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(Some("p"), "{}")).await }
    })
    .await;
    assert!(panicked.expect_err("the panic goes on").is_panic());
    // The key is freed in the background; give that task a moment.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, h, _) = send(&app, pay(Some("p"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(h.get("idempotent-replayed").is_none(), "ran again");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn stored_responses_expire() {
    let runs = Arc::new(AtomicUsize::new(0));
    // A record lives its TTL from its claim, and at least its claim's lease.
    let layer = IdempotencyLayer::new().store(idem()).ttl(Duration::from_millis(100)).lease(Duration::from_millis(50));
    let app = counting_app(layer, runs.clone(), Duration::ZERO);
    send(&app, pay(Some("e"), "{}")).await;
    assert_eq!(send(&app, pay(Some("e"), "{}")).await.1["idempotent-replayed"], "true");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(send(&app, pay(Some("e"), "{}")).await.1.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn oversized_bodies_are_refused_clearly() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new().store(idem()).max_body_bytes(8).max_response_bytes(10);
    let app = counting_app(layer, runs.clone(), Duration::ZERO);
    let (s, _, b) = send(&app, pay(Some("big"), "0123456789")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Issue 15 item 6 changes this part: the route's answer (longer than 10
    // bytes) reaches the client whole; it is not kept, but the key stays
    // completed, and the retry is told so instead of running the route again.
    let (s, _, b) = send(&app, pay(Some("r"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(String::from_utf8_lossy(&b).starts_with("{\"run\":1,"), "{}", String::from_utf8_lossy(&b));
    let (s, h, b) = send(&app, pay(Some("r"), "{}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_response_not_stored"));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry did not run the route again");
}

#[tokio::test]
async fn tokens_are_issued_and_spent_once() {
    let idem = idem();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app: Router = Router::new()
        .route("/idempotency/token", get(token_handler(None)))
        .route(
            "/orders",
            post(move || {
                h.fetch_add(1, Ordering::SeqCst);
                async { "placed" }
            })
            .layer(TokenLayer::new().query_param("token")),
        )
        .with_dlock(runtime_of(&idem));
    let (s, h, b) = send(&app, Request::get("/idempotency/token").body(Body::empty()).expect("req")).await;
    assert_eq!((s, h["content-type"].to_str().expect("ascii")), (StatusCode::OK, "application/json"));
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    let token = v["token"].as_str().expect("token").to_owned();
    assert_eq!(token.len(), 32);
    assert_eq!(v["expires_in_secs"], 86_400);

    let (s, _, b) = send(&app, Request::post("/orders").body(Body::empty()).expect("req")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_token_missing"));
    let by_query = || Request::post(format!("/orders?token={token}")).body(Body::empty()).expect("req");
    assert_eq!(send(&app, by_query()).await.0, StatusCode::OK);
    let (s, h, b) = send(&app, by_query()).await;
    // A spent token is permanent: its own code, and no Retry-After.
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_token_unknown"));
    assert!(h.get("retry-after").is_none());
    let (s, _, _) = send(&app, Request::post("/orders?token=made-up").body(Body::empty()).expect("req")).await;
    assert_eq!(s, StatusCode::CONFLICT);

    // Header form, and a storm of one token: exactly one gets through.
    let (_, _, b) = send(&app, Request::get("/idempotency/token").body(Body::empty()).expect("req")).await;
    let token = serde_json::from_slice::<serde_json::Value>(&b).expect("json")["token"].as_str().expect("t").to_owned();
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (app, token) = (app.clone(), token.clone());
            tokio::spawn(async move {
                send(
                    &app,
                    Request::post("/orders").header("idempotency-token", token).body(Body::empty()).expect("req"),
                )
                .await
                .0
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.expect("task") {
            StatusCode::OK => ok += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_of_one_key_runs_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(IdempotencyLayer::new().store(idem()), runs.clone(), Duration::from_millis(100));
    let tasks: Vec<_> = (0..30)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, pay(Some("storm"), "{}")).await })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        let (s, h, _) = t.await.expect("task");
        match s {
            StatusCode::CREATED => {
                assert!(h.get("idempotent-replayed").is_none());
                created += 1
            }
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((created, runs.load(Ordering::SeqCst)), (1, 1));
}

/// The TTL comes with the installed runtime (`DLOCK_IDEMPOTENCY_TTL_SECS`
/// through `Config` and `DlockRuntime`), and so does the store.
#[tokio::test]
async fn the_token_ttl_comes_with_the_installed_runtime() {
    let dlock = runtime_of(&idem()).with_idempotency_ttl(Duration::from_secs(60));
    let app = Router::new().route("/token", get(token_handler(None))).with_dlock(dlock);
    for (uri, ttl) in [("/token", 60)] {
        let (status, _, body) = send(&app, Request::get(uri).body(Body::empty()).expect("request")).await;
        assert_eq!(status, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["expires_in_secs"], ttl, "{uri}");
    }
}

/// The inner service's error passes through the idempotency services
/// unchanged (tower-http's convention), and an error frees the key as a `5xx`
/// does, so a retry runs the route again.
#[tokio::test]
async fn an_inner_error_passes_through_and_frees_the_key() {
    use dlock_axum::idempotency::{Idempotent, RequireToken};
    use tower::{Layer, Service};

    #[derive(Debug, PartialEq)]
    struct Broken(u32);

    let runs = Arc::new(AtomicUsize::new(0));
    let inner = tower::service_fn({
        let runs = runs.clone();
        move |_req: Request<Body>| {
            let n = runs.fetch_add(1, Ordering::SeqCst) as u32;
            async move { Err::<axum::response::Response, _>(Broken(n)) }
        }
    });
    let mut svc = Idempotent::layer().store(idem()).layer(inner.clone());
    for attempt in 0..2 {
        let res = svc.call(pay(Some("k-err"), "{}")).await;
        assert_eq!(res.err(), Some(Broken(attempt)), "attempt {attempt} reached the route");
        // The key is freed in the background.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let idem = idem();
    let mut svc = RequireToken::layer().store(idem.clone()).layer(inner);
    let token = idem.issue_token(None, Duration::from_secs(86_400)).await.expect("token");
    let req = Request::post("/submit").header("idempotency-token", token).body(Body::empty()).expect("request");
    assert_eq!(svc.call(req).await.err(), Some(Broken(2)));
}

/// Issue 15 item 5: a token is given back when the route did not run
/// (axum's 415) or failed (503, panic), and spent when it ran to a result;
/// concurrent submits of one token still run the route once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_is_given_back_when_the_route_did_not_run_or_failed() {
    let idem = idem();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app: Router = Router::new().route(
        "/submit",
        post(move |axum::Json(v): axum::Json<serde_json::Value>| {
            let n = r.fetch_add(1, Ordering::SeqCst);
            async move {
                match v["do"].as_str() {
                    Some("fail") if n == 0 => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    Some("panic") if n == 0 => panic!("handler bug"),
                    Some("slow") => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        (StatusCode::CREATED, "placed").into_response()
                    }
                    _ => (StatusCode::CREATED, "placed").into_response(),
                }
            }
        })
        .layer(TokenLayer::new().store(idem.clone())),
    );
    let submit = |token: &str, content_type: Option<&str>, what: &str| {
        let mut req = Request::post("/submit").header("idempotency-token", token);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        req.body(Body::from(format!("{{\"do\":\"{what}\"}}"))).expect("req")
    };
    let json = Some("application/json");
    let fresh = || async { idem.issue_token(None, Duration::from_secs(86_400)).await.expect("token") };

    // 415 from axum's Json extractor: the route never ran; the fixed retry works.
    let t = fresh().await;
    assert_eq!(send(&app, submit(&t, None, "ok")).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(send(&app, submit(&t, json, "ok")).await.0, StatusCode::CREATED);
    let (s, _, b) = send(&app, submit(&t, json, "ok")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_token_unknown"), "spent after the 201");

    // A 503 of the route gives the token back.
    runs.store(0, Ordering::SeqCst);
    let t = fresh().await;
    assert_eq!(send(&app, submit(&t, json, "fail")).await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(send(&app, submit(&t, json, "fail")).await.0, StatusCode::CREATED);

    // A panic gives it back too (in the background), and goes on.
    runs.store(0, Ordering::SeqCst);
    let t = fresh().await;
    let panicked = tokio::spawn({
        let (app, req) = (app.clone(), submit(&t, json, "panic"));
        async move { send(&app, req).await }
    })
    .await;
    assert!(panicked.expect_err("the panic goes on").is_panic());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(send(&app, submit(&t, json, "panic")).await.0, StatusCode::CREATED);

    // Concurrent submits: one runs; the others are told it is in progress.
    runs.store(0, Ordering::SeqCst);
    let t = fresh().await;
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let (app, req) = (app.clone(), submit(&t, json, "slow"));
            tokio::spawn(async move { send(&app, req).await })
        })
        .collect();
    let (mut created, mut in_progress) = (0, 0);
    for task in tasks {
        match task.await.expect("task") {
            (StatusCode::CREATED, _, _) => created += 1,
            (StatusCode::CONFLICT, h, b) => {
                assert_eq!(error_of(&b), "idempotency_request_in_progress");
                assert_eq!(h["retry-after"], "1");
                in_progress += 1;
            }
            (other, _, b) => panic!("unexpected {other}: {}", String::from_utf8_lossy(&b)),
        }
    }
    assert_eq!((created, in_progress, runs.load(Ordering::SeqCst)), (1, 9, 1));
}

/// Issue 15 item 3: one-time tokens bound to the caller the layer's scope
/// names: a token issued to alice is of no use to bob, nor to a request
/// without a caller.
#[tokio::test]
async fn bound_tokens_serve_only_their_caller() {
    use dlock_axum::{idempotency::token_handler, Caller};
    let idem = idem();
    let app: Router = Router::new()
        .route("/token", get(token_handler(Some(Caller::header("x-user")))))
        .route("/submit", post(|| async { "ok" }).layer(TokenLayer::new().caller(Caller::header("x-user"))))
        .with_dlock(runtime_of(&idem));
    let as_user = |user: Option<&str>, req: axum::http::request::Builder| match user {
        Some(u) => req.header("x-user", u),
        None => req,
    };
    let (s, _, b) = send(&app, as_user(Some("alice"), Request::get("/token")).body(Body::empty()).expect("req")).await;
    assert_eq!(s, StatusCode::OK);
    let token = serde_json::from_slice::<serde_json::Value>(&b).expect("json")["token"].as_str().expect("t").to_owned();
    let (s, _, b) = send(&app, Request::get("/token").body(Body::empty()).expect("req")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    let submit = |user: Option<&str>| {
        as_user(user, Request::post("/submit").header("idempotency-token", &token)).body(Body::empty()).expect("req")
    };
    let (s, _, b) = send(&app, submit(Some("bob"))).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_token_unknown"));
    let (s, _, b) = send(&app, submit(None)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    assert_eq!(send(&app, submit(Some("alice"))).await.0, StatusCode::OK);
    assert_eq!(send(&app, submit(Some("alice"))).await.0, StatusCode::CONFLICT, "spent");
    // An unbound layer does not take a bound token either.
    let unbound: Router =
        Router::new().route("/submit", post(|| async { "ok" }).layer(TokenLayer::new().store(idem.clone())));
    let t = idem.issue_token(Some("h:x-user:whatever"), Duration::from_secs(86_400)).await.expect("token");
    let req = Request::post("/submit").header("idempotency-token", &t).body(Body::empty()).expect("req");
    assert_eq!(send(&unbound, req).await.0, StatusCode::CONFLICT);
}

/// Issue 16 over HTTP: a caller at its cap gets `429 idempotency_scope_full`
/// and a full store `503 idempotency_store_full`, both JSON with
/// `Retry-After`; the route does not run, a retry of a stored key is still
/// replayed, and tokens are refused the same way.
async fn full_store_answers(store: Arc<dyn dlock_core::idempotency::IdempotencyStore>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let idem: Arc<dyn IdempotencyStore> = store;
    let app = counting_app(IdempotencyLayer::new().store(idem.clone()), runs.clone(), Duration::ZERO)
        .route("/token", get(token_handler(None)))
        .with_dlock(runtime_of(&idem));
    assert_eq!(send(&app, pay(Some("k1"), "{}")).await.0, StatusCode::CREATED);
    let (s, h, b) = send(&app, pay(Some("k2"), "{}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::TOO_MANY_REQUESTS, "idempotency_scope_full"));
    assert_eq!(h["content-type"], "application/json");
    // The stored record lives 24 hours: that is when alice has room again
    // (on Redis, up to a 64th of that later: its pool counts by buckets).
    let retry: u64 = h["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((86_000..=86_400 + 1_350).contains(&retry), "retry after {retry}");
    // A retry of the stored key is replayed at the cap.
    let (s, h, _) = send(&app, pay(Some("k1"), "{}")).await;
    assert_eq!((s, h.get("idempotent-replayed").map(|v| v.as_bytes())), (StatusCode::CREATED, Some(&b"true"[..])));
    // Another caller fills the total (2); a third finds the store full.
    let of = |caller: &str| {
        Request::post("/pay").header("authorization", caller).header("idempotency-key", "k").body(Body::from("{}"))
    };
    assert_eq!(send(&app, of("Bearer bob").expect("request")).await.0, StatusCode::CREATED);
    let (s, h, b) = send(&app, of("Bearer carol").expect("request")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::SERVICE_UNAVAILABLE, "idempotency_store_full"));
    assert!(h.contains_key("retry-after"));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "refused requests never ran");
    // Unbound tokens: a pool of 2 of their own, then 503.
    for _ in 0..2 {
        assert_eq!(send(&app, Request::get("/token").body(Body::empty()).expect("request")).await.0, StatusCode::OK);
    }
    let (s, h, b) = send(&app, Request::get("/token").body(Body::empty()).expect("request")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::SERVICE_UNAVAILABLE, "idempotency_store_full"));
    assert!(h.contains_key("retry-after"));
}

fn tiny() -> dlock_core::idempotency::IdempotencyLimits {
    dlock_core::idempotency::IdempotencyLimits::default()
        .with_max_per_scope(1)
        .with_max_records(2)
        .with_max_unbound_tokens(2)
}

#[tokio::test]
async fn a_full_memory_store_is_429_or_503() {
    full_store_answers(Arc::new(MemoryStore::new().with_limits(tiny()))).await;
}

#[tokio::test]
async fn a_full_redis_store_is_429_or_503() {
    let redis = dlock_testing::RedisServer::start();
    let store = dlock_core::idempotency::RedisStore::connect(&redis.url(), "full").await.expect("connect");
    full_store_answers(Arc::new(store.with_limits(tiny()))).await;
}

/// A key the layer frees (the route answered `5xx`) gives its room back at
/// once: the caller's next key runs instead of waiting out the lease.
#[tokio::test]
async fn a_freed_key_gives_its_room_back() {
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new().with_limits(tiny()));
    let app = Router::new().route(
        "/pay",
        post(|body: String| async move {
            if body == "fail" {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::CREATED
            }
        })
        .layer(IdempotencyLayer::new().store(idem.clone())),
    );
    assert_eq!(send(&app, pay(Some("k1"), "fail")).await.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(send(&app, pay(Some("k2"), "{}")).await.0, StatusCode::CREATED, "k1's room was given back");
    let (s, _, b) = send(&app, pay(Some("k3"), "{}")).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::TOO_MANY_REQUESTS, "idempotency_scope_full"));
}

/// Issue 24: a token sent more than once — two headers, two `?token=`, or
/// a header and a parameter, equal or not — is refused with a `400` in the
/// error shape, before anything is claimed: taking the first would let a
/// proxy and the route read different tokens. The token stays fresh.
#[tokio::test]
async fn a_token_sent_twice_is_refused() {
    let idem = idem();
    let app: Router = Router::new().route(
        "/orders",
        post(|| async { "placed" }).layer(TokenLayer::new().store(idem.clone()).query_param("token")),
    );
    let token = idem.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    let other = idem.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    let twice = [
        Request::post("/orders").header("idempotency-token", &token).header("idempotency-token", &other),
        Request::post(format!("/orders?token={token}&token={other}")),
        Request::post(format!("/orders?token={token}&token={token}")),
        Request::post(format!("/orders?token={other}")).header("idempotency-token", &token),
        Request::post(format!("/orders?token={token}")).header("idempotency-token", &token),
    ];
    for req in twice {
        let (s, _, b) = send(&app, req.body(Body::empty()).expect("req")).await;
        assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_token_duplicated"));
    }
    let once = Request::post("/orders").header("idempotency-token", &token).body(Body::empty()).expect("req");
    assert_eq!(send(&app, once).await.0, StatusCode::OK, "the refused requests claimed nothing");
}

/// Issue 24: an answer over the store's byte budget is delivered to its
/// client and not kept: the retry is told so, and the route does not run
/// again.
#[tokio::test]
async fn an_answer_over_the_byte_budget_is_delivered_and_not_stored() {
    use dlock_core::idempotency::IdempotencyLimits;
    let limits = IdempotencyLimits::default().with_max_bytes_per_scope(4 * 1024);
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new().with_limits(limits));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app: Router = Router::new().route(
        "/export",
        post(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { (StatusCode::CREATED, "x".repeat(8 * 1024)) }
        })
        .layer(IdempotencyLayer::new().store(idem.clone()).caller(dlock_axum::Caller::shared())),
    );
    let export = || Request::post("/export").header("idempotency-key", "big").body(Body::from("{}")).expect("req");
    let (s, _, b) = send(&app, export()).await;
    assert_eq!((s, b.len()), (StatusCode::CREATED, 8 * 1024), "delivered whole");
    let (s, _, b) = send(&app, export()).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_response_not_stored"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Issue 25: a token endpoint, or a route that takes bound tokens, that
/// cannot name the caller says its token, not an `Idempotency-Key`.
#[tokio::test]
async fn a_token_route_without_a_caller_speaks_of_its_token() {
    use dlock_axum::{idempotency::token_handler, Caller};
    let idem = idem();
    let app: Router = Router::new()
        .route("/token", get(token_handler(Some(Caller::header("x-user")))))
        .route("/submit", post(|| async { "ok" }).route_layer(TokenLayer::new().caller(Caller::header("x-user"))))
        .with_dlock(runtime_of(&idem));
    let anonymous = [
        Request::get("/token").body(Body::empty()).expect("req"),
        Request::post("/submit").header("idempotency-token", "t").body(Body::empty()).expect("req"),
    ];
    for req in anonymous {
        let uri = req.uri().clone();
        let (s, _, b) = send(&app, req).await;
        assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"), "{uri}");
        let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
        let message = v["message"].as_str().unwrap_or_default();
        assert!(message.contains("token") && !message.contains("Idempotency-Key"), "{uri}: {message}");
    }
}

/// One `Caller` names whom an `Idempotency-Key` belongs to, whom a token is
/// bound to and whose locks a `LockLayer` counts; a request without a
/// caller is refused by each, with its own code, and never pooled with
/// other such requests.
#[tokio::test]
async fn one_caller_for_keys_tokens_and_the_lock_cap() {
    use dlock_axum::{idempotency::token_handler, Caller, LockLayer};

    /// Set by the service's authentication.
    #[derive(Clone)]
    struct User(String);

    let caller = Caller::from_fn(|parts| parts.extensions.get::<User>().map(|u| u.0.clone()));
    let idem = idem();
    let runs = Arc::new(AtomicUsize::new(0));
    let route = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move { (StatusCode::CREATED, (runs.fetch_add(1, Ordering::SeqCst) + 1).to_string()) }
        }
    };
    let app: Router = Router::new()
        .route("/token", get(token_handler(Some(caller.clone()))))
        .route("/submit", post(route.clone()).route_layer(TokenLayer::new().caller(caller.clone())))
        .route("/pay", post(route.clone()).route_layer(IdempotencyLayer::new().caller(caller.clone())))
        .route("/report", post(route).route_layer(LockLayer::new("report").max_holds_per(1, caller)))
        .layer(axum::middleware::map_request(|mut req: Request<Body>| async move {
            // The service's authentication: a session names its user.
            let session = req.headers().get("x-session").and_then(|v| v.to_str().ok()).map(str::to_owned);
            if let Some(s) = session {
                req.extensions_mut().insert(User(format!("user-of-{s}")));
            }
            req
        }))
        .with_dlock(runtime_of(&idem));
    let req = |method: &str, uri: &str, session: Option<&str>, extra: Option<(&str, &str)>| {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(s) = session {
            b = b.header("x-session", s);
        }
        if let Some((name, value)) = extra {
            b = b.header(name, value);
        }
        b.body(Body::empty()).expect("request")
    };

    // Keys: each caller's own; a request without a caller is refused.
    let key = Some(("idempotency-key", "k1"));
    let (s, _, alice) = send(&app, req("POST", "/pay", Some("alice"), key)).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, h, bob) = send(&app, req("POST", "/pay", Some("bob"), key)).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(h.get("idempotent-replayed").is_none() && bob != alice, "bob is not answered with alice's");
    let (_, h, again) = send(&app, req("POST", "/pay", Some("alice"), key)).await;
    assert_eq!((h.get("idempotent-replayed").map(|v| v.as_bytes()), again), (Some(&b"true"[..]), alice));
    let (s, _, b) = send(&app, req("POST", "/pay", None, key)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Tokens: bound to the caller that fetched them.
    let (s, _, b) = send(&app, req("GET", "/token", Some("alice"), None)).await;
    assert_eq!(s, StatusCode::OK);
    let token = serde_json::from_slice::<serde_json::Value>(&b).expect("json")["token"].as_str().expect("t").to_owned();
    let (s, _, b) = send(&app, req("GET", "/token", None, None)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    let with_token = Some(("idempotency-token", token.as_str()));
    let (s, _, b) = send(&app, req("POST", "/submit", Some("bob"), with_token)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::CONFLICT, "idempotency_token_unknown"));
    let (s, _, b) = send(&app, req("POST", "/submit", None, with_token)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "idempotency_scope_missing"));
    assert_eq!(send(&app, req("POST", "/submit", Some("alice"), with_token)).await.0, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // The lock cap: counted per caller; a request without one is refused.
    let (s, _, b) = send(&app, req("POST", "/report", None, None)).await;
    assert_eq!((s, error_of(&b).as_str()), (StatusCode::BAD_REQUEST, "lock_caller_missing"));
    assert_eq!(send(&app, req("POST", "/report", Some("alice"), None)).await.0, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}
