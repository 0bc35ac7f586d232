//! Issue 38 item 1, over HTTP: a key answered `201` by a route behind
//! `IdempotencyLayer` on the PostgreSQL store is replayed after the server
//! crashed, on a server set to `synchronous_commit = off` (which answers a
//! commit before its WAL is written). Both faces: the store's own
//! statements (`store`) and the route's transaction
//! (`in_transaction`). Before the fix the crash forgot the record and the
//! retry ran the route again ("route runs: 2"). The crash is
//! `PostgresServer::hold_wal_writes` before the request and
//! `crash_losing_unwritten_wal` after its answer (see dlock-core's
//! tests/postgres_async_commit.rs).

#![cfg(feature = "postgres")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::{IdempotencyLayer, Tx};
use dlock_axum::Caller;
use dlock_core::idempotency::PostgresStore;
use dlock_testing::PostgresServer;
use tower::ServiceExt;

#[derive(Clone, Copy, Debug)]
enum Face {
    OwnStatements,
    InTransaction,
}

/// `POST /pay` behind the layer, on a store of its own (as a process
/// started after the crash would have), counting its runs in `runs`.
async fn app(server: &PostgresServer, face: Face, runs: Arc<AtomicUsize>) -> Router {
    let store = PostgresStore::connect(&server.url(), "dlock").await.expect("connect to the test PostgreSQL");
    let layer = IdempotencyLayer::new().caller(Caller::header("x-user"));
    match face {
        Face::OwnStatements => {
            let handler = move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "paid").into_response()
            };
            Router::new().route("/pay", post(handler).layer(layer.store(Arc::new(store))))
        }
        Face::InTransaction => {
            let handler = move |mut tx: Tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                sqlx::query("SELECT 1").execute(&mut *tx).await.expect("a statement in the route's transaction");
                (StatusCode::CREATED, "paid").into_response()
            };
            Router::new().route("/pay", post(handler).layer(layer.in_transaction(store)))
        }
    }
}

/// The status, and whether it was replayed.
async fn pay(app: &Router, key: &str) -> (StatusCode, bool) {
    let req = Request::post("/pay")
        .header("idempotency-key", key)
        .header("x-user", "alice")
        .body(Body::from("{}"))
        .expect("request");
    let res = app.clone().oneshot(req).await.expect("infallible");
    (res.status(), res.headers().contains_key("idempotent-replayed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_key_survives_a_server_crash_under_async_commit() {
    let mut server = PostgresServer::start_with(&[("synchronous_commit", "off")]);
    let mut seen = Vec::new();
    for face in [Face::OwnStatements, Face::InTransaction] {
        let runs = Arc::new(AtomicUsize::new(0));
        let key = format!("k-crash-{face:?}");
        let before = app(&server, face, runs.clone()).await;
        server.psql("CHECKPOINT");
        server.hold_wal_writes();
        assert_eq!(pay(&before, &key).await, (StatusCode::CREATED, false), "{face:?}");
        server.crash_losing_unwritten_wal();
        drop(before);

        let after = app(&server, face, runs.clone()).await;
        let (status, replayed) = pay(&after, &key).await;
        seen.push(format!("{face:?}: retry after the crash {status} (replayed: {replayed}); route runs: {runs:?}"));
    }
    let expected = ["OwnStatements", "InTransaction"]
        .map(|face| format!("{face}: retry after the crash 201 Created (replayed: true); route runs: 1"));
    assert_eq!(seen, expected);
}
