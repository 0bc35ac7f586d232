//! What a failed ZooKeeper request tells: dlock's error for it, and
//! whether the server [`answered`] it or it may have been applied unseen
//! (ZOOKEEPER-1262).

use zookeeper_client as zk;

use crate::error::Error;

pub(super) fn zk_error(e: zk::Error) -> Error {
    Error::Backend {
        backend: "zookeeper",
        message: format!("ZooKeeper request failed: {e}"),
        source: Some(Box::new(e)),
    }
}

/// Whether an error is the server's answer to the request, as opposed to
/// a lost connection or timeout after which the request may or may not
/// have been applied.
pub(super) fn answered(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::NoNode
            | zk::Error::NodeExists
            | zk::Error::NoAuth
            | zk::Error::BadVersion
            | zk::Error::NoChildrenForEphemerals
            | zk::Error::NotEmpty
            | zk::Error::InvalidAcl
            | zk::Error::BadArguments(_)
            | zk::Error::Unimplemented
            | zk::Error::QuotaExceeded
            | zk::Error::NotReadOnly
            // The session is over: an ephemeral node it made is gone too.
            | zk::Error::SessionExpired
            | zk::Error::SessionMoved
            | zk::Error::AuthFailed
            | zk::Error::ClientClosed
    )
}
