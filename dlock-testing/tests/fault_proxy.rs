//! `FaultProxy` delays and holds: late bytes, in order, in the chosen
//! direction; cuts that close.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use dlock_testing::{FaultProxy, RedisServer};

fn connect(proxy: &FaultProxy) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", proxy.port())).expect("connect through the proxy");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
    s
}

/// Reads until `want` bytes arrived; returns them and when the first came.
fn read_exactly(s: &mut TcpStream, want: usize) -> (Vec<u8>, Instant) {
    let mut got = Vec::new();
    let mut first = None;
    let mut buf = [0u8; 256];
    while got.len() < want {
        let n = s.read(&mut buf).expect("reply within 5 s");
        assert!(n > 0, "proxy closed the connection after {got:?}");
        first.get_or_insert_with(Instant::now);
        got.extend_from_slice(&buf[..n]);
    }
    (got, first.expect("at least one read"))
}

/// A server, a proxy in front of it and a connection through the proxy
/// that has been answered once, undelayed, so it exists before a test
/// starts its clock or its fault.
fn answered_once() -> (RedisServer, FaultProxy, TcpStream) {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(redis.port());
    let mut s = connect(&proxy);
    s.write_all(b"PING\r\n").expect("send");
    assert_eq!(read_exactly(&mut s, 7).0, b"+PONG\r\n");
    (redis, proxy, s)
}

/// Replies come `delay` late, and lowering the delay while bytes are held
/// does not let a later reply overtake an earlier one.
#[test]
fn replies_are_delayed_without_reordering() {
    let (_redis, proxy, mut s) = answered_once();

    proxy.set_delay(Duration::from_millis(300));
    let sent = Instant::now();
    s.write_all(b"ECHO first\r\n").expect("send");
    std::thread::sleep(Duration::from_millis(50));
    proxy.set_delay(Duration::ZERO);
    s.write_all(b"ECHO second\r\n").expect("send");
    let (bytes, first_at) = read_exactly(&mut s, b"$5\r\nfirst\r\n$6\r\nsecond\r\n".len());
    assert_eq!(bytes, b"$5\r\nfirst\r\n$6\r\nsecond\r\n", "in order");
    let late = first_at - sent;
    assert!(late >= Duration::from_millis(300), "reply only {late:?} late");

    // Back to no delay: answers are prompt again.
    let sent = Instant::now();
    s.write_all(b"PING\r\n").expect("send");
    let (_, at) = read_exactly(&mut s, 7);
    assert!(at - sent < Duration::from_millis(250), "still delayed: {:?}", at - sent);
}

/// A request delay holds the command itself: it takes effect on the
/// server only after the delay. A cut still closes a slowed connection.
#[test]
fn requests_land_late_and_cut_still_cuts() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(redis.port());
    let mut s = connect(&proxy);
    proxy.set_request_delay(Duration::from_millis(400));
    let sent = Instant::now();
    s.write_all(b"SET late v\r\n").expect("send");
    let mut direct = redis.connection();
    let early: Option<String> = redis::cmd("GET").arg("late").query(&mut direct).expect("GET");
    if sent.elapsed() < Duration::from_millis(400) {
        assert_eq!(early, None, "the command landed before its delay");
    }
    let (reply, at) = read_exactly(&mut s, 5);
    assert_eq!(reply, b"+OK\r\n");
    assert!(at - sent >= Duration::from_millis(400));
    let now: Option<String> = redis::cmd("GET").arg("late").query(&mut direct).expect("GET");
    assert_eq!(now.as_deref(), Some("v"));

    proxy.cut();
    let mut buf = [0u8; 8];
    assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "a cut closes the connection");
}

/// A hold keeps the connection open and the command away from the server
/// until the heal; then the command lands and its reply comes, in order,
/// and a connection opened during the hold works too.
#[test]
fn a_hold_delivers_late_and_closes_nothing() {
    let (redis, proxy, mut s) = answered_once();

    proxy.hold();
    s.write_all(b"SET held v\r\n").expect("send");
    let mut during = connect(&proxy);
    during.write_all(b"ECHO during\r\n").expect("send on a connection opened during the hold");
    std::thread::sleep(Duration::from_millis(300));
    let mut direct = redis.connection();
    let early: Option<String> = redis::cmd("GET").arg("held").query(&mut direct).expect("GET");
    assert_eq!(early, None, "a held command reached the server");
    s.set_read_timeout(Some(Duration::from_millis(100))).expect("read timeout");
    let mut buf = [0u8; 8];
    match s.read(&mut buf) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
        other => panic!("a hold must neither answer nor close: {other:?}"),
    }
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");

    proxy.heal();
    assert_eq!(read_exactly(&mut s, 5).0, b"+OK\r\n");
    let now: Option<String> = redis::cmd("GET").arg("held").query(&mut direct).expect("GET");
    assert_eq!(now.as_deref(), Some("v"));
    assert_eq!(read_exactly(&mut during, b"$6\r\nduring\r\n".len()).0, b"$6\r\nduring\r\n");
}
