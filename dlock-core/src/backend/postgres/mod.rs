//! The PostgreSQL backend: a lease table, fencing tokens from a sequence,
//! `LISTEN/NOTIFY` wake-ups.
//!
//! # Mechanism
//!
//! * Every held key has one row in the table `<prefix>_locks` (in the
//!   connection's current schema), its **head**, keyed on the key alone:
//!   the mode (`x` exclusive, `s` shared, `p<N>` one of N permits), the
//!   fencing token, `expires_at` on the **server's** clock
//!   (`clock_timestamp()`, so the clients' clocks do not matter) and
//!   `awaited`, set when a waiter was refused while the head held the key.
//!   A head past `expires_at` holds nothing; whoever takes the key next
//!   overwrites it. An exclusive hold *is* its head (its owner is the
//!   holder). A key held shared or by permits has a head whose owner is
//!   `''`, whose lease is at least each of its holders', and one row per
//!   holder in `<prefix>_holders`, keyed on `(key, owner)`. The split is
//!   the one the Redis backend makes between a string and a hash: the
//!   common case, one exclusive holder, is one row, and the unique key on
//!   it is what makes two holders impossible.
//! * Fencing tokens come from the sequence `<prefix>_fence` (`bigint`,
//!   `nextval` once per grant): they grow strictly, for every key of the
//!   prefix, across modes. Each grant of a key draws its token under a
//!   transaction-level advisory lock on the key (the hashes of the prefix
//!   and the key), held until it commits, so the grants of one key draw in
//!   the order they commit: a first try that drew its token and then
//!   waited, or was descheduled, before it wrote its row cannot be granted
//!   below a holder that came and went in between. Being transaction-level,
//!   the lock works through a transaction pool (unlike session advisory
//!   locks, below).
//! * The **first try** at an exclusive hold is one plain statement
//!   (take.sql): `INSERT` of the head `ON CONFLICT (key) DO UPDATE … WHERE`
//!   its lease has ended, `RETURNING` the token — the hand-written lease
//!   lock's statement with a `nextval`. It answers a row when granted and
//!   nothing when the key is held.
//! * **Every other step** (a try that found the key held, a wait, a shared
//!   or counted mode, re-entry) is a PL/pgSQL function
//!   (`<prefix>_acquire_v5`), one statement and so one transaction, one
//!   round trip. It first upserts the key's head (a free one when missing)
//!   and so holds its row lock until commit: steps on one key run one at a
//!   time, and the first try's write waits for them too. It then reads the
//!   key's holders once and decides. A refusal marks the head `awaited`
//!   under that row lock, so a release, which deletes the head, waits for
//!   the mark and reads it: no wake-up can fall between them.
//! * An exclusive release is one plain `DELETE` of the head while its
//!   lease lives (release.sql), answered by its command tag alone; a shared
//!   one, or one that found no such head (its lease ran out), is the
//!   function `<prefix>_release_v3`, which locks the head first and deletes
//!   it with the last holder. Renewals are the function
//!   `<prefix>_renew_v1`, many holds a statement (renewals asked while one
//!   is in flight go out together); it locks the heads of shared holds
//!   before it extends them, so none is taken over in between. A refused
//!   acquire answers, in the same call, when the first of the holders'
//!   leases ends (the wait loop's `retry_in`).
//! * Re-entry is counted by the engine; the tables keep one row per key and
//!   owner. An acquire by an owner that holds the key joins its hold (same
//!   token), which also makes an acquire safe to send twice.
//! * Writer preference: a writer that will wait and is refused records an
//!   intent row in `<prefix>_holders` (mode `i`, owner `~<owner>`) that
//!   lives until its wait would end; while one lives, new readers are
//!   refused (and told to try again when it ends). The writer's grant
//!   deletes it, and so does a writer that leaves without the key before
//!   its wait ends (its caller went, its acquire failed): the engine's
//!   [`Backend::withdraw`] is the release function told to take back only
//!   what the owner's waits left, never a hold, under the head's row lock
//!   like every step on the key; it announces the intent's end when a
//!   waiter was refused, so the readers it kept out try again at once.
//! * A semaphore keeps its limit for its waiters too: a permit that will
//!   wait and finds every permit of its limit taken records its **place**,
//!   a row in `<prefix>_holders` (mode `p<N>`, owner `~<owner>`) that lives
//!   until its wait would end, and the key's head lives at least as long.
//!   While a place lives, the key is a semaphore of that limit also with
//!   nobody holding it: a request for another limit, a shared or an
//!   exclusive one is [`Error::ModeConflict`], one of the same limit is
//!   granted a free permit. The waiter's grant deletes its place, and so
//!   do its withdrawal (as for an intent) and its release; an expired one
//!   goes with the next step on the key. A permit that found the key held
//!   exclusive keeps no place.
//!
//! **No session advisory locks.** `pg_advisory_lock` would need no table,
//! but it has no lease (a hung holder keeps it while its connection lives),
//! no fencing token, and it belongs to a server session: behind a
//! transaction-mode pooler (PgBouncer) the session is not the client's, and
//! the lock strands on a pooled server connection that someone else uses
//! next (`a_session_advisory_lock_strands_behind_a_transaction_pool` shows
//! an unlock answering "not held" and the lock left taken). Every step here
//! is one transaction, and its row locks end with it, so requests may go
//! through a pooler in transaction mode, on three conditions (`mod pooled`
//! of tests/postgres_backend.rs runs the suites through PgBouncer 1.24 in
//! transaction mode, and shows the first two failing without their
//! settings):
//!
//! 1. The pooler must keep prepared statements (PgBouncer 1.21 and later
//!    with `max_prepared_statements` above 0): sqlx prepares every
//!    statement, and even its unnamed ones are parsed and run in two
//!    exchanges that a pooler of an earlier version may send to two server
//!    connections.
//! 2. It must let dlock's connections in: they send `statement_timeout` (the
//!    response timeout) and sqlx's `extra_float_digits` at connect, which
//!    PgBouncer refuses unless both are in its `ignore_startup_parameters`.
//!    Ignored there, the server no longer bounds dlock's statements: set
//!    `statement_timeout` on the server's role instead (`ALTER ROLE app SET
//!    statement_timeout = '2s'`). Either refusal is an [`Error::Config`]
//!    naming `DLOCK_POSTGRES_URL` and the setting to change.
//! 3. The listener needs a session: give it its own URL
//!    ([`PostgresOptions::with_listen_url`], `DLOCK_POSTGRES_LISTEN_URL`),
//!    the server's or a session-mode pool's.
//!
//! Durability needs no pooler setting: it is set inside each statement's
//! own transaction, not at connect (see below), and a startup parameter
//! would not reach the server session through PgBouncer.
//!
//! The table, the sequence and the functions are created at connect when
//! missing, inside a transaction that takes a fixed advisory lock first: two
//! processes starting at once do not race on the catalog (a loser of a race
//! that happens anyway is retried once).
//!
//! # Waiting
//!
//! A waiter uses the shared event-driven loop (`wait::acquire_loop`): it
//! tries, and while the key is held it sleeps until a release wakes it or
//! the holder's lease ends. Releases are announced with `NOTIFY` on the
//! channel `<prefix>_released`, the key as payload, only when the released
//! row was `awaited`: uncontended cycles send no notification. Each backend
//! keeps one dedicated connection listening on the channel (sqlx's
//! `PgListener`) and wakes the local waiters of the key; when that
//! connection is lost and comes back, every local waiter is woken to try
//! again, since notifications in between are lost.
//!
//! # What it costs
//!
//! An uncontended exclusive cycle is two round trips and two plain
//! statements, each its own short transaction, on connections kept
//! between requests (`connections.rs`: sqlx's pool would add a round trip
//! to each, testing the connection given back to it): the first try (an `INSERT`
//! with a `nextval` under the key's advisory lock) and the release (a
//! `DELETE`), what a hand-written lease lock costs plus the token drawn in
//! the order of grants (dlock-bench's `lease-fenced` row is that lock). A try that finds the key held costs a
//! second round trip (the function), and so does a shared release.
//! Renewals cost one function call per statement in flight, whatever the
//! number of holds it extends (up to 512). Every grant
//! writes WAL (and a dead row for autovacuum), and waits for it to be
//! written before it is answered, on a server set to
//! `synchronous_commit = off` too (see below). A contended release adds one
//! `NOTIFY`, which wakes one waiter of the key in each listening process (all
//! of them when readers wait).
//!
//! # Restarts, crashes and failovers
//!
//! The table and the sequence are ordinary durable objects, and every
//! statement dlock answers on (a grant, a release, a renewal; the
//! idempotency store's and [`Fences::check`](crate::fence::postgres::Fences::check)'s
//! too) commits to disk before it is answered, **whatever the server's
//! `synchronous_commit`**. Under `synchronous_commit = off` (for the
//! server, a database or a role: a common throughput setting) PostgreSQL
//! answers a commit before its WAL is written, and a crash within the next
//! `3 × wal_writer_delay` (600 ms by default) forgets the transaction,
//! its `nextval` with it: the next client would be granted the key while
//! the first still holds it, **with the same fencing token**, which no
//! fence refuses (a fence accepts a token equal to the highest it saw). So
//! each statement sets `synchronous_commit` for its own transaction
//! (`SET LOCAL`, inside the statement: it holds through a transaction-mode
//! pooler, and ends with the transaction), from `off` to `on`; any other
//! value is the operator's and is kept. dlock's statements then wait for
//! their WAL to be written as under the default setting; the
//! application's own keep the server's. A server that refuses the setting
//! is refused at connect ([`Error::Config`] naming it).
//! `tests/postgres_async_commit.rs` shows each step surviving a crash of a
//! server set to `off`, which forgot every one of them before.
//!
//! What that gives, on one server: a lease survives a restart or a crash
//! of the server or of its machine, its holder keeps it if it renews
//! before it ends, a release and a renewal answered stay done, and tokens
//! keep growing (a sequence never hands out a value twice; it may skip
//! some), as long as the disk keeps what PostgreSQL flushed to it: with
//! `fsync = off`, or a disk that acknowledges writes it has not stored, a
//! crash of the machine can lose any of them, whatever dlock does.
//! Requests fail with [`Error::Backend`] while the server is away.
//!
//! A failover to an **asynchronously** replicated standby can lose the
//! last grants, releases and renewals (and sequence values) that the old
//! primary committed and had not yet shipped: a lock held there may be
//! free on the new primary, and a token may be handed out again, to
//! another holder, while the first still holds its lease. Pinning
//! `synchronous_commit` does not change that: without a synchronous
//! standby, `on` waits for the local disk only. If locks must survive a
//! failover, make the standby you fail over to synchronous
//! (`synchronous_standby_names`), keep `synchronous_commit` at `on` or
//! `remote_apply` for dlock's role (`local` and `remote_write`, which the
//! pin keeps, do not wait for the standby's disk), and promote only a
//! standby that confirmed the commits (with `ANY n (…)`, the most
//! advanced one).
//!
//! # TLS
//!
//! With dlock-core's `tls` feature, the URL's `sslmode` and `sslrootcert`
//! (and `sslcert` / `sslkey` for a client certificate) are sqlx's, over the
//! system's OpenSSL: `?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem`
//! checks the server's certificate and name. Without the feature, a URL
//! that asks for TLS is a configuration error at connect; `prefer` (the
//! default) connects in plain text.
//!
//! # Failures and unknown outcomes
//!
//! Every request has a response timeout (the connection's
//! `statement_timeout` is set to the same value, so the server gives up on
//! it too). A server that cannot be reached is an [`Error::Backend`]
//! within that bound, never a hang. A request that was sent and whose
//! answer was lost (a timeout, a connection that broke) may have been
//! carried out. Acquires and renewals are sent again on another
//! connection (both are safe to repeat: an acquire joins the hold it may
//! have taken): once after a timeout, up to three times when connections
//! fail at once (a pool's connections all die with a server restart, and
//! each is found dead only when used). Once a try's answer was lost, every
//! later failure of the same acquire says the outcome is unknown
//! ([`Error::Backend`] whose source marks it), whatever it failed with: a
//! resend whose answer is lost too, one that cannot connect, one the
//! server refuses, or the acquire function after a resent first try found
//! the key held (perhaps by the first try's own grant). The engine then
//! releases the key in the background, owner-checked (see
//! [`Locker`](crate::Locker)). That release is the function
//! (`<prefix>_release_v3`), whose upsert of the key's head waits for a
//! write of it still running on the server (the lost acquire's insert or
//! update), so it lands after it. A release is sent once: a second would
//! answer "not held" for a hold the first freed. A connection whose request failed that way is
//! closed, never reused.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::TryStreamExt as _;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection as _, Executor as _, Postgres, Row as _};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::DropGuard;

