//! The layers over a real socket, against clients that behave as common HTTP
//! clients do: the answer to a refused body must reach a client that is still
//! sending it, and a client that stops sending must not hold a task forever.
//!
//! These cannot be tested with `oneshot`: what goes wrong is the connection.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use dlock_axum::{idempotency::IdempotencyLayer, Caller};
use dlock_axum::{lockable, DlockExt, DlockRuntime, JsonBody, LockLayer};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use dlock_core::{Locker, MemoryBackend};
use dlock_testing::{read_http_answer, HttpAnswer};
use serde::Deserialize;
use serde_json::Value;

mod small_buffers;

use small_buffers::{connect, serve};

const TWO_MIB: usize = 2 * 1024 * 1024;
/// Far over the 64 KiB limit, and over the 8 MiB that refused bodies were
/// once drained up to.
const OVER_EIGHT_MIB: usize = 8 * 1024 * 1024 + 64 * 1024;

#[derive(Deserialize)]
struct Req {
    id: u64,
}

#[lockable(key = "t", fields = ["req.id"])]
async fn by_macro(JsonBody(req): JsonBody<Req>) -> String {
    req.id.to_string()
}

/// The three readers of a body: `LockLayer`, `#[lockable]` with `JsonBody`,
/// `IdempotencyLayer`; bodies limited to 64 KiB (the default).
fn app(dlock: DlockRuntime) -> Router {
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    Router::new()
        .route("/layer", post(|body: String| async move { body }).layer(LockLayer::new("t").json("id")))
        .route("/macro", post(by_macro))
        .route(
            "/idem",
            post(|| async { "done" }).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
        )
        .with_dlock(dlock)
}

/// The body's `error` member.
fn error(answer: &HttpAnswer) -> String {
    let v: Value = serde_json::from_slice(&answer.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&answer.body)));
    v["error"].as_str().unwrap_or_default().to_owned()
}

/// What Python's `http.client` (and many SDKs) do: write the head and the
/// whole body, with no `Expect: 100-continue`, and only then read.
fn send_then_read(s: &mut TcpStream, head: &str, body: &[u8]) -> Result<HttpAnswer, String> {
    s.write_all(head.as_bytes()).map_err(|e| format!("writing the head: {e}"))?;
    s.write_all(body).map_err(|e| format!("writing the body: {e}"))?;
    read_http_answer(s)
}

fn head(path: &str, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\nidempotency-key: k-{path}\r\n{extra}\r\n"
    )
}

