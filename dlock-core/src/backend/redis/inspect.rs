//! A Redis lock as an operator sees it (`inspect.lua`'s reply read into a
//! [`LockState`]), and the keys a listing keeps: dlock's own lock keys,
//! not their fencing marks, data markers or idempotency records.

use std::time::Duration;

use crate::backend::{Holder, LockMode, LockState};
use crate::error::{Error, Result};
use crate::key::LockKey;

/// A mode as the scripts write it: `x`, `s`, `p<N>`.
fn mode(text: &str) -> Option<LockMode> {
    match text {
        "x" => Some(LockMode::Exclusive),
        "s" => Some(LockMode::Shared),
        permits => permits.strip_prefix('p')?.parse().ok().map(LockMode::permits),
    }
}

fn malformed(what: &str) -> Error {
    Error::backend("redis", format!("a lock key holds {what}, which dlock does not write"))
}

/// `inspect.lua`'s reply for `key`.
pub(super) fn lock_state(key: &LockKey, reply: &[String]) -> Result<LockState> {
    let mut state = LockState::new(key.clone());
    let now: u64 = reply.first().and_then(|t| t.parse().ok()).ok_or_else(|| malformed("no server time"))?;
    match reply.get(1).map(String::as_str) {
        None => {}
        // '<token>:<flag>:<owner>' (take.lua), with its TTL.
        Some("s") => {
            let (ttl, lock) = (reply.get(2), reply.get(3));
            let ttl: i64 = ttl.and_then(|t| t.parse().ok()).ok_or_else(|| malformed("no TTL"))?;
            let lock = lock.ok_or_else(|| malformed("no value"))?;
            let mut parts = lock.splitn(3, ':');
            let (Some(token), Some(flag), Some(owner)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(malformed("a string that is no lock"));
            };
            let token = token.parse().map_err(|_| malformed("a token that is no number"))?;
            let held = match flag.len() {
                1 => LockMode::Exclusive,
                _ => mode(&flag[1..]).ok_or_else(|| malformed("an unknown mode"))?,
            };
            let mut holder = Holder::new(owner, held, token);
            if ttl >= 0 {
                holder = holder.with_time_left(Duration::from_millis(ttl.unsigned_abs()));
            }
            state.holders.push(holder);
        }
        // counted.lua's hash: `m` its mode, `w`, `i` an intent
        // '<until>:<owner>', holders <owner> = '<fence>:<until>', places
        // '~<owner>' = '<until>'; what has run out is not there any more.
        Some("h") => {
            let fields = &reply[2..];
            let held = fields
                .chunks(2)
                .find(|f| f[0] == "m")
                .and_then(|f| mode(f.get(1)?))
                .ok_or_else(|| malformed("a counted key without its mode"))?;
            let left = |until: &str| until.parse::<u64>().ok().filter(|&u| u > now).map(|u| u - now);
            for pair in fields.chunks(2) {
                let [field, value] = pair else { continue };
                match field.as_str() {
                    "m" | "w" => {}
                    "i" => {
                        let until = value.split(':').next().unwrap_or_default();
                        state.intents += u64::from(left(until).is_some());
                    }
                    place if place.starts_with('~') => state.intents += u64::from(left(value).is_some()),
                    owner => {
                        let (fence, until) = value.split_once(':').ok_or_else(|| malformed("a holder field"))?;
                        let Some(ms) = left(until) else { continue };
                        let fence = fence.parse().map_err(|_| malformed("a token that is no number"))?;
                        state.holders.push(Holder::new(owner, held, fence).with_time_left(Duration::from_millis(ms)));
                    }
                }
            }
            state.holders.sort_by_key(|h| h.fencing_token);
        }
        Some(_) => return Err(malformed("a reply of another kind")),
    }
    Ok(state)
}

/// The lock key a listed Redis key is, if it is one: `prefix:{…}` with
/// nothing after the brace (a fencing mark is `prefix:{tag}:fence`), and
/// not the restart quarantine's data marker.
pub(super) fn listed_lock(key: &str, prefix: &str) -> Option<LockKey> {
    if key.strip_prefix(prefix).is_some_and(|rest| rest == ":{dlock-data-marker}") {
        return None;
    }
    LockKey::parse(key).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn every_shape_of_lock_reads_back() {
        let key = LockKey::builder("dlock", "n").build().expect("key");
        let owner = "0123456789abcdef0123456789abcdef";
        let one = lock_state(&key, &texts(&["1000", "s", "500", &format!("77:0:{owner}")])).expect("string");
        assert_eq!(one.holders[0].fencing_token, 77);
        assert_eq!((one.limit(), one.holders[0].time_left), (Some(1), Some(Duration::from_millis(500))));
        let alone = lock_state(&key, &texts(&["1000", "s", "500", &format!("78:1p3:{owner}")])).expect("permit");
        assert_eq!(alone.limit(), Some(3));
        let hash = lock_state(
            &key,
            &texts(&["1000", "h", "m", "s", "w", "1", owner, "80:1500", "i", "1800:x", "ffff", "81:900"]),
        )
        .expect("hash");
        assert_eq!(hash.holders.len(), 1, "the holder whose lease ran out is not shown: {hash:?}");
        assert_eq!((hash.mode(), hash.intents), (Some(LockMode::Shared), 1));
        assert!(lock_state(&key, &texts(&["1000"])).expect("free").holders.is_empty());
        assert!(lock_state(&key, &texts(&["1000", "s", "5", "nonsense"])).is_err());
    }

    #[test]
    fn a_listing_keeps_lock_keys_only() {
        assert!(listed_lock("dlock:{n:1}", "dlock").is_some());
        for other in ["dlock:{7}:fence", "dlock:fence", "dlock:{dlock-data-marker}", "dlock:idem:r:{a}:b"] {
            assert!(listed_lock(other, "dlock").is_none(), "{other}");
        }
    }
}
