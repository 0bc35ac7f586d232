//! `pg-fence` (issue 27 item 3): the real PostgreSQL as the protected
//! resource, written through `dlock_core::fence::postgres::Fences`.
//!
//! Workers take a Redis lock (watchdog lease 300 ms) on one of 4 keys and
//! then, in one transaction on a PostgreSQL of its own (not the lock
//! server), read the key's counter, sleep (the window a pause hits), write
//! counter + 1 and append an op row, and commit. Even keys are fenced: the
//! transaction's first statement is `Fences::check(tx, "counter:<k>",
//! token)`. Odd keys are the unfenced control: the same transaction
//! without the check. The harness stops (`SIGSTOP`) a holder for 1000 ms,
//! three kinds of episode in turn: a fenced holder before its check (the
//! resumed check must be refused, `StaleToken`), a fenced holder inside
//! its transaction after the check (the next holder's check waits for it:
//! the paused transaction is ordered first), and an unfenced holder inside
//! its transaction (the control: it must lose an update, or the pauses
//! broke nothing and the row fails).
//!
//! The checks, on the tables themselves: per fenced key, the counter
//! equals its committed op rows and no two committed ops read the same
//! value (no lost update); every commit a client saw acknowledged has its
//! op row; the unfenced keys lost at least one update. Refusals are counted
//! and must answer ≥ 0.9 × the before-the-check episodes.
//!
//! Its broken twin `broken-fence-check-outside-tx` (in `checker-self-test`)
//! runs the check on a connection of its own, in autocommit, before the
//! transaction: every token check passes, and a holder paused inside its
//! transaction overwrites the next holder's increment. The lost-update
//! check must fire on the fenced keys.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::fence::postgres::Fences;
use dlock_core::AcquireOptions;
use dlock_testing::{PostgresServer, RedisServer};
use rustix::process::Signal;
use sqlx::postgres::PgPool;
use tokio::time::{sleep, Instant};

use crate::harness::{Report, Run};
use crate::history::{Event, History};
use crate::rng::Rng;
use crate::scenario::{check_history, config_on, describe, join, spawn_workers, tasks_at, workers_started, Size};
use crate::worker::WorkerConfig;

/// The worker kind of the real row, and of its broken twin.
const KIND: &str = "pg-fence";
const KIND_OUTSIDE: &str = "pg-fence-check-outside-tx";
/// The stop, against the 300 ms lease.
const PAUSE: Duration = Duration::from_millis(1000);
const LEASE_MS: u64 = 300;
const KEYS: u32 = 4;

/// Whether key `k`'s writes are fenced (the odd keys are the control).
fn fenced(k: u32) -> bool {
    k.is_multiple_of(2)
}

/// The fence's resource name for key `k`.
fn resource(k: u32) -> String {
    format!("counter:{k}")
}

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("pg-fence", KIND, size, seed).await?])
}

