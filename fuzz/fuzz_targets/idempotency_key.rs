//! `Idempotency-Key` handling against its documented rules (reliability.md
//! T10): for any header bytes a client can send and any body,
//!
//! * a key (inside one pair of surrounding quotes, which the draft's
//!   structured-field form adds) that is empty, longer than 255 bytes or has
//!   a byte outside visible ASCII is `400 idempotency_key_invalid` and the
//!   route does not run;
//! * a valid key runs the route once: the same request again gets the stored
//!   response byte for byte with `Idempotent-Replayed: true`, and the same key
//!   with another body gets `422 idempotency_key_mismatch`;
//! * never a 5xx, never a panic.
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::IdempotencyLayer;
use dlock_axum::Caller;
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

static RUNS: AtomicU64 = AtomicU64::new(0);
static CASE: AtomicU64 = AtomicU64::new(0);

struct Fixture {
    rt: tokio::runtime::Runtime,
    app: Router,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime");
        // A short TTL keeps a long fuzzing run's store small.
        let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
        // Every fuzz case is its own caller, so cases never see each other's keys.
        let layer =
            IdempotencyLayer::new().store(idem).ttl(Duration::from_secs(5)).caller(Caller::header("x-case"));
        let route = post(|body: Bytes| async move {
            let run = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("run {run}, {} bytes", body.len()))
        });
        Fixture { rt, app: Router::new().route("/pay", route.layer(layer)) }
    })
}

fn valid(key: &[u8]) -> bool {
    let key = match key {
        [b'"', inner @ .., b'"'] => inner,
        bare => bare,
    };
    (1..=255).contains(&key.len()) && key.iter().all(|b| (b'!'..=b'~').contains(b))
}

fuzz_target!(|input: (Vec<u8>, Vec<u8>, Vec<u8>)| {
    let (key, body, other_body) = input;
    let Ok(header) = HeaderValue::from_bytes(&key) else { return }; // a client cannot send it
    let f = fixture();
    let case = CASE.fetch_add(1, Ordering::Relaxed).to_string();
    let send = |body: Vec<u8>| {
        let req = Request::post("/pay")
            .header("idempotency-key", header.clone())
            .header("x-case", case.as_str())
            .body(Body::from(body))
            .expect("a valid request");
        f.rt.block_on(async {
            let res = f.app.clone().oneshot(req).await.expect("infallible");
            let replayed = res.headers().get("idempotent-replayed").cloned();
            let status = res.status();
            let out = res.into_body().collect().await.expect("an in-memory body").to_bytes();
            (status, replayed, out)
        })
    };
    let error = |out: &Bytes| -> String {
        let v: serde_json::Value =
            serde_json::from_slice(out).unwrap_or_else(|e| panic!("no JSON error body: {e}: {out:?}"));
        v["error"].as_str().unwrap_or_else(|| panic!("{v}")).to_owned()
    };
    let before = RUNS.load(Ordering::SeqCst);
    let (status, replayed, first) = send(body.clone());
    if !valid(&key) {
        assert_eq!((status, error(&first).as_str()), (StatusCode::BAD_REQUEST, "idempotency_key_invalid"), "{key:?}");
        assert_eq!(RUNS.load(Ordering::SeqCst), before, "the route ran for an invalid key");
        return;
    }
    assert_eq!(status, StatusCode::CREATED, "{key:?}: {first:?}");
    assert!(replayed.is_none());
    assert_eq!(RUNS.load(Ordering::SeqCst), before + 1);
    let (status, replayed, again) = send(body.clone());
    assert_eq!((status, again.as_ref()), (StatusCode::CREATED, first.as_ref()), "the replay differs");
    assert_eq!(replayed.as_ref().and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(RUNS.load(Ordering::SeqCst), before + 1, "a replay ran the route again");
    if other_body != body {
        let (status, _, out) = send(other_body);
        assert_eq!((status, error(&out).as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_mismatch"));
        assert_eq!(RUNS.load(Ordering::SeqCst), before + 1);
    }
});
