//! [`Rejection`]: every refusal dlock makes, and its one HTTP answer.
//! Applications answer their own errors in the same shape with
//! [`Rejection::new`] (the `orders` example answers `409 sold_out` that way).
//!
//! ```
//! use axum::response::IntoResponse;
//! use dlock_axum::Rejection;
//!
//! let r = Rejection::duplicate_submission().with_message("order already being placed").with_code(4001);
//! assert_eq!(r.status(), 409);
//! assert_eq!(r.error(), "duplicate_submission");
//! let response = r.into_response();
//! assert_eq!(response.headers()["content-type"], "application/json");
//! ```

use std::borrow::Cow;
use std::fmt;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The default text of `duplicate_submission`.
pub const DEFAULT_DUPLICATE_MESSAGE: &str = "duplicate submission, please retry later";
/// The default number of `duplicate_submission`.
pub const DEFAULT_DUPLICATE_CODE: u32 = 2101;

/// A refusal with its HTTP status and JSON body
/// `{"error": "<machine code>", "code": <number>, "message": "<text>"}`
/// (`code` is configurable only for `duplicate_submission`).
///
/// | status | `error` | `code` | when |
/// |---|---|---|---|
/// | 400 | `lock_key_field_missing` | 2001 | a field named in the lock key is not in the request (or is an empty header) |
/// | 400 | `invalid_json` | 2002 | the body is not JSON, but the key needs a field of it |
/// | 400 | `idempotency_token_missing` | 2003 | no one-time token was sent |
/// | 400 | `idempotency_token_duplicated` | 2010 | the one-time token was sent more than once (two headers, two query parameters, or both) |
/// | 400 | `idempotency_key_missing` | 2004 | no `Idempotency-Key` header was sent |
/// | 400 | `idempotency_key_invalid` | 2005 | the `Idempotency-Key` header is malformed |
/// | 400 | `lock_key_invalid` | 2006 | the key built from the request is unusable (e.g. too long) |
/// | 400 | `request_body_unreadable` | 2007 | the body could not be read (client went away, bad framing) |
/// | 400 | `idempotency_scope_missing` | 2008 | the request does not name the caller its `Idempotency-Key` (or one-time token) belongs to |
/// | 400 | `lock_key_field_duplicated` | 2009 | a query parameter or header of the lock key is sent more than once |
/// | 400 | `lock_caller_missing` | 2011 | the route caps the locks of each caller, and the request does not name its caller |
/// | 408 | `request_timeout` | 2303 | the body did not arrive within the body-read timeout |
/// | 409 | `duplicate_submission` | 2101 (configurable) | the lock is held by another request (transient: `Retry-After` the lease, see below) |
/// | 409 | `idempotency_request_in_progress` | 2102 | the same `Idempotency-Key` is still being processed (transient: `Retry-After`) |
/// | 409 | `lock_wait_timeout` | 2103 | the route waits for its lock, and it stayed held for the whole wait (transient: `Retry-After` the lease, see below) |
/// | 409 | `idempotency_token_unknown` | 2104 | the one-time token is unknown, expired or already used (permanent: fetch a new token) |
/// | 409 | `lock_token_stale` | 2105 | the storage refused the route's write: its lock's lease ran out and another holder wrote with a newer fencing token ([`Error::StaleToken`](dlock_core::Error::StaleToken), from [`dlock_core::fence`]); nothing was changed (transient: `Retry-After`) |
/// | 413 | `payload_too_large` | 2301 | the body is larger than the most bytes read to derive a key |
/// | 415 | `unsupported_media_type` | 2302 | the key needs JSON fields and the body's `Content-Type` is not JSON |
/// | 422 | `idempotency_key_mismatch` | 2201 | the same `Idempotency-Key` was sent with a different payload |
/// | 409 | `idempotency_response_not_stored` | 2202 | the request with this `Idempotency-Key` ran, but its response could not be kept (too large, or its body failed) (permanent) |
/// | 409 | `idempotency_outcome_unknown` | 2203 | the request with this `Idempotency-Key` (or one-time token) was claimed by an instance that neither answered nor gave it back before its lease ran out: whether it ran is unknown (permanent: check, then use a new key) |
/// | 429 | `too_many_locks` | 2401 | the caller already holds the most locks a layer allows at once (transient: `Retry-After`) |
/// | 429 | `lock_permits_exhausted` | 2403 | the route admits at most N requests at once per key (a semaphore: `#[lockable(permits = N)]`, [`LockLayer::permits`](crate::LockLayer::permits)), all N are running, and the route's wait ran out (transient: `Retry-After` the lease, see below) |
/// | 429 | `idempotency_scope_full` | 2402 | the caller already has the most live idempotency records (or tokens) the store keeps per caller (transient: `Retry-After` until its oldest expires) |
/// | 500 | `lock_misconfigured` | 2901 | the service is misconfigured (no lock engine installed, bad config) |
/// | 501 | `lock_mode_unsupported` | 2902 | the route's lock mode (a semaphore of several permits) cannot be kept by the lock backend this instance runs on (RedLock): the route is not served here, the rest of the service is (permanent) |
/// | 503 | `lock_backend_unavailable` | 2501 | the lock service cannot be reached: fail closed (transient: `Retry-After`) |
/// | 503 | `idempotency_store_full` | 2502 | the idempotency store holds the most live records (or tokens) it keeps in all (transient: `Retry-After` until the oldest expires) |
/// | 503 | `idempotency_not_committed` | 2503 | the route ran inside its transaction and the transaction did not commit: nothing it wrote was kept (transient: retry with the same `Idempotency-Key`) |
///
/// A transient refusal carries `Retry-After` ([`Rejection::retry_after`]),
/// a permanent one none. A busy lock says the route's lease (else
/// `DLOCK_LEASE_MS`), rounded up (why: `docs/axum-design.md`); a full store
/// or a restart quarantine says when it ends; everything else says 1.
///
/// Every response carries its [`Rejection`] in its extensions
/// ([`Rejection::of`]), so middleware recognises a refusal without reading
/// the body; [`Rejection::is_dlock`] tells dlock's from the application's.
///
/// ```
/// use dlock_axum::Rejection;
/// let r = Rejection::backend_unavailable();
/// assert_eq!((r.status().as_u16(), r.error(), r.code()), (503, "lock_backend_unavailable", 2501));
/// assert_eq!(
///     r.body_json(),
///     r#"{"error":"lock_backend_unavailable","code":2501,"message":"lock service unavailable, please retry later"}"#
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    status: StatusCode,
    error: Cow<'static, str>,
    code: u32,
    message: Cow<'static, str>,
    /// Seconds for `Retry-After`: set on the transient refusals.
    retry_after: Option<u32>,
    /// Made by dlock (one of the constructors below), not by `Rejection::new`.
    dlock: bool,
}

