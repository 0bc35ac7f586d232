//! Where the Redis store keeps each record and token, and which pools
//! (ledger.lua) count it.
//!
//! A script may only touch the keys of one slot, so an entry and every pool
//! that counts it must share a hash tag.
//!
//! * **One server** (or Sentinel's master), where slots do not matter: an
//!   entry is tagged by its caller's hash, its caller's pool too, and one
//!   pool counts all (`prefix:idem:rp:all`, `prefix:idem:tp:all`), capped at
//!   the [`IdempotencyLimits`] totals.
//! * **Redis Cluster**: one count cannot span the slots, so the total is
//!   split into [`SHARDS`] pools, each in a slot of its own, and a caller's
//!   entries and pool live in the slot of its shard (the first hex digit of
//!   its hash): `prefix:idem:r:{<tag>}:<sha1(scope, key)>` for a record,
//!   `prefix:idem:t:{<tag>}:<sha1(caller)>:<token>` for a bound token,
//!   `prefix:idem:rp:{<tag>}:<sha1(caller)>` and `…:tp:…` for the caller's
//!   pools, `prefix:idem:rp:{<tag>}:all` and `…:tp:…` for the shard's. The
//!   shards' caps add up to the totals (a total below [`SHARDS`] records is
//!   raised to one per shard), so the sum of what lives never passes them;
//!   one shard may refuse (`Error::IdempotencyFull`, `per_scope: false`)
//!   while others still have room, once a sixteenth of the total lives in
//!   it.
//!
//! Unbound tokens keep their pool of their own in one slot on every
//! deployment (`prefix:idem:t:{anon}:<token>`, `prefix:idem:tp:{anon}`).

use super::super::{fingerprint, IdempotencyLimits};

/// How many pools share a Cluster's totals. Each holds a sixteenth: at the
/// defaults 62 500 records and 64 MiB of answers, above a caller's own cap
/// (10 000 records, 64 MiB), so a lone caller reaches its own cap first.
pub(super) const SHARDS: usize = 16;

/// The hash tag of each shard: shard `i`'s slot is in the `i`-th sixteenth
/// of the 16 384 slots (tested), so a Cluster whose masters hold equal
/// ranges of slots holds equal numbers of shards.
const SHARD_TAGS: [&str; SHARDS] = [
    "s0.10", "s1.13", "s2.23", "s3.20", "s4.0", "s5.3", "s6.40", "s7.43", "s8.23", "s9.20", "s10.22", "s11.21",
    "s12.2", "s13.1", "s14.41", "s15.42",
];

/// A pool that counts an entry (ledger.lua), its caps, and whether it is
/// one caller's.
pub(super) struct Pool {
    pub(super) key: String,
    pub(super) max: u64,
    pub(super) max_bytes: u64,
    pub(super) per_scope: bool,
}

/// The names of one store's entries and pools: by one server's layout or a
/// Cluster's (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct Layout {
    prefix: String,
    sharded: bool,
}

/// Where the entries of one caller live: the tag that puts them in one
/// slot, the name of the caller within it, and the shard (on a Cluster).
struct Home<'a> {
    caller: &'a str,
    shard: Option<usize>,
}

impl Home<'_> {
    /// `{tag}`: the hash tag of the caller's slot.
    fn tag(&self) -> String {
        match self.shard {
            None => format!("{{{}}}", self.caller),
            Some(i) => format!("{{{}}}", SHARD_TAGS[i]),
        }
    }

    /// The caller's own place in its slot: the tag, and on a Cluster its
    /// hash after it.
    fn place(&self) -> String {
        match self.shard {
            None => self.tag(),
            Some(_) => format!("{}:{}", self.tag(), self.caller),
        }
    }
}

impl Layout {
    /// One server's layout, or (`sharded`) a Cluster's.
    pub(super) fn new(prefix: &str, sharded: bool) -> Self {
        Layout { prefix: prefix.to_owned(), sharded }
    }

