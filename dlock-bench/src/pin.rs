//! Where the benchmark and its servers run: the servers (Redis, PostgreSQL) on the last
//! CPU, the benchmark's own threads on the others.
//!
//! Left to the scheduler on a small machine, the client's worker threads
//! and `redis-server` take turns on the same cores, and which
//! implementation gets the better turns changes from run to run (the fenced
//! floor measured about 60,000 cycles/s at c = 16 alone and 76,000 in a full
//! run of the same build). A lock server has a CPU of its own in production; pinned,
//! the server's CPU is what limits a row at high concurrency, as it would
//! there, and the client's work shows as what it costs. With one CPU, or
//! without `taskset`, nothing is pinned and the header says so.

use std::process::{Command, Stdio};

/// The CPUs in use, decided once before the runtime starts.
#[derive(Debug, Clone)]
pub(crate) enum Pinning {
    /// Servers on `server`, the benchmark on `0..server`.
    Pinned { server: usize },
    /// Not pinned, and why.
    Off(String),
}

impl Pinning {
    /// Pins this process (every thread started from now on inherits it)
    /// unless `off`.
    pub(crate) fn apply(off: bool) -> Pinning {
        if off {
            return Pinning::Off("--no-pin".into());
        }
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        if cpus < 2 {
            return Pinning::Off("one CPU".into());
        }
        let server = cpus - 1;
        let client = if server == 1 { "0".to_owned() } else { format!("0-{}", server - 1) };
        match taskset(&client, std::process::id()) {
            Ok(()) => Pinning::Pinned { server },
            Err(why) => Pinning::Off(why),
        }
    }

    /// Moves a server process onto the server CPU (when pinned).
    pub(crate) fn server(&self, pid: Option<u32>) -> Result<(), String> {
        match (self, pid) {
            (Pinning::Pinned { server }, Some(pid)) => taskset(&server.to_string(), pid),
            _ => Ok(()),
        }
    }

    /// For the header.
    pub(crate) fn describe(&self) -> String {
        match self {
            Pinning::Pinned { server } if *server == 1 => {
                format!("the servers on CPU {server}, the benchmark on CPU 0")
            }
            Pinning::Pinned { server } => {
                format!("the servers on CPU {server}, the benchmark on CPUs 0-{}", server - 1)
            }
            Pinning::Off(why) => format!("not pinned ({why})"),
        }
    }
}

/// `taskset -a -p -c CPUS PID`: every thread of `pid`.
fn taskset(cpus: &str, pid: u32) -> Result<(), String> {
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("taskset: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("taskset -c {cpus} {pid} failed ({status})"))
    }
}
