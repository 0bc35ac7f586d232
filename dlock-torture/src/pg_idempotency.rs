//! `pg-idempotency` (issue 27 item 2): exactly once through `kill -9`, with
//! `IdempotencyLayer::in_transaction` on a real PostgreSQL.
//!
//! Worker processes each serve an in-process axum `Router` (called through
//! `tower::ServiceExt::oneshot`, no sockets) whose one route sits under
//! `IdempotencyLayer::new().caller(Caller::shared()).in_transaction(store)`.
//! Its handler inserts an effect row `(key, worker, at)` through its `Tx`
//! into a table with **no unique index** (a second run of a key shows as a
//! second row), sleeps 5–30 ms (so kills land mid-transaction) and answers
//! `201`. Each task sends `Idempotency-Key`s from a window that all workers
//! share and that moves with the system's monotonic clock (16 keys, a new
//! one every 10 ms), so several workers race on every key, and logs what it
//! was answered. The harness `kill -9`s a worker with a request in flight
//! every 250–500 ms and starts a fresh one. Once every worker has ended:
//!
//! * **atomicity**: every effect row has its completed record and every
//!   completed record its effect (both tables read, compared by key);
//! * **recovery**: the harness sends every key ever sent again, through
//!   the same route in its own process, retrying `409`/`503`, until it
//!   answers `201`;
//! * **exactly once**: then every key has exactly one effect row (never
//!   0, never 2) and a completed record, and no key was answered "`201`,
//!   not replayed" more than once (workers and recovery together).
//!
//! `overlaps` and `lost` count the keys whose effect ran twice (as in
//! `idempotency-storm`); `lost` also counts keys with no effect after the
//! recovery.
//!
//! Its broken twin `broken-effect-outside-tx` (in `checker-self-test`)
//! writes the effect through the pool, in autocommit, instead of the `Tx`:
//! a kill between the effect and the commit leaves an effect with no
//! record, and the recovery runs the key again. Atomicity and exactly-once
//! must both fire.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use dlock_axum::idempotency::{IdempotencyLayer, Tx};
use dlock_axum::Caller;
use dlock_core::idempotency::PostgresStore;
use dlock_testing::PostgresServer;
use sqlx::postgres::PgPool;
use tokio::time::{sleep, Instant};
use tower::ServiceExt;

use crate::harness::{Report, Run};
use crate::history::{mono_ns, Event, History};
use crate::rng::Rng;
use crate::scenario::{config_on, join, kill_and_replace, spawn_workers, tasks_at, workers_logged, Size};
use crate::worker::WorkerConfig;

const KIND: &str = "pg-idempotency";
const KIND_OUTSIDE: &str = "pg-idempotency-effect-outside-tx";
/// The keys' window: a new key every `STEP_MS`, each sent for `WINDOW` steps.
const STEP_MS: u64 = 10;
const WINDOW: u64 = 16;
/// How long the recovery pass retries one key.
const RECOVERY: Duration = Duration::from_secs(15);
/// How many keys the recovery pass sends at once.
const RECOVERY_AT_ONCE: usize = 16;

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("pg-idempotency", KIND, size, seed).await?])
}