/// The row of `kind` (the real fenced writes, or the broken twin) under
/// `scenario`'s name.
pub(crate) async fn row(scenario: &str, kind: &str, size: Size, seed: u64) -> Result<Report, String> {
    let broken = kind != KIND;
    let lock = RedisServer::start();
    let pg = tokio::task::spawn_blocking(PostgresServer::start).await.map_err(|e| format!("PostgreSQL: {e}"))?;
    let pool = crate::scenario::pg_pool(&pg.url(), 2).await?;
    let tables = Tables::new("torture");
    tables.create(&pool).await?;
    let mut run = Run::new(&format!("pg-fence-{kind}")).map_err(|e| e.to_string())?;
    // Three kinds of episode in turn, so each gets a third.
    let episodes = size.pick(6u64, 45);
    let mut cfg = config_on("redis", vec![lock.url()], pg.url(), seed);
    cfg.kind = kind.into();
    cfg.lease_ms = LEASE_MS;
    cfg.keys = KEYS;
    // The transaction's window between the read and the write, and (the
    // same range) the work before the transaction begins.
    (cfg.cs_min_ms, cfg.cs_max_ms) = (20, 60);
    cfg.duration_ms = episodes * 1600 + 2000;
    let procs = 3;
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(10)).await?;
    let mut rng = Rng::new(seed);
    let mut done = [0u64; 3];
    let mut missed = 0;
    for i in 0..episodes {
        let phase = Phase::ALL[(i % 3) as usize];
        let give_up = Instant::now() + Duration::from_secs(3);
        while Instant::now() < give_up {
            let found = tokio::task::block_in_place(|| tasks_at(&run, phase.last_op(), |k| phase.keys(k)))?;
            let Some(&pid) = found.get(usize::try_from(rng.below(found.len().max(1) as u64)).unwrap_or(0)) else {
                sleep(Duration::from_millis(3)).await;
                continue;
            };
            run.signal(pid, Signal::STOP, "stop");
            // The stopped process's history is frozen once the signal
            // lands: it must still be in the phase this episode is for.
            sleep(Duration::from_millis(5)).await;
            if !tokio::task::block_in_place(|| tasks_at(&run, phase.last_op(), |k| phase.keys(k)))?.contains(&pid) {
                run.signal(pid, Signal::CONT, "cont");
                missed += 1;
                continue;
            }
            sleep(PAUSE).await;
            run.signal(pid, Signal::CONT, "cont");
            done[i as usize % 3] += 1;
            break;
        }
        sleep(Duration::from_millis(400)).await;
    }
    let mut r = Report::new(
        scenario,
        if broken { "broken-fence-check-outside-tx" } else { "redis lock, PostgreSQL fenced" },
        seed,
    );
    r.expected_safe = !broken;
    r.overlaps_informational = true;
    r.faults = done.iter().sum();
    r.fault_kind = format!("SIGSTOP holder {} ms > lease {LEASE_MS} ms", PAUSE.as_millis());
    describe(&mut r, procs, &cfg);
    join(&mut run, &mut r, Duration::from_secs(15));
    check_history(&run, &mut r)?;
    let events = run.events()?;
    let tally = Tally::of(&events);
    let state = tables.state(&pool).await?;
    judge(&mut r, &tally, &state, done, episodes);
    if missed > 0 {
        r.note(format!("{missed} stop(s) found the task past its phase once stopped; let go at once and not counted"));
    }
    // The twin's lost updates are its verdict in the self-test, not a
    // failure of the row.
    if !broken && !r.safety_ok() {
        r.fail("safety violated under a fault the fenced writes promise to survive");
    }
    Ok(r)
}

/// Where in its section a stop lands.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// A fenced holder granted, its transaction not begun: its check comes
    /// after the pause and must be refused.
    BeforeCheck,
    /// A fenced holder inside its transaction, between read and write: the
    /// fence's row is locked by it, the next holder's check waits.
    InFencedTx,
    /// An unfenced holder between read and write: the control's lost update.
    InUnfencedTx,
}

impl Phase {
    const ALL: [Phase; 3] = [Phase::BeforeCheck, Phase::InFencedTx, Phase::InUnfencedTx];

    /// The task's last logged event in this phase.
    fn last_op(self) -> &'static str {
        match self {
            Phase::BeforeCheck => "acq_ok",
            Phase::InFencedTx | Phase::InUnfencedTx => "read",
        }
    }

    fn keys(self, k: u32) -> bool {
        match self {
            Phase::BeforeCheck | Phase::InFencedTx => fenced(k),
            Phase::InUnfencedTx => !fenced(k),
        }
    }
}

/// The final state of one key's counter and op rows.
#[derive(Debug, Clone, Default)]
struct KeyState {
    key: u32,
    counter: i64,
    ops: i64,
    /// Committed ops that read a value another committed op of the key had
    /// read too (each such op beyond the first of its value).
    same_read: i64,
}

/// What the clients saw, from the history: per key, commits acknowledged
/// and commits whose outcome is unknown; refusals; checks that waited.
#[derive(Debug, Default)]
struct Tally {
    acked: std::collections::HashMap<u32, i64>,
    unknown: std::collections::HashMap<u32, i64>,
    refused: u64,
    /// Checks that waited ≥ half the pause (for a paused transaction).
    waited: u64,
}

