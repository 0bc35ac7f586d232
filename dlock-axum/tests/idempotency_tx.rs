//! Issue 27 item 2: `IdempotencyLayer::in_transaction` on a real
//! PostgreSQL. The handler's writes and the stored answer commit together
//! or not at all: an error, a panic, a broken connection or a refusal
//! leaves neither, and the retry runs the route once more; a commit
//! answers every retry from the record.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::{IdempotencyLayer, Tx};
use dlock_axum::Caller;
use dlock_core::idempotency::PostgresStore;
use dlock_testing::PostgresServer;
use tokio::sync::Notify;
use tower::ServiceExt;

/// What a route does after it wrote its row.
#[derive(Clone, Copy)]
enum Then {
    Answer,
    Fail,
    Panic,
    /// Waits for the test's go, with its transaction open.
    Wait,
}

#[derive(Clone)]
struct Route {
    runs: Arc<AtomicUsize>,
    go: Arc<Notify>,
    started: Arc<Notify>,
}

async fn app(server: &PostgresServer, then: Then) -> (Router, Route, PostgresStore) {
    let store = PostgresStore::connect(&server.url(), "tx").await.expect("connect to the test PostgreSQL");
    server.psql("CREATE TABLE IF NOT EXISTS payments (id serial PRIMARY KEY, note text)");
    let route =
        Route { runs: Arc::new(AtomicUsize::new(0)), go: Arc::new(Notify::new()), started: Arc::new(Notify::new()) };
    let r = route.clone();
    let handler = move |mut tx: Tx| {
        let r = r.clone();
        async move {
            r.runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO payments (note) VALUES ('paid')").execute(&mut *tx).await.expect("write");
            match then {
                Then::Answer => {}
                Then::Fail => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                Then::Panic => panic!("the route panicked after its write"),
                Then::Wait => {
                    r.started.notify_one();
                    r.go.notified().await;
                }
            }
            (StatusCode::CREATED, "paid").into_response()
        }
    };
    let layer = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(store.clone());
    (Router::new().route("/pay", post(handler).layer(layer)), route, store)
}

fn pay(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("x-user", "alice")
        .body(Body::from(body))
        .expect("request")
}

async fn status_and_body(app: &Router, req: Request<Body>) -> (StatusCode, String, bool) {
    let res = app.clone().oneshot(req).await.expect("infallible");
    let replayed = res.headers().contains_key("idempotent-replayed");
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    (status, String::from_utf8_lossy(&bytes).into_owned(), replayed)
}

fn rows(server: &PostgresServer) -> String {
    server.psql("SELECT count(*) FROM payments")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_committed_route_is_replayed_and_its_write_made_once() {
    let server = PostgresServer::start();
    let (app, route, _) = app(&server, Then::Answer).await;
    assert_eq!(status_and_body(&app, pay("k1", "{}")).await, (StatusCode::CREATED, "paid".into(), false));
    assert_eq!(status_and_body(&app, pay("k1", "{}")).await, (StatusCode::CREATED, "paid".into(), true));
    assert_eq!((route.runs.load(Ordering::SeqCst), rows(&server)), (1, "1".into()));
    let (status, body, _) = status_and_body(&app, pay("k1", "{\"other\":1}")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_error_or_a_panic_rolls_the_write_back_and_the_retry_runs() {
    let server = PostgresServer::start();
    let (failing, route, _) = app(&server, Then::Fail).await;
    assert_eq!(status_and_body(&failing, pay("k1", "{}")).await.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(rows(&server), "0", "a 5xx keeps nothing the route wrote");
    assert_eq!(server.psql("SELECT count(*) FROM tx_idem_keys"), "0", "nor its claim");

    let (panicking, _, _) = app(&server, Then::Panic).await;
    let panicked = tokio::spawn(async move { panicking.oneshot(pay("k1", "{}")).await }).await;
    assert!(panicked.is_err_and(|e| e.is_panic()), "the panic goes on, for an outer CatchPanicLayer");
    assert_eq!(rows(&server), "0", "a panic keeps nothing the route wrote");

    let (working, _, _) = app(&server, Then::Answer).await;
    assert_eq!(status_and_body(&working, pay("k1", "{}")).await.0, StatusCode::CREATED, "the retry runs");
    assert!(status_and_body(&working, pay("k1", "{}")).await.2, "then replays");
    assert_eq!((route.runs.load(Ordering::SeqCst), rows(&server)), (1, "1".into()));
}

/// While the route runs with its transaction open, a duplicate is told
/// "in progress" at once; a client that hangs up cancels neither the route
/// nor its commit, and its retry gets the stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_is_refused_at_once_and_a_hang_up_still_commits() {
    let server = PostgresServer::start();
    let (app, route, _) = app(&server, Then::Wait).await;
    let first = tokio::spawn(app.clone().oneshot(pay("k1", "{}")));
    route.started.notified().await;
    let started = std::time::Instant::now();
    let (status, body, _) = status_and_body(&app, pay("k1", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains("idempotency_request_in_progress"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(1), "never waits for the running one");
    // The client hangs up: its request future is dropped mid-route.
    first.abort();
    let _ = first.await;
    route.go.notify_one();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body, replayed) = status_and_body(&app, pay("k1", "{}")).await;
        if status == StatusCode::CREATED {
            assert!(replayed, "the stored answer, not a second run");
            break;
        }
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(tokio::time::Instant::now() < deadline, "the route never committed after its client hung up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((route.runs.load(Ordering::SeqCst), rows(&server)), (1, "1".into()));
}

/// The route's connection breaks before its commit (the server killed it,
/// as it does when the instance dies): nothing is kept, the request is
/// told so, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_lost_before_the_commit_keeps_nothing_and_the_retry_runs() {
    let server = PostgresServer::start();
    let (app, route, _) = app(&server, Then::Wait).await;
    let first = tokio::spawn(app.clone().oneshot(pay("k1", "{}")));
    route.started.notified().await;
    let killed = server.psql(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE state = 'idle in transaction' \
         AND pid <> pg_backend_pid()",
    );
    assert_eq!(killed, "1", "the route's transaction");
    route.go.notify_one();
    let res = first.await.expect("task").expect("infallible");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    assert!(String::from_utf8_lossy(&body).contains("idempotency_not_committed"));
    assert_eq!(rows(&server), "0");
    let (working, again, _) = self::app(&server, Then::Answer).await;
    assert_eq!(status_and_body(&working, pay("k1", "{}")).await.0, StatusCode::CREATED, "the retry runs");
    assert_eq!((again.runs.load(Ordering::SeqCst), rows(&server)), (1, "1".into()));
}

/// A `Tx` on a route without `in_transaction` is a clear 500, naming it.
#[tokio::test]
async fn a_tx_without_its_layer_is_a_misconfiguration() {
    let app: Router = Router::new().route("/pay", post(|_tx: Tx| async { "never" }));
    let res = app.oneshot(Request::post("/pay").body(Body::empty()).expect("request")).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("lock_misconfigured") && body.contains("no idempotent transaction"), "{body}");
}
