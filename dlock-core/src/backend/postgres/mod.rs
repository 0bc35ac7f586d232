//! The PostgreSQL backend: a lease table, fencing tokens from a sequence,
//! `LISTEN/NOTIFY` wake-ups.
//!
//! Every held key has one row in `<prefix>_locks`, its head (the mode, the
//! fencing token, `expires_at` on the server's clock); a key held shared
//! or by permits also has one row per holder in `<prefix>_holders`.
//! Tokens come from the sequence `<prefix>_fence`, each grant of a key
//! drawing its own under a transaction-level advisory lock on the key, so
//! they grow in the order grants commit. The first try at an exclusive
//! hold is one plain `INSERT … ON CONFLICT` (take.sql) and its release one
//! `DELETE` (release.sql); every other step (a wait, a shared or counted
//! mode, re-entry, a renewal) is one call of a PL/pgSQL function, one
//! transaction, one round trip. A writer that waits keeps new readers out
//! with an intent row, and a permit that waits keeps its place; both are
//! taken back by [`Backend::withdraw`]. The table, the sequence and the
//! functions are made at connect when missing.
//!
//! A waiter sleeps until a release is announced with `NOTIFY` on
//! `<prefix>_released` (sent only when a waiter was refused) or the
//! holder's lease ends. There are no session advisory locks: every step is
//! one transaction, so requests may go through a transaction-mode pooler
//! (PgBouncer 1.21 or later with `max_prepared_statements` above 0, and
//! `extra_float_digits, statement_timeout` in its
//! `ignore_startup_parameters`), with the listener on a session of its own
//! ([`PostgresOptions::with_listen_url`]).
//!
//! # Restarts, crashes and failovers
//!
//! Every statement dlock answers on (a grant, a release, a renewal; the
//! idempotency store's and [`Fences::check`](crate::fence::postgres::Fences::check)'s
//! too) commits to disk before it is answered, whatever the server's
//! `synchronous_commit` (each raises `off` to `on` for its own
//! transaction). A lease, a release, a renewal and the order of tokens
//! survive a restart or a crash of the server or its machine, as long as
//! its disk keeps what it flushed. A failover to an asynchronously
//! replicated standby can lose the last of them: if locks must survive
//! one, fail over only to a synchronous standby.
//!
//! # Failures and unknown outcomes
//!
//! Every request is bounded by the response timeout (the server's
//! `statement_timeout` too). Acquires and renewals whose answer was lost
//! are sent again on another connection; once an acquire's answer was
//! lost, its every failure says its outcome is unknown ([`Error::Backend`]),
//! and the engine releases the key in the background. A release is sent
//! once. With dlock-core's `tls` feature the URL's `sslmode` is sqlx's;
//! without it, a URL that asks for TLS is an [`Error::Config`].
//!
//! `docs/postgres-design.md` in the repository has the whole design: the
//! mechanism step by step, the pooler's conditions, the costs, durability
//! and failovers. The connections, the request path and the schema install
//! shared with the idempotency store and the fences are dlock-core's
//! PostgreSQL client layer (`src/postgres/`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::DropGuard;

use super::wait::{acquire_loop, Attempt, Waiters};
use super::{
    mode_conflict, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Holder, KeyPage, ListQuery, LockMode,
    LockState, Release, RenewRequest, Renewal,
};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;
pub use crate::postgres::PostgresOptions;
use crate::postgres::{column, connect_options, durable, pool, unexpected, Db, Doubt, Repeat, BACKEND};

mod inspect;
mod listen;
mod renewals;
mod schema;
use schema::{create_schema, mode_text, parse_mode, Names, RELEASE_SQL, TAKE_SQL};

/// Locks in a PostgreSQL database.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use std::sync::Arc;
/// use dlock_core::{Locker, LockerOptions};
/// use dlock_core::backend::postgres::PostgresBackend;
/// let backend = PostgresBackend::connect("postgres://app@127.0.0.1:5432/app", "dlock").await?;
/// let locker = Locker::with_options(Arc::new(backend), LockerOptions::default())?;
/// let key = locker.key("report").part(7).build()?;
/// let guard = locker.try_acquire(&key).await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub struct PostgresBackend {
    shared: Arc<Shared>,
    /// Stops the listener task when the backend goes.
    _listener: DropGuard,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend").field("prefix", &self.shared.prefix).finish_non_exhaustive()
    }
}

struct Shared {
    db: Db,
    prefix: Arc<str>,
    waiters: Arc<Waiters>,
    /// The first try at an exclusive hold (take.sql).
    take: String,
    /// Every other try (acquire.sql).
    acquire: String,
    /// The release of an exclusive hold (release.sql).
    release: String,
    /// The release of any hold, or the withdrawal of a wait (release_any.sql).
    release_any: String,
    /// `(key, owner)` of acquires whose answer was lost: their release
    /// (the engine's undo) must wait for a write of the key still running.
    uncertain: Mutex<std::collections::HashSet<(String, String)>>,
    /// Renews a batch of holds (see `renewals.rs`).
    renew: String,
    /// A key's holders, for an operator (inspect.sql).
    inspect: String,
    /// One page of held keys (list.sql).
    list: String,
}