impl Tally {
    fn of(events: &[Event]) -> Tally {
        let mut t = Tally::default();
        for e in events {
            let key = e.key.unwrap_or(0);
            match (e.op.as_str(), e.res.as_deref()) {
                ("write", Some("ok")) => *t.acked.entry(key).or_default() += 1,
                ("write", Some("error")) => *t.unknown.entry(key).or_default() += 1,
                ("write", Some("stale")) => t.refused += 1,
                ("checked", _) => {
                    let half = i64::try_from(PAUSE.as_micros() / 2).unwrap_or(i64::MAX);
                    t.waited += u64::from(e.val.is_some_and(|us| us >= half));
                }
                _ => {}
            }
        }
        t
    }
}

/// Files the checks into `r`: the fenced keys lose nothing and every
/// acknowledged commit is there; the control lost something; refusals
/// answer the before-the-check episodes.
fn judge(r: &mut Report, t: &Tally, state: &[KeyState], done: [u64; 3], planned: u64) {
    let (mut lost, mut unfenced_lost, mut missing, mut extra) = (0i64, 0i64, 0i64, 0i64);
    for s in state {
        // Increments that left no trace in the counter, or ops that read
        // what another had read: either is a lost update.
        let here = (s.ops - s.counter).max(s.same_read).max(0);
        let acked = t.acked.get(&s.key).copied().unwrap_or(0);
        let unknown = t.unknown.get(&s.key).copied().unwrap_or(0);
        if fenced(s.key) {
            lost += here;
        } else {
            unfenced_lost += here;
        }
        // Every acknowledged commit has its row; a row beyond those is
        // only allowed for a commit whose answer was lost.
        missing += (acked - s.ops).max(0);
        extra += (s.ops - acked - unknown).max(0);
    }
    r.lost_updates = u64::try_from(lost).unwrap_or(0);
    r.unfenced_lost = u64::try_from(unfenced_lost).unwrap_or(0);
    r.stale_writes_refused = t.refused;
    let per_key: Vec<String> = state
        .iter()
        .map(|s| {
            format!(
                "{}{}: counter {} / ops {}{}",
                if fenced(s.key) { "fenced " } else { "control " },
                s.key,
                s.counter,
                s.ops,
                if s.same_read > 0 { format!(" ({} read a value twice)", s.same_read) } else { String::new() }
            )
        })
        .collect();
    r.note(format!("PostgreSQL: {}", per_key.join(", ")));
    r.note(format!(
        "stops: {} before the check, {} inside a fenced transaction, {} inside an unfenced one ({planned} planned); \
         refused (StaleToken) {}, checks that waited for a paused transaction {}",
        done[0], done[1], done[2], t.refused, t.waited
    ));
    if lost > 0 && r.expected_safe {
        r.fail(format!("{lost} update(s) lost on the fenced counters"));
    }
    if missing > 0 {
        r.fail(format!("{missing} acknowledged commit(s) have no op row"));
    }
    if extra > 0 {
        r.fail(format!("{extra} op row(s) of commits no client saw acknowledged nor in doubt"));
    }
    if unfenced_lost == 0 {
        r.fail("no fault injected: the unfenced control lost no update, so the pauses broke nothing");
    }
    // refused ≥ 0.9 × the stops before a check, in integers.
    if t.refused * 10 < done[0] * 9 || done[0] == 0 {
        r.fail(format!("{} refusal(s) for {} stop(s) before a check (need ≥ 0.9 ×, and a stop)", t.refused, done[0]));
    }
}

/// The workload's tables, of one prefix: a counter per key, and a row per
/// committed op; the fences of `dlock_core::fence::postgres`.
#[derive(Debug, Clone)]
struct Tables {
    counters: String,
    ops: String,
    prefix: String,
}

impl Tables {
    fn new(prefix: &str) -> Tables {
        Tables { counters: format!("{prefix}_counters"), ops: format!("{prefix}_ops"), prefix: prefix.into() }
    }

