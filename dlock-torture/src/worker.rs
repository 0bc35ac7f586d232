//! The worker process: a tokio runtime whose tasks contend for K keys and
//! do a read–sleep–write on the resource while holding a lock, logging
//! every step to the history.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::redis::{RedisBackend, RedisOptions};
use dlock_core::backend::redlock::{RedLockBackend, RedLockOptions};
use dlock_core::backend::zookeeper::{ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::backend::Backend;
use dlock_core::LockMode;
use dlock_core::{AcquireOptions, LockGuard, Locker, LockerOptions, MemoryBackend, Owner};
use serde::{Deserialize, Serialize};
use tokio::time::{sleep, Instant};

use crate::broken::{BrokenHold, BrokenLock, Bug};
use crate::history::{instant_to_ns, Event, History};
use crate::resource::{Fenced, Resource, SetAccess, SetReg};
use crate::rng::Rng;

/// What one worker process does; passed as JSON on its command line.
///
/// `backend` `memory` is dlock's in-process table: it cannot span
/// processes, so its contenders are the tasks of one worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WorkerConfig {
    /// What the worker does: `` (the default) the registers' read–sleep–
    /// write on the Redis resource, below; `pg-fence` and its broken twin
    /// `pg-fence-check-outside-tx` the same on a PostgreSQL counter
    /// ([`crate::pg_fence`]); `pg-idempotency` and its broken twin
    /// `pg-idempotency-effect-outside-tx` requests through an
    /// `IdempotencyLayer::in_transaction` route ([`crate::pg_idempotency`]).
    /// For those, `resource` is the PostgreSQL URL.
    #[serde(default)]
    pub(crate) kind: String,
    /// `redis`, `redlock`, `zookeeper`, `postgres`, `memory` or a `broken-*` variant.
    pub(crate) backend: String,
    /// The lock servers.
    pub(crate) urls: Vec<String>,
    /// The resource server.
    pub(crate) resource: String,
    pub(crate) prefix: String,
    pub(crate) history: PathBuf,
    pub(crate) tasks: u32,
    pub(crate) keys: u32,
    /// Stop after this long.
    pub(crate) duration_ms: u64,
    /// The lease: a fixed lease unless `watchdog`.
    pub(crate) lease_ms: u64,
    pub(crate) watchdog: bool,
    pub(crate) wait_ms: u64,
    /// The critical section sleeps a random cs_min_ms..=cs_max_ms between read and write.
    pub(crate) cs_max_ms: u64,
    #[serde(default)]
    pub(crate) cs_min_ms: u64,
    /// ZooKeeper session timeout.
    pub(crate) session_ms: u64,
    /// Redis restart quarantine (`DLOCK_RESTART_QUARANTINE_MS`); 0: off.
    #[serde(default)]
    pub(crate) quarantine_ms: u64,
    /// How many op ids each key's set registers take (C3); 0: no set
    /// accesses. [`crate::harness::Run::spawn`] sets the run's cap.
    #[serde(default)]
    pub(crate) set_cap: u32,
    /// RedLock's per-node timeout; 0: the default 50 ms.
    #[serde(default)]
    pub(crate) node_timeout_ms: u64,
    /// Each task acquires under one owner of its own for all its sections
    /// (`AcquireOptions::with_owner`), as an application reusing an owner
    /// does; otherwise every acquire has a fresh owner.
    #[serde(default)]
    pub(crate) reuse_owner: bool,
    /// How the tasks take their keys: `` (exclusive, the default), `rw`
    /// (a quarter of the sections exclusive writers, the rest shared
    /// readers) or `permits:<N>` (one of N permits each). Only exclusive
    /// sections write the registers: shared holders and permit holders
    /// may hold a key together, so their writes would race by design.
    #[serde(default)]
    pub(crate) mode: String,
    /// Half the writers of `rw` are given up 50 to 250 ms into their wait
    /// (their acquire future dropped, as when an HTTP request hangs up),
    /// logged `acq_fail` `cancelled`: the readers a withdrawn intent kept
    /// out must then be let in (`crate::preference`). Only the first task
    /// of each process writes then (see `next_mode`).
    #[serde(default)]
    pub(crate) cancel_writers: bool,
    pub(crate) seed: u64,
}

