//! [`RedisOptions`]: the timeouts, TLS material and restart quarantine of
//! every Redis connection dlock makes.

use std::time::Duration;

use super::tls::RedisTls;

/// Timeouts of the Redis connections.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::redis::RedisOptions;
/// let opts = RedisOptions::default().with_response_timeout(Duration::from_millis(500));
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
    tls: Option<RedisTls>,
    pub(super) restart_quarantine: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            tls: None,
            restart_quarantine: Duration::ZERO,
        }
    }
}

impl RedisOptions {
    /// How long to wait for a TCP (and TLS, AUTH) connection.
    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long to wait for the reply to one command.
    pub fn with_response_timeout(mut self, t: Duration) -> Self {
        self.response_timeout = t;
        self
    }

    /// The CA (and client certificate) for `rediss://` URLs; plain
    /// `redis://` URLs ignore it (with a warning).
    ///
    /// ```no_run
    /// # fn demo() -> dlock_core::Result<()> {
    /// use dlock_core::backend::redis::RedisOptions;
    /// use dlock_core::RedisTls;
    /// let opts = RedisOptions::default().with_tls(RedisTls::new().with_ca_file("/etc/redis/ca.crt")?);
    /// # Ok(()) }
    /// ```
    pub fn with_tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// After the server restarts or loses its data, grant nothing until it
    /// has been up this long (set it to the longest lease any client uses,
    /// in every client of the server); zero (the default) turns the check
    /// off. See `DLOCK_RESTART_QUARANTINE_MS` and [`RELIABILITY.md`]:
    /// without persistence, a restarted Redis otherwise grants locks whose
    /// earlier holders are still running.
    ///
    /// Every missing data marker is taken for a possible flush, and a flush
    /// is quarantined from when any client first saw it. So a Redis that
    /// dlock has never used (a first deploy, even against a server up for
    /// long) grants nothing during its first quarantine, once: it cannot be
    /// told from a server flushed a moment ago.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::backend::redis::RedisOptions;
    /// let opts = RedisOptions::default().with_restart_quarantine(Duration::from_secs(30));
    /// ```
    ///
    /// [`RELIABILITY.md`]: https://github.com/dlock-rs/dlock/blob/main/RELIABILITY.md
    pub fn with_restart_quarantine(mut self, quarantine: Duration) -> Self {
        self.restart_quarantine = quarantine;
        self
    }

    pub(super) fn custom_tls(&self) -> Option<&RedisTls> {
        self.tls.as_ref().filter(|t| t.is_custom())
    }
}
