//! `wallet`: money moved between accounts on PostgreSQL through sqlx,
//! exactly once per `Idempotency-Key`, with no update lost between two
//! transfers, over any number of instances. It is the service of the outside
//! user's trial (2026-12-07, findings W1–W4), composed the way it is
//! correct.
//!
//! # Routes
//!
//! * `POST /transfers` `{"from": a, "to": b, "amount": n}`, with an
//!   `Idempotency-Key` and the caller in `x-user` → `201` `{"ledger": id,
//!   "amount": n, "from": {"id", "balance"}, "to": {..}}`;
//!   `409 insufficient_funds` (a result: stored and replayed);
//!   `422 same_account`, `422 invalid_amount`, `404 account_not_found`
//!   (refusals before the work: not stored, the corrected retry runs).
//! * `PUT /accounts/{id}` `{"balance": n}` seeds an account (one
//!   autocommit statement, under the account's lock); `GET /accounts/{id}`.
//! * `GET /ready` (`dlock_axum::ready`): the lock service, and the
//!   application's database, where the idempotency records of `/transfers`
//!   live (handed to the runtime with `with_idempotency_store`).
//!
//! Every refusal is RFC 9457 Problem Details.
//!
//! # The composition
//!
//! `/transfers` is a plain read-modify-write — `SELECT` both balances, work
//! (`work`, a gap that tests widen), `UPDATE` both to the computed values,
//! `INSERT` the ledger row — on purpose: no `FOR UPDATE`, no `balance =
//! balance - $1`, no `CHECK (balance >= 0)`. Those would each hide a lost
//! update the lock is there to prevent. Three pieces make it safe:
//!
//! 1. `IdempotencyLayer::new().caller(Caller::header("x-user"))
//!    .in_transaction(PostgresStore::with_pool(pool, "wallet"))`: the claim
//!    of the key, the transfer's writes and its stored answer are one
//!    transaction on the application's pool. The handler joins it with a
//!    [`Tx`](dlock_axum::idempotency::Tx) argument. Once claimed, the route
//!    runs and commits on a task of its own, whatever the client does.
//! 2. `LockLayer::new("account").json("from").also("account").json("to")
//!    .wait(5 s)`: both accounts, all or none, in one global key order (1→2
//!    and 2→1 at once never deadlock).
//! 3. `Fences::check` on each account's row, in the transaction, before
//!    it reads: each with **its own key's** fencing token, from
//!    [`HeldLocks`](dlock_axum::HeldLocks).
//!
//! Both orders of the two layers are correct ([`LayerOrder`]):
//!
//! | order | built as | a duplicate while the first runs | the lock ends |
//! |---|---|---|---|
//! | [`LayerOrder::LockOutside`] | `post(transfer).route_layer(idempotency).route_layer(lock)` | waits for the lock, then gets the stored answer | when the idempotency layer inside has committed: the lock layer runs it on a task of its own once the lock is held, so a client that hangs up does not release it early |
//! | [`LayerOrder::LockInside`] | `post(transfer).route_layer(lock).route_layer(idempotency)` | `409 idempotency_request_in_progress` at once | after the transaction has committed or rolled back: the lock layer finds the transaction in the request and hands its release to it |
//!
//! The idempotency layer may equally sit on the whole router
//! (`Router::layer`): that is the second order.
//!
//! Either way the next holder of an account's lock reads what the last
//! transfer committed. Lock outside, a transfer waiting for its accounts
//! holds no database connection; lock inside, it holds its transaction (and
//! its pool connection) while it waits, so size the pool for the waiters.
//!
//! # Why fence, and why with each account's own token
//!
//! A lock is a lease: an instance paused past it (a GC, a stopped VM) still
//! believes it holds both accounts while the next transfer runs. The fence
//! makes the database refuse its late writes (`409 lock_token_stale`,
//! nothing written) instead of trusting the lease.
//!
//! Tokens are drawn per key. A transfer that took `account:1` early and
//! waited for `account:3` holds `account:1`'s older token, while a transfer
//! on 2→3 meanwhile fenced `account:3` with a newer one of its own. Fencing
//! both rows with the first key's token would refuse that transfer although
//! it holds both locks (the trial's W3: 5–7 % spurious refusals). So each
//! row is checked with `locks.token("account", id)`.
//!
//! The accounts are fenced in id order, so two transactions never wait for
//! each other's fence rows in opposite orders. The check also locks the
//! fence row until the transaction ends, which orders the transactions of an
//! account by itself; [`WalletConfig::fenced`] `= false` leaves the lock
//! alone to keep transfers apart (what the tests use to show it does).

use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post, put, MethodRouter};
use axum::Router;
use dlock_axum::idempotency::IdempotencyLayer;
use dlock_axum::{Caller, DlockExt, DlockRuntime, LockLayer, RenderRejections};
use dlock_core::fence::postgres::Fences;
use dlock_core::idempotency::PostgresStore;
use sqlx::PgPool;