impl WorkerConfig {
    /// The mode of the next section, drawn from `rng` for `rw`.
    fn next_mode(&self, task: u32, rng: &mut Rng) -> Result<LockMode, String> {
        match self.mode.as_str() {
            "" => Ok(LockMode::Exclusive),
            // Writers few enough that one given up often leaves no other
            // writer about, which is when a stale intent shows: only the
            // first task of each process writes, a third of the time.
            "rw" if self.cancel_writers && task == 0 && rng.below(3) == 0 => Ok(LockMode::Exclusive),
            "rw" if self.cancel_writers => Ok(LockMode::Shared),
            "rw" if rng.below(4) == 0 => Ok(LockMode::Exclusive),
            "rw" => Ok(LockMode::Shared),
            other => match other.strip_prefix("permits:").and_then(|n| n.parse().ok()) {
                Some(limit) => Ok(LockMode::permits(limit)),
                None => Err(format!("unknown mode `{other}`")),
            },
        }
    }
}

/// A mode as the history writes it (`None`: exclusive).
pub(crate) fn mode_label(mode: LockMode) -> Option<String> {
    match mode {
        LockMode::Shared => Some("s".into()),
        LockMode::Permits { limit } => Some(format!("p{limit}")),
        _ => None,
    }
}

enum Client {
    Dlock(Locker),
    Broken(BrokenLock),
}

enum Hold {
    Dlock(LockGuard),
    Broken(BrokenHold),
}

impl Hold {
    fn token(&self) -> u64 {
        match self {
            Hold::Dlock(g) => g.fencing_token(),
            Hold::Broken(h) => h.token,
        }
    }
}

/// Reads a worker's configuration (`worker <json>` on its command line).
pub(crate) fn config(config_json: &str) -> Result<WorkerConfig, String> {
    serde_json::from_str(config_json).map_err(|e| format!("bad worker config: {e}"))
}

/// The runtime a worker runs on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a tokio runtime: {e}"))
}

/// dlock's client for `cfg.backend` (a real backend, not a broken lock).
pub(crate) async fn locker(cfg: &WorkerConfig) -> Result<Locker, String> {
    match connect(cfg).await? {
        (Client::Dlock(locker), _) => Ok(locker),
        (Client::Broken(_), _) => Err(format!("`{}` is a broken lock of the harness, not dlock", cfg.backend)),
    }
}

/// The client, and the in-process table when the backend is `memory` (to
/// report what is left in it at the end).
async fn connect(cfg: &WorkerConfig) -> Result<(Client, Option<Arc<MemoryBackend>>), String> {
    let lease = Duration::from_millis(cfg.lease_ms);
    if let Some(bug) = Bug::from_name(&cfg.backend) {
        return BrokenLock::connect(bug, &cfg.urls, lease)
            .await
            .map(|b| (Client::Broken(b), None))
            .map_err(|e| e.to_string());
    }
    let options = LockerOptions::default().with_prefix(cfg.prefix.clone()).with_watchdog_lease(lease);
    if cfg.backend == "memory" {
        let table = Arc::new(MemoryBackend::new());
        let locker = Locker::with_options(table.clone(), options).map_err(|e| e.to_string())?;
        return Ok((Client::Dlock(locker), Some(table)));
    }
    let first = cfg.urls.first().ok_or("no lock server URL")?;
    // A broken variant of dlock's own mechanisms: the real backend, with
    // one of dlock-core's test-only switches on in this process.
    let backend = match crate::own_bugs::find(&cfg.backend) {
        Some(bug) => {
            dlock_core::broken_variants::set(bug.switch, true);
            bug.backend
        }
        None => cfg.backend.as_str(),
    };
    // Many workers start at once on a loaded machine: a connect that times
    // out then is the harness's start, not a fault under test (the run's
    // clock starts after it), so it is tried again for a while.
    let give_up = Instant::now() + START_UP_PATIENCE;
    let backend = loop {
        match open(backend, first, cfg).await {
            Ok(backend) => break backend,
            Err(e) if e.is_unavailable() && Instant::now() < give_up => sleep(Duration::from_millis(200)).await,
            Err(e) => return Err(e.to_string()),
        }
    };
    Locker::with_options(backend, options).map(|l| (Client::Dlock(l), None)).map_err(|e| e.to_string())
}

