//! A TCP proxy that can cut the line, hold its bytes or slow it down: a
//! network partition or a slow link between one client and a server,
//! without root, iptables, namespaces or `tc`.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::accept;

/// Forwards `127.0.0.1:<port()>` to a server, so the client behind it can
/// be partitioned from the server while others are not, in two ways:
///
/// * [`FaultProxy::cut`] closes every connection and refuses new ones: the
///   client sees its connections end at once.
/// * [`FaultProxy::hold`] keeps every connection open and holds every byte,
///   both ways, on live connections and new ones: a partition shorter than
///   TCP's retransmission give-up, whose packets arrive late, after the
///   heal, which is exactly when a late renewal could resurrect a lock.
///
/// [`FaultProxy::heal`] ends either. Stops on drop.
///
/// ```no_run
/// let redis = dlock_testing::RedisServer::start();
/// let proxy = dlock_testing::FaultProxy::start(redis.port());
/// let url = format!("redis://127.0.0.1:{}", proxy.port()); // give this to the client under test
/// proxy.cut();   // the client loses the server
/// proxy.heal();  // and finds it again
/// proxy.hold();  // the client's commands and the server's replies stall
/// proxy.heal();  // and arrive now, in order
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    cut: AtomicBool,
    /// Bytes wait in the pipes while set.
    held: AtomicBool,
    stopped: AtomicBool,
    live: Mutex<Vec<TcpStream>>,
    /// Extra latency of server → client bytes, in µs.
    reply_delay_us: AtomicU64,
    /// Extra latency of client → server bytes, in µs.
    request_delay_us: AtomicU64,
}

/// Reads a connection's first message from the client and returns what to
/// send upstream instead (see [`FaultProxy::start_link`]).
pub(crate) type Greeting = Arc<dyn Fn(&mut TcpStream) -> std::io::Result<Vec<u8>> + Send + Sync>;

/// Which way a pipe carries bytes, so it knows which delay applies.
#[derive(Debug, Clone, Copy)]
enum Direction {
    Request,
    Reply,
}

impl Shared {
    fn delay(&self, direction: Direction) -> Duration {
        let us = match direction {
            Direction::Request => &self.request_delay_us,
            Direction::Reply => &self.reply_delay_us,
        };
        Duration::from_micros(us.load(Ordering::SeqCst))
    }
}

impl Shared {
    /// Waits while the line is held; `false` when the proxy stopped meanwhile.
    fn wait_while_held(&self) -> bool {
        while self.held.load(Ordering::SeqCst) {
            if self.stopped.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        !self.stopped.load(Ordering::SeqCst)
    }

    fn close_all(&self) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for s in live.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl FaultProxy {
    /// Starts forwarding a free loopback port to `127.0.0.1:<upstream>`.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound; [`FaultProxy::try_start`] returns
    /// that error instead.
    pub fn start(upstream: u16) -> Self {
        Self::try_start(upstream).expect("bind a loopback port for the proxy")
    }

    /// [`FaultProxy::start`], for a harness that reports a proxy that could
    /// not start instead of panicking.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub fn try_start(upstream: u16) -> std::io::Result<Self> {
        Self::start_inner(upstream, None)
    }

    /// A proxy for a link between two servers of a cluster, which differs
    /// from [`FaultProxy::start`] in two ways. An upstream that refuses
    /// the connection is retried for up to 5 s before the client's
    /// connection is closed: the client's own connect already succeeded
    /// (to the proxy), so it cannot retry a refusal it never saw, as a
    /// ZooKeeper follower dialling a leader that is not listening yet
    /// would. And with a `greeting`, the first bytes a client sends on each
    /// connection are read by it (with a 2 s read timeout) and what it
    /// returns is sent upstream in their place; a greeting that fails ends
    /// that connection.
    pub(crate) fn start_link(upstream: u16, greeting: Option<Greeting>) -> Self {
        Self::start_inner(upstream, Some(Link { greeting })).expect("bind a loopback port for the link proxy")
    }

    fn start_inner(upstream: u16, link: Option<Link>) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream).into();
        let (s, stopped) = (shared.clone(), shared.clone());
        let port = accept::listen(
            move || stopped.stopped.load(Ordering::SeqCst),
            move |client| {
                if s.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    return;
                }
                match &link {
                    None => {
                        let Some(server) = accept::dial(upstream, &client) else { return };
                        // Registered before the cut flag is read again: a cut
                        // that came after the first look, while we dialled,
                        // closed the sockets it knew of, and not these.
                        register(&s, &client, &server);
                        if s.cut.load(Ordering::SeqCst) {
                            let _ = client.shutdown(Shutdown::Both);
                            let _ = server.shutdown(Shutdown::Both);
                            return;
                        }
                        pipes(&s, client, server);
                    }
                    Some(link) => {
                        // In a thread of its own: retries and greetings must not stall the accept loop.
                        let (greeting, s) = (link.greeting.clone(), s.clone());
                        std::thread::spawn(move || link_connection(&s, upstream, client, greeting.as_ref()));
                    }
                }
            },
        )?;
        Ok(FaultProxy { port, shared })
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Partitions: closes every connection through the proxy and refuses
    /// new ones until [`FaultProxy::heal`].
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        self.shared.close_all();
    }

    /// Partitions without closing anything: every byte either way, on live
    /// connections and new ones, waits in the proxy until
    /// [`FaultProxy::heal`], then goes on in order. New connections are
    /// accepted and dialled upstream, and carry nothing meanwhile.
    pub fn hold(&self) {
        self.shared.held.store(true, Ordering::SeqCst);
    }

    /// Ends a [`cut`](FaultProxy::cut) (new connections go through again)
    /// and a [`hold`](FaultProxy::hold) (the held bytes go on at once).
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
        self.shared.held.store(false, Ordering::SeqCst);
    }

    /// Makes the server slow as the client sees it: every byte the server
    /// sends is passed on `delay` after it arrived, on live connections and
    /// new ones, so a reply reaches the client that much later while the
    /// request itself lands on time. Bytes are never reordered: lowering
    /// the delay does not let later bytes overtake those already held.
    /// `Duration::ZERO` (the default) forwards at once.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// let redis = dlock_testing::RedisServer::start();
    /// let proxy = dlock_testing::FaultProxy::start(redis.port());
    /// proxy.set_delay(Duration::from_millis(200)); // every reply is 200 ms late
    /// ```
    pub fn set_delay(&self, delay: Duration) {
        self.shared.reply_delay_us.store(micros(delay), Ordering::SeqCst);
    }

    /// Like [`FaultProxy::set_delay`] for the other direction: every byte the
    /// client sends reaches the server `delay` late, so a command lands (and
    /// takes effect) that much after it was sent.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// let redis = dlock_testing::RedisServer::start();
    /// let proxy = dlock_testing::FaultProxy::start(redis.port());
    /// proxy.set_request_delay(Duration::from_millis(200)); // commands land 200 ms late
    /// ```
    pub fn set_request_delay(&self, delay: Duration) {
        self.shared.request_delay_us.store(micros(delay), Ordering::SeqCst);
    }
}