    async fn create(&self, pool: &PgPool) -> Result<(), String> {
        let Tables { counters, ops, .. } = self;
        for sql in [
            format!("CREATE TABLE {counters} (key int PRIMARY KEY, value bigint NOT NULL)"),
            format!("INSERT INTO {counters} SELECT k, 0 FROM generate_series(0, {}) AS k", KEYS - 1),
            format!(
                "CREATE TABLE {ops} (op text NOT NULL, key int NOT NULL, read bigint NOT NULL, token bigint NOT NULL)"
            ),
        ] {
            sqlx::query(&sql).execute(pool).await.map_err(|e| format!("`{sql}`: {e}"))?;
        }
        fences(&self.prefix)?.create(pool).await.map_err(|e| e.to_string())
    }

    async fn state(&self, pool: &PgPool) -> Result<Vec<KeyState>, String> {
        let Tables { counters, ops, .. } = self;
        let sql = format!(
            "SELECT c.key, c.value, \
               (SELECT count(*) FROM {ops} o WHERE o.key = c.key), \
               (SELECT coalesce(sum(n - 1), 0)::bigint FROM \
                  (SELECT count(*) AS n FROM {ops} o WHERE o.key = c.key GROUP BY o.read) AS d) \
             FROM {counters} c ORDER BY c.key"
        );
        let rows: Vec<(i32, i64, i64, i64)> =
            sqlx::query_as(&sql).fetch_all(pool).await.map_err(|e| format!("reading the counters: {e}"))?;
        Ok(rows
            .into_iter()
            .map(|(key, counter, ops, same_read)| KeyState {
                key: u32::try_from(key).unwrap_or(u32::MAX),
                counter,
                ops,
                same_read,
            })
            .collect())
    }
}

fn fences(prefix: &str) -> Result<Fences, String> {
    Fences::new(prefix).map_err(|e| e.to_string())
}

/// The worker process of `pg-fence` (and of its twin): `cfg.tasks` tasks
/// contend for `cfg.keys` keys until `cfg.duration_ms` has passed.
pub(crate) async fn work(cfg: WorkerConfig) -> Result<(), String> {
    let history = Arc::new(History::open(&cfg.history).map_err(|e| format!("cannot open the history: {e}"))?);
    // A connection per task for its transaction, and one more each for the
    // twin's check outside it.
    let pool = crate::scenario::pg_pool(&cfg.resource, cfg.tasks * 2 + 1).await?;
    let locker = Arc::new(crate::worker::locker(&cfg).await?);
    let w = Arc::new(Writer {
        tables: Tables::new(&cfg.prefix),
        fences: fences(&cfg.prefix)?,
        outside: cfg.kind == KIND_OUTSIDE,
        pool,
        history,
    });
    let cfg = Arc::new(cfg);
    let stop_at = Instant::now() + Duration::from_millis(cfg.duration_ms);
    let mut tasks = Vec::new();
    for task in 0..cfg.tasks {
        let (cfg, w, locker) = (cfg.clone(), w.clone(), locker.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(cfg.seed ^ (u64::from(std::process::id()) << 20) ^ u64::from(task));
            let mut seq = 0u64;
            while Instant::now() < stop_at {
                seq += 1;
                one_op(&cfg, &w, &locker, task, seq, &mut rng).await;
            }
        }));
    }
    crate::worker::join_tasks(tasks).await?;
    Ok(())
}

/// What a task writes with.
struct Writer {
    tables: Tables,
    fences: Fences,
    /// The broken twin: the check on its own connection, before the transaction.
    outside: bool,
    pool: PgPool,
    history: Arc<History>,
}

fn ev(op: &str, task: u32, key: u32) -> Event {
    Event { task, key: Some(key), ..Event::now(op) }
}

