//! The PostgreSQL store; see [`PostgresStore`].

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgArguments, PgConnection, PgPool, PgRow};
use sqlx::Postgres;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{
    token_well_formed, Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, RecordView, StoredResponse,
    TokenClaim, Usage, TOKEN_BYTES,
};
use crate::backend::{BoxFuture, PostgresBackend};
use crate::error::{Error, Result};
use crate::postgres::durable::{self, after_pin};
use crate::postgres::{check_prefix, column, connect_options, pool, Db, Objects, PostgresOptions, Repeat};

mod begin;
mod inspect;
mod tables;
use tables::Tables;

const STORE: &str = "postgres";
/// The first key of the store's advisory locks ("dloi"): `+0` a key's
/// claims, `+1` a caller's claims outside a transaction, `+2` a token pool.
const KEY_CLASS: i32 = 0x646c_6f69;

const SCHEMA_SQL: &str = include_str!("schema.sql");
const BEGIN_SQL: &str = include_str!("begin.sql");
const SETTLE_SQL: &str = include_str!("settle.sql");
const TOKENS_SQL: &str = include_str!("tokens.sql");
const CLAIM_IN_TX_SQL: &str = include_str!("claim_in_tx.sql");
const COMPLETE_IN_TX_SQL: &str = include_str!("complete_in_tx.sql");
const TALLY_SQL: &str = include_str!("tally.sql");

/// The PostgreSQL store: idempotency records and one-time tokens in two
/// tables of the application's own database, so that a route's writes and
/// its stored answer can be one transaction.
///
/// * **By its own statement** ([`IdempotencyStore::begin`]), as every store
///   does: the record is committed at once, in progress with a lease its
///   request renews. Between the route's writes and the answer's statement
///   the outcome is unknown to a retry, as with Redis.
/// * **Inside the route's transaction** ([`begin_in`](Self::begin_in) and
///   [`complete_in`](Self::complete_in); over HTTP, dlock-axum's
///   `IdempotencyLayer::in_transaction`): the writes and the answer commit
///   together or not at all, so there is no "outcome unknown". A concurrent
///   duplicate is answered "in progress" at once (a transaction-scoped
///   advisory lock on the key), and a transaction idle longer than the
///   claim's lease is rolled back by the server.
///
/// Every statement the store answers on commits to disk before it is
/// answered, whatever the server's `synchronous_commit`; across a crash or
/// a failover it keeps what the lock backend keeps (see the
/// [backend's docs](crate::backend::postgres#restarts-crashes-and-failovers)).
/// Every cap of [`IdempotencyLimits`] holds, per caller and in total; the
/// total may be passed by the claims running at that moment and those
/// committed inside transactions in the last second. How and why:
/// `docs/postgres-design.md`.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use std::time::Duration;
/// use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, PostgresStore, StoredResponse};
/// let store = PostgresStore::connect("postgres://app@127.0.0.1:5432/app", "dlock").await?;
///
/// // A key claimed inside the route's own transaction: the writes and the
/// // stored answer commit together.
/// let mut tx = store.pool().begin().await.map_err(|e| dlock_core::Error::backend("postgres", e.to_string()))?;
/// let terms = ClaimTerms::new(Duration::from_secs(10));
/// if let Begin::New(claim) = store.begin_in(&mut tx, "alice", "k1", "fp", terms).await? {
///     sqlx::query("INSERT INTO payments (amount) VALUES (42)").execute(&mut *tx).await.ok();
///     store.complete_in(&mut tx, &claim, &StoredResponse::new(201, vec![], b"paid".to_vec())).await?;
///     tx.commit().await.map_err(|e| dlock_core::Error::backend("postgres", e.to_string()))?;
/// }
/// assert!(matches!(store.begin("alice", "k1", "fp", terms).await?, Begin::Completed(_)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
    limits: IdempotencyLimits,
}

