//! [`ScriptCall`]: a script called by its SHA1, the command written once.
//! Every script of the Redis backends and of the Redis idempotency store
//! goes out this way.
//!
//! redis-rs's `ScriptInvocation` keeps every key and argument in a vector
//! of its own and copies them all into the `EVALSHA` it sends: seven
//! allocations for an acquire and four for a release that a lock cycle does
//! not need, on a path every request takes (and a stored response copied
//! twice). [`ScriptCall`] writes the command in place. A server that does
//! not know the script (`NOSCRIPT`: it restarted or was flushed) gets it
//! loaded and the same command again, as `ScriptInvocation` does.

use std::time::Duration;

use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, ToRedisArgs};

/// One `EVALSHA` of a script: its keys, then its arguments.
pub(crate) struct ScriptCall<'a> {
    script: &'a Script,
    cmd: Cmd,
}

impl<'a> ScriptCall<'a> {
    /// A call of `script` on `keys` (its `KEYS`); [`arg`](Self::arg) adds
    /// its `ARGV` in order. `args` is how many will come, to size the
    /// command once.
    pub(crate) fn new(script: &'a Script, keys: &[&str], args: usize) -> Self {
        let bytes = 64 + keys.iter().map(|k| k.len() + 16).sum::<usize>() + 48 * args;
        let mut cmd = Cmd::with_capacity(3 + keys.len() + args, bytes);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for key in keys {
            cmd.arg(*key);
        }
        ScriptCall { script, cmd }
    }

    /// Adds the next argument (`ARGV[i]`).
    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Sends the call; on `NOSCRIPT`, loads the script and sends it again.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, conn: &mut impl redis::aio::ConnectionLike) -> RedisResult<T> {
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                self.cmd.query_async(conn).await
            }
            answered => answered,
        }
    }
}

/// A duration as whole milliseconds for `PX` / `PEXPIRE`, at least 1 (0 is
/// an error there).
pub(crate) fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_before_the_arguments_as_evalsha_wants() {
        let script = Script::new("return 1");
        let mut call = ScriptCall::new(&script, &["k1", "k2"], 2);
        call.arg("owner").arg(30_000u64);
        let packed = String::from_utf8(call.cmd.get_packed_command()).expect("text");
        let words: Vec<&str> = packed.split("\r\n").filter(|w| !w.starts_with('*') && !w.starts_with('$')).collect();
        assert_eq!(words[..7], ["EVALSHA", script.get_hash(), "2", "k1", "k2", "owner", "30000"]);
    }
}
