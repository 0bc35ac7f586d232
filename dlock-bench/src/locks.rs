//! The lock implementations the benchmarks compare, behind one trait: dlock
//! itself (any backend) and hand-written Redis locks made of raw commands —
//! the baselines.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::LockMode;
use dlock_core::{AcquireOptions, LockGuard, LockKey, Locker, Owner};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::Script;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

use crate::error::{BenchError, Result};

/// Every benchmark holds locks with a fixed lease (so no watchdog renews
/// anything behind the measurement's back) that is far longer than a run.
pub(crate) const LEASE: Duration = Duration::from_secs(30);

/// How long a waiting acquire may wait: longer than any window.
pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// A lock under test. It owns a numbered set of keys ("slots"): the
/// uncontended benchmark gives each task its own slot, the handoff benchmark
/// makes every task fight over slot 0.
pub(crate) trait BenchLock: Send + Sync + 'static {
    /// What a successful acquire hands back, to be released.
    type Held: Send + 'static;

    /// Takes slot `slot`; tries once when `wait` is false.
    fn acquire(&self, slot: usize, wait: bool) -> impl Future<Output = Result<Self::Held>> + Send;

    /// Gives it back; an error when the lock was no longer held.
    fn release(&self, held: Self::Held) -> impl Future<Output = Result<()>> + Send;

    /// The Redis commands this implementation only issues from inside Lua
    /// scripts (see [`command_delta`](crate::measure::command_delta)).
    fn script_internal_commands(&self) -> &'static [&'static str];

    /// When the client also sends one of the
    /// [`script_internal_commands`](Self::script_internal_commands) itself,
    /// how many it sent so far: `INFO commandstats` cannot tell them from the
    /// script's calls.
    fn client_sent_script_commands(&self) -> Option<&AtomicU64> {
        None
    }

    /// The keys of this lock still in Redis. Once every hold was released
    /// nothing may be left: a lock that never frees its keys would look
    /// fast, and a re-entrant one would even keep granting.
    fn leftovers(&self, conn: &MultiplexedConnection) -> impl Future<Output = Result<Vec<String>>> + Send;
}

/// Which of `keys` exist, in one pipeline.
pub(crate) async fn existing_keys(conn: &MultiplexedConnection, keys: &[String]) -> Result<Vec<String>> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.exists(key);
    }
    let exists: Vec<bool> = pipe.query_async(&mut conn.clone()).await?;
    Ok(keys.iter().zip(exists).filter(|(_, e)| *e).map(|(k, _)| k.clone()).collect())
}

/// Every key matching `pattern` (`SCAN`, so a large database is not blocked).
pub(crate) async fn scan(conn: &MultiplexedConnection, pattern: &str) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, mut keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn.clone())
            .await?;
        found.append(&mut keys);
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// Commands called by dlock's Redis scripts (`dlock-core/src/backend/redis/
/// {acquire,release,renew}.lua`); the engine itself sends only EVALSHA
/// (EVAL / SCRIPT LOAD once after a restart) and SUBSCRIBE / UNSUBSCRIBE.
const DLOCK_SCRIPT_COMMANDS: &[&str] = &[
    "get",
    "time",
    "set",
    "pexpire",
    "exists",
    "pttl",
    "del",
    "publish",
    "type",
    "hgetall",
    "hset",
    "hdel",
    "pexpireat",
];

/// dlock's [`Locker`] over any backend.
#[derive(Debug)]
pub(crate) struct DlockLock {
    locker: Locker,
    keys: Vec<LockKey>,
    /// Exclusive unless [`with_mode`](Self::with_mode) says otherwise.
    mode: LockMode,
}

impl DlockLock {
    /// `slots` keys named `name` with the part 0, 1, … .
    pub(crate) fn new(locker: Locker, name: &str, slots: usize) -> Result<Self> {
        let keys = slot_keys(&locker, name, slots)?;
        Ok(DlockLock { locker, keys, mode: LockMode::Exclusive })
    }

    /// Takes every key in `mode` (a shared hold, a permit) instead.
    pub(crate) fn with_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    fn key(&self, slot: usize) -> Result<&LockKey> {
        slot_key(&self.keys, slot)
    }
}

/// `slots` keys named `name` with the part 0, 1, … .
pub(crate) fn slot_keys(locker: &Locker, name: &str, slots: usize) -> Result<Vec<LockKey>> {
    Ok((0..slots).map(|i| locker.key(name).part(i as u64).build()).collect::<dlock_core::Result<_>>()?)
}

/// The key of `slot`.
pub(crate) fn slot_key(keys: &[LockKey], slot: usize) -> Result<&LockKey> {
    keys.get(slot).ok_or_else(|| BenchError::Invariant(format!("no lock slot {slot}")))
}

impl BenchLock for DlockLock {
    type Held = LockGuard;

