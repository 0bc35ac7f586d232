//! The measurement harness shared by every benchmark: a warm-up, one timed
//! window, latencies of the operations that completed inside it, and the
//! Redis commands the server executed inside it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{BenchError, Result};

/// How long tasks get to stop after the window closed before the run is
/// declared hung.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Warm-up and window lengths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
}

/// A clock shared by the tasks of one measurement: nanoseconds since its
/// start, so that timestamps fit an `AtomicU64`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock(Instant);

impl Clock {
    pub(crate) fn start() -> Self {
        Clock(Instant::now())
    }

    pub(crate) fn now_ns(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// One completed operation: when it completed and how long it took (ns).
pub(crate) type Record = (u64, u64);

/// Reads `INFO commandstats` of the server under test.
#[derive(Clone)]
pub(crate) struct CommandCounter {
    conn: MultiplexedConnection,
}

impl std::fmt::Debug for CommandCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandCounter").finish_non_exhaustive()
    }
}

/// One reading of the server: `command -> calls` as `INFO commandstats`
/// reports them, and the CPU time of its main thread (what runs the commands
/// and scripts), µs.
#[derive(Debug, Clone, Default)]
pub(crate) struct CommandStats {
    calls: HashMap<String, u64>,
    cpu_us: u64,
}

impl<const N: usize> From<[(String, u64); N]> for CommandStats {
    fn from(calls: [(String, u64); N]) -> Self {
        CommandStats { calls: calls.into(), cpu_us: 0 }
    }
}

impl CommandCounter {
    pub(crate) fn new(conn: MultiplexedConnection) -> Self {
        CommandCounter { conn }
    }

    pub(crate) async fn snapshot(&self) -> Result<CommandStats> {
        let info: String =
            redis::cmd("INFO").arg("commandstats").arg("cpu").query_async(&mut self.conn.clone()).await?;
        let cpu_secs: f64 = info
            .lines()
            .filter_map(|l| {
                l.strip_prefix("used_cpu_user_main_thread:").or_else(|| l.strip_prefix("used_cpu_sys_main_thread:"))
            })
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .sum();
        Ok(CommandStats { calls: dlock_testing::parse_command_stats(&info), cpu_us: (cpu_secs * 1e6) as u64 })
    }
}

/// Commands the server executed between two snapshots.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CommandDelta {
    /// Commands sent by clients (EVALSHA, SET, SUBSCRIBE, …).
    pub(crate) client: u64,
    /// Every call, including those a Lua script makes (HGET, PUBLISH, …).
    pub(crate) server: u64,
    /// CPU time of the server's main thread, µs.
    pub(crate) server_cpu_us: u64,
}

/// The difference `after - before`, not counting our own `INFO` calls.
///
/// `INFO commandstats` counts the calls a Lua script makes as well, so
/// `script_internal` names the commands that the implementation under test
/// only ever issues from inside its scripts; they count as server calls, not
/// client commands.
pub(crate) fn command_delta(before: &CommandStats, after: &CommandStats, script_internal: &[&str]) -> CommandDelta {
    let mut delta =
        CommandDelta { server_cpu_us: after.cpu_us.saturating_sub(before.cpu_us), ..CommandDelta::default() };
    for (name, &calls) in &after.calls {
        if name == "info" {
            continue;
        }
        let d = calls.saturating_sub(before.calls.get(name).copied().unwrap_or(0));
        delta.server += d;
        if !script_internal.contains(&name.as_str()) {
            delta.client += d;
        }
    }
    delta
}

/// What [`run_window`] reads at both ends of its window.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counting<'a> {
    pub(crate) counter: &'a CommandCounter,
    /// See [`command_delta`].
    pub(crate) script_internal: &'a [&'a str],
    /// Calls of `script_internal` commands the client sent itself, as the
    /// implementation counts them; they move from server-only to client
    /// commands.
    pub(crate) client_sent: Option<&'a AtomicU64>,
}

impl Counting<'_> {
    async fn snapshot(&self) -> Result<(CommandStats, u64)> {
        let sent = self.client_sent.map_or(0, |n| n.load(Ordering::SeqCst));
        Ok((self.counter.snapshot().await?, sent))
    }
}

/// What one window measured.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) ops_per_sec: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    /// Operations completed in the window.
    pub(crate) ops: u64,
    /// Commands per operation: (client, server). `None` without a counter.
    pub(crate) cmds_per_op: Option<(f64, f64)>,
    /// Server main-thread CPU µs per operation (INFO's, a few µs per
    /// window, included). `None` without a counter.
    pub(crate) server_cpu_us_per_op: Option<f64>,
    /// This process's CPU µs per operation over the window, all its threads
    /// and the kernel's work for them: the client side of a cycle (and the
    /// benchmark's own bookkeeping, alike for every implementation). The
    /// servers the benchmark starts are processes of their own, not in it.
    pub(crate) client_cpu_us_per_op: Option<f64>,
}

