//! The request path: [`Db`] sends a statement on a kept (or pooled)
//! connection within the response timeout, and sends it again on another
//! connection when its answer was lost and [`Repeat`] allows it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt as _;
use sqlx::postgres::{PgArguments, PgPool, PgRow};
use sqlx::{Executor as _, Postgres, Row as _};

use super::connections::{Connections, Lent};
use super::doubt::Doubt;
use super::error::{connection_ended, not_sent, unexpected, LostAnswer};
use super::BACKEND;
use crate::error::{Error, Result};

/// Whether a request may be sent again after its answer was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Sending it twice does what sending it once does.
    Safe,
    /// Once only (a release: a second one would answer "not held").
    Once,
}

/// A pool of connections to one server and the bound on each request,
/// shared by the lock backend and the
/// [`PostgresStore`](crate::idempotency::PostgresStore).
#[derive(Debug, Clone)]
pub(crate) struct Db {
    pub(crate) pool: PgPool,
    pub(crate) response_timeout: Duration,
    /// Connections kept between requests (the lock backend's pool), or
    /// none: each request's connection goes back to the pool.
    kept: Option<Arc<Connections>>,
}

impl Db {
    /// Requests on `pool`'s connections, each given back after it.
    pub(crate) fn new(pool: PgPool, response_timeout: Duration) -> Self {
        Db { pool, response_timeout, kept: None }
    }

    /// Requests on connections kept between them (`connections.rs`).
    pub(crate) fn keeping(pool: PgPool, response_timeout: Duration) -> Self {
        let kept = Some(Arc::new(Connections::for_pool(&pool)));
        Db { pool, response_timeout, kept }
    }

    /// A connection, within the response timeout. Nothing was sent when
    /// this fails.
    async fn conn(&self) -> Result<Lent<'_>> {
        let lent = async {
            match &self.kept {
                Some(kept) => kept.lend(&self.pool).await,
                None => self.pool.acquire().await.map(Lent::pooled),
            }
        };
        match tokio::time::timeout(self.response_timeout, lent).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => Err(Error::backend(
                BACKEND,
                format!("no connection to PostgreSQL within {:?} (is the server up?)", self.response_timeout),
            )),
            Ok(Err(e)) => Err(not_sent(e)),
        }
    }

    /// The first row of [`fetch_all`](Self::fetch_all).
    pub(crate) async fn fetch<'q, F>(&self, make: F, repeat: Repeat) -> Result<Option<PgRow>>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        self.fetch_doubting(make, repeat, &Doubt::default()).await
    }

    /// [`fetch`](Self::fetch) as one step of a request of several
    /// statements: a lost answer is noted in `doubt`, and once it holds
    /// one, every error carries it.
    pub(crate) async fn fetch_doubting<'q, F>(&self, make: F, repeat: Repeat, doubt: &Doubt) -> Result<Option<PgRow>>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        Ok(self.send(make, repeat, doubt).await?.rows.into_iter().next())
    }

    /// The rows of the query `make` builds, sent again on another
    /// connection when its answer was lost and `repeat` allows it.
    pub(crate) async fn fetch_all<'q, F>(&self, make: F, repeat: Repeat) -> Result<Vec<PgRow>>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        Ok(self.send(make, repeat, &Doubt::default()).await?.rows)
    }

    /// How many rows the statement `make` builds changed (its command tag:
    /// no `RETURNING`). Sent again as [`fetch_all`](Self::fetch_all) is.
    pub(crate) async fn changed<'q, F>(&self, make: F, repeat: Repeat) -> Result<u64>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        Ok(self.send(make, repeat, &Doubt::default()).await?.changed)
    }

    /// Runs the query `make` builds, again on another connection when its
    /// answer was lost and `repeat` allows it. Once a try's answer was lost
    /// (`doubt`), every later error says the request may have run.
    async fn send<'q, F>(&self, make: F, repeat: Repeat, doubt: &Doubt) -> Result<Reply>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        let mut tries = 0;
        loop {
            tries += 1;
            let mut conn = self.conn().await.map_err(|e| doubt.mark(e))?;
            // The rows and the command tag of one answer: what fetch_all
            // and execute each read of it, alone.
            let request = async {
                let mut reply = Reply::default();
                let mut steps = (&mut *conn).fetch_many(make());
                while let Some(step) = steps.try_next().await? {
                    match step {
                        sqlx::Either::Left(done) => reply.changed += done.rows_affected(),
                        sqlx::Either::Right(row) => reply.rows.push(row),
                    }
                }
                Ok::<_, sqlx::Error>(reply)
            };
            let result = tokio::time::timeout(self.response_timeout, request).await;
            let lost = match result {
                Ok(Ok(reply)) => {
                    conn.rest();
                    return Ok(reply);
                }
                // The server answered: the statement failed, and its
                // transaction with it.
                Ok(Err(sqlx::Error::Database(db))) if !connection_ended(&*db) => {
                    return Err(doubt.mark(not_sent(sqlx::Error::Database(db))))
                }
                Ok(Err(e)) => LostAnswer::Failed(e),
                Err(_) => LostAnswer::TimedOut(self.response_timeout),
            };
            // Its state is unknown (an answer may still be on its way).
            conn.close_on_drop();
            drop(conn);
            doubt.answer_lost();
            // Connections that died with a server restart are found dead
            // one by one: worth a few tries. A timeout: one more.
            let limit = match lost {
                LostAnswer::Failed(_) => STALE_TRIES,
                LostAnswer::TimedOut(_) => 2,
            };
            if repeat == Repeat::Once || tries >= limit {
                return Err(lost.into_error().may_have_run());
            }
            tracing::debug!(error = %lost, "dlock: a PostgreSQL answer was lost; asking again on another connection");
        }
    }
}

/// A request's answer: its rows, and how many rows it changed.
#[derive(Default)]
struct Reply {
    rows: Vec<PgRow>,
    changed: u64,
}

/// How many times a request that may be repeated is sent when its
/// connection fails under it.
const STALE_TRIES: u32 = 4;

/// Column `i` of `row`, or the error of an answer dlock did not expect.
pub(crate) fn column<'r, T>(row: &'r PgRow, i: usize) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(i).map_err(|e| unexpected(&e.to_string()))
}
