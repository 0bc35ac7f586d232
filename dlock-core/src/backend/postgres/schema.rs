//! The lock table's names and statements: the objects of one prefix
//! ([`Names`]), made at connect when missing, and how the table writes a
//! mode.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection as _;

use super::LockMode;
use crate::error::{Error, Result};
use crate::postgres::{check_prefix, ddl_timeout, durable, install, within, Objects};

const SCHEMA_SQL: &str = include_str!("schema.sql");
pub(super) const TAKE_SQL: &str = include_str!("take.sql");
const ACQUIRE_SQL: &str = include_str!("acquire.sql");
pub(super) const RELEASE_SQL: &str = include_str!("release.sql");
const RELEASE_ANY_SQL: &str = include_str!("release_any.sql");
const RENEW_SQL: &str = include_str!("renew.sql");

/// The names of one prefix's objects, quoted.
pub(super) struct Names {
    locks: String,
    holders: String,
    fence: String,
    pub(super) acquire: String,
    pub(super) release: String,
    pub(super) renew: String,
    /// Unquoted: `LISTEN` quotes it, `pg_notify` takes it as text.
    pub(super) channel: String,
    /// As given (its characters need no quoting in a string literal): the
    /// first key of the advisory lock each grant of a key draws its token
    /// under is its hash, so prefixes do not wait for each other.
    prefix: String,
}

impl Names {
    pub(super) fn for_prefix(prefix: &str) -> Result<Self> {
        check_prefix(prefix)?;
        Ok(Names {
            locks: format!("\"{prefix}_locks\""),
            holders: format!("\"{prefix}_holders\""),
            fence: format!("\"{prefix}_fence\""),
            acquire: format!("\"{prefix}_acquire_v5\""),
            release: format!("\"{prefix}_release_v3\""),
            renew: format!("\"{prefix}_renew_v1\""),
            channel: format!("{prefix}_released"),
            prefix: prefix.to_owned(),
        })
    }

    /// `sql` with the placeholders of the `.sql` files filled in.
    pub(super) fn fill(&self, sql: &str) -> String {
        sql.replace("{locks}", &self.locks)
            .replace("{holders}", &self.holders)
            .replace("{fence_text}", &self.fence)
            .replace("{fence}", &self.fence)
            .replace("{acquire}", &self.acquire)
            .replace("{release}", &self.release)
            .replace("{renew}", &self.renew)
            .replace("{channel_text}", &self.channel)
            .replace("{prefix_text}", &self.prefix)
            .replace("{durable}", durable::PIN)
    }
}

/// The acquire function's `CREATE` for `names` (with the test-only broken
/// variants applied when a harness turned one on).
fn acquire_function(names: &Names) -> String {
    let sql = names.fill(ACQUIRE_SQL);
    #[cfg(feature = "broken-variants")]
    let sql = crate::broken_variants::acquire_function(&sql);
    sql
}

/// Creates the table, the sequence and the functions of `names` when they
/// are missing, on a connection of its own.
pub(super) async fn create_schema(connect: &PgConnectOptions, names: &Names, timeout: Duration) -> Result<()> {
    let objects = Objects {
        what: "creating the lock table",
        schema: names.fill(SCHEMA_SQL),
        functions: vec![
            (names.acquire.clone(), acquire_function(names)),
            (names.release.clone(), names.fill(RELEASE_ANY_SQL)),
            (names.renew.clone(), names.fill(RENEW_SQL)),
        ],
    };
    let mut conn = within(ddl_timeout(timeout), "connecting", PgConnection::connect_with(connect)).await?;
    let mut result = install(&mut conn, &objects, timeout).await;
    if result.is_ok() {
        result = check_shape(&mut conn, names, timeout).await;
    }
    let _ = conn.close().await;
    result
}

/// Refuses a lock table of an earlier shape, keyed on `(key, owner)` (a
/// development build of dlock made it): `CREATE TABLE IF NOT EXISTS` kept
/// it, and every first try at a lock would fail on it.
async fn check_shape(conn: &mut PgConnection, names: &Names, timeout: Duration) -> Result<()> {
    let keyed_on_key: bool = within(
        timeout,
        "checking the lock table",
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = to_regclass($1) AND indisprimary AND indnatts = 1)",
        )
        .bind(names.locks.as_str())
        .fetch_one(&mut *conn),
    )
    .await?;
    if keyed_on_key {
        return Ok(());
    }
    Err(Error::config(
        "DLOCK_PREFIX",
        format!(
            "the table {} was made by an earlier dlock (its primary key is not the key alone): drop it while no lock \
             is held, or choose another prefix",
            names.locks
        ),
    ))
}

/// How the table writes a mode.
pub(super) fn mode_text(mode: LockMode) -> String {
    match mode {
        LockMode::Exclusive => "x".into(),
        LockMode::Shared => "s".into(),
        LockMode::Permits { limit } => format!("p{limit}"),
    }
}

pub(super) fn parse_mode(text: &str) -> Option<LockMode> {
    match text {
        "x" => Some(LockMode::Exclusive),
        "s" => Some(LockMode::Shared),
        _ => text.strip_prefix('p')?.parse().ok().map(|limit| LockMode::Permits { limit }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::MAX_PREFIX;

    #[test]
    fn modes_round_trip_through_their_text() {
        for mode in [LockMode::Exclusive, LockMode::Shared, LockMode::permits(1), LockMode::permits(40)] {
            assert_eq!(parse_mode(&mode_text(mode)), Some(mode));
        }
        assert_eq!(parse_mode("q"), None);
        assert_eq!(parse_mode("p-1"), None);
    }

    #[test]
    fn prefixes_that_cannot_name_a_table_are_refused() {
        assert!(Names::for_prefix("dlock").is_ok());
        assert!(Names::for_prefix("orders.v2:eu-1").is_ok());
        for bad in ["a\"b", "a'b", "a$b", &"x".repeat(MAX_PREFIX + 1)] {
            let err = Names::for_prefix(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("DLOCK_PREFIX"), "{bad}: {err}");
        }
    }

    #[test]
    fn placeholders_are_all_filled() {
        let names = Names::for_prefix("p").expect("valid");
        for sql in [SCHEMA_SQL, TAKE_SQL, ACQUIRE_SQL, RELEASE_SQL, RELEASE_ANY_SQL, RENEW_SQL] {
            let filled = names.fill(sql);
            assert!(!filled.contains('{') && !filled.contains('}'), "{filled}");
        }
    }
}
