//! The history every process appends to: one JSON line per event, written
//! with a single `write(2)` so that `kill -9` loses at most the event in
//! flight and lines from one file never interleave.
//!
//! Timestamps are `CLOCK_MONOTONIC` in nanoseconds. On Linux that clock is
//! one system-wide counter (time since boot, not counting suspend), so the
//! events of different processes on this box are ordered by it. A
//! `std::time::Instant` reads the same clock but cannot be exported, and
//! `/proc/uptime` only has 10 ms resolution, so the harness calls
//! `clock_gettime` itself (through `rustix`, which keeps the crate free of
//! `unsafe`).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Nanoseconds of `CLOCK_MONOTONIC`, comparable across processes.
pub(crate) fn mono_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs * 1_000_000_000 + nanos
}

/// Converts a tokio instant to the shared monotonic clock.
pub(crate) fn instant_to_ns(at: tokio::time::Instant) -> u64 {
    let now_i = tokio::time::Instant::now();
    let now = mono_ns();
    if at >= now_i {
        now + u64::try_from((at - now_i).as_nanos()).unwrap_or(u64::MAX / 4)
    } else {
        now.saturating_sub(u64::try_from((now_i - at).as_nanos()).unwrap_or(0))
    }
}

/// One history event. Fields that do not apply are left out of the JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Event {
    /// `CLOCK_MONOTONIC` ns.
    pub(crate) t: u64,
    pub(crate) pid: u32,
    #[serde(default)]
    pub(crate) task: u32,
    /// `acq_invoke`, `acq_ok`, `acq_fail`, `cs_enter`, `w_invoke`, `write`,
    /// `cs_exit`, `rel_invoke`, `rel_ok`, `rel_err`, `lost`, `residue` (a
    /// worker's in-process lock table at its end), and the nemesis's `kill`, `stop`, `cont`, `restart`, `partition`, `heal`.
    pub(crate) op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) key: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) owner: Option<String>,
    /// The end of the validity the client believes in, when it knows one
    /// (fixed leases, and the lease end at the moment a loss is seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) vu: Option<u64>,
    /// For `write`: `f` (fenced counter), `u` (unfenced control), `s`
    /// (fenced set) or `us` (unfenced set control).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reg: Option<String>,
    /// For `write`: `ok` or `stale`; for `acq_fail`: the error kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) res: Option<String>,
    /// For `write`: the value written; for `residue`: the keys left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) val: Option<i64>,
    /// For nemesis events: the target process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) target: Option<u32>,
    /// For `write` to a set register (`s`, `us`): the op id added to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) id: Option<String>,
    /// For `acq_ok`: the validity the guard had left when `acquire`
    /// returned, in µs on the guard's own clock (negative: it returned a
    /// guard whose validity was already over, which R3 forbids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) left_us: Option<i64>,
    /// For `acq_ok`: how the key is held when not exclusively: `s`
    /// (shared) or `p<N>` (one of N permits). Absent: exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) mode: Option<String>,
}

impl Event {
    /// An event of this process, stamped now.
    pub(crate) fn now(op: &str) -> Self {
        Event { t: mono_ns(), pid: std::process::id(), op: op.to_owned(), ..Event::default() }
    }
}

/// An append-only history file shared by the tasks of one process.
#[derive(Debug)]
pub(crate) struct History {
    file: Mutex<File>,
}

impl History {
    /// Opens (creating) `path` for appending.
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(History { file: Mutex::new(file) })
    }

    /// Appends one event as one `write(2)` of one line.
    pub(crate) fn log(&self, event: &Event) {
        let Ok(mut line) = serde_json::to_vec(event) else { return };
        line.push(b'\n');
        let mut file = match self.file.lock() {
            Ok(f) => f,
            Err(poisoned) => poisoned.into_inner(),
        };
        // A regular file in O_APPEND mode takes a short line whole; a failed
        // write (disk full) would show up as a missing event, which the
        // checker reports as indeterminate rather than hides.
        if let Err(e) = file.write_all(&line) {
            eprintln!("dlock-torture: cannot append to the history: {e}");
        }
    }
}

/// Reads every event of the given files, sorted by time.
///
/// Every file must be readable and every complete line (ending in `\n`)
/// must be an event: a missing file, an I/O error or a bad line is an
/// error, never skipped, or a history could lose a worker's events and the
/// checks pass on what is left. Only a file's last line may be torn (no
/// `\n`: its process was killed mid-write, or is writing it right now);
/// it is left out.
pub(crate) fn read_all(paths: &[std::path::PathBuf]) -> Result<Vec<Event>, String> {
    let mut events = Vec::new();
    for path in paths {
        let file = File::open(path).map_err(|e| format!("cannot open the history {}: {e}", path.display()))?;
        parse_into(BufReader::new(file), &path.display().to_string(), &mut events)?;
    }
    events.sort_by_key(|e| e.t);
    Ok(events)
}

/// Appends the events of one history to `events`; `name` is for errors.
fn parse_into(mut reader: impl BufRead, name: &str, events: &mut Vec<Event>) -> Result<(), String> {
    let mut line = Vec::new();
    for number in 1.. {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(|e| format!("cannot read the history {name}: {e}"))?;
        if n == 0 {
            break;
        }
        if line.last() != Some(&b'\n') {
            // A torn last line: at most the one event in flight.
            break;
        }
        let e = serde_json::from_slice::<Event>(&line).map_err(|e| {
            format!("the history {name} has a bad line {number} ({e}): {}", String::from_utf8_lossy(&line).trim_end())
        })?;
        events.push(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Event>, String> {
        let mut events = Vec::new();
        parse_into(text.as_bytes(), "test", &mut events).map(|()| events)
    }

    #[test]
    fn a_torn_last_line_is_left_out() {
        let events = parse("{\"t\":1,\"pid\":2,\"op\":\"acq_ok\"}\n{\"t\":2,\"pid\":2,\"op\":\"re").expect("parse");
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].op, "acq_ok");
    }

    #[test]
    fn a_bad_complete_line_is_an_error() {
        let err = parse("{\"t\":1,\"pid\":2,\"op\":\"acq_ok\"}\nnot json\n{\"t\":3,\"pid\":2,\"op\":\"rel_ok\"}\n")
            .expect_err("a bad line must not be skipped");
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn a_missing_history_is_an_error() {
        let missing = std::env::temp_dir().join(format!("dlock-torture-no-such-history-{}", std::process::id()));
        assert!(read_all(&[missing]).is_err());
    }
}
