//! RedLock: one lock over N independent Redis masters.
//!
//! Every step runs on all masters at once (never one after another), each
//! with a short per-node timeout, and counts a quorum of N/2+1:
//!
//! * acquire is granted only with a quorum and only if the remaining
//!   validity `lease − elapsed − drift` (drift = lease × 1 % + 2 ms) is
//!   positive; the guard's [`valid_until`](crate::LockGuard::valid_until) is
//!   that validity. An attempt waits for nodes no longer than that validity
//!   (answers after it cannot make a grant). A failed attempt releases on
//!   *every* node, including those that did not answer (their command may
//!   still land).
//! * a split vote (some grants, no quorum) retries after a random jitter so
//!   competing clients do not collide forever; otherwise waiters sleep until
//!   a release is announced on any node's pub/sub or the holders' TTL ends.
//! * the fencing token: each node answers `max(mark + 1, node time in µs)`,
//!   where the mark is the node's high-water mark of tokens
//!   (`prefix:fence`, see `redis/high_water.rs`), and the grant's token is
//!   the maximum over the quorum. That maximum alone does not grow: it may
//!   come from a node whose clock (or mark) runs ahead and which is not in
//!   the next quorum (it was down, or merely answered third), and the next
//!   maximum is then lower. So the token is written back: every node
//!   raises its mark to it (`mark = max(mark, token)`, one more round trip,
//!   skipped when a quorum answered with the token itself), and the grant
//!   counts only once a quorum of nodes holds a mark at least the token,
//!   within the validity. Any later quorum shares a node with that one,
//!   and that node answers above its mark.
//!
//!   **What tokens promise**: when a grant of a key has been returned
//!   before another acquire of the key begins, the later grant's token is
//!   strictly greater, whatever the offsets between the node clocks or
//!   marks, as long as the masters keep their data: a majority (the one
//!   that took the write-back) must not lose its marks, so run them with
//!   `appendfsync always`. A node that lost its data (restart without
//!   persistence, flush) answers from its clock alone: when it is the only
//!   node a later quorum shares with the write-back's, the later token can
//!   be lower when that node's clock lags the one the earlier token came
//!   from by more than the time between the two grants. Then tokens are
//!   only as good as the clocks (Kleppmann's critique). A re-entry (counted
//!   by the engine, never sent here) keeps the token of the hold it joins.
//!   An attempt whose write-back does not
//!   reach a quorum within the validity is undone and tried again, as one
//!   whose validity ran out.
//! * renewal succeeds only with a quorum; when it cannot reach one before
//!   the validity ends, the guard's lost signal fires.
//!
//! * modes: [`LockMode::Shared`] is kept: each node keeps its readers as
//!   the Redis backend does, and any majority of readers shares a node with
//!   any majority of a writer, where one of them is refused. A waiting
//!   writer's intent (writer preference) is recorded on the nodes it
//!   reaches, and taken back from every node when it leaves without the
//!   key before its wait ends ([`Backend::withdraw`]) or releases it.
//!   [`LockMode::Permits`] with a limit of 2 or more is refused
//!   with [`Error::InvalidArgument`]: a node counts only the holders that
//!   reached it, and a permit needs only a majority, so with 3 masters and
//!   2 permits, clients granted on nodes {1,2}, {2,3} and {1,3} each hold a
//!   majority while no node has more than 2 holders: 3 permits of 2. One
//!   permit is a mutex and is kept. A node that finds the key held in a
//!   mode that does not fit makes the attempt fail with
//!   [`Error::ModeConflict`], its grants elsewhere undone.
//!
//! Each node is a [`RedisBackend`]: same scripts, one multiplexed connection
//! and one subscriber connection per node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::redis::script::{lock_scripts, NodeAttempt};
use super::redis::subscriber::Subscription;
use super::redis::{prefix_fence_key, release_channel, RedisBackend};
use super::wait::{self, Waiters};
use super::wait::{acquire_loop, Attempt};
use super::{
    contention, mode_conflict, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Holder, KeyPage,
    ListQuery, LockMode, LockState, Release, Renewal,
};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;
use crate::redis::{redis_error, RedisOptions, ScriptCall};

