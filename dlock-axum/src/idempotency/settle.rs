//! How a claimed idempotent request ends, by one rule for keys, tokens and transactions.

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dlock_core::idempotency::{Begin, Claim, StoredResponse};
use futures_util::StreamExt;

use super::REPLAYED_HEADER;
use crate::pipeline::detached::Settled;
use crate::pipeline::outage::STORE;
use crate::rejection::Rejection;

/// Response headers stored and replayed by default
/// ([`IdempotencyLayer::store_headers`](super::IdempotencyLayer::store_headers));
/// never `set-cookie`.
pub const DEFAULT_STORED_HEADERS: &[&str] =
    &["content-type", "content-language", "content-encoding", "location", "etag", "cache-control"];

/// Refusals before the work, never stored (`axum-idempotent`'s, plus `404`).
const NOT_STORED: &[u16] = &[400, 401, 403, 404, 405, 408, 411, 413, 414, 415, 422, 429];

/// The default of [`IdempotencyLayer::store_when`](super::IdempotencyLayer::store_when)
/// and [`TokenLayer::spend_when`](super::TokenLayer::spend_when), Stripe's
/// rule: a response counts only when the route ran to a result (`2xx`,
/// `3xx`, a `4xx` result such as the app's `409`). Never a `5xx`, a refusal
/// before the work (`400`, `401`, `403`, `404`, `405`, `408`, `411`, `413`,
/// `414`, `415`, `422`, `429`), or a refusal dlock made ([`Rejection::is_dlock`]).
///
/// ```
/// use axum::{http::StatusCode, response::IntoResponse};
/// use dlock_axum::{idempotency::stored_by_default, Rejection};
/// assert!(stored_by_default(&(StatusCode::CREATED, "made").into_response()));
/// assert!(stored_by_default(&Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, "none left").into_response()));
/// assert!(!stored_by_default(&StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response()));
/// assert!(!stored_by_default(&Rejection::duplicate_submission().into_response()));
/// ```
pub fn stored_by_default(response: &Response) -> bool {
    let status = response.status();
    !(status.is_server_error()
        || NOT_STORED.contains(&status.as_u16())
        || Rejection::of(response).is_some_and(Rejection::is_dlock))
}

/// Whether a route's response (before its body is read) is kept.
pub(super) type KeepWhen = Arc<dyn Fn(&Response) -> bool + Send + Sync>;

/// Whether `response` settles its claim: never a `5xx`, else as `when` says.
pub(super) fn kept(when: &KeepWhen, response: &Response) -> bool {
    !response.status().is_server_error() && when(response)
}

/// What of a route's answer is stored for replay, and when.
#[derive(Clone)]
pub(super) struct StorePolicy {
    pub(super) store_when: KeepWhen,
    pub(super) max_response_bytes: usize,
    pub(super) stored_headers: Arc<[HeaderName]>,
}

impl Default for StorePolicy {
    fn default() -> Self {
        StorePolicy {
            store_when: Arc::new(stored_by_default),
            max_response_bytes: 1024 * 1024,
            stored_headers: DEFAULT_STORED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect(),
        }
    }
}

impl StorePolicy {
    /// Whether `response` is kept for replay.
    pub(super) fn stores(&self, response: &Response) -> bool {
        kept(&self.store_when, response)
    }

    /// The record of a route's response and its client's answer; a body too
    /// large or failed is recorded as `409 idempotency_response_not_stored`.
    pub(super) async fn record(&self, response: Response, key: &str) -> (StoredResponse, Response) {
        let (mut parts, body) = response.into_parts();
        let headers: Vec<(String, Vec<u8>)> = self
            .stored_headers
            .iter()
            .flat_map(|name| {
                parts.headers.get_all(name).iter().map(move |v| (name.as_str().to_owned(), v.as_bytes().to_vec()))
            })
            .collect();
        let bytes = match read_response(body, self.max_response_bytes).await {
            ResponseBody::Whole(bytes) => bytes,
            ResponseBody::TooLarge(body) => {
                tracing::warn!(
                    key = crate::headers::log_id(key),
                    limit = self.max_response_bytes,
                    "dlock: response too large to store for replay; retries get idempotency_response_not_stored"
                );
                parts.headers.remove(header::CONTENT_LENGTH);
                return (not_stored_record(), Response::from_parts(parts, body));
            }
            ResponseBody::Failed(e) => {
                // Its status said the route ran: the key stays completed.
                tracing::warn!(error = %e, key = crate::headers::log_id(key), "dlock: reading the route's response failed; retries get idempotency_response_not_stored");
                return (not_stored_record(), Rejection::body_unreadable().into_response());
            }
        };
        let stored = StoredResponse::new(parts.status.as_u16(), headers, bytes.to_vec());
        parts.headers.remove(header::CONTENT_LENGTH);
        (stored, Response::from_parts(parts, Body::from(bytes)))
    }
}

/// A claim held while its route runs: kept, or given up so that a retry runs.
pub(super) trait Claimed: Send + Sized {
    /// Whether the route's `response` is a result that settles the claim.
    fn keeps(&self, response: &Response) -> bool;