/// The row of `kind` (the real route, or the broken twin) under
/// `scenario`'s name.
pub(crate) async fn row(scenario: &str, kind: &str, size: Size, seed: u64) -> Result<Report, String> {
    let broken = kind != KIND;
    let pg = tokio::task::spawn_blocking(PostgresServer::start).await.map_err(|e| format!("PostgreSQL: {e}"))?;
    // A connection for each request's transaction and one for the twin's
    // effect beside it (as the workers' pools): with fewer, the twin's
    // requests would each hold one and wait for another until the pool's
    // timeout, and its recovery would fail for a reason that is no bug.
    let pool = crate::scenario::pg_pool(&pg.url(), RECOVERY_AT_ONCE as u32 * 2 + 1).await?;
    let effects = effects_table("torture");
    let create = format!("CREATE TABLE {effects} (key text NOT NULL, worker int NOT NULL, at timestamptz NOT NULL)");
    sqlx::query(&create).execute(&pool).await.map_err(|e| format!("`{create}`: {e}"))?;
    // The store's tables, made once before the workers race to make them.
    let store = PostgresStore::with_pool(pool.clone(), "torture").await.map_err(|e| e.to_string())?;
    let mut run = Run::new(&format!("pg-idem-{kind}")).map_err(|e| e.to_string())?;
    let kills = size.pick(12u64, 80);
    let mut cfg = config_on("none", Vec::new(), pg.url(), seed);
    cfg.kind = kind.into();
    cfg.tasks = 4;
    (cfg.cs_min_ms, cfg.cs_max_ms) = (5, 30);
    cfg.duration_ms = kills * 500 + 2000;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_logged(&run, "idem_send", procs as usize, Duration::from_secs(20)).await?;
    let mut rng = Rng::new(seed);
    let started = mono_ns();
    let mut done = 0;
    for _ in 0..kills {
        sleep(Duration::from_millis(250 + rng.below(250))).await;
        // A worker with a request in flight (its last event the send).
        let busy = tokio::task::block_in_place(|| tasks_at(&run, "idem_send", |_| true))?;
        let Some(&pid) = busy.get(usize::try_from(rng.below(busy.len().max(1) as u64)).unwrap_or(0)) else {
            continue;
        };
        kill_and_replace(&mut run, pid, &cfg, started, 500)?;
        done += 1;
    }
    // The run ends with a kill of every worker, mid-request: keys whose
    // only run dies with it are left for the recovery pass.
    for pid in run.live() {
        tokio::task::block_in_place(|| run.kill(pid));
        done += 1;
    }
    let mut r =
        Report::new(scenario, if broken { "broken-effect-outside-tx" } else { "postgres in_transaction" }, seed);
    r.expected_safe = !broken;
    r.faults = done;
    r.fault_kind = "kill -9 a worker with a request in flight, replaced at once".into();
    r.processes = procs;
    r.tasks = cfg.tasks;
    join(&mut run, &mut r, Duration::from_secs(15));
    let events = run.events()?;
    let sent = Sent::of(&events);
    r.operations = sent.answered;
    r.keys = u32::try_from(sent.keys.len()).unwrap_or(u32::MAX);
    let before = Tables::read(&pool, &effects).await?;
    let route = Route {
        pool: pool.clone(),
        outside: broken,
        worker: 0,
        sleep_ms: (cfg.cs_min_ms, cfg.cs_max_ms),
        effects: effects.clone(),
        history: None,
    };
    let app = app(route, store);
    let recovered = recover(&app, &sent.keys).await;
    let after = Tables::read(&pool, &effects).await?;
    judge(&mut r, &sent, &before, &recovered, &after);
    Ok(r)
}

fn effects_table(prefix: &str) -> String {
    format!("\"{prefix}_effects\"")
}

/// What the route is made of.
#[derive(Clone)]
struct Route {
    pool: PgPool,
    /// The broken twin: the effect through the pool, not the `Tx`.
    outside: bool,
    /// The effect rows' `worker` column: the process's pid (0: the harness).
    worker: i32,
    /// The work after the effect, a random `sleep_ms.0..=sleep_ms.1` ms.
    sleep_ms: (u64, u64),
    effects: String,
    /// Where each run logs its effect (the workers; not the recovery pass).
    history: Option<Arc<History>>,
}

/// The route: an effect row per run, through the route's `Tx` (or, in the
/// broken twin, through the pool beside it), a few ms of work, `201`.
fn app(route: Route, store: PostgresStore) -> Router {
    let Route { pool, outside, worker, sleep_ms, effects, history } = route;
    let insert = format!("INSERT INTO {effects} (key, worker, at) VALUES ($1, $2, clock_timestamp())");
    let handler = move |mut tx: Tx, key: String| {
        let (pool, insert, history) = (pool.clone(), insert.clone(), history.clone());
        async move {
            let query = sqlx::query(&insert).bind(&key).bind(worker);
            let written = if outside {
                // The twin's bug: the effect commits on its own, whatever
                // becomes of the route's transaction.
                query.execute(&pool).await
            } else {
                query.execute(&mut *tx).await
            };
            if let Err(e) = written {
                // A 5xx: the layer rolls the transaction back.
                return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
            }
            // Written, not yet committed: a kill from here on rolls the run
            // back (or, in the twin, tears the effect from its record).
            if let Some(h) = &history {
                h.log(&Event { id: Some(key.clone()), ..Event::now("effect_run") });
            }
            let mut rng = Rng::new(mono_ns() ^ u64::from(std::process::id()));
            sleep(Duration::from_millis(sleep_ms.0 + rng.below(sleep_ms.1.saturating_sub(sleep_ms.0) + 1))).await;
            (StatusCode::CREATED, "done").into_response()
        }
    };
    let layer = IdempotencyLayer::new().caller(Caller::shared()).in_transaction(store);
    Router::new().route("/effect", post(handler).layer(layer))
}

