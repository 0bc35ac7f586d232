//! A route's transaction begun on the store's pool, within the store's
//! bound and safe to cancel.

use sqlx::Postgres;
use tokio::sync::oneshot;

use super::PostgresStore;
use crate::error::{Error, Result};

impl PostgresStore {
    /// Begins a transaction on the store's [`pool`](Self::pool), for a
    /// route whose key [`begin_in`](Self::begin_in) then claims in it;
    /// waits at most the store's [`response_timeout`](Self::response_timeout).
    ///
    /// Cancel-safe, unlike `Pool::begin` on PostgreSQL in sqlx 0.8: cut
    /// between sending `BEGIN` and reading its answer, that hands the
    /// connection back to the pool inside a transaction nobody will end
    /// (upstream sqlx#4393). Here the `BEGIN` runs on a task of its own and
    /// is never cut; the bound, or dropping this future, only stops waiting
    /// for it, and a transaction begun after nobody waits is rolled back by
    /// that task before its connection goes back.
    ///
    /// ```no_run
    /// # async fn demo(store: dlock_core::idempotency::PostgresStore) -> dlock_core::Result<()> {
    /// let mut tx = store.begin_transaction().await?;
    /// sqlx::query("SELECT 1").execute(&mut *tx).await.ok();
    /// tx.commit().await.ok();
    /// # Ok(()) }
    /// ```
    pub async fn begin_transaction(&self) -> Result<sqlx::Transaction<'static, Postgres>> {
        let bound = self.response_timeout();
        let (answer, begun) = oneshot::channel();
        let pool = self.pool().clone();
        tokio::spawn(async move {
            if let Err(Ok(late)) = answer.send(pool.begin().await) {
                // A rollback that fails leaves nothing either: the server
                // ends the transaction with its connection.
                let _ = late.rollback().await;
            }
        });
        match tokio::time::timeout(bound, begun).await {
            Ok(Ok(Ok(tx))) => Ok(tx),
            Ok(Ok(Err(e))) => Err(Error::Backend {
                backend: "postgres",
                message: format!("cannot begin the route's transaction: {e}"),
                source: Some(Box::new(e)),
            }),
            // The runtime is shutting down under the task.
            Ok(Err(_)) => Err(Error::backend("postgres", "the route's transaction was not begun")),
            Err(_) => Err(Error::backend("postgres", format!("no transaction within {bound:?}"))),
        }
    }
}
