//! **Test only** (feature `broken-variants`): switches that break one of
//! dlock's own mechanisms on purpose, so that `dlock-torture`'s checkers can
//! be shown to catch each bug in the real code, not only in a lock the
//! harness wrote itself. Every switch is off until a harness turns it on
//! for its whole process with [`set`]; with all of them off, nothing
//! behaves differently. Never enable the feature in an application.

use std::sync::atomic::{AtomicU32, Ordering};

/// One deliberately broken mechanism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Switch {
    /// The restart quarantine of a missing data marker ends at once: the
    /// first client to find the marker missing sets it again and grants
    /// (`redis/restart.rs`, the quarantine script told 0 µs).
    QuarantineOpensEarly,
    /// A release retried in the background gives its owner's turn up at
    /// once, so an acquire of the same key and owner can join the hold on
    /// the server just before the retry deletes it (`engine/guard.rs`).
    RetryIgnoresTurn,
    /// A coalesced batch answers an acquire that found its key held by an
    /// earlier acquire of the same batch with that acquire's grant: a second
    /// holder with the same token (`backend/redis/batch.rs`).
    BatchRepeatsToken,
    /// A semaphore admits one holder more than its limit (ZooKeeper's turn
    /// rule counts one contender too few, `backend/zookeeper/node.rs`;
    /// Redis's acquire script and PostgreSQL's acquire function count one
    /// holder too few, `take.lua`, `acquire.sql`).
    PermitsOverLimit,
    /// A reader takes a read-write lock however many writers are ahead of
    /// it (ZooKeeper's turn rule ignores them, `backend/zookeeper/node.rs`;
    /// Redis's acquire script and PostgreSQL's acquire function ignore a
    /// waiting writer's intent, `take.lua`, `acquire.sql`).
    ReadersPassWriters,
    /// A writer that leaves without the key never takes its intent back
    /// (Redis, RedLock and PostgreSQL:
    /// [`Backend::withdraw`](crate::backend::Backend::withdraw) does
    /// nothing, `backend/redis/mod.rs`, `backend/postgres/mod.rs`): the
    /// readers it kept out wait until its wait would have ended.
    IntentNeverWithdrawn,
}

static ON: AtomicU32 = AtomicU32::new(0);

fn bit(switch: Switch) -> u32 {
    1 << switch as u32
}

/// Turns `switch` on or off for this whole process.
pub fn set(switch: Switch, on: bool) {
    if on {
        ON.fetch_or(bit(switch), Ordering::SeqCst);
    } else {
        ON.fetch_and(!bit(switch), Ordering::SeqCst);
    }
}

/// Whether `switch` is on.
pub fn is_on(switch: Switch) -> bool {
    ON.load(Ordering::Relaxed) & bit(switch) != 0
}

/// [`Switch::QuarantineOpensEarly`]: the quarantine the script is told, in µs.
#[cfg(feature = "redis")]
pub(crate) fn quarantine_micros(micros: u64) -> u64 {
    if is_on(Switch::QuarantineOpensEarly) {
        0
    } else {
        micros
    }
}

/// [`Switch::RetryIgnoresTurn`]: the turn a release retry keeps (none).
pub(crate) fn keep_turn<T>(turn: T) -> Option<T> {
    (!is_on(Switch::RetryIgnoresTurn)).then_some(turn)
}

/// [`Switch::BatchRepeatsToken`]: `acquire_many.lua`'s reply (`{1, token,
/// 1}` granted, `{1, token, 2}` joined, `{0, ms, 0}` held, per key of
/// `keys` in order) with every "held" of a key granted earlier in the batch
/// turned into a copy of that grant.
#[cfg(feature = "redis")]
pub(crate) fn batch_repeats_token<'a>(flat: Vec<i64>, keys: impl Iterator<Item = &'a str>) -> Vec<i64> {
    if is_on(Switch::BatchRepeatsToken) {
        repeat_tokens(flat, keys)
    } else {
        flat
    }
}