/// What one request was answered, as the history logs it (`res`).
fn outcome(status: StatusCode, replayed: bool) -> String {
    match (status.as_u16(), replayed) {
        (201, false) => "fresh".into(),
        (201, true) => "replayed".into(),
        (409, _) => "in_progress".into(),
        (503, _) => "not_committed".into(),
        (other, _) => other.to_string(),
    }
}

async fn send(app: &Router, key: &str) -> String {
    let req = Request::post("/effect").header("idempotency-key", key).body(Body::from(key.to_owned()));
    let Ok(req) = req else { return "bad_request".into() };
    match app.clone().oneshot(req).await {
        Ok(res) => outcome(res.status(), res.headers().contains_key("idempotent-replayed")),
        Err(never) => match never {},
    }
}

/// The worker process: `cfg.tasks` tasks send keys of the shared window
/// until `cfg.duration_ms` has passed.
pub(crate) async fn work(cfg: WorkerConfig) -> Result<(), String> {
    let history = Arc::new(History::open(&cfg.history).map_err(|e| format!("cannot open the history: {e}"))?);
    let pool = crate::scenario::pg_pool(&cfg.resource, cfg.tasks * 2 + 1).await?;
    let store = PostgresStore::with_pool(pool.clone(), &cfg.prefix).await.map_err(|e| e.to_string())?;
    let worker = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    let route = Route {
        pool,
        outside: cfg.kind == KIND_OUTSIDE,
        worker,
        sleep_ms: (cfg.cs_min_ms, cfg.cs_max_ms),
        effects: effects_table(&cfg.prefix),
        history: Some(history.clone()),
    };
    let app = app(route, store);
    let stop_at = Instant::now() + Duration::from_millis(cfg.duration_ms);
    let mut tasks = Vec::new();
    for task in 0..cfg.tasks {
        let (app, history) = (app.clone(), history.clone());
        let mut rng = Rng::new(cfg.seed ^ (u64::from(std::process::id()) << 20) ^ u64::from(task));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < stop_at {
                let n = mono_ns() / 1_000_000 / STEP_MS + rng.below(WINDOW);
                let key = format!("k{n}");
                let at = Event { task, key: u32::try_from(n).ok(), id: Some(key.clone()), ..Event::now("idem_send") };
                history.log(&at);
                let res = send(&app, &key).await;
                history.log(&Event { task, key: at.key, id: Some(key), res: Some(res), ..Event::now("idem_answer") });
                sleep(Duration::from_millis(1 + rng.below(3))).await;
            }
        }));
    }
    crate::worker::join_tasks(tasks).await?;
    Ok(())
}

/// What the workers sent and were answered.
#[derive(Debug, Default)]
struct Sent {
    /// Every key sent, in the order first sent.
    keys: Vec<String>,
    /// Answers "201, not replayed", per key.
    fresh: HashMap<String, u64>,
    answered: u64,
    /// Answers by outcome.
    outcomes: HashMap<String, u64>,
    /// Requests sent and never answered (their worker was killed).
    cut: u64,
    /// Runs of the route that wrote their effect (committed or not).
    runs: u64,
}

impl Sent {
    fn of(events: &[Event]) -> Sent {
        let mut s = Sent::default();
        let mut seen = HashSet::new();
        let mut open: HashMap<(u32, u32), ()> = HashMap::new();
        for e in events {
            let Some(key) = &e.id else { continue };
            match e.op.as_str() {
                "effect_run" => s.runs += 1,
                "idem_send" => {
                    if seen.insert(key.clone()) {
                        s.keys.push(key.clone());
                    }
                    open.insert((e.pid, e.task), ());
                }
                "idem_answer" => {
                    open.remove(&(e.pid, e.task));
                    s.answered += 1;
                    let res = e.res.clone().unwrap_or_default();
                    if res == "fresh" {
                        *s.fresh.entry(key.clone()).or_default() += 1;
                    }
                    *s.outcomes.entry(res).or_default() += 1;
                }
                _ => {}
            }
        }
        s.cut = open.len() as u64;
        s
    }
}

/// The two tables, read at one moment: effect rows per key, and the keys
/// with a completed record.
#[derive(Debug, Default)]
struct Tables {
    effects: HashMap<String, i64>,
    completed: HashSet<String>,
}

