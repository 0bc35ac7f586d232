//! `POST /db/…`: the database's own answers to concurrent writes, without a
//! dlock lock, on the PostgreSQL store (`pg.rs`): a unique index, an
//! optimistic `version` column, `SELECT … FOR UPDATE`. What each catches,
//! and when dlock is the better tool, is in `docs/database-patterns.md`.
//! On another store they answer `501 needs_postgres_store`; built with the
//! feature `postgres` only.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dlock_axum::{JsonBody, Rejection};
use serde::Deserialize;
use serde_json::json;

use crate::model::{ProductId, ProductRef, ReduceStock};
use crate::pg::{PgStore, Placed};
use crate::{invalid_quantity, App, AppError};

/// `POST /db/orders`.
#[derive(Debug, Deserialize)]
pub(crate) struct UniqueOrder {
    /// The client's id of this order: unique in the orders table.
    request_id: String,
    product: ProductRef,
    quantity: i64,
}

fn pg(app: &App) -> Result<&PgStore, AppError> {
    match &app.store {
        crate::store::Store::Postgres(pg) => Ok(pg),
        _ => Err(needs_postgres()),
    }
}

fn needs_postgres() -> AppError {
    Rejection::new(
        StatusCode::NOT_IMPLEMENTED,
        "needs_postgres_store",
        3014,
        "this route shows a PostgreSQL pattern: start the service with ORDERS_POSTGRES_URL",
    )
    .into()
}

fn contended(id: &ProductId) -> AppError {
    Rejection::new(
        StatusCode::CONFLICT,
        "stock_contended",
        3015,
        format!("product {id} changed under every try; please retry"),
    )
    .with_retry_after(Some(1))
    .into()
}

fn remaining(id: &ProductId, left: i64) -> Json<serde_json::Value> {
    Json(json!({"product_id": id, "remaining": left}))
}

/// A unique index on `request_id`: 201 with the new order, or 200 with the
/// order a request with the same id placed before.
pub(crate) async fn unique_order(
    State(app): State<App>,
    JsonBody(UniqueOrder { request_id, product, quantity }): JsonBody<UniqueOrder>,
) -> Result<Response, AppError> {
    let store = pg(&app)?;
    if quantity < 1 {
        return Err(invalid_quantity().into());
    }
    let id = product.id;
    let order_id = crate::new_order_id()?;
    let order = json!({"order_id": order_id, "request_id": request_id, "product_id": id, "quantity": quantity});
    match store.place_unique(&request_id, &order_id, &order, id.as_str(), quantity).await? {
        Placed::Created(order) => Ok((StatusCode::CREATED, Json(order)).into_response()),
        Placed::Existing(order) => Ok((StatusCode::OK, Json(order)).into_response()),
        Placed::NotSold(sale) => crate::sold(&id, quantity, sale).map(|_| StatusCode::OK.into_response()),
    }
}

/// An optimistic `version` column: a lost race reads again.
pub(crate) async fn reduce_optimistic(
    State(app): State<App>,
    JsonBody(ReduceStock { product_id, quantity }): JsonBody<ReduceStock>,
) -> Result<Json<serde_json::Value>, AppError> {
    let store = pg(&app)?;
    if quantity < 1 {
        return Err(invalid_quantity().into());
    }
    let Some(sale) = store.sell_optimistic(product_id.as_str(), quantity, app.stock_work).await? else {
        return Err(contended(&product_id));
    };
    crate::sold(&product_id, quantity, sale).map(|left| remaining(&product_id, left))
}

/// `SELECT … FOR UPDATE`: sales of one product queue on its row.
pub(crate) async fn reduce_for_update(
    State(app): State<App>,
    JsonBody(ReduceStock { product_id, quantity }): JsonBody<ReduceStock>,
) -> Result<Json<serde_json::Value>, AppError> {
    let store = pg(&app)?;
    if quantity < 1 {
        return Err(invalid_quantity().into());
    }
    let sale = store.sell_for_update(product_id.as_str(), quantity, app.stock_work).await?;
    crate::sold(&product_id, quantity, sale).map(|left| remaining(&product_id, left))
}