/// How long a worker tries to reach its lock service at start-up.
const START_UP_PATIENCE: Duration = Duration::from_secs(10);

/// The real backend `backend` at `first` (every URL for RedLock).
async fn open(backend: &str, first: &str, cfg: &WorkerConfig) -> dlock_core::Result<Arc<dyn Backend>> {
    Ok(match backend {
        "redis" => Arc::new(
            RedisBackend::connect_with(
                first,
                &cfg.prefix,
                RedisOptions::default()
                    .with_connect_timeout(Duration::from_millis(200))
                    .with_response_timeout(Duration::from_millis(cfg.lease_ms / 3).max(Duration::from_millis(20)))
                    .with_restart_quarantine(Duration::from_millis(cfg.quarantine_ms)),
            )
            .await?,
        ),
        "redlock" => Arc::new(
            RedLockBackend::connect_with(
                &cfg.urls,
                &cfg.prefix,
                RedLockOptions::default()
                    .with_node_timeout(Duration::from_millis(if cfg.node_timeout_ms == 0 {
                        50
                    } else {
                        cfg.node_timeout_ms
                    }))
                    .with_redis(
                        RedisOptions::default().with_restart_quarantine(Duration::from_millis(cfg.quarantine_ms)),
                    ),
            )
            .await?,
        ),
        "zookeeper" => Arc::new(
            ZooKeeperBackend::connect_with(
                first,
                &cfg.prefix,
                ZooKeeperOptions::default().with_session_timeout(Duration::from_millis(cfg.session_ms)),
            )
            .await?,
        ),
        "postgres" => Arc::new(
            PostgresBackend::connect_with(
                first,
                &cfg.prefix,
                PostgresOptions::default()
                    .with_response_timeout(Duration::from_millis(cfg.lease_ms / 3).max(Duration::from_millis(50))),
            )
            .await?,
        ),
        other => return Err(dlock_core::Error::config("--backend", format!("unknown backend `{other}`"))),
    })
}

/// The default workload (`kind` empty): the registers' read–sleep–write
/// under the lock, every task until the run's end.
pub(crate) async fn registers(cfg: WorkerConfig) -> Result<(), String> {
    let history = Arc::new(History::open(&cfg.history).map_err(|e| format!("cannot open the history: {e}"))?);
    let resource =
        Resource::connect(&cfg.resource).await.map_err(|e| format!("cannot reach the resource server: {e}"))?;
    let (client, table) = connect(&cfg).await?;
    let client = Arc::new(client);
    let cfg = Arc::new(cfg);
    let stop_at = Instant::now() + Duration::from_millis(cfg.duration_ms);
    let mut tasks = Vec::new();
    for task in 0..cfg.tasks {
        let (cfg, history, resource, client) = (cfg.clone(), history.clone(), resource.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(cfg.seed ^ (u64::from(std::process::id()) << 20) ^ u64::from(task));
            let mut seq = 0u64;
            let owner = if cfg.reuse_owner { Owner::random().ok() } else { None };
            while Instant::now() < stop_at {
                seq += 1;
                let op = Op { task, seq, owner: owner.as_ref() };
                one_op(&cfg, &history, &resource, &client, op, &mut rng).await;
            }
        }));
    }
    join_tasks(tasks).await?;
    if let Some(table) = table {
        // C6 for the in-process backend: every task has released, so the
        // table must be empty; the supervisor reads this from the history.
        let left = i64::try_from(table.len()).unwrap_or(i64::MAX);
        history.log(&Event { val: Some(left), ..Event::now("residue") });
    }
    Ok(())
}

