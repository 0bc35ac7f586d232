//! `/ready` checks the store a route actually uses (issue 37 item 5). An
//! application with `DLOCK_BACKEND=postgres` whose route keeps its records
//! in its own database (`IdempotencyLayer::in_transaction` on
//! `PostgresStore::with_pool`) hands that store to the runtime
//! (`DlockRuntime::with_idempotency_store`), or adds it beside the
//! runtime's (`DlockRuntime::also_check`): `dlock_axum::ready` then answers
//! `503` while that database is down and `200` once it is back. The control:
//! the runtime as `Config::build` made it answers `200` all along, the
//! route's database down or not, since it asks only the lock database.

#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use dlock_axum::idempotency::IdempotencyLayer;
use dlock_axum::{Caller, DlockExt, DlockRuntime};
use dlock_core::idempotency::PostgresStore;
use dlock_core::Config;
use dlock_testing::PostgresServer;
use serde_json::Value;
use tower::ServiceExt;

/// The runtime `DLOCK_BACKEND=postgres` at `locks` builds.
async fn runtime(locks: &PostgresServer) -> DlockRuntime {
    let url = locks.url();
    let config = Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("postgres".into()),
        "DLOCK_POSTGRES_URL" => Some(url.clone()),
        _ => None,
    })
    .expect("config");
    config.build().await.expect("build")
}

/// The wallet's store, on a pool of the application's database.
async fn wallet_store(wallet: &PostgresServer) -> PostgresStore {
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect_lazy(&wallet.url()).expect("pool");
    PostgresStore::with_pool(pool, "wallet").await.expect("the wallet's store")
}

/// `POST /transfers` inside the wallet's transaction, and `GET /ready`.
fn app(dlock: DlockRuntime, wallet: PostgresStore) -> Router {
    let layer = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(wallet);
    Router::new()
        .route("/transfers", post(|| async { (StatusCode::CREATED, "moved") }).layer(layer))
        .route("/ready", get(dlock_axum::ready))
        .with_dlock(dlock)
}

/// `/ready`'s status, and its checks as `part:ok` (`part:FAILED`).
async fn ready(app: &Router) -> (StatusCode, String) {
    let res =
        app.clone().oneshot(Request::get("/ready").body(Body::empty()).expect("request")).await.expect("infallible");
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 1 << 16).await.expect("body");
    let json: Value = serde_json::from_slice(&body).expect("JSON");
    let checks = json["checks"].as_array().cloned().unwrap_or_default();
    let checks: Vec<String> = checks
        .iter()
        .map(|c| {
            let ok = if c["ok"] == Value::Bool(true) { "ok" } else { "FAILED" };
            format!("{}:{ok}", c["part"].as_str().unwrap_or("?"))
        })
        .collect();
    (status, checks.join(","))
}

/// `/ready` once the wallet's database is back (the pool's connections
/// died with it: the first probes may meet them).
async fn ready_again(app: &Router) -> (StatusCode, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let answer = ready(app).await;
        if answer.0 == StatusCode::OK || tokio::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn transfer(app: &Router, key: &str) -> StatusCode {
    let req = Request::post("/transfers")
        .header("idempotency-key", key)
        .header("x-user", "alice")
        .body(Body::empty())
        .expect("request");
    app.clone().oneshot(req).await.expect("infallible").status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_asks_the_store_the_routes_use() {
    let locks = PostgresServer::start();
    let mut wallet = PostgresServer::start();
    let store = wallet_store(&wallet).await;

    let control = app(runtime(&locks).await, store.clone());
    let handed = app(runtime(&locks).await.with_idempotency_store(Arc::new(store.clone())), store.clone());
    let beside = app(runtime(&locks).await.also_check("wallet records", Arc::new(store.clone())), store);
    assert_eq!(transfer(&handed, "k1").await, StatusCode::CREATED);
    assert_eq!(ready(&handed).await, (StatusCode::OK, "locks:ok,idempotency:ok".into()));
    assert_eq!(ready(&beside).await, (StatusCode::OK, "locks:ok,idempotency:ok,wallet records:ok".into()));
    // The runtimes' own stores were never asked for a record: the lock
    // database has no records' tables.
    assert_eq!(locks.psql("SELECT to_regclass('dlock_idem_keys') IS NULL"), "t");

    wallet.stop();
    assert_ne!(transfer(&handed, "k2").await, StatusCode::CREATED, "the route's database is down");
    assert_eq!(ready(&handed).await, (StatusCode::SERVICE_UNAVAILABLE, "locks:ok,idempotency:FAILED".into()));
    assert_eq!(
        ready(&beside).await,
        (StatusCode::SERVICE_UNAVAILABLE, "locks:ok,idempotency:ok,wallet records:FAILED".into())
    );
    // The control asks the lock database only.
    assert_eq!(ready(&control).await, (StatusCode::OK, "locks:ok,idempotency:ok".into()));

    wallet.start_again();
    assert_eq!(ready_again(&handed).await, (StatusCode::OK, "locks:ok,idempotency:ok".into()));
    assert_eq!(ready_again(&beside).await, (StatusCode::OK, "locks:ok,idempotency:ok,wallet records:ok".into()));
    assert_eq!(transfer(&handed, "k2").await, StatusCode::CREATED);
}
