//! A TCP proxy that speaks enough of the ZooKeeper wire protocol to lose
//! one reply on purpose: the create whose reply never comes back
//! (ZOOKEEPER-1262). A plain byte pipe cannot do this, because the fault
//! must fall after the server has applied the request and before the client
//! hears of it.
//!
//! The protocol is jute records in frames of a 4-byte big-endian length and
//! a payload. The client's first frame is the `ConnectRequest` and the
//! server's first is the `ConnectResponse`; after that every request starts
//! with `RequestHeader { xid: i32, type: i32 }` and every reply with
//! `ReplyHeader { xid: i32, zxid: i64, err: i32 }` (xid -1 is a watch
//! notification, -2 a ping).

use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::accept;

/// ZooKeeper's request types that create a node: `create` (1), `create2`
/// (15, what zookeeper-client 0.11 sends for every non-TTL, non-container
/// create, ephemeral sequential included), `createContainer` (19) and
/// `createTTL` (21). `multi` (14) is not inspected.
pub const CREATE_OP_CODES: [i32; 4] = [1, 15, 19, 21];

/// ZooKeeper's `createContainer` request type (19), the create of a lock's
/// parent node, for [`ZooKeeperProxy::drop_replies`].
pub const CREATE_CONTAINER: i32 = 19;

/// ZooKeeper's `delete` request type (2), for
/// [`ZooKeeperProxy::drop_replies`].
pub const DELETE: i32 = 2;

/// ZooKeeper's `getChildren` request type (8), what zookeeper-client's
/// `list_children` sends, for [`ZooKeeperProxy::requests_of`].
pub const GET_CHILDREN: i32 = 8;

/// ZooKeeper's `getChildren2` request type (12, children with the parent's
/// stat), for [`ZooKeeperProxy::requests_of`].
pub const GET_CHILDREN2: i32 = 12;

/// How the proxy ends a connection whose reply it swallowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hangup {
    /// An orderly close (FIN) both ways: the client reads end-of-stream.
    Close,
    /// A reset (RST, `SO_LINGER` 0) towards the client, which reads
    /// `ECONNRESET`, the way a crashed middlebox or server looks; the
    /// server side is closed.
    Reset,
}

/// Frames longer than this end the connection: ZooKeeper's own limit
/// (`jute.maxbuffer`) is 1 MiB by default, so a bigger length means the
/// stream is out of step, not that a big record is coming.
const MAX_FRAME: usize = 16 << 20;

/// Forwards `127.0.0.1:<port()>` to a ZooKeeper server and, when armed with
/// [`ZooKeeperProxy::drop_create_replies`], loses the replies of the next
/// creates: the request reaches the server (so the node *is* created), and
/// when its reply comes back the proxy swallows it and closes both sides of
/// that connection. The client sees `ConnectionLoss` for a create that
/// happened, reconnects through the proxy and resumes the same session.
/// [`ZooKeeperProxy::drop_replies`] picks the request types and whether the
/// connection is closed or reset ([`Hangup`]). Stops on drop.
///
/// ```no_run
/// let zk = dlock_testing::ZooKeeperServer::start();
/// let proxy = dlock_testing::ZooKeeperProxy::start(zk.port());
/// let connect = format!("127.0.0.1:{}", proxy.port()); // give this to the client under test
/// proxy.drop_create_replies(1);
/// // … the client creates a node: it exists, but the client got ConnectionLoss …
/// // Or lose the reply of the next create of a container node, with a reset:
/// proxy.drop_replies(&[dlock_testing::CREATE_CONTAINER], 1, dlock_testing::Hangup::Reset);
/// println!("{} replies lost", proxy.dropped_replies());
/// ```
#[derive(Debug)]
pub struct ZooKeeperProxy {
    port: u16,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    stopped: AtomicBool,
    /// Which replies to lose, first match wins.
    arms: Mutex<Vec<Arm>>,
    dropped: AtomicU64,
    /// Lost replies by request type.
    dropped_by_op: Mutex<HashMap<i32, u64>>,
    dropped_created: AtomicU64,
    creates: AtomicU64,
    /// Requests forwarded, by type.
    requests: Mutex<HashMap<i32, u64>>,
    /// Watch notifications (xid -1) passed to clients.
    notifications: AtomicU64,
    /// Of those, `NodeDeleted` for a node the same connection deleted.
    own_delete_notifications: AtomicU64,
    connections: AtomicU64,
    /// Both sockets of each open connection, to close them on drop.
    live: Mutex<HashMap<u64, [TcpStream; 2]>>,
}

