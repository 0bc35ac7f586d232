//! Real servers for dlock's tests and benchmarks, started on free loopback
//! ports and stopped when dropped.
//!
//! A missing server binary is a test failure with instructions, never a
//! skip: the README's test command installs what is needed.
//!
//! ```no_run
//! let redis = dlock_testing::RedisServer::start();
//! let url = redis.url();
//! // ... point the code under test at `url` ...
//! assert!(redis.command_calls("evalsha") == 0);
//! ```

mod announce;
mod ensemble;
mod proxy;
mod tls;
mod zk_proxy;

pub use announce::announced_address;
pub use ensemble::ZooKeeperEnsemble;
pub use proxy::FaultProxy;
pub use tls::{TestCertificates, TlsRedisServer};
pub use zk_proxy::{Hangup, ZooKeeperProxy, CREATE_CONTAINER, CREATE_OP_CODES, DELETE, GET_CHILDREN, GET_CHILDREN2};

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` process of our own on `127.0.0.1:<free port>`, without
/// persistence unless asked. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

/// A free TCP port on loopback, for a server started in another process.
///
/// The port comes from below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`). A port from inside that range, bound
/// and released, can be handed out again as the source port of any outgoing
/// connection (another test's client) in the second before the server binds
/// it, and the server then fails to start; a port below the range is never
/// handed out that way. Calls in one process never return the same port, and
/// each candidate is checked with a bind first.
///
/// ```no_run
/// let port = dlock_testing::free_port();
/// assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
/// ```
pub fn free_port() -> u16 {
    pick_port(0)
}

/// A free port whose `port + offset` is free too (Redis Cluster's bus port
/// is the client port + 10000), both below the ephemeral range.
fn pick_port(offset: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;
    static RANGE: OnceLock<Option<(u16, u16)>> = OnceLock::new();
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let Some((low, high)) = *RANGE.get_or_init(ports_outside_the_ephemeral_range) else {
        return kernel_port(offset);
    };
    let span = u32::from(high.saturating_sub(offset).saturating_sub(low));
    if span < 1000 {
        return kernel_port(offset);
    }
    // A different starting point per process, so two test processes on one
    // machine rarely try the same ports.
    let next = NEXT.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        AtomicU32::new(nanos ^ std::process::id().wrapping_mul(2_654_435_761))
    });
    for _ in 0..span {
        let candidate = low + u16::try_from(next.fetch_add(1, Ordering::Relaxed) % span).unwrap_or(0);
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(candidate) && (offset == 0 || free(candidate + offset)) {
            return candidate;
        }
    }
    panic!("no free loopback port between {low} and {}", high - offset)
}

/// The ports from 10000 up to the start of the ephemeral range, or above
/// its end when it starts too low; `None` when neither leaves room (or the
/// range cannot be read), and ports then come from the kernel.
fn ports_outside_the_ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(first)), Some(Ok(last))) = (bounds.next(), bounds.next()) else { return None };
    if first >= 21_000 {
        Some((10_000, first))
    } else if last <= 54_000 {
        Some((last + 1, u16::MAX))
    } else {
        None
    }
}

/// A port the kernel picks (bound to 0, then released): the fallback when
/// no ports lie outside the ephemeral range.
fn kernel_port(offset: u16) -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
        let port = listener.local_addr().expect("local address of a bound listener").port();
        if offset == 0 || port.checked_add(offset).is_some_and(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return port;
        }
    }
}

