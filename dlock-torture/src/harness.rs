//! The supervisor's side of a run: worker processes (this binary re-executed
//! with the hidden `worker` subcommand), their histories, the nemesis's own
//! log, and the scenario report.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::checker::{self, Findings, KeyState};
use crate::history::{self, mono_ns, Event, History};
use crate::resource::{Resource, SetReg};
use crate::worker::WorkerConfig;

/// One scenario's row in the table and object in `--json`.
#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct Report {
    pub(crate) scenario: String,
    pub(crate) backend: String,
    /// Whether the backend promises safety under this fault.
    pub(crate) expected_safe: bool,
    /// Whether the backend promises growing fencing tokens under this
    /// fault (C4 = 0), also where it does not promise mutual exclusion: a
    /// restart without persistence loses the locks but not the token order
    /// (tokens fall back to the server clock). Not promised only where
    /// RedLock masters lose their data, and for the broken variants.
    pub(crate) tokens_promised: bool,
    /// Overlaps are expected (pauses, expiry): the fencing must catch them.
    pub(crate) overlaps_informational: bool,
    pub(crate) seed: u64,
    pub(crate) processes: u32,
    pub(crate) tasks: u32,
    pub(crate) keys: u32,
    pub(crate) lease_ms: u64,
    pub(crate) operations: u64,
    pub(crate) acq_failures: u64,
    pub(crate) faults: u64,
    pub(crate) fault_kind: String,
    pub(crate) overlaps: u64,
    pub(crate) lost_updates: u64,
    pub(crate) indeterminate: u64,
    pub(crate) stale_writes_refused: u64,
    pub(crate) stale_accepted: u64,
    pub(crate) token_regressions: u64,
    pub(crate) unfenced_lost: u64,
    /// C3: acknowledged op ids missing from the final fenced set.
    pub(crate) set_missing: u64,
    /// C3 on the unfenced set control (lost under a broken lock or a fault).
    pub(crate) unfenced_set_missing: u64,
    /// Op ids acknowledged on the fenced set (what C3 checked).
    pub(crate) set_acked: u64,
    pub(crate) lost_signals: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stale_holds_signalled: Option<String>,
    /// The same as numbers: holds refused by fencing, and how many of them
    /// had seen their lost signal by their first refused access.
    pub(crate) stale_holds: u64,
    pub(crate) stale_holds_seen_lost: u64,
    pub(crate) p50_wait_ms: f64,
    pub(crate) p99_wait_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) recovery_max_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) residual_keys: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) refreshed_keys: Option<u64>,
    /// For `checker-self-test` rows: whether the checker caught the bug.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) caught: Option<bool>,
    /// Grants returned with their validity already over (R3, T5e).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) expired_on_return: Option<u64>,
    /// T6a: episodes where the key expired on the server and the holder's
    /// lost signal never fired, and renewals that gave a key taken by
    /// another owner back to the old holder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) silent_losses: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) resurrections: Option<u64>,
    /// T6a: lease end → lost signal, ms (negative: signalled before the
    /// key was free).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lost_latency_p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lost_latency_p99_ms: Option<f64>,
    /// `pg-idempotency`: effects committed without their idempotency
    /// record, and records committed without their effect, before the
    /// recovery pass (the route's writes and its answer torn apart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) torn: Option<u64>,
    /// `primitives` `rw` rows: readers granted past a writer waiting behind
    /// readers, and readers kept out over the bound after a writer that
    /// waited gave up (`crate::preference`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) readers_passed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) readers_kept_out: Option<u64>,
    pub(crate) notes: String,
    /// The row's timeline picture (`--timelines`), when one was drawn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) timeline: Option<String>,
    /// Whether the row passes its own assertions.
    pub(crate) pass: bool,
}

impl Report {
    pub(crate) fn new(scenario: &str, backend: &str, seed: u64) -> Self {
        Report {
            scenario: scenario.into(),
            backend: backend.into(),
            seed,
            pass: true,
            tokens_promised: true,
            ..Report::default()
        }
    }

