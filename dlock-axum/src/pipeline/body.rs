//! The one bounded body reader and JSON `Content-Type` check of every face; a
//! refused body is drained before the answer (`docs/axum-design.md`).

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use bytes::{Bytes, BytesMut};
use dlock_core::{DlockRuntime, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_BODY_BYTES};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::rejection::Rejection;

/// The longest a refused body is drained (nginx's `lingering_time`).
pub(crate) const DRAIN_MAX_TIME: Duration = Duration::from_secs(30);
/// The longest a drain waits for more bytes (nginx's `lingering_timeout`).
pub(crate) const DRAIN_IDLE_TIME: Duration = Duration::from_secs(5);
/// The bounds of one body read: bytes and time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyLimits {
    pub(crate) max_bytes: usize,
    pub(crate) timeout: Duration,
}

impl BodyLimits {
    /// The installed runtime's bounds (the layer's byte limit first), else the defaults.
    pub(crate) fn of(installed: Option<&DlockRuntime>, layer_max_bytes: Option<usize>) -> Self {
        let (max_bytes, timeout) = match installed {
            Some(dlock) => (dlock.max_body_bytes(), dlock.body_read_timeout()),
            None => (DEFAULT_MAX_BODY_BYTES, DEFAULT_BODY_READ_TIMEOUT),
        };
        BodyLimits { max_bytes: layer_max_bytes.unwrap_or(max_bytes), timeout }
    }
}

impl From<usize> for BodyLimits {
    /// `max_bytes` with the default time bound.
    fn from(max_bytes: usize) -> Self {
        BodyLimits { max_bytes, timeout: DEFAULT_BODY_READ_TIMEOUT }
    }
}

/// Reads at most `limits.max_bytes` within `limits.timeout`; a refused body
/// is drained first. A body in one frame is kept without a copy.
pub(crate) async fn read_body(
    headers: &HeaderMap,
    mut body: Body,
    limits: impl Into<BodyLimits>,
) -> Result<Bytes, Rejection> {
    let BodyLimits { max_bytes: limit, timeout } = limits.into();
    let too_large =
        || Rejection::payload_too_large().with_message(format!("the request body is larger than {limit} bytes"));
    if declared_length(headers).is_some_and(|n| n > limit as u64) {
        discard(headers, body, false).await;
        return Err(too_large());
    }
    // One deadline for the whole body: a trickling sender cannot stretch it.
    let deadline = Instant::now() + timeout;
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    let mut len = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            // The connection closes with the answer: nothing drained from a slow sender.
            Err(_) => {
                return Err(Rejection::request_timeout()
                    .with_message(format!("the request body did not arrive within {} ms", timeout.as_millis())))
            }
        };
        let frame = frame.map_err(|e| {
            tracing::debug!(error = %e, "dlock: reading the request body failed");
            Rejection::body_unreadable()
        })?;
        let Ok(data) = frame.into_data() else { continue };
        len += data.len();
        if len > limit {
            discard(headers, body, true).await;
            return Err(too_large());
        }
        match joined.as_mut() {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut buf = BytesMut::with_capacity(len);
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
}

/// Drains a refused body, unless the client waits for `100 Continue` and
/// has sent nothing. `started`: some was read (which sent that `100`).
pub(crate) async fn discard(headers: &HeaderMap, body: Body, started: bool) {
    let expects_continue =
        headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue && !started {
        return;
    }
    drain(body, DRAIN_MAX_TIME, DRAIN_IDLE_TIME).await;
}

/// Reads `body` to its end, dropping each chunk, within `max_time` in all and
/// `idle` between chunks; whether it reached the end.
async fn drain(mut body: Body, max_time: Duration, idle: Duration) -> bool {
    let deadline = Instant::now() + max_time;
    loop {
        let next = deadline.min(Instant::now() + idle);
        match tokio::time::timeout_at(next, body.frame()).await {
            Ok(None) => return true,
            Ok(Some(Ok(_chunk))) => {}
            // A broken body or the time is up: hyper closes the connection.
            Ok(Some(Err(_))) | Err(_) => return false,
        }
    }
}