struct Inner {
    db: Db,
    sql: Statements,
    /// An operator's reads (inspect.rs).
    inspect: inspect::Inspect,
    tables: Tables,
    /// Stops the upkeep (tallies, sweeps), started once the tables are made.
    stop: CancellationToken,
    /// Stops the upkeep when the last clone goes.
    _sweep: DropGuard,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").field("limits", &self.limits).finish_non_exhaustive()
    }
}

/// The statements of one prefix, its names filled in.
struct Statements {
    begin: String,
    /// The first try of `begin_in`: a new record, as a plain statement.
    claim_in_tx: String,
    complete: String,
    /// The first try of `complete_in`, as a plain statement.
    complete_in_tx: String,
    enter: String,
    abandon: String,
    renew_key: String,
    issue: String,
    claim: String,
    renew_token: String,
    spend: String,
    give_back: String,
    sweep: String,
}

/// The quoted names of one prefix's objects.
struct Names {
    keys: String,
    tokens: String,
    tally: String,
    tally_add: String,
    sweep: String,
    expired: String,
    expired_tokens: String,
    token_pool: String,
    begin: String,
    complete: String,
    abandon: String,
    enter: String,
    issue: String,
    claim: String,
}

impl Names {
    fn for_prefix(prefix: &str) -> Result<Self> {
        check_prefix(prefix)?;
        let q = |suffix: &str| format!("\"{prefix}_{suffix}\"");
        Ok(Names {
            keys: q("idem_keys"),
            tokens: q("idem_tokens"),
            tally: q("idem_tally"),
            // A function is made only when missing, so its version is in
            // its name; a file's functions are renamed together.
            tally_add: q("ik_tally_v1"),
            sweep: q("ik_sweep_v2"),
            expired: q("ik_expired_v1"),
            expired_tokens: q("tk_expired_v1"),
            token_pool: q("tk_pool_v2"),
            begin: q("ik_begin_v3"),
            complete: q("ik_done_v2"),
            abandon: q("ik_drop_v2"),
            enter: q("ik_enter_v2"),
            issue: q("tk_issue_v2"),
            claim: q("tk_claim_v2"),
        })
    }

    fn fill(&self, sql: &str) -> String {
        // Index names: the table's name with a suffix, inside its quotes.
        let index = |table: &str, suffix: &str| format!("{}_{suffix}\"", table.trim_end_matches('"'));
        sql.replace("{keys_expiry}", &index(&self.keys, "exp"))
            .replace("{keys_todo}", &index(&self.keys, "todo"))
            .replace("{keys_pending}", &index(&self.keys, "pending"))
            .replace("{tokens_pool}", &index(&self.tokens, "pool"))
            // "ex", not "exp": 63 bytes with the longest prefix.
            .replace("{tokens_expiry}", &index(&self.tokens, "ex"))
            .replace("{keys}", &self.keys)
            .replace("{tokens}", &self.tokens)
            .replace("{tally}", &self.tally)
            .replace("{tally_add}", &self.tally_add)
            .replace("{sweep}", &self.sweep)
            .replace("{expired}", &self.expired)
            .replace("{expired_tokens}", &self.expired_tokens)
            .replace("{token_pool}", &self.token_pool)
            .replace("{begin}", &self.begin)
            .replace("{complete}", &self.complete)
            .replace("{abandon}", &self.abandon)
            .replace("{enter}", &self.enter)
            .replace("{issue}", &self.issue)
            .replace("{claim}", &self.claim)
            .replace("{class}", &KEY_CLASS.to_string())
            .replace("{durable}", durable::PIN)
    }

    fn objects(&self) -> Objects {
        Objects {
            what: "creating the idempotency tables",
            schema: self.fill(SCHEMA_SQL),
            functions: vec![
                (self.tally_add.clone(), self.fill(TALLY_SQL)),
                (self.begin.clone(), self.fill(BEGIN_SQL)),
                // Each file makes several; it is run when its first is missing.
                (self.complete.clone(), self.fill(SETTLE_SQL)),
                (self.issue.clone(), self.fill(TOKENS_SQL)),
            ],
        }
    }