use super::wait::{acquire_loop, Attempt};
use super::{
    mode_conflict, redact, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, LockMode, Release, Renewal,
};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

mod connections;
mod doubt;
pub(crate) mod durable;
mod renewals;
use connections::{Connections, Lent};
use doubt::Doubt;
use renewals::Renewals;

const BACKEND: &str = "postgres";
/// The variable that names the server, for configuration errors.
const URL_VAR: &str = "DLOCK_POSTGRES_URL";
/// The variable that names where the listener connects.
const LISTEN_URL_VAR: &str = "DLOCK_POSTGRES_LISTEN_URL";
/// The first key of the advisory lock ("dloc", second key 0) that makes
/// the schema one process at a time (the fences table's too, see
/// [`crate::fence::postgres`]). Grants of a key take one of their own,
/// on the hashes of the prefix and the key (take.sql).
const LOCK_CLASS: i32 = 0x646c_6f63;
/// The longest prefix: the longest name made of it (`_acquire_v5`) must fit
/// PostgreSQL's 63 bytes, or it would be cut and collide.
const MAX_PREFIX: usize = 48;

const SCHEMA_SQL: &str = include_str!("schema.sql");
const TAKE_SQL: &str = include_str!("take.sql");
const ACQUIRE_SQL: &str = include_str!("acquire.sql");
const RELEASE_SQL: &str = include_str!("release.sql");
const RELEASE_ANY_SQL: &str = include_str!("release_any.sql");
const RENEW_SQL: &str = include_str!("renew.sql");