    /// Gives the claim up: the route did not run to a result.
    fn abandon(self) -> impl Future<Output = ()> + Send;

    /// Settles the claim with the route's `response`; what the client gets.
    fn keep(self, response: Response) -> impl Future<Output = Response> + Send;
}

/// Settles `claim` by the route's answer (caught by
/// [`CatchUnwind`](crate::pipeline::detached::CatchUnwind)): kept for a result, else given up.
pub(super) async fn settle<C: Claimed, R: IntoResponse, E>(
    claim: C,
    answered: std::thread::Result<Result<R, E>>,
) -> Settled<E> {
    let response = match answered {
        Ok(Ok(res)) => res.into_response(),
        Ok(Err(e)) => {
            claim.abandon().await; // the route failed: as for a 5xx
            return Settled::Failed(e);
        }
        Err(panic) => {
            claim.abandon().await;
            return Settled::Panicked(panic);
        }
    };
    if !claim.keeps(&response) {
        // Not a result (a 5xx, a refusal before the work): the retry runs.
        claim.abandon().await;
        return Settled::Answer(response);
    }
    Settled::Answer(claim.keep(response).await)
}

/// Whether storing failed for the byte budget (then store [`not_stored_record`]).
pub(super) fn over_budget(stored: &dlock_core::Result<bool>, claim: &Claim) -> bool {
    let Err(e @ dlock_core::Error::IdempotencyFull { .. }) = stored else { return false };
    tracing::warn!(error = %e, key = crate::headers::log_id(claim.key()), "dlock: the answer is over the idempotency store's byte budget; retries get idempotency_response_not_stored");
    true
}

/// What a claim's answer leads to: run the route, or answer at once.
pub(super) enum Begun {
    /// [`Begin::New`]: the key is the request's.
    Run(Claim),
    /// Anything else: a replay, a refusal, or the store's error.
    Answer(Response),
}

/// What `begun` leads to.
pub(super) fn claimed(begun: dlock_core::Result<Begin>) -> Begun {
    match &begun {
        Err(e) if e.is_unavailable() => {}
        _ => STORE.answered(),
    }
    Begun::Answer(match begun {
        Ok(Begin::New(claim)) => return Begun::Run(claim),
        Ok(Begin::InProgress) => Rejection::idempotency_request_in_progress().into_response(),
        Ok(Begin::Mismatch) => Rejection::idempotency_key_mismatch().into_response(),
        Ok(Begin::Completed(stored)) => replay(stored),
        Ok(Begin::OutcomeUnknown) => Rejection::idempotency_outcome_unknown().into_response(),
        // An answer from a newer store: refuse rather than risk running twice.
        Ok(other) => store_error(&dlock_core::Error::Internal(format!(
            "the idempotency store answered {other:?}, which this layer does not know"
        ))),
        Err(e) => store_error(&e),
    })
}

/// The answer to a request the store could not serve.
pub(super) fn store_error(e: &dlock_core::Error) -> Response {
    if matches!(e, dlock_core::Error::IdempotencyFull { .. }) {
        // A refusal the caps exist to make: not worth a warning per request.
        tracing::debug!(error = %e, "dlock: idempotency store full");
    } else if e.is_unavailable() {
        // Told once per outage, with a count, by the outage log.
        tracing::debug!(error = %e, "dlock: idempotency store failed");
        STORE.refused(&e.to_string());
    } else {
        tracing::warn!(error = %e, "dlock: idempotency store failed");
    }
    Rejection::from_lock_error(e).into_response()
}

fn replay(stored: StoredResponse) -> Response {
    let mut res = Response::new(Body::from(stored.body));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in stored.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
            res.headers_mut().append(n, v);
        }
    }
    res.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    res
}

/// The record of `409 idempotency_response_not_stored`.
pub(super) fn not_stored_record() -> StoredResponse {
    let rejection = Rejection::idempotency_response_not_stored();
    StoredResponse::new(
        rejection.status().as_u16(),
        vec![("content-type".to_owned(), b"application/json".to_vec())],
        rejection.body_json().into_bytes(),
    )
}

/// A route's response body, read for storing.
enum ResponseBody {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Over the limit: the bytes read so far, then the rest, for the client.
    TooLarge(Body),
    /// The body failed while being read.
    Failed(axum::Error),
}

async fn read_response(body: Body, limit: usize) -> ResponseBody {
    let mut stream = body.into_data_stream();
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                len += chunk.len();
                read.push(chunk);
                if len > limit {
                    let head = futures_util::stream::iter(read.into_iter().map(Ok::<Bytes, axum::Error>));
                    return ResponseBody::TooLarge(Body::from_stream(head.chain(stream)));
                }
            }
            Err(e) => return ResponseBody::Failed(e),
        }
    }
    ResponseBody::Whole(match read.len() {
        0 => Bytes::new(),
        1 => read.swap_remove(0),
        _ => read.concat().into(),
    })
}