impl PostgresBackend {
    /// Connects with default [`PostgresOptions`]; see
    /// [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    ///
    /// As [`connect_with`](Self::connect_with).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, PostgresOptions::default()).await
    }

    /// Connects to the database at `url` (`postgres://user:password@host:port/db`),
    /// creates the lease table, sequence and functions of `prefix` when they
    /// are missing, and starts listening for releases.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_POSTGRES_URL` for a URL that does not
    /// parse, credentials the server refused, a user that may not create
    /// the table or a server that does not let dlock set
    /// `synchronous_commit` (see [Restarts, crashes and
    /// failovers](self#restarts-crashes-and-failovers)); naming
    /// `DLOCK_PREFIX` for a prefix that cannot name them;
    /// [`Error::Backend`] when the server cannot be reached within the
    /// response timeout. Messages never show the password.
    pub async fn connect_with(url: &str, prefix: &str, options: PostgresOptions) -> Result<Self> {
        let names = Names::for_prefix(prefix)?;
        let connect = connect_options(url, &options)?;
        create_schema(&connect, &names, options.response_timeout()).await?;
        let pool = pool(connect, &options);
        let waiters = Arc::new(Waiters::default());
        let listener = listen::connect(&pool, &names, &options).await?;
        let stop = CancellationToken::new();
        let sweep = listen::sweep(&names);
        tokio::spawn(listen::listen(listener, waiters.clone(), pool.clone(), sweep, stop.clone()));
        let shared = Shared {
            take: names.fill(TAKE_SQL),
            // The functions are called with the pin in their first argument
            // (durable.rs): a database keeps the functions an earlier dlock
            // made, and the pin reaches their commits all the same.
            acquire: format!(
                "SELECT r_outcome, r_fence, r_info FROM {}({}, $2, $3, $4, $5, $6)",
                names.acquire,
                durable::after_pin("$1::text")
            ),
            release: names.fill(RELEASE_SQL),
            // $3: only what the waits of the owner left (a withdrawal).
            release_any: format!("SELECT {}({}, $2, $3)", names.release, durable::after_pin("$1::text")),
            uncertain: Mutex::default(),
            renew: format!("SELECT r_key, r_owner FROM {}({}, $2, $3)", names.renew, durable::after_pin("$1::text[]")),
            inspect: names.fill(include_str!("inspect.sql")),
            list: names.fill(include_str!("list.sql")),
            db: Db::keeping(pool, options.response_timeout()),
            prefix: prefix.into(),
            waiters,
        };
        Ok(PostgresBackend { shared: Arc::new(shared), _listener: stop.drop_guard() })
    }

    /// The pool and the bound of its requests, for an idempotency store on
    /// the same server ([`PostgresStore::from_backend`](crate::idempotency::PostgresStore::from_backend)).
    pub(crate) fn db(&self) -> &Db {
        &self.shared.db
    }

    /// How many acquires of this backend are parked waiting for `key`
    /// ([`test_support::postgres_waiters`](crate::test_support::postgres_waiters)).
    #[cfg(feature = "test-support")]
    pub(crate) fn waiters(&self, key: &LockKey) -> usize {
        self.shared.waiters.count(key.as_str())
    }

    /// One try on the server (see [`try_on_server`](Self::try_on_server)).
    /// `doubt` is the acquire's, across its tries: once any statement of it
    /// may have run, its every failure says so, and the engine's undo of it
    /// is the release that waits for it.
    async fn try_once(&self, req: &AcquireRequest, awaited: bool, doubt: &Doubt) -> Result<Attempt> {
        let result = self.try_on_server(req, awaited, doubt).await;
        result.map_err(|e| self.lost_acquire(req, doubt.mark(e)))
    }

    /// The first try at an exclusive hold is a plain insert of the key's
    /// head (take.sql), and only when that finds the key held, the acquire
    /// function.
    async fn try_on_server(&self, req: &AcquireRequest, awaited: bool, doubt: &Doubt) -> Result<Attempt> {
        let sent = Instant::now();
        if !awaited && req.mode == LockMode::Exclusive {
            let take = || {
                sqlx::query(&self.shared.take)
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(millis(req.lease).max(1))
            };
            // Safe to send twice: the second finds the first's head, live,
            // and says "held"; the function that follows joins it (and when
            // that fails, `doubt` says the first may have been granted).
            if let Some(row) = self.shared.fetch_doubting(take, Repeat::Safe, doubt).await? {
                let fence =
                    u64::try_from(column::<i64>(&row, 0)?).map_err(|_| unexpected("a negative fencing token"))?;
                return Ok(Attempt::Acquired(Grant::until(fence, sent + req.lease)));
            }
        }
        let wait_ms = req.deadline.map_or(0, |deadline| millis(deadline.saturating_duration_since(sent)));
        let query = || {
            sqlx::query(&self.shared.acquire)
                .bind(req.key.as_str())
                .bind(req.owner.as_str())
                .bind(millis(req.lease).max(1))
                .bind(mode_text(req.mode))
                .bind(awaited)
                .bind(wait_ms)
        };
        let row = self.shared.fetch_doubting(query, Repeat::Safe, doubt).await?.ok_or_else(|| unexpected("no row"))?;
        let (outcome, fence, info): (i32, i64, String) =
            (column(&row, 0)?, column(&row, 1)?, column::<Option<String>>(&row, 2)?.unwrap_or_default());
        match outcome {
            1 | 2 => {
                let fence = u64::try_from(fence).map_err(|_| unexpected("a negative fencing token"))?;
                Ok(Attempt::Acquired(Grant::until(fence, sent + req.lease)))
            }
            0 => Ok(Attempt::Held { retry_in: info.parse::<u64>().ok().map(Duration::from_millis) }),
            3 => Err(mode_conflict(req, parse_mode(&info).ok_or_else(|| unexpected("an unknown mode"))?)),
            _ => Err(unexpected("an unknown outcome")),
        }
    }

    /// The release function (release_any.sql): frees the owner's hold of
    /// `key`, whatever its mode, or with `only_waits` takes back what its
    /// waits left there and never a hold. Whether it did. A release is sent
    /// once (a second would answer "not held" for a hold the first freed);
    /// a withdrawal may be sent again (a second finds nothing to take).
    async fn release_any(&self, key: &LockKey, owner: &Owner, only_waits: bool) -> Result<bool> {
        let query = || sqlx::query(&self.shared.release_any).bind(key.as_str()).bind(owner.as_str()).bind(only_waits);
        let repeat = if only_waits { Repeat::Safe } else { Repeat::Once };
        Ok(match self.shared.fetch(query, repeat).await? {
            Some(row) => column::<Option<bool>>(&row, 0)?.unwrap_or(false),
            None => false,
        })
    }

    /// `e`, after an acquire's request failed: when it may have run, the
    /// engine's undo of it must be the release that waits for it.
    fn lost_acquire(&self, req: &AcquireRequest, e: Error) -> Error {
        if e.outcome_unknown() {
            let mut uncertain = self.shared.uncertain.lock().unwrap_or_else(|p| p.into_inner());
            uncertain.insert((req.key.as_str().to_owned(), req.owner.as_str().to_owned()));
        }
        e
    }
}
impl std::ops::Deref for Shared {
    type Target = Db;