/// How the PostgreSQL backend connects.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::postgres::PostgresOptions;
/// let opts = PostgresOptions::default().with_response_timeout(Duration::from_millis(500)).with_max_connections(8);
/// # let _ = opts;
/// ```
#[derive(Clone)]
pub struct PostgresOptions {
    response_timeout: Duration,
    max_connections: u32,
    listen_url: Option<String>,
}

impl std::fmt::Debug for PostgresOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOptions")
            .field("response_timeout", &self.response_timeout)
            .field("max_connections", &self.max_connections)
            .field("listen_url", &self.listen_url.as_deref().map(redact))
            .finish()
    }
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions { response_timeout: Duration::from_secs(2), max_connections: 16, listen_url: None }
    }
}

impl PostgresOptions {
    /// The longest a request may take, a connection included (default 2 s);
    /// also the server's `statement_timeout` for dlock's connections.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The bound of each request.
    pub(crate) fn response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// The most connections the pool opens (default 16), the one that
    /// listens for releases included unless it has a URL of its own
    /// ([`with_listen_url`](Self::with_listen_url)). Lock requests take
    /// turns on at most half of them, in the order they come, and keep
    /// those open between requests (sqlx's pool would test each one given
    /// back with a round trip of its own); the other half stays for the
    /// pool's other users, such as an idempotency store made
    /// [`from_backend`](crate::idempotency::PostgresStore::from_backend).
    ///
    /// ```
    /// use dlock_core::backend::postgres::PostgresOptions;
    /// // Up to 16 lock requests at once, on connections kept between them.
    /// let opts = PostgresOptions::default().with_max_connections(32);
    /// # let _ = opts;
    /// ```
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Where the connection that listens for releases goes, when not where
    /// the requests go (the default). `LISTEN` belongs to a server session:
    /// behind a pooler in transaction mode (PgBouncer's `pool_mode =
    /// transaction`) the session is lent to others between statements and
    /// the announcements are lost, so waiters would wake only when a
    /// holder's lease ends. Point this at the server itself, or at a pool
    /// in session mode, **of the same database** (announcements do not
    /// cross databases). Its environment variable is
    /// `DLOCK_POSTGRES_LISTEN_URL`.
    ///
    /// ```
    /// use dlock_core::backend::postgres::PostgresOptions;
    /// // Requests through PgBouncer (port 6432), the listener to the server.
    /// let opts = PostgresOptions::default().with_listen_url("postgres://app@db:5432/app");
    /// # let _ = opts;
    /// ```
    pub fn with_listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }
}

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
    renewals: Renewals,
}

