//! How dlock connects to PostgreSQL: [`PostgresOptions`], the connect
//! options made of a URL (its `statement_timeout`, its TLS mode checked),
//! and the lazy pool.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::URL_VAR;
use crate::backend::redact;
use crate::error::{Error, Result};

/// How the PostgreSQL backend connects.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::postgres::PostgresOptions;
/// let opts = PostgresOptions::default().with_response_timeout(Duration::from_millis(500)).with_max_connections(8);
/// # let _ = opts;
/// ```
#[derive(Clone)]
pub struct PostgresOptions {
    response_timeout: Duration,
    max_connections: u32,
    listen_url: Option<String>,
}

impl std::fmt::Debug for PostgresOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOptions")
            .field("response_timeout", &self.response_timeout)
            .field("max_connections", &self.max_connections)
            .field("listen_url", &self.listen_url.as_deref().map(redact))
            .finish()
    }
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions { response_timeout: Duration::from_secs(2), max_connections: 16, listen_url: None }
    }
}

impl PostgresOptions {
    /// The longest a request may take, a connection included (default 2 s);
    /// also the server's `statement_timeout` for dlock's connections.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The bound of each request.
    pub(crate) fn response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// Where the listener connects, when not where the requests go.
    pub(crate) fn listen_url(&self) -> Option<&str> {
        self.listen_url.as_deref()
    }

    /// The most connections the pool opens (default 16), the listener's
    /// included unless it has its own URL. Lock requests keep at most half
    /// of them open between requests; the rest is for the pool's other
    /// users, such as a store made
    /// [`from_backend`](crate::idempotency::PostgresStore::from_backend).
    ///
    /// ```
    /// use dlock_core::backend::postgres::PostgresOptions;
    /// // Up to 16 lock requests at once, on connections kept between them.
    /// let opts = PostgresOptions::default().with_max_connections(32);
    /// # let _ = opts;
    /// ```
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Where the connection that listens for releases goes
    /// (`DLOCK_POSTGRES_LISTEN_URL`), when not where the requests go.
    /// Behind a transaction-mode pooler `LISTEN` loses its announcements
    /// (waiters then wake only when a lease ends): point this at the
    /// server, or a session-mode pool, **of the same database**.
    ///
    /// ```
    /// use dlock_core::backend::postgres::PostgresOptions;
    /// // Requests through PgBouncer (port 6432), the listener to the server.
    /// let opts = PostgresOptions::default().with_listen_url("postgres://app@db:5432/app");
    /// # let _ = opts;
    /// ```
    pub fn with_listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }
}

/// How dlock connects to the server at `url`: its `statement_timeout` is
/// the response timeout, so the server gives up on a request when dlock
/// does.
pub(crate) fn connect_options(url: &str, options: &PostgresOptions) -> Result<PgConnectOptions> {
    let timeout_ms = options.response_timeout.as_millis().to_string();
    let connect = PgConnectOptions::from_str(url)
        .map_err(|e| Error::config(URL_VAR, format!("`{}` is not a PostgreSQL URL: {e}", redact(url))))?;
    check_tls(&connect, cfg!(feature = "tls"))?;
    Ok(connect.application_name("dlock").options([("statement_timeout", timeout_ms.as_str())]))
}

/// Refuses a URL that requires TLS (`require`, `verify-*`) in a build
/// without the `tls` feature, which would fail far from the cause.
fn check_tls(connect: &PgConnectOptions, tls_built: bool) -> Result<()> {
    use sqlx::postgres::PgSslMode;
    let asks = matches!(connect.get_ssl_mode(), PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull);
    if asks && !tls_built {
        return Err(Error::config(
            URL_VAR,
            "asks for TLS (`sslmode`), and dlock-core was built without its `tls` feature: enable it (dlock-axum \
             forwards it) or connect without TLS",
        ));
    }
    Ok(())
}

/// A lazy pool of `connect`: no connection is opened before a request.
pub(crate) fn pool(connect: PgConnectOptions, options: &PostgresOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(options.max_connections)
        .min_connections(0)
        .acquire_timeout(options.response_timeout)
        // No ping per request: a dead connection fails its request.
        .test_before_acquire(false)
        .connect_lazy_with(connect)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_that_asks_for_tls_needs_the_feature() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://app@db:5432/app?sslmode={mode}");
            let connect = PgConnectOptions::from_str(&url).expect("a URL");
            let err = check_tls(&connect, false).expect_err(mode).to_string();
            assert!(err.contains("DLOCK_POSTGRES_URL") && err.contains("`tls` feature"), "{err}");
            assert!(check_tls(&connect, true).is_ok(), "{mode}");
        }
        for mode in ["disable", "prefer"] {
            let connect = PgConnectOptions::from_str(&format!("postgres://db/app?sslmode={mode}")).expect("a URL");
            assert!(check_tls(&connect, false).is_ok(), "{mode}");
        }
    }
}
