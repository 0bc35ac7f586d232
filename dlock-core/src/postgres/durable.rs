//! Every statement dlock answers on commits to disk before it is answered,
//! whatever the server's `synchronous_commit`: each pins the setting for its
//! own transaction (`SET LOCAL`, raised from `off` to `on` only), inside the
//! statement so that it holds through a transaction-mode pooler. Why there,
//! and not per connection or in a function's `SET` clause:
//! `docs/postgres-design.md`.

use std::time::Duration;

use sqlx::postgres::PgConnection;

use super::error::{connect_error, connection_ended, pooler_hint};
use super::{BACKEND, URL_VAR};
use crate::error::{Error, Result};

/// An expression that makes the current transaction's commit durable
/// (never NULL), for a statement's `WHERE` or through [`after_pin`].
/// Schema-qualified, so that nothing earlier in a `search_path` stands in.
pub(crate) const PIN: &str = "pg_catalog.set_config('synchronous_commit', \
     CASE pg_catalog.current_setting('synchronous_commit') WHEN 'off' THEN 'on' \
     ELSE pg_catalog.current_setting('synchronous_commit') END, true)";

/// `expr`, evaluated after the pin: a function's first argument (evaluated
/// before its body runs) or a value of an `INSERT` (computed either way).
pub(crate) fn after_pin(expr: &str) -> String {
    format!("CASE WHEN {PIN} IS NOT NULL THEN {expr} END")
}

/// What [`pin`] is, for its errors.
const WHAT: &str = "pinning synchronous_commit";

/// Pins the setting on `conn` for its current transaction, refusing at
/// start-up a server that does not let it (not PostgreSQL, or one whose
/// `synchronous_commit` stays `off`).
pub(crate) async fn pin(conn: &mut PgConnection, timeout: Duration) -> Result<()> {
    let sql = format!("SELECT {PIN}");
    let query = sqlx::query_scalar::<_, String>(&sql).fetch_one(&mut *conn);
    let in_force = match tokio::time::timeout(timeout, query).await {
        Ok(Ok(value)) => value,
        // A pooler that lends the session on without its prepared
        // statements fails the check before any setting is tried: say so.
        Ok(Err(sqlx::Error::Database(db))) if pooler_hint(&*db).is_some() => {
            // Asked twice: a guard that binds (`if let`) needs Rust 1.95.
            let hint = pooler_hint(&*db).unwrap_or_default();
            return Err(Error::config(URL_VAR, format!("dlock's durability check failed: {}; {hint}", db.message())));
        }
        // The server refused the setting itself (say, "unrecognized
        // configuration parameter" from a server that is not PostgreSQL).
        Ok(Err(sqlx::Error::Database(db))) if !connection_ended(&*db) => return Err(refused(db.message())),
        Ok(Err(e)) => return Err(connect_error(e, WHAT)),
        Err(_) => return Err(Error::backend(BACKEND, format!("{WHAT}: PostgreSQL did not answer within {timeout:?}"))),
    };
    if in_force == "off" {
        return Err(refused("it is still `off` after `SET LOCAL synchronous_commit = on`"));
    }
    Ok(())
}

fn refused(why: &str) -> Error {
    Error::config(
        URL_VAR,
        format!(
            "dlock cannot pin `synchronous_commit` for its statements' transactions ({why}): without it, a grant \
             or an idempotency record could be answered before it is on disk and lost in a server crash; use \
             PostgreSQL, with a user that may set `synchronous_commit`"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pin_only_raises_off_and_only_for_the_transaction() {
        assert!(PIN.contains("WHEN 'off' THEN 'on' ELSE pg_catalog.current_setting('synchronous_commit')"), "{PIN}");
        assert!(PIN.ends_with(", true)"), "local to the transaction: {PIN}");
        assert!(after_pin("$1::text").ends_with("THEN $1::text END"));
    }

    #[test]
    fn a_server_that_refuses_the_pin_is_a_configuration_error_naming_it() {
        let err = refused("unrecognized configuration parameter \"synchronous_commit\"");
        assert!(matches!(err, Error::Config { var: "DLOCK_POSTGRES_URL", .. }), "{err:?}");
        assert!(err.to_string().contains("`synchronous_commit`"), "{err}");
    }
}
