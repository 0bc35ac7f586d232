//! Both ends of a socket test with small buffers, shared by the test files
//! that send large bodies over a real socket.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use axum::Router;

/// Serves `app` on a socket whose receive buffer is small, as on a real
/// network, where a 2 MiB body is in flight rather than absorbed by
/// loopback's large buffers.
pub(crate) async fn serve(app: Router) -> SocketAddr {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let listener = socket.listen(64).expect("listen");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// A client whose send buffer is small too: its writes block until the
/// server reads.
pub(crate) fn connect(addr: SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_send_buffer_size(16 * 1024).expect("SO_SNDBUF");
    socket.connect(&addr.into()).expect("connect");
    let s: TcpStream = socket.into();
    s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    s.set_write_timeout(Some(Duration::from_secs(20))).expect("timeout");
    s
}
