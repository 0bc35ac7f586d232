//! Finding the address a server process announces on its stdout.

use std::io::{BufRead, BufReader};
use std::process::ChildStdout;
use std::time::Duration;

/// What a dlock example server logs once it listens: `… listening on http://ADDR …`.
const MARKER: &str = "listening on http://";

/// Reads `stdout` of a server started with port 0 until it logs
/// `listening on http://ADDR`, and returns `ADDR`. A thread keeps draining
/// the pipe afterwards (so the server never blocks on a full pipe), echoing
/// each line to stderr with `[name]` when `echo` is set.
///
/// Blocking: call it from `spawn_blocking` in async code.
///
/// # Errors
///
/// When no such line arrives within `timeout` (the server failed to start
/// or logs elsewhere).
///
/// ```no_run
/// use std::process::{Command, Stdio};
/// use std::time::Duration;
/// let mut child = Command::new("orders").env("ORDERS_ADDR", "127.0.0.1:0").stdout(Stdio::piped()).spawn().unwrap();
/// let stdout = child.stdout.take().unwrap();
/// let addr = dlock_testing::announced_address(stdout, Duration::from_secs(30), None).unwrap();
/// ```
pub fn announced_address(stdout: ChildStdout, timeout: Duration, echo: Option<&'static str>) -> Result<String, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split(MARKER).nth(1)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
            if let Some(name) = echo {
                eprintln!("[{name}] {line}");
            }
        }
    });
    rx.recv_timeout(timeout)
        .map_err(|_| format!("the server did not log `{MARKER}…` within {timeout:?} (it may have failed to start)"))
}
