//! PostgreSQL's errors as dlock's: a request refused, its answer lost, a
//! start-up that failed (refused credentials and missing privileges are
//! the configuration's), a pooler that dlock cannot work through.

use std::time::Duration;

use super::{BACKEND, URL_VAR};
use crate::error::{Error, Result};

/// The server ended the session (a shutdown, a crash, an administrator):
/// SQLSTATE classes 57 (operator intervention) and 08 (connection
/// exception). The connection is gone, whatever the request did.
pub(crate) fn connection_ended(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.code().is_some_and(|code| code.starts_with("57P") || code.starts_with("08"))
}

/// Why the answer to a sent request never came.
#[derive(Debug)]
pub(crate) enum LostAnswer {
    Failed(sqlx::Error),
    TimedOut(Duration),
}

impl std::fmt::Display for LostAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LostAnswer::Failed(e) => write!(f, "the connection to PostgreSQL failed during a request: {e}"),
            LostAnswer::TimedOut(after) => write!(f, "PostgreSQL did not answer within {after:?}"),
        }
    }
}

impl LostAnswer {
    /// The error it is, its connection's error as the source; the caller
    /// marks it as one whose request may have run.
    pub(crate) fn into_error(self) -> Error {
        let message = self.to_string();
        let source: Option<Box<dyn std::error::Error + Send + Sync>> = match self {
            LostAnswer::Failed(e) => Some(Box::new(e)),
            LostAnswer::TimedOut(_) => None,
        };
        Error::Backend { backend: BACKEND, message, source }
    }
}

/// What to change when the error is a pooler's between dlock and the
/// server, set in a way dlock cannot work through (the first two of the
/// pooler's conditions in `docs/postgres-design.md`); `None` for any other error.
pub(crate) fn pooler_hint(db: &dyn sqlx::error::DatabaseError) -> Option<&'static str> {
    // PgBouncer's words for a startup parameter it was not told about.
    if db.message().starts_with("unsupported startup parameter") {
        return Some(
            "a pooler (PgBouncer) refused a parameter dlock sends at connect: list `extra_float_digits, \
             statement_timeout` in its `ignore_startup_parameters`, and bound statements on the server instead \
             (`ALTER ROLE … SET statement_timeout`)",
        );
    }
    // duplicate_prepared_statement, invalid_sql_statement_name: another
    // client's statement of the same name, or none, on the server session.
    matches!(db.code().as_deref(), Some("42P05" | "26000")).then_some(
        "a pooler in transaction mode lent this session to another client and does not keep prepared statements: \
         use PgBouncer 1.21 or later with `max_prepared_statements` above 0 (or session mode)",
    )
}

/// An error of a request that did nothing on the server.
pub(crate) fn not_sent(e: sqlx::Error) -> Error {
    let message = match &e {
        sqlx::Error::Database(db) => match pooler_hint(db.as_ref()) {
            Some(hint) => format!("PostgreSQL refused a request: {}; {hint}", db.message()),
            None => format!("PostgreSQL refused a request: {}", db.message()),
        },
        other => format!("cannot reach PostgreSQL: {other}"),
    };
    Error::Backend { backend: BACKEND, message, source: Some(Box::new(e)) }
}

pub(crate) fn unexpected(what: &str) -> Error {
    Error::backend(BACKEND, format!("unexpected answer from the acquire function: {what}"))
}

/// `future` within `timeout`, its errors as backend errors (it runs before
/// any lock is asked for, so none leaves a request half done).
pub(crate) async fn within<T>(
    timeout: Duration,
    what: &str,
    future: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, future).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(connect_error(e, what)),
        Err(_) => Err(Error::backend(BACKEND, format!("{what}: PostgreSQL did not answer within {timeout:?}"))),
    }
}

/// A start-up error: refused credentials and missing privileges are the
/// configuration's, the rest the server's.
pub(crate) fn connect_error(e: sqlx::Error, what: &str) -> Error {
    if let sqlx::Error::Database(db) = &e {
        match db.code().as_deref() {
            // invalid_password, invalid_authorization_specification
            Some("28P01" | "28000") => {
                return Error::config(URL_VAR, format!("{what}: the server refused the credentials: {}", db.message()))
            }
            // insufficient_privilege
            Some("42501") => {
                return Error::config(
                    URL_VAR,
                    format!(
                        "{what}: the user may not create or use the lock table ({}); grant it CREATE on the schema, \
                         or create the objects once as a user who may",
                        db.message()
                    ),
                )
            }
            // invalid_catalog_name: no such database
            Some("3D000") => return Error::config(URL_VAR, format!("{what}: {}", db.message())),
            _ => {}
        }
        if let Some(hint) = pooler_hint(db.as_ref()) {
            return Error::config(URL_VAR, format!("{what}: {}; {hint}", db.message()));
        }
    }
    Error::Backend { backend: BACKEND, message: format!("{what}: {e}"), source: Some(Box::new(e)) }
}