/// How long one node may take to answer one step.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(100);

/// Locks over an odd number (≥ 3) of independent Redis masters.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use std::sync::Arc;
/// use dlock_core::{Locker, LockerOptions};
/// use dlock_core::backend::redlock::RedLockBackend;
/// let urls = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
/// let backend = RedLockBackend::connect(&urls, "dlock").await?;
/// let locker = Locker::with_options(Arc::new(backend), LockerOptions::default())?;
/// # Ok(()) }
/// ```
pub struct RedLockBackend {
    nodes: Vec<Arc<RedisBackend>>,
    node_timeout: Duration,
    /// The acquires of this process parked per lock channel, woken by a
    /// release announced on any node (every node's subscriber wakes them).
    waiters: Arc<Waiters>,
    /// Local contenders of a key queue here (FIFO) and only the head of the
    /// queue competes on the masters: waiters of one process racing each
    /// other for a quorum would split the votes and back off again and again.
    turns: Mutex<HashMap<LockKey, std::sync::Weak<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for RedLockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedLockBackend")
            .field("nodes", &self.nodes.len())
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

/// How to reach the RedLock masters.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::redis::RedisOptions;
/// use dlock_core::backend::redlock::RedLockOptions;
/// let opts = RedLockOptions::default()
///     .with_node_timeout(Duration::from_millis(50))
///     .with_redis(RedisOptions::default().with_connect_timeout(Duration::from_millis(500)));
/// assert_eq!(opts.node_timeout(), Duration::from_millis(50));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedLockOptions {
    node_timeout: Duration,
    redis: RedisOptions,
}

impl Default for RedLockOptions {
    fn default() -> Self {
        RedLockOptions { node_timeout: DEFAULT_NODE_TIMEOUT, redis: RedisOptions::default() }
    }
}

impl RedLockOptions {
    /// How long one master may take to answer one step before the attempt
    /// counts it out (default [`DEFAULT_NODE_TIMEOUT`]); keep it well under
    /// the lease, as the RedLock algorithm asks.
    pub fn with_node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = timeout;
        self
    }

    /// The connection options of every master (timeouts, TLS material for
    /// `rediss://` URLs, the restart quarantine).
    pub fn with_redis(mut self, redis: RedisOptions) -> Self {
        self.redis = redis;
        self
    }

    /// The per-master timeout.
    pub fn node_timeout(&self) -> Duration {
        self.node_timeout
    }

    /// The connection options of every master.
    pub fn redis(&self) -> &RedisOptions {
        &self.redis
    }
}

impl RedLockBackend {
    /// Connects to every master with the default options; see
    /// [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    ///
    /// As [`RedLockBackend::connect_with`].
    pub async fn connect<S: AsRef<str>>(urls: &[S], prefix: &str) -> Result<Self> {
        Self::connect_with(urls, prefix, RedLockOptions::default()).await
    }