    /// Copies a history's findings in.
    pub(crate) fn absorb(&mut self, f: &Findings) {
        self.operations += f.acquisitions;
        self.acq_failures += f.acq_failures;
        self.overlaps += f.overlaps;
        self.lost_updates += f.lost_updates;
        self.indeterminate += f.indeterminate;
        self.stale_writes_refused += f.stale_refused;
        self.stale_accepted += f.stale_accepted;
        self.token_regressions += f.token_regressions;
        self.unfenced_lost += f.unfenced_lost;
        self.lost_signals += f.lost_signals;
        self.set_acked += f.set_acked;
        self.set_missing += f.set_missing.len() as u64;
        self.unfenced_set_missing += f.unfenced_set_missing.len() as u64;
        if !f.set_missing.is_empty() {
            self.note(format!(
                "C3: {} of {} acknowledged op ids missing from the fenced set, first {}",
                f.set_missing.len(),
                f.set_acked,
                first_ids(&f.set_missing)
            ));
        }
        if !f.unfenced_set_missing.is_empty() {
            self.note(format!(
                "C3 control: {} of {} acknowledged op ids missing from the unfenced set, first {}",
                f.unfenced_set_missing.len(),
                f.unfenced_set_acked,
                first_ids(&f.unfenced_set_missing)
            ));
        }
        if let Some(example) = &f.token_regression_example {
            self.note(format!(
                "C4: {} grant(s) with a token not above an earlier grant's; first: {example}",
                f.token_regressions
            ));
        }
        self.stale_holds += f.stale_holds;
        self.stale_holds_seen_lost += f.stale_holds_signalled;
        if f.stale_holds > 0 {
            self.stale_holds_signalled = Some(format!("{}/{}", f.stale_holds_signalled, f.stale_holds));
        }
        self.p50_wait_ms = f.wait_percentile_ms(0.5);
        self.p99_wait_ms = f.wait_percentile_ms(0.99);
        if !f.recoveries_ns.is_empty() {
            self.recovery_max_ms = Some(checker::percentile_ms(&f.recoveries_ns, 1.0));
        }
        if f.validity_logged > 0 {
            self.expired_on_return = Some(self.expired_on_return.unwrap_or(0) + f.expired_on_return);
        }
    }

    /// The harness's verdict: a row where tokens are promised must hand out
    /// no token regression (C4), whether or not it promises mutual
    /// exclusion; an expected-safe row must also lose nothing on the fenced
    /// counter or the fenced set, accept no stale write, and (unless
    /// overlaps are expected under its fault) show no overlap.
    pub(crate) fn safety_ok(&self) -> bool {
        let tokens_ok = !self.tokens_promised || self.token_regressions == 0;
        if !self.expected_safe {
            return tokens_ok;
        }
        tokens_ok
            && self.lost_updates == 0
            && self.set_missing == 0
            && self.stale_accepted == 0
            && (self.overlaps_informational || self.overlaps == 0)
    }

    pub(crate) fn fail(&mut self, why: impl AsRef<str>) {
        self.pass = false;
        if !self.notes.is_empty() {
            self.notes.push_str("; ");
        }
        self.notes.push_str("FAIL: ");
        self.notes.push_str(why.as_ref());
    }

    pub(crate) fn note(&mut self, what: impl AsRef<str>) {
        if !self.notes.is_empty() {
            self.notes.push_str("; ");
        }
        self.notes.push_str(what.as_ref());
    }
}

/// The first few of a list of op ids, for a note.
fn first_ids(ids: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut s = ids.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
    if ids.len() > SHOWN {
        s.push_str(", …");
    }
    s
}

/// How many op ids each key's set registers take in a run (C3). Every
/// section on a key reads and rewrites the whole set, so the traffic grows
/// with the square of the ids it takes; the cap keeps a long run's sets
/// under ~40 kB and the short run's (debug build, CI) under ~6 kB, while
/// still covering the first few hundred sections of every key, where every
/// scenario's faults begin.
const SET_CAP_SHORT: u32 = 300;
const SET_CAP_LONG: u32 = 2000;

static SET_CAP: AtomicU32 = AtomicU32::new(SET_CAP_LONG);

/// Chooses the set registers' cap for the run's size (`--short`).
pub(crate) fn size_set_registers(short: bool) {
    SET_CAP.store(if short { SET_CAP_SHORT } else { SET_CAP_LONG }, Ordering::Relaxed);
}