/// The names of one prefix's objects, quoted.
struct Names {
    locks: String,
    holders: String,
    fence: String,
    acquire: String,
    release: String,
    renew: String,
    /// Unquoted: `LISTEN` quotes it, `pg_notify` takes it as text.
    channel: String,
    /// As given (its characters need no quoting in a string literal): the
    /// first key of the advisory lock each grant of a key draws its token
    /// under is its hash, so prefixes do not wait for each other.
    prefix: String,
}

/// An error of the listen URL names its own variable.
fn listen_url_error(e: Error) -> Error {
    match e {
        Error::Config { reason, .. } => Error::config(LISTEN_URL_VAR, reason),
        other => other,
    }
}

/// How dlock connects to the server at `url`: its `statement_timeout` is
/// the response timeout, so the server gives up on a request when dlock
/// does.
pub(crate) fn connect_options(url: &str, options: &PostgresOptions) -> Result<PgConnectOptions> {
    let timeout_ms = options.response_timeout.as_millis().to_string();
    let connect = PgConnectOptions::from_str(url)
        .map_err(|e| Error::config(URL_VAR, format!("`{}` is not a PostgreSQL URL: {e}", redact(url))))?;
    check_tls(&connect, cfg!(feature = "tls"))?;
    Ok(connect.application_name("dlock").options([("statement_timeout", timeout_ms.as_str())]))
}

