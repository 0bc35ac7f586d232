//! The protected resource: per-key registers on a redis-server of their own
//! (never the lock server), so that lock faults cannot touch them.
//!
//! * `f:<k>` is the **fenced** counter. Every access, reads included, runs a
//!   script carrying the holder's fencing token, accepted iff the token is at
//!   least the highest seen for the key (`fmax:<k>`). Reads are fenced too:
//!   otherwise a new holder could read, a stale holder then write, and the new
//!   holder overwrite that write, losing it despite tokens. Refusals and
//!   accepted writes are appended to `flog:<k>`, for a person reading a kept
//!   run; the checker judges fencing from the clients' histories instead
//!   (this script refuses any token below its max, so its own log can never
//!   show a stale write accepted).
//! * `u:<k>` is the **unfenced** control: the same read–sleep–write without a
//!   token. It must lose updates when a fault breaks mutual exclusion, which
//!   proves the fault really happened.
//! * `s:<k>` is the **fenced set** (checker C3, Jepsen's set-full): each
//!   holder reads the whole set, sleeps as for the counter, and writes the
//!   whole set back with its op id added, fenced by its own `smax:<k>`
//!   exactly as the counter is. `us:<k>` is its unfenced control. A set read
//!   and rewritten whole costs traffic that grows with the set, so a set
//!   stops taking ids once it holds the run's cap (`sn:<k>` / `usn:<k>`
//!   count them; a full set answers "full" without being read or fenced).

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

const SET: &str = r#"
-- KEYS[1] the set (op ids separated by spaces), KEYS[2] its size,
-- KEYS[3] the max token ('' for the unfenced control)
-- ARGV[1] token, ARGV[2] cap, ARGV[3] 'r' (read) or the whole set to write,
-- ARGV[4] the written set's size
if ARGV[3] == 'r' and tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[2]) then
  return {2, ''}
end
if KEYS[3] ~= '' then
  local token = tonumber(ARGV[1])
  local max = tonumber(redis.call('GET', KEYS[3]) or '0')
  if token < max then
    return {0, ''}
  end
  redis.call('SET', KEYS[3], ARGV[1])
end
if ARGV[3] == 'r' then
  return {1, redis.call('GET', KEYS[1]) or ''}
end
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[4])
return {1, ''}
"#;

/// The answer of a set register access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SetAccess {
    /// Accepted; the set's op ids (read) or nothing (write).
    Ok(Vec<String>),
    /// Refused: a higher token has touched the set.
    Stale,
    /// The set holds the run's cap of ids and takes no more.
    Full,
}

/// Which set register: the fenced one or its unfenced control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SetReg {
    Fenced,
    Unfenced,
}

impl SetReg {
    /// The register's name in the history (`reg`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            SetReg::Fenced => "s",
            SetReg::Unfenced => "us",
        }
    }

    fn keys(self, key: u32) -> [String; 3] {
        match self {
            SetReg::Fenced => [format!("s:{key}"), format!("sn:{key}"), format!("smax:{key}")],
            SetReg::Unfenced => [format!("us:{key}"), format!("usn:{key}"), String::new()],
        }
    }
}

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
    set: Script,
}

impl std::fmt::Debug for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resource")
    }
}

impl Resource {
    pub(crate) async fn connect(url: &str) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        // No response timeout (the client's default is 500 ms): this server
        // is never faulted, and a worker stopped with an access in flight
        // must get the register's real answer when it resumes (refused, as
        // a stale holder), not a timeout the checker can only count as an
        // indeterminate write. A hang shows as a worker that never finishes.
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        let conn = client.get_multiplexed_async_connection_with_config(&config).await?;
        Ok(Resource { conn, script: Script::new(FENCED), set: Script::new(SET) })
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

    async fn set_access(
        &self,
        reg: SetReg,
        key: u32,
        token: u64,
        cap: u32,
        arg: String,
        size: usize,
    ) -> redis::RedisResult<SetAccess> {
        let mut conn = self.conn.clone();
        let [set, count, max] = reg.keys(key);
        let (status, ids): (i64, String) = self
            .set
            .key(set)
            .key(count)
            .key(max)
            .arg(token)
            .arg(cap)
            .arg(arg)
            .arg(size)
            .invoke_async(&mut conn)
            .await?;
        Ok(match status {
            1 => SetAccess::Ok(ids.split_ascii_whitespace().map(str::to_owned).collect()),
            2 => SetAccess::Full,
            _ => SetAccess::Stale,
        })
    }