/// One operation of a task: its sequence number, and the owner it reuses
/// (`reuse_owner`).
struct Op<'a> {
    task: u32,
    seq: u64,
    owner: Option<&'a Owner>,
}

fn ev(op: &str, task: u32, key: u32) -> Event {
    Event { task, key: Some(key), ..Event::now(op) }
}

async fn one_op(
    cfg: &WorkerConfig,
    history: &History,
    resource: &Resource,
    client: &Client,
    op: Op<'_>,
    rng: &mut Rng,
) {
    let Op { task, seq, owner: reused } = op;
    let key = u32::try_from(rng.below(u64::from(cfg.keys))).unwrap_or(0);
    let owner = format!("{}-{task}-{seq}", std::process::id());
    // The op id the set registers take: unique in the run (pids differ).
    let op_id = owner.clone();
    let wait = Duration::from_millis(cfg.wait_ms);
    let mode = match cfg.next_mode(task, rng) {
        Ok(mode) => mode,
        Err(e) => {
            history.log(&Event { owner: Some(owner.clone()), ..ev("acq_invoke", task, key) });
            history.log(&Event { res: Some(e), ..ev("acq_fail", task, key) });
            return;
        }
    };
    // The mode asked for (`x` exclusive), so the history shows who waited
    // as a writer (`crate::preference`).
    let asked = Some(mode_label(mode).unwrap_or_else(|| "x".into()));
    history.log(&Event { owner: Some(owner.clone()), mode: asked.clone(), ..ev("acq_invoke", task, key) });
    let give_up = (cfg.cancel_writers && mode == LockMode::Exclusive && rng.below(2) == 0)
        .then(|| Duration::from_millis(50 + rng.below(201)));
    let mut left_us = None;
    let acquired: Result<Option<(Hold, Option<u64>, String)>, String> = match client {
        Client::Dlock(locker) => {
            let lock_key = match locker.key("torture").part(key).build() {
                Ok(k) => k,
                Err(e) => {
                    history.log(&Event { res: Some(format!("invalid_key: {e}")), ..ev("acq_fail", task, key) });
                    return;
                }
            };
            let opts = AcquireOptions::new().with_wait(wait).with_mode(mode);
            let opts = match reused {
                Some(o) => opts.with_owner(o.clone()),
                None => opts,
            };
            let opts = if cfg.watchdog { opts } else { opts.with_lease(Duration::from_millis(cfg.lease_ms)) };
            let acquire = locker.acquire(&lock_key, opts);
            let outcome = match give_up {
                Some(after) => tokio::time::timeout(after, acquire).await.map_err(|_| ()),
                None => Ok(acquire.await),
            };
            match outcome {
                Err(()) => Err("cancelled".to_owned()),
                Ok(Ok(g)) => {
                    left_us = Some(validity_left_us(g.valid_until()));
                    let vu = (!cfg.watchdog).then(|| instant_to_ns(g.valid_until()));
                    let owner = g.owner().as_str().to_owned();
                    Ok(Some((Hold::Dlock(g), vu, owner)))
                }
                Ok(Err(e)) if e.is_contention() => Ok(None),
                Ok(Err(e)) => Err(error_kind(&e)),
            }
        }
        Client::Broken(b) => match b.acquire(key, &owner, Instant::now() + wait, rng).await {
            Ok(Some(h)) => {
                let vu = h.valid_until_ns;
                Ok(Some((Hold::Broken(h), vu, owner.clone())))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(format!("backend: {e}")),
        },
    };
    let (hold, vu, owner) = match acquired {
        Ok(Some(h)) => h,
        Ok(None) => {
            history.log(&Event { res: Some("timeout".into()), mode: asked, ..ev("acq_fail", task, key) });
            return;
        }
        Err(kind) if kind == "cancelled" && give_up.is_some() => {
            history.log(&Event { res: Some(kind), mode: asked, ..ev("acq_fail", task, key) });
            return;
        }
        Err(kind) => {
            history.log(&Event { res: Some(kind), mode: asked, ..ev("acq_fail", task, key) });
            // A dead server answers at once; do not spin on it.
            sleep(Duration::from_millis(5 + rng.below(20))).await;
            return;
        }
    };
    let token = hold.token();
    history.log(&Event {
        token: Some(token),
        owner: Some(owner.clone()),
        vu,
        left_us,
        mode: mode_label(mode),
        ..ev("acq_ok", task, key)
    });

    let cs_sleep = Duration::from_millis(cfg.cs_min_ms + rng.below(cfg.cs_max_ms.saturating_sub(cfg.cs_min_ms) + 1));
    let cs = critical_section(
        history,
        resource,
        Section { task, key, token, op_id: &op_id, set_cap: cfg.set_cap, writes: mode == LockMode::Exclusive },
        cs_sleep,
    );
    tokio::pin!(cs);
    // The section runs to its end even after a loss, like an application
    // that ignores the signal: the resource's fencing must then refuse it.
    let mut lost_seen = false;
    loop {
        tokio::select! {
            _ = &mut cs => break,
            vu_at_loss = lost(client, &hold), if !lost_seen => {
                lost_seen = true;
                history.log(&Event { token: Some(token), owner: Some(owner.clone()), vu: vu_at_loss, ..ev("lost", task, key) });
            }
        }
    }
    history.log(&Event { token: Some(token), ..ev("cs_exit", task, key) });
    history.log(&Event { token: Some(token), owner: Some(owner.clone()), ..ev("rel_invoke", task, key) });
    let released = match (client, hold) {
        (_, Hold::Dlock(g)) => {
            g.release().await.map(|held| if held { "freed" } else { "not_held" }).map_err(|e| e.to_string())
        }
        (Client::Broken(b), Hold::Broken(h)) => b.release(h).await.map(|()| "freed").map_err(|e| e.to_string()),
        (Client::Dlock(_), Hold::Broken(_)) => Err("a broken hold on the dlock client".to_owned()),
    };
    match released {
        Ok(res) => history.log(&Event { res: Some(res.into()), ..ev("rel_ok", task, key) }),
        Err(e) => history.log(&Event { res: Some(e), ..ev("rel_err", task, key) }),
    }
}

/// What is left of a guard's validity now, in µs; negative when it is over.
fn validity_left_us(valid_until: Instant) -> i64 {
    let now = Instant::now();
    let us = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    if valid_until > now {
        us(valid_until - now)
    } else {
        -us(now - valid_until)
    }
}

/// Waits for the hold's lost signal; returns the validity end the client
/// knew when it fired (the moment its belief should have ended).
async fn lost(client: &Client, hold: &Hold) -> Option<u64> {
    match (client, hold) {
        (_, Hold::Dlock(g)) => {
            g.lost().await;
            Some(instant_to_ns(g.valid_until()))
        }
        (Client::Broken(b), Hold::Broken(h)) => {
            b.lost(h).await;
            None
        }
        (Client::Dlock(_), Hold::Broken(_)) => std::future::pending().await,
    }
}

/// Who is in a critical section, and for what.
struct Section<'a> {
    task: u32,
    key: u32,
    token: u64,
    op_id: &'a str,
    set_cap: u32,
    /// An exclusive hold: it writes the registers (others only sleep).
    writes: bool,
}

