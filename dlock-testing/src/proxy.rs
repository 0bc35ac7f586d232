//! A TCP proxy that can cut the line: a network partition between one
//! client and a server, without root, iptables or namespaces.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Forwards `127.0.0.1:<port()>` to a server. [`FaultProxy::cut`] closes
/// every connection and refuses new ones until [`FaultProxy::heal`], so the
/// client behind it is partitioned from the server while others are not.
/// Stops on drop.
///
/// ```no_run
/// let redis = dlock_testing::RedisServer::start();
/// let proxy = dlock_testing::FaultProxy::start(redis.port());
/// let url = format!("redis://127.0.0.1:{}", proxy.port()); // give this to the client under test
/// proxy.cut();   // the client loses the server
/// proxy.heal();  // and finds it again
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    cut: AtomicBool,
    stopped: AtomicBool,
    live: Mutex<Vec<TcpStream>>,
}

impl Shared {
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
    /// When no loopback port can be bound.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port for the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared::default());
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream).into();
        let s = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                if s.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                    let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
                    live.push(c2);
                    live.push(s2);
                }
                pipe(client.try_clone(), server.try_clone());
                pipe(server.try_clone(), client.try_clone());
            }
        });
        FaultProxy { port, shared }
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

    /// Lets new connections through again.
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }
}

fn pipe(from: std::io::Result<TcpStream>, to: std::io::Result<TcpStream>) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else { return };
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.shared.close_all();
        // Wake the accept loop so its thread sees `stopped` and ends.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}
