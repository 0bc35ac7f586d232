//! The idempotency layers over a real socket, as `over_socket.rs` tests the
//! lock layers: a refusal made before the body is read reaches a client that
//! is still sending a large body (no broken pipe), and the layer reads a body
//! within the installed engine's body-read timeout.
//!
//! These cannot be tested with `oneshot`: what goes wrong is the connection.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use dlock_axum::{
    idempotency::{IdempotencyLayer, TokenLayer},
    Caller,
};
use dlock_axum::{DlockExt, DlockRuntime};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore};
use dlock_core::{Locker, MemoryBackend};
use serde_json::Value;

mod small_buffers;

use small_buffers::{connect, serve};

const TWO_MIB: usize = 2 * 1024 * 1024;

/// `/idem` behind `IdempotencyLayer`, `/token` and `/bound` behind
/// `TokenLayer` (unbound, and bound to the `x-user` header).
fn app(dlock: DlockRuntime) -> Router {
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    Router::new()
        .route(
            "/idem",
            post(|| async { "done" }).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
        )
        .route("/token", post(|| async { "done" }).layer(TokenLayer::new().store(idem.clone())))
        .route(
            "/bound",
            post(|| async { "done" }).layer(TokenLayer::new().store(idem.clone()).caller(Caller::header("x-user"))),
        )
        .with_dlock(dlock)
}

fn engine() -> DlockRuntime {
    DlockRuntime::new(Locker::new(MemoryBackend::new()))
}

/// One HTTP/1.1 answer: status and the body's `error` (or the body).
fn read_answer(s: &mut TcpStream) -> Result<(u16, String), String> {
    let answer = dlock_testing::read_http_answer(s)?;
    let error = serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&answer.body).into_owned());
    Ok((answer.status, error))
}

/// What Python's `http.client` (and many SDKs) do: write the head and the
/// whole body, with no `Expect: 100-continue`, and only then read.
fn send_then_read(s: &mut TcpStream, head: &str, body: &[u8]) -> Result<(u16, String), String> {
    s.write_all(head.as_bytes()).map_err(|e| format!("writing the head: {e}"))?;
    s.write_all(body).map_err(|e| format!("writing the body: {e}"))?;
    read_answer(s)
}

fn head(path: &str, extra: &str) -> String {
    format!("POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{extra}\r\n")
}

/// `IdempotencyLayer` refuses a request without a key before reading its
/// body, and `TokenLayer` every request it refuses: the 2 MiB body is
/// drained, the client reads the answer, and the connection serves the next
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_the_body_reach_a_client_still_sending_it() {
    let addr = serve(app(engine())).await;
    tokio::task::spawn_blocking(move || {
        let body = vec![b'x'; TWO_MIB];
        let length = format!("content-length: {TWO_MIB}\r\n");
        let cases = [
            ("/idem", String::new(), 400, "idempotency_key_missing"),
            ("/idem", "idempotency-key: \"\"\r\n".to_owned(), 400, "idempotency_key_invalid"),
            ("/idem", "idempotency-key: has\tspace\r\n".to_owned(), 400, "idempotency_key_invalid"),
            ("/token", String::new(), 400, "idempotency_token_missing"),
            ("/token", format!("idempotency-token: {}\r\n", "0".repeat(32)), 409, "idempotency_token_unknown"),
            ("/bound", format!("idempotency-token: {}\r\n", "0".repeat(32)), 400, "idempotency_scope_missing"),
            (
                "/bound",
                format!("x-user: alice\r\nidempotency-token: {}\r\n", "0".repeat(32)),
                409,
                "idempotency_token_unknown",
            ),
        ];
        for (path, extra, status, error) in cases {
            let mut s = connect(addr);
            let first = head(path, &format!("{length}{extra}"));
            let answer = send_then_read(&mut s, &first, &body).unwrap_or_else(|e| panic!("{path} {extra:?}: {e}"));
            assert_eq!(answer, (status, error.to_owned()), "{path} {extra:?}");
            // Drained, not left in the socket: the connection goes on.
            let next = head("/idem", "content-length: 2\r\nidempotency-key: next\r\n");
            let answer = send_then_read(&mut s, &next, b"{}").unwrap_or_else(|e| panic!("{path} next: {e}"));
            // (The first case runs it, the later ones are replayed: 200 too.)
            assert_eq!(answer.0, 200, "{path} {extra:?} next: {answer:?}");
        }
    })
    .await
    .expect("client");
}

/// `IdempotencyLayer` reads the body for its fingerprint within the
/// installed engine's body-read timeout, as the lock layers do, not a
/// default of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_408_within_the_engines_timeout() {
    let timeout = Duration::from_millis(300);
    let addr = serve(app(engine().with_body_read_timeout(timeout))).await;
    tokio::task::spawn_blocking(move || {
        let mut s = connect(addr);
        // Announces 100 bytes, sends 10, then nothing.
        let started = std::time::Instant::now();
        let first = head("/idem", "content-length: 100\r\nidempotency-key: slow\r\n");
        let answer = send_then_read(&mut s, &first, br#"{"id": 1, "#).unwrap_or_else(|e| panic!("/idem: {e}"));
        let took = started.elapsed();
        assert_eq!(answer, (408, "request_timeout".to_owned()));
        assert!(took >= timeout, "answered before the timeout: {took:?}");
        // Not the default 30 s; generous for a loaded machine.
        assert!(took < Duration::from_secs(10), "the engine's timeout was not used: {took:?}");
    })
    .await
    .expect("client");
}
