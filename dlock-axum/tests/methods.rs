//! Methods a route does not serve (issue 25, point 3).
//!
//! axum's `MethodRouter::layer` wraps every method's handler *and* the
//! fallback that answers `405`; `route_layer` wraps only the handlers. A
//! `LockLayer` cannot tell the fallback from a handler (both reach it as an
//! opaque `Route`), so the docs teach `route_layer`, and these tests pin
//! what each does. Token endpoints issue no token on `HEAD`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use dlock_axum::{idempotency::token_handler, Caller};
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::idempotency::{IdempotencyLimits, MemoryStore};
use dlock_core::{Locker, MemoryBackend};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// The layer's key: the lock `m`, on the tenant header.
fn layer() -> LockLayer {
    LockLayer::new("m").header("x-tenant")
}

async fn send(app: &Router, method: Method, tenant: bool) -> (StatusCode, String) {
    let mut req = Request::builder().method(method).uri("/r");
    if tenant {
        req = req.header("x-tenant", "t");
    }
    let res = app.clone().oneshot(req.body(Body::empty()).expect("request")).await.expect("infallible");
    let status = res.status();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Holds the lock the layer takes for tenant `t`, as another request would.
async fn hold(locker: &Locker) -> dlock_core::LockGuard {
    let key = locker.key("m").part("t").build().expect("key");
    locker.try_acquire(&key).await.expect("free")
}

#[tokio::test]
async fn route_layer_leaves_the_405_of_other_methods_unlocked() {
    let locker = Locker::new(MemoryBackend::new());
    let app = Router::new().route("/r", post(|| async { "posted" }).route_layer(layer())).with_dlock(locker.clone());
    let _held = hold(&locker).await;
    // The layer is there: a POST finds the lock held.
    assert_eq!(send(&app, Method::POST, true).await.0, StatusCode::CONFLICT);
    for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::PUT, Method::DELETE] {
        // Neither a lock (the held one would be a 409) nor a key (without the
        // header it would be a 400): axum's 405.
        assert_eq!(send(&app, method.clone(), true).await.0, StatusCode::METHOD_NOT_ALLOWED, "{method}");
        assert_eq!(send(&app, method.clone(), false).await.0, StatusCode::METHOD_NOT_ALLOWED, "{method}");
    }
}

/// Pins axum's semantics: `.layer` also wraps the 405 fallback, so the
/// layer builds a key and takes the lock for every method. This is why the
/// docs teach `route_layer`.
#[tokio::test]
async fn layer_also_wraps_axums_405_and_locks_it() {
    let locker = Locker::new(MemoryBackend::new());
    let app = Router::new().route("/r", post(|| async { "posted" }).layer(layer())).with_dlock(locker.clone());
    let (status, body) = send(&app, Method::GET, false).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "the key was read: {body}");
    assert!(body.contains("lock_key_field_missing"), "{body}");
    assert_eq!(send(&app, Method::GET, true).await.0, StatusCode::METHOD_NOT_ALLOWED, "locked, then axum's 405");
    let _held = hold(&locker).await;
    assert_eq!(send(&app, Method::GET, true).await.0, StatusCode::CONFLICT, "the GET asked for the lock");
}

/// A store that holds one token per caller and one unbound token: a `HEAD`
/// that issued one would leave the `GET` after it refused as full.
fn idem() -> dlock_axum::DlockRuntime {
    let limits = IdempotencyLimits::default().with_max_per_scope(1).with_max_unbound_tokens(1);
    let locker = dlock_core::Locker::new(dlock_core::MemoryBackend::new());
    dlock_axum::DlockRuntime::new(locker).with_idempotency_store(Arc::new(MemoryStore::new().with_limits(limits)))
}

#[tokio::test]
async fn head_on_a_token_endpoint_issues_no_token() {
    let app: Router = Router::new()
        .route("/token", get(token_handler(None)))
        .route("/bound", get(token_handler(Some(Caller::header("x-user")))))
        .with_dlock(idem());
    for uri in ["/token", "/bound"] {
        let request = |method: Method| {
            Request::builder().method(method).uri(uri).header("x-user", "alice").body(Body::empty()).expect("request")
        };
        for _ in 0..3 {
            let res = app.clone().oneshot(request(Method::HEAD)).await.expect("infallible");
            assert_eq!(res.status(), StatusCode::OK, "{uri}: HEAD answers as GET would, without a token");
            assert_eq!(res.headers()["cache-control"], "no-store", "{uri}");
            let body = res.into_body().collect().await.expect("body").to_bytes();
            assert!(body.is_empty(), "{uri}");
        }
        let res = app.clone().oneshot(request(Method::GET)).await.expect("infallible");
        let status = res.status();
        let body = res.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(status, StatusCode::OK, "{uri}: the store is not full: {}", String::from_utf8_lossy(&body));
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["token"].as_str().map(str::len), Some(32), "{uri}");
    }
    // HEAD of a caller the bound endpoint cannot name is refused as GET is.
    let res = app.clone().oneshot(Request::head("/bound").body(Body::empty()).expect("request")).await.expect("ok");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}
