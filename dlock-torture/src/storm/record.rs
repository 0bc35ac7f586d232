//! Where a storm key's idempotency record lives on the storm's Redis, and
//! how long ago it was claimed: what tells, from outside `orders`, whether a
//! client hung up while its key's claim was on its way.
//!
//! The claim (`begin.lua`) sets the record with the records' TTL, and
//! neither completing nor renewing it touches that TTL, so the record's
//! remaining time (`PTTL`, read straight from Redis, not through the slow
//! proxy) dates the claim to the millisecond. The names and the scope are
//! the store's and `IdempotencyLayer`'s own (`dlock-core`
//! `idempotency/redis.rs`, `dlock-axum` `caller.rs`); [`check`] proves them
//! on a real request before the storm, so a change there fails the row
//! loudly instead of dating nothing.

use std::time::Duration;

use dlock_core::idempotency::fingerprint;
use redis::aio::MultiplexedConnection;

/// The `DLOCK_PREFIX` both instances are given.
pub(super) const PREFIX: &str = "storm";
/// The records' TTL both instances are given (`DLOCK_IDEMPOTENCY_TTL_SECS`):
/// known here, so a record's remaining TTL gives its age.
pub(super) const TTL: Duration = Duration::from_secs(600);
/// The `Authorization` value of every storm request: one caller, one scope.
pub(super) const CALLER: &str = "Bearer storm";

/// The scope `IdempotencyLayer` files [`CALLER`]'s keys under
/// (`Caller::authorization`: the header's name and its value's hash).
pub(super) fn scope() -> String {
    format!("h:authorization:{}", fingerprint(&[CALLER]))
}

/// The record of Idempotency-Key `key` (`prefix:idem:r:{<sha1(scope)>}:<sha1(scope, key)>`).
pub(super) fn name(key: &str) -> String {
    let scope = scope();
    format!("{PREFIX}:idem:r:{{{}}}:{}", fingerprint(&[scope.as_str()]), fingerprint(&[scope.as_str(), key]))
}

/// How long ago `key` was claimed, as Redis sees it now; `None` when it has
/// no record (never claimed, or its claim was given back).
pub(super) async fn age(conn: &mut MultiplexedConnection, key: &str) -> Result<Option<Duration>, String> {
    let pttl: i64 = redis::cmd("PTTL").arg(name(key)).query_async(conn).await.map_err(|e| format!("PTTL: {e}"))?;
    match u64::try_from(pttl) {
        Ok(ms) => Ok(Some(TTL.saturating_sub(Duration::from_millis(ms)))),
        // -2: no such key.
        Err(_) if pttl == -2 => Ok(None),
        Err(_) => Err(format!("the record of {key} has no TTL (PTTL {pttl})")),
    }
}

/// Proves [`name`] and [`TTL`] on `key`, which a request has just claimed
/// and answered: its record must be where [`name`] says, claimed within
/// the last 10 s.
pub(super) async fn check(conn: &mut MultiplexedConnection, key: &str) -> Result<(), String> {
    match age(conn, key).await? {
        Some(age) if age < Duration::from_secs(10) => Ok(()),
        Some(age) => Err(format!(
            "the record of {key} was claimed {age:?} ago by its TTL: the records' TTL is not the {TTL:?} this harness set"
        )),
        None => Err(format!(
            "no record of {key} at {}: the store names its records otherwise now (update storm/record.rs)",
            name(key)
        )),
    }
}
