//! Where the `orders` service keeps products, orders and payments: in
//! process, in a Redis shared by several instances, or (feature
//! `postgres`) in a PostgreSQL database (`pg.rs`).
//!
//! A sale is a read-modify-write of the product on purpose (read, work,
//! write): only the lock keeps concurrent sales from overselling, and
//! only the fence keeps a holder whose lease ran out during its work from
//! writing over the sale of the request that took the lock after it. Every
//! stock write carries the stock lock's fencing token: the in-process
//! store compares it with the highest one it has seen, the Redis store
//! reads and writes through `dlock_core::fence::redis`, the PostgreSQL
//! store checks `dlock_core::fence::postgres::Fences` first in the sale's
//! transaction. A refused token is [`StoreError::Stale`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

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

/// What a sale did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sale {
    /// Sold: the units left.
    Sold(i64),
    /// Not enough left: the units there are.
    SoldOut(i64),
    /// No such product.
    NotFound,
}

/// A store access that failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    /// The store could not be reached or answered garbage.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store refused a write fenced by a stale token
    /// (`dlock_core::Error::StaleToken`): nothing was written.
    #[error("{0}")]
    Stale(dlock_core::Error),
}

impl StoreError {
    pub(crate) fn unavailable(e: impl fmt::Display) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError::unavailable(e)
    }
}

impl From<dlock_core::Error> for StoreError {
    fn from(e: dlock_core::Error) -> Self {
        if e.is_stale() {
            StoreError::Stale(e)
        } else {
            StoreError::unavailable(e)
        }
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
    /// In a PostgreSQL database that several instances share.
    #[cfg(feature = "postgres")]
    Postgres(crate::pg::PgStore),
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Store::Memory(_) => "Store::Memory",
            Store::Redis(_) => "Store::Redis",
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => "Store::Postgres",
        })
    }
}

/// The in-process tables.
#[derive(Debug, Default)]
pub(crate) struct MemoryStore {
    products: HashMap<String, Stock>,
    /// The highest fencing token seen per product.
    fences: HashMap<String, u64>,
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

impl MemoryStore {
    /// The fence of product `id`: refuses a token below the highest seen,
    /// and records it (reads too, as `dlock_core::fence::redis` does).
    fn fence(&mut self, id: &str, token: Option<u64>) -> Result<(), StoreError> {
        let Some(token) = token else { return Ok(()) };
        let newest = self.fences.entry(id.to_owned()).or_default();
        if token < *newest {
            return Err(StoreError::Stale(dlock_core::Error::StaleToken {
                resource: product_key(id),
                token,
                newest: *newest,
            }));
        }
        *newest = token;
        Ok(())
    }
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
        let client = redis::Client::open(url).map_err(StoreError::unavailable)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(1)))
            .set_response_timeout(Some(std::time::Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(std::time::Duration::from_millis(250));
        let conn = ConnectionManager::new_with_config(client, config).await.map_err(StoreError::unavailable)?;
        Ok(Store::Redis(conn))
    }

    /// `memory`, `redis` or `postgres`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => "postgres",
        }
    }

    /// Sells `quantity` units of product `id`: reads its stock, works for
    /// `work` (the window a pause or a second seller lands in), writes it
    /// back, each access fenced by `fence` (`None`: unfenced).
    pub(crate) async fn sell(
        &self,
        id: &str,
        quantity: i64,
        fence: Option<u64>,
        work: Duration,
    ) -> Result<Sale, StoreError> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(pg) = self {
            return pg.sell(id, quantity, fence, work).await;
        }
        let Some(current) = self.read_stock(id, fence).await? else { return Ok(Sale::NotFound) };
        if current.stock < quantity {
            return Ok(Sale::SoldOut(current.stock));
        }
        // Another request that read the same stock would now write the same
        // result: the lost update the lock prevents, and the fence when the
        // lock ran out.
        tokio::time::sleep(work).await;
        let next = Stock { stock: current.stock - quantity, sold: current.sold + quantity };
        self.put(id, next, fence).await?;
        Ok(Sale::Sold(next.stock))
    }

    /// The stock of product `id`, read fenced by `fence`.
    async fn read_stock(&self, id: &str, fence: Option<u64>) -> Result<Option<Stock>, StoreError> {
        match (self, fence) {
            (Store::Memory(m), _) => {
                let mut m = m.lock().await;
                m.fence(id, fence)?;
                Ok(m.products.get(id).copied())
            }
            (Store::Redis(conn), Some(token)) => {
                let raw = dlock_core::fence::redis::get(&mut conn.clone(), &product_key(id), token).await?;
                raw.map(|s| parse_stock(id, &s)).transpose()
            }
            _ => self.get(id).await,
        }
    }

    /// The stock of product `id`, if it exists (unfenced: for answers, not
    /// for a read-modify-write).
    pub(crate) async fn get(&self, id: &str) -> Result<Option<Stock>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.lock().await.products.get(id).copied()),
            Store::Redis(conn) => {
                let raw: Option<String> = conn.clone().get(product_key(id)).await?;
                raw.map(|s| parse_stock(id, &s)).transpose()
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.get(id).await,
        }
    }

    /// Overwrites the stock of product `id`, fenced by `fence` (`None`:
    /// unfenced).
    pub(crate) async fn put(&self, id: &str, stock: Stock, fence: Option<u64>) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                let mut m = m.lock().await;
                m.fence(id, fence)?;
                m.products.insert(id.to_owned(), stock);
                Ok(())
            }
            Store::Redis(conn) => {
                let raw = serde_json::to_string(&stock).map_err(StoreError::unavailable)?;
                match fence {
                    Some(token) => {
                        dlock_core::fence::redis::set(&mut conn.clone(), &product_key(id), raw, token).await?
                    }
                    None => conn.clone().set(product_key(id), raw).await?,
                }
                Ok(())
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.put(id, stock, fence).await,
        }
    }

    /// The balance of account `id`, if it exists.
    pub(crate) async fn balance(&self, id: &str) -> Result<Option<i64>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.lock().await.accounts.get(id).copied()),
            Store::Redis(conn) => Ok(conn.clone().get(account_key(id)).await?),
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.balance(id).await,
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
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.set_balance(id, balance).await,
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
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.record_order(order_id, order).await,
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
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.count_charge(order_id).await,
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
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.record_payment_once(claim, payment_id, payment).await,
        }
    }
}

fn parse_stock(id: &str, raw: &str) -> Result<Stock, StoreError> {
    serde_json::from_str(raw).map_err(|e| StoreError::Unavailable(format!("product {id}: {e}")))
}