    fn deref(&self) -> &Db {
        &self.db
    }
}

/// Whole milliseconds, as PostgreSQL's `bigint`.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Backend for PostgresBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    /// Every mode.
    fn supports(&self, _: LockMode) -> Result<()> {
        Ok(())
    }

    fn prefix(&self) -> Option<&str> {
        Some(&self.shared.prefix)
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        let waiters = &self.shared.waiters;
        Box::pin(async move {
            // One for the whole acquire: a try that found the key held
            // after an earlier one's answer was lost is the same request.
            let doubt = Doubt::default();
            acquire_loop(
                req,
                cancel,
                || waiters.count(req.key.as_str()) > 0,
                |awaited| self.try_once(req, awaited, &doubt),
                // Listening since connect: registering is local.
                move || std::future::ready(waiters.register(req.key.as_str(), req.mode)),
            )
            .await
        })
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        Box::pin(async move {
            let one = [RenewRequest::new(key.clone(), owner.clone(), lease)];
            let answer = renewals::renew(&self.shared, &one).await.pop();
            answer.unwrap_or_else(|| Err(Error::Internal("a renewal without an answer".into())))
        })
    }

    fn renew_many<'a>(&'a self, holds: &'a [RenewRequest]) -> BoxFuture<'a, Vec<Result<Renewal>>> {
        Box::pin(renewals::renew(&self.shared, holds))
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move {
            let after_unknown = {
                let mut uncertain = self.shared.uncertain.lock().unwrap_or_else(|p| p.into_inner());
                // Nearly always empty: a release allocates nothing to find out.
                !uncertain.is_empty() && uncertain.remove(&(key.as_str().to_owned(), owner.as_str().to_owned()))
            };
            let query = |sql| move || sqlx::query(sql).bind(key.as_str()).bind(owner.as_str());
            // A live exclusive hold is its key's head; none deleted: the
            // owner's hold, if any, is shared or its lease ran out (the
            // function's to answer).
            if !after_unknown && self.shared.changed(query(self.shared.release.as_str()), Repeat::Once).await? == 1 {
                return Ok(Release::Freed);
            }
            Ok(match self.release_any(key, owner, false).await? {
                true => Release::Freed,
                false => Release::NotHeld,
            })
        })
    }

    /// A writer's intent or a waiting permit's place; a waiting reader
    /// leaves nothing, and costs no round trip.
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if req.mode == LockMode::Shared {
                return Ok(());
            }
            #[cfg(feature = "broken-variants")]
            if crate::broken_variants::is_on(crate::broken_variants::Switch::IntentNeverWithdrawn) {
                return Ok(());
            }
            self.release_any(&req.key, &req.owner, true).await.map(drop)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.shared.fetch(|| sqlx::query("SELECT 1"), Repeat::Safe).await?;
            Ok(())
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.inspect_on_server(key))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        Box::pin(self.list_on_server(query))
    }

    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.force_unlock_on_server(key, holder))
    }
}
