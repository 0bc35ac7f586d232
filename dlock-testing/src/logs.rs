//! What a test logs, captured: every `tracing` event of the current thread,
//! written as `fmt` lines without colours, for assertions on log output.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// The lines written while the guard of [`capture_logs`] lives.
#[derive(Clone, Default, Debug)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    /// The text written since the last `take`, removed from the capture.
    pub fn take(&self) -> String {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The lines written since the last `take`, removed from the capture.
    pub fn take_lines(&self) -> Vec<String> {
        self.take().lines().map(str::to_owned).collect()
    }
}

/// Captures every event at every level of this thread while the guard
/// lives (a `current_thread` runtime keeps a test's tasks on it).
pub fn capture_logs() -> (LogCapture, tracing::subscriber::DefaultGuard) {
    let captured = LogCapture::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    (captured, set_scoped(subscriber))
}

/// Makes `subscriber` this thread's default while the guard lives, and has
/// every callsite asked again. `tracing` caches whether a callsite is wanted
/// once for the whole process, asked of the thread that reaches it first: a
/// test running beside this one without a subscriber can have cached a span
/// or an event as never wanted, and a capture would then miss it.
pub fn set_scoped<S>(subscriber: S) -> tracing::subscriber::DefaultGuard
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    let guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    guard
}
