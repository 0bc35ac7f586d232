//! The kit every scenario is built from: sizes, a worker's default
//! configuration, the report's shape, the RedLock masters, the residue
//! check, the holder finder and the end of a run (join, check, verdict).
//! Scenarios import it; the registry of scenarios is [`crate::scenarios`].

use std::time::Duration;

use dlock_testing::RedisServer;
use redis::AsyncCommands;
use tokio::time::sleep;

use crate::checker::Findings;
use crate::harness::{Report, Run};
use crate::resource::Resource;
use crate::rng::Rng;
use crate::worker::WorkerConfig;

/// Sizes: `--short` for CI (debug build, 2 cores), the default for the long run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Size {
    pub(crate) short: bool,
}

impl Size {
    pub(crate) fn pick<T>(self, short: T, long: T) -> T {
        if self.short {
            short
        } else {
            long
        }
    }
}

/// A worker's configuration with the defaults every scenario starts from.
pub(crate) fn config(backend: &str, urls: Vec<String>, resource: &RedisServer, seed: u64) -> WorkerConfig {
    config_on(backend, urls, resource.url(), seed)
}

/// [`config`] for a resource that is not the harness's Redis registers
/// (the `kind`s of [`WorkerConfig`] that write to PostgreSQL).
pub(crate) fn config_on(backend: &str, urls: Vec<String>, resource: String, seed: u64) -> WorkerConfig {
    WorkerConfig {
        kind: String::new(),
        backend: backend.into(),
        urls,
        resource,
        prefix: "torture".into(),
        history: std::path::PathBuf::new(),
        tasks: 3,
        keys: 2,
        duration_ms: 2000,
        lease_ms: 1000,
        watchdog: true,
        wait_ms: 2000,
        cs_max_ms: 5,
        cs_min_ms: 0,
        session_ms: 1000,
        quarantine_ms: 0,
        // Run::spawn sets the run's cap.
        set_cap: 0,
        node_timeout_ms: 0,
        reuse_owner: false,
        mode: String::new(),
        cancel_writers: false,
        seed,
    }
}

/// Fills the report's shape columns (processes, tasks, keys, lease) from a worker configuration.
pub(crate) fn describe(r: &mut Report, procs: u32, cfg: &WorkerConfig) {
    r.processes = procs;
    r.tasks = cfg.tasks;
    r.keys = cfg.keys;
    r.lease_ms = if cfg.backend == "zookeeper" { cfg.session_ms } else { cfg.lease_ms };
}

/// The Redis server the workers' resource lives on (the fenced register,
/// the sets), and the harness's own connection to it for the checks.
/// A pool of `connections` to the PostgreSQL at `url` (the resource of
/// `pg-fence`, the records and effects of `pg-idempotency`), connected now.
pub(crate) async fn pg_pool(url: &str, connections: u32) -> Result<sqlx::PgPool, String> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))
}

pub(crate) async fn resource_server() -> Result<(RedisServer, Resource), String> {
    let server = RedisServer::start();
    let resource = Resource::connect(&server.url()).await.map_err(|e| e.to_string())?;
    Ok((server, resource))
}

