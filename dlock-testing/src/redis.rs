//! Redis servers of our own: one server, a cluster, a Sentinel set.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::port::{free_cluster_port, free_port};

/// A `redis-server` process of our own on `127.0.0.1:<free port>`, without
/// persistence unless asked. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
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
            if let Ok(mut conn) = self.try_connection()
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return;
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

    /// The process id of the running server (`None` after a kill).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
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
            if (*lo..=*hi).contains(&i64::from(slot))
                && let Some(redis::Value::Int(port)) = master.get(1)
            {
                return self.nodes.iter().position(|n| i64::from(n.port()) == *port).expect("a known master");
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
}
