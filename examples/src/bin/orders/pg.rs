//! The PostgreSQL store (`ORDERS_POSTGRES_URL`, feature `postgres`), and
//! the database's own answers to concurrent writes, one example each (see
//! `docs/database-patterns.md`):
//!
//! * **fencing** ([`PgStore::sell`], behind the stock lock): the sale's
//!   transaction first checks the lock's token
//!   (`dlock_core::fence::postgres::Fences::check`), then reads and writes;
//! * **a unique index** ([`PgStore::place_unique`]): `orders.request_id`
//!   is unique, so a second order with the same request id fails at its
//!   insert, in the transaction that would have taken the stock;
//! * **an optimistic `version` column** ([`PgStore::sell_optimistic`]): the
//!   write names the version it read, and a lost race is a retry;
//! * **`SELECT … FOR UPDATE`** ([`PgStore::sell_for_update`]): the row is
//!   locked from the read to the commit.
//!
//! The last three take no dlock lock at all.

use std::time::Duration;

use dlock_core::fence::postgres::Fences;
use serde_json::Value;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row as _;

use crate::store::{Sale, Stock, StoreError};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders_products (
  id text PRIMARY KEY, stock bigint NOT NULL, sold bigint NOT NULL, version bigint NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS orders_orders (order_id text PRIMARY KEY, body text NOT NULL);
ALTER TABLE orders_orders ADD COLUMN IF NOT EXISTS request_id text;
CREATE UNIQUE INDEX IF NOT EXISTS orders_orders_request_id ON orders_orders (request_id);
CREATE TABLE IF NOT EXISTS orders_accounts (id text PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE IF NOT EXISTS orders_charges (order_id text PRIMARY KEY, runs bigint NOT NULL);
CREATE TABLE IF NOT EXISTS orders_payments (claim text PRIMARY KEY, payment_id text NOT NULL, body text NOT NULL);
";

/// How many times [`PgStore::sell_optimistic`] reads again after a lost race.
const OPTIMISTIC_TRIES: u32 = 20;

/// Products, orders, accounts and payments in PostgreSQL.
#[derive(Debug, Clone)]
pub(crate) struct PgStore {
    pool: PgPool,
    fences: Fences,
}

/// What [`PgStore::place_unique`] did.
#[derive(Debug)]
pub(crate) enum Placed {
    /// A new order: its JSON.
    Created(Value),
    /// The request id had an order already: that order's JSON.
    Existing(Value),
    /// Not placed: the sale's outcome (sold out, no such product).
    NotSold(Sale),
}

fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

impl PgStore {
    /// Connects and creates the tables (and the fences table `orders_fences`)
    /// when missing.
    pub(crate) async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(2))
            .connect(url)
            .await
            .map_err(unavailable)?;
        let fences = Fences::new("orders")?;
        fences.create(&pool).await?;
        let mut conn = pool.acquire().await.map_err(unavailable)?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(unavailable)?;
        // dlock's schema lock ("dloc", 0) keeps instances starting at once
        // from racing on the catalog.
        sqlx::query("SELECT pg_advisory_xact_lock(1684828003, 0)").execute(&mut *tx).await.map_err(unavailable)?;
        sqlx::raw_sql(SCHEMA).execute(&mut *tx).await.map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(PgStore { pool, fences })
    }

    pub(crate) async fn get(&self, id: &str) -> Result<Option<Stock>, StoreError> {
        let row = sqlx::query("SELECT stock, sold FROM orders_products WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.map(|r| Ok(Stock { stock: col(&r, 0)?, sold: col(&r, 1)? })).transpose()
    }

    /// Sets the stock, in a transaction that checks `fence` first.
    pub(crate) async fn put(&self, id: &str, stock: Stock, fence: Option<u64>) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        if let Some(token) = fence {
            self.fences.check(&mut tx, &resource(id), token).await?;
        }
        sqlx::query(
            "INSERT INTO orders_products (id, stock, sold) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET stock = $2, sold = $3, version = orders_products.version + 1",
        )
        .bind(id)
        .bind(stock.stock)
        .bind(stock.sold)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)
    }

    /// The fenced sale: check the token, read, work, write, commit. The
    /// check's row lock orders this transaction with every other fenced
    /// write of the product; a token a newer holder overtook is refused
    /// before anything is read.
    pub(crate) async fn sell(
        &self,
        id: &str,
        quantity: i64,
        fence: Option<u64>,
        work: Duration,
    ) -> Result<Sale, StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        if let Some(token) = fence {
            self.fences.check(&mut tx, &resource(id), token).await?;
        }
        let row = sqlx::query("SELECT stock, sold FROM orders_products WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
        let Some(row) = row else { return Ok(Sale::NotFound) };
        let (stock, sold) = (col(&row, 0)?, col(&row, 1)?);
        if stock < quantity {
            return Ok(Sale::SoldOut(stock));
        }
        tokio::time::sleep(work).await;
        write_stock(&mut tx, id, stock - quantity, sold + quantity).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(Sale::Sold(stock - quantity))
    }

    /// `SELECT … FOR UPDATE`: the row is locked from the read to the
    /// commit, so concurrent sales of the product queue on it, in any
    /// instance, with no dlock lock. `work` runs holding the row lock.
    pub(crate) async fn sell_for_update(&self, id: &str, quantity: i64, work: Duration) -> Result<Sale, StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let row = sqlx::query("SELECT stock, sold FROM orders_products WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
        let Some(row) = row else { return Ok(Sale::NotFound) };
        let (stock, sold) = (col(&row, 0)?, col(&row, 1)?);
        if stock < quantity {
            return Ok(Sale::SoldOut(stock));
        }
        tokio::time::sleep(work).await;
        write_stock(&mut tx, id, stock - quantity, sold + quantity).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(Sale::Sold(stock - quantity))
    }

    /// An optimistic `version` column: read stock and version, work, write
    /// only if the version is still the one read; a lost race reads again.
    /// No lock is held across the work. `Ok(None)`: every try lost its race.
    pub(crate) async fn sell_optimistic(
        &self,
        id: &str,
        quantity: i64,
        work: Duration,
    ) -> Result<Option<Sale>, StoreError> {
        for _ in 0..OPTIMISTIC_TRIES {
            let row = sqlx::query("SELECT stock, sold, version FROM orders_products WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(unavailable)?;
            let Some(row) = row else { return Ok(Some(Sale::NotFound)) };
            let (stock, sold, version) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?);
            if stock < quantity {
                return Ok(Some(Sale::SoldOut(stock)));
            }
            tokio::time::sleep(work).await;
            let written = sqlx::query(
                "UPDATE orders_products SET stock = $2, sold = $3, version = version + 1 WHERE id = $1 AND version = $4",
            )
            .bind(id)
            .bind(stock - quantity)
            .bind(sold + quantity)
            .bind(version)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
            if written.rows_affected() == 1 {
                return Ok(Some(Sale::Sold(stock - quantity)));
            }
        }
        Ok(None)
    }

    /// A unique index: the order is inserted first, under its unique
    /// `request_id`, in the transaction that then takes the stock (one
    /// conditional `UPDATE`). A second order with the same request id fails
    /// at the insert (`23505`), waiting for the first's transaction if it
    /// is still open; it then answers the order already there (the seed's
    /// "query once more and return it").
    pub(crate) async fn place_unique(
        &self,
        request_id: &str,
        order_id: &str,
        order: &Value,
        id: &str,
        quantity: i64,
    ) -> Result<Placed, StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let inserted = sqlx::query("INSERT INTO orders_orders (order_id, request_id, body) VALUES ($1, $2, $3)")
            .bind(order_id)
            .bind(request_id)
            .bind(order.to_string())
            .execute(&mut *tx)
            .await;
        match inserted {
            Ok(_) => {}
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505") => {
                drop(tx);
                let body: Option<String> = sqlx::query_scalar("SELECT body FROM orders_orders WHERE request_id = $1")
                    .bind(request_id)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(unavailable)?;
                let body = body.ok_or_else(|| StoreError::unavailable("the duplicate's order vanished"))?;
                return serde_json::from_str(&body).map(Placed::Existing).map_err(StoreError::unavailable);
            }
            Err(e) => return Err(unavailable(e)),
        }
        let taken = sqlx::query(
            "UPDATE orders_products SET stock = stock - $2, sold = sold + $2, version = version + 1 \
             WHERE id = $1 AND stock >= $2 RETURNING stock",
        )
        .bind(id)
        .bind(quantity)
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        if taken.is_none() {
            // Rolled back with the order: nothing was placed.
            drop(tx);
            return Ok(Placed::NotSold(match self.get(id).await? {
                Some(s) => Sale::SoldOut(s.stock),
                None => Sale::NotFound,
            }));
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(Placed::Created(order.clone()))
    }

    pub(crate) async fn balance(&self, id: &str) -> Result<Option<i64>, StoreError> {
        sqlx::query_scalar("SELECT balance FROM orders_accounts WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)
    }

    pub(crate) async fn set_balance(&self, id: &str, balance: i64) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO orders_accounts VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET balance = $2")
            .bind(id)
            .bind(balance)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(unavailable)
    }

    pub(crate) async fn record_order(&self, order_id: &str, order: &Value) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO orders_orders (order_id, body) VALUES ($1, $2)")
            .bind(order_id)
            .bind(order.to_string())
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(unavailable)
    }

    pub(crate) async fn count_charge(&self, order_id: &str) -> Result<u64, StoreError> {
        let runs: i64 = sqlx::query_scalar(
            "INSERT INTO orders_charges VALUES ($1, 1) ON CONFLICT (order_id) \
             DO UPDATE SET runs = orders_charges.runs + 1 RETURNING runs",
        )
        .bind(order_id)
        .fetch_one(&self.pool)
        .await
        .map_err(unavailable)?;
        u64::try_from(runs).map_err(StoreError::unavailable)
    }

    /// Once per claim: the claim is the primary key (a unique index too).
    pub(crate) async fn record_payment_once(
        &self,
        claim: &str,
        payment_id: &str,
        payment: &Value,
    ) -> Result<Option<String>, StoreError> {
        let inserted = sqlx::query(
            "INSERT INTO orders_payments VALUES ($1, $2, $3) ON CONFLICT (claim) DO NOTHING RETURNING claim",
        )
        .bind(claim)
        .bind(payment_id)
        .bind(payment.to_string())
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        if inserted.is_some() {
            return Ok(None);
        }
        sqlx::query_scalar("SELECT body FROM orders_payments WHERE claim = $1")
            .bind(claim)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)
    }
}

/// Column `i` of `row`, a `bigint`.
fn col(row: &sqlx::postgres::PgRow, i: usize) -> Result<i64, StoreError> {
    row.try_get(i).map_err(unavailable)
}

/// The fenced resource of product `id`: one per stock lock key.
fn resource(id: &str) -> String {
    format!("product:{id}")
}

async fn write_stock(tx: &mut sqlx::PgConnection, id: &str, stock: i64, sold: i64) -> Result<(), StoreError> {
    sqlx::query("UPDATE orders_products SET stock = $2, sold = $3, version = version + 1 WHERE id = $1")
        .bind(id)
        .bind(stock)
        .bind(sold)
        .execute(tx)
        .await
        .map(drop)
        .map_err(unavailable)
}