    /// Connects to every master. All of them must answer at start-up, so a
    /// typo in one URL is found now rather than as a lost quorum later.
    ///
    /// ```no_run
    /// # async fn demo() -> dlock_core::Result<()> {
    /// use dlock_core::backend::redis::RedisOptions;
    /// use dlock_core::backend::redlock::{RedLockBackend, RedLockOptions};
    /// use dlock_core::RedisTls;
    /// let urls = ["rediss://10.0.0.1:6380", "rediss://10.0.0.2:6380", "rediss://10.0.0.3:6380"];
    /// let redis = RedisOptions::default().with_tls(RedisTls::new().with_ca_file("ca.crt")?);
    /// let backend = RedLockBackend::connect_with(&urls, "dlock", RedLockOptions::default().with_redis(redis)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_REDLOCK_URLS` when the count is not
    /// odd and at least 3 or a URL is malformed, or naming `DLOCK_PREFIX`
    /// for an invalid prefix; [`Error::Backend`] naming the node that
    /// cannot be reached.
    pub async fn connect_with<S: AsRef<str>>(urls: &[S], prefix: &str, options: RedLockOptions) -> Result<Self> {
        let RedLockOptions { node_timeout, redis: options } = options;
        if urls.len() < 3 || urls.len().is_multiple_of(2) {
            return Err(Error::config(
                "DLOCK_REDLOCK_URLS",
                format!("needs an odd number of at least 3 Redis URLs, got {}", urls.len()),
            ));
        }
        let waiters = Arc::new(Waiters::default());
        let connecting =
            urls.iter().map(|url| RedisBackend::connect_waking(url.as_ref(), prefix, options.clone(), waiters.clone()));
        let on_node = |i: usize| {
            move |e| match e {
                Error::Backend { message, source, .. } => Error::Backend {
                    backend: "redlock",
                    message: format!("node {} of DLOCK_REDLOCK_URLS: {message}", i + 1),
                    source,
                },
                other => other,
            }
        };
        let mut nodes = Vec::with_capacity(urls.len());
        for (i, node) in join_all(connecting).await.into_iter().enumerate() {
            nodes.push(Arc::new(node.map_err(on_node(i))?));
        }
        // Loaded now, so that a node's first acquire is one round trip: with
        // a cold script cache it takes three and a slow node misses the node
        // timeout (found by the slow-node test, T5e). A node that restarts
        // later loses its cache and pays that once more, on one attempt.
        for (i, loaded) in join_all(nodes.iter().map(|n| n.load_scripts())).await.into_iter().enumerate() {
            loaded.map_err(on_node(i))?;
        }
        // The fencing token's write-back, every grant's second step.
        let load_raise = |n: &Arc<RedisBackend>| {
            let mut conn = n.client().conn().clone();
            async move { lock_scripts().raise_mark.prepare_invoke().load_async(&mut conn).await.map_err(redis_error) }
        };
        for (i, loaded) in join_all(nodes.iter().map(load_raise)).await.into_iter().enumerate() {
            loaded.map_err(on_node(i))?;
        }
        Ok(RedLockBackend { nodes, node_timeout, waiters, turns: Mutex::default() })
    }

    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Runs `step` on every node at once, each bounded by `timeout`, and
    /// returns as soon as `decided` says the outcome is known (a quorum
    /// agreed, or can no longer agree): a dead node costs its timeout only
    /// when the live ones cannot decide without it. Answers come with their
    /// node's index; a node without an answer failed, timed out or was not
    /// waited for.
    ///
    /// Steps still running when the outcome is known or the timeout is up
    /// finish on a task of their own (within the connection's response
    /// timeout). Dropping them would not only lose
    /// their answers: redis-rs does not send a queued command whose reply
    /// nobody waits for any more, so a lock granted on a bare quorum would
    /// never reach the other nodes, and losing one node of that quorum would
    /// lose the lock (seen as a flaky `losing_the_quorum_fires_lost`).
    async fn on_all<T, F, Fut>(
        &self,
        timeout: Duration,
        step: F,
        decided: impl Fn(&[(usize, T)], usize) -> bool,
    ) -> Vec<(usize, T)>
    where
        T: Send + 'static,
        F: Fn(usize, Arc<RedisBackend>) -> Fut,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        let deadline = Instant::now() + timeout;
        let mut pending: FuturesUnordered<_> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let fut = step(i, node.clone());
                async move { (i, fut.await.ok()) }
            })
            .collect();
        let (mut answers, mut failed) = (Vec::with_capacity(self.nodes.len()), 0);
        loop {
            // One deadline for all (they start together), and a node past it
            // is only no longer waited for: its step goes on below, so that
            // its command is still sent (an undo or a release dropped before
            // redis-rs sent it would leave the node's key for a whole lease).
            match tokio::time::timeout_at(deadline, pending.next()).await {
                Ok(Some((i, Some(a)))) => answers.push((i, a)),
                Ok(Some((_, None))) => failed += 1,
                Ok(None) => break,
                Err(_) => break,
            }
            if decided(&answers, failed) {
                break;
            }
        }
        if !pending.is_empty() {
            tokio::spawn(async move { while pending.next().await.is_some() {} });
        }
        answers
    }

    /// Whether `yes` of the answers so far reach a quorum, or the nodes
    /// still out can no longer make one.
    fn settled(&self, yes: usize, answered: usize, failed: usize) -> bool {
        let n = self.nodes.len();
        yes >= self.quorum() || (n - answered - failed) + yes < self.quorum() || answered + failed == n
    }

    fn unavailable(&self, granted: usize) -> Error {
        Error::QuorumUnavailable { granted, nodes: self.nodes.len(), needed: self.quorum() }
    }

    /// One try on the masters.
    async fn try_once(&self, req: &AcquireRequest, awaited: bool) -> Result<Attempt> {
        let started = Instant::now();
        let granted_in =
            |a: &[(usize, NodeAttempt)]| a.iter().filter(|(_, a)| matches!(a, NodeAttempt::Granted { .. })).count();
        let drift = req.lease / 100 + Duration::from_millis(2);
        let validity = req.lease.saturating_sub(drift);
        // An answer that comes after the validity is used up cannot make a
        // grant, so the wait ends there even when the node timeout is longer:
        // waiting on would only let our grants on the other nodes expire
        // before the undo below reaches them, blocking the key for a lease.
        let answers = self
            .on_all(
                self.node_timeout.min(validity),
                |_, node| {
                    let req = req.clone();
                    async move { node.try_on_node(&req, awaited).await }
                },
                |a, failed| self.settled(granted_in(a), a.len(), failed),
            )
            .await;
        let mut fence = 0;
        let (mut granted, mut holder_ttl) = (0, None::<Duration>);
        let mut held_by_others = vec![false; self.nodes.len()];
        let mut conflict = None;
        for (i, answer) in &answers {
            match answer {
                // Not ours to undo either; the attempt fails below.
                NodeAttempt::Conflict { held } => {
                    held_by_others[*i] = true;
                    conflict = Some(*held);
                }
                NodeAttempt::Granted { grant } => {
                    granted += 1;
                    fence = fence.max(grant.fencing_token);
                }
                NodeAttempt::Held { retry_in } => {
                    held_by_others[*i] = true;
                    if let Some(t) = *retry_in {
                        holder_ttl = Some(holder_ttl.map_or(t, |h| h.min(t)));
                    }
                }
            }
        }
        let valid_until = started + validity;
        if granted >= self.quorum()
            && conflict.is_none()
            && Instant::now() < valid_until
            && self.fence_on_quorum(fence, &answers, valid_until).await
            && Instant::now() < valid_until
        {
            return Ok(Attempt::Acquired(Grant::until(fence, valid_until)));
        }
        // Undo on every node that granted, or did not answer (its command may
        // land late) — not where someone else holds the key: an undo there
        // could take away a grant of our next try. Awaited, so that it reaches
        // each node before our next try does.
        let answered_held = held_by_others.iter().filter(|h| **h).count();
        if answered_held < self.nodes.len() {
            let held_by_others = &held_by_others;
            self.on_all(
                self.node_timeout,
                |i, node| {
                    let (skip, key, owner) = (held_by_others[i], req.key.clone(), req.owner.clone());
                    async move {
                        if skip {
                            Ok(Release::NotHeld)
                        } else {
                            node.release_on_server(&key, &owner).await
                        }
                    }
                },
                |_, _| false,
            )
            .await;
        }
        if let Some(held) = conflict {
            return Err(mode_conflict(req, held));
        }
        if granted + answered_held < self.quorum() {
            return Err(self.unavailable(granted));
        }
        let retry_in = if granted > 0 {
            // A split vote: back off by a random few ms before retrying.
            Some(jitter(Duration::from_millis(20)))
        } else {
            holder_ttl
        };
        Ok(Attempt::Held { retry_in })
    }

    /// Makes `fence`, the token a quorum just granted, the floor of every
    /// later token: raises the high-water mark of every node to it, and is
    /// true once a quorum of nodes holds a mark at least `fence` before
    /// `valid_until`. A node that answered the grant with `fence` itself
    /// holds it already (its script set its mark to its token); a later
    /// quorum shares a node with this one, whose answer is above its mark.
    /// The writes not waited for still land (see `on_all`).
    async fn fence_on_quorum(&self, fence: u64, answers: &[(usize, NodeAttempt)], valid_until: Instant) -> bool {
        let mut has_fence = vec![false; self.nodes.len()];
        for (i, answer) in answers {
            if let NodeAttempt::Granted { grant, .. } = answer {
                has_fence[*i] = grant.fencing_token >= fence;
            }
        }
        if has_fence.iter().filter(|h| **h).count() >= self.quorum() {
            return true;
        }
        let (has_fence, token) = (&has_fence, fence.to_string());
        let timeout = self.node_timeout.min(valid_until.saturating_duration_since(Instant::now()));
        let acknowledged = self
            .on_all(
                timeout,
                |i, node| {
                    let (skip, token) = (has_fence[i], token.clone());
                    async move {
                        if skip {
                            return Ok(());
                        }
                        let mark = prefix_fence_key(node.key_prefix());
                        let mut call = ScriptCall::new(&lock_scripts().raise_mark, &[mark.as_str()], 1);
                        call.arg(token.as_str());
                        let _: i64 = node.client().invoke(&call).await?;
                        Ok(())
                    }
                },
                |a, failed| self.settled(a.len(), a.len(), failed),
            )
            .await;
        acknowledged.len() >= self.quorum()
    }

    /// The local queue of `key`.
    fn turn(&self, key: &LockKey) -> Arc<tokio::sync::Mutex<()>> {
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        turns.retain(|_, t| t.strong_count() > 0);
        if let Some(turn) = turns.get(key).and_then(std::sync::Weak::upgrade) {
            return turn;
        }
        let turn = Arc::new(tokio::sync::Mutex::new(()));
        turns.insert(key.clone(), Arc::downgrade(&turn));
        turn
    }

    async fn register(&self, key: &LockKey, mode: LockMode) -> SharedRegistration {
        let channel = release_channel(key);
        let wait = self.waiters.register(&channel, mode);
        // A release that succeeds reaches a quorum of nodes and announces
        // itself on each; any two quorums share a node. So once a quorum of
        // our subscriptions is confirmed, every successful release is heard,
        // and a slow node's confirmation need not hold the waiter up. The
        // other subscriptions go on (the actors send them whether or not
        // their futures are polled) and end with this registration.
        let mut pending: FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|n| {
                let (subscriber, channel) = (n.subscriber.clone(), channel.clone());
                Box::pin(async move { subscriber.subscribe(channel).await }) as BoxFuture<'static, _>
            })
            .collect();
        let mut confirmed = Vec::with_capacity(self.nodes.len());
        while confirmed.len() < self.quorum() {
            match pending.next().await {
                Some(registration) => confirmed.push(registration),
                None => break,
            }
        }
        SharedRegistration { wait, _confirmed: confirmed, _pending: pending }
    }
}

