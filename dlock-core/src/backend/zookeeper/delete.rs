//! Giving up our place in a lock's line: deleting our node at once, with
//! retries ([`delete_node`]), or in the background ([`sweep`]) when we
//! cannot.
//!
//! Only our own node is ever deleted (its path is unique to one
//! contender), and then the lock's node if that left it empty, so one-off
//! keys do not pile up. A reply lost with the connection (ZOOKEEPER-1262)
//! leaves the outcome of a delete unknown; a retry that finds nothing means
//! our delete went through.

use std::time::Duration;

use zookeeper_client as zk;

use super::error::{answered, zk_error};
use super::path::path_log_id;
use crate::error::{Error, Result};

/// Deletes our node (only ours: the path is unique to this contender),
/// retrying transient failures, then the lock's node if it is empty.
/// Returns whether the node was ours until this delete.
///
/// A delete whose reply was lost may have happened; the retry then finds
/// no node, which means our own delete went through, not that the lock
/// had been lost already.
pub(super) async fn delete_node(client: &zk::Client, node: &str) -> Result<bool> {
    let mut last = None;
    let mut maybe_deleted = false;
    for attempt in 0..3 {
        let deleted = match client.delete(node, None).await {
            Ok(()) => true,
            Err(zk::Error::NoNode) => maybe_deleted,
            Err(e @ (zk::Error::SessionExpired | zk::Error::ClientClosed)) => {
                // The node died with the session.
                tracing::debug!(error = %e, node = %path_log_id(node), "lock node went with the session");
                return Ok(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, node = %path_log_id(node), attempt, "deleting a lock node failed; retrying");
                maybe_deleted |= !answered(&e);
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                continue;
            }
        };
        if deleted {
            if let Some((dir, _)) = node.rsplit_once('/') {
                // Fails harmlessly when another contender is inside.
                let _ = client.delete(dir, None).await;
            }
        }
        return Ok(deleted);
    }
    Err(last.map_or_else(|| Error::backend("zookeeper", "delete failed"), zk_error))
}

/// Deletes, in the background, our node under `dir` whose name starts with
/// `name`, when we could neither find it again after a lost reply nor
/// delete it after giving up our place. Nobody else would: it would sort
/// ahead of every later contender for as long as our session lives, and the
/// session outlives reconnects. Ends when the node is deleted or not there,
/// or the session is over.
pub(super) async fn sweep(client: zk::Client, dir: String, name: String) {
    let mut backoff = Duration::from_millis(100);
    loop {
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return,
            Err(
                e @ (zk::Error::SessionExpired
                | zk::Error::SessionMoved
                | zk::Error::ClientClosed
                | zk::Error::AuthFailed),
            ) => {
                // An ephemeral node goes with its session.
                tracing::debug!(error = %e, dir = %path_log_id(&dir), name, "session over; no orphan left to sweep");
                return;
            }
            Err(e) if answered(&e) => {
                tracing::warn!(
                    error = %e,
                    dir = %path_log_id(&dir),
                    name,
                    "giving up on a possible orphan lock node; it goes with the session"
                );
                return;
            }
            Err(_) => continue,
        };
        let Some(child) = children.iter().find(|c| c.starts_with(&name)) else { return };
        let node = format!("{dir}/{child}");
        if delete_node(&client, &node).await.is_ok() {
            tracing::info!(node = %path_log_id(&node), "deleted an orphan lock node");
            return;
        }
    }
}
