//! PostgreSQL (issue 27): dlock's lock backend against the locks people
//! write by hand on PostgreSQL, and the transactional idempotency route
//! against the same route without idempotency, on a cluster the bench
//! starts on loopback (`fsync=off`, as the tests' clusters: every row pays
//! the same commits, none of them a disk flush).
//!
//! * uncontended acquire+release, each task its own key, at concurrency 1,
//!   16 and 64, every implementation on a pool of 16 connections:
//!   * `dlock` — the `postgres` backend (lease table, fencing sequence,
//!     two function calls per cycle);
//!   * `lease` — a hand-written lease lock: `INSERT … ON CONFLICT DO UPDATE
//!     … WHERE expires_at < now()` to take, an owner-checked `DELETE` to
//!     give back (no fencing, no wake-ups);
//!   * `lease-fenced` — the same lease lock handing out a fencing token the
//!     way tokens must be drawn to follow the order of grants: `nextval`
//!     under a transaction-level advisory lock on the key (see the backend's
//!     take.sql). The least a fenced lease lock costs, with no wake-ups:
//!     its ratio to `lease` is the price of the token itself;
//!   * `advisory` — `pg_try_advisory_lock` / `pg_advisory_unlock` on one
//!     pooled connection (a session lock: no lease, no fencing).
//!
//!   Targets: dlock ≥ [`VS_LEASE`] × `lease` and ≥ [`VS_FENCED`] ×
//!   `lease-fenced`, each the median of per-round ratios.
//! * strict handoff on one key, K = 8: `dlock` (LISTEN/NOTIFY wake-ups),
//!   `lease` (its waiters poll every millisecond: a hand-written lease lock
//!   has no wake-up) and `advisory` (`pg_advisory_lock` waits in the server,
//!   a connection per waiter).
//! * a route that inserts one row in a transaction: `route` (it begins and
//!   commits its own) against `in-transaction` (the same insert through
//!   `IdempotencyLayer::in_transaction`: claim, insert, stored answer, one
//!   commit), each request a new key. Target: ≥ [`TX_VS_ROUTE`] × `route`.
//!   Beside them `hand-tx`, the least a transactional idempotency key can
//!   cost: the route's own transaction with an `INSERT … ON CONFLICT DO
//!   NOTHING` of the key before its insert and an `UPDATE` of the answer
//!   after it (no caller scope, no fingerprint, no caps, and a duplicate
//!   waits on the unique index instead of being refused): the floor of the
//!   design, in round trips and in rows written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::{IdempotencyLayer, Tx};
use dlock_axum::Caller;
use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::{AcquireRequest, Backend, Release};
use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyLimits, PostgresStore, StoredResponse};
use dlock_core::{LockKey, Locker, LockerOptions, Owner};
use dlock_testing::PostgresServer;
use redis::aio::MultiplexedConnection;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Executor;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::args::Args;
use crate::backends::without_commands;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::{slot_key, slot_keys, BenchLock, DlockLock, LEASE};
use crate::measure::{median, run_window, Sample, Timing};
use crate::pin::Pinning;
use crate::report::Row;
use crate::series::{target, Series};
use crate::{handoff, uncontended};

/// dlock's uncontended cycles at least this times the hand-written lease lock's.
pub(crate) const VS_LEASE: f64 = 0.9;
/// dlock's uncontended cycles at least this times the fenced lease lock's
/// (`lease-fenced`): a lock that hands out tokens cannot be held to one
/// that does not, which is what that row is for.
pub(crate) const VS_FENCED: f64 = 0.9;
/// The transactional idempotency route at least this times the route alone.
pub(crate) const TX_VS_ROUTE: f64 = 0.8;

const CONCURRENCY: &[usize] = &[1, 16, 64];
const CONTENDERS: usize = 8;
/// Tasks sending requests to the routes at once.
const REQUESTS_AT_ONCE: usize = 16;
/// Connections of every pool: the backend's default.
const POOL: u32 = 16;