/// A waiter parked once and subscribed on every node; dropping it
/// unsubscribes on every node, confirmed or not.
struct SharedRegistration {
    wait: wait::Registration,
    _confirmed: Vec<Subscription>,
    _pending: FuturesUnordered<BoxFuture<'static, Subscription>>,
}

impl AsRef<Notify> for SharedRegistration {
    fn as_ref(&self) -> &Notify {
        self.wait.as_ref()
    }
}

/// `Ok` for a mode whose limit a majority of nodes can keep: exclusive,
/// shared, and one permit (a mutex). A semaphore of more permits cannot be
/// kept by majorities (see the module docs).
fn majority_safe(mode: LockMode) -> Result<()> {
    match mode {
        LockMode::Permits { limit } if limit >= 2 => Err(Error::invalid_argument(
            "mode",
            format!(
                "RedLock cannot keep a semaphore of {limit} permits: each node counts only the holders that \
                 reached it, and a permit needs only a majority of nodes, so more than {limit} clients can \
                 each hold a majority while no node has more than {limit} holders (3 masters, 2 permits: \
                 clients on nodes {{1,2}}, {{2,3}} and {{1,3}}). Use one permit (a mutex), a shared or \
                 exclusive lock, or a single Redis (or Sentinel or Cluster) backend for semaphores"
            ),
        )),
        _ => Ok(()),
    }
}