/// A JSON body of `len` bytes with the key field first.
fn big_json(len: usize) -> Vec<u8> {
    let mut body = br#"{"id": 1, "pad": ""#.to_vec();
    body.resize(len - 2, b'x');
    body.extend_from_slice(b"\"}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_sent_in_one_go_gets_its_413() {
    let addr = serve(app(DlockRuntime::new(Locker::new(MemoryBackend::new())))).await;
    tokio::task::spawn_blocking(move || {
        let body = big_json(TWO_MIB);
        for path in ["/layer", "/macro", "/idem"] {
            // Declared up front, then streamed with no length: both are read
            // to the end and answered, and the connection stays usable.
            let declared = head(path, &format!("content-length: {}\r\n", body.len()));
            let mut chunked = head(path, "transfer-encoding: chunked\r\n").into_bytes();
            let mut framed = Vec::new();
            for c in body.chunks(16 * 1024) {
                framed.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                framed.extend_from_slice(c);
                framed.extend_from_slice(b"\r\n");
            }
            framed.extend_from_slice(b"0\r\n\r\n");
            chunked.extend_from_slice(&framed);
            for (how, first, body) in [("content-length", declared.as_str(), &body[..]), ("chunked", "", &chunked[..])]
            {
                let mut s = connect(addr);
                let res = send_then_read(&mut s, first, body).unwrap_or_else(|e| panic!("{path} {how}: {e}"));
                assert_eq!((res.status, error(&res)), (413, "payload_too_large".to_owned()), "{path} {how}");
                // The body was drained, not left in the socket: the same
                // connection serves the next request.
                let small = br#"{"id": 2}"#;
                let next = head(path, &format!("content-length: {}\r\n", small.len())).replace("k-/", "k2-/");
                let res = send_then_read(&mut s, &next, small).unwrap_or_else(|e| panic!("{path} {how} next: {e}"));
                assert_eq!(res.status, 200, "{path} {how}: {}", String::from_utf8_lossy(&res.body));
            }
        }
    })
    .await
    .expect("client");
}

/// However large the body, a client that writes all of it before reading
/// reads its `413`: a refused body is drained for a bounded time, not up to
/// a bounded number of bytes (as nginx's lingering close).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_far_over_the_limit_sent_in_one_go_gets_its_413() {
    let addr = serve(app(DlockRuntime::new(Locker::new(MemoryBackend::new())))).await;
    tokio::task::spawn_blocking(move || {
        let body = big_json(OVER_EIGHT_MIB);
        for path in ["/layer", "/macro", "/idem"] {
            let mut s = connect(addr);
            let first = head(path, &format!("content-length: {}\r\n", body.len()));
            let res = send_then_read(&mut s, &first, &body).unwrap_or_else(|e| panic!("{path}: {e}"));
            let v: Value = serde_json::from_slice(&res.body).expect("a JSON body");
            assert_eq!(
                (res.status, v["error"].as_str(), v["code"].as_u64()),
                (413, Some("payload_too_large"), Some(2301)),
                "{path}: {v}"
            );
        }
    })
    .await
    .expect("client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_for_100_continue_is_answered_at_once() {
    let addr = serve(app(DlockRuntime::new(Locker::new(MemoryBackend::new())))).await;
    tokio::task::spawn_blocking(move || {
        for path in ["/layer", "/macro", "/idem"] {
            let mut s = connect(addr);
            // Only the head: the client sends the body after `100 Continue`.
            let first = head(path, &format!("content-length: {TWO_MIB}\r\nexpect: 100-continue\r\n"));
            let res = send_then_read(&mut s, &first, b"").unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!((res.status, error(&res)), (413, "payload_too_large".to_owned()), "{path}");
        }
    })
    .await
    .expect("client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_408() {
    let timeout = Duration::from_millis(300);
    let dlock = DlockRuntime::new(Locker::new(MemoryBackend::new())).with_body_read_timeout(timeout);
    let addr = serve(app(dlock)).await;
    tokio::task::spawn_blocking(move || {
        for path in ["/layer", "/macro"] {
            let mut s = connect(addr);
            // Announces 100 bytes, sends 10, then nothing.
            let started = std::time::Instant::now();
            let res = send_then_read(&mut s, &head(path, "content-length: 100\r\n"), br#"{"id": 1, "#)
                .unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!((res.status, error(&res)), (408, "request_timeout".to_owned()), "{path}");
            assert!(started.elapsed() >= timeout, "{path}: answered before the timeout");
        }
    })
    .await
    .expect("client");
}

/// A refusal made before the body is read (here `415`: the key needs JSON)
/// is answered after the body is drained, like a `413`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_refused_before_reading_gets_its_answer() {
    let addr = serve(app(DlockRuntime::new(Locker::new(MemoryBackend::new())))).await;
    tokio::task::spawn_blocking(move || {
        let body = vec![b'x'; TWO_MIB];
        for path in ["/layer", "/macro"] {
            let mut s = connect(addr);
            let first = head(path, &format!("content-length: {}\r\n", body.len()))
                .replace("content-type: application/json", "content-type: text/plain");
            let res = send_then_read(&mut s, &first, &body).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!((res.status, error(&res)), (415, "unsupported_media_type".to_owned()), "{path}");
        }
    })
    .await
    .expect("client");
}
