//! Where the acquire script keeps the last fencing token it granted.
//!
//! A lock string carries its own token while it is held and is deleted on
//! release, so a key locked once leaves nothing behind. What keeps a key's
//! next token above its last is a *high-water mark* shared by many keys: the
//! acquire script grants `max(mark + 1, server time in µs)` and stores it.
//!
//! * A single server (or a Sentinel master, or one RedLock node) keeps one
//!   mark for the prefix, `prefix:fence`.
//! * A Redis Cluster script may only touch the slot of its lock, so a
//!   cluster keeps one mark per hash slot it has granted in:
//!   `prefix:{N}:fence`, where `N` is the smallest decimal number whose
//!   CRC16 falls into the lock's slot. At most 16,384 keys, whatever the
//!   number of locks.

use std::sync::OnceLock;

use crate::key::LockKey;

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16_384;

/// The high-water mark of a single server's locks under `prefix`.
pub(crate) fn prefix_mark(prefix: &str) -> String {
    format!("{prefix}:fence")
}

/// The high-water mark of the cluster slot `key` falls into; same slot as
/// `key`.
pub(crate) fn slot_mark(key: &LockKey) -> String {
    let full = key.as_str();
    // Keys are `prefix:{…}`, and a prefix has no brace (`validate_prefix`).
    let prefix = full.split_once(":{").map_or(full, |(p, _)| p);
    let slot = slot_of(full.as_bytes());
    // The table has every slot: `tags()` runs until each one is filled.
    let tag = tags().get(slot).copied().unwrap_or(0);
    format!("{prefix}:{{{tag}}}:fence")
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, or of
/// the whole key when it has none.
fn slot_of(key: &[u8]) -> usize {
    let hashed = match key.iter().position(|b| *b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|b| *b == b'}') {
            Some(0) | None => key,
            Some(len) => &key[open + 1..open + 1 + len],
        },
        None => key,
    };
    usize::from(crc16_xmodem(hashed)) % SLOTS
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in data {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// For every slot, the smallest number whose decimal text hashes into it;
/// built once (about 180,000 CRCs, a few milliseconds) by the first cluster
/// acquire.
fn tags() -> &'static [u32] {
    static TAGS: OnceLock<Vec<u32>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; SLOTS];
        let mut missing = SLOTS;
        let mut n: u32 = 0;
        while missing > 0 {
            let slot = slot_of(n.to_string().as_bytes());
            if tags[slot] == u32::MAX {
                tags[slot] = n;
                missing -= 1;
            }
            n += 1;
        }
        tags
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_redis_cluster_spec() {
        // The examples of the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{}{bar}"), usize::from(crc16_xmodem(b"foo{}{bar}")) % SLOTS);
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
    }

    #[test]
    fn every_slot_mark_shares_the_slot_of_its_lock() {
        for i in 0..2_000 {
            let key = LockKey::builder("dlock", "slot").part(i).build().expect("key");
            let mark = slot_mark(&key);
            assert!(mark.starts_with("dlock:{") && mark.ends_with("}:fence"), "{mark}");
            assert_eq!(slot_of(mark.as_bytes()), slot_of(key.as_str().as_bytes()), "{mark} for {key}");
        }
    }
}
