//! A ZooKeeper ensemble of three JVMs on loopback.

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use crate::port::free_port;
use crate::proxy::Greeting;
use crate::zookeeper::{spawn_zookeeper, zookeeper_answers, ZOOKEEPER_JAR};
use crate::FaultProxy;

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
    /// The peer links of [`ZooKeeperEnsemble::start_partitionable`]: every
    /// connection member `from` opens to member `to` (quorum and election
    /// port) goes through one of these.
    links: Vec<Link>,
}

/// The proxies member `from` reaches member `to`'s peer ports through.
#[derive(Debug)]
struct Link {
    from: usize,
    to: usize,
    quorum: FaultProxy,
    election: FaultProxy,
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
    /// When Java or the `zookeeper` package is missing, when the ensemble
    /// does not form within 90 s, or when a member exits at start in each of
    /// three attempts (each on new ports).
    pub fn start(size: usize) -> Self {
        Self::start_with(size, false)
    }

    /// Like [`ZooKeeperEnsemble::start`], but each member reaches every
    /// other member's quorum and election ports through a [`FaultProxy`] of
    /// its own (one per direction, pair and port), so
    /// [`ZooKeeperEnsemble::isolate`] can cut a member off from its peers
    /// while clients still reach it: a leader isolated in its own
    /// partition, without network namespaces or root.
    ///
    /// ```no_run
    /// let zk = dlock_testing::ZooKeeperEnsemble::start_partitionable(3);
    /// let leader = zk.leader().expect("a formed ensemble has a leader");
    /// zk.isolate(leader);     // the others elect a new leader
    /// zk.heal();              // the old one rejoins as a follower
    /// ```
    ///
    /// # Panics
    ///
    /// As [`ZooKeeperEnsemble::start`].
    pub fn start_partitionable(size: usize) -> Self {
        Self::start_with(size, true)
    }

    fn start_with(size: usize, partitionable: bool) -> Self {
        // A member that exits while starting has almost always lost one of
        // its ports to another process in the second between our check and
        // its bind; a new ensemble on new ports gets past that.
        let mut exits = Vec::new();
        for _ in 0..3 {
            let ports = (0..size).map(|_| (free_port(), free_port(), free_port())).collect();
            let mut ensemble = Self::launch(ports, partitionable);
            match ensemble.form(Duration::from_secs(90)) {
                Ok(()) => return ensemble,
                Err(exit) => exits.push(exit),
            }
        }
        panic!("the ZooKeeper ensemble did not start in three attempts:\n{}", exits.join("\n"))
    }

    /// Writes the members' configurations and starts every member, one per
    /// entry of `ports` (client, quorum, election).
    fn launch(ports: Vec<(u16, u16, u16)>, partitionable: bool) -> Self {
        assert!(
            std::path::Path::new(ZOOKEEPER_JAR).exists(),
            "ZooKeeper is not installed. The tests need a real server: run the README's test command \
             (`bash scripts/test.sh`), which installs it, or `apt-get install -y zookeeper`."
        );
        let size = ports.len();
        let dir = std::env::temp_dir().join(format!("dlock-zk-ensemble-{}-{}", std::process::id(), free_port()));
        let mut links = Vec::new();
        if partitionable {
            // Where each link's receiver is told to dial the sender back:
            // the proxy of the opposite link, filled in once it exists.
            let mut dial_back = Vec::new();
            for from in 0..size {
                for (to, (_, peer, election)) in ports.iter().enumerate() {
                    if from != to {
                        let back = Arc::new(AtomicU16::new(0));
                        let election = FaultProxy::start_link(*election, Some(election_greeting(back.clone())));
                        links.push(Link { from, to, quorum: FaultProxy::start_link(*peer, None), election });
                        dial_back.push((from, to, back));
                    }
                }
            }
            for (from, to, back) in dial_back {
                if let Some(l) = links.iter().find(|l| l.from == to && l.to == from) {
                    back.store(l.election.port(), Ordering::SeqCst);
                }
            }
        }
        let mut members = Vec::new();
        for (i, (client, _, _)) in ports.iter().enumerate() {
            // Member i binds its own peer ports and dials the others at
            // their proxies (or directly when there are none).
            let servers: String = ports
                .iter()
                .enumerate()
                .map(|(j, (_, peer, election))| {
                    let (peer, election) = links
                        .iter()
                        .find(|l| l.from == i && l.to == j)
                        .map_or((*peer, *election), |l| (l.quorum.port(), l.election.port()));
                    format!("server.{}=127.0.0.1:{peer}:{election}\n", j + 1)
                })
                .collect();
            let data = dir.join(format!("data-{}", i + 1));
            std::fs::create_dir_all(&data).expect("create a data directory for ZooKeeper");
            std::fs::write(data.join("myid"), format!("{}\n", i + 1)).expect("write myid");
            let cfg = dir.join(format!("zoo-{}.cfg", i + 1));
            std::fs::write(
                &cfg,
                format!(
                    "tickTime=100\ninitLimit=100\nsyncLimit=50\ndataDir={}\nclientPort={client}\n\
                     clientPortAddress=127.0.0.1\nminSessionTimeout=200\nmaxSessionTimeout=60000\n\
                     admin.enableServer=false\n4lw.commands.whitelist=ruok,stat,srvr,mntr\n\
                     znode.container.checkIntervalMs=1000\n{servers}",
                    data.display()
                ),
            )
            .expect("write zoo.cfg");
            members.push(Member { child: None, client_port: *client, cfg });
        }
        let mut ensemble = ZooKeeperEnsemble { members, dir, links };
        for i in 0..size {
            ensemble.spawn(i);
        }
        ensemble
    }