/// A random duration in `[1 ms, max]`.
fn jitter(max: Duration) -> Duration {
    let mut b = [0u8; 2];
    let r = getrandom::fill(&mut b).map(|()| u16::from_le_bytes(b)).unwrap_or(0);
    let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX).max(1_000);
    Duration::from_micros(1_000 + u64::from(r) % max_us)
}

impl Backend for RedLockBackend {
    fn name(&self) -> &'static str {
        "redlock"
    }

    /// A majority of the masters ready, each within the node timeout.
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let asked = self.nodes.iter().map(|node| tokio::time::timeout(self.node_timeout, node.ready()));
            let granted = join_all(asked).await.into_iter().filter(|answer| matches!(answer, Ok(Ok(())))).count();
            match granted >= self.quorum() {
                true => Ok(()),
                false => Err(Error::QuorumUnavailable { granted, nodes: self.nodes.len(), needed: self.quorum() }),
            }
        })
    }

    fn prefix(&self) -> Option<&str> {
        // Every master was connected for the same prefix.
        self.nodes.first().map(|node| node.key_prefix())
    }

    fn supports(&self, mode: LockMode) -> Result<()> {
        majority_safe(mode)
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(async move {
            majority_safe(req.mode)?;
            let started = Instant::now();
            let turn = self.turn(&req.key);
            let _turn = match turn.clone().try_lock_owned() {
                Ok(guard) => guard,
                Err(_) => {
                    let Some(deadline) = req.deadline else { return Err(contention(req, started)) };
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => return Err(Error::Cancelled),
                        guard = turn.lock_owned() => guard,
                        _ = tokio::time::sleep_until(deadline) => return Err(contention(req, started)),
                    }
                }
            };
            let others_wait = || self.waiters.waited_on(|| release_channel(&req.key));
            acquire_loop(
                req,
                cancel,
                others_wait,
                move |awaited| self.try_once(req, awaited),
                move || self.register(&req.key, req.mode),
            )
            .await
        })
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        Box::pin(async move {
            let sent = Instant::now();
            let held_in = |a: &[(usize, Renewal)]| a.iter().filter(|(_, a)| matches!(a, Renewal::Held { .. })).count();
            let answers = self
                .on_all(
                    self.node_timeout,
                    |_, node| {
                        let (key, owner) = (key.clone(), owner.clone());
                        async move { node.renew(&key, &owner, lease).await }
                    },
                    |a, failed| self.settled(held_in(a), a.len(), failed),
                )
                .await;
            let held = held_in(&answers);
            let lost = answers.len() - held;
            let drift = lease / 100 + Duration::from_millis(2);
            if held >= self.quorum() {
                Ok(Renewal::Held { valid_until: sent + lease.saturating_sub(drift) })
            } else if lost > self.nodes.len() - self.quorum() {
                Ok(Renewal::Lost)
            } else {
                Err(self.unavailable(held))
            }
        })
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.release_on_all(key, owner))
    }

    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.inspect_on_all(key))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        Box::pin(self.list_on_all(query))
    }

    /// Freed on a majority, or refused: a release on fewer masters than a
    /// quorum answers [`Error::QuorumUnavailable`].
    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move { self.release_on_all(key, &holder.owner()?).await })
    }

    /// On every node, as a release: a writer's intent (or a permit's
    /// place) is on each node that refused it.
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if req.mode == LockMode::Shared {
                return Ok(());
            }
            let answers = self
                .on_all(
                    self.node_timeout,
                    |_, node| {
                        let (key, owner) = (req.key.clone(), req.owner.clone());
                        async move { node.withdraw_on_server(&key, &owner).await }
                    },
                    |_, _| false,
                )
                .await;
            match answers.len() >= self.quorum() {
                true => Ok(()),
                false => Err(self.unavailable(answers.len())),
            }
        })
    }
}