/// Refuses a URL that asks for TLS (`sslmode=require`, `verify-ca` or
/// `verify-full`) when dlock-core was built without its `tls` feature
/// (`tls_built`): the first request would fail with sqlx's words, far
/// from the cause. `prefer`, the default, falls back to plain text.
fn check_tls(connect: &PgConnectOptions, tls_built: bool) -> Result<()> {
    use sqlx::postgres::PgSslMode;
    let asks = matches!(connect.get_ssl_mode(), PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull);
    if asks && !tls_built {
        return Err(Error::config(
            URL_VAR,
            "asks for TLS (`sslmode`), and dlock-core was built without its `tls` feature: enable it (dlock-axum \
             forwards it) or connect without TLS",
        ));
    }
    Ok(())
}

/// A lazy pool of `connect`: no connection is opened before a request.
pub(crate) fn pool(connect: PgConnectOptions, options: &PostgresOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(options.max_connections)
        .min_connections(0)
        .acquire_timeout(options.response_timeout)
        // A ping before every request would double its round trips: a
        // connection found dead is closed when its request fails.
        .test_before_acquire(false)
        .connect_lazy_with(connect)
}

/// Refuses a prefix that cannot name dlock's tables, sequences, functions
/// and channel: quoted names of at most 63 bytes, the longest suffix
/// included.
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
    if prefix.len() > MAX_PREFIX || !prefix.chars().all(allowed) {
        return Err(Error::config(
            "DLOCK_PREFIX",
            format!(
                "names the PostgreSQL tables, sequence and channel: at most {MAX_PREFIX} ASCII letters, digits, \
                 `_`, `-`, `.` or `:`"
            ),
        ));
    }
    Ok(())
}

