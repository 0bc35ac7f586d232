//! What each locked or idempotent request tells an operator: one `INFO`
//! span `dlock.http.request` with its outcome recorded on it (as the `idempotent`
//! crate does), and, with the `metrics` feature, its refusal by `error`
//! code and its idempotency outcome (`docs/operations.md` lists both).

use axum::response::Response;
use tracing::field::Empty;
use tracing::Span;

use crate::rejection::Rejection;
use crate::request::LockOutcome;

/// Which face answered.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Face {
    /// `LockLayer` or `#[lockable]`.
    Lock,
    /// `IdempotencyLayer` (`Idempotency-Key`).
    Key,
    /// `TokenLayer` (one-time tokens).
    Token,
}

impl Face {
    fn label(self) -> &'static str {
        match self {
            Face::Lock => "lock",
            Face::Key => "idempotency_key",
            Face::Token => "token",
        }
    }
}

/// The request's span: the lock's name for a lock, the face otherwise.
pub(crate) fn span(face: Face, name: &str) -> Span {
    tracing::info_span!(
        "dlock.http.request",
        dlock.face = face.label(),
        dlock.lock.name = name,
        dlock.outcome = Empty,
        http.response.status_code = Empty,
    )
}

/// Records `response` on `span` and in the metrics.
pub(crate) fn responded(face: Face, name: &str, span: &Span, response: &Response) {
    let rejection = response.extensions().get::<Rejection>();
    let outcome = match face {
        Face::Lock => response.extensions().get::<LockOutcome>().map_or("acquired", LockOutcome::as_str),
        Face::Key | Face::Token => idempotency_outcome(response, rejection),
    };
    span.record("dlock.outcome", outcome);
    span.record("http.response.status_code", response.status().as_u16());
    if let Some(rejection) = rejection {
        refused(name, rejection);
    }
    if !matches!(face, Face::Lock) {
        idempotency(face, outcome);
    }
}

/// A `#[lockable]` handler's lock ended with `outcome` (its response is the
/// handler's, made later).
pub(crate) fn locked(span: &Span, outcome: &LockOutcome) {
    span.record("dlock.outcome", outcome.as_str());
}

/// What an idempotent request came to: `executed` (the route ran now),
/// `replayed`, `in_progress`, `mismatch`, `outcome_unknown`, `not_stored`,
/// or `refused` (any other of dlock's refusals).
fn idempotency_outcome(response: &Response, rejection: Option<&Rejection>) -> &'static str {
    if response.headers().get(crate::idempotency::REPLAYED_HEADER).is_some_and(|v| v == "true") {
        return "replayed";
    }
    match rejection.map(Rejection::error) {
        None => "executed",
        Some("idempotency_request_in_progress") => "in_progress",
        Some("idempotency_key_mismatch") => "mismatch",
        Some("idempotency_outcome_unknown") => "outcome_unknown",
        Some("idempotency_response_not_stored") => "not_stored",
        Some(_) => "refused",
    }
}

/// `dlock.http.refusals`, by the lock's name (or the face) and `error` code.
#[cfg(feature = "metrics")]
fn refused(name: &str, rejection: &Rejection) {
    let (name, error) = (name.to_owned(), rejection.error().to_owned());
    quietly(|| {
        metrics::counter!(dlock_core::metrics::HTTP_REFUSALS, "dlock.lock.name" => name, "error" => error).increment(1)
    });
}

#[cfg(not(feature = "metrics"))]
fn refused(_name: &str, _rejection: &Rejection) {}

/// `dlock.idempotency.requests`, by face and outcome.
#[cfg(feature = "metrics")]
fn idempotency(face: Face, outcome: &'static str) {
    quietly(|| {
        metrics::counter!(dlock_core::metrics::IDEMPOTENCY_REQUESTS, "dlock.face" => face.label(), "dlock.outcome" => outcome)
            .increment(1)
    });
}

#[cfg(not(feature = "metrics"))]
fn idempotency(_face: Face, _outcome: &'static str) {}

/// A recorder's panic loses the figure, never the answer.
#[cfg(feature = "metrics")]
fn quietly(record: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(record)).is_err() {
        tracing::debug!("dlock: the metrics recorder panicked; the figure is lost");
    }
}