impl RedLockBackend {
    /// Who holds `key` on a majority: a holder is shown when a quorum of
    /// the masters that answered hold it for it, with the time a quorum of
    /// them still give it. Each master granted its own token, and the
    /// holder's is the highest of the quorum that answered it first, which
    /// no master recorded: the token shown is the lowest it can be (the
    /// quorum-th lowest of theirs), a floor of the holder's.
    async fn inspect_on_all(&self, key: &LockKey) -> Result<LockState> {
        let answers = self
            .on_all(
                self.node_timeout,
                |_, node| {
                    let key = key.clone();
                    async move { node.inspect_on_server(&key).await }
                },
                |_, _| false,
            )
            .await;
        if answers.len() < self.quorum() {
            return Err(self.unavailable(answers.len()));
        }
        let mut seen: HashMap<String, Vec<Holder>> = HashMap::new();
        let mut state = LockState::new(key.clone());
        for (_, node) in answers {
            state.intents = state.intents.max(node.intents);
            for h in node.holders {
                seen.entry(h.handle().to_owned()).or_default().push(h);
            }
        }
        for (_, mut copies) in seen {
            if copies.len() < self.quorum() {
                continue;
            }
            let mut tokens: Vec<u64> = copies.iter().map(|h| h.fencing_token).collect();
            tokens.sort_unstable();
            let fence = tokens[self.quorum() - 1];
            // Longest first: the quorum-th is what a majority still gives it.
            copies.sort_by_key(|h| std::cmp::Reverse(h.time_left));
            let left = copies[self.quorum() - 1].time_left;
            let first = &copies[0];
            let mut holder = Holder::new(first.handle(), first.mode, fence).with_on_nodes(copies.len() as u32);
            holder.time_left = left;
            state.holders.push(holder);
        }
        state.holders.sort_by_key(|h| h.fencing_token);
        Ok(state)
    }

