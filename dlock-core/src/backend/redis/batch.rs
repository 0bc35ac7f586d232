//! Lock operations of many tasks gathered into shared script calls: the
//! one batcher of the Redis backend, for acquires and releases, each kind
//! in a queue of its own; and the watchdog's renewals of a tick, which come
//! already gathered ([`renew_all`]).
//!
//! A client that sends every lock operation as a script call of its own
//! pays the client side of a request (a redis-rs request, a reply to parse,
//! a task to wake) once per lock; under many concurrent requests that client
//! work, not the server, is what limits a process. So an operation is sent
//! at once and alone, with the one-key script, while fewer than its
//! policy's `alone` of its kind are in flight and no batch is being sent;
//! past that, operations queue, and up to the policy's `drains` tasks send
//! what queued, each as one call of up to [`MAX_BATCH`] keys at a time,
//! until the queue is empty (`acquire_many.lua` pays one `TIME` and one
//! mark update for all of a call's acquires, and hands out consecutive
//! tokens).
//!
//! * Acquires and releases go alone up to 16 in flight: measured on one
//!   2-core machine with the server on its own core (`dlock-bench`), 16
//!   tasks of a process went through fastest alone (the server is the limit
//!   there, and a batch saves it little: most of a lock's server work is per
//!   key), 256 fastest in batches (their client work halves). A lone caller
//!   waits for nothing.
//! * Renewals are not queued: the watchdog hands the backend every due hold
//!   of a tick at once (`Backend::renew_many`), sent as one call per
//!   [`MAX_BATCH`] holds.
//!
//! Not for Redis Cluster (one call may only touch one slot) nor RedLock
//! nodes (whose per-node timeout a queue would eat into).

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::script::{acquire_args, acquire_call, acquire_reply, lock_scripts, release_call, Reply};
use crate::backend::AcquireRequest;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;
use crate::redis::{Client, ScriptCall};

/// Keys per script call: bounds how long one call keeps the server busy.
const MAX_BATCH: usize = 128;

/// Acquires (or releases) sent alone at once, each in a call of its own,
/// before they start to queue.
const ALONE: usize = 16;
/// Batch calls of one kind in flight at once: two keep the server busy
/// while the client handles the other's answers.
const DRAINS: usize = 2;

/// A script's answer for one key, and when the call carrying it was sent.
pub(crate) type Answer = Result<(Reply, Instant)>;

/// One queued operation.
pub(crate) enum Op {
    Acquire { req: AcquireRequest, awaited: bool },
    Release { key: LockKey, owner: Owner },
    Renew { key: LockKey, owner: Owner, lease_ms: u64 },
}

/// The kinds of operation; acquires and releases each have a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Acquire = 0,
    Release = 1,
    Renew = 2,
}

impl Op {
    fn kind(&self) -> Kind {
        match self {
            Op::Acquire { .. } => Kind::Acquire,
            Op::Release { .. } => Kind::Release,
            Op::Renew { .. } => Kind::Renew,
        }
    }

    fn key(&self) -> &str {
        match self {
            Op::Acquire { req, .. } => req.key.as_str(),
            Op::Release { key, .. } | Op::Renew { key, .. } => key.as_str(),
        }
    }
}

/// What the calls need of the backend.
#[derive(Clone)]
pub(crate) struct Calls {
    pub(crate) client: Client,
    /// The prefix's high-water mark.
    pub(crate) mark: String,
}

/// The queues of acquires and releases. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Batcher {
    queues: [Arc<Mutex<Queue>>; 2],
}

#[derive(Default)]
struct Queue {
    waiting: Vec<(Op, oneshot::Sender<Answer>)>,
    /// Operations of this kind sent alone and not answered yet.
    alone: usize,
    /// Tasks sending what waits, each one batch call at a time.
    draining: usize,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    // Every change under this lock is a push, a drain, a count or a flag.
    queue.lock().unwrap_or_else(|p| p.into_inner())
}

