//! A PostgreSQL cluster of our own.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use crate::port::free_port;

/// Where Debian's `postgresql-<version>` packages put the server binaries.
const DEBIAN_POSTGRES: &str = "/usr/lib/postgresql";

/// A PostgreSQL cluster of our own (a copy of one `initdb` per process,
/// started with `pg_ctl`) in a temporary directory, listening on `127.0.0.1:<free port>` only, with trust
/// authentication (no password) for the `postgres` user. Stopped on drop.
///
/// PostgreSQL refuses to run as root: when the tests run as root, every
/// server command runs as the unprivileged `postgres` user (`runuser`), and
/// the directory is handed to that user.
///
/// ```no_run
/// let mut pg = dlock_testing::PostgresServer::start();
/// assert_eq!(pg.psql("SELECT 1 + 1"), "2");
/// pg.stop();
/// pg.start_again(); // same data directory, same port
/// ```
#[derive(Debug)]
pub struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    running: bool,
    /// Server commands run as `postgres` through `runuser` (we are root).
    as_postgres: bool,
    /// The processes that write WAL in the background, stopped
    /// ([`hold_wal_writes`](Self::hold_wal_writes)).
    held: Vec<u32>,
}

impl PostgresServer {
    /// Initialises a cluster and starts it.
    ///
    /// # Panics
    ///
    /// When PostgreSQL is not installed, or the cluster cannot be created or
    /// does not come up within 30 s; the message says why.
    pub fn start() -> Self {
        let mut server = Self::init();
        server.start_again();
        server
    }

    /// Initialises a cluster with `settings` in its `postgresql.conf` (so
    /// they hold across its restarts) and starts it:
    /// `[("synchronous_commit", "off")]` answers commits before their WAL
    /// is written, as many production servers are set for throughput.
    /// Settings the harness passes at start (`fsync`, `full_page_writes`,
    /// `listen_addresses`, the WAL sizes) are its own.
    ///
    /// ```no_run
    /// let pg = dlock_testing::PostgresServer::start_with(&[("synchronous_commit", "off")]);
    /// assert_eq!(pg.psql("SHOW synchronous_commit"), "off");
    /// ```
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with(settings: &[(&str, &str)]) -> Self {
        let mut server = Self::init();
        let lines: String = settings.iter().map(|(name, value)| format!("{name} = '{value}'\n")).collect();
        append(&server.data_dir().join("postgresql.conf"), &lines);
        server.start_again();
        server
    }

