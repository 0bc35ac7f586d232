//! A blocking HTTP/1.1 answer reader for tests that drive a server over a
//! raw socket (bodies sent without `Expect: 100-continue`, slow senders),
//! where an HTTP client library would hide what the socket saw.

use std::io::Read;
use std::net::TcpStream;

/// One HTTP/1.1 answer: its status and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    /// The status code.
    pub status: u16,
    /// The body, `Content-Length` bytes.
    pub body: Vec<u8>,
}

/// Reads one answer from `s`: the head, then `Content-Length` bytes of
/// body; the connection may stay open afterwards. An error says what was
/// missing (a closed connection before the head or in the body, no status,
/// no `Content-Length`).
///
/// ```no_run
/// use std::io::Write;
/// let mut s = std::net::TcpStream::connect("127.0.0.1:3000")?;
/// s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")?;
/// let answer = dlock_testing::read_http_answer(&mut s).map_err(std::io::Error::other)?;
/// assert_eq!(answer.status, 200);
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn read_http_answer(s: &mut TcpStream) -> Result<HttpAnswer, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).map_err(|e| format!("reading the answer: {e}"))?;
        if n == 0 {
            return Err(format!("connection closed before an answer; got {:?}", String::from_utf8_lossy(&buf)));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or(format!("no status: {head}"))?;
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned()))
        .and_then(|v| v.parse().ok())
        .ok_or(format!("no content-length: {head}"))?;
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = s.read(&mut chunk).map_err(|e| format!("reading the body: {e}"))?;
        if n == 0 {
            return Err("connection closed in the body".into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(HttpAnswer { status, body })
}
