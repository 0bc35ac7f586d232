//! A ZooKeeper server of our own, and what it reports about itself.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::port::free_port;

/// A standalone ZooKeeper server of our own (Debian's `zookeeper` package,
/// run with `java`) on `127.0.0.1:<free port>`, with a 100 ms tick so
/// sessions can be as short as 200 ms. Killed on drop.
#[derive(Debug)]
pub struct ZooKeeperServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

/// Where Debian's `zookeeper` package puts the server.
pub(crate) const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
const ZOOKEEPER_CLASSPATH: &str = "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar";
/// A logging backend for the server's slf4j: without it the server logs
/// nothing at all. Debian's libslf4j-java, which the zookeeper package
/// pulls in.
const SLF4J_SIMPLE: &str = "/usr/share/java/slf4j-simple.jar";

/// Starts one ZooKeeper server JVM on `cfg` (128 MB heap). With `log`, the
/// server's INFO log is appended there; otherwise it is discarded.
pub(crate) fn spawn_zookeeper(cfg: &std::path::Path, log: Option<&std::path::Path>) -> Child {
    // Appends, so a restarted server's log follows its earlier life.
    let stderr = log
        .and_then(|log| std::fs::OpenOptions::new().create(true).append(true).open(log).ok())
        .map_or_else(Stdio::null, Stdio::from);
    Command::new("java")
        .args(["-Xmx128m", "-XX:+UseSerialGC", "-Dzookeeper.admin.enableServer=false"])
        // A member whose election messages went unanswered (a peer not yet
        // listening, a healed partition) asks again after a back-off that
        // doubles up to 60 s by default: an ensemble could take minutes to
        // form on a busy machine. One second is plenty on loopback.
        .arg("-Dzookeeper.fastleader.maxNotificationInterval=1000")
        .args(["-Dorg.slf4j.simpleLogger.showDateTime=true", "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS"])
        .args(["-cp", &format!("{ZOOKEEPER_CLASSPATH}:{SLF4J_SIMPLE}")])
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(cfg)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start ZooKeeper with java ({e}); run `bash scripts/test.sh`"))
}

/// Sends a four-letter word to a ZooKeeper server and returns its answer.
pub(crate) fn zookeeper_answers(port: u16, word: &[u8]) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(word).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer)
}

impl ZooKeeperServer {
    /// Starts a server and waits until it serves clients.
    ///
    /// # Panics
    ///
    /// When Java or the `zookeeper` package is missing, or the server does
    /// not come up within 30 s.
    pub fn start() -> Self {
        assert!(
            std::path::Path::new(ZOOKEEPER_JAR).exists(),
            "ZooKeeper is not installed. The tests need a real server: run the README's test command \
             (`bash scripts/test.sh`), which installs it, or `apt-get install -y zookeeper`."
        );
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("dlock-zk-{}-{port}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).expect("create a data directory for ZooKeeper");
        let cfg = format!(
            "tickTime=100\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
             minSessionTimeout=200\nmaxSessionTimeout=60000\nadmin.enableServer=false\n\
             4lw.commands.whitelist=ruok,stat,srvr,mntr\nznode.container.checkIntervalMs=1000\n",
            dir.join("data").display()
        );
        std::fs::write(dir.join("zoo.cfg"), cfg).expect("write zoo.cfg");
        let mut server = ZooKeeperServer { child: None, port, dir };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        self.child = Some(spawn_zookeeper(&self.dir.join("zoo.cfg"), None));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.is_ok() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("ZooKeeper on port {} exited at start ({status}); is the port taken?", self.port);
            }
            assert!(Instant::now() < deadline, "ZooKeeper on port {} did not come up within 60 s", self.port);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether it serves clients: `srvr` names its mode only then. `ruok`
    /// answers `imok` as soon as the process runs, before its data is
    /// loaded, when it still closes every session it is asked for (a
    /// loaded machine's tests then failed to connect).
    fn is_ok(&self) -> bool {
        zookeeper_answers(self.port, b"srvr").is_some_and(|a| a.contains("Mode: "))
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL (its data directory stays).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's own metrics (the `mntr` four-letter word), as
    /// `zk_name -> value`: counted by the server, so independent of what a
    /// client believes it sent or received. ZooKeeper 3.6+ reports watch
    /// triggers there, e.g. `zk_sum_node_deleted_watch_count` (watchers
    /// fired by deletes so far).
    ///
    /// ```no_run
    /// let zk = dlock_testing::ZooKeeperServer::start();
    /// let m = zk.mntr().expect("mntr");
    /// assert_eq!(m["zk_server_state"], "standalone");
    /// ```
    ///
    /// # Errors
    ///
    /// When the server does not answer or answers with no metrics.
    pub fn mntr(&self) -> std::io::Result<BTreeMap<String, String>> {
        mntr(self.port)
    }

    /// Starts the server again on the same port with the same data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `mntr` on the server at `port`, parsed.
pub(crate) fn mntr(port: u16) -> std::io::Result<BTreeMap<String, String>> {
    let answer = zookeeper_answers(port, b"mntr").ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, format!("no mntr answer from port {port}"))
    })?;
    let metrics = parse_mntr(&answer);
    if metrics.is_empty() {
        // A server outside a quorum answers "This ZooKeeper instance is not currently serving requests".
        return Err(std::io::Error::other(format!("mntr on port {port}: {}", answer.trim())));
    }
    Ok(metrics)
}

/// Parses `mntr` output: one `name<TAB>value` per line.
///
/// ```
/// let m = dlock_testing::parse_mntr("zk_server_state\tleader\nzk_watch_count\t3\n");
/// assert_eq!(m["zk_watch_count"], "3");
/// ```
pub fn parse_mntr(answer: &str) -> BTreeMap<String, String> {
    answer
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once('\t')?;
            Some((name.trim().to_owned(), value.trim().to_owned()))
        })
        .collect()
}

/// Watchers fired so far on the server, by every kind of event (node
/// created, deleted, data changed, children changed): the sum of the
/// `zk_sum_node_*_watch_count` summaries of `mntr` (ZooKeeper 3.6+).
/// `None` when the server does not report them.
///
/// ```no_run
/// let zk = dlock_testing::ZooKeeperServer::start();
/// let before = dlock_testing::watches_fired(&zk.mntr().expect("mntr")).expect("ZooKeeper 3.6+");
/// // … clients set watches and change nodes …
/// let fired = dlock_testing::watches_fired(&zk.mntr().expect("mntr")).expect("ZooKeeper 3.6+") - before;
/// ```
pub fn watches_fired(metrics: &BTreeMap<String, String>) -> Option<u64> {
    ["created", "deleted", "changed", "children"]
        .iter()
        .map(|kind| metrics.get(&format!("zk_sum_node_{kind}_watch_count"))?.parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_mntr_and_sums_watch_triggers() {
        let s = "zk_version\t3.8.0-1, built on x\nzk_server_state\tleader\n\
                 zk_sum_node_created_watch_count\t1\nzk_sum_node_deleted_watch_count\t40\n\
                 zk_sum_node_changed_watch_count\t0\nzk_sum_node_children_watch_count\t2\n";
        let m = super::parse_mntr(s);
        assert_eq!(m["zk_server_state"], "leader");
        assert_eq!(super::watches_fired(&m), Some(43));
        assert_eq!(super::watches_fired(&super::parse_mntr("zk_server_state\tleader\n")), None);
    }
}