mod accounts;
mod db;
mod error;
mod transfer;

/// The prefix of the wallet's dlock tables on the application's database:
/// `wallet_idem_*` (the idempotency records) and `wallet_fences`.
pub const PREFIX: &str = "wallet";

/// The lock name of an account; its one part is the account id.
pub const ACCOUNT_LOCK: &str = "account";

/// Where the lock sits relative to the in-transaction idempotency layer on
/// `POST /transfers`; both are correct (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerOrder {
    /// The lock outermost: a request takes both accounts, then claims its
    /// key and runs in its transaction.
    #[default]
    LockOutside,
    /// The idempotency layer outermost: a request claims its key in its
    /// transaction, then takes both accounts.
    LockInside,
}

/// How the wallet runs.
#[derive(Debug, Clone)]
pub struct WalletConfig {
    /// The order of the lock and the idempotency layer.
    pub order: LayerOrder,
    /// A transfer's work between reading the balances and writing them
    /// (`WALLET_WORK_MS`): the window in which a second transfer that got
    /// in would lose an update.
    pub work: Duration,
    /// Whether each account's row is fenced with its own token (the
    /// default). Off, only the lock keeps transfers apart: correct while
    /// leases hold, unprotected against a holder paused past its lease.
    pub fenced: bool,
    /// How long a transfer waits for its accounts' locks before
    /// `409 lock_wait_timeout`.
    pub lock_wait: Duration,
}

impl Default for WalletConfig {
    fn default() -> Self {
        WalletConfig {
            order: LayerOrder::default(),
            work: Duration::ZERO,
            fenced: true,
            lock_wait: Duration::from_secs(5),
        }
    }
}

/// Why the wallet could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The wallet's tables could not be created.
    #[error("creating the wallet's tables: {0}")]
    Schema(#[from] sqlx::Error),
    /// dlock's tables (idempotency records, fences) could not be created.
    #[error("creating dlock's tables on the wallet's database: {0}")]
    Dlock(#[from] dlock_core::Error),
}

/// One wallet instance: its database pool, its dlock runtime, its settings.
#[derive(Debug, Clone)]
pub struct Wallet {
    app: App,
    store: PostgresStore,
}

/// What the handlers share.
#[derive(Debug, Clone)]
struct App {
    pool: PgPool,
    dlock: DlockRuntime,
    fences: Arc<Fences>,
    config: Arc<WalletConfig>,
}

impl Wallet {
    /// Creates the wallet's tables, dlock's idempotency tables and the
    /// fences table on `pool`'s database when missing (safe from several
    /// instances at once), and keeps `dlock` for the account locks.
    ///
    /// # Errors
    ///
    /// [`StartError`] when a table cannot be created.
    pub async fn new(pool: PgPool, dlock: DlockRuntime, config: WalletConfig) -> Result<Wallet, StartError> {
        db::create_schema(&pool).await?;
        let fences = Fences::new(PREFIX)?;
        fences.create(&pool).await?;
        let store = PostgresStore::with_pool(pool.clone(), PREFIX).await?;
        // The records live where the transfers' transactions are, so the
        // runtime's readiness (`/ready`) asks that database, and the
        // runtime makes no records of its own elsewhere.
        let dlock = dlock.with_idempotency_store(Arc::new(store.clone()));
        let app = App { pool, dlock, fences: Arc::new(fences), config: Arc::new(config) };
        Ok(Wallet { app, store })
    }

    /// The service's routes, the runtime installed, refusals as Problem Details.
    pub fn router(&self) -> Router {
        let account_lock = LockLayer::new(ACCOUNT_LOCK).path("id").wait(self.app.config.lock_wait);
        Router::new()
            .route("/transfers", self.transfers())
            .route("/accounts/{id}", get(accounts::get_account))
            .route("/accounts/{id}", put(accounts::put_account).route_layer(account_lock))
            .route("/ready", get(dlock_axum::ready))
            .fallback(error::route_not_found)
            .method_not_allowed_fallback(error::method_not_allowed)
            .layer(RenderRejections::problem_details())
            .with_dlock(self.app.dlock.clone())
            .with_state(self.app.clone())
    }

    /// `POST /transfers`, with the two layers in the configured order.
    fn transfers(&self) -> MethodRouter<App> {
        let idempotency = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(self.store.clone());
        let lock =
            LockLayer::new(ACCOUNT_LOCK).json("from").also(ACCOUNT_LOCK).json("to").wait(self.app.config.lock_wait);
        match self.app.config.order {
            LayerOrder::LockOutside => post(transfer::transfer).route_layer(idempotency).route_layer(lock),
            LayerOrder::LockInside => post(transfer::transfer).route_layer(lock).route_layer(idempotency),
        }
    }
}
