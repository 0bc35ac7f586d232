//! Giving up our place in a lock's line: deleting our own node at once,
//! with retries ([`delete_node`]), or in the background ([`sweep`]), and
//! then the lock's node if that left it empty.

use std::time::Duration;

use zookeeper_client as zk;

use super::error::{answered, zk_error};
use super::path::path_log_id;
use crate::error::{Error, Result};

/// Deletes our node, retrying transient failures, then the lock's node if
/// it is empty. Returns whether the node was ours until this delete (a
/// retry that finds none after a lost reply: our delete went through).
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
        if deleted && let Some((dir, _)) = node.rsplit_once('/') {
            // Fails harmlessly when another contender is inside.
            let _ = client.delete(dir, None).await;
        }
        return Ok(deleted);
    }
    Err(last.map_or_else(|| Error::backend("zookeeper", "delete failed"), zk_error))
}

/// Deletes, in the background, our node under `dir` starting with `name`,
/// which we could neither find nor delete: nobody else would, and it would
/// sort ahead of every later contender while our session lives. Ends when
/// it is gone or the session is over.
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
