//! The wallet's tables and statements, each one plain SQL: the safety
//! comes from the lock and the fences, not from the statements.

use sqlx::postgres::{PgConnection, PgPool};

/// `wallet_accounts` holds balances; `wallet_ledger` one row per transfer,
/// with the caller and `Idempotency-Key` that made it (an audit trail, and
/// how a second run of one key would show). Neither has a `CHECK` on the
/// balance or a unique index on the key: either would turn the faults the
/// lock and the idempotency layer prevent into errors, and hide them.
const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS wallet_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS wallet_ledger (id bigserial PRIMARY KEY, from_id bigint NOT NULL, \
     to_id bigint NOT NULL, amount bigint NOT NULL, caller text NOT NULL, idem_key text NOT NULL, \
     at timestamptz NOT NULL DEFAULT now())",
];

/// Creates the tables when missing. `CREATE … IF NOT EXISTS` from two
/// instances at once can still collide in the catalog, so the statements
/// run under a transaction-scoped advisory lock of their own.
pub(super) async fn create_schema(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('wallet schema'))").execute(&mut *tx).await?;
    for statement in SCHEMA {
        sqlx::query(statement).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// An account's balance, if it exists.
pub(super) async fn balance(conn: &mut PgConnection, id: i64) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT balance FROM wallet_accounts WHERE id = $1").bind(id).fetch_optional(conn).await
}

/// An account's balance, read on the pool.
pub(super) async fn balance_on(pool: &PgPool, id: i64) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT balance FROM wallet_accounts WHERE id = $1").bind(id).fetch_optional(pool).await
}

/// Writes the balance computed from an earlier read.
pub(super) async fn set_balance(conn: &mut PgConnection, id: i64, balance: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE wallet_accounts SET balance = $2 WHERE id = $1").bind(id).bind(balance).execute(conn).await?;
    Ok(())
}

/// Creates or resets an account: one autocommit statement on the pool.
pub(super) async fn seed(pool: &PgPool, id: i64, balance: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO wallet_accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
    )
    .bind(id)
    .bind(balance)
    .execute(pool)
    .await?;
    Ok(())
}

/// A transfer's ledger row.
#[derive(Debug)]
pub(super) struct Entry<'a> {
    pub(super) from: i64,
    pub(super) to: i64,
    pub(super) amount: i64,
    pub(super) caller: &'a str,
    pub(super) key: &'a str,
}

/// Records a transfer; its ledger id.
pub(super) async fn record(conn: &mut PgConnection, e: &Entry<'_>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO wallet_ledger (from_id, to_id, amount, caller, idem_key) VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(e.from)
    .bind(e.to)
    .bind(e.amount)
    .bind(e.caller)
    .bind(e.key)
    .fetch_one(conn)
    .await
}
