//! `GET`/`PUT /accounts/{id}` and `GET /ready`.

use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use dlock_axum::{JsonBody, Rejection};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, App};

/// `PUT /accounts/{id}`.
#[derive(Debug, Deserialize)]
pub(super) struct SetBalance {
    balance: i64,
}

/// How long `/ready` waits for the application's database.
const READY_WITHIN: Duration = Duration::from_secs(2);

fn account_json(id: i64, balance: i64) -> Json<Value> {
    Json(json!({"id": id, "balance": balance}))
}

/// `GET /accounts/{id}` → `{"id", "balance"}`.
pub(super) async fn get_account(
    State(app): State<App>,
    id: Result<Path<i64>, PathRejection>,
) -> Result<Json<Value>, Rejection> {
    let Path(id) = id.map_err(|e| error::invalid_path(&e))?;
    match db::balance_on(&app.pool, id).await.map_err(|e| error::database(&e))? {
        Some(balance) => Ok(account_json(id, balance)),
        None => Err(error::account_not_found(id)),
    }
}

/// `PUT /accounts/{id}` `{"balance": n}`: an operator's seed or reset. It
/// runs under the account's lock (the route's `LockLayer`), so it never
/// lands between a transfer's read and its write, as one autocommit
/// statement on the pool. It is not fenced: not for a live account whose
/// lock could change hands under a lease that ran out.
pub(super) async fn put_account(
    State(app): State<App>,
    id: Result<Path<i64>, PathRejection>,
    JsonBody(SetBalance { balance }): JsonBody<SetBalance>,
) -> Result<Json<Value>, Rejection> {
    let Path(id) = id.map_err(|e| error::invalid_path(&e))?;
    if balance < 0 {
        return Err(error::invalid_balance());
    }
    db::seed(&app.pool, id, balance).await.map_err(|e| error::database(&e))?;
    Ok(account_json(id, balance))
}

/// `GET /ready`: dlock's own checks (the lock service) and the
/// application's database, which `/transfers` needs for its transaction
/// and its idempotency records alike. `200` when all answer, else `503`.
pub(super) async fn ready(State(app): State<App>) -> (StatusCode, Json<Value>) {
    let readiness = app.dlock.readiness().await;
    let mut checks: Vec<Value> = readiness
        .checks()
        .iter()
        .map(|c| json!({"part": c.part(), "backend": c.backend(), "ok": c.is_ok(), "problem": c.problem()}))
        .collect();
    let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&app.pool);
    let db_problem = match tokio::time::timeout(READY_WITHIN, ping).await {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!("no answer within {READY_WITHIN:?}")),
    };
    checks.push(json!({"part": "wallet", "backend": "postgres", "ok": db_problem.is_none(), "problem": db_problem}));
    let ready = readiness.is_ready() && db_problem.is_none();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"ready": ready, "checks": checks})))
}