impl Shared {
    fn live(&self) -> MutexGuard<'_, HashMap<u64, [TcpStream; 2]>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn arms(&self) -> MutexGuard<'_, Vec<Arm>> {
        self.arms.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one drop for a request of type `op`, if one is armed.
    fn take_drop(&self, op: i32) -> Option<Hangup> {
        let mut arms = self.arms();
        let arm = arms.iter_mut().find(|a| a.left > 0 && a.ops.contains(&op))?;
        arm.left -= 1;
        let how = arm.how;
        arms.retain(|a| a.left > 0);
        Some(how)
    }

    fn close(&self, id: u64, how: Hangup) {
        let Some([client, server]) = self.live().remove(&id) else { return };
        let _ = server.shutdown(Shutdown::Both);
        match how {
            Hangup::Close => {
                let _ = client.shutdown(Shutdown::Both);
            }
            Hangup::Reset => {
                // With linger 0 the last close of the socket sends RST. A
                // read shutdown sends nothing but wakes our own reader of
                // this socket, whose exit closes the last descriptor.
                let _ = socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO));
                let _ = client.shutdown(Shutdown::Read);
            }
        }
    }
}

/// Replies to lose: the next `left` requests whose type is in `ops`.
#[derive(Debug)]
struct Arm {
    ops: Vec<i32>,
    left: u64,
    how: Hangup,
}

/// One connection's state shared by its two directions: the requests
/// whose replies are to be lost, by xid, with their type; and the paths
/// this connection asked to delete, to tell a client's notification of its
/// own delete from one about somebody else's node.
#[derive(Debug, Default)]
struct Doomed {
    replies: Mutex<HashMap<i32, (i32, Hangup)>>,
    deleted: Mutex<HashSet<String>>,
}

impl Doomed {
    fn map(&self) -> MutexGuard<'_, HashMap<i32, (i32, Hangup)>> {
        self.replies.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn deleted(&self) -> MutexGuard<'_, HashSet<String>> {
        self.deleted.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ZooKeeperProxy {
    /// Starts forwarding a free loopback port to `127.0.0.1:<upstream>`.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound.
    pub fn start(upstream: u16) -> Self {
        let shared = Arc::new(Shared::default());
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream).into();
        let (s, stopped) = (shared.clone(), shared.clone());
        let port = accept::listen(
            move || stopped.stopped.load(Ordering::SeqCst),
            move |client| {
                let Some(server) = accept::dial(upstream, &client) else { return };
                let id = s.connections.fetch_add(1, Ordering::SeqCst);
                if let Err(e) = serve(&s, id, client, server) {
                    // Only a failed `try_clone` (out of descriptors) ends up here.
                    eprintln!("ZooKeeperProxy: cannot serve a connection: {e}");
                }
            },
        )
        .expect("bind a loopback port for the ZooKeeper proxy");
        ZooKeeperProxy { port, shared }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`, the connect string for the client under test.
    pub fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Loses the replies of the next `n` creates of any kind
    /// ([`CREATE_OP_CODES`]), closing the connection each time.
    pub fn drop_create_replies(&self, n: u64) {
        self.drop_replies(&CREATE_OP_CODES, n, Hangup::Close);
    }

    /// Loses the replies of the next `n` requests whose type is in `ops`
    /// and ends their connection as `how` says. Arms are used in the order
    /// they were set.
    pub fn drop_replies(&self, ops: &[i32], n: u64, how: Hangup) {
        if n > 0 {
            self.shared.arms().push(Arm { ops: ops.to_vec(), left: n, how });
        }
    }

    /// Stops losing replies; returns how many drops were still armed.
    pub fn disarm(&self) -> u64 {
        self.shared.arms().drain(..).map(|a| a.left).sum()
    }

    /// Replies lost so far.
    pub fn dropped_replies(&self) -> u64 {
        self.shared.dropped.load(Ordering::SeqCst)
    }

    /// Replies lost so far to requests of type `op`.
    pub fn dropped_replies_of(&self, op: i32) -> u64 {
        self.shared.dropped_by_op.lock().unwrap_or_else(|p| p.into_inner()).get(&op).copied().unwrap_or(0)
    }

    /// Of [`ZooKeeperProxy::dropped_replies`], those that reported success:
    /// the node exists and the client does not know its name.
    pub fn dropped_successful_creates(&self) -> u64 {
        self.shared.dropped_created.load(Ordering::SeqCst)
    }

    /// Create requests forwarded so far.
    pub fn creates_forwarded(&self) -> u64 {
        self.shared.creates.load(Ordering::SeqCst)
    }

    /// Requests of type `op` forwarded so far, on every connection (e.g.
    /// [`GET_CHILDREN`]): counted on the wire, so independent of what the
    /// client under test reports.
    ///
    /// ```no_run
    /// let zk = dlock_testing::ZooKeeperServer::start();
    /// let proxy = dlock_testing::ZooKeeperProxy::start(zk.port());
    /// // … clients work through `proxy.connect_string()` …
    /// println!("{} getChildren", proxy.requests_of(dlock_testing::GET_CHILDREN));
    /// ```
    pub fn requests_of(&self, op: i32) -> u64 {
        self.shared.requests.lock().unwrap_or_else(|p| p.into_inner()).get(&op).copied().unwrap_or(0)
    }

    /// Watch notifications (replies with xid -1) passed to clients so far:
    /// one per watcher the server fired for a client behind this proxy.
    pub fn notifications(&self) -> u64 {
        self.shared.notifications.load(Ordering::SeqCst)
    }

    /// Of [`ZooKeeperProxy::notifications`], those telling a client that a
    /// node it deleted itself is gone (it had a watch on its own node):
    /// these wake nobody who is waiting.
    pub fn own_delete_notifications(&self) -> u64 {
        self.shared.own_delete_notifications.load(Ordering::SeqCst)
    }

    /// Client connections accepted so far (a client reconnects after each
    /// lost reply).
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for ZooKeeperProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        let ids: Vec<u64> = self.shared.live().keys().copied().collect();
        for id in ids {
            self.shared.close(id, Hangup::Close);
        }
        accept::wake(self.port);
    }
}