impl Batcher {
    /// Runs `op` in a script call of its kind and returns its reply: alone
    /// and at once while fewer than [`ALONE`] of its kind are in flight and
    /// no batch is being sent; else in a batch call. A renewal goes alone
    /// (the watchdog's come gathered, through [`renew_all`]).
    pub(crate) async fn run(&self, calls: &Calls, op: Op) -> Answer {
        let Some(queue) = self.queues.get(op.kind() as usize) else {
            return send_one(calls, &op).await;
        };
        let route = {
            let mut q = lock(queue);
            if q.draining == 0 && q.alone < ALONE {
                q.alone += 1;
                Route::Alone(op)
            } else {
                let (tx, rx) = oneshot::channel();
                q.waiting.push((op, tx));
                let start_drain = q.draining < DRAINS;
                if start_drain {
                    q.draining += 1;
                }
                Route::Queued { answer: rx, start_drain }
            }
        };
        let (answer, start) = match route {
            Route::Alone(op) => {
                let _alone = Alone(queue.clone());
                return send_one(calls, &op).await;
            }
            Route::Queued { answer, start_drain } => (answer, start_drain),
        };
        if start {
            // On a task of its own, so that no caller depends on another
            // caller being polled (or not dropped) for its answer.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(drain(queue.clone(), calls.clone()))),
                Err(_) => drain(queue.clone(), calls.clone()).await,
            }
        }
        answer
            .await
            .map_err(|_| Error::backend("redis", "the lock operation was dropped with its runtime before an answer"))?
    }
}

/// How an operation goes out.
enum Route {
    /// In a call of its own, sent by its caller.
    Alone(Op),
    /// In a batch call; `start_drain`: the caller starts a task that sends.
    Queued { answer: oneshot::Receiver<Answer>, start_drain: bool },
}

/// An operation sent alone, counted until it is answered (or dropped).
struct Alone(Arc<Mutex<Queue>>);

impl Drop for Alone {
    fn drop(&mut self) {
        lock(&self.0).alone -= 1;
    }
}

/// A drain task, counted until it ends: when the queue is empty, or when
/// it is dropped mid-call (its runtime shut down), so that a later
/// operation starts another instead of waiting for it.
struct Draining {
    queue: Arc<Mutex<Queue>>,
    /// Uncounted already, under the lock that found the queue empty.
    ended: bool,
}

impl Drop for Draining {
    fn drop(&mut self) {
        if !self.ended {
            lock(&self.queue).draining -= 1;
        }
    }
}

