//! The store's tables and functions, made when missing: when the store is
//! made, or, for the store a runtime keeps beside PostgreSQL locks
//! ([`Config::build`](crate::Config::build)), on its first use. A service
//! whose routes keep their records elsewhere (their own
//! [`PostgresStore::with_pool`](super::PostgresStore::with_pool) in the
//! application's database) never asks that store for a record, and gets no
//! `<prefix>_idem_*` tables it would have to carry and migrate.

use std::time::Duration;

use tokio::sync::OnceCell;

use crate::error::Result;
use crate::postgres::{install, within, Db, Objects};

/// The objects of one prefix, and whether this store made (or found) them.
pub(super) struct Tables {
    objects: Objects,
    made: OnceCell<()>,
}

impl Tables {
    pub(super) fn new(objects: Objects) -> Self {
        Tables { objects, made: OnceCell::new() }
    }

    /// Makes them on `db` when missing, once: the requests that come while
    /// it runs wait for it, and the first after a failure (a server away,
    /// a user without `CREATE`) tries again, so a failure is reported to
    /// the request that met it and is not kept. `then` runs once they are
    /// made (the upkeep, which works on them, starts there).
    pub(super) async fn make(&self, db: &Db, then: impl FnOnce()) -> Result<()> {
        self.made
            .get_or_try_init(|| async {
                create(db, &self.objects).await.inspect_err(|e| {
                    tracing::warn!(error = %e, "dlock: the PostgreSQL idempotency tables could not be made");
                })?;
                then();
                Ok(())
            })
            .await
            .map(|_| ())
    }
}

/// Creates `objects` on a connection of `db`'s pool taken for it alone and
/// closed after (its session ran DDL and set its own settings; the pool's
/// next user must not inherit them).
async fn create(db: &Db, objects: &Objects) -> Result<()> {
    let connecting = db.response_timeout.max(Duration::from_secs(10));
    let mut conn = within(connecting, "connecting", db.pool.acquire()).await?.detach();
    let installed = install(&mut conn, objects, db.response_timeout).await;
    let _ = sqlx::Connection::close(conn).await;
    installed
}
