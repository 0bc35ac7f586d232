//! Acquires and releases of many tasks gathered into one script call.
//!
//! On one server (or Sentinel master) the per-call cost of `EVALSHA` is a
//! large part of a lock cycle's server work, and an acquire pays `TIME` and
//! the high-water mark's `SET … GET` besides. When many tasks of a process
//! take or give back locks at once, the operations that queue behind a call
//! in flight go out together in the next one (up to [`MAX_BATCH`] keys): one
//! `EVALSHA`, and for acquires one `TIME` and one mark update for all of
//! them (`acquire_many.lua` hands out consecutive tokens). An operation
//! that finds nothing in flight is sent at once, alone, with the one-key
//! script: a lone caller waits for nothing.
//!
//! Not for Redis Cluster (one call may only touch one slot) nor RedLock
//! nodes (whose per-node timeout a queue would eat into).

use std::sync::{Arc, Mutex, MutexGuard};

use redis::Script;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::restart::RestartGuard;
use super::{lease_ms, redis_error, Conn};
use crate::backend::AcquireRequest;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// Keys per script call: bounds how long one call keeps the server busy.
const MAX_BATCH: usize = 128;

/// A script's answer for one key, and when the call carrying it was sent.
pub(crate) type Answer = Result<(Vec<i64>, Instant)>;

/// One queued operation.
pub(crate) enum Op {
    Acquire { req: AcquireRequest, awaited: bool },
    Release { key: LockKey, owner: Owner, channel: String },
}

impl Op {
    fn is_acquire(&self) -> bool {
        matches!(self, Op::Acquire { .. })
    }
}

/// What the calls need of the backend.
#[derive(Clone)]
pub(crate) struct Calls {
    pub(crate) conn: Conn,
    pub(crate) restart: Option<Arc<RestartGuard>>,
    /// The prefix's high-water mark.
    pub(crate) mark: String,
    pub(crate) acquire: Script,
    pub(crate) acquire_many: Script,
    pub(crate) release: Script,
    pub(crate) release_many: Script,
}

/// The queues of acquires and of releases. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Coalescer {
    acquires: Arc<Mutex<Queue>>,
    releases: Arc<Mutex<Queue>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<(Op, oneshot::Sender<Answer>)>,
    /// A call of this kind is in flight (or about to be).
    sending: bool,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    // Every change under this lock is a push, a drain or a flag.
    queue.lock().unwrap_or_else(|p| p.into_inner())
}

impl Coalescer {
    /// Runs `op` in the next script call of its kind and returns its reply:
    /// at once and alone when no call of its kind is in flight.
    pub(crate) async fn run(&self, calls: &Calls, op: Op) -> Answer {
        let queue = if op.is_acquire() { &self.acquires } else { &self.releases };
        let slot = {
            let mut q = lock(queue);
            if q.sending {
                let (tx, rx) = oneshot::channel();
                q.waiting.push((op, tx));
                Slot::Queued(rx)
            } else {
                q.sending = true;
                Slot::First(op)
            }
        };
        let op = match slot {
            Slot::First(op) => op,
            Slot::Queued(answer) => {
                return answer.await.map_err(|_| {
                    Error::backend("redis", "the lock operation was dropped with its runtime before an answer")
                })?
            }
        };
        // Ours is the call in flight; whoever queues behind it is sent by a
        // task of its own afterwards (or at once if we are dropped), so that
        // no caller depends on another caller being polled.
        let turn = Turn { queue: queue.clone(), calls: calls.clone() };
        let answer = send(calls, vec![op]).await.pop().unwrap_or_else(|| Err(Error::backend("redis", "no answer")));
        drop(turn);
        answer
    }
}

enum Slot {
    /// Nothing of its kind in flight: the caller sends it.
    First(Op),
    /// Queued behind a call in flight.
    Queued(oneshot::Receiver<Answer>),
}

/// The claim of the caller whose call is in flight: when it ends, what
/// queued meanwhile goes out on a task of its own.
struct Turn {
    queue: Arc<Mutex<Queue>>,
    calls: Calls,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut q = lock(&self.queue);
        if q.waiting.is_empty() {
            q.sending = false;
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(q);
                runtime.spawn(drain(self.queue.clone(), self.calls.clone()));
            }
            Err(_) => {
                // Dropping the senders answers every queued caller with an error.
                q.waiting.clear();
                q.sending = false;
            }
        }
    }
}