impl Tables {
    async fn read(pool: &PgPool, effects: &str) -> Result<Tables, String> {
        // One snapshot for both, so that they are compared at one moment.
        let mut tx = pool.begin().await.map_err(|e| format!("reading the tables: {e}"))?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("reading the tables: {e}"))?;
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!("SELECT key, count(*) FROM {effects} GROUP BY key"))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| format!("reading the effects: {e}"))?;
        let done: Vec<String> =
            sqlx::query_scalar("SELECT key FROM torture_idem_keys WHERE owner IS NULL AND response IS NOT NULL")
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| format!("reading the idempotency records: {e}"))?;
        Ok(Tables { effects: rows.into_iter().collect(), completed: done.into_iter().collect() })
    }
}

/// The recovery pass's outcome.
#[derive(Debug, Default)]
struct Recovered {
    /// Keys the pass ran (answered "201, not replayed").
    ran: HashMap<String, u64>,
    /// Keys that never answered `201` within [`RECOVERY`], with the last answer.
    stuck: Vec<(String, String)>,
    requests: u64,
}

/// Sends every key again until it answers `201`, 16 at a time.
async fn recover(app: &Router, keys: &[String]) -> Recovered {
    let mut got = Recovered::default();
    for chunk in keys.chunks(RECOVERY_AT_ONCE) {
        let tries = chunk.iter().map(|key| async move {
            let deadline = Instant::now() + RECOVERY;
            let mut sent = 0;
            loop {
                sent += 1;
                let res = send(app, key).await;
                if res == "fresh" || res == "replayed" || Instant::now() >= deadline {
                    return (key.clone(), res, sent);
                }
                sleep(Duration::from_millis(20)).await;
            }
        });
        for (key, res, sent) in futures_util::future::join_all(tries).await {
            got.requests += sent;
            match res.as_str() {
                "fresh" => *got.ran.entry(key).or_default() += 1,
                "replayed" => {}
                _ => got.stuck.push((key, res)),
            }
        }
    }
    got
}