/// How the workers of a run ended ([`Run::join`]).
#[derive(Debug, Default)]
pub(crate) struct Joined {
    /// Still running past their end and grace: killed.
    pub(crate) hung: u32,
    /// Exited with a failure: what each said.
    pub(crate) failed: Vec<String>,
}

/// A run's processes and files.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) dir: PathBuf,
    histories: Vec<PathBuf>,
    children: Vec<Child>,
    pub(crate) nemesis: History,
    next: u32,
    /// When the last worker is due to stop on its own.
    planned_end: std::time::Instant,
}

impl Run {
    pub(crate) fn new(name: &str) -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!("dlock-torture-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let nemesis_path = dir.join("nemesis.jsonl");
        let nemesis = History::open(&nemesis_path)?;
        Ok(Run {
            dir,
            histories: vec![nemesis_path],
            children: Vec::new(),
            nemesis,
            next: 0,
            planned_end: std::time::Instant::now(),
        })
    }

    /// Starts a worker process; returns its pid.
    pub(crate) fn spawn(&mut self, mut cfg: WorkerConfig) -> std::io::Result<u32> {
        self.next += 1;
        self.planned_end = self.planned_end.max(std::time::Instant::now() + Duration::from_millis(cfg.duration_ms));
        cfg.history = self.dir.join(format!("worker-{}.jsonl", self.next));
        cfg.seed ^= u64::from(self.next) << 40;
        cfg.set_cap = SET_CAP.load(Ordering::Relaxed);
        // The file exists before the worker does: a history that cannot be
        // read later is then an error, not a worker that had not started.
        std::fs::OpenOptions::new().create(true).append(true).open(&cfg.history)?;
        self.histories.push(cfg.history.clone());
        let json = serde_json::to_string(&cfg).map_err(std::io::Error::other)?;
        let exe = std::env::current_exe()?;
        let child = Command::new(exe)
            .arg("worker")
            .arg(json)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    pub(crate) fn log(&self, op: &str, target: Option<u32>) {
        self.nemesis.log(&Event { target, ..Event::now(op) });
    }

    /// SIGKILLs a worker and logs it once it is dead. Logged before the
    /// signal, the victim could still log a grant after the `kill` event (it
    /// ran between the two), a hold the checker would then see open until
    /// the end of the run and count as overlapping every later grant of its
    /// key; logged after the reaping, every event of the victim precedes it.
    pub(crate) fn kill(&mut self, pid: u32) {
        if let Some(i) = self.children.iter().position(|c| c.id() == pid) {
            let mut child = self.children.swap_remove(i);
            let _ = child.kill();
            let _ = child.wait();
            // Reaped: no longer a worker to pick as a holder or to join.
        }
        self.log("kill", Some(pid));
    }

    pub(crate) fn signal(&self, pid: u32, sig: rustix::process::Signal, op: &str) {
        self.log(op, Some(pid));
        if let Some(p) = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap_or(0))
            && let Err(e) = rustix::process::kill_process(p, sig)
        {
            eprintln!("dlock-torture: cannot signal {pid}: {e}");
        }
    }

