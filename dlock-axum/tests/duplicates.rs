//! A key field sent twice is refused: the lock must protect the value the
//! handler acts on, and with two values the two can disagree (the key took
//! the first `?q=a&q=b`, axum's `Query<HashMap>` takes the last).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use dlock_axum::{idempotency::IdempotencyLayer, Caller};
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use dlock_core::{Locker, MemoryBackend};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

fn counting(
    calls: &Arc<AtomicUsize>,
) -> impl Fn() -> std::future::Ready<&'static str> + Clone + Send + 'static + use<> {
    let calls = calls.clone();
    move || {
        calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready("ran")
    }
}

async fn answer(res: Response) -> (StatusCode, String, String) {
    let status = res.status();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v["error"].as_str().unwrap_or_default().to_owned(), v["message"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_key_parameter_or_header_sent_twice_is_400() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::new("t").query("q").header("x-tenant");
    let app: Router =
        Router::new().route("/r", post(counting(&calls)).layer(layer)).with_dlock(Locker::new(MemoryBackend::new()));
    let req = |uri: &str, tenants: &[&str]| {
        let mut b = Request::post(uri);
        for t in tenants {
            b = b.header("x-tenant", *t);
        }
        b.body(Body::empty()).expect("request")
    };

    for (uri, tenants, what) in [
        ("/r?q=a&q=b", &["t1"][..], "query parameter `q`"),
        // The same name once percent-decoded.
        ("/r?q=a&%71=b", &["t1"][..], "query parameter `q`"),
        ("/r?q=a&q=a", &["t1"][..], "query parameter `q`"),
        ("/r?q=a", &["t1", "t2"][..], "header `x-tenant`"),
    ] {
        let (status, error, message) = answer(app.clone().oneshot(req(uri, tenants)).await.expect("infallible")).await;
        assert_eq!((status.as_u16(), error.as_str()), (400, "lock_key_field_duplicated"), "{uri} {tenants:?}");
        assert!(message.contains(what), "{uri}: {message}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");

    // Other parameters and headers may repeat; the key's own once each is fine.
    let (status, ..) = answer(app.oneshot(req("/r?q=a&other=1&other=2", &["t1"])).await.expect("infallible")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_idempotency_key_sent_twice_is_400() {
    let calls = Arc::new(AtomicUsize::new(0));
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let app: Router = Router::new().route(
        "/pay",
        post(counting(&calls)).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
    );
    let pay = |keys: &[&str]| {
        let mut b = Request::post("/pay");
        for k in keys {
            b = b.header("idempotency-key", *k);
        }
        b.body(Body::from("{}")).expect("request")
    };
    for keys in [&["k1", "k2"][..], &["k1", "k1"][..]] {
        let (status, error, message) = answer(app.clone().oneshot(pay(keys)).await.expect("infallible")).await;
        assert_eq!((status.as_u16(), error.as_str()), (400, "idempotency_key_invalid"), "{keys:?}");
        assert!(message.contains("more than once"), "{message}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the route never ran");
    let (status, ..) = answer(app.oneshot(pay(&["k1"])).await.expect("infallible")).await;
    assert_eq!(status, StatusCode::OK);
}
