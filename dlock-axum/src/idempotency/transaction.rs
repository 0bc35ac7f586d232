//! Key mode inside the route's own PostgreSQL transaction
//! ([`IdempotencyLayer::in_transaction`]): the claim, the handler's writes
//! and the stored answer are one transaction.
//!
//! The layer begins the transaction and claims the key in it
//! ([`PostgresStore::begin_in`]), hands it to the handler through the
//! request's extensions (the [`Tx`] argument takes it for the handler's
//! run), takes it back when the route has answered, stores the answer
//! ([`PostgresStore::complete_in`]) and commits. Everything after the claim
//! runs on a task of its own (`pipeline/detached.rs`), from the `BEGIN` on,
//! so a client that hangs up cancels neither the route nor the commit, and
//! never leaves a transaction half-begun on the application's pool. A lock
//! the route takes inside this layer is released once the transaction has
//! ended (`pipeline/until_commit.rs`), not when the route answers.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dlock_core::idempotency::{Claim, ClaimTerms, PostgresStore};
use sqlx::postgres::PgConnection;
use sqlx::Postgres;
use tokio::sync::{oneshot, Mutex, OwnedMutexGuard};
use tower::Service;

use super::key::{claimed, is_stored, not_stored_record, store_error, to_record, Begun, IdempotencyLayer};
use crate::pipeline::detached::{self, CatchUnwind, Settled};
use crate::pipeline::until_commit::UntilCommit;
use crate::rejection::Rejection;

/// The transaction of a request, between the layer and the handler.
type Slot = Arc<Mutex<sqlx::Transaction<'static, Postgres>>>;

/// The request extension that carries the [`Slot`].
#[derive(Clone)]
struct TxSlot(Slot);

/// The route's transaction, under [`IdempotencyLayer::in_transaction`]: the
/// one that claimed the request's `Idempotency-Key` and that will store its
/// answer. The handler's writes through it commit with that answer, or not
/// at all. Use it as a connection: `query.execute(&mut *tx)`.
///
/// Do not commit or roll it back (the layer does, by the route's answer),
/// and do not keep it past the handler: a transaction still held when the
/// route has answered is rolled back, and the request answers `500`.
///
/// On a route without [`in_transaction`](IdempotencyLayer::in_transaction)
/// (or a request of a method the layer lets through untouched), and for a
/// second `Tx` argument, the request is refused with `500 lock_misconfigured`.
///
/// ```no_run
/// use dlock_axum::idempotency::Tx;
///
/// async fn place_order(mut tx: Tx) -> Result<&'static str, axum::http::StatusCode> {
///     sqlx::query("UPDATE stock SET units = units - 1 WHERE id = 7 AND units > 0")
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?; // a 5xx rolls it back
///     Ok("placed")
/// }
/// ```
pub struct Tx(OwnedMutexGuard<sqlx::Transaction<'static, Postgres>>);

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx")
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Rejection> {
        let Some(TxSlot(slot)) = parts.extensions.get::<TxSlot>() else {
            tracing::error!(
                "dlock: a handler takes a Tx, and its route has no IdempotencyLayer::in_transaction (or the layer let \
                 this method through)"
            );
            return Err(Rejection::misconfigured().with_message("this route has no idempotent transaction"));
        };
        slot.clone().try_lock_owned().map(Tx).map_err(|_| {
            tracing::error!("dlock: a handler takes two Tx arguments; the route's transaction is one");
            Rejection::misconfigured().with_message("the route's transaction is taken twice")
        })
    }
}

/// What the request claims: its key within its caller's scope, and the
/// fingerprint and terms of the claim.
pub(super) struct Claimed {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) fingerprint: String,
    pub(super) terms: ClaimTerms,
}

/// Begins the transaction, claims the key in it, and runs the route and
/// its settling, all on a task of its own: a client that hangs up while
/// the transaction is being begun, while the claim is on its way or while
/// the route runs cuts none of them, so no transaction is left open and no
/// claim stranded.
pub(super) async fn run<S>(
    layer: IdempotencyLayer,
    store: PostgresStore,
    mut inner: S,
    mut parts: Parts,
    body: Bytes,
    claimed_as: Claimed,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>> + Send + 'static,
    S::Response: IntoResponse + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    detached::run_detached(move |client| async move {
        let mut tx = match begin(&store).await {
            Ok(tx) => tx,
            Err(e) => return Settled::Answer(store_error(&e)),
        };
        let Claimed { scope, key, fingerprint, terms } = &claimed_as;
        let begun = store.begin_in(&mut tx, scope, key, fingerprint, *terms).await;
        let claim = match claimed(begun) {
            Begun::Run(claim) => claim,
            // Nothing to keep: the claim's statement wrote nothing, or failed.
            Begun::Answer(answer) => {
                rollback(tx).await;
                return Settled::Answer(answer);
            }
        };
        if client.is_gone() {
            // Nobody waits for the route's answer: the claim goes with the
            // transaction, unrun, and its retry runs.
            rollback(tx).await;
            return Settled::Answer(Rejection::idempotency_request_in_progress().into_response());
        }
        let slot: Slot = Arc::new(Mutex::new(tx));
        parts.extensions.insert(TxSlot(slot.clone()));
        let until_commit = UntilCommit::default();
        until_commit.insert(&mut parts.extensions);
        let route = inner.call(Request::from_parts(parts, Body::from(body)));
        let settled = settle(layer, store, claim, slot, route).await;
        // The locks the route took inside this layer end after its
        // transaction, so their next holder reads what it committed.
        until_commit.ended().await;
        settled
    })
    .await
}

