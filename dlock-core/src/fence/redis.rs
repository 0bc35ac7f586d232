//! Fencing of a Redis value: [`get`] and [`set`] each run one script that
//! compares the holder's token with the highest seen for the value (kept in
//! [`fence_key`]), refuse a lower one with [`Error::StaleToken`], and raise
//! it. The read raises it too: a stale holder's write is then refused once
//! a newer holder has read. A read-modify-write is `get` then `set` with
//! the token of the lock you hold, and every writer goes through [`set`].
//! On a Redis Cluster put a hash tag in the key (`shop:{product:42}`) so
//! that it and its fence share a slot.

use redis::aio::ConnectionLike;
use redis::{Script, ToRedisArgs};
use std::sync::LazyLock;

use crate::error::{Error, Result};

const BACKEND: &str = "redis";

/// The one script of the fenced accesses.
static FENCED: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("fenced.lua")));

/// The key that keeps the highest token seen for `key`.
///
/// ```
/// assert_eq!(dlock_core::fence::redis::fence_key("shop:{product:42}"), "shop:{product:42}:fence");
/// ```
pub fn fence_key(key: &str) -> String {
    format!("{key}:fence")
}

/// Reads `key` (a string value; `None` when missing) if `token` is at
/// least the highest token seen for it, and records `token` as seen.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection, guard: dlock_core::LockGuard) -> dlock_core::Result<()> {
/// use dlock_core::fence::redis as fenced;
/// let token = guard.fencing_token();
/// let stock: i64 = fenced::get(&mut conn, "shop:{product:42}", token).await?.and_then(|s| s.parse().ok()).unwrap_or(0);
/// fenced::set(&mut conn, "shop:{product:42}", stock - 1, token).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::StaleToken`] when a higher token was seen: nothing was read.
/// [`Error::Backend`] when Redis fails or the value is not a string.
pub async fn get<C: ConnectionLike + Send>(conn: &mut C, key: &str, token: u64) -> Result<Option<String>> {
    let (accepted, value): (i64, Option<String>) = FENCED
        .key(key)
        .key(fence_key(key))
        .arg(token)
        .arg("get")
        .invoke_async(conn)
        .await
        .map_err(|e| failed("a fenced read", e))?;
    match accepted {
        1 => Ok(value),
        _ => Err(stale(key, token, value)),
    }
}

/// Sets `key` to `value` if `token` is at least the highest token seen for
/// it, and records `token` as seen. The same holder may write twice.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection) -> dlock_core::Result<()> {
/// use dlock_core::fence::redis as fenced;
/// fenced::set(&mut conn, "report:7", "v2", 12).await?;
/// let err = fenced::set(&mut conn, "report:7", "v1", 11).await.unwrap_err();
/// assert!(err.is_stale());
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::StaleToken`] when a higher token was seen: nothing was
/// written. [`Error::Backend`] when Redis fails.
///
/// # Cancellation safety
///
/// A command already sent runs to its end: a dropped call may have
/// written.
pub async fn set<C, V>(conn: &mut C, key: &str, value: V, token: u64) -> Result<()>
where
    C: ConnectionLike + Send,
    V: ToRedisArgs,
{
    let (accepted, newest): (i64, Option<String>) = FENCED
        .key(key)
        .key(fence_key(key))
        .arg(token)
        .arg("set")
        .arg(value)
        .invoke_async(conn)
        .await
        .map_err(|e| failed("a fenced write", e))?;
    match accepted {
        1 => Ok(()),
        _ => Err(stale(key, token, newest)),
    }
}

fn stale(key: &str, token: u64, newest: Option<String>) -> Error {
    let newest = newest.and_then(|n| n.parse().ok()).unwrap_or(token);
    Error::StaleToken { resource: key.to_owned(), token, newest }
}

fn failed(what: &str, e: redis::RedisError) -> Error {
    Error::Backend { backend: BACKEND, message: format!("{what}: {e}"), source: Some(Box::new(e)) }
}