async fn one_op(cfg: &WorkerConfig, w: &Writer, locker: &dlock_core::Locker, task: u32, seq: u64, rng: &mut Rng) {
    let key = u32::try_from(rng.below(u64::from(cfg.keys))).unwrap_or(0);
    let op = format!("{}-{task}-{seq}", std::process::id());
    w.history.log(&Event { owner: Some(op.clone()), ..ev("acq_invoke", task, key) });
    let lock_key = match locker.key("torture").part(key).build() {
        Ok(k) => k,
        Err(e) => {
            w.history.log(&Event { res: Some(format!("invalid_key: {e}")), ..ev("acq_fail", task, key) });
            return;
        }
    };
    let guard =
        match locker.acquire(&lock_key, AcquireOptions::new().with_wait(Duration::from_millis(cfg.wait_ms))).await {
            Ok(g) => g,
            Err(e) => {
                let res = if e.is_contention() { "timeout".to_owned() } else { format!("backend: {e}") };
                w.history.log(&Event { res: Some(res), ..ev("acq_fail", task, key) });
                // A dead server answers at once; do not spin on it.
                sleep(Duration::from_millis(5 + rng.below(20))).await;
                return;
            }
        };
    let token = guard.fencing_token();
    let owner = guard.owner().as_str().to_owned();
    w.history.log(&Event { token: Some(token), owner: Some(owner.clone()), ..ev("acq_ok", task, key) });
    let span = cfg.cs_max_ms.saturating_sub(cfg.cs_min_ms) + 1;
    let before = Duration::from_millis(cfg.cs_min_ms + rng.below(span));
    let window = Duration::from_millis(cfg.cs_min_ms + rng.below(span));
    let section = async {
        // The work before the write: a pause here delays the check.
        sleep(before).await;
        w.section(task, key, token, &op, window).await;
    };
    tokio::pin!(section);
    // The section runs to its end after a loss, as an application that
    // ignores the signal: the storage's fence must refuse it.
    let mut lost_seen = false;
    loop {
        tokio::select! {
            () = &mut section => break,
            _ = guard.lost(), if !lost_seen => {
                lost_seen = true;
                let vu = crate::history::instant_to_ns(guard.valid_until());
                w.history.log(&Event { token: Some(token), owner: Some(owner.clone()), vu: Some(vu), ..ev("lost", task, key) });
            }
        }
    }
    w.history.log(&Event { token: Some(token), owner: Some(owner.clone()), ..ev("rel_invoke", task, key) });
    match guard.release().await {
        Ok(held) => w
            .history
            .log(&Event { res: Some(if held { "freed" } else { "not_held" }.into()), ..ev("rel_ok", task, key) }),
        Err(e) => w.history.log(&Event { res: Some(e.to_string()), ..ev("rel_err", task, key) }),
    }
}

impl Writer {
    /// One transaction: the check (fenced keys), the read, the window, the
    /// write and the op row, the commit. Each outcome is logged as the
    /// `write` event: `ok` (committed), `stale` (refused by the fence),
    /// `error` (the commit's outcome unknown, or nothing written).
    async fn section(&self, task: u32, key: u32, token: u64, op: &str, window: Duration) {
        let reg = if fenced(key) { "pf" } else { "pu" };
        let log = |res: &str, val: Option<i64>| {
            self.history.log(&Event {
                token: Some(token),
                reg: Some(reg.into()),
                res: Some(res.into()),
                val,
                id: Some(op.to_owned()),
                ..ev("write", task, key)
            });
        };
        self.history.log(&Event { token: Some(token), ..ev("cs_enter", task, key) });
        let written = self.transaction(task, key, token, op, window).await;
        match written {
            Ok(v) => log("ok", Some(v)),
            Err(Outcome::Stale) => log("stale", None),
            Err(Outcome::Failed(e)) => {
                eprintln!("dlock-torture worker: pg-fence key {key}: {e}");
                log("error", None);
            }
        }
        self.history.log(&Event { token: Some(token), ..ev("cs_exit", task, key) });
    }

