//! Installing dlock's objects in a database: [`Objects`] made when
//! missing, one process at a time ([`install`]), and the prefix rule that
//! their names follow ([`check_prefix`]).

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{Connection as _, Executor as _};

use super::{durable, within};
use crate::backend::BoxFuture;
use crate::error::{Error, Result};

/// The first key of the advisory lock ("dloc", second key 0) that makes
/// the schema (and the fences table) one process at a time.
const LOCK_CLASS: i32 = 0x646c_6f63;
/// The longest prefix: the longest name made of it (`_acquire_v5`) must fit
/// PostgreSQL's 63 bytes, or it would be cut and collide.
pub(crate) const MAX_PREFIX: usize = 48;

/// Refuses a prefix that cannot name dlock's objects: quoted names of at
/// most 63 bytes, the longest suffix included.
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
    if prefix.len() > MAX_PREFIX || !prefix.chars().all(allowed) {
        return Err(Error::config(
            "DLOCK_PREFIX",
            format!(
                "names the PostgreSQL tables, sequence and channel: at most {MAX_PREFIX} ASCII letters, digits, \
                 `_`, `-`, `.` or `:`"
            ),
        ));
    }
    Ok(())
}

/// DDL can wait behind a lock of another process's DDL: more time than a
/// request, still bounded.
pub(crate) fn ddl_timeout(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(10))
}

/// Tables and functions dlock keeps in a database: the lock backend's, or
/// the idempotency store's.
pub(crate) struct Objects {
    /// What creating them is, for errors ("creating the lock table").
    pub(crate) what: &'static str,
    /// Idempotent DDL (`CREATE … IF NOT EXISTS`).
    pub(crate) schema: String,
    /// Each function's quoted name and its `CREATE FUNCTION`.
    pub(crate) functions: Vec<(String, String)>,
}

/// Creates `objects` when missing, in one transaction under a fixed
/// advisory lock, so two processes starting at once do not race.
pub(crate) async fn install(conn: &mut PgConnection, objects: &Objects, timeout: Duration) -> Result<()> {
    // Refused here, with the setting named, rather than at every request.
    durable::pin(conn, timeout).await?;
    let timeout = ddl_timeout(timeout);
    let mut result = within(timeout, objects.what, create_objects(conn, objects)).await;
    if let Err(Error::Backend { source: Some(source), .. }) = &result {
        // A catalog race lost despite the lock: a second try finds it made.
        let raced = source.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()).and_then(|db| db.code());
        if matches!(raced.as_deref(), Some("23505" | "42P07" | "42723" | "XX000")) {
            result = within(timeout, objects.what, create_objects(conn, objects)).await;
        }
    }
    result
}

/// Boxed: sqlx's executor on `&mut` connections trips the compiler's
/// proof that an unboxed future of it is `Send`, and `connect` must be.
fn create_objects<'a>(
    conn: &'a mut PgConnection,
    objects: &'a Objects,
) -> BoxFuture<'a, std::result::Result<(), sqlx::Error>> {
    Box::pin(async move {
        let mut tx = conn.begin().await?;
        let c: &mut PgConnection = &mut tx;
        // Its commit durable too, and no `… IF NOT EXISTS` notices, which
        // sqlx would log at every start.
        let first = format!("SELECT pg_advisory_xact_lock($1, 0), {}, {QUIET}", durable::PIN);
        sqlx::query(&first).bind(LOCK_CLASS).execute(&mut *c).await?;
        c.execute(sqlx::raw_sql(&objects.schema)).await?;
        // Each function is created only when missing: its name carries its
        // version, and replacing it would need the privileges of its owner.
        for (name, sql) in &objects.functions {
            let missing: bool =
                sqlx::query_scalar("SELECT to_regproc($1) IS NULL").bind(name.as_str()).fetch_one(&mut *c).await?;
            if missing {
                c.execute(sqlx::raw_sql(sql.as_str())).await?;
            }
        }
        tx.commit().await
    })
}

/// Keeps the DDL's notices ("relation … already exists, skipping") from
/// the client for its transaction; warnings and errors still come.
const QUIET: &str = "set_config('client_min_messages', 'warning', true)";
