//! axum's `Query` and `Path`, refusing as every other error of the
//! service does: with a [`Rejection`], which `RenderRejections` answers as
//! Problem Details, instead of axum's `text/plain` (axum's
//! "customize extractor error" pattern).

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::FromRequestParts;
use dlock_axum::Rejection;

use crate::AppError;

/// `axum::extract::Query`; a query string it cannot read (a field sent
/// twice, a value of the wrong type) is `400 invalid_query`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(AppError))]
pub(crate) struct Query<T>(pub(crate) T);

/// `axum::extract::Path`; a path parameter it cannot read (not UTF-8 once
/// percent-decoded, a value of the wrong type) is `400 invalid_path`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(AppError))]
pub(crate) struct Path<T>(pub(crate) T);

impl From<QueryRejection> for AppError {
    fn from(e: QueryRejection) -> Self {
        Rejection::new(e.status(), "invalid_query", 3009, e.body_text()).into()
    }
}

impl From<PathRejection> for AppError {
    fn from(e: PathRejection) -> Self {
        Rejection::new(e.status(), "invalid_path", 3010, e.body_text()).into()
    }
}