/// Sends what waits, one batch call at a time, until nothing does.
async fn drain(queue: Arc<Mutex<Queue>>, calls: Calls) {
    let mut draining = Draining { queue, ended: false };
    loop {
        let batch: Vec<(Op, oneshot::Sender<Answer>)> = {
            let mut q = lock(&draining.queue);
            if q.waiting.is_empty() {
                // Under the lock that found it empty, so an operation queued
                // from now on starts a new drain.
                q.draining -= 1;
                drop(q);
                draining.ended = true;
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

/// Renews each of `holds` (`(key, owner, lease in ms)`), [`MAX_BATCH`] to a
/// script call; one answer per hold, in order.
pub(crate) async fn renew_all(calls: &Calls, holds: impl Iterator<Item = (LockKey, Owner, u64)>) -> Vec<Answer> {
    let ops: Vec<Op> = holds.map(|(key, owner, lease_ms)| Op::Renew { key, owner, lease_ms }).collect();
    let mut answers = Vec::with_capacity(ops.len());
    let mut ops = ops.into_iter().peekable();
    while ops.peek().is_some() {
        let batch: Vec<Op> = ops.by_ref().take(MAX_BATCH).collect();
        answers.extend(send(calls, batch).await);
    }
    answers
}

/// One script call for `op` alone, with the one-key script.
async fn send_one(calls: &Calls, op: &Op) -> Answer {
    let (reply, sent) = call(calls, std::slice::from_ref(op)).await?;
    let reply = match op.kind() {
        Kind::Acquire => acquire_reply(reply)?,
        Kind::Release => redis::from_redis_value::<i64>(reply).and_then(|r| Reply::new(&[r])).map_err(unexpected)?,
        Kind::Renew => redis::from_redis_value::<Vec<i64>>(reply).and_then(|r| Reply::new(&r)).map_err(unexpected)?,
    };
    Ok((reply, sent))
}

/// One script call for `ops` (all of one kind): the one-key script for a
/// single operation, the many-key one otherwise. One answer per operation.
async fn send(calls: &Calls, ops: Vec<Op>) -> Vec<Answer> {
    let n = ops.len();
    if let [op] = ops.as_slice() {
        return vec![send_one(calls, op).await];
    }
    let failed = |e: Error| -> Vec<Answer> {
        let text = e.to_string();
        let mut first = Some(e);
        (0..n).map(|_| Err(first.take().unwrap_or_else(|| Error::backend("redis", text.clone())))).collect()
    };
    let (reply, sent) = match call(calls, &ops).await {
        Ok(answered) => answered,
        Err(e) => return failed(e),
    };
    let parsed: std::result::Result<Vec<Reply>, redis::ParsingError> = if ops[0].kind() == Kind::Acquire {
        redis::from_redis_value::<Vec<i64>>(reply).and_then(|flat| {
            #[cfg(feature = "broken-variants")]
            let flat = crate::broken_variants::batch_repeats_token(flat, ops.iter().map(Op::key));
            if flat == [2] {
                // The data marker is gone: the same answer for every acquire.
                Reply::new(&[2]).map(|gone| vec![gone; n])
            } else {
                // {0, ms, 0} when held, {3, mode, 0} in another mode: the
                // one-key script's {0, ms} and {3, mode}.
                flat.chunks(3)
                    .map(|c| Reply::new(if matches!(c.first(), Some(0 | 3)) { &c[..2.min(c.len())] } else { c }))
                    .collect()
            }
        })
    } else {
        redis::from_redis_value::<Vec<i64>>(reply).and_then(|r| r.into_iter().map(|x| Reply::new(&[x])).collect())
    };
    match parsed {
        Ok(answers) if answers.len() == n => answers.into_iter().map(|a| Ok((a, sent))).collect(),
        Ok(answers) => {
            failed(Error::backend("redis", format!("a lock script answered for {} keys of {n}", answers.len())))
        }
        Err(e) => failed(unexpected(e)),
    }
}

fn unexpected(e: redis::ParsingError) -> Error {
    Error::backend("redis", format!("unexpected reply from a lock script: {e}"))
}

/// Sends `ops` (one or more of one kind) in one script call: the one-key
/// script for one operation, the many-key script otherwise. The raw reply
/// and when the call was sent.
async fn call(calls: &Calls, ops: &[Op]) -> Result<(redis::Value, Instant)> {
    if ops.first().is_some_and(|op| op.kind() == Kind::Acquire) {
        // Checked when the acquire was queued too; a batch may have waited.
        calls.client.check().await?;
    }
    let marker = calls.client.marker();
    let call = match ops {
        [Op::Acquire { req, awaited }] => acquire_call(&lock_scripts().acquire, req, &calls.mark, marker, *awaited),
        [Op::Release { key, owner, .. }] => release_call(&lock_scripts().release, key, owner),
        _ => batch_call(calls, ops, marker),
    };
    let sent = Instant::now();
    Ok((calls.client.invoke(&call).await?, sent))
}

/// The many-key script's call for a batch of one kind (`acquire_many.lua`,
/// `release_many.lua`, `renew.lua`): every key before the first argument,
/// as `EVALSHA` takes them.
fn batch_call<'a>(calls: &'a Calls, ops: &[Op], marker: Option<&str>) -> ScriptCall<'a> {
    let kind = ops.first().map_or(Kind::Release, Op::kind);
    let mut keys: Vec<&str> = Vec::with_capacity(ops.len() + 2);
    if kind == Kind::Acquire {
        // The mark, and the data marker (or the mark again, unused).
        keys.push(&calls.mark);
        keys.push(marker.unwrap_or(&calls.mark));
    }
    keys.extend(ops.iter().map(Op::key));
    let script = match kind {
        Kind::Acquire => &lock_scripts().acquire_many,
        Kind::Release => &lock_scripts().release_many,
        Kind::Renew => &lock_scripts().renew,
    };
    let mut call = ScriptCall::new(script, &keys, 5 * ops.len() + 1);
    if kind == Kind::Acquire {
        call.arg(if marker.is_some() { "1" } else { "0" });
    }
    for op in ops {
        match op {
            Op::Acquire { req, awaited } => acquire_args(&mut call, req, *awaited),
            Op::Release { owner, .. } => {
                call.arg(owner.as_str());
            }
            Op::Renew { owner, lease_ms, .. } => {
                call.arg(owner.as_str()).arg(*lease_ms);
            }
        }
    }
    call
}
