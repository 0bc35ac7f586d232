//! A ZooKeeper ensemble of three JVMs on loopback.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, zookeeper_answers, ZOOKEEPER_CLASSPATH, ZOOKEEPER_JAR};

/// `size` ZooKeeper servers (Debian's package, 128 MB heap each) forming one
/// ensemble on loopback, with a 100 ms tick. Killed on drop.
///
/// ```no_run
/// let mut zk = dlock_testing::ZooKeeperEnsemble::start(3);
/// let connect = zk.connect_string(); // "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
/// zk.kill(0);                        // a minority down: the ensemble still serves
/// ```
#[derive(Debug)]
pub struct ZooKeeperEnsemble {
    members: Vec<Member>,
    dir: PathBuf,
}

#[derive(Debug)]
struct Member {
    child: Option<Child>,
    client_port: u16,
    cfg: PathBuf,
}

impl ZooKeeperEnsemble {
    /// Starts the servers and waits until every one serves clients (`stat`
    /// answers with a mode, so a leader was elected).
    ///
    /// # Panics
    ///
    /// When Java or the `zookeeper` package is missing, or the ensemble does
    /// not form within 60 s.
    pub fn start(size: usize) -> Self {
        assert!(
            std::path::Path::new(ZOOKEEPER_JAR).exists(),
            "ZooKeeper is not installed. The tests need a real server: run the README's test command \
             (`bash scripts/test.sh`), which installs it, or `apt-get install -y zookeeper`."
        );
        let dir = std::env::temp_dir().join(format!("dlock-zk-ensemble-{}-{}", std::process::id(), free_port()));
        let ports: Vec<(u16, u16, u16)> = (0..size).map(|_| (free_port(), free_port(), free_port())).collect();
        let servers: String = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer, election))| format!("server.{}=127.0.0.1:{peer}:{election}\n", i + 1))
            .collect();
        let mut members = Vec::new();
        for (i, (client, _, _)) in ports.iter().enumerate() {
            let data = dir.join(format!("data-{}", i + 1));
            std::fs::create_dir_all(&data).expect("create a data directory for ZooKeeper");
            std::fs::write(data.join("myid"), format!("{}\n", i + 1)).expect("write myid");
            let cfg = dir.join(format!("zoo-{}.cfg", i + 1));
            std::fs::write(
                &cfg,
                format!(
                    "tickTime=100\ninitLimit=100\nsyncLimit=50\ndataDir={}\nclientPort={client}\n\
                     clientPortAddress=127.0.0.1\nminSessionTimeout=200\nmaxSessionTimeout=60000\n\
                     admin.enableServer=false\n4lw.commands.whitelist=ruok,stat,srvr\n\
                     znode.container.checkIntervalMs=1000\n{servers}",
                    data.display()
                ),
            )
            .expect("write zoo.cfg");
            members.push(Member { child: None, client_port: *client, cfg });
        }
        let mut ensemble = ZooKeeperEnsemble { members, dir };
        for i in 0..size {
            ensemble.spawn(i);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for i in 0..size {
            while !ensemble.serves(i) {
                assert!(Instant::now() < deadline, "the ZooKeeper ensemble did not form within 60 s");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        ensemble
    }

    fn spawn(&mut self, i: usize) {
        let m = &mut self.members[i];
        let child = Command::new("java")
            .args(["-Xmx128m", "-XX:+UseSerialGC", "-Dzookeeper.admin.enableServer=false", "-cp", ZOOKEEPER_CLASSPATH])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&m.cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start ZooKeeper with java ({e}); run `bash scripts/test.sh`"));
        m.child = Some(child);
    }

    /// Whether member `i` serves clients: `srvr` names its mode only when it
    /// is a leader or a follower of a formed quorum.
    fn serves(&self, i: usize) -> bool {
        zookeeper_answers(self.members[i].client_port, b"srvr").is_some_and(|a| a.contains("Mode: "))
    }

    /// `127.0.0.1:p1,127.0.0.1:p2,…`.
    pub fn connect_string(&self) -> String {
        let hosts: Vec<String> = self.members.iter().map(|m| format!("127.0.0.1:{}", m.client_port)).collect();
        hosts.join(",")
    }

    /// The client port of member `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// Kills member `i` with SIGKILL (its data stays).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again with its data and waits until it serves.
    ///
    /// # Panics
    ///
    /// When it does not rejoin within 60 s.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.serves(i) {
            assert!(Instant::now() < deadline, "ZooKeeper member {i} did not rejoin within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for ZooKeeperEnsemble {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
