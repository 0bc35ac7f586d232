//! [`JsonBody`]: a JSON body read by the same rules as [`LockLayer`](crate::LockLayer)'s.

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::install::installed;
use crate::lock::body::{discard, read_body, require_json_content_type, BodyLimits};
use crate::rejection::Rejection;

/// A JSON request body, read and refused exactly as [`LockLayer`](crate::LockLayer)
/// reads the body its key fields come from, with dlock's JSON rejections:
///
/// | the body | answer |
/// |---|---|
/// | `Content-Type` present and not JSON | `415 unsupported_media_type` |
/// | longer than the installed engine's `max_body_bytes` (`DLOCK_MAX_BODY_BYTES`) | `413 payload_too_large` |
/// | still arriving after the engine's [`body_read_timeout`](crate::DlockRuntime::body_read_timeout) | `408 request_timeout` |
/// | not JSON, or JSON of the wrong shape | `400 invalid_json` |
/// | a field of `T` missing | `400 lock_key_field_missing` |
/// | cannot be read | `400 request_body_unreadable` |
///
/// Take it in a `#[lockable]` handler in place of `axum::Json`, so that the
/// handler answers a bad body like a [`LockLayer`](crate::LockLayer) route
/// does (axum's `Json` answers in plain text, with `422` for a missing field).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::{lockable, JsonBody, LockerExt};
/// use dlock_core::{Locker, MemoryBackend};
/// use tower::ServiceExt;
///
/// #[derive(serde::Deserialize)]
/// struct Order { product_id: u64 }
///
/// #[lockable(key = "order.create", fields = ["order.product_id"])]
/// async fn create(JsonBody(order): JsonBody<Order>) -> String {
///     format!("order for {}", order.product_id)
/// }
///
/// let app: Router = Router::new().route("/orders", post(create)).with_locker(Locker::new(MemoryBackend::new()));
/// let req = |body: &'static str| Request::post("/orders").header("content-type", "application/json").body(Body::from(body)).unwrap();
/// assert_eq!(app.clone().oneshot(req(r#"{"product_id": 7}"#)).await.unwrap().status(), 200);
/// assert_eq!(app.oneshot(req("{}")).await.unwrap().status(), 400); // lock_key_field_missing
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = Rejection;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Rejection> {
        let (parts, body) = req.into_parts();
        if let Err(rejection) = require_json_content_type(&parts.headers) {
            // Drained so the client can read the 415 (see `lock/body.rs`).
            discard(&parts.headers, body, false).await;
            return Err(rejection);
        }
        let limits = BodyLimits::of(installed(&parts.extensions), None);
        let bytes = read_body(&parts.headers, body, limits).await?;
        parse(&bytes).map(JsonBody)
    }
}

/// `T` from `bytes`, with a missing field told apart from a broken body.
fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Rejection> {
    serde_json::from_slice(bytes).map_err(|e| {
        if let Some(field) = missing_field(&e) {
            return Rejection::missing_field(format_args!("JSON field `{field}`"));
        }
        let what = if e.is_data() { "not of the expected shape" } else { "not valid JSON" };
        Rejection::invalid_json().with_message(format!("the request body is {what}: {e}"))
    })
}

/// The field a serde "missing field `x`" error names. serde has no structured
/// form of this error; its text is stable across serde 1.x.
fn missing_field(e: &serde_json::Error) -> Option<String> {
    if !e.is_data() {
        return None;
    }
    let text = e.to_string();
    let rest = text.strip_prefix("missing field `")?;
    rest.split_once('`').map(|(field, _)| field.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Order {
        id: u64,
    }

    #[test]
    fn a_missing_field_is_not_bad_json() {
        let r = parse::<Order>(b"{}").expect_err("missing");
        assert_eq!((r.status().as_u16(), r.error()), (400, "lock_key_field_missing"));
        assert_eq!(r.message(), "JSON field `id` is missing from the request");
        for bad in [&b"{"[..], b"{\"id\": \"x\"}", b"[]", b""] {
            let r = parse::<Order>(bad).expect_err("bad");
            assert_eq!((r.status().as_u16(), r.error()), (400, "invalid_json"), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse::<Order>(br#"{"id": 3}"#).expect("valid").id, 3);
    }
}
