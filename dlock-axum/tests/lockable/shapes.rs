//! Handler shapes `#[lockable]` must take and leave axum handlers: every
//! extractor and argument from the lock, a tuple's fields, shared, permits
//! and several keys. Compiling is the check; the test routes each one.
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_axum::{lockable, FencingToken, HeldLock};
use serde::Deserialize;

#[derive(Deserialize)]
struct Customer {
    id: String,
}

#[derive(Deserialize)]
struct Order {
    customer: Customer,
    sku: Option<String>,
}

#[derive(Deserialize)]
struct TokenParam {
    token: String,
}

#[derive(Clone)]
struct AppState;

#[lockable(key = "order.create", fields = ["order.customer.id", "order.sku", "t"], wait_ms = 100, lease_ms = 5000,
           message = "busy", code = 7)]
async fn create(
    State(_s): State<AppState>,
    Query(TokenParam { token: t }): Query<TokenParam>,
    Json(mut order): Json<Order>,
) -> Result<String, (axum::http::StatusCode, String)> {
    order.sku = None;
    Ok(format!("{t} {}", order.customer.id))
}

#[lockable(key = "tuple", fields = ["pair.0", "pair.1"])]
#[axum::debug_handler]
async fn tuple(Path(pair): Path<(u32, String)>) -> String {
    pair.1
}

#[lockable(key = "plain")]
async fn plain(body: String) -> String {
    body
}

/// Arguments filled from the lock, by any path, beside ordinary extractors.
#[lockable(key = "fenced", fields = ["id"], lease_ms = 1000, max_hold_ms = 60000)]
async fn fenced(
    Path(id): Path<u64>,
    dlock_axum::FencingToken(fence): dlock_axum::FencingToken,
    maybe: Option<FencingToken>,
    lock: HeldLock,
    also: Option<dlock_axum::HeldLock>,
) -> String {
    format!("{id} {fence} {maybe:?} {} {}", lock.is_lost(), also.is_some())
}

#[test]
fn every_shape_is_still_an_axum_handler() {
    let _app: Router = Router::new()
        .route("/orders", post(create))
        .route("/tuple/{a}/{b}", get(tuple))
        .route("/plain", post(plain))
        .route("/fenced/{id}", post(fenced))
        .merge(modes())
        .with_state(AppState);
}

/// Shared readers, a semaphore of two, and two keys taken together.
#[lockable(key = "price.list", fields = ["list"], mode = "shared", wait_ms = 100)]
async fn read_prices(Path(list): Path<String>, FencingToken(_f): FencingToken) -> String {
    list
}

#[lockable(key = "price.list", fields = ["list"], mode = "exclusive")]
async fn reprice(Path(list): Path<String>) -> String {
    list
}

#[lockable(key = "export", fields = ["user"], permits = 2, wait_ms = 0)]
async fn export(Path(user): Path<String>) -> String {
    user
}

#[derive(Deserialize)]
struct Transfer {
    from: u64,
    to: u64,
}

#[lockable(key = "account", fields = ["t.from"], also(key = "account", fields = ["t.to"]), also(key = "ledger"), wait_ms = 50)]
async fn transfer(Json(t): Json<Transfer>, lock: HeldLock) -> String {
    format!("{} -> {} under {}", t.from, t.to, lock.fencing_token().0)
}

fn modes() -> Router<AppState> {
    Router::new()
        .route("/prices/{list}", get(read_prices).post(reprice))
        .route("/exports/{user}", post(export))
        .route("/transfers", post(transfer))
}