/// Starts `procs` worker processes of `cfg` in `run`.
pub(crate) fn spawn_workers(run: &mut Run, cfg: &WorkerConfig, procs: u32) -> Result<(), String> {
    for _ in 0..procs {
        run.spawn(cfg.clone()).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Waits until `procs` worker processes have each logged an acquire, so
/// are connected (at most `within`): a server fault injected while a worker
/// still connects makes it fail to start, a lost worker, instead of testing
/// the fault. Start-up takes longer on a loaded machine and in a debug
/// build than any fixed pause allows for.
pub(crate) async fn workers_started(run: &Run, procs: usize, within: Duration) -> Result<(), String> {
    workers_logged(run, "acq_invoke", procs, within).await
}

/// [`workers_started`] for workers whose first step is `op`, not an acquire.
pub(crate) async fn workers_logged(run: &Run, op: &str, procs: usize, within: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let events = tokio::task::block_in_place(|| run.events())?;
        let started: std::collections::HashSet<u32> = events.iter().filter(|e| e.op == op).map(|e| e.pid).collect();
        if started.len() >= procs || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        sleep(Duration::from_millis(20)).await;
    }
}

/// For the scenarios whose fault outlives a lease: how many holds that
/// fencing refused had been told they were lost by then.
pub(crate) fn note_signalled(r: &mut Report) {
    if let Some(signalled) = r.stale_holds_signalled.clone() {
        r.note(format!(
            "holds refused by fencing whose lost signal had fired by their first refused access: {signalled}"
        ));
    }
}

/// The RedLock masters every RedLock scenario that promises safety runs on:
/// 5, with AOF `always`, so a restarted master keeps its locks.
pub(crate) fn redlock_masters() -> Vec<RedisServer> {
    (0..5).map(|_| RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"])).collect()
}

/// [`residue`] summed over `servers`, sampled on all of them in one window.
pub(crate) async fn residue_on(
    servers: impl IntoIterator<Item = &RedisServer>,
    renew_every: Duration,
) -> Result<(u64, u64), String> {
    let mut total = (0, 0);
    for got in futures_util::future::join_all(servers.into_iter().map(|s| {
        let url = s.url();
        async move { residue(&url, renew_every).await }
    }))
    .await
    {
        let (left, refreshed) = got?;
        total.0 += left;
        total.1 += refreshed;
    }
    Ok(total)
}

/// C6 on a Redis lock server: lock keys left, and how many of them have a
/// PTTL that grows between two samples 2 × renew interval apart.
pub(crate) async fn residue(url: &str, renew_every: Duration) -> Result<(u64, u64), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut c = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    let all: Vec<String> = c.keys("torture*").await.map_err(|e| e.to_string())?;
    let mut locks = Vec::new();
    for k in all {
        let kind: String = redis::cmd("TYPE").arg(&k).query_async(&mut c).await.map_err(|e| e.to_string())?;
        if kind != "string" {
            continue;
        }
        // A lock is `<token>:<w>:<owner>`; the fence high-water mark (a bare
        // number) and the restart marker (`1`) are not locks.
        let value: Option<String> = c.get(&k).await.map_err(|e| e.to_string())?;
        if value.is_some_and(|v| {
            v.splitn(3, ':').count() == 3 && v.split(':').next().is_some_and(|t| t.parse::<u64>().is_ok())
        }) {
            locks.push(k);
        }
    }
    let mut first = Vec::new();
    for k in &locks {
        let pttl = c.pttl::<_, i64>(k).await.map_err(|e| e.to_string())?;
        // Which grant it was (token and owner are in the value), to find it
        // in the histories when a row fails on it.
        let value: Option<String> = c.get(k).await.map_err(|e| e.to_string())?;
        eprintln!("dlock-torture: lock key left on {url}: {k} = {value:?}, PTTL {pttl} ms");
        first.push(pttl);
    }
    sleep(renew_every * 2).await;
    let mut refreshed = 0;
    for (k, before) in locks.iter().zip(first) {
        let after: i64 = c.pttl(k).await.map_err(|e| e.to_string())?;
        if after > before {
            refreshed += 1;
        }
    }
    Ok((locks.len() as u64, refreshed))
}

/// Waits for the workers; a hang or a lost worker fails the row.
pub(crate) fn join(run: &mut Run, r: &mut Report, grace: Duration) {
    let joined = tokio::task::block_in_place(|| run.join(grace));
    if joined.hung > 0 {
        r.fail(format!("{} worker(s) did not finish within {grace:?} of their end (hang)", joined.hung));
    }
    if !joined.failed.is_empty() {
        r.fail(format!("lost worker(s): {}", joined.failed.join(", ")));
    }
}

/// The history's own checks (C1 from the grants, C4, lost signals, waits)
/// for a run whose resource is not the Redis registers: nothing to compare
/// a register with, so the scenario judges its resource itself. The
/// workers must have ended ([`join`]).
pub(crate) fn check_history(run: &Run, r: &mut Report) -> Result<Findings, String> {
    let events = run.events()?;
    let findings = crate::checker::check(&events, &std::collections::HashMap::new(), crate::history::mono_ns());
    r.absorb(&findings);
    let drawn = crate::timeline::write(&r.scenario, &r.backend, &events, crate::history::mono_ns())?;
    r.timeline = drawn.map(|p| p.display().to_string());
    Ok(findings)
}

/// Waits for the workers (a hang fails the row), checks the history and
/// files the findings into `r`; a safety violation fails the row.
pub(crate) async fn finish(
    run: &mut Run,
    r: &mut Report,
    resource: &Resource,
    keys: u32,
    grace: Duration,
) -> Result<Findings, String> {
    join(run, r, grace);
    let findings = run.check(resource, keys).await?;
    r.absorb(&findings);
    let drawn = crate::timeline::write(&r.scenario, &r.backend, &run.events()?, crate::history::mono_ns())?;
    r.timeline = drawn.map(|p| p.display().to_string());
    if !findings.unavailable_ns.is_empty() {
        r.note(format!(
            "unavailable answers: {}, p99 {:.0} ms, max {:.0} ms after the acquire was called",
            findings.unavailable_ns.len(),
            crate::checker::percentile_ms(&findings.unavailable_ns, 0.99),
            crate::checker::percentile_ms(&findings.unavailable_ns, 1.0)
        ));
    }
    if findings.released_not_held > 0 {
        r.note(format!(
            "releases after the lease ran out, answered `not held` (release() = false, nothing deleted): {}",
            findings.released_not_held
        ));
    }
    if !r.safety_ok() {
        if r.expected_safe {
            r.fail("safety violated under a fault the backend promises to survive");
        } else {
            r.fail("C4: a token not above an earlier grant's, where tokens are promised under this fault");
        }
    }
    Ok(findings)
}

/// Waits up to `within` for a worker (of `among`) that holds a lock;
/// `Ok(None)` when none did, an error when the history cannot be read.
pub(crate) async fn find_holder(
    run: &Run,
    among: Option<&[u32]>,
    within: Duration,
    rng: &mut Rng,
) -> Result<Option<u32>, String> {
    find(run, among, false, within, rng).await
}

/// A worker among `among` whose hold was granted at most `age` ago,
/// looked for until `within` passes.
pub(crate) async fn find_fresh_holder(
    run: &Run,
    among: &[u32],
    age: Duration,
    within: Duration,
) -> Result<Option<u32>, String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let since = crate::history::mono_ns().saturating_sub(u64::try_from(age.as_nanos()).unwrap_or(u64::MAX));
        let holders = tokio::task::block_in_place(|| run.holders_since(Some(among), false, since))?;
        if let Some(pid) = holders.first() {
            return Ok(Some(*pid));
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(None);
        }
        sleep(Duration::from_millis(5)).await;
    }
}