    async fn transaction(&self, task: u32, key: u32, token: u64, op: &str, window: Duration) -> Result<i64, Outcome> {
        let Tables { counters, ops, .. } = &self.tables;
        let mut tx = self.pool.begin().await.map_err(Outcome::failed)?;
        if fenced(key) {
            let asked = Instant::now();
            let checked = if self.outside {
                // The twin's bug: the check commits on its own, and the
                // transaction below is not ordered by the fence's row lock.
                match self.pool.acquire().await {
                    Ok(mut conn) => self.fences.check(&mut conn, &resource(key), token).await,
                    Err(e) => return Err(Outcome::failed(e)),
                }
            } else {
                self.fences.check(&mut tx, &resource(key), token).await
            };
            match checked {
                Ok(()) => {}
                // Dropping the transaction rolls it back.
                Err(dlock_core::Error::StaleToken { .. }) => return Err(Outcome::Stale),
                Err(e) => return Err(Outcome::Failed(e.to_string())),
            }
            let waited = i64::try_from(asked.elapsed().as_micros()).unwrap_or(i64::MAX);
            self.history.log(&Event { token: Some(token), val: Some(waited), ..ev("checked", task, key) });
        }
        let read: i64 = sqlx::query_scalar(&format!("SELECT value FROM {counters} WHERE key = $1"))
            .bind(i32::try_from(key).unwrap_or(i32::MAX))
            .fetch_one(&mut *tx)
            .await
            .map_err(Outcome::failed)?;
        let reg = if fenced(key) { "pf" } else { "pu" };
        self.history.log(&Event {
            token: Some(token),
            reg: Some(reg.into()),
            val: Some(read),
            ..ev("read", task, key)
        });
        sleep(window).await;
        self.history.log(&Event { token: Some(token), reg: Some(reg.into()), ..ev("w_invoke", task, key) });
        sqlx::query(&format!("UPDATE {counters} SET value = $2 WHERE key = $1"))
            .bind(i32::try_from(key).unwrap_or(i32::MAX))
            .bind(read + 1)
            .execute(&mut *tx)
            .await
            .map_err(Outcome::failed)?;
        sqlx::query(&format!("INSERT INTO {ops} (op, key, read, token) VALUES ($1, $2, $3, $4)"))
            .bind(op)
            .bind(i32::try_from(key).unwrap_or(i32::MAX))
            .bind(read)
            .bind(i64::try_from(token).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await
            .map_err(Outcome::failed)?;
        tx.commit().await.map_err(Outcome::failed)?;
        Ok(read + 1)
    }
}

/// A transaction that did not commit as far as its client knows.
enum Outcome {
    /// The fence refused the token.
    Stale,
    /// A statement or the commit failed (the commit's outcome unknown).
    Failed(String),
}

impl Outcome {
    fn failed(e: impl std::fmt::Display) -> Outcome {
        Outcome::Failed(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(key: u32, counter: i64, ops: i64, same_read: i64) -> KeyState {
        KeyState { key, counter, ops, same_read }
    }

    fn tally(acked: &[(u32, i64)], refused: u64) -> Tally {
        Tally { acked: acked.iter().copied().collect(), refused, ..Tally::default() }
    }

    fn judged(t: &Tally, s: &[KeyState]) -> Report {
        let mut r = Report::new("pg-fence", "x", 0);
        r.expected_safe = true;
        judge(&mut r, t, s, [2, 2, 2], 6);
        r
    }

    /// The row passes when the fenced keys lose nothing and the control
    /// does; each of its checks fails it on its own.
    #[test]
    fn each_check_of_pg_fence_can_fail() {
        let good = [state(0, 10, 10, 0), state(1, 8, 10, 2)];
        let acks = [(0, 10), (1, 10)];
        assert!(judged(&tally(&acks, 2), &good).pass);
        let r = judged(&tally(&acks, 2), &[state(0, 9, 10, 1), state(1, 8, 10, 2)]);
        assert!(!r.pass && r.lost_updates == 1, "{}", r.notes);
        // The counter right, but two ops read the same value.
        let r = judged(&tally(&acks, 2), &[state(0, 10, 10, 1), state(1, 8, 10, 2)]);
        assert!(!r.pass && r.lost_updates == 1, "{}", r.notes);
        let r = judged(&tally(&acks, 2), &[state(0, 10, 10, 0), state(1, 10, 10, 0)]);
        assert!(!r.pass && r.notes.contains("no fault injected"), "{}", r.notes);
        let r = judged(&tally(&[(0, 11), (1, 10)], 2), &good);
        assert!(!r.pass && r.notes.contains("no op row"), "{}", r.notes);
        let r = judged(&tally(&[(0, 9), (1, 10)], 2), &good);
        assert!(!r.pass && r.notes.contains("nor in doubt"), "{}", r.notes);
        let r = judged(&tally(&acks, 1), &good);
        assert!(!r.pass && r.notes.contains("refusal"), "{}", r.notes);
    }
}
