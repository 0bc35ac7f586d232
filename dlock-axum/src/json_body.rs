//! [`JsonBody`]: a JSON body read by the same rules as [`LockLayer`](crate::LockLayer)'s.

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::install::installed;
use crate::pipeline::body::{discard, read_body, require_json_content_type, BodyLimits};
use crate::rejection::Rejection;

/// A JSON body, read and refused as [`LockLayer`](crate::LockLayer) reads its key fields:
///
/// | the body | answer |
/// |---|---|
/// | `Content-Type` present and not JSON | `415 unsupported_media_type` |
/// | longer than the installed engine's `max_body_bytes` (`DLOCK_MAX_BODY_BYTES`) | `413 payload_too_large` |
/// | still arriving after the engine's [`body_read_timeout`](crate::DlockRuntime::body_read_timeout) | `408 request_timeout` |
/// | not JSON, or JSON that does not fit `T` (a field missing, a value of the wrong type) | `400 invalid_json`, naming the field by its path (`seat.number`) |
/// | cannot be read | `400 request_body_unreadable` |
///
/// Take it in a `#[lockable]` handler in place of `axum::Json` (plain text,
/// `422` for a missing field) to answer a bad body as a `LockLayer` route does.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use dlock_axum::{lockable, JsonBody, DlockExt};
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
/// let app: Router = Router::new().route("/orders", post(create)).with_dlock(Locker::new(MemoryBackend::new()));
/// let req = |body: &'static str| Request::post("/orders").header("content-type", "application/json").body(Body::from(body)).unwrap();
/// assert_eq!(app.clone().oneshot(req(r#"{"product_id": 7}"#)).await.unwrap().status(), 200);
/// assert_eq!(app.oneshot(req("{}")).await.unwrap().status(), 400); // invalid_json: JSON field `product_id` is missing
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
            discard(&parts.headers, body, false).await;
            return Err(rejection);
        }
        let limits = BodyLimits::of(installed(&parts.extensions), None);
        let bytes = read_body(&parts.headers, body, limits).await?;
        parse(&bytes).map(JsonBody)
    }
}

/// `T` from `bytes`; a misfit is told from bad JSON and named by its path.
fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Rejection> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| refuse(Some(e.path()), e.inner()))?;
    // Nothing but whitespace after the value, as `serde_json::from_slice` checks.
    de.end().map_err(|e| refuse(None, &e))?;
    Ok(value)
}

/// `400 invalid_json`, saying what is wrong where.
fn refuse(path: Option<&serde_path_to_error::Path>, e: &serde_json::Error) -> Rejection {
    let path = path.filter(|p| p.iter().next().is_some());
    let message = if !e.is_data() {
        format!("the request body is not valid JSON: {e}")
    } else if let Some(field) = missing_field(e) {
        // serde's path ends at the object the field is missing from.
        let field = match path {
            Some(path) => format!("{path}.{field}"),
            None => field,
        };
        format!("the request body is not of the expected shape: JSON field `{field}` is missing")
    } else {
        match path {
            Some(path) => format!("the request body is not of the expected shape: at `{path}`: {e}"),
            None => format!("the request body is not of the expected shape: {e}"),
        }
    };
    Rejection::invalid_json().with_message(message)
}

/// The field a serde "missing field `x`" error names (its text is stable in serde 1.x).
fn missing_field(e: &serde_json::Error) -> Option<String> {
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

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Seat {
        row: String,
        number: u32,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Reserve {
        customer: String,
        seat: Seat,
        extras: Vec<Seat>,
    }

    /// A body that does not fit `T` is `invalid_json`, a missing field included.
    #[test]
    fn a_missing_field_is_invalid_json_naming_the_field() {
        let r = parse::<Order>(b"{}").expect_err("missing");
        assert_eq!((r.status().as_u16(), r.error()), (400, "invalid_json"));
        assert_eq!(r.message(), "the request body is not of the expected shape: JSON field `id` is missing");
        for bad in [&b"{"[..], b"{\"id\": \"x\"}", b"[]", b""] {
            let r = parse::<Order>(bad).expect_err("bad");
            assert_eq!((r.status().as_u16(), r.error()), (400, "invalid_json"), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse::<Order>(br#"{"id": 3}"#).expect("valid").id, 3);
    }

    /// The message names the field by its whole path, as serde's path does.
    #[test]
    fn errors_name_the_full_path() {
        let cases: [(&[u8], &str); 4] = [
            (br#"{"customer": "c", "seat": {"row": "A"}, "extras": []}"#, "JSON field `seat.number` is missing"),
            (br#"{"seat": {"row": "A", "number": 1}, "extras": []}"#, "JSON field `customer` is missing"),
            (
                br#"{"customer": "c", "seat": {"row": "A", "number": "x"}, "extras": []}"#,
                "at `seat.number`: invalid type",
            ),
            (
                br#"{"customer": "c", "seat": {"row": "A", "number": 1}, "extras": [{"row": "B"}]}"#,
                "JSON field `extras[0].number` is missing",
            ),
        ];
        for (body, expected) in cases {
            let r = parse::<Reserve>(body).expect_err("refused");
            assert_eq!(r.error(), "invalid_json", "{}", r.message());
            assert!(r.message().contains(expected), "{:?} does not say {expected:?}", r.message());
        }
    }
}