/// Sends what is queued, one call at a time, until the queue is empty.
async fn drain(queue: Arc<Mutex<Queue>>, calls: Calls) {
    loop {
        let batch: Vec<(Op, oneshot::Sender<Answer>)> = {
            let mut q = lock(&queue);
            if q.waiting.is_empty() {
                // Under the lock, so an operation queued from now on is sent by its caller.
                q.sending = false;
                return;
            }
            let n = q.waiting.len().min(MAX_BATCH);
            q.waiting.drain(..n).collect()
        };
        let (ops, replies): (Vec<Op>, Vec<_>) = batch.into_iter().unzip();
        for (answer, reply) in send(&calls, ops).await.into_iter().zip(replies) {
            let _ = reply.send(answer);
        }
    }
}

/// One script call for `ops` (all of one kind): the one-key script for a
/// single operation, the many-key one otherwise. One answer per operation.
async fn send(calls: &Calls, ops: Vec<Op>) -> Vec<Answer> {
    let n = ops.len();
    let failed = |e: Error| -> Vec<Answer> {
        let text = e.to_string();
        let mut first = Some(e);
        (0..n).map(|_| Err(first.take().unwrap_or_else(|| Error::backend("redis", text.clone())))).collect()
    };
    let acquiring = ops.first().is_some_and(Op::is_acquire);
    if acquiring {
        if let Some(guard) = &calls.restart {
            if let Err(e) = guard.check(&calls.conn).await {
                return failed(e);
            }
        }
    }
    let single = n == 1;
    let mut invocation = match (acquiring, single) {
        (true, true) => calls.acquire.prepare_invoke(),
        (true, false) => calls.acquire_many.prepare_invoke(),
        (false, true) => calls.release.prepare_invoke(),
        (false, false) => calls.release_many.prepare_invoke(),
    };
    if acquiring && !single {
        invocation.key(calls.mark.as_str());
        match &calls.restart {
            Some(guard) => invocation.key(guard.marker.as_str()).arg("1"),
            None => invocation.key(calls.mark.as_str()).arg("0"),
        };
    }
    for op in &ops {
        match op {
            Op::Acquire { req, awaited } => {
                invocation.key(req.key.as_str());
                if single {
                    invocation.key(calls.mark.as_str());
                }
                invocation.arg(req.owner.as_str()).arg(lease_ms(req.lease)).arg(if *awaited { "1" } else { "0" });
                if single {
                    if let Some(guard) = &calls.restart {
                        invocation.key(guard.marker.as_str()).arg("1");
                    }
                }
            }
            Op::Release { key, owner, channel } => {
                invocation.key(key.as_str()).arg(owner.as_str()).arg(channel.as_str());
            }
        }
    }
    let sent = Instant::now();
    let reply: redis::RedisResult<redis::Value> = invocation.invoke_async(&mut calls.conn.clone()).await;
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => {
            return failed(match &calls.restart {
                Some(guard) => guard.failed(e),
                None => redis_error(e),
            })
        }
    };
    let parsed: std::result::Result<Vec<Vec<i64>>, redis::ParsingError> = match (acquiring, single) {
        (true, true) => redis::from_redis_value::<Vec<i64>>(reply.clone()).map(|r| vec![r]),
        (false, true) => redis::from_redis_value::<i64>(reply.clone()).map(|r| vec![vec![r]]),
        (true, false) => redis::from_redis_value::<Vec<i64>>(reply.clone()).map(|flat| {
            if flat == [2] {
                // The data marker is gone: the same answer for every acquire.
                vec![vec![2]; n]
            } else {
                // {0, ms, 0} when held: the one-key script's {0, ms}.
                flat.chunks(3)
                    .map(|c| if c.first() == Some(&0) { c[..2.min(c.len())].to_vec() } else { c.to_vec() })
                    .collect()
            }
        }),
        (false, false) => {
            redis::from_redis_value::<Vec<i64>>(reply.clone()).map(|r| r.into_iter().map(|x| vec![x]).collect())
        }
    };
    match parsed {
        Ok(answers) if answers.len() == n => answers.into_iter().map(|a| Ok((a, sent))).collect(),
        Ok(answers) => {
            failed(Error::backend("redis", format!("a lock script answered for {} keys of {n}", answers.len())))
        }
        Err(e) => failed(Error::backend("redis", format!("unexpected reply from a lock script: {e}"))),
    }
}
