//! Where a lock lives in ZooKeeper, and how its paths appear in logs.
//!
//! A lock is the container node `/<prefix>/<key>`; each contender's node in
//! it is `_c_<random 128 bits>-lock-<seq>`. The key's text is a path here,
//! but never a log line: logs write [`path_log_id`].

use crate::error::Result;
use crate::key::LockKey;
use crate::owner::random_hex;

/// What separates a contender's random prefix from its sequence number;
/// only contenders' nodes contain it.
pub(super) const LOCK_NAME: &str = "-lock-";

/// The container node of `key` under `/<prefix>`.
pub(super) fn lock_path(prefix: &str, key: &LockKey) -> String {
    let mut path = String::with_capacity(prefix.len() + key.as_str().len() + 2);
    path.push('/');
    path.push_str(prefix);
    path.push('/');
    for c in key.as_str().chars() {
        // Characters ZooKeeper refuses in a path; `%u` + 4 hex digits
        // cannot clash with the key's own `%XX` escapes.
        if matches!(c, '\u{80}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}') {
            path.push_str(&format!("%u{:04X}", c as u32));
        } else {
            path.push(c);
        }
    }
    path
}

/// The name of a new contender's node up to the sequence number ZooKeeper
/// appends: `_c_<random 128 bits>-lock-`. Ours alone, so we can find our
/// node again by it after a lost reply (Curator's protection mode) or after
/// an attempt is cut short.
pub(super) fn node_prefix() -> Result<String> {
    Ok(format!("_c_{}{LOCK_NAME}", random_hex::<16>()?))
}

/// The sequence suffix of a node name, for ordering.
pub(super) fn sequence_of(name: &str) -> u64 {
    name.rsplit(LOCK_NAME).next().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

/// A lock directory or node path as logs write it: `zk#` and a short hash
/// of the lock's directory, then the node's own name when there is one
/// (`zk#1a2b3c4d5e6f/_c_…lock-0000000007`).
///
/// The directory is the lock key's text, and a key's parts are often
/// request values (account ids, one-time tokens) that do not belong in
/// logs; the node's name is ours (random hex and a sequence number). The
/// hash is the same in every process, so the lines of one lock match
/// across instances.
pub(super) fn path_log_id(path: &str) -> String {
    // Only a name we made, `_c_…`, is split off as the node: the rest is
    // the key's text, whatever it holds.
    let (dir, node) = match path.rsplit_once('/') {
        Some((dir, node)) if node.starts_with("_c_") => (dir, Some(node)),
        _ => (path, None),
    };
    let digest = sha1_smol::Sha1::from(dir).digest().to_string();
    match node {
        Some(node) => format!("zk#{}/{node}", &digest[..12]),
        None => format!("zk#{}", &digest[..12]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock key's text never reaches a log line; the node's own name
    /// does, and one lock's directory and nodes share one hash.
    #[test]
    fn a_logged_path_hides_the_key_text() {
        let key = LockKey::builder("dlock", "order.create").part("tok-secret").build().expect("key");
        let backend_dir = format!("/dlock/{}", key.as_str());
        let node = format!("{backend_dir}/_c_0123abcd-lock-0000000007");
        for logged in [path_log_id(&backend_dir), path_log_id(&node)] {
            assert!(!logged.contains("secret") && !logged.contains("order"), "{logged}");
        }
        assert_eq!(path_log_id(&node), format!("{}/_c_0123abcd-lock-0000000007", path_log_id(&backend_dir)));
    }
}
