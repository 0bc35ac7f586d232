//! A handler reaches the lock it holds — its fencing token, validity and
//! lost signal — through `#[lockable]` and behind `LockLayer` alike, and a
//! store that refuses stale fencing tokens keeps a holder whose lease ran
//! out from writing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use dlock_axum::{lockable, DlockExt, FencingToken, HeldLock, LockLayer};
use dlock_core::{Locker, MemoryBackend};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;

/// Storage that keeps, per key, the highest fencing token it has seen, and
/// refuses a write carrying a lower one: the holder of an expired lock.
#[derive(Clone, Default)]
struct FencedStore {
    highest: Arc<Mutex<HashMap<String, u64>>>,
    writes: Arc<Mutex<Vec<(String, u64)>>>,
}

impl FencedStore {
    fn write(&self, key: &str, FencingToken(token): FencingToken) -> bool {
        let mut highest = self.highest.lock().unwrap_or_else(|p| p.into_inner());
        let seen = highest.entry(key.to_owned()).or_insert(0);
        if token < *seen {
            return false;
        }
        *seen = token;
        self.writes.lock().unwrap_or_else(|p| p.into_inner()).push((key.to_owned(), token));
        true
    }
}

#[derive(Debug, Deserialize)]
struct Pause {
    sleep_ms: u64,
}

/// Sleeps, then writes through the store with the lock's token, and says
/// what the lock looked like by then.
async fn work(store: &FencedStore, id: &str, sleep_ms: u64, lock: &HeldLock) -> (StatusCode, Json<Value>) {
    let valid_for_ms = lock.valid_until().saturating_duration_since(Instant::now()).as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
    let written = store.write(id, lock.fencing_token());
    let status = if written { StatusCode::OK } else { StatusCode::CONFLICT };
    let body = json!({"fence": lock.fencing_token().0, "written": written, "lost": lock.is_lost(), "valid_for_ms": valid_for_ms});
    (status, Json(body))
}

#[lockable(key = "account", fields = ["id"], lease_ms = 100)]
async fn by_macro(
    State(store): State<FencedStore>,
    Path(id): Path<String>,
    Query(Pause { sleep_ms }): Query<Pause>,
    fence: FencingToken,
    maybe: Option<FencingToken>,
    lock: HeldLock,
) -> (StatusCode, Json<Value>) {
    assert_eq!((Some(fence), fence), (maybe, lock.fencing_token()), "one lock, one token");
    work(&store, &id, sleep_ms, &lock).await
}

/// Behind the layer, the same arguments are ordinary extractors.
async fn by_layer(
    State(store): State<FencedStore>,
    Path(id): Path<String>,
    Query(Pause { sleep_ms }): Query<Pause>,
    fence: FencingToken,
    maybe: Option<FencingToken>,
    lock: HeldLock,
) -> (StatusCode, Json<Value>) {
    assert_eq!((Some(fence), fence), (maybe, lock.fencing_token()), "one lock, one token");
    work(&store, &id, sleep_ms, &lock).await
}

fn app(store: FencedStore) -> Router {
    Router::new()
        .route("/macro/{id}", post(by_macro))
        .route(
            "/layer/{id}",
            post(by_layer).layer(LockLayer::new("account").path("id").lease(Duration::from_millis(100))),
        )
        .with_dlock(Locker::new(MemoryBackend::new()))
        .with_state(store)
}

async fn call(app: &Router, uri: String) -> (StatusCode, Value) {
    let res = app.clone().oneshot(Request::post(uri).body(Body::empty()).expect("request")).await.expect("infallible");
    let status = res.status();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A slow holder outlives its 100 ms lease; a second request takes the lock
/// and writes; the slow one's write carries the older token and is refused,
/// and its lock reports itself lost.
async fn stale_holder_is_refused(face: &str) {
    let store = FencedStore::default();
    let app = app(store.clone());
    let slow = tokio::spawn({
        let app = app.clone();
        let uri = format!("/{face}/a?sleep_ms=400");
        async move { call(&app, uri).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, fast) = call(&app, format!("/{face}/a?sleep_ms=0")).await;
    assert_eq!(status, StatusCode::OK, "{face}: the lease ran out, so the lock is free: {fast}");
    assert_eq!(fast["written"], true);
    let (status, slow) = slow.await.expect("task");
    assert_eq!(status, StatusCode::CONFLICT, "{face}: the stale holder's write is refused: {slow}");
    assert_eq!(slow["written"], false);
    assert_eq!(slow["lost"], true, "{face}: the handler sees that its lock was lost");
    assert!(slow["fence"].as_u64() < fast["fence"].as_u64(), "{face}: {slow} then {fast}");
    let valid_for = slow["valid_for_ms"].as_u64().expect("number");
    assert!(valid_for > 0 && valid_for <= 100, "{face}: valid for the lease, not more: {valid_for}");
    let writes = store.writes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(writes.len(), 1, "{face}: only the holder of the newest token wrote: {writes:?}");
}

#[tokio::test]
async fn a_lockable_handler_writes_with_its_own_fencing_token() {
    stale_holder_is_refused("macro").await;
}

#[tokio::test]
async fn a_layer_route_writes_with_its_own_fencing_token() {
    stale_holder_is_refused("layer").await;
}

/// Tokens grow from one request to the next, through both faces, on one key.
#[tokio::test]
async fn each_request_gets_a_newer_token() {
    let app = app(FencedStore::default());
    let mut last = 0;
    for face in ["macro", "layer", "macro", "layer"] {
        let (status, body) = call(&app, format!("/{face}/b?sleep_ms=0")).await;
        assert_eq!(status, StatusCode::OK, "{face}: {body}");
        let fence = body["fence"].as_u64().expect("fence");
        assert!(fence > last, "{face}: {fence} after {last}");
        last = fence;
    }
}

/// Where no lock is held, `FencingToken` and `HeldLock` are a `500` that says
/// so, and their `Option`s are `None`.
#[tokio::test]
async fn without_a_lock_the_extractors_say_so() {
    use axum::routing::get;
    let app: Router = Router::new()
        .route("/fence", get(|FencingToken(t): FencingToken| async move { t.to_string() }))
        .route("/held", get(|lock: HeldLock| async move { lock.fencing_token().0.to_string() }))
        .route(
            "/maybe",
            get(|fence: Option<FencingToken>, lock: Option<HeldLock>| async move {
                format!("{:?} {}", fence, lock.is_some())
            }),
        );
    let get = |uri: &str| Request::get(uri).body(Body::empty()).expect("request");
    for (uri, message) in
        [("/fence", "this route holds no lock, so it has no fencing token"), ("/held", "this route holds no lock")]
    {
        let res = app.clone().oneshot(get(uri)).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR, "{uri}");
        let bytes = res.into_body().collect().await.expect("body").to_bytes();
        let v: Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!((v["error"].as_str(), v["message"].as_str()), (Some("lock_misconfigured"), Some(message)), "{uri}");
    }
    let res = app.oneshot(get("/maybe")).await.expect("infallible");
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&bytes[..], b"None false");
}