pub(crate) const TITLE: &str = "postgres: uncontended acquire+release, each task its own key, pools of 16 \
     connections (ratio = vs the hand-written lease lock, same round)";
pub(crate) const HANDOFF_TITLE: &str = "postgres: strict handoff on one key, K = 8 (latency = release() called -> \
     next acquire returned; lease = hand-written lease lock polled every 1 ms; advisory = pg_advisory_lock)";
pub(crate) const ROUTE_TITLE: &str = "postgres: a route that inserts one row in a transaction, in-process router, \
     16 requests at once (ratio = vs the route alone, same round)";

/// Which hand-written lock a [`HandLock`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hand {
    /// The lease lock of the `lease` row.
    Lease,
    /// The lease lock that also draws a fencing token per grant
    /// (`lease-fenced`).
    Fenced,
    /// Session advisory locks (`advisory`).
    Advisory,
}

/// The lease locks' statements: take ($1 key, $2 owner, $3 lease ms) and
/// release ($1 key, $2 owner). The plain take answers by its command tag,
/// the fenced one with the token, as a lock that hands tokens out must.
const LEASE_TAKE: &str = "INSERT INTO bench_lease (key, owner, expires_at) \
     VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond') \
     ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at \
     WHERE bench_lease.expires_at < clock_timestamp()";
const LEASE_RELEASE: &str = "DELETE FROM bench_lease WHERE key = $1 AND owner = $2";
const FENCED_TAKE: &str = "INSERT INTO bench_fenced (key, owner, fence, expires_at) VALUES ($1, $2, \
     CASE WHEN pg_advisory_xact_lock(hashtext('bench_fenced'), hashtext($1))::text = '' \
     THEN nextval('bench_fence') END, clock_timestamp() + $3 * interval '1 millisecond') \
     ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, \
     expires_at = EXCLUDED.expires_at WHERE bench_fenced.expires_at < clock_timestamp() RETURNING fence";
const FENCED_RELEASE: &str = "DELETE FROM bench_fenced WHERE key = $1 AND owner = $2";

/// What a hand-written lock holds until it releases.
pub(crate) enum PgHeld {
    /// A lease row of this owner.
    Lease { slot: usize, owner: u64 },
    /// A session lock on this pooled connection.
    Advisory { slot: usize, conn: sqlx::pool::PoolConnection<sqlx::Postgres> },
}

/// The hand-written PostgreSQL locks.
pub(crate) struct HandLock {
    pool: PgPool,
    kind: Hand,
    /// Slots are keys `<name>:<slot>` (lease) or `<base> + slot` (advisory).
    name: String,
    base: i64,
    owners: AtomicU64,
}

impl HandLock {
    fn key(&self, slot: usize) -> String {
        format!("{}:{slot}", self.name)
    }
}

fn pg(e: sqlx::Error) -> BenchError {
    BenchError::Invariant(format!("postgres: {e}"))
}

impl BenchLock for HandLock {
    type Held = PgHeld;