    /// The statements, each pinning its commit durable (`durable.rs`),
    /// except the upkeep's (`enter`, `sweep`), which a crash only repeats.
    fn statements(&self) -> Statements {
        let f = |sql: &str| self.fill(sql);
        // Every function's first argument is text: the scope, or the token.
        let first = after_pin("$1::text");
        Statements {
            begin: f(&format!(
                "SELECT r_outcome, r_response, r_retry_ms FROM {{begin}}({first}, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
            )),
            claim_in_tx: f(CLAIM_IN_TX_SQL),
            complete: f(&format!("SELECT r_outcome, r_retry_ms FROM {{complete}}({first}, $2, $3, $4, $5, $6)")),
            complete_in_tx: f(COMPLETE_IN_TX_SQL),
            abandon: f(&format!("SELECT {{abandon}}({first}, $2, $3)")),
            enter: f("SELECT {enter}()"),
            renew_key: f("UPDATE {keys} AS k SET lease_until = clock_timestamp() + $4 * interval '1 millisecond' \
                 WHERE k.scope = $1 AND k.key = $2 AND k.owner = $3 AND k.response IS NULL \
                 AND k.lease_until > clock_timestamp() AND {durable} IS NOT NULL RETURNING 1"),
            issue: f(&format!("SELECT r_outcome, r_retry_ms FROM {{issue}}({first}, $2, $3, $4, $5)")),
            claim: f(&format!("SELECT {{claim}}({first}, $2, $3, $4)")),
            renew_token: f("UPDATE {tokens} AS t SET lease_until = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE t.token = $1 AND t.owner = $2 AND t.lease_until > clock_timestamp() \
                 AND {durable} IS NOT NULL RETURNING 1"),
            spend: f("WITH gone AS (DELETE FROM {tokens} AS t WHERE t.token = $1 AND t.owner = $2 \
                 AND t.principal IS NOT DISTINCT FROM $3 AND t.expires_at > clock_timestamp() \
                 AND {durable} IS NOT NULL RETURNING t.principal, t.token) \
                 SELECT {tally_add}(ARRAY[{token_pool}(g.principal)], ARRAY[hashtext(g.token) & 15], \
                 ARRAY[-1::bigint], ARRAY[0::bigint]) FROM gone AS g"),
            give_back: f("UPDATE {tokens} AS t SET owner = NULL, lease_until = NULL WHERE t.token = $1 \
                 AND t.owner = $2 AND t.principal IS NOT DISTINCT FROM $3 AND t.expires_at > clock_timestamp() \
                 AND {durable} IS NOT NULL RETURNING 1"),
            // Never waits for a row a running transaction holds.
            sweep: f("SELECT {sweep}(NULL, 60000)"),
        }
    }
}