    /// The home of the caller whose hash is `caller` (a [`fingerprint`]).
    fn home<'a>(&self, caller: &'a str) -> Home<'a> {
        // The first hex digit of a SHA-1: one of sixteen, evenly.
        let shard = caller.chars().next().and_then(|c| c.to_digit(16)).map_or(0, |d| d as usize % SHARDS);
        Home { caller, shard: self.sharded.then_some(shard) }
    }

    /// The pools of kind `kind` (`rp` records, `tp` bound tokens) that
    /// count an entry of the caller at `home`: its own, and the total's (or
    /// on a Cluster its shard's).
    fn pools(&self, kind: &str, home: &Home<'_>, limits: &IdempotencyLimits) -> Vec<Pool> {
        let own = Pool {
            key: format!("{}:idem:{kind}:{}", self.prefix, home.place()),
            max: limits.max_per_scope(),
            max_bytes: limits.max_bytes_per_scope(),
            per_scope: true,
        };
        let all = match home.shard {
            None => Pool {
                key: format!("{}:idem:{kind}:all", self.prefix),
                max: limits.max_records(),
                max_bytes: limits.max_bytes(),
                per_scope: false,
            },
            Some(i) => Pool {
                key: format!("{}:idem:{kind}:{}:all", self.prefix, home.tag()),
                max: share(limits.max_records(), i).max(1),
                max_bytes: share(limits.max_bytes(), i),
                per_scope: false,
            },
        };
        vec![own, all]
    }

    /// The record of `(scope, key)` and the pools that count it.
    pub(super) fn record(&self, scope: &str, key: &str, limits: &IdempotencyLimits) -> (String, Vec<Pool>) {
        let caller = fingerprint(&[scope]);
        let home = self.home(&caller);
        let id = fingerprint(&[scope, key]);
        (format!("{}:idem:r:{}:{id}", self.prefix, home.tag()), self.pools("rp", &home, limits))
    }

    /// A `SCAN` pattern that matches every key record of this store.
    pub(super) fn records_glob(&self) -> String {
        crate::redis::starts_with_glob(&format!("{}:idem:r:", self.prefix))
    }

    /// The pools that count every caller's records: the total's, or on a
    /// Cluster each shard's.
    pub(super) fn record_totals(&self) -> Vec<String> {
        match self.sharded {
            false => vec![format!("{}:idem:rp:all", self.prefix)],
            true => SHARD_TAGS.iter().map(|tag| format!("{}:idem:rp:{{{tag}}}:all", self.prefix)).collect(),
        }
    }

    /// The fresh and the claimed name of `token`, bound to `principal` or
    /// not: one slot, so a claim can rename one to the other.
    pub(super) fn token_names(&self, token: &str, principal: Option<&str>) -> (String, String) {
        let place = match principal {
            Some(p) => self.home(&fingerprint(&[p])).place(),
            None => "{anon}".to_owned(),
        };
        (format!("{}:idem:t:{place}:{token}", self.prefix), format!("{}:idem:tu:{place}:{token}", self.prefix))
    }

    /// The pools that count a token bound to `principal`, or (none) an
    /// unbound one: the unbound tokens' pool of their own.
    pub(super) fn token_pools(&self, principal: Option<&str>, limits: &IdempotencyLimits) -> Vec<Pool> {
        match principal {
            Some(p) => self.pools("tp", &self.home(&fingerprint(&[p])), limits),
            None => {
                let key = format!("{}:idem:tp:{{anon}}", self.prefix);
                vec![Pool { key, max: limits.max_unbound_tokens(), max_bytes: u64::MAX >> 11, per_scope: false }]
            }
        }
    }
}

/// Shard `i`'s part of `total`: the shards' parts add up to it exactly.
fn share(total: u64, i: usize) -> u64 {
    let (n, i) = (SHARDS as u64, i as u64);
    total / n + u64::from(i < total % n)
}

#[cfg(test)]
mod tests {
    use super::*;

    use redis::cluster_routing::Slot;

    /// Each shard's tag lands in its sixteenth of the slots.
    #[test]
    fn the_shards_spread_evenly_over_the_slots() {
        for (i, tag) in SHARD_TAGS.iter().enumerate() {
            let slot = Slot::for_key(format!("x:{{{tag}}}:y"));
            let sixteenth = i as u16 * 1024..(i as u16 + 1) * 1024;
            assert!(sixteenth.clone().any(|n| Slot::new(n) == Some(slot)), "{tag}: {slot:?} is not in {sixteenth:?}");
        }
    }

    /// The shards' parts add up to the total, whatever it is.
    #[test]
    fn the_shares_add_up_to_the_total() {
        for total in [0, 1, 15, 16, 17, 1_000_000, 1 << 30, u64::MAX] {
            let sum: u128 = (0..SHARDS).map(|i| u128::from(share(total, i))).sum();
            assert_eq!(sum, u128::from(total));
        }
    }

    /// One server's names are those of earlier versions; a Cluster's put a
    /// caller's entries and both its pools in one slot.
    #[test]
    fn names() {
        let limits = IdempotencyLimits::default();
        let single = Layout::new("p", false);
        let (record, pools) = single.record("alice", "k", &limits);
        let tag = fingerprint(&["alice"]);
        assert_eq!(record, format!("p:idem:r:{{{tag}}}:{}", fingerprint(&["alice", "k"])));
        let keys: Vec<&str> = pools.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, [format!("p:idem:rp:{{{tag}}}"), "p:idem:rp:all".to_owned()]);
        assert_eq!(single.token_names("t", Some("alice")).0, format!("p:idem:t:{{{tag}}}:t"));

        let sharded = Layout::new("p", true);
        let (record, pools) = sharded.record("alice", "k", &limits);
        let slot = |key: &str| Slot::for_key(key);
        let (fresh, claimed) = sharded.token_names("t", Some("alice"));
        let token_pools = sharded.token_pools(Some("alice"), &limits);
        let all = [&record, &fresh, &claimed].into_iter().chain(pools.iter().chain(&token_pools).map(|p| &p.key));
        for key in all {
            assert_eq!(slot(key), slot(&record), "{key}");
        }
        assert_eq!(pools[1].key, format!("p:idem:rp:{}:all", sharded.home(&tag).tag()));
        assert_eq!(sharded.token_names("t", None), single.token_names("t", None), "unbound: unchanged");
    }
}