/// How a [`FaultProxy::start_link`] proxy treats each connection.
struct Link {
    greeting: Option<Greeting>,
}

/// Keeps a clone of both sockets, so a cut closes them.
fn register(shared: &Shared, client: &TcpStream, server: &TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
        let mut live = shared.live.lock().unwrap_or_else(|p| p.into_inner());
        live.push(c2);
        live.push(s2);
    }
}

fn pipes(shared: &Arc<Shared>, client: TcpStream, server: TcpStream) {
    pipe(client.try_clone(), server.try_clone(), shared.clone(), Direction::Request);
    pipe(server.try_clone(), client.try_clone(), shared.clone(), Direction::Reply);
}

/// One connection of a link proxy: dial the upstream until it answers (or
/// the link is cut), pass the greeting, then forward.
fn link_connection(shared: &Arc<Shared>, upstream: SocketAddr, mut client: TcpStream, greeting: Option<&Greeting>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut server = loop {
        if shared.cut.load(Ordering::SeqCst) || shared.stopped.load(Ordering::SeqCst) {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        match TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) {
            Ok(server) => break server,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
        }
    };
    // Registered before the cut flag is read: a cut from now on closes
    // these sockets, and one that came before is seen below.
    register(shared, &client, &server);
    let greeted = match greeting {
        None => Ok(()),
        Some(greeting) => client
            .set_read_timeout(Some(Duration::from_secs(2)))
            .and_then(|()| greeting(&mut client))
            .and_then(|bytes| server.write_all(&bytes))
            .and_then(|()| client.set_read_timeout(None)),
    };
    if greeted.is_err() || shared.cut.load(Ordering::SeqCst) {
        let _ = client.shutdown(Shutdown::Both);
        let _ = server.shutdown(Shutdown::Both);
        return;
    }
    pipes(shared, client, server);
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Copies `from` to `to`: a reader thread stamps each chunk with the time
/// it may leave, a writer thread passes the chunks on in order once due and
/// not held, so a delay or a hold keeps bytes back without reordering them
/// and without stalling the reads (a slow link, not a stalled server).
fn pipe(from: std::io::Result<TcpStream>, to: std::io::Result<TcpStream>, shared: Arc<Shared>, direction: Direction) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else { return };
    let Ok(from_for_writer) = from.try_clone() else { return };
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer_shared = shared.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due = Instant::now() + shared.delay(direction);
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        // Ends when the reader is gone and every held chunk is written.
        for (due, bytes) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if !writer_shared.wait_while_held() || to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from_for_writer.shutdown(Shutdown::Both);
    });
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.shared.close_all();
        accept::wake(self.port);
    }
}
