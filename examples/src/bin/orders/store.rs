//! Where the `orders` service keeps products, orders and payments: in
//! process, or in a Redis shared by several instances.
//!
//! Products are read and written with plain `GET` / `SET` on purpose: the
//! read-modify-write of stock is not atomic, so only the lock keeps
//! concurrent sales from overselling.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

/// Stock and sales of one product, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Stock {
    /// Units left.
    pub(crate) stock: i64,
    /// Units sold since the stock was last set.
    pub(crate) sold: i64,
}

/// The store could not be reached or answered garbage.
#[derive(Debug, thiserror::Error)]
#[error("store unavailable: {0}")]
pub(crate) struct StoreError(String);

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError(e.to_string())
    }
}

/// Products, orders and payments. (One-time order tokens live in the
/// idempotency store, see `payments.rs`.)
#[derive(Clone)]
pub(crate) enum Store {
    /// In this process only.
    Memory(Arc<Mutex<MemoryStore>>),
    /// In a Redis that several instances share.
    Redis(ConnectionManager),
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Store::Memory(_) => "Store::Memory",
            Store::Redis(_) => "Store::Redis",
        })
    }
}

/// The in-process tables.
#[derive(Debug, Default)]
pub(crate) struct MemoryStore {
    products: HashMap<String, Stock>,
    orders: HashMap<String, String>,
    payments: HashMap<String, String>,
    payment_claims: HashMap<String, String>,
    charges: HashMap<String, u64>,
    accounts: HashMap<String, i64>,
}

const PREFIX: &str = "orders";

fn product_key(id: &str) -> String {
    format!("{PREFIX}:product:{id}")
}

fn account_key(id: &str) -> String {
    format!("{PREFIX}:account:{id}")
}

impl Store {
    /// An empty in-process store.
    pub(crate) fn memory() -> Self {
        Store::Memory(Arc::default())
    }

    /// A store in the Redis at `url`, through redis-rs's own
    /// `ConnectionManager`: commands give up after a second, so a dead
    /// Redis answers errors at once, not hangs, and a broken connection is
    /// re-established by the requests that follow.
    pub(crate) async fn redis(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(1)))
            .set_response_timeout(Some(std::time::Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(std::time::Duration::from_millis(250));
        let conn = ConnectionManager::new_with_config(client, config).await.map_err(|e| StoreError(e.to_string()))?;
        Ok(Store::Redis(conn))
    }

    /// `memory` or `redis`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }

    /// The stock of product `id`, if it exists.
    pub(crate) async fn get(&self, id: &str) -> Result<Option<Stock>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.lock().await.products.get(id).copied()),
            Store::Redis(conn) => {
                let raw: Option<String> = conn.clone().get(product_key(id)).await?;
                raw.map(|s| serde_json::from_str(&s).map_err(|e| StoreError(format!("product {id}: {e}")))).transpose()
            }
        }
    }

    /// Overwrites the stock of product `id`.
    pub(crate) async fn put(&self, id: &str, stock: Stock) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.lock().await.products.insert(id.to_owned(), stock);
                Ok(())
            }
            Store::Redis(conn) => {
                let raw = serde_json::to_string(&stock).map_err(|e| StoreError(e.to_string()))?;
                let () = conn.clone().set(product_key(id), raw).await?;
                Ok(())
            }
        }
    }

    /// The balance of account `id`, if it exists.
    pub(crate) async fn balance(&self, id: &str) -> Result<Option<i64>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.lock().await.accounts.get(id).copied()),
            Store::Redis(conn) => Ok(conn.clone().get(account_key(id)).await?),
        }
    }

    /// Overwrites the balance of account `id`: a plain write, which only
    /// the account's lock keeps from racing another transfer.
    pub(crate) async fn set_balance(&self, id: &str, balance: i64) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.lock().await.accounts.insert(id.to_owned(), balance);
                Ok(())
            }
            Store::Redis(conn) => {
                let () = conn.clone().set(account_key(id), balance).await?;
                Ok(())
            }
        }
    }

    /// Records an order (its JSON) under `order_id`.
    pub(crate) async fn record_order(&self, order_id: &str, order: &serde_json::Value) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.lock().await.orders.insert(order_id.to_owned(), order.to_string());
                Ok(())
            }
            Store::Redis(conn) => {
                let () = conn.clone().set(format!("{PREFIX}:order:{order_id}"), order.to_string()).await?;
                Ok(())
            }
        }
    }

    /// Counts one more execution of the charge of `order_id` and returns the
    /// count: `POST /charges` has no deduplication of its own, so this
    /// counter shows how often the idempotency layer let it run.
    pub(crate) async fn count_charge(&self, order_id: &str) -> Result<u64, StoreError> {
        match self {
            Store::Memory(m) => {
                let mut m = m.lock().await;
                let n = m.charges.entry(order_id.to_owned()).or_default();
                *n += 1;
                Ok(*n)
            }
            Store::Redis(conn) => Ok(conn.clone().incr(format!("{PREFIX}:charges:{order_id}"), 1u64).await?),
        }
    }

    /// Records a payment once per `claim` (a hash of the caller and its
    /// `Idempotency-Key`), atomically: returns `None` when this call recorded
    /// it, or the payment recorded earlier under the same claim. The
    /// idempotency layer stores the response only after the handler ran, so
    /// an instance killed between the two would let the retry run the
    /// handler again; keying the effect itself makes that retry find the
    /// first payment instead of making a second one.
    pub(crate) async fn record_payment_once(
        &self,
        claim: &str,
        payment_id: &str,
        payment: &serde_json::Value,
    ) -> Result<Option<String>, StoreError> {
        match self {
            Store::Memory(m) => {
                let mut m = m.lock().await;
                if let Some(existing) = m.payment_claims.get(claim) {
                    return Ok(Some(existing.clone()));
                }
                m.payment_claims.insert(claim.to_owned(), payment.to_string());
                m.payments.insert(payment_id.to_owned(), payment.to_string());
                Ok(None)
            }
            Store::Redis(conn) => {
                let script = redis::Script::new(
                    "if redis.call('SET', KEYS[1], ARGV[1], 'NX') then redis.call('SET', KEYS[2], ARGV[1]) return false end \
                     return redis.call('GET', KEYS[1])",
                );
                let existing: Option<String> = script
                    .key(format!("{PREFIX}:paykey:{claim}"))
                    .key(format!("{PREFIX}:payment:{payment_id}"))
                    .arg(payment.to_string())
                    .invoke_async(&mut conn.clone())
                    .await?;
                Ok(existing)
            }
        }
    }
}
