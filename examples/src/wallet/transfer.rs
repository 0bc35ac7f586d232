//! `POST /transfers`: a plain read-modify-write inside the route's
//! transaction, under both accounts' locks, each row fenced with its own
//! token.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use dlock_axum::idempotency::{Tx, KEY_HEADER};
use dlock_axum::{HeldLocks, JsonBody, Rejection};
use serde::Deserialize;
use serde_json::{json, Value};

use super::db::{self, Entry};
use super::{error, App, ACCOUNT_LOCK};

/// The body of `POST /transfers`; `from` and `to` are also the lock keys'
/// parts (`LockLayer::json("from")`, `.json("to")`).
#[derive(Debug, Deserialize)]
pub(super) struct Transfer {
    from: i64,
    to: i64,
    amount: i64,
}

pub(super) async fn transfer(
    State(app): State<App>,
    locks: HeldLocks,
    headers: HeaderMap,
    mut tx: Tx,
    JsonBody(t): JsonBody<Transfer>,
) -> Result<(StatusCode, Json<Value>), Rejection> {
    if t.from == t.to {
        return Err(error::same_account());
    }
    if t.amount < 1 {
        return Err(error::invalid_amount());
    }
    if app.config.fenced {
        // First in the transaction, before anything is read: a holder whose
        // lease ran out is refused here. In id order, so two transactions
        // never wait on each other's fence rows.
        for id in [t.from.min(t.to), t.from.max(t.to)] {
            let token = locks.token(ACCOUNT_LOCK, id).ok_or_else(|| error::no_token(id))?;
            app.fences.check(&mut tx, &format!("account:{id}"), token.0).await?;
        }
    }
    let from = db::balance(&mut tx, t.from).await.map_err(|e| error::database(&e))?;
    let to = db::balance(&mut tx, t.to).await.map_err(|e| error::database(&e))?;
    let (Some(from), Some(to)) = (from, to) else {
        return Err(error::account_not_found(if from.is_none() { t.from } else { t.to }));
    };
    if from < t.amount {
        return Err(error::insufficient_funds(t.from, from, t.amount));
    }
    let (from, to) = (from - t.amount, to + t.amount);
    if !app.config.work.is_zero() {
        // The transfer's work: another transfer on these accounts that got
        // in now would read the same balances, and one update would be lost.
        tokio::time::sleep(app.config.work).await;
    }
    db::set_balance(&mut tx, t.from, from).await.map_err(|e| error::database(&e))?;
    db::set_balance(&mut tx, t.to, to).await.map_err(|e| error::database(&e))?;
    // The idempotency layer let the request in with both headers.
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let entry = Entry { from: t.from, to: t.to, amount: t.amount, caller: header("x-user"), key: header(KEY_HEADER) };
    let ledger = db::record(&mut tx, &entry).await.map_err(|e| error::database(&e))?;
    let body = json!({
        "ledger": ledger,
        "amount": t.amount,
        "from": {"id": t.from, "balance": from},
        "to": {"id": t.to, "balance": to},
    });
    Ok((StatusCode::CREATED, Json(body)))
}