impl Names {
    fn for_prefix(prefix: &str) -> Result<Self> {
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
    fn fill(&self, sql: &str) -> String {
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
        create_schema(&connect, &names, options.response_timeout).await?;
        let pool = pool(connect, &options);
        let waiters = Arc::new(Waiters::default());
        // Its own pool of one when it has its own URL: the listener takes
        // a connection of its pool, and makes it again when it breaks.
        let listen_pool = match &options.listen_url {
            Some(url) => {
                let one = PostgresOptions { max_connections: 1, ..options.clone() };
                self::pool(connect_options(url, &options).map_err(listen_url_error)?, &one)
            }
            None => pool.clone(),
        };
        let what = match &options.listen_url {
            Some(url) => format!("listening for releases at {LISTEN_URL_VAR} ({})", redact(url)),
            None => "listening for releases".to_owned(),
        };
        let listener = within(options.response_timeout, &what, async {
            let mut listener = PgListener::connect_with(&listen_pool).await?;
            listener.listen(&names.channel).await?;
            Ok(listener)
        })
        .await?;
        let stop = CancellationToken::new();
        let sweep = names.fill(
            "WITH h AS (DELETE FROM {holders} WHERE expires_at < clock_timestamp() - interval '1 minute') \
             DELETE FROM {locks} WHERE expires_at < clock_timestamp() - interval '1 minute'",
        );
        tokio::spawn(listen(listener, waiters.clone(), pool.clone(), sweep, stop.clone()));
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
            renewals: Renewals::default(),
            db: Db::keeping(pool, options.response_timeout),
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

    /// Test hook: how many acquires of this backend are parked waiting for
    /// `key`, so a test can wait for a waiter to park instead of sleeping.
    #[doc(hidden)]
    pub fn waiters(&self, key: &LockKey) -> usize {
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

/// Whether a request may be sent again after its answer was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Sending it twice does what sending it once does.
    Safe,
    /// Once only (a release: a second one would answer "not held").
    Once,
}

impl std::ops::Deref for Shared {
    type Target = Db;

    fn deref(&self) -> &Db {
        &self.db
    }
}

/// A pool of connections to one server, and the bound on each request:
/// how a request is sent, and sent again when its answer was lost. The
/// lock backend and the idempotency store
/// ([`PostgresStore`](crate::idempotency::PostgresStore)) share it.
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

    /// Requests on connections kept between them (see `connections.rs`):
    /// for a pool of dlock's own.
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
    async fn fetch_doubting<'q, F>(&self, make: F, repeat: Repeat, doubt: &Doubt) -> Result<Option<PgRow>>
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

    /// How many rows the statement `make` builds changed: a statement with
    /// no `RETURNING`, whose answer is its command tag alone (the server
    /// projects and sends no row). Sent again as [`fetch_all`](Self::fetch_all) is.
    pub(crate) async fn changed<'q, F>(&self, make: F, repeat: Repeat) -> Result<u64>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        Ok(self.send(make, repeat, &Doubt::default()).await?.changed)
    }

    /// Runs the query `make` builds, again on another connection when its
    /// answer was lost and `repeat` allows it. Once a try's answer was lost
    /// (noted in `doubt`), the request may have run, whatever a later try
    /// fails with: a resend that cannot connect or that the server refuses
    /// did nothing itself, and its error carries the mark all the same.
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
            // A pool keeps connections that died with a server restart
            // until a request finds them dead, each at once: those are
            // worth a few tries. A timeout costs the whole bound: one more.
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

/// The server ended the session (a shutdown, a crash, an administrator):
/// SQLSTATE classes 57 (operator intervention) and 08 (connection
/// exception). The connection is gone, whatever the request did.
fn connection_ended(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.code().is_some_and(|code| code.starts_with("57P") || code.starts_with("08"))
}

/// Why the answer to a sent request never came.
#[derive(Debug)]
enum LostAnswer {
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
    fn into_error(self) -> Error {
        let message = self.to_string();
        let source: Option<Box<dyn std::error::Error + Send + Sync>> = match self {
            LostAnswer::Failed(e) => Some(Box::new(e)),
            LostAnswer::TimedOut(_) => None,
        };
        Error::Backend { backend: BACKEND, message, source }
    }
}

/// What to change when the error is a pooler's between dlock and the
/// server, set in a way dlock cannot work through (the module docs' two
/// conditions); `None` for any other error.
fn pooler_hint(db: &dyn sqlx::error::DatabaseError) -> Option<&'static str> {
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
fn not_sent(e: sqlx::Error) -> Error {
    let message = match &e {
        sqlx::Error::Database(db) => match pooler_hint(db.as_ref()) {
            Some(hint) => format!("PostgreSQL refused a request: {}; {hint}", db.message()),
            None => format!("PostgreSQL refused a request: {}", db.message()),
        },
        other => format!("cannot reach PostgreSQL: {other}"),
    };
    Error::Backend { backend: BACKEND, message, source: Some(Box::new(e)) }
}

fn unexpected(what: &str) -> Error {
    Error::backend(BACKEND, format!("unexpected answer from the acquire function: {what}"))
}

pub(crate) fn column<'r, T>(row: &'r PgRow, i: usize) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(i).map_err(|e| unexpected(&e.to_string()))
}