    /// Waits, at start, until every member serves and one leads.
    ///
    /// # Errors
    ///
    /// When a member's process exits meanwhile: the member and the last
    /// records it logged.
    ///
    /// # Panics
    ///
    /// When the ensemble does not form within `within`.
    fn form(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            for i in 0..self.members.len() {
                if let Some(Ok(Some(status))) = self.members[i].child.as_mut().map(Child::try_wait) {
                    return Err(format!("member {i} exited at start ({status}):\n{}", self.log_tail(i, 40)));
                }
            }
            if (0..self.members.len()).all(|i| self.serves(i)) && self.leader().is_some() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                panic!("the ZooKeeper ensemble did not form within {within:?}\n{}", self.report());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every member's mode and last log records, for a failure message.
    pub fn report(&self) -> String {
        (0..self.members.len())
            .map(|i| format!("member {i} ({:?}), last log records:\n{}", self.mode(i), self.log_tail(i, 40)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn spawn(&mut self, i: usize) {
        let log = self.log_path(i);
        let m = &mut self.members[i];
        m.child = Some(spawn_zookeeper(&m.cfg, Some(&log)));
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.join(format!("member-{i}.log"))
    }

    /// The last `lines` records member `i`'s server logged (INFO and up,
    /// without stack traces), for a failing test to show why the ensemble
    /// misbehaved; empty when nothing was logged.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let all = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
        let records = all.lines().filter(|l| l.starts_with(|c: char| c.is_ascii_digit()));
        let kept: Vec<&str> = records.rev().take(lines).collect();
        kept.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Whether member `i` serves clients: `srvr` names its mode only when it
    /// is a leader or a follower of a formed quorum.
    fn serves(&self, i: usize) -> bool {
        zookeeper_answers(self.members[i].client_port, b"srvr").is_some_and(|a| a.contains("Mode: "))
    }

    /// Member `i`'s role as `srvr` names it (`leader`, `follower`), or
    /// `None` while it serves no clients (looking for a leader, isolated
    /// from a quorum, or down).
    pub fn mode(&self, i: usize) -> Option<String> {
        let answer = zookeeper_answers(self.members[i].client_port, b"srvr")?;
        answer.lines().find_map(|l| l.strip_prefix("Mode: ")).map(|m| m.trim().to_owned())
    }

    /// The member that is leader now, if exactly one says so.
    pub fn leader(&self) -> Option<usize> {
        let leaders: Vec<usize> =
            (0..self.members.len()).filter(|&i| self.mode(i).as_deref() == Some("leader")).collect();
        match leaders[..] {
            [one] => Some(one),
            _ => None,
        }
    }

    /// Member `i`'s `mntr` metrics (see [`crate::ZooKeeperServer::mntr`]).
    ///
    /// # Errors
    ///
    /// When the member does not answer, or serves no clients.
    pub fn mntr(&self, i: usize) -> std::io::Result<BTreeMap<String, String>> {
        crate::zookeeper::mntr(self.members[i].client_port)
    }

    /// Cuts member `i` off from every other member, both ways, on the
    /// quorum and the election ports: its peer connections are closed and
    /// new ones refused until [`ZooKeeperEnsemble::heal`]. Its client port
    /// stays reachable. Only for an ensemble from
    /// [`ZooKeeperEnsemble::start_partitionable`].
    ///
    /// # Panics
    ///
    /// When the ensemble was started without peer proxies.
    pub fn isolate(&self, i: usize) {
        assert!(!self.links.is_empty(), "isolate needs ZooKeeperEnsemble::start_partitionable");
        for l in self.links.iter().filter(|l| l.from == i || l.to == i) {
            l.quorum.cut();
            l.election.cut();
        }
    }

    /// Lets every peer connection through again.
    pub fn heal(&self) {
        for l in &self.links {
            l.quorum.heal();
            l.election.heal();
        }
    }

    /// Waits until every member serves clients (at start, or again after a
    /// partition) and one is leader; returns the leader.
    ///
    /// # Panics
    ///
    /// When that does not happen within `within`.
    pub fn wait_formed(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            if (0..self.members.len()).all(|i| self.serves(i))
                && let Some(leader) = self.leader()
            {
                return leader;
            }
            if Instant::now() >= deadline {
                panic!("the ZooKeeper ensemble did not form within {within:?}\n{}", self.report());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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

/// Rewrites the address in ZooKeeper's election handshake. A server that
/// receives a connection from a peer with a lower id closes it and dials
/// back the address the peer sent in its `InitialMessage` (`long version,
/// long sid, int length, "host:port"`), not the one its own config names
/// for that peer; left alone, that dial-back would bypass the proxies.
/// Older handshakes (a non-negative version: the sid alone) pass unchanged.
fn election_greeting(dial_back: Arc<AtomicU16>) -> Greeting {
    Arc::new(move |client: &mut TcpStream| {
        let mut version = [0u8; 8];
        client.read_exact(&mut version)?;
        let mut out = version.to_vec();
        if i64::from_be_bytes(version) >= 0 {
            return Ok(out);
        }
        let mut sid = [0u8; 8];
        client.read_exact(&mut sid)?;
        out.extend_from_slice(&sid);
        let mut len = [0u8; 4];
        client.read_exact(&mut len)?;
        // ZooKeeper itself refuses addresses longer than 4096 bytes.
        let len = usize::try_from(i32::from_be_bytes(len))
            .ok()
            .filter(|n| *n <= 4096)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad election handshake"))?;
        let mut addr = vec![0u8; len];
        client.read_exact(&mut addr)?;
        let ours = format!("127.0.0.1:{}", dial_back.load(Ordering::SeqCst));
        let ours_len = i32::try_from(ours.len()).map_err(|_| std::io::Error::other("address too long"))?;
        out.extend_from_slice(&ours_len.to_be_bytes());
        out.extend_from_slice(ours.as_bytes());
        Ok(out)
    })
}

impl Drop for ZooKeeperEnsemble {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::AtomicU16;
    use std::sync::Arc;

    use std::time::Duration;

    use super::{election_greeting, ZooKeeperEnsemble};
    use crate::free_port;

    fn greet(bytes: Vec<u8>, dial_back: u16) -> std::io::Result<Vec<u8>> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let writer =
            std::thread::spawn(move || TcpStream::connect(addr).expect("connect").write_all(&bytes).expect("write"));
        let (mut s, _) = listener.accept().expect("accept");
        writer.join().expect("writer");
        election_greeting(Arc::new(AtomicU16::new(dial_back)))(&mut s)
    }

    #[test]
    fn a_member_that_cannot_bind_its_port_is_reported_at_once() {
        let _starting = crate::port::SERVERS_STARTING.lock().unwrap_or_else(|p| p.into_inner());
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = taken.local_addr().expect("addr").port();
        let ports = vec![(port, free_port(), free_port()), (free_port(), free_port(), free_port())];
        let started = std::time::Instant::now();
        let mut ensemble = ZooKeeperEnsemble::launch(ports, false);
        let exit = ensemble.form(Duration::from_secs(60)).expect_err("member 0's client port is taken");
        assert!(exit.starts_with("member 0 exited at start"), "{exit}");
        assert!(started.elapsed() < Duration::from_secs(30), "reported before the deadline: {exit}");
    }

    #[test]
    fn the_election_handshake_names_the_proxy_to_dial_back() {
        let mut hello = (-65535i64).to_be_bytes().to_vec();
        hello.extend_from_slice(&3i64.to_be_bytes());
        let addr = b"127.0.0.1:40123";
        hello.extend_from_slice(&(addr.len() as i32).to_be_bytes());
        hello.extend_from_slice(addr);
        let out = greet(hello.clone(), 5555).expect("a well-formed handshake");
        assert_eq!(&out[..16], &hello[..16], "version and sid pass unchanged");
        assert_eq!(i32::from_be_bytes(out[16..20].try_into().expect("4 bytes")), 14);
        assert_eq!(&out[20..], b"127.0.0.1:5555");

        // The old protocol sends the sid alone.
        assert_eq!(greet(3i64.to_be_bytes().to_vec(), 5555).expect("old handshake"), 3i64.to_be_bytes());
        // A length out of range ends the connection.
        let mut bad = (-65535i64).to_be_bytes().to_vec();
        bad.extend_from_slice(&3i64.to_be_bytes());
        bad.extend_from_slice(&(-1i32).to_be_bytes());
        assert!(greet(bad, 5555).is_err());
    }
}