    async fn acquire(&self, slot: usize, wait: bool) -> Result<LockGuard> {
        let opts = AcquireOptions::new()
            .with_lease(LEASE)
            .with_wait(if wait { WAIT } else { Duration::ZERO })
            .with_mode(self.mode);
        Ok(self.locker.acquire(self.key(slot)?, opts).await?)
    }

    async fn release(&self, guard: LockGuard) -> Result<()> {
        if guard.release().await? {
            Ok(())
        } else {
            Err(BenchError::Invariant("dlock: a release found the lock no longer held".into()))
        }
    }

    fn script_internal_commands(&self) -> &'static [&'static str] {
        if self.locker.backend_name() == "memory" {
            &[]
        } else {
            DLOCK_SCRIPT_COMMANDS
        }
    }

    async fn leftovers(&self, conn: &MultiplexedConnection) -> Result<Vec<String>> {
        if self.locker.backend_name() != "redis" {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = self.keys.iter().map(|k| k.as_str().to_owned()).collect();
        existing_keys(conn, &keys).await
    }
}

/// Compare-and-delete: the textbook Redis unlock.
const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// Compare-and-delete that also announces the release to subscribers.
const COMPARE_DELETE_PUBLISH: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '')
  return 1
end
return 0";

/// The least a lock with fencing tokens must do to grant: `SET NX PX` and,
/// when it succeeds, `INCR` of a companion counter, atomically (one script).
/// No reentrancy, no restart-proof token, no waiter flag, a counter that
/// never expires: the floor under any fenced Redis lock, dlock included.
pub(crate) const FENCED_SET_NX: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0";

/// How a hand-written lock waits for a held key.
enum Waiting {
    /// Never: the uncontended baseline only ever tries once.
    TryOnce,
    /// Sleep a fixed interval between `SET NX` attempts.
    Poll(Duration, TimerThread),
    /// One shared subscription to the release channel; every release wakes
    /// every local waiter, and each of them retries.
    WakeAll { notify: Arc<Notify>, listener: JoinHandle<()> },
}

/// A runtime of its own on its own thread, for the poller's sleeps.
///
/// Tokio fires a timer on the first runtime wake-up after its 1 ms tick has
/// passed. If the pollers slept on the benchmark's runtime, the wake-up that
/// lets the holder release would also fire every overdue poll — right behind
/// the release, a coincidence that pollers in other processes never enjoy.
/// Timers on a separate runtime fire on their own schedule.
struct TimerThread {
    handle: tokio::runtime::Handle,
    /// Dropping it ends the thread.
    _shutdown: oneshot::Sender<()>,
}

impl TimerThread {
    fn start() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| BenchError::Invariant(format!("cannot start the poller's timer runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let (shutdown, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("poll-timer".into())
            .spawn(move || runtime.block_on(async move { drop(stopped.await) }))
            .map_err(|e| BenchError::Invariant(format!("cannot start the poller's timer thread: {e}")))?;
        Ok(TimerThread { handle, _shutdown: shutdown })
    }

    async fn sleep(&self, d: Duration) -> Result<()> {
        self.handle
            .spawn(tokio::time::sleep(d))
            .await
            .map_err(|e| BenchError::Invariant(format!("poller timer failed: {e}")))
    }
}

/// A naive waiter that somehow missed a release tries again after this long;
/// it never fires while wake-ups work, and it is counted if it does.
const WAKE_ALL_FALLBACK: Duration = Duration::from_millis(100);

/// A lock written by hand from raw commands: `SET key token NX PX lease` to
/// take it, compare-and-delete by `EVALSHA` to give it back, all on one
/// multiplexed connection.
pub(crate) struct RawLock {
    conn: MultiplexedConnection,
    keys: Vec<String>,
    channel: String,
    release: Script,
    token_prefix: String,
    next_token: AtomicU64,
    waiting: Waiting,
    /// Takes the lock with [`FENCED_SET_NX`] instead of a bare `SET NX PX`.
    fenced: Option<Script>,
}

impl std::fmt::Debug for RawLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawLock").field("keys", &self.keys.len()).finish_non_exhaustive()
    }
}

impl Drop for RawLock {
    fn drop(&mut self) {
        if let Waiting::WakeAll { listener, .. } = &self.waiting {
            listener.abort();
        }
    }
}

impl RawLock {
    fn with(conn: MultiplexedConnection, name: &str, slots: usize, release: &str, waiting: Waiting) -> Result<Self> {
        Ok(RawLock {
            conn,
            keys: (0..slots).map(|i| format!("{name}:{i}")).collect(),
            channel: format!("{name}:released"),
            release: Script::new(release),
            // Unique per acquire and unguessable enough for a benchmark: one
            // CSPRNG draw per lock object, a counter per acquire.
            token_prefix: Owner::random()?.as_str().to_owned(),
            next_token: AtomicU64::new(0),
            waiting,
            fenced: None,
        })
    }

    /// Tries once; for the uncontended baseline.
    pub(crate) fn try_once(conn: MultiplexedConnection, name: &str, slots: usize) -> Result<Self> {
        Self::with(conn, name, slots, COMPARE_AND_DELETE, Waiting::TryOnce)
    }