    async fn acquire(&self, slot: usize, wait: bool) -> Result<PgHeld> {
        if self.kind == Hand::Advisory {
            let mut conn = self.pool.acquire().await.map_err(pg)?;
            let id = self.base + slot as i64;
            if wait {
                sqlx::query("SELECT pg_advisory_lock($1)").bind(id).execute(&mut *conn).await.map_err(pg)?;
            } else {
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(id)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(pg)?;
                if !got {
                    return Err(BenchError::Invariant("an uncontended advisory lock was held".into()));
                }
            }
            return Ok(PgHeld::Advisory { slot, conn });
        }
        let owner = self.owners.fetch_add(1, Ordering::Relaxed);
        let fenced = self.kind == Hand::Fenced;
        loop {
            let take = sqlx::query(if fenced { FENCED_TAKE } else { LEASE_TAKE })
                .bind(self.key(slot))
                .bind(owner as i64)
                .bind(LEASE.as_millis() as i64);
            let taken = if fenced {
                take.fetch_optional(&self.pool).await.map_err(pg)?.is_some()
            } else {
                take.execute(&self.pool).await.map_err(pg)?.rows_affected() == 1
            };
            if taken {
                return Ok(PgHeld::Lease { slot, owner });
            }
            if !wait {
                return Err(BenchError::Invariant("an uncontended lease lock was held".into()));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn release(&self, held: PgHeld) -> Result<()> {
        let freed = match held {
            PgHeld::Lease { slot, owner } => {
                sqlx::query(if self.kind == Hand::Fenced { FENCED_RELEASE } else { LEASE_RELEASE })
                    .bind(self.key(slot))
                    .bind(owner as i64)
                    .execute(&self.pool)
                    .await
                    .map_err(pg)?
                    .rows_affected()
                    == 1
            }
            PgHeld::Advisory { slot, mut conn } => sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(self.base + slot as i64)
                .fetch_one(&mut *conn)
                .await
                .map_err(pg)?,
        };
        if freed {
            Ok(())
        } else {
            Err(BenchError::Invariant("a hand-written lock was not held at release".into()))
        }
    }

    fn script_internal_commands(&self) -> &'static [&'static str] {
        &[]
    }

    async fn leftovers(&self, _: &MultiplexedConnection) -> Result<Vec<String>> {
        // Not in Redis: [`left_in_postgres`] checks the table.
        Ok(Vec::new())
    }
}

/// dlock's PostgreSQL backend called directly, past the engine (no hold
/// table, no guard, no watchdog): beside `dlock` and `lease` it tells the
/// engine's share of a cycle from the statements'.
pub(crate) struct BackendLock {
    backend: Arc<PostgresBackend>,
    keys: Vec<LockKey>,
    cancel: CancellationToken,
}

impl BackendLock {
    fn new(backend: Arc<PostgresBackend>, locker: &Locker, name: &str, slots: usize) -> Result<Self> {
        Ok(BackendLock { backend, keys: slot_keys(locker, name, slots)?, cancel: CancellationToken::new() })
    }

    fn key(&self, slot: usize) -> Result<&LockKey> {
        slot_key(&self.keys, slot)
    }
}

impl BenchLock for BackendLock {
    type Held = (usize, Owner);

    async fn acquire(&self, slot: usize, wait: bool) -> Result<(usize, Owner)> {
        let owner = Owner::random()?;
        let mut req = AcquireRequest::new(self.key(slot)?.clone(), owner.clone(), LEASE);
        if wait {
            req = req.with_deadline(tokio::time::Instant::now() + Duration::from_secs(30));
        }
        self.backend.acquire(&req, &self.cancel).await?;
        Ok((slot, owner))
    }

    async fn release(&self, (slot, owner): (usize, Owner)) -> Result<()> {
        match self.backend.release(self.key(slot)?, &owner).await? {
            Release::Freed => Ok(()),
            other => Err(BenchError::Invariant(format!("backend: a release answered {other:?}"))),
        }
    }

    fn script_internal_commands(&self) -> &'static [&'static str] {
        &[]
    }

    async fn leftovers(&self, _: &MultiplexedConnection) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
}

/// Rows of live locks left in PostgreSQL once every hold was released: a
/// lock that never frees its rows would look fast.
async fn left_in_postgres(pool: &PgPool) -> Result<i64> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM bench_lease) + (SELECT count(*) FROM bench_fenced) + (SELECT count(*) FROM bench_locks WHERE expires_at > clock_timestamp()) \
         + (SELECT count(*) FROM bench_holders WHERE mode <> 'i') \
         + (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 AND objsubid = 1)",
    )
    .fetch_one(pool)
    .await
    .map_err(pg)
}

/// The servers and pools of one run.
struct Under {
    /// Stopped when the run drops it.
    _server: PostgresServer,
    backend: Arc<PostgresBackend>,
    locker: Locker,
    pool: PgPool,
}

