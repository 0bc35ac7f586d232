//! The lock scripts, their calls and their replies.
//!
//! Each lock script is built once from its body and the per-key code it
//! shares with its many-key twin (`take.lua`, `free.lua`; `clock.lua` for
//! the scripts that make tokens; `counted.lua`, how a key with several
//! holders is kept, for every script that touches a lock), as Lua cannot
//! import. Every call goes out as a [`ScriptCall`].

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use crate::backend::{AcquireRequest, Grant, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;
use crate::redis::{lease_ms, ScriptCall};

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
    /// Reads a lock for an operator.
    pub(crate) inspect: Script,
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
        inspect: Script::new(include_str!("inspect.lua")),
    }
});

/// The lock scripts, built once per process.
pub(crate) fn lock_scripts() -> &'static LockScripts {
    &LOCK_SCRIPTS
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

/// The acquire scripts' answer when the data marker is gone.
pub(super) fn marker_gone((reply, _): &(Reply, Instant)) -> bool {
    reply.as_slice() == [2]
}

/// An acquire script's reply for one lock, sent at `sent`.
pub(super) fn node_attempt(reply: &[i64], sent: Instant, lease: Duration) -> Result<NodeAttempt> {
    Ok(match reply {
        // Held in a mode that does not fit the one asked for: -1 exclusive,
        // 0 shared, N one of N permits.
        [3, held] => NodeAttempt::Conflict {
            held: match u32::try_from(*held) {
                Ok(0) => LockMode::Shared,
                Ok(limit) => LockMode::Permits { limit },
                Err(_) => LockMode::Exclusive,
            },
        },
        // The third value tells a fresh grant (1) from one that joined a
        // hold of the same owner (2), which keeps its token: either is ours.
        [1, token, _] => NodeAttempt::Granted { grant: Grant::until(u64::try_from(*token).unwrap_or(0), sent + lease) },
        // PTTL: -2 gone since (try again now), -1 no TTL (wait for a release).
        [0, -2] => NodeAttempt::Held { retry_in: Some(Duration::ZERO) },
        [0, ms] if *ms >= 0 => NodeAttempt::Held { retry_in: Some(Duration::from_millis(*ms as u64)) },
        [0, _] => NodeAttempt::Held { retry_in: None },
        other => return Err(Error::backend("redis", format!("unexpected reply from the acquire script: {other:?}"))),
    })
}

/// One node's answer to an acquire.
#[derive(Debug)]
pub(crate) enum NodeAttempt {
    Granted {
        grant: Grant,
    },
    Held {
        retry_in: Option<Duration>,
    },
    /// Held (by others, or by this owner) in `held`, which does not fit the
    /// mode asked for: a mistake of the program, not contention.
    Conflict {
        held: LockMode,
    },
}