impl RedisServer {
    /// Starts a server with no persistence.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or does not come up within 10 s.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments (e.g.
    /// `["--appendonly", "yes"]`).
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`].
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_on(free_port(), extra)
    }

    fn start_on(port: u16, extra: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!("dlock-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a data directory for redis-server");
        let mut server = RedisServer { child: None, port, dir, extra: extra.iter().map(|s| s.to_string()).collect() };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => panic!(
                "cannot start redis-server ({e}). The tests need a real Redis: run the README's test \
                 command (`bash scripts/test.sh`), which installs it, or `apt-get install -y redis-server`."
            ),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = self.try_connection() {
                if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                    return;
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("redis-server on port {} exited at start ({status}); is the port taken?", self.port);
            }
            assert!(Instant::now() < deadline, "redis-server on port {} did not come up within 10 s", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_connection(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        client.get_connection_with_timeout(Duration::from_millis(500))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A plain synchronous connection for assertions.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub fn connection(&self) -> redis::Connection {
        self.try_connection().expect("connect to the test redis-server")
    }

    /// Kills the server with SIGKILL (data without persistence is gone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server cleanly with `SHUTDOWN` (an AOF is flushed and
    /// fsynced; without persistence the data is gone all the same), falling
    /// back to SIGKILL when it does not exit within 10 s.
    pub fn shutdown(&mut self) {
        if let Ok(mut conn) = self.try_connection() {
            // The server closes the connection instead of answering.
            let _ = redis::cmd("SHUTDOWN").query::<()>(&mut conn);
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server after [`kill`](Self::kill) or
    /// [`shutdown`](Self::shutdown), on the same port and data directory.
    pub fn start_again(&mut self) {
        if self.child.is_none() {
            self.spawn();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `INFO commandstats` as `command -> calls` (lower-case names).
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub fn command_stats(&self) -> HashMap<String, u64> {
        let info: String = redis::cmd("INFO").arg("commandstats").query(&mut self.connection()).expect("INFO");
        parse_command_stats(&info)
    }

    /// Calls of one command so far (`evalsha`, `subscribe`, …).
    pub fn command_calls(&self, command: &str) -> u64 {
        self.command_stats().get(command).copied().unwrap_or(0)
    }

    /// Resets `INFO commandstats`.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub fn reset_stats(&self) {
        let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut self.connection()).expect("CONFIG RESETSTAT");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of our own: `masters` redis-servers on loopback with
/// cluster mode on, joined by `redis-cli --cluster create` (no replicas).
#[derive(Debug)]
pub struct RedisCluster {
    /// The masters, to kill or inspect one.
    pub nodes: Vec<RedisServer>,
}

/// A free port whose cluster-bus port (+10000) is free too.
fn free_cluster_port() -> u16 {
    pick_port(10_000)
}

impl RedisCluster {
    /// Starts and joins the masters, waiting until the cluster reports `ok`.
    ///
    /// # Panics
    ///
    /// When redis-server or redis-cli is missing or the cluster does not form.
    pub fn start(masters: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                let port = free_cluster_port();
                RedisServer::start_on(
                    port,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run redis-cli ({e}); it comes with redis-server: run `bash scripts/test.sh`")
            });
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            loop {
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut node.connection()).unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "the cluster did not reach state ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes }
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`, the form dlock accepts.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The index of the master that serves `key`'s slot.
    ///
    /// # Panics
    ///
    /// When no master claims the slot.
    pub fn node_for(&self, key: &str) -> usize {
        let slot: u16 =
            redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut self.nodes[0].connection()).expect("KEYSLOT");
        let slots: Vec<Vec<redis::Value>> =
            redis::cmd("CLUSTER").arg("SLOTS").query(&mut self.nodes[0].connection()).expect("SLOTS");
        for range in slots {
            let (Some(redis::Value::Int(lo)), Some(redis::Value::Int(hi)), Some(redis::Value::Array(master))) =
                (range.first(), range.get(1), range.get(2))
            else {
                continue;
            };
            if (*lo..=*hi).contains(&i64::from(slot)) {
                if let Some(redis::Value::Int(port)) = master.get(1) {
                    return self.nodes.iter().position(|n| i64::from(n.port()) == *port).expect("a known master");
                }
            }
        }
        panic!("no master serves slot {slot}");
    }
}

