//! `GET`/`PUT /accounts/{id}`.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
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
