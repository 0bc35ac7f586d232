//! PgBouncer in front of a [`PostgresServer`], in transaction mode.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::port::free_port;
use crate::postgres::{fresh_dir, running_as_root};
use crate::PostgresServer;

/// Where `scripts/install-deps.sh` installs the PgBouncer it builds (Debian
/// 12 packages 1.18, which cannot keep prepared statements in transaction
/// mode).
const BUILT_PGBOUNCER: &str = "/usr/local/bin/pgbouncer";

/// The first PgBouncer that keeps prepared statements across the server
/// connections of a transaction-mode pool (`max_prepared_statements`),
/// which sqlx needs: it prepares every statement.
const FIRST_USABLE: (u32, u32) = (1, 21);

/// A PgBouncer process of our own, listening on `127.0.0.1:<free port>`,
/// pooling one [`PostgresServer`] in **transaction mode** with a few server
/// connections (4): every transaction a client runs may land on any of
/// them, and a client's next one on another. Stopped on drop.
///
/// Clients connect as `postgres` to the database `postgres` (trusted, no
/// password). They may send `extra_float_digits` (sqlx does) and
/// `statement_timeout` (dlock does, in `options`) at connect: the pooler
/// ignores both, as a production PgBouncer in front of dlock must be told
/// to (it refuses a connection with a parameter it does not know).
///
/// PgBouncer refuses to run as root: when the tests run as root, it runs as
/// the `postgres` user.
///
/// ```no_run
/// let pg = dlock_testing::PostgresServer::start();
/// let pooler = dlock_testing::PgBouncer::start(&pg);
/// let url = pooler.url(); // requests here; LISTEN needs the server's own URL
/// # let _ = url;
/// ```
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl PgBouncer {
    /// Starts PgBouncer in front of `server`, set as dlock needs it:
    /// `max_prepared_statements = 200` and `ignore_startup_parameters =
    /// extra_float_digits, statement_timeout`.
    ///
    /// # Panics
    ///
    /// When no PgBouncer of version 1.21 or later is installed, or it does
    /// not accept connections within 30 s; the message says why.
    pub fn start(server: &PostgresServer) -> Self {
        Self::start_with(server, &[])
    }

    /// As [`start`](Self::start), with some settings of the `[pgbouncer]`
    /// section replaced: `("max_prepared_statements", "0")` turns off the
    /// pooler's tracking of prepared statements, and sqlx's statements then
    /// fail (a control that the pool really lends its server connections
    /// per transaction); `("ignore_startup_parameters",
    /// "extra_float_digits")` refuses dlock's `statement_timeout`.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with(server: &PostgresServer, settings: &[(&str, &str)]) -> Self {
        let bin = binary();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("dlock-pgbouncer-{}-{port}", std::process::id()));
        let uid = postgres_uid();
        // PgBouncer, as `postgres`, writes its log there.
        fresh_dir(&dir, uid.is_some(), "PgBouncer");
        let users = dir.join("users.txt");
        // `trust` still looks the user up in the auth file.
        std::fs::write(&users, "\"postgres\" \"\"\n").expect("write PgBouncer's auth file");
        let log = dir.join("pgbouncer.log");
        let config = dir.join("pgbouncer.ini");
        let mut section = vec![
            ("listen_addr", "127.0.0.1".to_owned()),
            ("listen_port", port.to_string()),
            ("unix_socket_dir", String::new()),
            ("auth_type", "trust".to_owned()),
            ("auth_file", users.display().to_string()),
            ("logfile", log.display().to_string()),
            ("pool_mode", "transaction".to_owned()),
            ("default_pool_size", "4".to_owned()),
            ("max_client_conn", "500".to_owned()),
            ("max_prepared_statements", "200".to_owned()),
            ("ignore_startup_parameters", "extra_float_digits, statement_timeout".to_owned()),
        ];
        for &(name, value) in settings {
            match section.iter_mut().find(|(n, _)| *n == name) {
                Some(setting) => setting.1 = value.to_owned(),
                None => section.push((name, value.to_owned())),
            }
        }
        let lines: String = section.iter().map(|(name, value)| format!("{name} = {value}\n")).collect();
        std::fs::write(
            &config,
            format!(
                "[databases]\npostgres = host=127.0.0.1 port={pg} dbname=postgres user=postgres\n\n[pgbouncer]\n{lines}",
                pg = server.port(),
            ),
        )
        .expect("write pgbouncer.ini");
        let mut cmd = Command::new(&bin);
        cmd.arg(&config).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt as _;
            cmd.uid(uid);
        }
        let child = cmd.spawn().unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        let mut pooler = PgBouncer { child, dir, port };
        pooler.until_listening(&log);
        pooler
    }

    fn until_listening(&mut self, log: &std::path::Path) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            let exited = self.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let mut stderr = String::new();
                if let Some(mut err) = self.child.stderr.take() {
                    use std::io::Read as _;
                    let _ = err.read_to_string(&mut stderr);
                }
                let log = std::fs::read_to_string(log).unwrap_or_default();
                panic!("PgBouncer on port {} did not start ({exited:?}):\n{stderr}\n{log}", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`, through the pooler.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The pooler's port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `postgres` user's id when we are root (PgBouncer refuses root), else
/// `None`.
fn postgres_uid() -> Option<u32> {
    if !running_as_root() {
        return None;
    }
    let out = Command::new("id").args(["-u", "postgres"]).output().expect("run `id -u postgres`");
    let uid = String::from_utf8_lossy(&out.stdout).trim().parse().ok();
    assert!(uid.is_some(), "we are root and there is no `postgres` user to run PgBouncer as");
    uid
}

/// `$DLOCK_PGBOUNCER`, the one `install-deps.sh` built, or `pgbouncer` on the
/// `PATH`, whichever is found first; it must be 1.21 or later.
fn binary() -> PathBuf {
    let candidates = std::env::var_os("DLOCK_PGBOUNCER")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from(BUILT_PGBOUNCER), PathBuf::from("pgbouncer")]);
    let mut seen = Vec::new();
    for bin in candidates {
        let Ok(out) = Command::new(&bin).arg("--version").stdin(Stdio::null()).output() else { continue };
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        match version(&text) {
            Some(v) if v >= FIRST_USABLE => return bin,
            _ => seen.push(format!("{} says {:?}", bin.display(), text.lines().next().unwrap_or(""))),
        }
    }
    panic!(
        "no PgBouncer {}.{} or later (found: {}). The tests need a real one: run the README's test command \
         (`bash scripts/test.sh`), whose install-deps.sh builds it into {BUILT_PGBOUNCER}, or set DLOCK_PGBOUNCER.",
        FIRST_USABLE.0,
        FIRST_USABLE.1,
        if seen.is_empty() { "none".to_owned() } else { seen.join("; ") }
    )
}

/// `(major, minor)` of `PgBouncer 1.24.1`.
fn version(text: &str) -> Option<(u32, u32)> {
    let number = text.lines().next()?.strip_prefix("PgBouncer ")?;
    let mut parts = number.split('.').map(|p| p.trim().parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

#[cfg(test)]
mod tests {
    use super::version;

    #[test]
    fn versions_are_read_from_the_first_line() {
        assert_eq!(version("PgBouncer 1.24.1\nlibevent 2.1.12-stable\n"), Some((1, 24)));
        assert_eq!(version("PgBouncer 1.18.0\n"), Some((1, 18)));
        assert!(version("PgBouncer 1.18.0").is_some_and(|v| v < super::FIRST_USABLE));
        assert_eq!(version("pgbouncer: command not found"), None);
    }
}