    /// One page of the keys on the masters, one master after another: the
    /// cursor is `<master>/<its cursor>`. A key held on several masters
    /// may be listed once for each.
    async fn list_on_all(&self, query: &ListQuery) -> Result<KeyPage> {
        let bad = || Error::invalid_argument("cursor", "not a cursor of this listing");
        let (mut at, mut inner) = match query.cursor.as_deref() {
            None => (0, None),
            Some(c) => {
                let (i, rest) = c.split_once('/').ok_or_else(bad)?;
                (i.parse::<usize>().map_err(|_| bad())?, Some(rest.to_owned()))
            }
        };
        let mut keys: Vec<LockKey> = Vec::new();
        while let Some(node) = self.nodes.get(at) {
            let mut q = ListQuery::new(query.starts_with.clone(), query.limit);
            q.cursor = inner.take();
            let page = node.list_on_server(&q).await?;
            keys.extend(page.keys);
            match page.next {
                Some(next) => inner = Some(next),
                None => at += 1,
            }
            if keys.len() >= query.limit {
                break;
            }
        }
        keys.sort_unstable();
        keys.dedup();
        let next = self.nodes.get(at).map(|_| format!("{at}/{}", inner.unwrap_or_else(|| "0".to_owned())));
        Ok(KeyPage::new(keys, next))
    }

    /// Frees the key on every node where `owner` holds it.
    async fn release_on_all(&self, key: &LockKey, owner: &Owner) -> Result<Release> {
        // Release waits for every node (bounded by the node timeout): it is
        // not on anyone's hot path, and a node we skip keeps a stray hold
        // until its lease ends.
        let answers = self
            .on_all(
                self.node_timeout,
                |_, node| {
                    let (key, owner) = (key.clone(), owner.clone());
                    async move { node.release_on_server(&key, &owner).await }
                },
                |_, _| false,
            )
            .await;
        let freed = answers.iter().filter(|(_, a)| matches!(a, Release::Freed)).count();
        if freed >= self.quorum() {
            Ok(Release::Freed)
        } else if answers.len() >= self.quorum() {
            Ok(Release::NotHeld)
        } else {
            Err(self.unavailable(freed))
        }
    }
}