impl PostgresStore {
    /// Connects with default [`PostgresOptions`]; see
    /// [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    ///
    /// As [`connect_with`](Self::connect_with).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, PostgresOptions::default()).await
    }

    /// Connects to the database at `url` and creates the tables and
    /// functions of `prefix` (`<prefix>_idem_keys`, `<prefix>_idem_tokens`)
    /// when they are missing. The store's requests keep at most half of
    /// `options`' connections; the rest is for transactions begun on
    /// [`pool`](Self::pool).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_POSTGRES_URL` for a URL that does not
    /// parse, refused credentials, a user that may not create the tables or
    /// a server that does not let dlock set `synchronous_commit`, naming `DLOCK_PREFIX` for a prefix that cannot name them;
    /// [`Error::Backend`] when the server cannot be reached in time.
    pub async fn connect_with(url: &str, prefix: &str, options: PostgresOptions) -> Result<Self> {
        let connect = connect_options(url, &options)?;
        let db = Db::keeping(pool(connect, &options), options.response_timeout());
        Self::on(db, prefix).await
    }

    /// A store on the application's own pool, so that its routes' writes
    /// and their records can be one transaction ([`begin_in`](Self::begin_in)).
    /// Each of the store's own requests is bounded by 2 seconds.
    ///
    /// # Errors
    ///
    /// As [`connect_with`](Self::connect_with).
    pub async fn with_pool(pool: PgPool, prefix: &str) -> Result<Self> {
        let db = Db::new(pool, PostgresOptions::default().response_timeout());
        Self::on(db, prefix).await
    }

    /// A store on the lock backend's pool and prefix, its tables made now
    /// when missing. (The one [`Config::build`](crate::Config::build) keeps
    /// beside PostgreSQL locks makes them on its first use instead.)
    ///
    /// # Errors
    ///
    /// As [`connect_with`](Self::connect_with).
    pub async fn from_backend(backend: &PostgresBackend) -> Result<Self> {
        let store = Self::on_first_use(backend)?;
        store.tables().await?;
        Ok(store)
    }

    /// A store on the lock backend's pool and prefix that makes its tables
    /// on first use (the one [`Config::build`](crate::Config::build) keeps
    /// beside PostgreSQL locks). The backend's connect already checked the
    /// server and the user.
    pub(crate) fn on_first_use(backend: &PostgresBackend) -> Result<Self> {
        let prefix = crate::backend::Backend::prefix(backend).unwrap_or("dlock").to_owned();
        Self::lazily(backend.db().clone(), &prefix)
    }

    async fn on(db: Db, prefix: &str) -> Result<Self> {
        let store = Self::lazily(db, prefix)?;
        store.tables().await?;
        Ok(store)
    }

    /// The store, its tables not made yet.
    fn lazily(db: Db, prefix: &str) -> Result<Self> {
        let names = Names::for_prefix(prefix)?;
        let stop = CancellationToken::new();
        let inner = Inner {
            db,
            sql: names.statements(),
            inspect: inspect::Inspect::new(|sql| names.fill(sql)),
            tables: Tables::new(names.objects()),
            _sweep: stop.clone().drop_guard(),
            stop,
        };
        Ok(PostgresStore { inner: Arc::new(inner), limits: IdempotencyLimits::default() })
    }

    /// The store's requests, its tables made first when they are not yet
    /// (once: afterwards this is a look at a flag).
    async fn db(&self) -> Result<&Db> {
        self.tables().await?;
        Ok(&self.inner.db)
    }

    /// Makes the tables when this store has not made them yet, and starts
    /// the upkeep on them.
    async fn tables(&self) -> Result<()> {
        let inner = &self.inner;
        inner
            .tables
            .make(&inner.db, || {
                let (enter, sweep) = (inner.sql.enter.clone(), inner.sql.sweep.clone());
                tokio::spawn(upkeep(inner.db.pool.clone(), enter, sweep, inner.stop.clone()));
            })
            .await
    }

    /// Replaces the caps on live records, their bytes and tokens.
    pub fn with_limits(mut self, limits: IdempotencyLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The pool the store runs on: a route's transaction begun on it
    /// ([`begin_transaction`](Self::begin_transaction)) claims its key in
    /// the same database with [`begin_in`](Self::begin_in).
    pub fn pool(&self) -> &PgPool {
        &self.inner.db.pool
    }

    /// The bound of each of the store's requests (the connection's
    /// response timeout; 2 seconds on a pool of [`with_pool`](Self::with_pool)),
    /// which also bounds [`begin_transaction`](Self::begin_transaction).
    ///
    /// ```no_run
    /// # async fn demo(store: dlock_core::idempotency::PostgresStore) {
    /// assert!(store.response_timeout() > std::time::Duration::ZERO);
    /// # }
    /// ```
    pub fn response_timeout(&self) -> Duration {
        self.inner.db.response_timeout
    }

    /// Claims `key` within `scope` inside the transaction open on `conn`,
    /// as [`IdempotencyStore::begin`] answers: [`Begin::New`] — run the
    /// route in this transaction, then [`complete_in`](Self::complete_in)
    /// and commit; anything else — roll back and answer it.
    ///
    /// The claim lasts as long as the transaction, which the server ends
    /// once it stays idle for `terms.lease()`; its commit is made durable.
    /// A rollback leaves no record: a retry runs the route again. Use
    /// `READ COMMITTED` (the default): under an earlier snapshot a record
    /// committed just before the claim is not seen, and the claim fails.
    ///
    /// # Errors
    ///
    /// [`Error::IdempotencyFull`] at the caller's cap (`per_scope: true`) or
    /// the store's total; [`Error::Backend`] when the statement fails (the
    /// transaction is then to be rolled back).
    pub fn begin_in<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            let claim = Claim::new(scope, key)?;
            self.tables().await?;
            let first = claim_args(&self.inner.sql.claim_in_tx, &claim, fingerprint, terms)
                .bind(count(self.limits.max_per_scope()))
                .bind(count(self.limits.max_records()));
            if let Some(row) = self.in_tx(first.fetch_optional(&mut *conn)).await? {
                // The tally's bytes as read, for complete_in_tx.
                let read = TallyBytes { caller: column(&row, 3)?, total: column(&row, 4)? };
                return self.begun(&row, claim.with_memo(read.memo()));
            }
            let row = self.in_tx(self.begin_query(&claim, fingerprint, terms, true).fetch_one(conn)).await?;
            self.begun(&row, claim)
        })
    }

    /// Stores `response` as the answer of `claim` inside the transaction
    /// open on `conn` (the one [`begin_in`](Self::begin_in) claimed it in):
    /// it is kept if and only if that transaction commits. `Ok(false)` when
    /// the claim is not this transaction's.
    ///
    /// # Errors
    ///
    /// [`Error::IdempotencyFull`] when the answer's bytes do not fit the
    /// caller's cap or the store's total (nothing stored: store a smaller
    /// answer, or roll back);
    /// [`Error::Backend`] when the statement fails.
    pub fn complete_in<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            self.tables().await?;
            let encoded = response.encode();
            // Only a claim made by claim_in_tx carries its tally's bytes.
            if let Some(read) = TallyBytes::from_memo(&claim.memo) {
                let first = self
                    .complete_query(&self.inner.sql.complete_in_tx, claim, &encoded)
                    .bind(read.caller)
                    .bind(read.total);
                if let Some(row) = self.in_tx(first.fetch_optional(&mut *conn)).await? {
                    return completed(&row);
                }
            }
            let row =
                self.in_tx(self.complete_query(&self.inner.sql.complete, claim, &encoded).fetch_one(conn)).await?;
            completed(&row)
        })
    }

    /// A statement on the caller's transaction, within the response timeout.
    async fn in_tx<T>(
        &self,
        query: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
    ) -> Result<T> {
        let timeout = self.inner.db.response_timeout;
        match tokio::time::timeout(timeout, query).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(Error::Backend {
                backend: STORE,
                message: format!("an idempotency statement in the route's transaction failed: {e}"),
                source: Some(Box::new(e)),
            }),
            Err(_) => Err(Error::backend(STORE, format!("PostgreSQL did not answer within {timeout:?}"))),
        }
    }

    fn begin_query<'q>(
        &'q self,
        claim: &'q Claim,
        fingerprint: &'q str,
        terms: ClaimTerms,
        in_tx: bool,
    ) -> sqlx::query::Query<'q, Postgres, PgArguments> {
        claim_args(&self.inner.sql.begin, claim, fingerprint, terms)
            .bind(terms.runs_again_after_lease())
            .bind(in_tx)
            .bind(count(self.limits.max_per_scope()))
            .bind(count(self.limits.max_records()))
    }

    /// `sql` (`complete`, or its first try `complete_in_tx`, which takes
    /// two more) bound for `claim`, its encoded answer and the byte caps.
    fn complete_query<'q>(
        &'q self,
        sql: &'q str,
        claim: &'q Claim,
        encoded: &'q [u8],
    ) -> sqlx::query::Query<'q, Postgres, PgArguments> {
        sqlx::query(sql)
            .bind(claim.scope())
            .bind(claim.key())
            .bind(claim.owner())
            .bind(encoded)
            .bind(count(self.limits.max_bytes_per_scope()))
            .bind(count(self.limits.max_bytes()))
    }

    fn begun(&self, row: &PgRow, claim: Claim) -> Result<Begin> {
        let outcome: i32 = column(row, 0)?;
        Ok(match outcome {
            0 => Begin::New(claim),
            1 => Begin::InProgress,
            2 => {
                let bytes: Option<Vec<u8>> = column(row, 1)?;
                Begin::Completed(StoredResponse::decode(&bytes.unwrap_or_default())?)
            }
            3 => Begin::Mismatch,
            4 => Begin::OutcomeUnknown,
            5 => return Err(full(true, column(row, 2)?)),
            6 => return Err(full(false, column(row, 2)?)),
            other => return Err(unexpected(&format!("begin answered {other}"))),
        })
    }

    async fn issue(&self, principal: Option<&str>, ttl: Duration) -> Result<String> {
        let token = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let max = match principal {
            Some(_) => self.limits.max_per_scope(),
            None => self.limits.max_unbound_tokens(),
        };
        // Bound tokens are counted in total too, with the records' cap.
        let query = || {
            sqlx::query(&self.inner.sql.issue)
                .bind(&token)
                .bind(principal)
                .bind(millis(ttl).max(1))
                .bind(count(max))
                .bind(count(self.limits.max_records()))
        };
        let row = self.db().await?.fetch(query, Repeat::Once).await?.ok_or_else(|| unexpected("no row"))?;
        match column::<i32>(&row, 0)? {
            0 => Ok(token),
            // The unbound tokens' pool is no caller's.
            5 => Err(full(principal.is_some(), column(&row, 1)?)),
            6 => Err(full(false, column(&row, 1)?)),
            other => Err(unexpected(&format!("issue answered {other}"))),
        }
    }

    /// Whether a statement that returns a row per change changed one.
    async fn changed<'q, F>(&self, make: F, repeat: Repeat) -> Result<bool>
    where
        F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
    {
        Ok(!self.db().await?.fetch_all(make, repeat).await?.is_empty())
    }
}

