//! Review 2026-12-07 A1 over a real socket, on any lock backend: a writer
//! request that waits on a read-write key keeps new readers out (writer
//! preference); when its client hangs up, hyper drops its request future,
//! and what the writer recorded goes with it. One hung-up writer request
//! does not refuse every reader of a shared route for the rest of its wait.
//!
//! Over `axum::serve`, because hyper dropping the request's future when
//! its client goes away is the point: `oneshot` never does that. The same
//! app and scenario for `shared_hang_up.rs` (Redis) and
//! `shared_hang_up_postgres.rs`, kept here so that each
//! backend's file only says which locker it runs on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Query;
use axum::routing::{get, put};
use axum::Router;
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::Locker;
use tokio::sync::{mpsc, Notify};

/// How long the writer's route waits for the readers: far past anything
/// the test waits for.
const WRITER_WAIT: Duration = Duration::from_secs(30);

#[derive(serde::Deserialize)]
struct ReadQuery {
    /// Hold the read lock until the test lets go.
    #[serde(default)]
    hold: bool,
}

/// `GET /doc` reads under a shared lock and tries once; `PUT /doc` writes
/// under the exclusive lock of the same key and waits [`WRITER_WAIT`]. A
/// `GET /doc?hold=true` says it entered and holds its read lock until
/// `leave` is notified.
fn app(locker: Locker, entered: mpsc::UnboundedSender<()>, leave: Arc<Notify>) -> Router {
    let read = move |Query(ReadQuery { hold }): Query<ReadQuery>| {
        let (entered, leave) = (entered.clone(), leave.clone());
        async move {
            if hold {
                let _ = entered.send(());
                leave.notified().await;
            }
            "read"
        }
    };
    let reads = get(read).route_layer(LockLayer::new("doc").shared().wait(Duration::ZERO));
    let writes = put(|| async { "written" }).route_layer(LockLayer::new("doc").wait(WRITER_WAIT));
    Router::new().route("/doc", reads.merge(writes)).with_dlock(locker)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn request(method: &str, path: &str) -> String {
    format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
}

/// Sends `req` and leaves the socket open: dropping it hangs up.
fn send_and_keep(addr: SocketAddr, req: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(req.as_bytes()).expect("write");
    s
}

/// The status of a `GET /doc` (the server closes: `connection: close`).
async fn read_status(addr: SocketAddr) -> u16 {
    tokio::task::spawn_blocking(move || {
        let mut s = send_and_keep(addr, &request("GET", "/doc"));
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        answer.get(9..12).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("an HTTP answer: {answer:?}"))
    })
    .await
    .expect("client")
}

/// A reader holds the key; a writer request waits for it (and keeps new
/// readers out: the control), then hangs up. New readers are let in at
/// once, while the first reader still holds the key, not when the writer's
/// 30 s wait would have ended.
pub(crate) async fn a_writer_request_that_hung_up_does_not_keep_readers_out(locker: Locker) {
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let leave = Arc::new(Notify::new());
    let addr = serve(app(locker, entered_tx, leave.clone())).await;

    let holding = std::thread::spawn(move || {
        let mut s = send_and_keep(addr, &request("GET", "/doc?hold=true"));
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        answer
    });
    tokio::time::timeout(Duration::from_secs(10), entered.recv()).await.expect("the first reader runs");

    let writer = send_and_keep(addr, &request("PUT", "/doc"));
    // Control: once the waiting writer's claim landed, a new reader is
    // refused (readers let in before that go at once).
    let claimed_by = Instant::now() + Duration::from_secs(5);
    loop {
        match read_status(addr).await {
            409 => break,
            200 => assert!(Instant::now() < claimed_by, "the waiting writer never kept a reader out"),
            other => panic!("a new reader while the writer waits: {other}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let hung_up = Instant::now();
    drop(writer);
    let mut refused = 0;
    loop {
        match read_status(addr).await {
            200 => break,
            409 => refused += 1,
            other => panic!("a new reader after the writer hung up: {other}"),
        }
        assert!(
            hung_up.elapsed() < Duration::from_secs(5),
            "a new reader was refused {refused} times in the 5 s after the writer hung up (its wait: {WRITER_WAIT:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admitted = hung_up.elapsed();
    eprintln!("a new reader was refused {refused} times, admitted {admitted:?} after the writer hung up");
    assert!(admitted < Duration::from_secs(2), "admitted {admitted:?} after the writer hung up");

    leave.notify_one();
    let answer = tokio::task::spawn_blocking(move || holding.join().expect("first reader")).await.expect("join");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