    /// Reads `key`'s whole set (fenced by `token` for [`SetReg::Fenced`]),
    /// unless it already holds `cap` ids.
    pub(crate) async fn set_read(&self, reg: SetReg, key: u32, token: u64, cap: u32) -> redis::RedisResult<SetAccess> {
        self.set_access(reg, key, token, cap, "r".into(), 0).await
    }

    /// Writes `ids` as `key`'s whole set (fenced by `token` for
    /// [`SetReg::Fenced`]).
    pub(crate) async fn set_write(
        &self,
        reg: SetReg,
        key: u32,
        token: u64,
        ids: &[String],
    ) -> redis::RedisResult<SetAccess> {
        self.set_access(reg, key, token, 0, ids.join(" "), ids.len()).await
    }

    /// The final contents of `key`'s set register.
    pub(crate) async fn set_snapshot(
        &self,
        reg: SetReg,
        key: u32,
    ) -> redis::RedisResult<std::collections::HashSet<String>> {
        let mut conn = self.conn.clone();
        let [set, _, _] = reg.keys(key);
        let ids: Option<String> = conn.get(set).await?;
        Ok(ids.unwrap_or_default().split_ascii_whitespace().map(str::to_owned).collect())
    }

    /// The final values of `key`'s registers: (fenced, unfenced).
    pub(crate) async fn snapshot(&self, key: u32) -> redis::RedisResult<(i64, i64)> {
        let mut conn = self.conn.clone();
        let f: Option<i64> = conn.get(format!("f:{key}")).await?;
        let u: Option<i64> = conn.get(format!("u:{key}")).await?;
        Ok((f.unwrap_or(0), u.unwrap_or(0)))
    }
}

#[cfg(test)]
mod tests {
    use dlock_testing::RedisServer;

    use super::*;

    /// The fenced set refuses a stale token exactly as the counter does,
    /// the unfenced control takes anything, and a set at its cap answers
    /// "full" without being read.
    #[tokio::test(flavor = "current_thread")]
    async fn the_set_register_is_fenced_and_capped() {
        let server = RedisServer::start();
        let res = Resource::connect(&server.url()).await.expect("connect");
        let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();

        assert_eq!(res.set_read(SetReg::Fenced, 0, 5, 3).await.expect("read"), SetAccess::Ok(vec![]));
        assert_eq!(res.set_read(SetReg::Fenced, 0, 6, 3).await.expect("read"), SetAccess::Ok(vec![]));
        assert_eq!(res.set_write(SetReg::Fenced, 0, 5, &ids(&["a"])).await.expect("write"), SetAccess::Stale);
        assert_eq!(res.set_write(SetReg::Fenced, 0, 6, &ids(&["b"])).await.expect("write"), SetAccess::Ok(vec![]));
        assert_eq!(res.set_read(SetReg::Fenced, 0, 5, 3).await.expect("read"), SetAccess::Stale);
        assert_eq!(res.set_read(SetReg::Fenced, 0, 7, 3).await.expect("read"), SetAccess::Ok(ids(&["b"])));

        // The control: a lower token still writes (and loses "b").
        assert_eq!(
            res.set_write(SetReg::Unfenced, 0, 1, &ids(&["b", "c"])).await.expect("write"),
            SetAccess::Ok(vec![])
        );
        assert_eq!(res.set_write(SetReg::Unfenced, 0, 0, &ids(&["d"])).await.expect("write"), SetAccess::Ok(vec![]));
        assert_eq!(res.set_read(SetReg::Unfenced, 0, 0, 3).await.expect("read"), SetAccess::Ok(ids(&["d"])));

        // At the cap the set is left alone.
        assert_eq!(
            res.set_write(SetReg::Fenced, 0, 7, &ids(&["b", "e", "f"])).await.expect("write"),
            SetAccess::Ok(vec![])
        );
        assert_eq!(res.set_read(SetReg::Fenced, 0, 8, 3).await.expect("read"), SetAccess::Full);
        let final_set = res.set_snapshot(SetReg::Fenced, 0).await.expect("snapshot");
        assert_eq!(final_set.len(), 3);
        assert!(final_set.contains("e"));
    }
}