async fn start(pinning: &Pinning) -> Result<Under> {
    let server = std::panic::catch_unwind(PostgresServer::start).map_err(|_| {
        BenchError::Server("PostgreSQL did not start (see above; apt-get install -y postgresql)".into())
    })?;
    // The server's CPU, as for Redis: started from this process, it would
    // otherwise share the benchmark's CPU and leave the other idle.
    let pids = server.pids();
    if pids.is_empty() {
        return Err(BenchError::Server("PostgreSQL runs, and its postmaster.pid names no process".into()));
    }
    pinning.server(pids.first().copied()).map_err(BenchError::Server)?;
    for &child in &pids[1..] {
        // One that exited meanwhile (an autovacuum worker) needs no CPU.
        let _ = pinning.server(Some(child));
    }
    let options = PostgresOptions::default().with_max_connections(POOL);
    let backend = Arc::new(PostgresBackend::connect_with(&server.url(), "bench", options).await?);
    let locker =
        Locker::with_options(backend.clone() as Arc<dyn Backend>, LockerOptions::default().with_prefix("bench"))?;
    // Set as dlock's own pool is: sqlx's default pings a connection before
    // each use, a round trip the hand-written rows would pay and dlock not.
    let pool = PgPoolOptions::new()
        .max_connections(POOL)
        .test_before_acquire(false)
        .connect(&server.url())
        .await
        .map_err(pg)?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_lease (key text PRIMARY KEY, owner bigint NOT NULL, expires_at timestamptz NOT NULL); \
         CREATE TABLE IF NOT EXISTS bench_fenced (key text PRIMARY KEY, owner bigint NOT NULL, fence bigint NOT NULL, \
           expires_at timestamptz NOT NULL); \
         CREATE SEQUENCE IF NOT EXISTS bench_fence AS bigint; \
         CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, note text NOT NULL); \
         CREATE TABLE IF NOT EXISTS bench_idem (key text PRIMARY KEY, status int, body bytea)",
    )
    .execute(&pool)
    .await
    .map_err(pg)?;
    Ok(Under { _server: server, backend, locker, pool })
}

fn hand(pool: &PgPool, kind: Hand, name: String, base: i64) -> HandLock {
    HandLock { pool: pool.clone(), kind, name, base, owners: AtomicU64::new(0) }
}

/// Runs every round and returns the rows: the locks' (when `locks`) and
/// the routes'.
pub(crate) async fn run(env: &Env, args: &Args, locks: bool) -> Result<Vec<Row>> {
    let under = start(&env.pinning).await?;
    let mut rows = Vec::new();
    if locks {
        rows = lock_rows(&under, args).await?;
    }
    let timing = Timing { warmup: args.warmup, duration: args.duration.max(Duration::from_millis(200)) };
    rows.extend(routes(&under, args, timing).await?);
    drop(under);
    Ok(rows)
}