/// CPU time of this process so far, in ns.
pub(crate) fn process_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0)
}

/// The median; the mean of the two middle values for an even count.
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// Runs `workers` tasks through a warm-up and one window, then stops them.
///
/// Each worker gets its index, the shared clock and a stop flag; it loops
/// until the flag is set and returns the [`Record`]s of its operations.
/// Operations that complete inside the window count: their number gives the
/// rate, their latencies the percentiles. When a `counter` is given, the
/// server's command counts are read at both ends of the window.
pub(crate) async fn run_window<W, F>(
    workers: usize,
    timing: Timing,
    counter: Option<Counting<'_>>,
    worker: W,
) -> Result<Sample>
where
    W: Fn(usize, Clock, Arc<AtomicBool>) -> F,
    F: Future<Output = Result<Vec<Record>>> + Send + 'static,
{
    let clock = Clock::start();
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = JoinSet::new();
    for i in 0..workers {
        set.spawn(worker(i, clock, stop.clone()));
    }
    let outcome = async {
        tokio::time::sleep(timing.warmup).await;
        // The server counts a snapshot's commands somewhere between its
        // request and its reply, which at high concurrency waits behind
        // the commands in flight: each edge of the window is the middle of
        // its snapshot's round trip, so that the operations counted match
        // the commands counted on both edges alike. (An edge taken after
        // the first reply and before the second request shortened the
        // operations' window only, and raised the commands per operation.)
        let sent = clock.now_ns();
        let before = match counter {
            Some(c) => Some(c.snapshot().await?),
            None => None,
        };
        let start = sent + (clock.now_ns() - sent) / 2;
        let cpu_start = process_cpu_ns();
        tokio::time::sleep(timing.duration).await;
        let cpu = process_cpu_ns().saturating_sub(cpu_start);
        let sent = clock.now_ns();
        let delta = match (counter, before) {
            (Some(c), Some((before, sent_before))) => {
                let (after, sent_after) = c.snapshot().await?;
                let mut delta = command_delta(&before, &after, c.script_internal);
                delta.client += sent_after.saturating_sub(sent_before);
                Some(delta)
            }
            _ => None,
        };
        let end = sent + (clock.now_ns() - sent) / 2;
        Ok::<_, BenchError>((start, end, cpu, delta))
    }
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut records = Vec::new();
    let mut task_error = None;
    let joined = tokio::time::timeout(STOP_TIMEOUT, async {
        while let Some(res) = set.join_next().await {
            let res = res.map_err(|e| BenchError::Invariant(format!("a benchmark task failed: {e}")));
            match res.and_then(|r| r) {
                Ok(mut r) => records.append(&mut r),
                Err(e) => {
                    task_error.get_or_insert(e);
                }
            }
        }
    })
    .await;
    if joined.is_err() {
        set.abort_all();
        return Err(BenchError::Invariant(format!(
            "benchmark tasks did not stop within {STOP_TIMEOUT:?} after the window closed (a lost wake-up?)"
        )));
    }
    let (start, end, cpu, delta) = outcome?;
    if let Some(e) = task_error {
        return Err(e);
    }
    let latencies: Vec<u64> =
        records.into_iter().filter(|(done, _)| (start..=end).contains(done)).map(|(_, lat)| lat).collect();
    let percentile_us = |q| dlock_testing::percentile(&latencies, q).map_or(0.0, |ns| ns as f64 / 1000.0);
    let ops = latencies.len() as u64;
    let secs = Duration::from_nanos(end.saturating_sub(start)).as_secs_f64();
    Ok(Sample {
        ops_per_sec: if secs > 0.0 { ops as f64 / secs } else { 0.0 },
        p50_us: percentile_us(0.50),
        p99_us: percentile_us(0.99),
        ops,
        cmds_per_op: delta.filter(|_| ops > 0).map(|d| (d.client as f64 / ops as f64, d.server as f64 / ops as f64)),
        server_cpu_us_per_op: delta.filter(|_| ops > 0).map(|d| d.server_cpu_us as f64 / ops as f64),
        client_cpu_us_per_op: (ops > 0).then(|| cpu as f64 / 1000.0 / ops as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
    }

    #[test]
    fn command_delta_splits_script_calls() {
        let before: CommandStats = [("evalsha".to_owned(), 10), ("hget".to_owned(), 10), ("info".to_owned(), 1)].into();
        let after: CommandStats =
            [("evalsha".to_owned(), 14), ("hget".to_owned(), 14), ("subscribe".to_owned(), 1), ("info".to_owned(), 2)]
                .into();
        let d = command_delta(&before, &after, &["hget"]);
        assert_eq!(d, CommandDelta { client: 5, server: 9, server_cpu_us: 0 });
    }
}
