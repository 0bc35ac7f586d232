//! One `dlock.request` event per locked request, at the same level through
//! both faces, and no request values (the key) at `INFO` or above.

use std::io::Write;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::Request;
use axum::routing::post;
use axum::Router;
use dlock_axum::{lockable, JsonBody, LockLayer, LockerExt};
use dlock_core::{Locker, MemoryBackend};
use serde::Deserialize;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// The `dlock.request` lines written since the last call.
    fn take_events(&self) -> Vec<String> {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        String::from_utf8_lossy(&bytes).lines().filter(|l| l.contains("dlock.request")).map(str::to_owned).collect()
    }
}

#[derive(Deserialize)]
struct Req {
    id: String,
}

#[lockable(key = "t", fields = ["req.id"], wait_ms = 0)]
async fn by_macro(JsonBody(req): JsonBody<Req>) -> String {
    req.id
}

fn request(uri: &str) -> Request<Body> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id": "secret-7"}"#))
        .expect("request")
}

#[tokio::test(flavor = "current_thread")]
async fn one_event_per_request_at_the_same_level_through_both_faces() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let locker = Locker::new(MemoryBackend::new());
    let app = Router::new()
        .route("/layer", post(|body: String| async move { body }).layer(LockLayer::new("t").json("id")))
        .route("/macro", post(by_macro))
        .with_locker(locker.clone());

    for (outcome, level) in [("acquired", "DEBUG"), ("busy", "DEBUG")] {
        let held = if outcome == "busy" {
            let key = locker.key("t").part("secret-7").build().expect("key");
            Some(locker.try_acquire(&key).await.expect("free"))
        } else {
            None
        };
        let mut seen = Vec::new();
        for uri in ["/layer", "/macro"] {
            app.clone().oneshot(request(uri)).await.expect("infallible");
            let events = captured.take_events();
            assert_eq!(events.len(), 1, "{uri} {outcome}: {events:#?}");
            assert!(events[0].contains(&format!("outcome=\"{outcome}\"")), "{uri}: {}", events[0]);
            seen.push(events[0].split_whitespace().nth(1).map(str::to_owned));
        }
        assert_eq!(seen, vec![Some(level.to_owned()), Some(level.to_owned())], "{outcome}");
        if let Some(guard) = held {
            guard.release().await.expect("release");
        }
    }

    // Without an engine: an error, the same through both, naming no value.
    let bare = Router::new()
        .route("/layer", post(|body: String| async move { body }).layer(LockLayer::new("t").json("id")))
        .route("/macro", post(by_macro));
    for uri in ["/layer", "/macro"] {
        bare.clone().oneshot(request(uri)).await.expect("infallible");
        let events = captured.take_events();
        assert_eq!(events.len(), 1, "{uri}: {events:#?}");
        assert!(events[0].contains("ERROR") && events[0].contains("outcome=\"misconfigured\""), "{}", events[0]);
        assert!(!events[0].contains("secret-7"), "no request value above DEBUG: {}", events[0]);
    }
}
