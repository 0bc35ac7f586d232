//! The connections the lock backend's requests run on, kept between
//! requests: sqlx's pool would test each one given back with a round trip
//! of its own (`docs/postgres-design.md`, "Kept connections"). Only a
//! connection whose answer was read is kept. Requests take turns in order,
//! on at most half the pool, the rest staying for its other users; a
//! connection idle for a minute, or older than the pool's lifetime, goes
//! back to the pool.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::Postgres;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

/// How long a connection may rest here unused before it goes back to the
/// pool (whose idle timeout then closes it).
const IDLE: Duration = Duration::from_secs(60);

/// Connections at rest, and the turns of the requests that use them.
#[derive(Debug)]
pub(crate) struct Connections {
    turns: Semaphore,
    /// At rest, the most recently used last.
    kept: Mutex<Vec<Kept>>,
    /// The pool's lifetime of a connection (sqlx's default: 30 minutes).
    lifetime: Option<Duration>,
}

#[derive(Debug)]
struct Kept {
    conn: PoolConnection<Postgres>,
    /// When it was taken from the pool: it goes back once `lifetime` has
    /// passed since.
    taken: Instant,
    rested: Instant,
}

impl Connections {
    /// Turns for half the connections of `pool` (at least one).
    pub(crate) fn for_pool(pool: &PgPool) -> Self {
        let options = pool.options();
        let turns = (options.get_max_connections() / 2).max(1) as usize;
        Connections { turns: Semaphore::new(turns), kept: Mutex::default(), lifetime: options.get_max_lifetime() }
    }

    /// A connection at rest, or one of `pool`'s, once it is this request's
    /// turn. Cancellation-safe.
    pub(crate) async fn lend<'a>(&'a self, pool: &PgPool) -> sqlx::Result<Lent<'a>> {
        // Never closed, so never an error.
        let turn = self.turns.acquire().await.ok();
        let now = Instant::now();
        let rested = {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            // The oldest first: given back (to the pool) outside the lock.
            let idle = kept.iter().take_while(|k| now.duration_since(k.rested) > IDLE).count();
            let stale: Vec<Kept> = kept.drain(..idle).collect();
            let rested = kept.pop();
            drop(kept);
            drop(stale);
            rested
        };
        let (conn, taken) = match rested {
            Some(k) => (k.conn, k.taken),
            None => (pool.acquire().await?, now),
        };
        Ok(Lent { conn, taken, home: Some(self), _turn: turn })
    }

    fn rest(&self, conn: PoolConnection<Postgres>, taken: Instant) {
        let now = Instant::now();
        if self.lifetime.is_some_and(|lifetime| now.duration_since(taken) >= lifetime) {
            return; // Dropped: back to the pool, which closes it.
        }
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).push(Kept { conn, taken, rested: now });
    }
}

/// A connection lent to one request: [`rest`](Self::rest) once its answer
/// is read; dropped otherwise, it goes back to the pool (or is closed,
/// after [`close_on_drop`](Self::close_on_drop)).
pub(crate) struct Lent<'a> {
    conn: PoolConnection<Postgres>,
    taken: Instant,
    /// Where it rests; `None` for a connection of the pool's own (a store
    /// on a pool it does not keep connections of).
    home: Option<&'a Connections>,
    /// The request's turn, which ends after the connection is at rest, so
    /// that the next request finds it there.
    _turn: Option<SemaphorePermit<'a>>,
}

impl<'a> Lent<'a> {
    /// A connection of the pool, given back to it after each request.
    pub(crate) fn pooled(conn: PoolConnection<Postgres>) -> Self {
        Lent { conn, taken: Instant::now(), home: None, _turn: None }
    }

    /// The request read its answer: the connection is at rest, and the
    /// next request may have it as it is.
    pub(crate) fn rest(self) {
        let Lent { conn, taken, home, _turn } = self;
        if let Some(home) = home {
            home.rest(conn, taken);
        }
    }

    /// Its state is unknown (an answer may still be on its way): closed
    /// when dropped, never reused.
    pub(crate) fn close_on_drop(&mut self) {
        self.conn.close_on_drop();
    }
}

impl Deref for Lent<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for Lent<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}