/// `future` within `timeout`, its errors (none of which can leave a
/// request half done: it runs before any lock is asked for) as backend
/// errors.
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
fn connect_error(e: sqlx::Error, what: &str) -> Error {
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

/// Creates the table, the sequence and the functions of `names` when they
/// are missing, on a connection of its own.
async fn create_schema(connect: &PgConnectOptions, names: &Names, timeout: Duration) -> Result<()> {
    let objects = Objects {
        what: "creating the lock table",
        schema: names.fill(SCHEMA_SQL),
        functions: vec![
            (names.acquire.clone(), names.fill(ACQUIRE_SQL)),
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

/// DDL can wait behind a lock of another process's DDL: more time than a
/// request, still bounded.
fn ddl_timeout(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(10))
}

/// Tables and functions dlock keeps in a database: the lock backend's, or
/// the idempotency store's.
pub(crate) struct Objects {
    /// What creating them is, for errors ("creating the lock table").
    pub(crate) what: &'static str,
    /// Idempotent DDL (`CREATE … IF NOT EXISTS`).
    pub(crate) schema: String,
    /// Each function's quoted name and its `CREATE FUNCTION`.
    pub(crate) functions: Vec<(String, String)>,
}

/// Creates `objects` when they are missing, on `conn`, in one transaction
/// that first takes a fixed advisory lock, so two processes starting at
/// once do not race on the catalog.
pub(crate) async fn install(conn: &mut PgConnection, objects: &Objects, timeout: Duration) -> Result<()> {
    // Refused here, with the setting named, rather than at every request.
    durable::pin(conn, timeout).await?;
    let timeout = ddl_timeout(timeout);
    let mut result = within(timeout, objects.what, create_objects(conn, objects)).await;
    if let Err(Error::Backend { source: Some(source), .. }) = &result {
        // The fixed advisory lock makes this rare; a catalog race lost all
        // the same (another process created an object between our check and
        // our CREATE) is over once, and a second try finds it made.
        let raced = source.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()).and_then(|db| db.code());
        if matches!(raced.as_deref(), Some("23505" | "42P07" | "42723" | "XX000")) {
            result = within(timeout, objects.what, create_objects(conn, objects)).await;
        }
    }
    result
}

/// Boxed: sqlx's executor on `&mut` connections trips the compiler's
/// proof that an unboxed future of it is `Send`, and `connect` must be.
fn create_objects<'a>(
    conn: &'a mut PgConnection,
    objects: &'a Objects,
) -> BoxFuture<'a, std::result::Result<(), sqlx::Error>> {
    Box::pin(async move {
        let mut tx = conn.begin().await?;
        let c: &mut PgConnection = &mut tx;
        // Also for this transaction: its commit durable (a crash would
        // otherwise forget the objects under a running process), and no
        // notices: `… IF NOT EXISTS` tells of every object it finds made,
        // which sqlx logs at every start.
        let first = format!("SELECT pg_advisory_xact_lock($1, 0), {}, {QUIET}", durable::PIN);
        sqlx::query(&first).bind(LOCK_CLASS).execute(&mut *c).await?;
        c.execute(sqlx::raw_sql(&objects.schema)).await?;
        // Each function is created only when missing: its name carries its
        // version, and replacing it would need the privileges of its owner.
        for (name, sql) in &objects.functions {
            let missing: bool =
                sqlx::query_scalar("SELECT to_regproc($1) IS NULL").bind(name.as_str()).fetch_one(&mut *c).await?;
            if missing {
                c.execute(sqlx::raw_sql(sql.as_str())).await?;
            }
        }
        tx.commit().await
    })
}

/// Keeps the DDL's notices ("relation … already exists, skipping") from
/// the client for its transaction; warnings and errors still come.
const QUIET: &str = "set_config('client_min_messages', 'warning', true)";

/// Wakes the waiters of this process when a release is announced; every
/// minute, deletes the rows whose lease ended long ago (holders that never
/// released: every other row goes with its release).
async fn listen(mut listener: PgListener, waiters: Arc<Waiters>, pool: PgPool, sweep: String, stop: CancellationToken) {
    let mut sweeps = tokio::time::interval_at(Instant::now() + SWEEP_EVERY, SWEEP_EVERY);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return,
            _ = sweeps.tick() => {
                // Best effort: a row left behind costs space, nothing else.
                let _ = tokio::time::timeout(Duration::from_secs(10), sqlx::query(&sweep).execute(&pool)).await;
                continue;
            }
            next = listener.try_recv() => next,
        };
        match next {
            Ok(Some(notification)) => waiters.wake(notification.payload()),
            // The connection was lost and made again: announcements sent in
            // between are lost, so everyone tries again.
            Ok(None) => waiters.wake_all(),
            Err(e) => {
                tracing::debug!(error = %e, "dlock: the PostgreSQL release listener is down; retrying");
                waiters.wake_all();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(LISTENER_BACKOFF) => {}
                }
            }
        }
    }
}

