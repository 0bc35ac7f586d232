//! Where a lock lives in ZooKeeper (`/<prefix>/<key>`, one
//! `_c_<random>-<mode>-<seq>` node per contender), and how its paths appear
//! in logs ([`path_log_id`], never the key's text).

use crate::backend::LockMode;
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::random_hex;

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

/// The key whose container node under `/<prefix>` is named `name`
/// ([`lock_path`]'s escapes undone); `None` for any other node.
pub(super) fn key_of_dir(name: &str) -> Option<LockKey> {
    let mut text = String::with_capacity(name.len());
    let mut rest = name;
    while let Some(at) = rest.find("%u") {
        text.push_str(&rest[..at]);
        let hex = rest.get(at + 2..at + 6)?;
        text.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
        rest = &rest[at + 6..];
    }
    text.push_str(rest);
    LockKey::parse(&text).ok()
}

/// What starts every contender's node name; nothing else in a lock's
/// container node starts with it.
const CONTENDER: &str = "_c_";

/// The name of a new contender's node up to its sequence number:
/// `_c_<random 128 bits>-<mode>-`, the mode `lock`, `read` or `permits.<N>`.
/// Ours alone, to find our node again (Curator's protection mode); every
/// contender reads the modes from the names.
pub(super) fn node_prefix(mode: LockMode) -> Result<String> {
    let mode = match mode {
        LockMode::Exclusive => "lock".to_owned(),
        LockMode::Shared => "read".to_owned(),
        LockMode::Permits { limit } => format!("permits.{limit}"),
    };
    Ok(format!("{CONTENDER}{}-{mode}-", random_hex::<16>()?))
}

/// One contender's node, read from its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Contender {
    pub(super) name: String,
    pub(super) mode: LockMode,
    pub(super) sequence: u64,
}

impl Contender {
    /// `None` for a name that is not a contender's (or is malformed).
    pub(super) fn parse(name: &str) -> Option<Contender> {
        let rest = name.strip_prefix(CONTENDER)?;
        let (head, sequence) = rest.rsplit_once('-')?;
        let (_, mode) = head.split_once('-')?;
        let mode = match mode {
            "lock" => LockMode::Exclusive,
            "read" => LockMode::Shared,
            permits => LockMode::permits(permits.strip_prefix("permits.")?.parse().ok()?),
        };
        Some(Contender { name: name.to_owned(), mode, sequence: sequence.parse().ok()? })
    }

    /// The contenders among `children`, in the order they arrived.
    pub(super) fn line(children: &[String]) -> Vec<Contender> {
        let mut line: Vec<Contender> = children.iter().filter_map(|c| Contender::parse(c)).collect();
        line.sort_by_key(|c| c.sequence);
        line
    }
}

/// A lock directory or node path as logs write it: `zk#`, a hash of the
/// directory (the key's text, often request values), then the node's own
/// name (`zk#1a2b3c4d5e6f/_c_…lock-0000000007`). The hash is the same in
/// every process.
pub(super) fn path_log_id(path: &str) -> String {
    // Only a name we made, `_c_…`, is split off as the node: the rest is
    // the key's text, whatever it holds.
    let (dir, node) = match path.rsplit_once('/') {
        Some((dir, node)) if node.starts_with(CONTENDER) => (dir, Some(node)),
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

    /// A listing reads a key back from its directory's name.
    #[test]
    fn a_directory_names_its_key() {
        let key = LockKey::builder("dlock", "n").part("\u{85}x").build().expect("key");
        let dir = lock_path("dlock", &key);
        assert!(dir.contains("%u0085"), "{dir}");
        assert_eq!(key_of_dir(dir.rsplit('/').next().expect("name")), Some(key));
        assert_eq!(key_of_dir("_dlock_acl_anchor"), None);
    }

    /// A contender's mode and place are read back from the name it was
    /// given; anything else in the directory is no contender.
    #[test]
    fn a_contenders_mode_and_sequence_come_from_its_name() {
        for mode in [LockMode::Exclusive, LockMode::Shared, LockMode::permits(3)] {
            let name = format!("{}0000000042", node_prefix(mode).expect("prefix"));
            let c = Contender::parse(&name).expect("a contender");
            assert_eq!((c.mode, c.sequence), (mode, 42), "{name}");
        }
        for other in ["_dlock_acl_anchor", "_c_ab-permits.x-0000000001", "_c_ab-lock-", "lock-0000000001"] {
            assert_eq!(Contender::parse(other), None, "{other}");
        }
    }
}