/// The uncontended and handoff rounds of every lock.
async fn lock_rows(under: &Under, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration.max(Duration::from_millis(200)) };
    let imps = ["dlock", "lease", "advisory", "backend", "lease-fenced"];
    let mut unc: Vec<Vec<Series>> = imps
        .iter()
        .map(|imp| CONCURRENCY.iter().map(|&c| Series::new("postgres", imp, "postgres", c)).collect())
        .collect();
    let mut vs_lease: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let mut fenced_vs_lease: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let mut vs_fenced: Vec<Vec<f64>> = vec![Vec::new(); CONCURRENCY.len()];
    let mut hand_series: Vec<Series> =
        imps[..3].iter().map(|imp| Series::new("postgres-handoff", imp, "postgres", CONTENDERS)).collect();
    let rounds = args.uncontended_rounds.max(1);
    let mut base = 1_000_000i64;
    for round in 0..rounds {
        for (ci, &c) in CONCURRENCY.iter().enumerate() {
            let name = format!("u-r{round}-c{c}");
            let mut ops = vec![0.0; imps.len()];
            for turn in 0..imps.len() {
                // Turns rotate, so a slow phase of a shared machine hits each alike.
                let i = (round + ci + turn) % imps.len();
                let sample = match i {
                    0 => uncontended::measure(DlockLock::new(under.locker.clone(), &name, c)?, c, timing, None).await?,
                    1 => uncontended::measure(hand(&under.pool, Hand::Lease, name.clone(), 0), c, timing, None).await?,
                    3 => {
                        let lock = BackendLock::new(under.backend.clone(), &under.locker, &format!("{name}-b"), c)?;
                        uncontended::measure(lock, c, timing, None).await?
                    }
                    4 => {
                        let lock = hand(&under.pool, Hand::Fenced, name.clone(), 0);
                        uncontended::measure(lock, c, timing, None).await?
                    }
                    _ => {
                        base += 1_000;
                        uncontended::measure(hand(&under.pool, Hand::Advisory, name.clone(), base), c, timing, None)
                            .await?
                    }
                };
                ops[i] = sample.ops_per_sec;
                unc[i][ci].samples.push(sample);
            }
            if ops[1] > 0.0 {
                vs_lease[ci].push(ops[0] / ops[1]);
                fenced_vs_lease[ci].push(ops[4] / ops[1]);
            }
            if ops[4] > 0.0 {
                vs_fenced[ci].push(ops[0] / ops[4]);
            }
        }
        let name = format!("h-r{round}");
        let d =
            handoff::measure(DlockLock::new(under.locker.clone(), &name, 1)?, CONTENDERS, args.settle, timing, None);
        hand_series[0].samples.push(d.await?);
        let l =
            handoff::measure(hand(&under.pool, Hand::Lease, name.clone(), 0), CONTENDERS, args.settle, timing, None);
        hand_series[1].samples.push(l.await?);
        base += 1_000;
        let a = handoff::measure(hand(&under.pool, Hand::Advisory, name, base), CONTENDERS, args.settle, timing, None);
        hand_series[2].samples.push(a.await?);
        eprintln!(
            "postgres round {}/{rounds}: c=16 ops dlock {:.0}, lease {:.0}, advisory {:.0}",
            round + 1,
            unc[0][1].samples.last().map_or(0.0, |s| s.ops_per_sec),
            unc[1][1].samples.last().map_or(0.0, |s| s.ops_per_sec),
            unc[2][1].samples.last().map_or(0.0, |s| s.ops_per_sec),
        );
    }
    let left = left_in_postgres(&under.pool).await?;
    if left != 0 {
        return Err(BenchError::Invariant(format!("{left} locks left in PostgreSQL after every hold was released")));
    }
    let mut rows = Vec::new();
    for ci in 0..CONCURRENCY.len() {
        for (i, series) in unc.iter().enumerate() {
            let mut row = series[ci].row();
            if i == 0 {
                row.ratio = median(vs_lease[ci].iter().copied());
                row.targets.push(target("ops vs lease", row.ratio.unwrap_or(0.0), false, VS_LEASE, ""));
                let floor = median(vs_fenced[ci].iter().copied()).unwrap_or(0.0);
                row.targets.push(target("ops vs lease-fenced", floor, false, VS_FENCED, ""));
            } else if i == 1 {
                row.ratio = Some(1.0);
            } else if i == 4 {
                row.ratio = median(fenced_vs_lease[ci].iter().copied());
            }
            rows.push(without_commands(row));
        }
    }
    rows.extend(hand_series.iter().map(|s| without_commands(s.row())));
    Ok(rows)
}