/// A master, a replica and one Sentinel watching them (quorum 1, the
/// master declared down after 500 ms), all on loopback.
#[derive(Debug)]
pub struct RedisSentinel {
    /// The master at start (after a failover it may be a replica or gone).
    pub master: RedisServer,
    /// The replica at start.
    pub replica: RedisServer,
    sentinel: Option<Child>,
    sentinel_port: u16,
    dir: PathBuf,
}

impl RedisSentinel {
    /// The name the Sentinel knows the master by.
    pub const MASTER_NAME: &'static str = "dlockmaster";

    /// Starts the three processes and waits until the Sentinel names the master.
    ///
    /// # Panics
    ///
    /// When redis-server is missing or the Sentinel does not come up.
    pub fn start() -> Self {
        let master = RedisServer::start();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
        let sentinel_port = free_port();
        let dir = std::env::temp_dir().join(format!("dlock-sentinel-{}-{sentinel_port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a directory for the Sentinel");
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {name} 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds {name} 500\n\
                 sentinel failover-timeout {name} 2000\n",
                dir.display(),
                master.port(),
                name = Self::MASTER_NAME,
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server --sentinel ({e}); run `bash scripts/test.sh`"));
        let sentinel = RedisSentinel { master, replica, sentinel: Some(child), sentinel_port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.master_port().is_none() {
            assert!(Instant::now() < deadline, "the Sentinel did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        sentinel
    }

    /// `redis+sentinel://127.0.0.1:<sentinel port>/dlockmaster`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{}", self.sentinel_port, Self::MASTER_NAME)
    }

    /// The port of the server the Sentinel currently names as master.
    pub fn master_port(&self) -> Option<u16> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.sentinel_port)).ok()?;
        let mut conn = client.get_connection_with_timeout(Duration::from_millis(500)).ok()?;
        let addr: Vec<String> =
            redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(Self::MASTER_NAME).query(&mut conn).ok()?;
        addr.get(1)?.parse().ok()
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
const ZOOKEEPER_CLASSPATH: &str = "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar";
/// A logging backend for the server's slf4j: without it the server logs
/// nothing at all. Debian's libslf4j-java, which the zookeeper package
/// pulls in.
const SLF4J_SIMPLE: &str = "/usr/share/java/slf4j-simple.jar";

/// Starts one ZooKeeper server JVM on `cfg` (128 MB heap). With `log`, the
/// server's INFO log is appended there; otherwise it is discarded.
fn spawn_zookeeper(cfg: &std::path::Path, log: Option<&std::path::Path>) -> Child {
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
fn zookeeper_answers(port: u16, word: &[u8]) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(word).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer)
}

impl ZooKeeperServer {
    /// Starts a server and waits until it answers `ruok`.
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

    fn is_ok(&self) -> bool {
        zookeeper_answers(self.port, b"ruok").as_deref() == Some("imok")
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
fn mntr(port: u16) -> std::io::Result<BTreeMap<String, String>> {
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

/// Parses `cmdstat_get:calls=3,usec=…` lines.
pub fn parse_command_stats(info: &str) -> HashMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("cmdstat_")?;
            let (name, fields) = rest.split_once(':')?;
            let calls = fields.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_commandstats() {
        let s =
            "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=3,usec_per_call=0.25\r\ncmdstat_ping:calls=1,usec=0\r\n";
        let m = super::parse_command_stats(s);
        assert_eq!(m["evalsha"], 12);
        assert_eq!(m["ping"], 1);
    }

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

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let range =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").expect("read the ephemeral range");
        let bounds: Vec<u16> = range.split_whitespace().map(|b| b.parse().expect("a port")).collect();
        let outside = |p: u16| p < bounds[0] || p > bounds[1];
        let ports: Vec<u16> = (0..200).map(|_| super::free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "no port handed out twice");
        for p in ports {
            assert!(outside(p), "{p} lies in the ephemeral range {range}");
            assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok(), "{p} is free");
        }
        let cluster = super::free_cluster_port();
        assert!(outside(cluster) && outside(cluster + 10_000), "{cluster} and its bus port lie outside {range}");
    }
}
