//! The accept loop the two proxies share ([`crate::FaultProxy`] and
//! [`crate::ZooKeeperProxy`]): a free loopback port, one thread handing
//! each client to the proxy until it is stopped, and the dial upstream.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// Listens on a free loopback port and passes every accepted client to
/// `serve`, on the accept thread, until `stopped` says so; returns the port.
/// A stopped loop ends at its next accept: see [`wake`].
pub(crate) fn listen(
    stopped: impl Fn() -> bool + Send + 'static,
    mut serve: impl FnMut(TcpStream) + Send + 'static,
) -> io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            if stopped() {
                return;
            }
            let Ok(client) = client else { continue };
            serve(client);
        }
    });
    Ok(port)
}

/// Connects to `upstream` for `client`; a server that does not answer
/// within 2 s gets the client's connection closed instead.
pub(crate) fn dial(upstream: SocketAddr, client: &TcpStream) -> Option<TcpStream> {
    match TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) {
        Ok(server) => Some(server),
        Err(_) => {
            let _ = client.shutdown(Shutdown::Both);
            None
        }
    }
}

/// Connects to the loop on `port` once, so that a loop told to stop sees it
/// now rather than at the next client, which may never come.
pub(crate) fn wake(port: u16) {
    let _ = TcpStream::connect(("127.0.0.1", port));
}