fn serve(shared: &Arc<Shared>, id: u64, client: TcpStream, server: TcpStream) -> io::Result<()> {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    shared.live().insert(id, [client.try_clone()?, server.try_clone()?]);
    let doomed = Arc::new(Doomed::default());
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    let (sh, dm) = (shared.clone(), doomed.clone());
    std::thread::spawn(move || {
        let _ = requests(&sh, &dm, client, server);
        sh.close(id, Hangup::Close);
    });
    let sh = shared.clone();
    std::thread::spawn(move || {
        let how = replies(&sh, &doomed, s2, c2).unwrap_or(Hangup::Close);
        sh.close(id, how);
    });
    Ok(())
}

/// Reads one frame: its 4-byte length prefix and payload, together.
fn read_frame(from: &mut TcpStream, frame: &mut Vec<u8>) -> io::Result<()> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len)?;
    let n = i32::from_be_bytes(len);
    let n = usize::try_from(n).ok().filter(|n| *n <= MAX_FRAME).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("ZooKeeper frame length {n} out of range"))
    })?;
    frame.clear();
    frame.extend_from_slice(&len);
    frame.resize(4 + n, 0);
    from.read_exact(&mut frame[4..])
}

fn be_i32(frame: &[u8], at: usize) -> Option<i32> {
    frame.get(at..at + 4).and_then(|b| b.try_into().ok()).map(i32::from_be_bytes)
}

/// The `NodeDeleted` type of a watch notification.
const NODE_DELETED: i32 = 2;

/// A jute `ustring` (4-byte length, UTF-8 bytes) at `at`.
fn jute_string(frame: &[u8], at: usize) -> Option<String> {
    let len = usize::try_from(be_i32(frame, at)?).ok()?;
    let bytes = frame.get(at + 4..at + 4 + len)?;
    String::from_utf8(bytes.to_vec()).ok()
}

/// Client to server: marks the creates whose replies are to be lost, then
/// forwards every frame unchanged.
fn requests(shared: &Shared, doomed: &Doomed, mut client: TcpStream, mut server: TcpStream) -> io::Result<()> {
    let mut frame = Vec::with_capacity(1024);
    // The ConnectRequest has no RequestHeader.
    read_frame(&mut client, &mut frame)?;
    server.write_all(&frame)?;
    loop {
        read_frame(&mut client, &mut frame)?;
        if let (Some(xid), Some(op)) = (be_i32(&frame, 4), be_i32(&frame, 8)) {
            if CREATE_OP_CODES.contains(&op) {
                shared.creates.fetch_add(1, Ordering::SeqCst);
            }
            *shared.requests.lock().unwrap_or_else(|p| p.into_inner()).entry(op).or_default() += 1;
            if op == DELETE {
                // DeleteRequest { path: ustring, version: int } after the header.
                if let Some(path) = jute_string(&frame, 12) {
                    doomed.deleted().insert(path);
                }
            }
            // Marked before the request leaves, so its reply cannot
            // overtake the mark. Pings and watch resets (negative xids)
            // are never lost.
            if xid >= 0
                && let Some(how) = shared.take_drop(op)
            {
                doomed.map().insert(xid, (op, how));
            }
        }
        server.write_all(&frame)?;
    }
}