/// `sql` (`begin`, or its first try `claim_in_tx`) with the parameters the
/// two share first: scope, key, fingerprint, owner, lease and ttl in ms.
fn claim_args<'q>(
    sql: &'q str,
    claim: &'q Claim,
    fingerprint: &'q str,
    terms: ClaimTerms,
) -> sqlx::query::Query<'q, Postgres, PgArguments> {
    sqlx::query(sql)
        .bind(claim.scope())
        .bind(claim.key())
        .bind(fingerprint)
        .bind(claim.owner())
        .bind(millis(terms.lease()).max(1))
        .bind(millis(terms.ttl()).max(1))
}

fn completed(row: &PgRow) -> Result<bool> {
    match column::<i32>(row, 0)? {
        1 => Ok(true),
        0 => Ok(false),
        5 => Err(full(true, column(row, 1)?)),
        6 => Err(full(false, column(row, 1)?)),
        other => Err(unexpected(&format!("complete answered {other}"))),
    }
}

/// The refusal of a full store: the caller's cap (`per_scope`) or the
/// store's total, `retry_ms` before its oldest entry expires.
fn full(per_scope: bool, retry_ms: i64) -> Error {
    Error::IdempotencyFull { per_scope, retry_after: Duration::from_millis(u64::try_from(retry_ms).unwrap_or(1)) }
}

