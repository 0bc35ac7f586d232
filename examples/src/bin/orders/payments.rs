//! The `orders` service's idempotency: where records live, the one-time order
//! tokens, and `POST /payments` behind `Idempotency-Key`.
//!
//! Records live where instances can share them: the idempotency store of the
//! `DLOCK_*` configuration when that is Redis (`DLOCK_BACKEND=redis`, or
//! `DLOCK_IDEMPOTENCY_REDIS_URL`); otherwise the Redis of `ORDERS_REDIS_URL`;
//! otherwise this process.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_axum::idempotency::{token_handler, IdempotencyLayer};
use dlock_axum::DlockRuntime;
use dlock_axum::Rejection;
use dlock_core::idempotency::IdempotencyStore;
use dlock_core::idempotency::{fingerprint, Claim, RedisStore, TokenClaim};
use dlock_core::{BackendKind, Config};
use serde::Deserialize;
use serde_json::json;

use super::store::Store;

/// The simulated work of a payment, long enough for duplicates to overlap.
const PAYMENT_WORK: Duration = Duration::from_millis(200);

/// The lock engine and the idempotency records of this service (see the
/// module docs), with `DLOCK_*`'s settings: `Config::build`, whose records
/// share the lock backend's Redis connection when they live there; without
/// a records Redis in the configuration, `ORDERS_REDIS_URL` holds them.
pub(crate) async fn services(config: &Config, orders_redis_url: Option<&str>) -> dlock_core::Result<DlockRuntime> {
    let shared_by_config =
        config.idempotency_redis_url.is_some() || matches!(config.backend, BackendKind::Redis { .. });
    match orders_redis_url {
        Some(url) if !shared_by_config => {
            let store = RedisStore::connect_with(url, &config.prefix, config.redis_options()).await?;
            Ok(config.build().await?.with_idempotency_store(Arc::new(store)))
        }
        _ => config.build().await,
    }
}

/// How long an order's token claim holds: orders take milliseconds.
const ORDER_LEASE: Duration = Duration::from_secs(30);

/// Claims a one-time order token from `GET /idempotency/token` for exactly
/// one request, whichever instance it reaches; refuses the others
/// (`409 idempotency_request_in_progress` while it runs,
/// `409 idempotency_token_unknown` once spent or when never issued,
/// `409 idempotency_outcome_unknown` when the instance that claimed it died
/// before it answered). An order takes well under `ORDER_LEASE`, so the
/// claim is not renewed. The handler claims, orders and settles on a task
/// of its own, so a client that hangs up does not leave the token claimed.
pub(crate) async fn claim_token(idem: &Arc<dyn IdempotencyStore>, token: &str) -> Result<Claim, Rejection> {
    let claim = idem.claim_token(token, None, ORDER_LEASE).await.map_err(|e| {
        tracing::warn!(error = %e, "idempotency store unavailable");
        Rejection::from_lock_error(&e)
    })?;
    match claim {
        TokenClaim::Claimed(claim) => Ok(claim),
        TokenClaim::InUse => {
            Err(Rejection::idempotency_request_in_progress()
                .with_message("an order with this token is still being placed"))
        }
        TokenClaim::OutcomeUnknown => Err(Rejection::idempotency_outcome_unknown()
            .with_message("an order with this token was started but never answered: check your orders")),
        // Permanent, unlike a held lock: the client needs a new token.
        _ => Err(Rejection::idempotency_token_unknown()),
    }
}

/// Spends a claimed token if the order ran to a result (`ran_to_result`:
/// [`stored_by_default`](dlock_axum::idempotency::stored_by_default), the
/// rule of `TokenLayer` and `IdempotencyLayer`), else gives it back. A store
/// failure here leaves the token claimed: spent, never run twice.
pub(crate) async fn settle_token(idem: &Arc<dyn IdempotencyStore>, claim: &Claim, ran_to_result: bool) {
    let settled = if ran_to_result { idem.spend_token(claim).await } else { idem.return_token(claim).await };
    if let Err(e) = settled {
        tracing::warn!(error = %e, "settling an order token failed; it stays spent");
    }
}

/// `GET /idempotency/token`, `POST /payments` and `POST /charges` (whose
/// in-progress claims block their key for at most `lease` if this instance
/// dies; `charges_unguarded`: `/charges` without its layer, the negative
/// control of the torture harness).
pub(crate) fn routes<S: Clone + Send + Sync + 'static>(
    lease: Duration,
    charges_unguarded: bool,
    store: Store,
    token_rate: crate::rate::TokenRate,
) -> Router<S> {
    // `/payments` keys its side effect on the caller and the Idempotency-Key
    // itself (`SET NX`), so a key whose instance died is safe to run again
    // once its lease ends, rather than answered `idempotency_outcome_unknown`.
    // `/charges` counts its executions for the torture harness, which
    // measures exactly that crash window: it runs again too.
    let layer = IdempotencyLayer::new().lease(lease).run_again_after_lease();
    let charges = post(create_charge);
    let charges = if charges_unguarded { charges } else { charges.layer(layer.clone()) };
    Router::new()
        .route(
            "/idempotency/token",
            get(token_handler(None)).layer(axum::middleware::from_fn_with_state(token_rate, crate::rate::limit)),
        )
        .route("/payments", post(create_payment).layer(layer))
        .route("/charges", charges)
        .with_state(store)
}