async fn critical_section(history: &History, resource: &Resource, s: Section<'_>, cs_sleep: Duration) {
    let Section { task, key, token, .. } = s;
    history.log(&Event { token: Some(token), ..ev("cs_enter", task, key) });
    if !s.writes {
        sleep(cs_sleep).await;
        return;
    }
    let fenced = resource.fenced_read(key, token).await;
    let plain = resource.read(key).await;
    // Both set registers are read before the sleep and written after it,
    // like the counter: a non-atomic read-modify-write of the whole set.
    let mut sets = Vec::new();
    if s.set_cap > 0 {
        for reg in [SetReg::Fenced, SetReg::Unfenced] {
            sets.push((reg, resource.set_read(reg, key, token, s.set_cap).await));
        }
    }
    sleep(cs_sleep).await;
    match fenced {
        Ok(Fenced::Ok(v)) => {
            history.log(&Event { token: Some(token), reg: Some("f".into()), ..ev("w_invoke", task, key) });
            let res = match resource.fenced_write(key, token, v + 1).await {
                Ok(Fenced::Ok(_)) => "ok",
                Ok(Fenced::Stale) => "stale",
                Err(_) => "error",
            };
            history.log(&Event {
                token: Some(token),
                reg: Some("f".into()),
                res: Some(res.into()),
                val: Some(v + 1),
                ..ev("write", task, key)
            });
        }
        Ok(Fenced::Stale) => {
            history.log(&Event {
                token: Some(token),
                reg: Some("f".into()),
                res: Some("stale".into()),
                ..ev("write", task, key)
            });
        }
        Err(_) => {
            history.log(&Event {
                token: Some(token),
                reg: Some("f".into()),
                res: Some("error".into()),
                ..ev("write", task, key)
            });
        }
    }
    if let Ok(v) = plain {
        history.log(&Event { token: Some(token), reg: Some("u".into()), ..ev("w_invoke", task, key) });
        let res = if resource.write(key, v + 1).await.is_ok() { "ok" } else { "error" };
        history.log(&Event {
            token: Some(token),
            reg: Some("u".into()),
            res: Some(res.into()),
            val: Some(v + 1),
            ..ev("write", task, key)
        });
    }
    for (reg, read) in sets {
        let logged = |res: &str| Event {
            token: Some(token),
            reg: Some(reg.name().into()),
            res: Some(res.into()),
            id: Some(s.op_id.to_owned()),
            ..ev("write", task, key)
        };
        match read {
            Ok(SetAccess::Ok(mut ids)) => {
                ids.push(s.op_id.to_owned());
                history.log(&Event { token: Some(token), reg: Some(reg.name().into()), ..ev("w_invoke", task, key) });
                let res = match resource.set_write(reg, key, token, &ids).await {
                    Ok(SetAccess::Ok(_)) => "ok",
                    Ok(SetAccess::Stale) => "stale",
                    Ok(SetAccess::Full) | Err(_) => "error",
                };
                history.log(&logged(res));
            }
            Ok(SetAccess::Stale) => history.log(&logged("stale")),
            // Past the cap: the set is left alone, and nothing is logged.
            Ok(SetAccess::Full) => {}
            Err(_) => history.log(&logged("error")),
        }
    }
}

fn error_kind(e: &dlock_core::Error) -> String {
    match e {
        dlock_core::Error::QuorumUnavailable { .. } => "quorum_unavailable".into(),
        dlock_core::Error::Backend { .. } => "backend".into(),
        dlock_core::Error::Cancelled => "cancelled".into(),
        other => format!("other: {other}"),
    }
}

/// Waits for a worker's tasks. A task that panicked did not do its share:
/// the worker fails, and the supervisor counts it as a lost worker.
pub(crate) async fn join_tasks(tasks: Vec<tokio::task::JoinHandle<()>>) -> Result<(), String> {
    let total = tasks.len();
    let mut panicked = 0;
    for t in tasks {
        if t.await.is_err() {
            panicked += 1;
        }
    }
    if panicked > 0 {
        return Err(format!("{panicked} of {total} task(s) panicked"));
    }
    Ok(())
}
