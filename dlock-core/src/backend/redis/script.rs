//! The lock scripts, their calls and their replies.
//!
//! Each lock script is built once from its body and the per-key code it
//! shares with its many-key twin (`take.lua`, `free.lua`; `clock.lua` for
//! the scripts that make tokens; `counted.lua`, how a key with several
//! holders is kept, for every script that touches a lock), as Lua cannot
//! import.
//!
//! [`ScriptCall`] is a script called by its SHA1, the command written once:
//! every script of the Redis backends and of the Redis idempotency store
//! goes out this way.
//!
//! redis-rs's `ScriptInvocation` keeps every key and argument in a vector
//! of its own and copies them all into the `EVALSHA` it sends: seven
//! allocations for an acquire and four for a release that a lock cycle does
//! not need, on a path every request takes (and a stored response copied
//! twice). [`ScriptCall`] writes the command in place. A server that does not know the script (`NOSCRIPT`: it
//! restarted or was flushed) gets it loaded and the same command again, as
//! `ScriptInvocation` does.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, ToRedisArgs};
use tokio::time::Instant;

use super::lease_ms;
use crate::backend::{AcquireRequest, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// The server clock as token text, prepended to the scripts that make
/// tokens.
const CLOCK: &str = include_str!("clock.lua");
/// A key with several holders (shared, permits), prepended to every
/// script that touches a lock.
const COUNTED: &str = include_str!("counted.lua");
/// What an acquire does to one lock, prepended to both acquire scripts.
const TAKE: &str = include_str!("take.lua");
/// What a release does to one lock, prepended to both release scripts.
const FREE: &str = include_str!("free.lua");

/// The lock scripts.
pub(crate) struct LockScripts {
    pub(crate) acquire: Script,
    pub(crate) acquire_many: Script,
    pub(crate) release: Script,
    pub(crate) release_many: Script,
    /// Renews one lock or many.
    pub(crate) renew: Script,
    /// RedLock's write-back of a granted token to a node's high-water mark.
    pub(crate) raise_mark: Script,
}

static LOCK_SCRIPTS: LazyLock<LockScripts> = LazyLock::new(|| {
    #[cfg(feature = "broken-variants")]
    let take = crate::broken_variants::take_script(TAKE);
    #[cfg(not(feature = "broken-variants"))]
    let take = TAKE;
    LockScripts {
        acquire: Script::new(&format!("{CLOCK}{COUNTED}{take}{}", include_str!("acquire.lua"))),
        acquire_many: Script::new(&format!("{CLOCK}{COUNTED}{take}{}", include_str!("acquire_many.lua"))),
        release: Script::new(&format!("{COUNTED}{FREE}{}", include_str!("release.lua"))),
        release_many: Script::new(&format!("{COUNTED}{FREE}{}", include_str!("release_many.lua"))),
        renew: Script::new(&format!("{COUNTED}{}", include_str!("renew.lua"))),
        raise_mark: Script::new(&format!("{CLOCK}{}", include_str!("raise_mark.lua"))),
    }
});

/// The lock scripts, built once per process.
pub(crate) fn lock_scripts() -> &'static LockScripts {
    &LOCK_SCRIPTS
}

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

/// The one-key acquire script's call (`acquire.lua`) for `req` with the
/// high-water `mark`, and the restart quarantine's data `marker` if on.
pub(crate) fn acquire_call<'a>(
    script: &'a Script,
    req: &AcquireRequest,
    mark: &str,
    marker: Option<&str>,
    awaited: bool,
) -> ScriptCall<'a> {
    let mut call = match marker {
        Some(marker) => ScriptCall::new(script, &[req.key.as_str(), mark, marker], 6),
        None => ScriptCall::new(script, &[req.key.as_str(), mark], 5),
    };
    acquire_args(&mut call, req, awaited);
    if marker.is_some() {
        call.arg("1");
    }
    call
}

/// One acquire's arguments, in the order both acquire scripts take them:
/// owner, lease in ms, awaited, mode, and how long a waiting writer or
/// permit may still wait (what bounds the intent that holds new readers
/// back, and the place that keeps a semaphore's limit; readers record
/// nothing).
pub(crate) fn acquire_args(call: &mut ScriptCall<'_>, req: &AcquireRequest, awaited: bool) {
    call.arg(req.owner.as_str()).arg(lease_ms(req.lease)).arg(if awaited { "1" } else { "0" });
    match req.mode {
        LockMode::Shared => call.arg("s"),
        LockMode::Permits { limit } => call.arg(format!("p{limit}")),
        LockMode::Exclusive => call.arg("x"),
    };
    let wait = match (req.mode, req.deadline) {
        (LockMode::Exclusive | LockMode::Permits { .. }, Some(deadline)) if awaited => {
            deadline.saturating_duration_since(Instant::now())
        }
        _ => Duration::ZERO,
    };
    call.arg(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
}

/// The one-key release script's call (`release.lua`).
pub(crate) fn release_call<'a>(script: &'a Script, key: &LockKey, owner: &Owner) -> ScriptCall<'a> {
    let mut call = ScriptCall::new(script, &[key.as_str()], 1);
    call.arg(owner.as_str());
    call
}

/// The one-key release script's call that takes back only what the waits
/// of `owner` left on `key` (`release.lua` with `w`: a withdrawal).
pub(crate) fn withdraw_call<'a>(script: &'a Script, key: &LockKey, owner: &Owner) -> ScriptCall<'a> {
    let mut call = ScriptCall::new(script, &[key.as_str()], 2);
    call.arg(owner.as_str()).arg("w");
    call
}

/// A lock script's answer for one key: at most three integers, kept
/// inline, since every lock operation gets one.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    values: [i64; 3],
    len: usize,
}

impl Reply {
    /// `values` as a reply; a parse error past three.
    pub(crate) fn new(values: &[i64]) -> std::result::Result<Reply, redis::ParsingError> {
        let mut reply = Reply { values: [0; 3], len: values.len() };
        reply
            .values
            .get_mut(..values.len())
            .ok_or_else(|| redis::ParsingError::from(format!("a lock script answered {values:?}")))?
            .copy_from_slice(values);
        Ok(reply)
    }

    pub(crate) fn as_slice(&self) -> &[i64] {
        &self.values[..self.len]
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// The acquire script's reply as `[1, token, 1]` (granted), `[1, token, 2]`
/// (joined), `[0, ms]` (held), `[3, mode held]` (held in a mode that does
/// not fit) or `[2]` (data marker gone). A grant comes
/// back as the bare token, the cheapest reply for the script to build.
pub(crate) fn acquire_reply(reply: redis::Value) -> Result<Reply> {
    let parsed = match reply {
        redis::Value::BulkString(_) => {
            redis::from_redis_value::<i64>(reply).and_then(|token| Reply::new(&[1, token, 1]))
        }
        other => redis::from_redis_value::<Vec<i64>>(other).and_then(|reply| Reply::new(&reply)),
    };
    parsed.map_err(|e| Error::backend("redis", format!("unexpected reply from the acquire script: {e}")))
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
