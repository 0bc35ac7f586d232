//! Headers that must come once (`docs/axum-design.md`), and request secrets as logs write them.

use axum::http::header::AsHeaderName;
use axum::http::{HeaderMap, HeaderValue};

use crate::rejection::Rejection;

/// The header sent more than once.
#[derive(Debug)]
pub(crate) struct Repeated;

/// The one value of `name`: `Ok(None)` when absent, `Err` when repeated (even equal).
pub(crate) fn sole(headers: &HeaderMap, name: impl AsHeaderName) -> Result<Option<&HeaderValue>, Repeated> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    match values.next() {
        Some(_) => Err(Repeated),
        None => Ok(first),
    }
}

/// The idempotency key header `name` (`Idempotency-Key`) if it was sent
/// once; `400 idempotency_key_invalid` when it was sent more than once.
pub(crate) fn sole_idempotency_key(
    headers: &HeaderMap,
    name: impl AsHeaderName,
) -> Result<Option<&HeaderValue>, Rejection> {
    sole(headers, name).map_err(|Repeated| {
        Rejection::idempotency_key_invalid().with_message("the Idempotency-Key header is sent more than once")
    })
}

/// A request secret (an `Idempotency-Key`) as logs write it: 12 hex digits of
/// its SHA-1, the same in every process.
pub(crate) fn log_id(secret: &str) -> String {
    let mut id = dlock_core::idempotency::fingerprint(&[secret]);
    id.truncate(12);
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderName;

    #[test]
    fn once_absent_or_repeated() {
        let name = HeaderName::from_static("x-t");
        let mut h = HeaderMap::new();
        assert!(matches!(sole(&h, &name), Ok(None)));
        h.append(&name, HeaderValue::from_static("a"));
        assert_eq!(sole(&h, &name).ok().flatten().map(HeaderValue::as_bytes), Some(&b"a"[..]));
        h.append(&name, HeaderValue::from_static("a"));
        assert!(sole(&h, &name).is_err(), "equal values repeated are still two");
    }

    #[test]
    fn a_log_id_is_short_stable_and_not_the_secret() {
        assert_eq!(log_id("k-secret"), log_id("k-secret"));
        assert_ne!(log_id("k-secret"), log_id("k-secreT"));
        assert_eq!(log_id("k-secret").len(), 12);
        assert!(!log_id("k-secret").contains("secret"));
    }
}