#[cfg(feature = "redis")]
fn repeat_tokens<'a>(mut flat: Vec<i64>, keys: impl Iterator<Item = &'a str>) -> Vec<i64> {
    let mut granted: Vec<(&str, i64)> = Vec::new();
    for (chunk, key) in flat.chunks_mut(3).zip(keys) {
        match *chunk {
            [1, token, 1] => granted.push((key, token)),
            [0, ..] => {
                if let Some(&(_, token)) = granted.iter().find(|(k, _)| *k == key) {
                    chunk.copy_from_slice(&[1, token, 1]);
                }
            }
            _ => {}
        }
    }
    flat
}

#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;

    /// The broken batch: a second acquire of a key granted earlier in the
    /// batch is answered with that grant; other answers stay as they were.
    #[test]
    fn a_repeated_key_gets_the_earlier_grant() {
        let flat = vec![1, 7, 1, 0, 30, 0, 0, 30, 0, 1, 8, 2];
        let broken = repeat_tokens(flat, ["a", "a", "b", "c"].into_iter());
        assert_eq!(broken, vec![1, 7, 1, 1, 7, 1, 0, 30, 0, 1, 8, 2]);
        assert_eq!(keep_turn(5), Some(5), "off unless a harness turns it on");
    }
}

/// The Redis acquire scripts' `take.lua` with [`Switch::PermitsOverLimit`]
/// (a semaphore full at one holder more than its limit) and
/// [`Switch::ReadersPassWriters`] (a reader never refused for a waiting
/// writer's intent) applied when on.
#[cfg(feature = "redis")]
pub(crate) fn take_script(take: &str) -> String {
    edit(
        "take.lua",
        take,
        &[
            (Switch::PermitsOverLimit, "if held > 0 and s.n >= held then", "if held > 0 and s.n > held then"),
            (Switch::ReadersPassWriters, "if held == 0 and s.intent and s.intent ~= owner then", "if false then"),
        ],
    )
}

/// PostgreSQL's acquire function (`acquire.sql`) with the same two
/// switches applied when on: a semaphore full at one holder more than its
/// limit, a reader never refused for a writer's intent.
#[cfg(feature = "postgres")]
pub(crate) fn acquire_function(sql: &str) -> String {
    edit(
        "acquire.sql",
        sql,
        &[
            (
                Switch::PermitsOverLimit,
                "refused := holders >= substr(p_mode, 2)::bigint;",
                "refused := holders > substr(p_mode, 2)::bigint;",
            ),
            (Switch::ReadersPassWriters, "refused := intent_end IS NOT NULL;", "refused := false;"),
            (Switch::ReadersPassWriters, "ELSIF p_mode = 's' AND intent_end IS NOT NULL THEN", "ELSIF false THEN"),
        ],
    )
}

/// `text` with each `(switch, from, to)` edit made whose switch is on.
/// Panics when the text an edit replaces is gone from `file`, so an edit of
/// the script cannot turn a switch into a silent no-op.
#[cfg(any(feature = "redis", feature = "postgres"))]
fn edit(file: &str, text: &str, edits: &[(Switch, &str, &str)]) -> String {
    let mut s = text.to_owned();
    for &(switch, from, to) in edits {
        assert!(s.contains(from), "{file} no longer holds `{from}`, which {switch:?} edits");
        if is_on(switch) {
            s = s.replace(from, to);
        }
    }
    s
}

/// [`Switch::PermitsOverLimit`]: the limit the turn rule applies.
#[cfg(feature = "zookeeper")]
pub(crate) fn permit_limit(limit: u32) -> u32 {
    if is_on(Switch::PermitsOverLimit) {
        limit + 1
    } else {
        limit
    }
}

/// [`Switch::ReadersPassWriters`]: whether a reader still waits for the
/// writer ahead of it.
#[cfg(feature = "zookeeper")]
pub(crate) fn readers_wait(waits: Option<usize>) -> Option<usize> {
    waits.filter(|_| !is_on(Switch::ReadersPassWriters))
}
