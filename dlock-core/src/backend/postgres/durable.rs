//! Every statement dlock answers on commits to disk before it is answered,
//! whatever the server's `synchronous_commit`.
//!
//! With `synchronous_commit = off` (for the server, a database or a role: a
//! common throughput setting), PostgreSQL answers a commit before its WAL
//! is written, and a crash within the next `3 × wal_writer_delay` forgets
//! the transaction, its `nextval` included. A grant forgotten that way lets
//! a second client take the key while the first still holds it, with the
//! same fencing token; an idempotency record forgotten runs its route
//! again. So each such statement pins the setting for its own transaction:
//! `set_config('synchronous_commit', …, true)` is `SET LOCAL`, and
//! PostgreSQL decides a commit's durability by the value in force when it
//! commits, so the statement's implicit transaction (or the route's own
//! transaction, for the statements dlock runs inside it) commits durably.
//!
//! Why inside the statement and not per connection: a transaction-mode
//! pooler (PgBouncer) lends a server session per transaction and ignores
//! or refuses a client's startup parameters, so a setting sent at connect
//! does not reach the session a statement runs on; a `SET LOCAL` in the
//! statement's own transaction does, and ends with it (nothing leaks to the
//! pooler's next client). Why not a function's `SET synchronous_commit`
//! clause: PostgreSQL restores the value when the function returns, before
//! the commit, which is then as asynchronous as before
//! (tests/postgres_async_commit.rs, the crash emulation's own test: such a
//! row is lost).
//!
//! Why in the statements dlock sends and not in its functions' bodies: a
//! function is created only when missing (its name carries its version),
//! so a database keeps the bodies an earlier dlock made; a call pins its
//! transaction whatever body it runs. Plain statements carry the pin in
//! their filter (`{durable}` in the `.sql` files), which every row they
//! write has passed; calls carry it before their first argument
//! ([`after_pin`]). The sweeps and the store's tallies are not pinned:
//! nothing is answered on them, and a crash that forgets one only means it
//! is done again. The pin costs a few function calls in the statement, no
//! round trip; the commit's wait for its WAL is the price of durability,
//! paid under the default setting anyway.
//!
//! The value is raised only from `off`, to `on`: `local`, `remote_write`,
//! `on` and `remote_apply` all make the local commit durable, and the
//! stronger ones are the operator's choice for failovers, kept as they are.

use std::time::Duration;

use sqlx::postgres::PgConnection;

use super::{connect_error, connection_ended, BACKEND, URL_VAR};
use crate::error::{Error, Result};

/// An expression that makes the current transaction's commit durable (it
/// returns the value now in force, never NULL): in a statement's `WHERE`,
/// which every row the statement writes has passed, or before a function's
/// first argument or a value ([`after_pin`]). Schema-qualified, so that no
/// function of the same name earlier in a `search_path` stands in for it.
pub(crate) const PIN: &str = "pg_catalog.set_config('synchronous_commit', \
     CASE pg_catalog.current_setting('synchronous_commit') WHEN 'off' THEN 'on' \
     ELSE pg_catalog.current_setting('synchronous_commit') END, true)";

/// `expr`, evaluated after the pin: as a function's first argument
/// (arguments are evaluated before the function body runs, whatever it
/// returns, so the pin does not depend on the rows it answers), or as a
/// value of an `INSERT` (computed whether it inserts or updates).
pub(crate) fn after_pin(expr: &str) -> String {
    format!("CASE WHEN {PIN} IS NOT NULL THEN {expr} END")
}

/// What [`pin`] is, for its errors.
const WHAT: &str = "pinning synchronous_commit";

/// Pins the setting on `conn` for its current transaction, and refuses a
/// server that does not let it (a server that is not PostgreSQL, or one
/// whose `synchronous_commit` stays `off`): every statement dlock answers
/// on would fail, or be answered before it is durable. Run at start-up,
/// before the schema's transaction (which pins its own commit too).
pub(crate) async fn pin(conn: &mut PgConnection, timeout: Duration) -> Result<()> {
    let sql = format!("SELECT {PIN}");
    let query = sqlx::query_scalar::<_, String>(&sql).fetch_one(&mut *conn);
    let in_force = match tokio::time::timeout(timeout, query).await {
        Ok(Ok(value)) => value,
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