/// Files the checks into `r`.
fn judge(r: &mut Report, sent: &Sent, before: &Tables, recovered: &Recovered, after: &Tables) {
    // Atomicity, before the recovery: effects and records committed together.
    // Row by row: a key's effect rows beyond its one completed record (all
    // of them without a record) have none, and a record without an effect
    // row has none either.
    let mut no_record: Vec<&String> = Vec::new();
    for (key, n) in &before.effects {
        let recorded = i64::from(before.completed.contains(key));
        no_record.extend(std::iter::repeat_n(key, usize::try_from(n - recorded).unwrap_or(0)));
    }
    no_record.sort();
    let no_effect: Vec<&String> = before.completed.iter().filter(|k| !before.effects.contains_key(*k)).collect();
    r.torn = Some((no_record.len() + no_effect.len()) as u64);
    // Exactly once, after it.
    let (mut twice, mut never, mut unrecorded, mut fresh_twice) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for key in &sent.keys {
        match after.effects.get(key).copied().unwrap_or(0) {
            1 => {}
            0 => never.push(key),
            _ => twice.push(key),
        }
        if !after.completed.contains(key) {
            unrecorded.push(key);
        }
        let fresh = sent.fresh.get(key).copied().unwrap_or(0) + recovered.ran.get(key).copied().unwrap_or(0);
        if fresh > 1 {
            fresh_twice.push(key);
        }
    }
    let effects: i64 = after.effects.values().sum();
    // Runs that wrote their effect and were killed before their commit:
    // rolled back (no effect kept), or, in the twin, torn (kept, no record).
    let kept = u64::try_from(before.effects.values().sum::<i64>()).unwrap_or(0);
    let rolled_back = sent.runs.saturating_sub(kept);
    let mid_transaction = rolled_back + no_record.len() as u64;
    r.overlaps = twice.len() as u64;
    r.lost_updates = (twice.len() + never.len()) as u64;
    let mut outcomes: Vec<String> = sent.outcomes.iter().map(|(k, n)| format!("{k} {n}")).collect();
    outcomes.sort();
    r.note(format!(
        "kills {}, keys {}, effect rows {effects}; answers: {}; requests cut by a kill {}; recovery: {} request(s), \
         {} key(s) run by it",
        r.faults,
        sent.keys.len(),
        outcomes.join(", "),
        sent.cut,
        recovered.requests,
        recovered.ran.len()
    ));
    r.note(format!(
        "runs that wrote their effect {}, rolled back by a kill before their commit {rolled_back}",
        sent.runs
    ));
    r.note(format!(
        "before the recovery: {} effect row(s) without a record, {} record(s) without an effect row (torn); after it: {} key(s) \
         run twice, {} never run, {} without a completed record, {} answered `201` fresh twice, {} stuck",
        no_record.len(),
        no_effect.len(),
        twice.len(),
        never.len(),
        unrecorded.len(),
        fresh_twice.len(),
        recovered.stuck.len()
    ));
    let first = |keys: &[&String]| keys.iter().take(3).map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
    if r.expected_safe {
        if !no_record.is_empty() || !no_effect.is_empty() {
            r.fail(format!(
                "effect and record torn apart: no record for {}, no effect for {}",
                first(&no_record),
                first(&no_effect)
            ));
        }
        if !twice.is_empty() {
            r.fail(format!("run twice: {}", first(&twice)));
        }
        if !fresh_twice.is_empty() {
            r.fail(format!("answered `201` not replayed twice: {}", first(&fresh_twice)));
        }
    }
    // Whatever the route: every key must end with an effect and a record,
    // or the recovery (or the harness) did not do its work.
    if !never.is_empty() || !unrecorded.is_empty() {
        r.fail(format!("after the recovery, no effect for {}, no record for {}", first(&never), first(&unrecorded)));
    }
    if let Some((key, res)) = recovered.stuck.first() {
        r.fail(format!("{} key(s) never answered 201 in the recovery, first {key}: {res}", recovered.stuck.len()));
    }
    // A kill that cut no request, or a run where no key was left for the
    // recovery to run, tested nothing of what a kill does.
    if sent.cut == 0 || mid_transaction == 0 {
        r.fail(format!(
            "no fault injected: {} request(s) cut by a kill, {mid_transaction} of them between an effect and its commit",
            sent.cut
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(effects: &[(&str, i64)], completed: &[&str]) -> Tables {
        Tables {
            effects: effects.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect(),
            completed: completed.iter().map(|k| (*k).to_owned()).collect(),
        }
    }

    fn sent(keys: &[&str], fresh: &[&str]) -> Sent {
        // Two runs wrote an effect, one was kept: the other was killed mid-transaction.
        let mut s = Sent { keys: keys.iter().map(|k| (*k).to_owned()).collect(), cut: 1, runs: 2, ..Sent::default() };
        for k in fresh {
            *s.fresh.entry((*k).to_owned()).or_default() += 1;
        }
        s
    }

    fn judged(s: &Sent, before: &Tables, ran: &[&str], after: &Tables) -> Report {
        let mut r = Report::new("pg-idempotency", "x", 0);
        r.expected_safe = true;
        let recovered = Recovered { ran: ran.iter().map(|k| ((*k).to_owned(), 1)).collect(), ..Recovered::default() };
        judge(&mut r, s, before, &recovered, after);
        r
    }

    /// A clean run passes; a torn pair, a second effect, a second fresh
    /// answer, a key left without effect, and a run no kill cut each fail.
    #[test]
    fn each_check_of_pg_idempotency_can_fail() {
        let s = sent(&["a", "b"], &["a"]);
        let before = tables(&[("a", 1)], &["a"]);
        let after = tables(&[("a", 1), ("b", 1)], &["a", "b"]);
        let r = judged(&s, &before, &["b"], &after);
        assert!(r.pass && r.torn == Some(0), "{}", r.notes);

        let torn = tables(&[("a", 1), ("b", 1)], &["a"]);
        let r = judged(&s, &torn, &[], &after);
        assert!(!r.pass && r.torn == Some(1), "{}", r.notes);
        // A second effect row beside a key's record has no record of its own.
        let r = judged(&s, &tables(&[("a", 2)], &["a"]), &["b"], &after);
        assert!(!r.pass && r.torn == Some(1), "{}", r.notes);
        let r = judged(&s, &tables(&[("a", 1)], &["a", "b"]), &["b"], &after);
        assert!(!r.pass && r.torn == Some(1), "{}", r.notes);

        let r = judged(&s, &before, &["b"], &tables(&[("a", 1), ("b", 2)], &["a", "b"]));
        assert!(!r.pass && r.overlaps == 1, "{}", r.notes);

        let r = judged(&sent(&["a", "b"], &["a", "a"]), &before, &["b"], &after);
        assert!(!r.pass && r.notes.contains("not replayed twice"), "{}", r.notes);

        let r = judged(&s, &before, &[], &tables(&[("a", 1)], &["a"]));
        assert!(!r.pass && r.lost_updates == 1, "{}", r.notes);

        let mut uncut = sent(&["a", "b"], &["a"]);
        uncut.cut = 0;
        let r = judged(&uncut, &before, &["b"], &after);
        assert!(!r.pass && r.notes.contains("no fault injected"), "{}", r.notes);
    }
}