/// The tally's bytes (caller's and total) as claim_in_tx.sql read them,
/// kept in the claim's memo for complete_in_tx.sql.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TallyBytes {
    caller: i64,
    total: i64,
}

impl TallyBytes {
    fn memo(self) -> String {
        format!("{}:{}", self.caller, self.total)
    }

    /// `None` for a claim made otherwise (its memo is empty).
    fn from_memo(memo: &str) -> Option<Self> {
        let (caller, total) = memo.split_once(':')?;
        Some(TallyBytes { caller: caller.parse().ok()?, total: total.parse().ok()? })
    }
}

fn unexpected(what: &str) -> Error {
    Error::backend(STORE, format!("unexpected answer from the idempotency tables: {what}"))
}

/// Whole milliseconds, as PostgreSQL's `bigint`.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A cap as PostgreSQL's `bigint`.
fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Every second, enters the records committed inside transactions in their
/// callers' tallies; every minute, deletes rows expired over a minute ago.
/// Neither waits for a row a running transaction holds.
async fn upkeep(pool: PgPool, enter: String, sweep: String, stop: CancellationToken) {
    let start = tokio::time::Instant::now();
    let mut entering = tokio::time::interval_at(start + ENTER_EVERY, ENTER_EVERY);
    let mut sweeping = tokio::time::interval_at(start + SWEEP_EVERY, SWEEP_EVERY);
    for ticks in [&mut entering, &mut sweeping] {
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    let bound = Duration::from_secs(10);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = entering.tick() => {
                // A full batch may leave more: the tally must keep up.
                while let Ok(Ok(ENTER_BATCH..)) =
                    tokio::time::timeout(bound, sqlx::query_scalar::<_, i64>(&enter).fetch_one(&pool)).await
                {
                    if stop.is_cancelled() {
                        return;
                    }
                }
            }
            _ = sweeping.tick() => {
                let _ = tokio::time::timeout(bound, sqlx::query(&sweep).execute(&pool)).await;
            }
        }
    }
}

