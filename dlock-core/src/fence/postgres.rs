//! Fencing inside a PostgreSQL transaction: a table of the highest token
//! seen per resource, checked by the first statement of the transaction
//! that writes the resource.
//!
//! The table `<prefix>_fences (resource text primary key, token bigint)`
//! is created by [`Fences::create`] when missing (idempotent, under the
//! same advisory lock as the lock backend's schema, so processes starting
//! at once do not race on the catalog). [`Fences::check`] runs
//!
//! ```sql
//! INSERT INTO <prefix>_fences AS f (resource, token)
//!   VALUES ($1, CASE WHEN <pin> IS NOT NULL THEN $2 END)
//! ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token
//!   WHERE f.token <= EXCLUDED.token
//! RETURNING f.token
//! ```
//!
//! and answers [`Error::StaleToken`] when it returns no row. `<pin>` is
//! `set_config('synchronous_commit', …, true)`, see below.
//!
//! # Durable whatever the server's `synchronous_commit`
//!
//! The check makes the transaction it runs in commit durably: it sets
//! `synchronous_commit` to `on` for that transaction (`SET LOCAL`) when
//! the server, database or role has it `off`, and leaves any other value
//! as it is. Under `off`, PostgreSQL answers a commit before its WAL is
//! written, and a crash in the next few hundred milliseconds forgets it:
//! a fence forgotten lets an older holder's write through after a newer
//! holder was told its own had committed. So a fenced transaction waits
//! for its WAL to be written like any transaction under the default
//! setting; the application's other transactions keep the server's. The
//! setting is the transaction's, not the connection's, so it holds through
//! a transaction-mode pooler (PgBouncer) too. What a crash and a failover
//! keep is the lock backend's promise: see
//! [`LockGuard::fencing_token`](crate::LockGuard::fencing_token).
//!
//! # Why it is safe under READ COMMITTED
//!
//! The statement locks the resource's row (inserted, updated, or — when the
//! `WHERE` fails — locked all the same) until the transaction ends. So the
//! transactions that write a resource run their fenced part one at a time,
//! in the order of their checks. Take an old holder A (token a) and a new
//! one B (token b > a):
//!
//! * A checks first: A passes; B's check waits for A's transaction to end,
//!   then passes, and B's later statements (each one reads what is
//!   committed when it starts) see A's writes. A ran entirely before B.
//! * B checks first: the row holds b; A's check waits for B's transaction
//!   to end and is evaluated against the row as B left it (PostgreSQL
//!   re-reads the newest version of a conflicting row): b > a, refused. If
//!   B rolled back, B wrote nothing, and A may go on.
//!
//! Either way no write of A lands after B has read. Three conditions:
//! check **before** reading what you write (a read earlier in the
//! transaction may see a state B is about to replace); every writer of the
//! resource checks; check and writes are in **one** transaction. Under
//! REPEATABLE READ or SERIALIZABLE the same race ends in a serialization
//! failure (`40001`, an [`Error::Backend`] here): retry the transaction.
//!
//! A holder paused **inside** its transaction keeps the row locked, and the
//! next holder's check waits for it (its transaction is ordered first, and
//! may still commit). Bound that wait with `lock_timeout` on the writers'
//! connections, and end abandoned transactions with
//! `idle_in_transaction_session_timeout`.
//!
//! # A guarded update instead
//!
//! A write that is a single statement on a row of your own can carry the
//! token in the row itself: add `fence bigint NOT NULL DEFAULT 0` and write
//!
//! ```sql
//! UPDATE products SET stock = $1, fence = $2 WHERE id = $3 AND fence <= $2
//! ```
//!
//! No row updated means a newer holder has written it: answer
//! [`Error::StaleToken`]. It needs no fences table, but protects only that
//! statement's row: a read-modify-write across statements, or writes to
//! several tables, need [`Fences::check`].

use sqlx::postgres::{PgConnection, PgPool};

use crate::backend::postgres::durable;
use crate::backend::postgres::{check_prefix, install, Objects, PostgresOptions};
use crate::error::{Error, Result};

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
            // The pin in VALUES, which are computed whether the row is
            // inserted or updates the one there.
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

    /// Creates the table when it is missing, in a transaction that takes
    /// dlock's schema advisory lock first. Safe to call from every process
    /// at start-up.
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

    /// Checks `token` for `resource` on `conn`, which should be the
    /// transaction that then reads and writes the resource (`&mut tx`):
    /// records it as the highest token seen when it is at least as high as
    /// every earlier one (the same holder may check twice), and locks the
    /// resource's fence until the transaction ends, and makes the
    /// transaction commit durably even on a server with
    /// `synchronous_commit = off`. Call it before reading what you will
    /// write (see the [module](self) docs).
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
        // This statement reads what is committed now: at least the token
        // that refused ours.
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
