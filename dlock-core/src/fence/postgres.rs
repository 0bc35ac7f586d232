//! Fencing inside a PostgreSQL transaction: the table
//! `<prefix>_fences (resource, token)` keeps the highest token seen per
//! resource, and [`Fences::check`], the transaction's first statement,
//! raises it or refuses a lower token with [`Error::StaleToken`].
//!
//! The check locks the resource's row until the transaction ends, so the
//! fenced transactions of a resource run one at a time in the order of
//! their checks: under READ COMMITTED no write of an old holder lands
//! after a newer one has read (under REPEATABLE READ or SERIALIZABLE the
//! race is a serialization failure, `40001`: retry). A holder paused
//! **inside** its transaction keeps the row locked and the next holder's
//! check waits: bound that with `lock_timeout` and
//! `idle_in_transaction_session_timeout`. Why it is safe, and a guarded
//! `UPDATE … WHERE fence <= $token` for a single-statement write:
//! `docs/core-design.md`.

use sqlx::postgres::{PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::postgres::{check_prefix, durable, install, Objects, PostgresOptions};

const BACKEND: &str = "postgres";

/// The fences table of one prefix, and its statements.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, guard: dlock_core::LockGuard) -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_core::fence::postgres::Fences;
/// let fences = Fences::new("dlock")?;
/// fences.create(&pool).await?; // once, at start-up
///
/// let mut tx = pool.begin().await?;
/// // First: a stale holder is refused here, before it reads anything.
/// fences.check(&mut tx, "stock:42", guard.fencing_token()).await?;
/// let stock: i64 = sqlx::query_scalar("SELECT stock FROM products WHERE id = 42").fetch_one(&mut *tx).await?;
/// sqlx::query("UPDATE products SET stock = $1 WHERE id = 42").bind(stock - 1).execute(&mut *tx).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Fences {
    table: String,
    create: String,
    check: String,
    newest: String,
}

impl Fences {
    /// The fences of `prefix`, in the table `<prefix>_fences` of the
    /// connection's current schema. Nothing is sent to the server.
    ///
    /// ```
    /// let fences = dlock_core::fence::postgres::Fences::new("shop")?;
    /// assert_eq!(fences.table(), "\"shop_fences\"");
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_PREFIX` for a prefix that cannot
    /// name a table (the lock backend's rule).
    pub fn new(prefix: &str) -> Result<Self> {
        check_prefix(prefix)?;
        let table = format!("\"{prefix}_fences\"");
        Ok(Fences {
            create: format!("CREATE TABLE IF NOT EXISTS {table} (resource text PRIMARY KEY, token bigint NOT NULL)"),
            // The pin in VALUES: computed whether it inserts or updates.
            check: format!(
                "INSERT INTO {table} AS f (resource, token) VALUES ($1, {}) \
                 ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token WHERE f.token <= EXCLUDED.token \
                 RETURNING f.token",
                durable::after_pin("$2::bigint")
            ),
            newest: format!("SELECT token FROM {table} WHERE resource = $1"),
            table,
        })
    }

    /// The table's name, quoted, for your own statements (say, deleting
    /// the fences of a resource whose lock moved to another backend).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the table when it is missing; safe to call from every
    /// process at start-up.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the server cannot be reached or refuses the
    /// statement (a user without `CREATE` on the schema: create the table
    /// once as one who has it).
    pub async fn create(&self, pool: &PgPool) -> Result<()> {
        let mut conn = pool.acquire().await.map_err(|e| failed("creating the fences table", e))?;
        let objects = Objects { what: "creating the fences table", schema: self.create.clone(), functions: Vec::new() };
        install(&mut conn, &objects, PostgresOptions::default().response_timeout()).await
    }

    /// Checks `token` for `resource` on `conn`, the transaction that then
    /// reads and writes the resource: records it when it is at least every
    /// earlier token (the same holder may check twice), locks the
    /// resource's fence until the transaction ends, and makes its commit
    /// durable. Call it before reading what you will write.
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a higher token was checked before: a newer
    /// holder has the lock; roll the transaction back (dropping it does).
    /// [`Error::InvalidArgument`] for a token above `i64::MAX` (no dlock
    /// backend hands one out). [`Error::Backend`] when the statement fails;
    /// the transaction is then aborted too.
    ///
    /// # Cancellation safety
    ///
    /// Dropping the future may leave the statement running on the
    /// connection; drop the transaction with it, which rolls it back.
    pub async fn check(&self, conn: &mut PgConnection, resource: &str, token: u64) -> Result<()> {
        let signed = i64::try_from(token)
            .map_err(|_| Error::invalid_argument("token", format!("{token} does not fit PostgreSQL's bigint")))?;
        let accepted: Option<i64> = sqlx::query_scalar(&self.check)
            .bind(resource)
            .bind(signed)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| failed("checking a fencing token", e))?;
        if accepted.is_some() {
            return Ok(());
        }
        // Reads what is committed now: at least the token that refused ours.
        let newest: Option<i64> = sqlx::query_scalar(&self.newest)
            .bind(resource)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| failed("reading a fence", e))?;
        let newest = newest.and_then(|n| u64::try_from(n).ok()).unwrap_or(token);
        Err(Error::StaleToken { resource: resource.to_owned(), token, newest })
    }
}

fn failed(what: &str, e: sqlx::Error) -> Error {
    Error::Backend { backend: BACKEND, message: format!("{what}: {e}"), source: Some(Box::new(e)) }
}
