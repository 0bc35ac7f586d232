//! The backend's holds: one per key and owner (the engine counts re-entry),
//! from the creation of its node to its release, each followed by a task
//! ([`follow`]) that deletes the node when its lease ends unrenewed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::backend::{LostReason, LostSignal};
use crate::key::LockKey;
use crate::owner::Owner;

/// Our holds, by key and owner.
pub(super) type HoldMap = HashMap<(LockKey, Owner), Hold>;

/// The table shared by the backend, the supervisor and each hold's task.
pub(super) type Holds = Arc<Mutex<HoldMap>>;

#[derive(Debug)]
pub(super) struct Hold {
    pub(super) node: String,
    /// The session whose ephemeral node this is.
    pub(super) client: zk::Client,
    pub(super) fence: u64,
    /// The end of the lease; the hold's task deletes the node then unless
    /// it was moved by a renewal. Dropping the sender (release) ends the task.
    pub(super) expires: watch::Sender<Instant>,
    /// The engine's lost signal, marked when the node is deleted behind our
    /// back or the session may be over; `None` once released or told.
    pub(super) signal: Option<LostSignal>,
}

impl Hold {
    /// Moves the end of the lease (never backwards).
    fn extend(&self, until: Instant) {
        self.expires.send_if_modified(|at| {
            let later = until > *at;
            if later {
                *at = until;
            }
            later
        });
    }

    /// Marks the hold lost; returns whether it was news.
    pub(super) fn lose(&mut self, reason: LostReason) -> bool {
        self.signal.take().is_some_and(|signal| signal.lose(reason))
    }
}

pub(super) fn lock_holds(holds: &Mutex<HoldMap>) -> MutexGuard<'_, HoldMap> {
    // Every update of the map is a single insert, remove or field write, so a
    // panic elsewhere cannot leave it half-done.
    holds.lock().unwrap_or_else(|p| p.into_inner())
}

/// Moves the end of a hold's lease (never backwards).
pub(super) fn extend(holds: &Mutex<HoldMap>, id: &(LockKey, Owner), until: Instant) {
    if let Some(hold) = lock_holds(holds).get(id) {
        hold.extend(until);
    }
}

/// Joins our hold `id` (the engine asks again only after its own hold
/// lapsed): moves the end of its lease to `until` and watches it with
/// `signal` from now on. `None` when the hold is gone or lost already.
pub(super) fn join(holds: &Mutex<HoldMap>, id: &(LockKey, Owner), until: Instant, signal: &LostSignal) -> Option<u64> {
    let mut holds = lock_holds(holds);
    let hold = holds.get_mut(id).filter(|h| h.signal.as_ref().is_some_and(|s| !s.is_lost()))?;
    hold.extend(until);
    hold.signal = Some(signal.clone());
    Some(hold.fence)
}

/// Follows one hold until it is released: deletes its node when its lease
/// ends unrenewed, and marks its guards lost when the node is deleted
/// behind our back (a session's end reaches them through
/// [`supervise`](super::session::supervise)).
pub(super) async fn follow(
    client: zk::Client,
    holds: Holds,
    id: (LockKey, Owner),
    node: String,
    mut expiry: watch::Receiver<Instant>,
) {
    let deleted = node_deleted(&client, &node);
    tokio::pin!(deleted);
    let mut watching = true;
    loop {
        let at = *expiry.borrow_and_update();
        tokio::select! {
            changed = expiry.changed() => if changed.is_err() { return },
            gone = &mut deleted, if watching => {
                watching = false;
                if gone
                    && let Some(hold) = lock_holds(&holds).get_mut(&id).filter(|h| h.node == node)
                        && hold.lose(LostReason::Stolen) {
                            tracing::warn!(key = %id.0.log_id(), reason = %LostReason::Stolen, "dlock.lost");
                        }
            }
            _ = tokio::time::sleep_until(at) => {
                let still_ours = {
                    let mut holds = lock_holds(&holds);
                    let expired = holds.get(&id).is_some_and(|h| h.node == node && *h.expires.borrow() <= Instant::now());
                    if expired {
                        holds.remove(&id);
                    }
                    expired
                };
                if still_ours {
                    tracing::debug!(key = %id.0.log_id(), "lease ran out; deleting the lock node");
                    let _ = client.delete(&node, None).await;
                }
                return;
            }
        }
    }
}

/// Resolves to `true` when `node` is deleted, `false` when its session ended
/// first (the supervisor tells the guards of that).
async fn node_deleted(client: &zk::Client, node: &str) -> bool {
    loop {
        match client.check_and_watch_stat(node).await {
            Ok((Some(_), watcher)) => {
                let event = watcher.changed().await;
                if event.event_type == zk::EventType::NodeDeleted {
                    return true;
                }
                if event.session_state.is_terminated() {
                    return false;
                }
                // Disconnected or a data change: the node is still ours
                // until the session says otherwise.
            }
            Ok((None, _)) => return true,
            Err(zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed) => return false,
            // Not connected right now: watch again once it is.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