const SWEEP_EVERY: Duration = Duration::from_secs(60);
const LISTENER_BACKOFF: Duration = Duration::from_millis(250);

/// The acquires of this process parked per key.
#[derive(Debug, Default)]
struct Waiters(Mutex<HashMap<String, Parked>>);

/// The acquires parked on one key.
#[derive(Debug, Default)]
struct Parked {
    notify: Arc<Notify>,
    count: usize,
    /// How many of them want it shared.
    readers: usize,
}

impl Waiters {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Parked>> {
        // Every update is a single insert, increment or removal.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(self: &Arc<Self>, key: &str, mode: LockMode) -> Registration {
        let mut map = self.map();
        let parked = map.entry(key.to_owned()).or_default();
        parked.count += 1;
        let reader = mode == LockMode::Shared;
        parked.readers += usize::from(reader);
        Registration { waiters: self.clone(), key: key.to_owned(), notify: parked.notify.clone(), reader }
    }

    fn count(&self, key: &str) -> usize {
        self.map().get(key).map_or(0, |parked| parked.count)
    }

    /// Wakes whom a release of `key` may let in. One waiter, when none of
    /// them reads: a freed exclusive hold or permit admits one, and waking
    /// them all would send every one of them to the server for nothing.
    /// The one woken either gets the key, and its grant (made while it
    /// waited) announces its own release in turn, or finds it taken by
    /// another process, and its refusal marks that holder's release to be
    /// announced; a waiter that gives up passes its wake-up on (tokio's
    /// `Notify`). Readers wait together: all of them are woken.
    fn wake(&self, key: &str) {
        if let Some(parked) = self.map().get(key) {
            match parked.readers {
                0 => parked.notify.notify_one(),
                _ => parked.notify.notify_waiters(),
            }
        }
    }

    fn wake_all(&self) {
        for parked in self.map().values() {
            parked.notify.notify_waiters();
        }
    }
}

struct Registration {
    waiters: Arc<Waiters>,
    key: String,
    notify: Arc<Notify>,
    reader: bool,
}

impl AsRef<Notify> for Registration {
    fn as_ref(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.waiters.map();
        if let Some(parked) = map.get_mut(&self.key) {
            parked.count = parked.count.saturating_sub(1);
            parked.readers = parked.readers.saturating_sub(usize::from(self.reader));
            if parked.count == 0 {
                map.remove(&self.key);
            }
        }
    }
}

/// How the table writes a mode.
fn mode_text(mode: LockMode) -> String {
    match mode {
        LockMode::Exclusive => "x".into(),
        LockMode::Shared => "s".into(),
        LockMode::Permits { limit } => format!("p{limit}"),
    }
}

fn parse_mode(text: &str) -> Option<LockMode> {
    match text {
        "x" => Some(LockMode::Exclusive),
        "s" => Some(LockMode::Shared),
        _ => text.strip_prefix('p')?.parse().ok().map(|limit| LockMode::Permits { limit }),
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
            let sent = Instant::now();
            Ok(match Renewals::renew(&self.shared, key.as_str(), owner.as_str(), lease).await? {
                true => Renewal::Held { valid_until: sent + lease },
                false => Renewal::Lost,
            })
        })
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
            self.release_any(&req.key, &req.owner, true).await.map(drop)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.shared.fetch(|| sqlx::query("SELECT 1"), Repeat::Safe).await?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_url_that_asks_for_tls_needs_the_feature() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://app@db:5432/app?sslmode={mode}");
            let connect = PgConnectOptions::from_str(&url).expect("a URL");
            let err = check_tls(&connect, false).expect_err(mode).to_string();
            assert!(err.contains("DLOCK_POSTGRES_URL") && err.contains("`tls` feature"), "{err}");
            assert!(check_tls(&connect, true).is_ok(), "{mode}");
        }
        for mode in ["disable", "prefer"] {
            let connect = PgConnectOptions::from_str(&format!("postgres://db/app?sslmode={mode}")).expect("a URL");
            assert!(check_tls(&connect, false).is_ok(), "{mode}");
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
