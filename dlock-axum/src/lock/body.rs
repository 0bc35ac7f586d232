//! The one bounded body reader of dlock-axum, and the one check of a JSON
//! `Content-Type`.
//!
//! [`LockLayer`](crate::LockLayer) (to find key fields), [`JsonBody`](crate::JsonBody)
//! (a `#[lockable]` handler's key fields) and
//! [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) (the fingerprint)
//! read a request body through [`read_body`], so the three answer an
//! oversized or broken body alike: `413 payload_too_large` naming the limit,
//! `400 request_body_unreadable`.

use axum::body::Body;
use axum::http::{header, HeaderMap};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::rejection::Rejection;

/// Reads at most `limit` bytes, refusing up front when `Content-Length`
/// already says the body is larger.
///
/// Most bodies arrive in one frame, which is kept as it is: no copy and no
/// buffer list (`BodyExt::collect` makes both for every body).
pub(crate) async fn read_body(headers: &HeaderMap, mut body: Body, limit: usize) -> Result<Bytes, Rejection> {
    let too_large =
        || Rejection::payload_too_large().with_message(format!("the request body is larger than {limit} bytes"));
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            tracing::debug!(error = %e, "dlock: reading the request body failed");
            Rejection::body_unreadable()
        })?;
        // Trailers carry no body bytes.
        let Ok(data) = frame.into_data() else { continue };
        len += data.len();
        if len > limit {
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

/// Refuses a body whose declared `Content-Type` is not JSON
/// (`application/json`, or any `application/*+json`), with
/// `415 unsupported_media_type`, before anything is read or locked: axum's
/// own `Json` would refuse it anyway, and a lock taken for a request that is
/// then refused only makes other requests wait.
///
/// A request without `Content-Type` is read as JSON (`curl --data-binary`
/// without `-H`, older clients), as dlock always did.
pub(crate) fn require_json_content_type(headers: &HeaderMap) -> Result<(), Rejection> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else { return Ok(()) };
    if is_json(value.as_bytes()) {
        return Ok(());
    }
    Err(Rejection::unsupported_media_type())
}

/// `application/json` or `application/<anything>+json`, parameters allowed,
/// case-insensitive.
fn is_json(content_type: &[u8]) -> bool {
    // What nearly every client sends, compared at once: this runs on every
    // locked request, and the general case costs several hundred instructions.
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
}