    /// Tries once with a fencing token ([`FENCED_SET_NX`]); the uncontended
    /// fenced floor.
    pub(crate) fn fenced_try_once(conn: MultiplexedConnection, name: &str, slots: usize) -> Result<Self> {
        let mut lock = Self::with(conn, name, slots, COMPARE_AND_DELETE, Waiting::TryOnce)?;
        lock.fenced = Some(Script::new(FENCED_SET_NX));
        Ok(lock)
    }

    /// The fenced floor that also reads the server clock, as any lock whose
    /// tokens must outlive a lost counter (a restart without persistence, a
    /// failover to a lagging replica) has to: what dlock's tokens cost on
    /// top of the floor's. The script reads `TIME` and throws it away; the
    /// token is still the counter.
    pub(crate) fn fenced_clock_try_once(conn: MultiplexedConnection, name: &str, slots: usize) -> Result<Self> {
        let mut lock = Self::fenced_try_once(conn, name, slots)?;
        lock.fenced = Some(Script::new(&format!("redis.call('TIME'){FENCED_SET_NX}")));
        Ok(lock)
    }

    /// Retries `SET NX` every `interval` while the key is held.
    pub(crate) fn poller(conn: MultiplexedConnection, name: &str, interval: Duration) -> Result<Self> {
        Self::with(conn, name, 1, COMPARE_AND_DELETE, Waiting::Poll(interval, TimerThread::start()?))
    }

    /// Subscribes to `name:released` on its own connection from `client`;
    /// each release wakes all local waiters.
    pub(crate) async fn wake_all(client: &redis::Client, conn: MultiplexedConnection, name: &str) -> Result<Self> {
        let channel = format!("{name}:released");
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(&channel).await?;
        let notify = Arc::new(Notify::new());
        let wake = notify.clone();
        let listener = tokio::spawn(async move {
            let mut messages = pubsub.into_on_message();
            while messages.next().await.is_some() {
                wake.notify_waiters();
            }
        });
        Self::with(conn, name, 1, COMPARE_DELETE_PUBLISH, Waiting::WakeAll { notify, listener })
    }

    async fn set_nx(&self, key: &str, token: &str) -> Result<bool> {
        if let Some(fenced) = &self.fenced {
            let fence: u64 = fenced
                .key(key)
                .key(format!("{key}:fence"))
                .arg(token)
                .arg(LEASE.as_millis() as u64)
                .invoke_async(&mut self.conn.clone())
                .await?;
            return Ok(fence > 0);
        }
        let reply: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(LEASE.as_millis() as u64)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(reply.is_some())
    }
}

impl BenchLock for RawLock {
    type Held = (usize, String);

    async fn acquire(&self, slot: usize, wait: bool) -> Result<(usize, String)> {
        let key = self.keys.get(slot).ok_or_else(|| BenchError::Invariant(format!("no lock slot {slot}")))?;
        let token = format!("{}-{}", self.token_prefix, self.next_token.fetch_add(1, Ordering::Relaxed));
        let busy = || BenchError::Invariant(format!("baseline: `{key}` was held on an uncontended acquire"));
        match (&self.waiting, wait) {
            (Waiting::TryOnce, _) | (_, false) => {
                if self.set_nx(key, &token).await? {
                    Ok((slot, token))
                } else {
                    Err(busy())
                }
            }
            (Waiting::Poll(interval, timer), true) => loop {
                if self.set_nx(key, &token).await? {
                    return Ok((slot, token));
                }
                timer.sleep(*interval).await?;
            },
            (Waiting::WakeAll { notify, .. }, true) => loop {
                let woken = notify.notified();
                tokio::pin!(woken);
                // Registered before the try: a release right after it still wakes us.
                woken.as_mut().enable();
                if self.set_nx(key, &token).await? {
                    return Ok((slot, token));
                }
                let _ = tokio::time::timeout(WAKE_ALL_FALLBACK, woken).await;
            },
        }
    }

    async fn release(&self, (slot, token): (usize, String)) -> Result<()> {
        let key = self.keys.get(slot).ok_or_else(|| BenchError::Invariant(format!("no lock slot {slot}")))?;
        let freed: i64 =
            self.release.key(key).arg(&token).arg(&self.channel).invoke_async(&mut self.conn.clone()).await?;
        if freed == 1 {
            Ok(())
        } else {
            Err(BenchError::Invariant(format!("baseline: a release found `{key}` no longer held")))
        }
    }

    fn script_internal_commands(&self) -> &'static [&'static str] {
        if self.fenced.is_some() {
            &["set", "incr", "get", "del", "time"]
        } else {
            &["get", "del", "publish"]
        }
    }

    async fn leftovers(&self, conn: &MultiplexedConnection) -> Result<Vec<String>> {
        existing_keys(conn, &self.keys).await
    }
}