/// [`find_holder`], among holds whose fenced write is still ahead.
pub(crate) async fn find_holder_before_write(
    run: &Run,
    within: Duration,
    rng: &mut Rng,
) -> Result<Option<u32>, String> {
    find(run, None, true, within, rng).await
}

async fn find(
    run: &Run,
    among: Option<&[u32]>,
    before_write: bool,
    within: Duration,
    rng: &mut Rng,
) -> Result<Option<u32>, String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let holders = tokio::task::block_in_place(|| run.holders(among, before_write))?;
        if !holders.is_empty() {
            let i = usize::try_from(rng.below(holders.len() as u64)).unwrap_or(0);
            return Ok(holders.get(i).copied());
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(None);
        }
        sleep(Duration::from_millis(10)).await;
    }
}

/// Live workers with a task whose last logged event is `op` on a key that
/// `key` accepts: where in its section a task is, for a fault that must
/// land in one phase of it (the history's tail; a task may have moved on
/// by the time the fault lands, so the caller looks again after it).
pub(crate) fn tasks_at(run: &Run, op: &str, key: impl Fn(u32) -> bool) -> Result<Vec<u32>, String> {
    let mut last: std::collections::HashMap<(u32, u32), (String, Option<u32>)> = std::collections::HashMap::new();
    for e in run.events()? {
        last.insert((e.pid, e.task), (e.op, e.key));
    }
    // Only workers: the nemesis's own events carry the harness's pid.
    let live = run.live();
    let mut pids: Vec<u32> = last
        .into_iter()
        .filter(|(_, (o, k))| o == op && k.is_some_and(&key))
        .map(|((pid, _), _)| pid)
        .filter(|p| live.contains(p))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// Kills a live worker (`kill -9`) and starts a fresh one of `cfg` for the
/// rest of the run (from `started`, at least `min_left` ms), so the load
/// stays up.
pub(crate) fn kill_and_replace(
    run: &mut Run,
    pid: u32,
    cfg: &WorkerConfig,
    started: u64,
    min_left: u64,
) -> Result<(), String> {
    tokio::task::block_in_place(|| run.kill(pid));
    let mut again = cfg.clone();
    let elapsed_ms = (crate::history::mono_ns() - started) / 1_000_000;
    again.duration_ms = cfg.duration_ms.saturating_sub(elapsed_ms).max(min_left);
    run.spawn(again).map(|_| ()).map_err(|e| e.to_string())
}

/// `kills` times, every `every`: kills a worker that holds a lock (`kill
/// -9`) and starts a fresh one for the rest of the run (from `started`, of
/// `cfg.duration_ms`, at least `min_left`), so the contention stays up.
/// Returns how many kills hit a holder.
pub(crate) async fn kill_holders(
    run: &mut Run,
    cfg: &WorkerConfig,
    kills: u64,
    every: Duration,
    min_left: u64,
    rng: &mut Rng,
) -> Result<u64, String> {
    let started = crate::history::mono_ns();
    let mut done = 0;
    for _ in 0..kills {
        sleep(every).await;
        let Some(pid) = find_holder(run, None, Duration::from_millis(500), rng).await? else { continue };
        kill_and_replace(run, pid, cfg, started, min_left)?;
        done += 1;
    }
    Ok(done)
}