/// A transaction on the store's pool, within the store's bound.
///
/// `Pool::begin` is not cancel-safe in sqlx 0.8 on PostgreSQL: cut between
/// sending `BEGIN` and reading its answer, it hands the connection back to
/// the pool inside a transaction nobody will end (upstream sqlx#4393). So
/// the begin is never cut: it runs on a task of its own, and the bound only
/// stops waiting for it. A transaction begun after its request stopped
/// waiting is rolled back by that task before its connection goes back.
async fn begin(store: &PostgresStore) -> dlock_core::Result<sqlx::Transaction<'static, Postgres>> {
    let bound = store.response_timeout();
    let (answer, begun) = oneshot::channel();
    let pool = store.pool().clone();
    tokio::spawn(async move {
        if let Err(Ok(late)) = answer.send(pool.begin().await) {
            rollback(late).await;
        }
    });
    match tokio::time::timeout(bound, begun).await {
        Ok(Ok(Ok(tx))) => Ok(tx),
        Ok(Ok(Err(e))) => Err(dlock_core::Error::Backend {
            backend: "postgres",
            message: format!("cannot begin the route's transaction: {e}"),
            source: Some(Box::new(e)),
        }),
        // The runtime is shutting down under the task.
        Ok(Err(_)) => Err(dlock_core::Error::backend("postgres", "the route's transaction was not begun")),
        Err(_) => Err(dlock_core::Error::backend("postgres", format!("no transaction within {bound:?}"))),
    }
}

async fn rollback(tx: sqlx::Transaction<'static, Postgres>) {
    // A rollback that fails leaves nothing either: the server ends the
    // transaction with its connection.
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "dlock: rolling back the route's transaction failed");
    }
}

/// Runs the claimed route, then commits its transaction with the answer,
/// or rolls it back when the route did not run to a result.
async fn settle<R, E>(
    layer: IdempotencyLayer,
    store: PostgresStore,
    claim: Claim,
    slot: Slot,
    route: impl Future<Output = Result<R, E>> + Send,
) -> Settled<E>
where
    R: IntoResponse,
{
    // The route's future (and the request in it, with its clone of the
    // slot) is gone once it answered.
    let answered = CatchUnwind(Box::pin(route)).await;
    let tx = Arc::try_unwrap(slot).map(Mutex::into_inner);
    let response = match answered {
        Ok(Ok(res)) => res.into_response(),
        Ok(Err(e)) => {
            if let Ok(tx) = tx {
                rollback(tx).await;
            }
            return Settled::Failed(e);
        }
        Err(panic) => {
            if let Ok(tx) = tx {
                rollback(tx).await;
            }
            return Settled::Panicked(panic);
        }
    };
    let Ok(mut tx) = tx else {
        // Dropped by its last holder, it rolls back then.
        tracing::error!(
            key = crate::headers::log_id(claim.key()),
            "dlock: the handler kept its Tx past its answer; the transaction is rolled back"
        );
        return Settled::Answer(
            Rejection::misconfigured().with_message("the route kept its transaction").into_response(),
        );
    };
    if !is_stored(&layer, &response) {
        // Not a result of the route: nothing it wrote is kept, and neither
        // is the claim, so the retry runs.
        rollback(tx).await;
        return Settled::Answer(response);
    }
    let (record, answer) = to_record(&layer, response, claim.key()).await;
    let mut stored = store.complete_in(&mut tx, &claim, &record).await;
    if let Err(e @ dlock_core::Error::IdempotencyFull { .. }) = &stored {
        tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: the answer is over the idempotency store's byte budget; retries get idempotency_response_not_stored");
        stored = store.complete_in(&mut tx, &claim, &not_stored_record()).await;
    }
    match stored {
        Ok(true) => {}
        Ok(false) => {
            // The claim is this transaction's own row: only a bug gets here.
            tracing::error!(key = crate::headers::log_id(claim.key()), "dlock: the transaction's claim was not found");
            rollback(tx).await;
            return Settled::Answer(Rejection::idempotency_not_committed().into_response());
        }
        Err(e) => {
            tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: storing the answer in the route's transaction failed; rolled back");
            rollback(tx).await;
            return Settled::Answer(Rejection::idempotency_not_committed().into_response());
        }
    }
    match tx.commit().await {
        Ok(()) => Settled::Answer(answer),
        Err(e) => {
            // Refused, or its answer lost: either nothing was kept, or the
            // writes and the answer were kept together. A retry with the
            // same key is right in both cases: it runs, or it replays.
            tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: the route's transaction did not commit");
            Settled::Answer(Rejection::idempotency_not_committed().into_response())
        }
    }
}
