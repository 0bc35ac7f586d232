//! Issue 37: `IdempotencyLayer` fingerprints a JSON body by its canonical
//! form (`dlock_core::idempotency::canonical_body`), so a client that
//! re-serialises its object for the retry (other key order, other
//! whitespace) gets the stored answer instead of `422
//! idempotency_key_mismatch`; a different value is still a mismatch, and a
//! body that is not declared JSON, or is not JSON, is fingerprinted as sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::IdempotencyLayer;
use dlock_core::idempotency::MemoryStore;
use tower::ServiceExt;

/// A `POST /transfers` route behind the layer that counts its runs.
fn app(runs: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::new().store(Arc::new(MemoryStore::new()));
    Router::new().route(
        "/transfers",
        post(move || {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!("{{\"run\":{run}}}"))
            }
        })
        .layer(layer),
    )
}

/// What the route answered: status, whether it was a replay, the `error`
/// of a refusal or the body.
async fn send(app: &Router, key: &str, content_type: &str, body: &str) -> (StatusCode, bool, String) {
    let req = Request::post("/transfers")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .body(Body::from(body.to_owned()))
        .expect("request");
    let res = app.clone().oneshot(req).await.expect("infallible");
    let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let status = res.status();
    let bytes = to_bytes(res.into_body(), usize::MAX).await.expect("body");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let error = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or(text);
    (status, replayed, error)
}

const JSON: &str = "application/json";

#[tokio::test]
async fn a_reordered_json_body_is_the_same_request() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(runs.clone());
    let first = send(&app, "k1", JSON, r#"{"from":1,"to":2,"amount":1}"#).await;
    assert_eq!(first, (StatusCode::CREATED, false, r#"{"run":1}"#.to_owned()));
    // The report's case: the same object, its keys in another order.
    let again = send(&app, "k1", JSON, r#"{"to":2,"from":1,"amount":1}"#).await;
    assert_eq!(again, (StatusCode::CREATED, true, r#"{"run":1}"#.to_owned()));
    // Whitespace and a charset parameter change nothing either.
    let spaced =
        send(&app, "k1", "application/json; charset=utf-8", "{\n  \"amount\": 1,\n  \"to\": 2, \"from\": 1\n}\n");
    assert_eq!(spaced.await, (StatusCode::CREATED, true, r#"{"run":1}"#.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn another_value_is_still_a_mismatch() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(runs.clone());
    assert_eq!(send(&app, "k2", JSON, r#"{"from":1,"to":2,"amount":1}"#).await.0, StatusCode::CREATED);
    for other in [
        r#"{"to":2,"from":1,"amount":2}"#,
        r#"{"to":1,"from":2,"amount":1}"#,
        // Numbers count as written: 1.0 is not taken for 1.
        r#"{"to":2,"from":1,"amount":1.0}"#,
        r#"{"to":2,"from":1,"amount":1,"memo":null}"#,
        r#"{"to":2,"from":1}"#,
    ] {
        let (status, replayed, error) = send(&app, "k2", JSON, other).await;
        assert_eq!(
            (status, replayed, error.as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, false, "idempotency_key_mismatch"),
            "{other}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `application/<anything>+json` is JSON too.
#[tokio::test]
async fn a_json_suffix_type_is_canonicalised() {
    let app = app(Arc::default());
    let patch = "application/merge-patch+json";
    assert_eq!(send(&app, "k3", patch, r#"{"b":[1,{"d":0,"c":0}],"a":"\u00e9"}"#).await.0, StatusCode::CREATED);
    let again = send(&app, "k3", patch, r#"{ "a": "é", "b": [1, {"c": 0, "d": 0}] }"#).await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, true));
    // An array keeps its order.
    let reordered = send(&app, "k3", patch, r#"{"a":"é","b":[{"c":0,"d":0},1]}"#).await;
    assert_eq!((reordered.0, reordered.2.as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"));
}

/// A body not declared as JSON, or not JSON, is compared byte for byte.
#[tokio::test]
async fn other_bodies_are_their_bytes() {
    let app = app(Arc::default());
    let text = "text/plain";
    assert_eq!(send(&app, "k4", text, r#"{"from":1,"to":2}"#).await.0, StatusCode::CREATED);
    assert!(send(&app, "k4", text, r#"{"from":1,"to":2}"#).await.1, "the same bytes replay");
    let reordered = send(&app, "k4", text, r#"{"to":2,"from":1}"#).await;
    assert_eq!((reordered.0, reordered.2.as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"));

    // Declared JSON, but not JSON (a key twice has no one meaning either).
    for (key, body, respaced) in
        [("k5", r#"{"from":1,"to":2,"#, r#"{"from":1, "to":2,"#), ("k6", r#"{"a":1,"a":2}"#, r#"{"a":1, "a":2}"#)]
    {
        assert_eq!(send(&app, key, JSON, body).await.0, StatusCode::CREATED, "{body}");
        assert!(send(&app, key, JSON, body).await.1, "{body}: the same bytes replay");
        let (status, _, error) = send(&app, key, JSON, respaced).await;
        assert_eq!(
            (status, error.as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"),
            "{respaced}"
        );
    }
}
