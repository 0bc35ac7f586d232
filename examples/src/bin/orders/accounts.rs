//! Accounts and transfers: issue 26's multi-key locks from HTTP.
//!
//! * `POST /transfers` holds **both** accounts as one multi-key set
//!   (`#[lockable(.., also(..))]`): taken all or none, in one global order,
//!   so a transfer 1→2 and a transfer 2→1 at the same time never deadlock,
//!   and no other transfer or deposit on either account runs meanwhile.
//!
//! The exports, a semaphore, are in `export.rs`.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dlock_axum::{lockable, JsonBody, Rejection};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::extract::Path;
use crate::{App, AppError};

/// `PUT /accounts/{id}`.
#[derive(Debug, Deserialize)]
pub(crate) struct SetBalance {
    /// The new balance (not negative).
    pub(crate) balance: i64,
}

/// `POST /transfers`.
#[derive(Debug, Deserialize)]
pub(crate) struct Transfer {
    /// The account debited.
    pub(crate) from: u64,
    /// The account credited.
    pub(crate) to: u64,
    /// How much (at least 1).
    pub(crate) amount: i64,
}

fn account_json(id: u64, balance: i64) -> Json<Value> {
    Json(json!({"id": id, "balance": balance}))
}

fn no_account(id: u64) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, "account_not_found", 3014, format!("no account {id}"))
}

/// `GET /accounts/{id}` → `{"id": id, "balance": n}`.
pub(crate) async fn get_account(State(app): State<App>, Path(id): Path<u64>) -> Result<Json<Value>, AppError> {
    match app.store.balance(&id.to_string()).await? {
        Some(balance) => Ok(account_json(id, balance)),
        None => Err(no_account(id).into()),
    }
}

/// `PUT /accounts/{id}` `{"balance": n}`: under the account's lock, the one
/// transfers take, so a reset never interleaves with a transfer.
#[lockable(key = "account", fields = ["id"], wait_ms = 5000)]
pub(crate) async fn put_account(
    State(app): State<App>,
    Path(id): Path<u64>,
    JsonBody(SetBalance { balance }): JsonBody<SetBalance>,
) -> Result<Json<Value>, AppError> {
    if balance < 0 {
        return Err(
            Rejection::new(StatusCode::BAD_REQUEST, "invalid_balance", 3015, "balance must not be negative").into()
        );
    }
    app.store.set_balance(&id.to_string(), balance).await?;
    Ok(account_json(id, balance))
}

/// `POST /transfers` `{"from": a, "to": b, "amount": n}` → `{"from": {..},
/// "to": {..}}` with both new balances. Both accounts are locked as one
/// set; the read-modify-write below is deliberately not atomic, so only the
/// locks keep concurrent transfers from losing money.
#[lockable(key = "account", fields = ["t.from"], also(key = "account", fields = ["t.to"]), wait_ms = 5000)]
pub(crate) async fn transfer(State(app): State<App>, JsonBody(t): JsonBody<Transfer>) -> Result<Json<Value>, AppError> {
    if t.amount < 1 {
        return Err(Rejection::new(StatusCode::BAD_REQUEST, "invalid_amount", 3016, "amount must be at least 1").into());
    }
    if t.from == t.to {
        return Err(Rejection::new(
            StatusCode::BAD_REQUEST,
            "invalid_transfer",
            3017,
            "a transfer needs two different accounts",
        )
        .into());
    }
    let (from, to) = (t.from.to_string(), t.to.to_string());
    let from_balance = app.store.balance(&from).await?.ok_or_else(|| no_account(t.from))?;
    let to_balance = app.store.balance(&to).await?.ok_or_else(|| no_account(t.to))?;
    if from_balance < t.amount {
        return Err(Rejection::new(
            StatusCode::CONFLICT,
            "insufficient_funds",
            3018,
            format!("account {} has {from_balance}, {} wanted", t.from, t.amount),
        )
        .into());
    }
    // Another transfer that read the same balances would now write over
    // this one: the lost update the locks prevent.
    tokio::time::sleep(Duration::from_millis(2)).await;
    app.store.set_balance(&from, from_balance - t.amount).await?;
    app.store.set_balance(&to, to_balance + t.amount).await?;
    Ok(Json(json!({
        "from": {"id": t.from, "balance": from_balance - t.amount},
        "to": {"id": t.to, "balance": to_balance + t.amount},
    })))
}