#[derive(Debug, Deserialize)]
struct CreatePayment {
    order_id: String,
    amount: i64,
}

/// `POST /charges`, the same body as `POST /payments` → 201 `{"charge_id",
/// "order_id", "amount", "execution"}`: a side effect with no deduplication
/// of its own (each run counts one more execution of the order's charge), so
/// that `IdempotencyLayer` alone stands between a duplicate and a second run.
/// The torture harness storms it (`idempotency-storm`).
async fn create_charge(State(store): State<Store>, body: axum::body::Bytes) -> Response {
    let CreatePayment { order_id, amount } = match parse_payment(&body) {
        Ok(p) => p,
        Err(refusal) => return refusal.into_response(),
    };
    tokio::time::sleep(PAYMENT_WORK).await;
    let charge_id = match random_id("ch_") {
        Ok(id) => id,
        Err(refusal) => return refusal.into_response(),
    };
    match store.count_charge(&order_id).await {
        Ok(execution) => {
            tracing::info!(%charge_id, execution, "charge made");
            let charge =
                json!({"charge_id": charge_id, "order_id": order_id, "amount": amount, "execution": execution});
            (StatusCode::CREATED, Json(charge)).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "store unavailable");
            store_unavailable().into_response()
        }
    }
}

fn parse_payment(body: &[u8]) -> Result<CreatePayment, Rejection> {
    let payment: CreatePayment = serde_json::from_slice(body).map_err(|e| {
        Rejection::new(
            StatusCode::BAD_REQUEST,
            "invalid_payment",
            3007,
            format!("expected {{\"order_id\": string, \"amount\": integer}}: {e}"),
        )
    })?;
    if payment.amount < 1 || payment.order_id.is_empty() {
        return Err(Rejection::new(
            StatusCode::BAD_REQUEST,
            "invalid_payment",
            3007,
            "amount must be at least 1 and order_id non-empty",
        ));
    }
    Ok(payment)
}

/// `prefix` and 24 random hex digits.
fn random_id(prefix: &str) -> Result<String, Rejection> {
    let mut bytes = [0u8; 12];
    getrandom::fill(&mut bytes).map_err(|e| {
        tracing::error!(error = %e, "OS random source failed");
        Rejection::new(StatusCode::SERVICE_UNAVAILABLE, "payment_id_unavailable", 3008, "cannot create a payment id")
    })?;
    Ok(bytes.iter().fold(String::from(prefix), |mut s, b| {
        s.push_str(&format!("{b:02x}"));
        s
    }))
}

/// A 503 frees the idempotency key, so the client's retry runs again.
fn store_unavailable() -> Rejection {
    Rejection::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store_unavailable",
        3004,
        "the store is unavailable, please retry later",
    )
}

/// `POST /payments` `{"order_id": "...", "amount": n}` → 201
/// `{"payment_id", "order_id", "amount"}`, once per `Idempotency-Key`.
async fn create_payment(
    State(store): State<Store>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let CreatePayment { order_id, amount } = match parse_payment(&body) {
        Ok(p) => p,
        Err(refusal) => return refusal.into_response(),
    };
    tokio::time::sleep(PAYMENT_WORK).await;
    let payment_id = match random_id("pay_") {
        Ok(id) => id,
        Err(refusal) => return refusal.into_response(),
    };
    let payment = json!({"payment_id": payment_id, "order_id": order_id, "amount": amount});
    // The effect is keyed by the caller and its Idempotency-Key (the layer
    // guarantees the header), the same scope the layer uses. Both are
    // secrets (a bearer credential, a replay handle): the Redis key name is
    // their hash, never their text, as key names show up in `MONITOR`,
    // `SCAN`, slow logs and dumps. `fingerprint` length-prefixes each part,
    // so no two (caller, key) pairs share a hash input.
    let header = |name: &str| headers.get(name).map_or(&b""[..], |v| v.as_bytes());
    let claim = fingerprint(&[header("authorization"), header("idempotency-key")]);
    match store.record_payment_once(&claim, &payment_id, &payment).await {
        Ok(None) => {
            tracing::info!(%payment_id, "payment recorded");
            (StatusCode::CREATED, Json(payment)).into_response()
        }
        Ok(Some(earlier)) => {
            // A retry after an instance died between paying and storing its
            // answer: answer with the payment that was made.
            tracing::info!("payment already made under this Idempotency-Key");
            (StatusCode::CREATED, [(axum::http::header::CONTENT_TYPE, "application/json")], earlier).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "store unavailable");
            store_unavailable().into_response()
        }
    }
}