    /// The pids of the workers still running (not killed on purpose).
    pub(crate) fn live(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// Every event of the run so far; an unreadable history is an error.
    pub(crate) fn events(&self) -> Result<Vec<Event>, String> {
        history::read_all(&self.histories)
    }

    /// Pids of workers that hold a lock right now, by the history's tail;
    /// with `before_write`, only holds whose fenced write is still ahead of
    /// them (a pause there makes the resumed holder write with its old token).
    pub(crate) fn holders(&self, among: Option<&[u32]>, before_write: bool) -> Result<Vec<u32>, String> {
        self.holders_since(among, before_write, 0)
    }

    /// [`holders`](Self::holders) whose hold was granted at or after
    /// `since` (the histories' monotonic clock, ns).
    pub(crate) fn holders_since(
        &self,
        among: Option<&[u32]>,
        before_write: bool,
        since: u64,
    ) -> Result<Vec<u32>, String> {
        let mut open: HashMap<(u32, u32), u64> = HashMap::new();
        for e in self.events()? {
            match e.op.as_str() {
                "acq_ok" => {
                    open.insert((e.pid, e.task), e.t);
                }
                "w_invoke" | "write" if before_write && e.reg.as_deref() == Some("f") => {
                    open.remove(&(e.pid, e.task));
                }
                "rel_invoke" => {
                    open.remove(&(e.pid, e.task));
                }
                _ => {}
            }
        }
        let live = self.live();
        let mut pids: Vec<u32> = open
            .iter()
            .filter(|(_, granted)| **granted >= since)
            .map(|((pid, _), _)| *pid)
            .filter(|p| live.contains(p) && among.is_none_or(|a| a.contains(p)))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// Waits for every worker to exit (they stop on their own after their
    /// duration); kills any still running `grace` after the last one was due
    /// to stop. A worker that cannot finish is a hang (a deadlock or an
    /// acquire that ignores its deadline); one that exits with a failure
    /// (it could not connect, a task panicked, a signal nobody sent on
    /// purpose) is a lost worker: its share of the work was never done, and
    /// the row must not pass on what the others did. Workers the nemesis
    /// killed on purpose ([`Run::kill`]) are not joined.
    pub(crate) fn join(&mut self, grace: Duration) -> Joined {
        let deadline = self.planned_end.max(std::time::Instant::now()) + grace;
        let mut joined = Joined::default();
        for child in &mut self.children {
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() {
                            joined.failed.push(format!("worker {} exited with {status}", child.id()));
                        }
                        break;
                    }
                    Err(e) => {
                        joined.failed.push(format!("worker {} could not be waited for: {e}", child.id()));
                        break;
                    }
                    Ok(None) if std::time::Instant::now() >= deadline => {
                        eprintln!("dlock-torture: worker {} did not stop in time; killing it", child.id());
                        joined.hung += 1;
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        joined
    }

    /// Checks the history against the resource.
    pub(crate) async fn check(&self, resource: &Resource, keys: u32) -> Result<Findings, String> {
        let mut finals = HashMap::new();
        for k in 0..keys {
            let (fenced, unfenced) = resource.snapshot(k).await.map_err(|e| format!("resource snapshot: {e}"))?;
            let set = resource.set_snapshot(SetReg::Fenced, k).await.map_err(|e| format!("resource snapshot: {e}"))?;
            let unfenced_set =
                resource.set_snapshot(SetReg::Unfenced, k).await.map_err(|e| format!("resource snapshot: {e}"))?;
            finals.insert(k, KeyState { fenced, unfenced, set, unfenced_set });
        }
        Ok(checker::check(&self.events()?, &finals, mono_ns()))
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::env::var_os("DLOCK_TORTURE_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// C4 fails a row wherever tokens are promised, safe or not; only a row
    /// that promises no token order (RedLock masters losing data, a broken
    /// variant) passes with regressions.
    #[test]
    fn token_regressions_fail_every_row_that_promises_tokens() {
        let mut unsafe_arm = Report::new("restart-redis", "no persistence", 0);
        unsafe_arm.overlaps = 3;
        assert!(unsafe_arm.safety_ok(), "overlaps are not promised away here");
        unsafe_arm.token_regressions = 1;
        assert!(!unsafe_arm.safety_ok(), "tokens are");
        unsafe_arm.tokens_promised = false;
        assert!(unsafe_arm.safety_ok());
        let mut safe = Report::new("baseline", "redis", 0);
        safe.expected_safe = true;
        safe.token_regressions = 1;
        assert!(!safe.safety_ok());
    }

    /// A worker that exits with a failure is a lost worker, one that does
    /// not stop is a hang, and one that exits cleanly is neither.
    #[test]
    fn join_counts_lost_and_hung_workers() {
        let mut run = Run::new("join-test").expect("run dir");
        for script in ["exit 0", "exit 3", "kill -9 $$", "sleep 30"] {
            run.children.push(Command::new("sh").arg("-c").arg(script).spawn().expect("spawn sh"));
        }
        let joined = run.join(Duration::from_millis(300));
        assert_eq!(joined.hung, 1, "{joined:?}");
        assert_eq!(joined.failed.len(), 2, "{joined:?}");
    }
}
