//! The wallet's own refusals, in dlock's [`Rejection`] shape, so that
//! `RenderRejections` answers them as Problem Details like dlock's own.

use axum::extract::rejection::PathRejection;
use axum::http::{Method, StatusCode, Uri};
use dlock_axum::Rejection;

pub(super) fn insufficient_funds(id: i64, balance: i64, amount: i64) -> Rejection {
    Rejection::new(
        StatusCode::CONFLICT,
        "insufficient_funds",
        4001,
        format!("account {id} has {balance}, {amount} wanted"),
    )
}

pub(super) fn same_account() -> Rejection {
    Rejection::new(StatusCode::UNPROCESSABLE_ENTITY, "same_account", 4002, "from and to are the same account")
}

pub(super) fn invalid_amount() -> Rejection {
    Rejection::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_amount", 4003, "amount must be at least 1")
}

pub(super) fn account_not_found(id: i64) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, "account_not_found", 4004, format!("no account {id}"))
}

/// The database failed a statement: a `5xx`, so the transfer's transaction
/// is rolled back and its key freed for the retry.
pub(super) fn database(e: &sqlx::Error) -> Rejection {
    tracing::warn!(error = %e, "wallet: a database statement failed");
    Rejection::new(StatusCode::SERVICE_UNAVAILABLE, "wallet_db_unavailable", 4005, "the wallet's database failed")
        .with_retry_after(Some(1))
}

pub(super) fn invalid_balance() -> Rejection {
    Rejection::new(StatusCode::BAD_REQUEST, "invalid_balance", 4006, "balance must not be negative")
}

pub(super) fn invalid_path(e: &PathRejection) -> Rejection {
    Rejection::new(e.status(), "invalid_path", 4007, e.body_text())
}

/// A transfer route whose lock layer did not give it a key's token: the
/// route is built wrong, never the request.
pub(super) fn no_token(id: i64) -> Rejection {
    tracing::error!(account = id, "wallet: the transfer holds no lock on one of its accounts");
    Rejection::misconfigured().with_message("the transfer holds no lock on one of its accounts")
}

pub(super) async fn route_not_found(uri: Uri) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, "route_not_found", 4008, format!("no route {}", uri.path()))
}

pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> Rejection {
    Rejection::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        4009,
        format!("{method} is not served at {}", uri.path()),
    )
}
