//! Renewals gathered into one script call.
//!
//! The watchdog renews every due hold of a tick at once. Each renewal
//! queues here; when no call is in flight one is sent at once (a lone
//! renewal waits for nothing), and the renewals that queue behind a call in
//! flight go out together in the next one, up to [`MAX_BATCH`] keys per
//! call. The server pays the per-call cost once for many locks.
//!
//! The call is made by a task of its own, so a renewal whose caller stops
//! waiting cannot strand the others queued behind it.

use std::sync::{Arc, Mutex, MutexGuard};

use redis::Script;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::script::ScriptCall;
use super::Client;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// Keys per script call: bounds how long one call keeps the server busy.
const MAX_BATCH: usize = 128;

/// The queue of renewals waiting for a script call. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct RenewBatch {
    queue: Arc<Mutex<Queue>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Pending>,
    /// A task is sending (or about to send) the queued renewals.
    sending: bool,
}

struct Pending {
    key: LockKey,
    owner: Owner,
    lease_ms: u64,
    /// Whether the lease was extended, and when the call carrying it was sent.
    reply: oneshot::Sender<Result<(bool, Instant)>>,
}

/// What the sending task needs of the backend.
#[derive(Clone)]
pub(crate) struct Sender {
    pub(crate) client: Client,
    pub(crate) script: Script,
}

impl RenewBatch {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Every mutation under this lock is a push, a drain or a flag, so a
        // panic elsewhere leaves it consistent.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Extends `key`'s lease to `lease_ms` if `owner` holds it; returns
    /// whether it did and when the call was sent.
    pub(crate) async fn renew(
        &self,
        sender: &Sender,
        key: &LockKey,
        owner: &Owner,
        lease_ms: u64,
    ) -> Result<(bool, Instant)> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut q = self.lock();
            q.waiting.push(Pending { key: key.clone(), owner: owner.clone(), lease_ms, reply });
            !std::mem::replace(&mut q.sending, true)
        };
        if start {
            let sending = Sending { batch: self.clone(), done: false };
            tokio::spawn(send_all(sending, sender.clone()));
        }
        answer
            .await
            .map_err(|_| Error::backend("redis", "the renewal was dropped with its runtime before an answer"))?
    }
}

/// The sending task's claim on the queue; if the task is dropped (its
/// runtime shut down) the queue is released and every renewal still queued
/// is answered with an error, so that none waits for a task that is gone.
struct Sending {
    batch: RenewBatch,
    done: bool,
}

impl Drop for Sending {
    fn drop(&mut self) {
        if !self.done {
            let mut q = self.batch.lock();
            q.sending = false;
            q.waiting.clear();
        }
    }
}

/// Sends what is queued, one call at a time, until the queue is empty.
async fn send_all(mut sending: Sending, sender: Sender) {
    loop {
        let batch: Vec<Pending> = {
            let mut q = sending.batch.lock();
            if q.waiting.is_empty() {
                // Under the lock, so a renewal queued from now on starts a task.
                q.sending = false;
                sending.done = true;
                return;
            }
            let n = q.waiting.len().min(MAX_BATCH);
            q.waiting.drain(..n).collect()
        };
        let keys: Vec<&str> = batch.iter().map(|p| p.key.as_str()).collect();
        let mut call = ScriptCall::new(&sender.script, &keys, 2 * batch.len());
        for p in &batch {
            call.arg(p.owner.as_str()).arg(p.lease_ms);
        }
        let sent = Instant::now();
        let reply: Result<Vec<i64>> = sender.client.invoke(&call).await;
        match reply {
            Ok(extended) if extended.len() == batch.len() => {
                for (p, e) in batch.into_iter().zip(extended) {
                    let _ = p.reply.send(Ok((e == 1, sent)));
                }
            }
            Ok(other) => {
                let message = format!("the renew script answered {} results for {} keys", other.len(), batch.len());
                for p in batch {
                    let _ = p.reply.send(Err(Error::backend("redis", message.clone())));
                }
            }
            Err(e) => {
                let message = e.to_string();
                let mut first = Some(e);
                for p in batch {
                    let err = first.take().unwrap_or_else(|| Error::backend("redis", message.clone()));
                    let _ = p.reply.send(Err(err));
                }
            }
        }
    }
}