macro_rules! rejections {
    ($(
        $(#[$doc:meta])*
        $fn:ident => ($status:ident, $error:literal, $code:literal, $message:literal, $retry:expr);
    )*) => {
        impl Rejection {
            $(
                $(#[$doc])*
                #[doc = concat!("\n\n`", stringify!($status), "`, `", $error, "`, ", stringify!($code), ": \"", $message, "\".")]
                pub fn $fn() -> Self {
                    Rejection {
                        status: StatusCode::$status,
                        error: Cow::Borrowed($error),
                        code: $code,
                        message: Cow::Borrowed($message),
                        retry_after: $retry,
                        dlock: true,
                    }
                }
            )*
        }

        #[cfg(test)]
        const ALL: &[fn() -> Rejection] = &[$(Rejection::$fn),*];
    };
}

rejections! {
    /// The lock is held by another request (message and code may be set per route).
    duplicate_submission => (CONFLICT, "duplicate_submission", 2101, "duplicate submission, please retry later", Some(1));
    /// A request with the same `Idempotency-Key` is still being processed.
    idempotency_request_in_progress => (CONFLICT, "idempotency_request_in_progress", 2102,
        "a request with this idempotency key is still being processed", Some(1));
    /// The lock stayed held for the route's whole wait.
    lock_wait_timeout => (CONFLICT, "lock_wait_timeout", 2103,
        "the lock stayed held for as long as this route waits, please retry later", Some(1));
    /// The one-time token is unknown, expired or used. Permanent: fetch a new one.
    idempotency_token_unknown => (CONFLICT, "idempotency_token_unknown", 2104,
        "the one-time token is unknown, expired or already used; fetch a new one", None);
    /// The storage refused the route's write for a newer fencing token ([`dlock_core::fence`]).
    lock_token_stale => (CONFLICT, "lock_token_stale", 2105,
        "another request took the lock after this one's lease ran out; its write was refused and nothing was changed", Some(1));
    /// A field named in the lock key is absent from the request.
    field_missing => (BAD_REQUEST, "lock_key_field_missing", 2001, "a field of the lock key is missing from the request", None);
    /// The body must be JSON to derive the key, and it is not.
    invalid_json => (BAD_REQUEST, "invalid_json", 2002, "the request body is not valid JSON", None);
    /// No one-time token was sent.
    idempotency_token_missing => (BAD_REQUEST, "idempotency_token_missing", 2003, "the one-time submission token is missing", None);
    /// The one-time token was sent more than once.
    idempotency_token_duplicated => (BAD_REQUEST, "idempotency_token_duplicated", 2010,
        "the one-time submission token was sent more than once", None);
    /// No `Idempotency-Key` header was sent.
    idempotency_key_missing => (BAD_REQUEST, "idempotency_key_missing", 2004, "the Idempotency-Key header is missing", None);
    /// The `Idempotency-Key` header is malformed.
    idempotency_key_invalid => (BAD_REQUEST, "idempotency_key_invalid", 2005, "the Idempotency-Key header is malformed", None);
    /// The key built from the request cannot be used (for example too long).
    lock_key_invalid => (BAD_REQUEST, "lock_key_invalid", 2006, "the lock key built from this request is invalid", None);
    /// The request body could not be read.
    body_unreadable => (BAD_REQUEST, "request_body_unreadable", 2007, "the request body could not be read", None);
    /// A query parameter or header of the key is sent more than once.
    field_duplicated => (BAD_REQUEST, "lock_key_field_duplicated", 2009,
        "a field of the lock key is sent more than once", None);
    /// The body did not arrive within the body-read timeout.
    request_timeout => (REQUEST_TIMEOUT, "request_timeout", 2303, "the request body did not arrive in time", None);
    /// The body is larger than the most bytes read to derive a key.
    payload_too_large => (PAYLOAD_TOO_LARGE, "payload_too_large", 2301, "the request body is too large", None);
    /// The key needs JSON fields and the body's `Content-Type` is not JSON.
    unsupported_media_type => (UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", 2302,
        "the request body must be JSON (Content-Type: application/json)", None);
    /// The request names no [`Caller`](crate::Caller) for its `Idempotency-Key`.
    idempotency_scope_missing => (BAD_REQUEST, "idempotency_scope_missing", 2008,
        "the request does not name the caller its Idempotency-Key belongs to", None);
    /// The request with this `Idempotency-Key` ran; its response could not be kept.
    idempotency_response_not_stored => (CONFLICT, "idempotency_response_not_stored", 2202,
        "a request with this idempotency key was processed, but its response could not be kept", None);
    /// The claim of this `Idempotency-Key` ran out unanswered: whether it ran is unknown.
    idempotency_outcome_unknown => (CONFLICT, "idempotency_outcome_unknown", 2203,
        "a request with this idempotency key was started but never answered; whether it ran is unknown: check, then use a new key", None);
    /// The same `Idempotency-Key` was used with a different payload.
    idempotency_key_mismatch => (UNPROCESSABLE_ENTITY, "idempotency_key_mismatch", 2201,
        "this idempotency key was used with a different request", None);
    /// The route caps each caller's locks, and the request names no caller.
    lock_caller_missing => (BAD_REQUEST, "lock_caller_missing", 2011,
        "the request does not name the caller whose locks this route counts", None);
    /// The caller already holds as many locks through this layer as it may.
    too_many_locks => (TOO_MANY_REQUESTS, "too_many_locks", 2401, "too many locks held at once, please retry later", Some(1));
    /// Every permit of a semaphore route stayed taken for its whole wait.
    permits_exhausted => (TOO_MANY_REQUESTS, "lock_permits_exhausted", 2403,
        "this route is already running as many requests at once as it allows, please retry later", Some(1));
    /// The caller has as many live records (or tokens) as the store keeps per caller.
    idempotency_scope_full => (TOO_MANY_REQUESTS, "idempotency_scope_full", 2402,
        "too many idempotency records are kept for this caller, please retry later", Some(1));
    /// The store holds as many live records (or tokens) as it keeps in all.
    idempotency_store_full => (SERVICE_UNAVAILABLE, "idempotency_store_full", 2502,
        "the idempotency store is full, please retry later", Some(1));
    /// The route's transaction did not commit: nothing it wrote was kept.
    idempotency_not_committed => (SERVICE_UNAVAILABLE, "idempotency_not_committed", 2503,
        "the request's transaction did not commit: nothing it wrote was kept; retry with the same idempotency key", Some(1));
    /// The lock service cannot be reached: the request is refused (fail closed).
    backend_unavailable => (SERVICE_UNAVAILABLE, "lock_backend_unavailable", 2501,
        "lock service unavailable, please retry later", Some(1));
    /// The service is misconfigured (no engine installed, invalid options).
    misconfigured => (INTERNAL_SERVER_ERROR, "lock_misconfigured", 2901, "the lock service is misconfigured", None);
    /// The lock backend cannot keep the route's mode (a semaphore on RedLock).
    lock_mode_unsupported => (NOT_IMPLEMENTED, "lock_mode_unsupported", 2902,
        "this route's lock cannot be kept by the lock service this instance runs on", None);
}

impl Rejection {
    /// A rejection of the application's own, in the same JSON shape.
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// use dlock_axum::Rejection;
    /// let r = Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "not enough stock");
    /// assert_eq!(r.body_json(), r#"{"error":"sold_out","code":3001,"message":"not enough stock"}"#);
    /// ```
    pub fn new(
        status: StatusCode,
        error: impl Into<Cow<'static, str>>,
        code: u32,
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        Rejection { status, error: error.into(), code, message: message.into(), retry_after: None, dlock: false }
    }

    /// `lock_key_field_missing` naming the field.
    ///
    /// ```
    /// let r = dlock_axum::Rejection::missing_field("json field `product_id`");
    /// assert_eq!(r.message(), "json field `product_id` is missing from the request");
    /// ```
    pub fn missing_field(what: impl fmt::Display) -> Self {
        Self::field_missing().with_message(format!("{what} is missing from the request"))
    }

    /// Replaces the message.
    pub fn with_message(mut self, message: impl Into<Cow<'static, str>>) -> Self {
        self.message = message.into();
        self
    }

    /// Replaces the numeric code.
    pub fn with_code(mut self, code: u32) -> Self {
        self.code = code;
        self
    }

    /// Sets (or, with `None`, removes) the `Retry-After` seconds.
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// use dlock_axum::Rejection;
    /// let r = Rejection::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", 3004, "retry").with_retry_after(Some(2));
    /// assert_eq!(r.retry_after(), Some(2));
    /// ```
    pub fn with_retry_after(mut self, seconds: Option<u32>) -> Self {
        self.retry_after = seconds;
        self
    }

    /// The `Retry-After` seconds: `Some` on a transient refusal (the same
    /// request may succeed later), `None` on a permanent one.
    ///
    /// ```
    /// use dlock_axum::Rejection;
    /// assert_eq!(Rejection::duplicate_submission().retry_after(), Some(1));
    /// assert_eq!(Rejection::idempotency_token_unknown().retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<u32> {
        self.retry_after
    }

    /// Whether dlock made this refusal, rather than [`Rejection::new`].
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// use dlock_axum::Rejection;
    /// assert!(Rejection::lock_wait_timeout().is_dlock());
    /// assert!(!Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "none left").is_dlock());
    /// ```
    pub fn is_dlock(&self) -> bool {
        self.dlock
    }

    /// The rejection a response carries, for middleware that recognises refusals.
    ///
    /// ```
    /// use axum::response::IntoResponse;
    /// use dlock_axum::Rejection;
    /// let response = Rejection::lock_wait_timeout().into_response();
    /// assert_eq!(Rejection::of(&response).map(Rejection::error), Some("lock_wait_timeout"));
    /// ```
    pub fn of<B>(response: &axum::http::Response<B>) -> Option<&Rejection> {
        response.extensions().get::<Rejection>()
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The machine code (`duplicate_submission`, …).
    pub fn error(&self) -> &str {
        &self.error
    }

    /// The numeric code.
    pub fn code(&self) -> u32 {
        self.code
    }

    /// The text for people.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The JSON body this rejection answers with.
    pub fn body_json(&self) -> String {
        // By hand, to keep the documented field order; `Value` escapes.
        let error = serde_json::Value::from(self.error.as_ref());
        let message = serde_json::Value::from(self.message.as_ref());
        format!(r#"{{"error":{error},"code":{},"message":{message}}}"#, self.code)
    }

    /// This refusal as RFC 9457 Problem Details (`application/problem+json`):
    /// `type` `about:blank`, `title`, `status`, `detail` (the message), and
    /// dlock's `error` and `code`; headers and extensions as [`IntoResponse`]'s.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http_body_util::BodyExt;
    /// let res = dlock_axum::Rejection::lock_wait_timeout().to_problem_details();
    /// assert_eq!(res.headers()["content-type"], "application/problem+json");
    /// let body = res.into_body().collect().await.unwrap().to_bytes();
    /// let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!((v["status"].as_u64(), v["error"].as_str(), v["code"].as_u64()), (Some(409), Some("lock_wait_timeout"), Some(2103)));
    /// # }
    /// ```
    pub fn to_problem_details(&self) -> Response {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "detail": self.message.as_ref(),
            "error": self.error.as_ref(),
            "code": self.code,
        });
        let mut response = self.clone().into_response();
        *response.body_mut() = Body::from(body.to_string());
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        response
    }

    /// Maps an engine error to its refusal (held, waited out, stale token,
    /// invalid key, misconfigured or [`Error::Internal`](dlock_core::Error::Internal),
    /// a full store); anything else is `503 lock_backend_unavailable` (fail
    /// closed). The engine's text, which names keys and servers, is not copied.
    ///
    /// ```
    /// use dlock_axum::Rejection;
    /// let busy = dlock_core::Error::Busy { key: "dlock:{k}".into() };
    /// assert_eq!(Rejection::from_lock_error(&busy).error(), "duplicate_submission");
    /// let waited = dlock_core::Error::Timeout { key: "dlock:{k}".into(), waited: std::time::Duration::from_secs(5) };
    /// assert_eq!(Rejection::from_lock_error(&waited).error(), "lock_wait_timeout");
    /// let stale = dlock_core::Error::StaleToken { resource: "stock:42".into(), token: 7, newest: 9 };
    /// assert_eq!(Rejection::from_lock_error(&stale).error(), "lock_token_stale");
    /// let down = dlock_core::Error::backend("redis", "connection refused");
    /// assert_eq!(Rejection::from_lock_error(&down).status(), 503);
    /// let bug = dlock_core::Error::Internal("polled after it finished".into());
    /// assert_eq!(Rejection::from_lock_error(&bug).status(), 500);
    /// let full = dlock_core::Error::IdempotencyFull { per_scope: true, retry_after: std::time::Duration::from_millis(2500) };
    /// let r = Rejection::from_lock_error(&full);
    /// assert_eq!((r.status().as_u16(), r.error(), r.retry_after()), (429, "idempotency_scope_full", Some(3)));
    /// ```
    pub fn from_lock_error(err: &dlock_core::Error) -> Self {
        if let dlock_core::Error::IdempotencyFull { per_scope, retry_after } = err {
            let full = if *per_scope { Self::idempotency_scope_full() } else { Self::idempotency_store_full() };
            return full.with_retry_after(Some(whole_seconds(*retry_after)));
        }
        if matches!(err, dlock_core::Error::Timeout { .. }) {
            Self::lock_wait_timeout()
        } else if err.is_stale() {
            Self::lock_token_stale()
        } else if err.is_contention() {
            Self::duplicate_submission()
        } else if matches!(err, dlock_core::Error::InvalidKey(_)) {
            Self::lock_key_invalid()
        } else if err.is_misconfigured() || matches!(err, dlock_core::Error::Internal(_)) {
            Self::misconfigured()
        } else {
            // A refusal that knows its end (a restart quarantine) says it.
            let unavailable = Self::backend_unavailable();
            match err.retry_after() {
                Some(left) => unavailable.with_retry_after(Some(whole_seconds(left))),
                None => unavailable,
            }
        }
    }
}

/// `Retry-After` seconds for `left`: rounded up, at least 1.
pub(crate) fn whole_seconds(left: std::time::Duration) -> u32 {
    let seconds = left.as_millis().div_ceil(1000).clamp(1, u128::from(u32::MAX));
    u32::try_from(seconds).unwrap_or(u32::MAX)
}

impl From<&dlock_core::Error> for Rejection {
    fn from(err: &dlock_core::Error) -> Self {
        Rejection::from_lock_error(err)
    }
}

impl From<dlock_core::Error> for Rejection {
    fn from(err: dlock_core::Error) -> Self {
        Rejection::from_lock_error(&err)
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ({}): {}", self.status.as_u16(), self.error, self.code, self.message)
    }
}

impl std::error::Error for Rejection {}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let mut response = Response::new(Body::from(self.body_json()));
        *response.status_mut() = self.status;
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // The marker middleware reads without parsing the body.
        response.extensions_mut().insert(self);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::collections::HashSet;

    #[test]
    fn codes_and_machine_codes_are_unique() {
        let all: Vec<Rejection> = ALL.iter().map(|f| f()).collect();
        let codes: HashSet<u32> = all.iter().map(Rejection::code).collect();
        let errors: HashSet<&str> = all.iter().map(Rejection::error).collect();
        assert_eq!(codes.len(), all.len());
        assert_eq!(errors.len(), all.len());
        assert_eq!(Rejection::duplicate_submission().code(), DEFAULT_DUPLICATE_CODE);
        assert_eq!(Rejection::duplicate_submission().message(), DEFAULT_DUPLICATE_MESSAGE);
    }

    #[test]
    fn statuses_follow_the_contract() {
        let expect = [
            ("duplicate_submission", 409),
            ("idempotency_request_in_progress", 409),
            ("lock_wait_timeout", 409),
            ("idempotency_token_unknown", 409),
            ("lock_token_stale", 409),
            ("lock_key_field_missing", 400),
            ("invalid_json", 400),
            ("idempotency_token_missing", 400),
            ("idempotency_token_duplicated", 400),
            ("idempotency_key_missing", 400),
            ("idempotency_key_invalid", 400),
            ("lock_key_invalid", 400),
            ("request_body_unreadable", 400),
            ("lock_key_field_duplicated", 400),
            ("lock_caller_missing", 400),
            ("request_timeout", 408),
            ("idempotency_scope_missing", 400),
            ("idempotency_response_not_stored", 409),
            ("idempotency_outcome_unknown", 409),
            ("payload_too_large", 413),
            ("unsupported_media_type", 415),
            ("idempotency_key_mismatch", 422),
            ("too_many_locks", 429),
            ("lock_permits_exhausted", 429),
            ("idempotency_scope_full", 429),
            ("lock_backend_unavailable", 503),
            ("idempotency_store_full", 503),
            ("idempotency_not_committed", 503),
            ("lock_misconfigured", 500),
            ("lock_mode_unsupported", 501),
        ];
        let all: Vec<Rejection> = ALL.iter().map(|f| f()).collect();
        assert_eq!(all.len(), expect.len());
        for (error, status) in expect {
            let r = all.iter().find(|r| r.error() == error).unwrap_or_else(|| panic!("no rejection {error}"));
            assert_eq!(r.status().as_u16(), status, "{error}");
        }
    }

    #[test]
    fn engine_errors_map_by_class() {
        use dlock_core::Error;
        let cases = [
            (Error::Busy { key: "k".into() }, 409),
            (Error::Timeout { key: "k".into(), waited: std::time::Duration::from_secs(1) }, 409),
            (Error::backend("redis", "down"), 503),
            (Error::QuorumUnavailable { granted: 1, nodes: 3, needed: 2 }, 503),
            (Error::InvalidKey("too long".into()), 400),
            (Error::config("DLOCK_PREFIX", "empty"), 500),
            (Error::Cancelled, 503),
            (Error::StaleToken { resource: "r".into(), token: 1, newest: 2 }, 409),
            (Error::IdempotencyFull { per_scope: true, retry_after: std::time::Duration::from_secs(1) }, 429),
            (Error::IdempotencyFull { per_scope: false, retry_after: std::time::Duration::from_secs(1) }, 503),
        ];
        for (err, status) in cases {
            assert_eq!(Rejection::from(&err).status().as_u16(), status, "{err}");
        }
    }

    #[tokio::test]
    async fn response_is_the_json_body() {
        let r = Rejection::duplicate_submission().with_message("wait \"please\"").with_code(7);
        let response = r.into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(v, serde_json::json!({"error": "duplicate_submission", "code": 7, "message": "wait \"please\""}));
    }

    #[test]
    fn unavailable_says_when_to_retry() {
        let response = Rejection::backend_unavailable().into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }

    /// A quarantine's refusal says the time it has left, rounded up, at least 1.
    #[test]
    fn a_timed_refusal_says_its_time() {
        use std::time::Duration;
        for (left, seconds) in [(2_500, 3), (3_000, 3), (1, 1), (0, 1), (59_001, 60)] {
            let err = dlock_core::Error::unavailable_for("redis", "quarantined", Duration::from_millis(left));
            let r = Rejection::from_lock_error(&err);
            assert_eq!((r.status().as_u16(), r.retry_after()), (503, Some(seconds)), "{left} ms");
        }
    }

    #[test]
    fn transient_refusals_say_when_to_retry_and_permanent_ones_do_not() {
        let transient = [
            "duplicate_submission",
            "idempotency_request_in_progress",
            "lock_wait_timeout",
            "lock_token_stale",
            "too_many_locks",
            "lock_permits_exhausted",
            "idempotency_scope_full",
            "lock_backend_unavailable",
            "idempotency_store_full",
            "idempotency_not_committed",
        ];
        for r in ALL.iter().map(|f| f()) {
            let response = r.clone().into_response();
            let header = response.headers().get(header::RETRY_AFTER);
            if transient.contains(&r.error()) {
                assert_eq!(header.map(|v| v.as_bytes()), Some(&b"1"[..]), "{}", r.error());
            } else {
                assert!(header.is_none(), "{} is permanent", r.error());
            }
        }
    }

    #[test]
    fn engine_contention_is_told_apart() {
        use dlock_core::Error;
        let busy = Rejection::from(&Error::Busy { key: "k".into() });
        let waited = Rejection::from(&Error::Timeout { key: "k".into(), waited: std::time::Duration::from_secs(1) });
        assert_eq!((busy.error(), busy.code()), ("duplicate_submission", 2101));
        assert_eq!((waited.error(), waited.code()), ("lock_wait_timeout", 2103));
    }

    #[test]
    fn every_response_carries_its_rejection() {
        for r in ALL.iter().map(|f| f()) {
            let response = r.clone().into_response();
            let marked = Rejection::of(&response).expect("marked");
            assert_eq!(marked, &r);
            assert!(marked.is_dlock());
        }
        let own = Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "none left").into_response();
        assert_eq!(Rejection::of(&own).map(Rejection::is_dlock), Some(false));
    }

    #[test]
    fn display_names_status_and_code() {
        assert_eq!(
            Rejection::payload_too_large().to_string(),
            "413 payload_too_large (2301): the request body is too large"
        );
    }
}