/// Server to client: forwards every frame except the reply of a doomed
/// request, which ends the connection instead, as the returned hang-up says.
fn replies(shared: &Shared, doomed: &Doomed, mut server: TcpStream, mut client: TcpStream) -> io::Result<Hangup> {
    let mut frame = Vec::with_capacity(1024);
    // The ConnectResponse has no ReplyHeader.
    read_frame(&mut server, &mut frame)?;
    client.write_all(&frame)?;
    loop {
        read_frame(&mut server, &mut frame)?;
        if let Some(xid) = be_i32(&frame, 4) {
            if xid == -1 {
                shared.notifications.fetch_add(1, Ordering::SeqCst);
                // WatcherEvent { type: int, state: int, path: ustring } after
                // the ReplyHeader; type 2 is NodeDeleted.
                if be_i32(&frame, 20) == Some(NODE_DELETED)
                    && let Some(path) = jute_string(&frame, 28)
                    && doomed.deleted().remove(&path)
                {
                    shared.own_delete_notifications.fetch_add(1, Ordering::SeqCst);
                }
            }
            let lost = if xid >= 0 { doomed.map().remove(&xid) } else { None };
            if let Some((op, how)) = lost {
                shared.dropped.fetch_add(1, Ordering::SeqCst);
                *shared.dropped_by_op.lock().unwrap_or_else(|p| p.into_inner()).entry(op).or_default() += 1;
                if CREATE_OP_CODES.contains(&op) && be_i32(&frame, 16) == Some(0) {
                    shared.dropped_created.fetch_add(1, Ordering::SeqCst);
                }
                return Ok(how);
            }
        }
        client.write_all(&frame)?;
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn frames_are_read_whole_and_bad_lengths_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let writer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            // Two frames in one write, then a negative length.
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&8i32.to_be_bytes());
            bytes.extend_from_slice(&7i32.to_be_bytes());
            bytes.extend_from_slice(&15i32.to_be_bytes());
            bytes.extend_from_slice(&0i32.to_be_bytes());
            bytes.extend_from_slice(&(-5i32).to_be_bytes());
            s.write_all(&bytes).expect("write");
        });
        let (mut s, _) = listener.accept().expect("accept");
        let mut frame = Vec::new();
        read_frame(&mut s, &mut frame).expect("first frame");
        assert_eq!((be_i32(&frame, 4), be_i32(&frame, 8)), (Some(7), Some(15)));
        read_frame(&mut s, &mut frame).expect("an empty frame");
        assert_eq!(frame.len(), 4);
        let err = read_frame(&mut s, &mut frame).expect_err("negative length");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        writer.join().expect("writer");
    }

    #[test]
    fn jute_strings_are_read_within_the_frame() {
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&5i32.to_be_bytes());
        frame.extend_from_slice(b"/a/b1");
        assert_eq!(jute_string(&frame, 12).as_deref(), Some("/a/b1"));
        frame.truncate(frame.len() - 1);
        assert_eq!(jute_string(&frame, 12), None, "a length past the frame's end");
        assert_eq!(jute_string(&(-1i32).to_be_bytes(), 0), None, "a null string");
    }

    #[test]
    fn arms_are_counted_down_in_order_and_by_type() {
        let shared = Shared::default();
        assert_eq!(shared.take_drop(15), None);
        shared.arms().push(Arm { ops: vec![CREATE_CONTAINER], left: 1, how: Hangup::Reset });
        shared.arms().push(Arm { ops: CREATE_OP_CODES.to_vec(), left: 2, how: Hangup::Close });
        assert_eq!(shared.take_drop(8), None, "getChildren2 is not armed");
        assert_eq!(shared.take_drop(15), Some(Hangup::Close));
        assert_eq!(shared.take_drop(CREATE_CONTAINER), Some(Hangup::Reset), "the first matching arm wins");
        assert_eq!(shared.take_drop(CREATE_CONTAINER), Some(Hangup::Close));
        assert_eq!(shared.take_drop(15), None, "all used");
        assert!(shared.arms().is_empty());
    }
}