/// `415 unsupported_media_type` for a declared `Content-Type` that is not
/// JSON, before anything is read or locked; none is read as JSON.
pub(crate) fn require_json_content_type(headers: &HeaderMap) -> Result<(), Rejection> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else { return Ok(()) };
    if is_json(value.as_bytes()) {
        return Ok(());
    }
    Err(Rejection::unsupported_media_type())
}

/// `application/json` or `application/*+json`, parameters allowed, any case.
fn is_json(content_type: &[u8]) -> bool {
    // The common case first (see `docs/performance.md`, "Hot-path notes").
    if content_type == b"application/json" {
        return true;
    }
    let essence = content_type.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    let Some(slash) = essence.iter().position(|&b| b == b'/') else { return false };
    let (kind, subtype) = (&essence[..slash], &essence[slash + 1..]);
    kind.eq_ignore_ascii_case(b"application")
        && (subtype.eq_ignore_ascii_case(b"json")
            || subtype.len() > 5 && subtype[subtype.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_type(ct: Option<&'static str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(ct) = ct {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        }
        h
    }

    #[test]
    fn json_types_pass_and_others_are_415() {
        for ok in [
            None,
            Some("application/json"),
            Some("Application/JSON; charset=utf-8"),
            Some("application/problem+json"),
            Some("application/vnd.api+JSON"),
        ] {
            assert!(require_json_content_type(&with_type(ok)).is_ok(), "{ok:?}");
        }
        for bad in ["text/plain", "application/x-www-form-urlencoded", "application/jsonx", "json", "application/+json"]
        {
            let r = require_json_content_type(&with_type(Some(bad))).expect_err(bad);
            assert_eq!((r.status().as_u16(), r.error()), (415, "unsupported_media_type"), "{bad}");
        }
    }

    #[tokio::test]
    async fn the_limit_is_counted_with_and_without_content_length() {
        let body = || Body::from(vec![b'x'; 11]);
        let r = read_body(&HeaderMap::new(), body(), 10).await.expect_err("over the limit");
        assert_eq!((r.status().as_u16(), r.message()), (413, "the request body is larger than 10 bytes"));
        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, HeaderValue::from_static("11"));
        let r = read_body(&declared, Body::empty(), 10).await.expect_err("declared over the limit");
        assert_eq!(r.status().as_u16(), 413);
        assert_eq!(read_body(&HeaderMap::new(), body(), 11).await.expect("at the limit").len(), 11);
    }

    #[tokio::test]
    async fn a_drain_is_bounded_in_time_not_bytes() {
        use futures_util::StreamExt;
        use std::convert::Infallible;
        let (long, short) = (Duration::from_secs(30), Duration::from_millis(50));
        // 64 MiB, far more than any body limit: read to the end, chunk by chunk.
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let big = Body::from_stream(futures_util::stream::repeat(Ok::<_, Infallible>(chunk.clone())).take(1024));
        assert!(drain(big, long, long).await, "read to the end, however many bytes");
        // A sender that stops: the idle bound ends the drain.
        let stalled = Body::from_stream(futures_util::stream::pending::<Result<Bytes, Infallible>>());
        let started = std::time::Instant::now();
        assert!(!drain(stalled, long, short).await, "stops when nothing arrives");
        assert!(started.elapsed() < Duration::from_secs(5));
        // A sender that never stops: the total bound ends the drain.
        let endless = futures_util::stream::repeat(Ok::<_, Infallible>(chunk)).then(|c| async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            c
        });
        let started = std::time::Instant::now();
        assert!(!drain(Body::from_stream(endless), short, long).await, "stops at the time bound");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_is_408() {
        use std::convert::Infallible;
        let stalled = Body::from_stream(futures_util::stream::pending::<Result<Bytes, Infallible>>());
        let limits = BodyLimits { max_bytes: 10, timeout: Duration::from_millis(20) };
        let r = read_body(&HeaderMap::new(), stalled, limits).await.expect_err("timed out");
        assert_eq!((r.status().as_u16(), r.error()), (408, "request_timeout"));
    }
}