    /// A cluster that accepts TLS connections only: the server presents
    /// `certs`' server certificate (for `127.0.0.1` and `localhost`, signed
    /// by [`TestCertificates::ca_cert`](crate::TestCertificates::ca_cert)), and a connection without TLS is
    /// refused (`hostnossl … reject`).
    ///
    /// ```no_run
    /// let certs = dlock_testing::TestCertificates::generate();
    /// let pg = dlock_testing::PostgresServer::start_tls(&certs);
    /// let url = format!("{}?sslmode=verify-full&sslrootcert={}", pg.url(), certs.ca_cert().display());
    /// # let _ = url;
    /// ```
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start), and when the certificate cannot be
    /// installed in the cluster.
    pub fn start_tls(certs: &crate::TestCertificates) -> Self {
        let mut server = Self::init();
        let data = server.data_dir();
        for (from, to) in [(certs.server_cert(), "server.crt"), (certs.server_key(), "server.key")] {
            std::fs::copy(&from, data.join(to))
                .unwrap_or_else(|e| panic!("copy {} into the cluster: {e}", from.display()));
        }
        // The server refuses a key that others may read.
        let key = data.join("server.key");
        check(Command::new("chmod").arg("600").arg(&key).output(), "chmod the server key");
        if server.as_postgres {
            check(
                Command::new("chown").arg("postgres:").arg(&key).arg(data.join("server.crt")).output(),
                "chown the certificate",
            );
        }
        append(&data.join("postgresql.conf"), "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        // First match wins: TLS connections are trusted, the rest refused.
        let hba = data.join("pg_hba.conf");
        let rules = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
        std::fs::write(
            &hba,
            format!("hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n{rules}"),
        )
        .expect("write pg_hba.conf");
        server.start_again();
        server
    }

    /// A cluster initialised, not started.
    fn init() -> Self {
        let bin = server_binaries();
        let as_postgres = running_as_root();
        reap_orphans(&bin, as_postgres);
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("{CLUSTER_DIR}{}-{port}", std::process::id()));
        fresh_dir(&dir, as_postgres, "the PostgreSQL cluster");
        let server = PostgresServer { bin, dir, port, running: false, as_postgres, held: Vec::new() };
        // A copy of this process's one `initdb`: a tenth of its time, and
        // a test pass makes a hundred clusters.
        let template = template(&server.bin, as_postgres);
        let out = Command::new("cp").arg("-a").arg(template).arg(server.data_dir()).output();
        check(out, "copy the initialised cluster");
        server
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A server binary, run as `postgres` when we are root.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        };
        cmd.stdin(Stdio::null());
        cmd
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process ids of the running server: its postmaster first, then
    /// the processes it started so far (`postmaster.pid` and
    /// `/proc/<pid>/task/<pid>/children`). Empty when it is not running.
    /// A benchmark moves them onto a CPU of their own; the backends the
    /// postmaster forks later inherit its CPUs.
    pub fn pids(&self) -> Vec<u32> {
        let Some(postmaster) = (self.running)
            .then(|| std::fs::read_to_string(self.data_dir().join("postmaster.pid")).ok())
            .flatten()
            .and_then(|text| text.lines().next().and_then(|line| line.trim().parse::<u32>().ok()))
        else {
            return Vec::new();
        };
        let children =
            std::fs::read_to_string(format!("/proc/{postmaster}/task/{postmaster}/children")).unwrap_or_default();
        std::iter::once(postmaster).chain(children.split_whitespace().filter_map(|p| p.parse().ok())).collect()
    }

    /// Starts the cluster after [`stop`](Self::stop) or
    /// [`crash`](Self::crash), on the same port and data directory, and
    /// waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// When it does not come up within 30 s.
    pub fn start_again(&mut self) {
        if self.running {
            return;
        }
        // Loopback only, a socket directory of our own (Debian's
        // /var/run/postgresql may be missing), and no fsync: a test cluster
        // survives its server's restarts, not the machine's. A small WAL:
        // dozens of clusters run in one test pass, on machines whose disk is
        // shared (a CI run once ran out of it).
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c full_page_writes=off \
             -c min_wal_size=4MB -c max_wal_size=16MB",
            self.port,
            self.dir.display()
        );
        let out = self
            .command("pg_ctl")
            .args(["-w", "-t", "30", "-o", &options, "-l"])
            .arg(self.dir.join("server.log"))
            .arg("-D")
            .arg(self.data_dir())
            .arg("start")
            .output();
        if let Err(why) = outcome(out) {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            panic!("PostgreSQL on port {} did not start: {why}\nserver log:\n{log}", self.port);
        }
        self.running = true;
    }

    /// Stops the server cleanly (`pg_ctl stop -m fast`): sessions are ended,
    /// the data stays.
    pub fn stop(&mut self) {
        self.pg_ctl_stop("fast");
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`: no
    /// checkpoint, WAL replayed at the next start). Committed data stays.
    pub fn crash(&mut self) {
        self.pg_ctl_stop("immediate");
    }

    /// Stops the server's background writers of WAL and data pages (the
    /// WAL writer, the background writer, the checkpointer: `SIGSTOP`), so
    /// that what commits leave in the server's memory stays there: the
    /// first half of [`crash_losing_unwritten_wal`](Self::crash_losing_unwritten_wal).
    /// A commit under `synchronous_commit = off` then leaves its WAL
    /// unwritten for as long as they are held; one under any other value
    /// writes it itself before it is answered. (They are stopped rather
    /// than killed: PostgreSQL treats the death of any of them as a crash.)
    ///
    /// # Panics
    ///
    /// When they cannot be found or stopped.
    pub fn hold_wal_writes(&mut self) {
        assert!(self.running && self.held.is_empty(), "hold the WAL writes of a running server, once");
        self.held = self.wal_writers();
        assert_eq!(self.held.len(), 3, "the WAL writer, background writer and checkpointer: {:?}", self.held);
        assert!(signal("STOP", &self.held), "stop the WAL writers {:?}", self.held);
    }

    /// A crash of the machine under the server, as PostgreSQL's data sees
    /// it: what commits wrote (to the operating system) stays, what they
    /// left in the server's memory is lost. After
    /// [`hold_wal_writes`](Self::hold_wal_writes), the held processes are
    /// killed (`SIGKILL`), the postmaster ends every other server process
    /// and replays the WAL written so far (crash recovery, the way a
    /// restarted machine's server would), and this returns once the server
    /// accepts connections again, recovered. What the server wrote to the
    /// operating system stays (the harness runs with `fsync = off`: it
    /// stands for what `fsync = on` would have flushed to the disk), what
    /// it held in its own memory is lost: exactly the window a commit
    /// answered under `synchronous_commit = off` is exposed to when the
    /// machine crashes, every time instead of by chance.
    ///
    /// # Panics
    ///
    /// Without [`hold_wal_writes`](Self::hold_wal_writes) first, or when
    /// the server is not back within 30 s.
    pub fn crash_losing_unwritten_wal(&mut self) {
        assert!(!self.held.is_empty(), "hold_wal_writes first");
        let killed = std::mem::take(&mut self.held);
        // One already gone (say, the test killed the server) crashes it all the same.
        let _ = signal("KILL", &killed);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // Recovered once a new WAL writer runs (it starts after recovery).
        loop {
            let writers = self.try_psql("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'");
            if let Ok(pid) = writers
                && pid.parse::<u32>().is_ok_and(|pid| !killed.contains(&pid))
            {
                return;
            }
            if std::time::Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
                panic!("PostgreSQL on port {} did not recover from the crash\nserver log:\n{log}", self.port);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The process ids of the WAL writer, the background writer and the
    /// checkpointer.
    fn wal_writers(&self) -> Vec<u32> {
        let pids = self.psql(
            "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity \
             WHERE backend_type IN ('walwriter', 'background writer', 'checkpointer')",
        );
        pids.split_whitespace().filter_map(|pid| pid.parse().ok()).collect()
    }

    fn pg_ctl_stop(&mut self, mode: &str) {
        if !self.running {
            return;
        }
        // Stopped processes would not hear the postmaster's request to end.
        let _ = signal("KILL", &std::mem::take(&mut self.held));
        let _ = self
            .command("pg_ctl")
            .args(["-w", "-t", "30", "-m", mode, "-D"])
            .arg(self.data_dir())
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        self.running = false;
    }

    /// Runs `sql` with `psql` and returns its unaligned, tuples-only output,
    /// trimmed (`SELECT count(*) …` gives `"3"`).
    ///
    /// # Panics
    ///
    /// When `psql` fails (the server is down, the statement is wrong).
    pub fn psql(&self, sql: &str) -> String {
        match self.try_psql(sql) {
            Ok(stdout) => stdout,
            Err(why) => panic!("psql `{sql}` on port {}: {why}", self.port),
        }
    }

    /// [`psql`](Self::psql), or why it failed.
    fn try_psql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &self.port.to_string(), "-d", "postgres", "-c", sql])
            .stdin(Stdio::null())
            .output();
        outcome(out).map(|stdout| stdout.trim().to_owned())
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The start of a cluster's directory name; the owning process id and the
/// port follow.
const CLUSTER_DIR: &str = "dlock-pg-";

/// Stops and deletes the clusters of test processes that ended without
/// dropping their server (a killed `cargo test`, a benchmark stopped by
/// Ctrl-C): `pg_ctl` starts a server that outlives the process that
/// started it, and each one left behind keeps its memory, its port and
/// tens of MB of a disk that CI machines share. A directory whose owner
/// process still runs is left alone (a reused process id only delays its
/// reaping).
fn reap_orphans(bin: &std::path::Path, as_postgres: bool) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(CLUSTER_DIR)) else { continue };
        let Some(owner) = rest.split('-').next().and_then(|pid| pid.parse::<u32>().ok()) else { continue };
        if std::path::Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        // Its drop stops it (if it still runs) and deletes its directory.
        let (dir, held) = (entry.path(), Vec::new());
        drop(PostgresServer { bin: bin.to_path_buf(), dir, port: 0, running: true, as_postgres, held });
    }
}

/// The data directory of a cluster `initdb` made once in this process
/// (in `<temp>/dlock-pg-<pid>-template`, which the next process reaps), to
/// be copied for each cluster.
///
/// # Panics
///
/// When `initdb` fails.
fn template(bin: &std::path::Path, as_postgres: bool) -> &'static std::path::Path {
    static TEMPLATE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("{CLUSTER_DIR}{}-template", std::process::id()));
        fresh_dir(&dir, as_postgres, "the PostgreSQL template");
        // Not running: a server only to run `initdb` as the right user.
        let maker = PostgresServer {
            bin: bin.to_path_buf(),
            dir: dir.clone(),
            port: 0,
            running: false,
            as_postgres,
            held: vec![],
        };
        let data = maker.data_dir();
        let out = maker
            .command("initdb")
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync", "--locale=C"])
            // 1 MB WAL segments: with `max_wal_size` below, a busy test
            // cluster keeps a few MB of WAL, not the default 1 GB.
            .arg("--wal-segsize=1")
            .arg("-D")
            .arg(&data)
            .output();
        // Its drop would delete the template.
        std::mem::forget(maker);
        check(out, "initdb");
        data
    })
}

/// The newest `/usr/lib/postgresql/<version>/bin` with an `initdb`.
fn server_binaries() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(DEBIAN_POSTGRES)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL is not installed (no {DEBIAN_POSTGRES}/<version>/bin/initdb). The tests need a real \
             server: run the README's test command (`bash scripts/test.sh`), which installs it, or \
             `apt-get install -y postgresql`."
        ),
    }
}

/// An empty directory at `dir` (what was there is deleted), the `postgres`
/// user's when `as_postgres`: a server that runs as that user writes its
/// files there.
///
/// # Panics
///
/// When it cannot be made or handed over; the message names `what`.
pub(crate) fn fresh_dir(dir: &std::path::Path, as_postgres: bool, what: &str) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create a directory for {what}: {e}"));
    if as_postgres {
        let out = Command::new("chown").arg("postgres:").arg(dir).output();
        if let Err(why) = outcome(out) {
            panic!("chown the directory of {what} to the `postgres` user (does that user exist?): {why}");
        }
    }
}

pub(crate) fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// A command's standard output, or why it failed (its standard error).
fn outcome(out: std::io::Result<Output>) -> Result<String, String> {
    match out {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!(
            "{}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn check(out: std::io::Result<Output>, what: &str) {
    if let Err(why) = outcome(out) {
        panic!("cannot set up a PostgreSQL cluster: {what} failed: {why}");
    }
}

/// Sends the signal `name` (`STOP`, `KILL`) to `pids`, through kill(1): we
/// may be root and they the `postgres` user's. Whether every one got it.
fn signal(name: &str, pids: &[u32]) -> bool {
    if pids.is_empty() {
        return true;
    }
    let out = Command::new("kill").arg(format!("-{name}")).args(pids.iter().map(u32::to_string)).output();
    outcome(out).is_ok()
}

/// Appends `text` to the file at `path`.
fn append(path: &std::path::Path, text: &str) {
    use std::io::Write as _;
    let mut file =
        std::fs::OpenOptions::new().append(true).open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    file.write_all(text.as_bytes()).unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
}