/// The most records one call of `enter` (settle.sql) takes: its `LIMIT`.
const ENTER_BATCH: i64 = 1000;

const ENTER_EVERY: Duration = Duration::from_secs(1);
const SWEEP_EVERY: Duration = Duration::from_secs(60);

impl IdempotencyStore for PostgresStore {
    fn name(&self) -> &'static str {
        STORE
    }

    /// The server answers; tables not made yet are not made for a probe.
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.inner.db.fetch(|| sqlx::query("SELECT 1"), Repeat::Safe).await?;
            Ok(())
        })
    }

    fn issue_token<'a>(&'a self, principal: Option<&'a str>, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(self.issue(principal, ttl))
    }

    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(TokenClaim::Unknown);
            }
            let claim = Claim::token(token, principal)?;
            let query = || {
                sqlx::query(&self.inner.sql.claim)
                    .bind(token)
                    .bind(principal)
                    .bind(claim.owner())
                    .bind(millis(lease).max(1))
            };
            let row = match self.db().await?.fetch(query, Repeat::Once).await {
                Ok(row) => row.ok_or_else(|| unexpected("no row"))?,
                Err(e) => {
                    if e.outcome_unknown() {
                        super::give_back_later(self, claim, lease);
                    }
                    return Err(e);
                }
            };
            Ok(match column::<i32>(&row, 0)? {
                0 => TokenClaim::Claimed(claim),
                1 => TokenClaim::InUse,
                2 => TokenClaim::OutcomeUnknown,
                _ => TokenClaim::Unknown,
            })
        })
    }

    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.changed(
            || sqlx::query(&self.inner.sql.spend).bind(claim.key()).bind(claim.owner()).bind(claim.principal()),
            Repeat::Once,
        ))
    }

    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.changed(
            || sqlx::query(&self.inner.sql.give_back).bind(claim.key()).bind(claim.owner()).bind(claim.principal()),
            Repeat::Once,
        ))
    }

    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            let claim = Claim::new(scope, key)?;
            let query = || self.begin_query(&claim, fingerprint, terms, false);
            match self.db().await?.fetch(query, Repeat::Once).await {
                Ok(Some(row)) => self.begun(&row, claim),
                Ok(None) => Err(unexpected("no row")),
                Err(e) => {
                    if e.outcome_unknown() {
                        super::give_back_later(self, claim, terms.lease());
                    }
                    Err(e)
                }
            }
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        let ms = millis(lease).max(1);
        if claim.is_token() {
            return Box::pin(self.changed(
                move || sqlx::query(&self.inner.sql.renew_token).bind(claim.key()).bind(claim.owner()).bind(ms),
                Repeat::Safe,
            ));
        }
        Box::pin(self.changed(
            move || {
                sqlx::query(&self.inner.sql.renew_key)
                    .bind(claim.scope())
                    .bind(claim.key())
                    .bind(claim.owner())
                    .bind(ms)
            },
            Repeat::Safe,
        ))
    }

    fn complete<'a>(&'a self, claim: &'a Claim, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let encoded = response.encode();
            let row = self
                .db()
                .await?
                .fetch(|| self.complete_query(&self.inner.sql.complete, claim, &encoded), Repeat::Once)
                .await?
                .ok_or_else(|| unexpected("no row"))?;
            completed(&row)
        })
    }

    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let query =
                || sqlx::query(&self.inner.sql.abandon).bind(claim.scope()).bind(claim.key()).bind(claim.owner());
            let row = self.db().await?.fetch(query, Repeat::Once).await?.ok_or_else(|| unexpected("no row"))?;
            Ok(column::<Option<bool>>(&row, 0)?.unwrap_or(false))
        })
    }

    fn inspect_record<'a>(&'a self, scope: &'a str, key: &'a str) -> BoxFuture<'a, Result<Option<RecordView>>> {
        Box::pin(self.record_in_table(scope, key))
    }

    fn stuck_records(&self, limit: usize) -> BoxFuture<'_, Result<Vec<RecordView>>> {
        Box::pin(self.stuck_in_table(limit))
    }

    fn usage<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Usage>> {
        Box::pin(self.usage_in_tally(scope))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_all_filled_and_names_fit() {
        let names = Names::for_prefix(&"p".repeat(48)).expect("valid");
        for sql in [SCHEMA_SQL, BEGIN_SQL, SETTLE_SQL, TOKENS_SQL, CLAIM_IN_TX_SQL, COMPLETE_IN_TX_SQL, TALLY_SQL] {
            let filled = names.fill(sql);
            for placeholder in
                ["{keys", "{tokens", "{class", "{tally", "{sweep", "{expired", "{token_pool", "{begin", "{complete"]
            {
                assert!(!filled.contains(placeholder), "{placeholder} in {filled}");
            }
        }
        // PostgreSQL cuts names at 63 bytes: two would then collide.
        for name in [
            &names.keys,
            &names.tokens,
            &names.begin,
            &names.complete,
            &names.abandon,
            &names.issue,
            &names.claim,
            &names.expired,
            &names.expired_tokens,
            &names.tally_add,
        ] {
            assert!(name.len() - 2 <= 63, "{name}");
        }
        assert!(names.fill("{keys_expiry}").len() - 2 <= 63);
        assert!(names.fill("{keys_todo}").len() - 2 <= 63);
        assert!(names.fill("{tokens_expiry}").len() - 2 <= 63);
    }

    #[test]
    fn a_claims_tally_bytes_round_trip_through_its_memo() {
        let read = TallyBytes { caller: 56, total: 1 << 40 };
        assert_eq!(TallyBytes::from_memo(&read.memo()), Some(read));
        assert_eq!(TallyBytes::from_memo(""), None);
        assert_eq!(TallyBytes::from_memo("56"), None);
    }
}