/// The route alone and through `in_transaction`, round by round.
async fn routes(under: &Under, args: &Args, timing: Timing) -> Result<Vec<Row>> {
    let unbounded = IdempotencyLimits::default().with_max_per_scope(u64::MAX).with_max_bytes_per_scope(u64::MAX);
    let store = PostgresStore::with_pool(under.pool.clone(), "bench").await?.with_limits(unbounded);
    let pool = under.pool.clone();
    let alone = Router::new().route(
        "/order",
        post(move || {
            let pool = pool.clone();
            async move {
                let Ok(mut tx) = pool.begin().await else { return StatusCode::SERVICE_UNAVAILABLE };
                let inserted = sqlx::query("INSERT INTO bench_orders (note) VALUES ('placed')").execute(&mut *tx).await;
                if inserted.is_err() || tx.commit().await.is_err() {
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                StatusCode::CREATED
            }
        }),
    );
    let pool = under.pool.clone();
    let hand_tx = Router::new().route(
        "/order",
        post(move |headers: axum::http::HeaderMap| {
            let pool = pool.clone();
            async move {
                let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
                    return StatusCode::BAD_REQUEST;
                };
                let Ok(mut tx) = pool.begin().await else { return StatusCode::SERVICE_UNAVAILABLE };
                let claimed = sqlx::query("INSERT INTO bench_idem (key) VALUES ($1) ON CONFLICT DO NOTHING")
                    .bind(&key)
                    .execute(&mut *tx)
                    .await;
                if !matches!(claimed, Ok(r) if r.rows_affected() == 1) {
                    return StatusCode::CONFLICT;
                }
                let inserted = sqlx::query("INSERT INTO bench_orders (note) VALUES ('placed')").execute(&mut *tx).await;
                let answered = sqlx::query("UPDATE bench_idem SET status = 201, body = '' WHERE key = $1")
                    .bind(&key)
                    .execute(&mut *tx)
                    .await;
                if inserted.is_err() || answered.is_err() || tx.commit().await.is_err() {
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                StatusCode::CREATED
            }
        }),
    );
    let pool = under.pool.clone();
    let hand_piped = Router::new().route(
        "/order",
        post(move |headers: axum::http::HeaderMap| {
            let pool = pool.clone();
            async move {
                let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(literal) else {
                    return StatusCode::BAD_REQUEST;
                };
                let Ok(mut conn) = pool.acquire().await else { return StatusCode::SERVICE_UNAVAILABLE };
                let claim = format!("BEGIN; INSERT INTO bench_idem (key) VALUES ({key}) ON CONFLICT DO NOTHING");
                let claimed = conn.execute(claim.as_str()).await;
                if !matches!(claimed, Ok(r) if r.rows_affected() == 1) {
                    let _ = conn.execute("ROLLBACK").await;
                    return StatusCode::CONFLICT;
                }
                let inserted =
                    sqlx::query("INSERT INTO bench_orders (note) VALUES ('placed')").execute(&mut *conn).await;
                let answer = format!("UPDATE bench_idem SET status = 201, body = '' WHERE key = {key}; COMMIT");
                if inserted.is_err() || conn.execute(answer.as_str()).await.is_err() {
                    let _ = conn.execute("ROLLBACK").await;
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                StatusCode::CREATED
            }
        }),
    );
    // dlock's statements without its layer: what the store costs, apart
    // from what the layer does around it.
    let pool = under.pool.clone();
    let bare = store.clone();
    let store_tx = Router::new().route(
        "/order",
        post(move |headers: axum::http::HeaderMap| {
            let (pool, store) = (pool.clone(), bare.clone());
            async move {
                let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
                    return StatusCode::BAD_REQUEST;
                };
                let Ok(mut tx) = pool.begin().await else { return StatusCode::SERVICE_UNAVAILABLE };
                let terms = ClaimTerms::new(Duration::from_secs(30));
                let Ok(Begin::New(claim)) = store.begin_in(&mut tx, "", &key, "fp", terms).await else {
                    return StatusCode::CONFLICT;
                };
                let inserted = sqlx::query("INSERT INTO bench_orders (note) VALUES ('placed')").execute(&mut *tx).await;
                let answer = StoredResponse::new(201, vec![], Vec::new());
                let stored = store.complete_in(&mut tx, &claim, &answer).await;
                if inserted.is_err() || !matches!(stored, Ok(true)) || tx.commit().await.is_err() {
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                StatusCode::CREATED
            }
        }),
    );
    let layer = IdempotencyLayer::new().caller(Caller::shared()).in_transaction(store);
    let in_tx = Router::new().route(
        "/order",
        post(|mut tx: Tx| async move {
            match sqlx::query("INSERT INTO bench_orders (note) VALUES ('placed')").execute(&mut *tx).await {
                Ok(_) => StatusCode::CREATED,
                Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
            }
        })
        .layer(layer),
    );
    let routers = [alone, in_tx, hand_tx, hand_piped, store_tx];
    let mut series = [
        Series::new("postgres-route", "route", "postgres", REQUESTS_AT_ONCE),
        Series::new("postgres-route", "in-transaction", "postgres", REQUESTS_AT_ONCE),
        Series::new("postgres-route", "hand-tx", "postgres", REQUESTS_AT_ONCE),
        Series::new("postgres-route", "hand-tx-piped", "postgres", REQUESTS_AT_ONCE),
        Series::new("postgres-route", "store-tx", "postgres", REQUESTS_AT_ONCE),
    ];
    // Per round: in-transaction and hand-tx over the route alone.
    let mut ratios = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let keys = Arc::new(AtomicU64::new(0));
    for round in 0..args.uncontended_rounds.max(1) {
        let mut ops = vec![0.0; routers.len()];
        for turn in 0..routers.len() {
            let i = (round + turn) % routers.len();
            let before = orders(&under.pool).await?;
            let sample = requests(routers[i].clone(), i > 0, keys.clone(), timing).await?;
            // Every request answered 201 made its row, once.
            let made = orders(&under.pool).await? - before;
            if made < sample.ops as i64 {
                return Err(BenchError::Invariant(format!("{made} rows for {} requests answered", sample.ops)));
            }
            ops[i] = sample.ops_per_sec;
            series[i].samples.push(sample);
        }
        if ops[0] > 0.0 {
            ratios[0].push(ops[1] / ops[0]);
            ratios[1].push(ops[2] / ops[0]);
            ratios[2].push(ops[3] / ops[0]);
            ratios[3].push(ops[4] / ops[0]);
        }
    }
    let mut rows: Vec<Row> = series.iter().map(|s| without_commands(s.row())).collect();
    let [tx_ratio, hand_ratio, piped_ratio, store_ratio] = ratios;
    rows[1].ratio = median(tx_ratio);
    rows[2].ratio = median(hand_ratio);
    rows[3].ratio = median(piped_ratio);
    rows[4].ratio = median(store_ratio);
    let value = rows[1].ratio.unwrap_or(0.0);
    rows[1].targets.push(target("ops vs route", value, false, TX_VS_ROUTE, ""));
    Ok(rows)
}

/// `s` as an SQL string literal, for a statement sent as text: an `E''`
/// literal means the same whatever `standard_conforming_strings` says.
fn literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

async fn orders(pool: &PgPool) -> Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM bench_orders").fetch_one(pool).await.map_err(pg)
}

/// One window of requests, each with a key never used before.
async fn requests(router: Router, keyed: bool, keys: Arc<AtomicU64>, timing: Timing) -> Result<Sample> {
    run_window(REQUESTS_AT_ONCE, timing, None, |_, clock, stop| {
        let (mut router, keys) = (router.clone(), keys.clone());
        async move {
            let mut records = Vec::with_capacity(1024);
            while !stop.load(Ordering::Relaxed) {
                let mut req = Request::post("/order");
                if keyed {
                    req = req.header("idempotency-key", format!("k{}", keys.fetch_add(1, Ordering::Relaxed)));
                }
                let req = req.body(Body::from("{}")).map_err(|e| BenchError::Invariant(e.to_string()))?;
                let started = clock.now_ns();
                let res = match router.call(req).await {
                    Ok(res) => res,
                    Err(never) => match never {},
                };
                let done = clock.now_ns();
                if res.status() != StatusCode::CREATED {
                    return Err(BenchError::Invariant(format!("the route answered {}", res.status())));
                }
                records.push((done, done - started));
            }
            Ok(records)
        }
    })
    .await
}
