//! Renewals gathered into shared statements.
//!
//! The engine's watchdog renews every hold of a process at once, each a
//! call of [`Backend::renew`](crate::backend::Backend::renew); one `UPDATE`
//! each would be a round trip and a pooled connection per hold. Renewals
//! asked while one statement is in flight go out together in the next one,
//! `UPDATE … FROM unnest(keys, owners, leases)`, up to [`MAX_BATCH`] holds
//! each. A lone renewal costs what it would alone: one statement.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{Repeat, Shared};
use crate::error::{Error, Result};

/// The most holds renewed by one statement.
const MAX_BATCH: usize = 512;

/// The renewals waiting for a statement, and whether a task is sending them.
#[derive(Debug, Default)]
pub(super) struct Renewals(Mutex<Queue>);

#[derive(Debug, Default)]
struct Queue {
    pending: Vec<Pending>,
    /// A task is sending the pending renewals.
    running: bool,
}

#[derive(Debug)]
struct Pending {
    key: String,
    owner: String,
    lease_ms: i64,
    /// Whether the hold was still ours and is now extended.
    answer: oneshot::Sender<Result<bool>>,
}

impl Renewals {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        // Every update is a push, a drain or a flag.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Extends `owner`'s hold of `key` by `lease` from the server's now, in
    /// the next statement; `Ok(false)` when it was no longer ours.
    pub(super) async fn renew(shared: &Arc<Shared>, key: &str, owner: &str, lease: Duration) -> Result<bool> {
        let (answer, answered) = oneshot::channel();
        let lease_ms = super::millis(lease).max(1);
        let start = {
            let mut queue = shared.renewals.queue();
            queue.pending.push(Pending { key: key.to_owned(), owner: owner.to_owned(), lease_ms, answer });
            !std::mem::replace(&mut queue.running, true)
        };
        if start {
            tokio::spawn(send(shared.clone()));
        }
        match answered.await {
            Ok(result) => result,
            // The task went with its runtime before it answered.
            Err(_) => Err(Error::backend(super::BACKEND, "a renewal was dropped with the runtime that sent it")),
        }
    }
}

/// Sends the pending renewals, a batch at a time, until none are left.
async fn send(shared: Arc<Shared>) {
    let mut running = Running { shared: &shared, finished: false };
    loop {
        let batch: Vec<Pending> = {
            let mut queue = shared.renewals.queue();
            if queue.pending.is_empty() {
                queue.running = false;
                running.finished = true;
                return;
            }
            let n = queue.pending.len().min(MAX_BATCH);
            queue.pending.drain(..n).collect()
        };
        let keys: Vec<&str> = batch.iter().map(|p| p.key.as_str()).collect();
        let owners: Vec<&str> = batch.iter().map(|p| p.owner.as_str()).collect();
        let leases: Vec<i64> = batch.iter().map(|p| p.lease_ms).collect();
        let query = || sqlx::query(&shared.renew).bind(&keys).bind(&owners).bind(&leases);
        // Extending a lease twice extends it once: safe to repeat.
        match shared.fetch_all(query, Repeat::Safe).await {
            Ok(rows) => {
                let renewed: HashSet<(String, String)> = rows
                    .iter()
                    .filter_map(|row| Some((super::column(row, 0).ok()?, super::column(row, 1).ok()?)))
                    .collect();
                for p in batch {
                    let ours = renewed.contains(&(p.key, p.owner));
                    let _ = p.answer.send(Ok(ours));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for p in batch {
                    let _ = p.answer.send(Err(Error::backend(super::BACKEND, message.clone())));
                }
            }
        }
    }
}

/// Lets the next renewal start a task when this one ended before it
/// emptied the queue (its runtime went away): the renewals left are
/// dropped, and their callers told.
struct Running<'a> {
    shared: &'a Shared,
    finished: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let mut queue = self.shared.renewals.queue();
            queue.running = false;
            queue.pending.clear();
        }
    }
}
