//! The PostgreSQL client layer: connecting ([`PostgresOptions`], the pool),
//! sending a request and sending it again when its answer was lost
//! ([`Db`], on connections kept between requests), pinning each commit
//! durable (`durable`), telling PostgreSQL's errors apart (`error`), and
//! installing dlock's objects ([`install`]).
//!
//! The lock backend (`backend/postgres/`), the idempotency store
//! (`idempotency/postgres/`) and the fences (`fence/postgres.rs`) sit on
//! it; it imports none of them. `docs/postgres-design.md` has the reasons.

mod connections;
mod db;
mod doubt;
pub(crate) mod durable;
mod error;
mod options;
mod schema;

pub(crate) use db::{column, Db, Repeat};
pub(crate) use doubt::Doubt;
pub(crate) use error::{unexpected, within};
pub use options::PostgresOptions;
pub(crate) use options::{connect_options, pool};
#[cfg(test)]
pub(crate) use schema::MAX_PREFIX;
pub(crate) use schema::{check_prefix, ddl_timeout, install, Objects};

/// The backend's name in errors (`Error::Backend { backend: "postgres" }`).
pub(crate) const BACKEND: &str = "postgres";
/// The variable that names the server, for configuration errors.
pub(crate) const URL_VAR: &str = "DLOCK_POSTGRES_URL";
