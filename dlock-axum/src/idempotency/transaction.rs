//! Key mode inside the route's PostgreSQL transaction: the claim, the
//! handler's writes and the stored answer commit together (`docs/axum-design.md`).

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
use tokio::sync::{Mutex, OwnedMutexGuard};
use tower::Service;

use super::settle::{self, claimed, not_stored_record, store_error, Begun, StorePolicy};
use crate::pipeline::detached::{self, CatchUnwind, Settled};
use crate::pipeline::until_commit::UntilCommit;
use crate::rejection::Rejection;

/// The transaction of a request, between the layer and the handler.
type Slot = Arc<Mutex<sqlx::Transaction<'static, Postgres>>>;

/// The request extension that carries the [`Slot`].
#[derive(Clone)]
struct TxSlot(Slot);

/// The route's transaction under
/// [`IdempotencyLayer::in_transaction`](super::IdempotencyLayer::in_transaction):
/// the handler's writes commit with the stored answer. Use it as a connection
/// (`query.execute(&mut *tx)`); never commit it, nor keep it past the handler
/// (rolled back, `500`). Elsewhere, or taken twice: `500 lock_misconfigured`.
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

/// What the request claims: its key in its caller's scope, fingerprint and terms.
pub(super) struct Claimed {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) fingerprint: String,
    pub(super) terms: ClaimTerms,
}

/// Begins the transaction, claims the key in it, runs the route and settles
/// it, all seen through (`pipeline/detached.rs`), so a hang-up leaves no
/// transaction open.
pub(super) async fn run<S>(
    policy: StorePolicy,
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
        let mut tx = match store.begin_transaction().await {
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
            // Nobody waits for the answer: the claim goes with the transaction, unrun.
            rollback(tx).await;
            return Settled::Answer(Rejection::idempotency_request_in_progress().into_response());
        }
        let slot: Slot = Arc::new(Mutex::new(tx));
        parts.extensions.insert(TxSlot(slot.clone()));
        let until_commit = UntilCommit::default();
        until_commit.insert(&mut parts.extensions);
        let route = inner.call(Request::from_parts(parts, Body::from(body)));
        // The route's future (with its clone of the slot) is gone once it answered.
        let answered = CatchUnwind(Box::pin(route)).await;
        let tx = Arc::try_unwrap(slot).map(Mutex::into_inner).ok();
        let settled = settle::settle(RouteTx { store, claim, tx, policy }, answered).await;
        // The route's locks end after its transaction.
        until_commit.ended().await;
        settled
    })
    .await
}

async fn rollback(tx: sqlx::Transaction<'static, Postgres>) {
    // A failed rollback leaves nothing either: the server ends the transaction.
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "dlock: rolling back the route's transaction failed");
    }
}

/// A key claimed inside the route's transaction: committed with the answer, or rolled back.
struct RouteTx {
    store: PostgresStore,
    claim: Claim,
    /// `None`: the handler kept its [`Tx`] past its answer.
    tx: Option<sqlx::Transaction<'static, Postgres>>,
    policy: StorePolicy,
}

impl settle::Claimed for RouteTx {
    fn keeps(&self, response: &Response) -> bool {
        // A transaction the handler kept is refused whatever it answered.
        self.tx.is_none() || self.policy.stores(response)
    }

    async fn abandon(self) {
        // Nothing it wrote is kept, nor the claim; a kept `Tx` rolls back when dropped.
        if let Some(tx) = self.tx {
            rollback(tx).await;
        }
    }

    async fn keep(self, response: Response) -> Response {
        let RouteTx { store, claim, tx, policy } = self;
        let Some(mut tx) = tx else {
            // Dropped by its last holder, it rolls back then.
            tracing::error!(
                key = crate::headers::log_id(claim.key()),
                "dlock: the handler kept its Tx past its answer; the transaction is rolled back"
            );
            return Rejection::misconfigured().with_message("the route kept its transaction").into_response();
        };
        let (record, answer) = policy.record(response, claim.key()).await;
        let mut stored = store.complete_in(&mut tx, &claim, &record).await;
        if settle::over_budget(&stored, &claim) {
            stored = store.complete_in(&mut tx, &claim, &not_stored_record()).await;
        }
        match stored {
            Ok(true) => {}
            Ok(false) => {
                // The claim is this transaction's own row: only a bug gets here.
                tracing::error!(
                    key = crate::headers::log_id(claim.key()),
                    "dlock: the transaction's claim was not found"
                );
                rollback(tx).await;
                return Rejection::idempotency_not_committed().into_response();
            }
            Err(e) => {
                tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: storing the answer in the route's transaction failed; rolled back");
                rollback(tx).await;
                return Rejection::idempotency_not_committed().into_response();
            }
        }
        match tx.commit().await {
            Ok(()) => answer,
            Err(e) => {
                // Nothing kept, or all of it: a retry with the key runs or replays.
                tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: the route's transaction did not commit");
                Rejection::idempotency_not_committed().into_response()
            }
        }
    }
}
