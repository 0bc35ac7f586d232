//! The protected resource: per-key registers on a redis-server of their own
//! (never the lock server), so that lock faults cannot touch them.
//!
//! * `f:<k>` is the **fenced** counter. Every access, reads included, runs a
//!   script carrying the holder's fencing token, accepted iff the token is at
//!   least the highest seen for the key (`fmax:<k>`). Reads are fenced too:
//!   otherwise a new holder could read, a stale holder then write, and the new
//!   holder overwrite that write, losing it despite tokens. Every decision is
//!   appended to `flog:<k>` so the checker can recompute it.
//! * `u:<k>` is the **unfenced** control: the same read–sleep–write without a
//!   token. It must lose updates when a fault breaks mutual exclusion, which
//!   proves the fault really happened.

use redis::aio::MultiplexedConnection;
use redis::{AsyncCommands, Script};

const FENCED: &str = r#"
-- KEYS[1] value, KEYS[2] max token, KEYS[3] decision log
-- ARGV[1] token, ARGV[2] 'r' (read) or the value to write
local token = tonumber(ARGV[1])
local max = tonumber(redis.call('GET', KEYS[2]) or '0')
if token < max then
  redis.call('RPUSH', KEYS[3], 'refused:' .. ARGV[1] .. ':' .. max)
  return {0, 0}
end
redis.call('SET', KEYS[2], ARGV[1])
if ARGV[2] == 'r' then
  return {1, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('RPUSH', KEYS[3], 'accepted:' .. ARGV[1] .. ':' .. max)
return {1, tonumber(ARGV[2])}
"#;

/// The answer of a fenced access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fenced {
    /// Accepted; the register's value (read) or the value written.
    Ok(i64),
    /// Refused: a higher token has touched the register.
    Stale,
}

/// A connection to the resource server.
#[derive(Clone)]
pub(crate) struct Resource {
    conn: MultiplexedConnection,
    script: Script,
}

impl std::fmt::Debug for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resource")
    }
}

impl Resource {
    pub(crate) async fn connect(url: &str) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        Ok(Resource { conn, script: Script::new(FENCED) })
    }

    async fn fenced(&self, key: u32, token: u64, arg: String) -> redis::RedisResult<Fenced> {
        let mut conn = self.conn.clone();
        let (ok, val): (i64, i64) = self
            .script
            .key(format!("f:{key}"))
            .key(format!("fmax:{key}"))
            .key(format!("flog:{key}"))
            .arg(token)
            .arg(arg)
            .invoke_async(&mut conn)
            .await?;
        Ok(if ok == 1 { Fenced::Ok(val) } else { Fenced::Stale })
    }

    /// A fenced read of `key`'s counter.
    pub(crate) async fn fenced_read(&self, key: u32, token: u64) -> redis::RedisResult<Fenced> {
        self.fenced(key, token, "r".into()).await
    }

    /// A fenced write of `value` to `key`'s counter.
    pub(crate) async fn fenced_write(&self, key: u32, token: u64, value: i64) -> redis::RedisResult<Fenced> {
        self.fenced(key, token, value.to_string()).await
    }

    /// The unfenced control's value.
    pub(crate) async fn read(&self, key: u32) -> redis::RedisResult<i64> {
        let mut conn = self.conn.clone();
        Ok(conn.get::<_, Option<i64>>(format!("u:{key}")).await?.unwrap_or(0))
    }

    /// Sets the unfenced control.
    pub(crate) async fn write(&self, key: u32, value: i64) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        conn.set(format!("u:{key}"), value).await
    }

    /// The final values and the fencing decisions of `key`:
    /// (fenced, unfenced, [(accepted, token, max before)]).
    pub(crate) async fn snapshot(&self, key: u32) -> redis::RedisResult<(i64, i64, Vec<(bool, u64, u64)>)> {
        let mut conn = self.conn.clone();
        let f: Option<i64> = conn.get(format!("f:{key}")).await?;
        let u: Option<i64> = conn.get(format!("u:{key}")).await?;
        let log: Vec<String> = conn.lrange(format!("flog:{key}"), 0, -1).await?;
        let decisions = log
            .iter()
            .filter_map(|l| {
                let mut it = l.split(':');
                let accepted = it.next()? == "accepted";
                Some((accepted, it.next()?.parse().ok()?, it.next()?.parse().ok()?))
            })
            .collect();
        Ok((f.unwrap_or(0), u.unwrap_or(0), decisions))
    }
}
