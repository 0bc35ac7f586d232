//! Locks held until the route's transaction has ended.
//!
//! Under [`IdempotencyLayer::in_transaction`](crate::idempotency::IdempotencyLayer::in_transaction)
//! the route's writes commit after the route has answered, when the layer
//! has stored the answer in the same transaction. A lock taken inside that
//! layer ([`LockLayer`](crate::LockLayer) as a `route_layer`, or
//! `#[lockable]`) would be released when the route answers, before that
//! commit: the next holder would read what the transaction is about to
//! overwrite. So the in-transaction layer leaves an [`UntilCommit`] in the
//! request, and a lock that finds one hands its release to it; the layer
//! runs those releases once its transaction has committed or rolled back.

use std::sync::{Arc, Mutex, PoisonError};

use axum::http::Extensions;
use futures_util::future::BoxFuture;

/// Releases kept for the end of the route's transaction.
#[derive(Clone, Default)]
pub(crate) struct UntilCommit(Arc<Mutex<Vec<BoxFuture<'static, ()>>>>);

impl std::fmt::Debug for UntilCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.0.lock().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("UntilCommit").field("kept", &kept).finish()
    }
}

impl UntilCommit {
    /// The one a request carries, if its route runs inside a transaction.
    pub(crate) fn of(extensions: &Extensions) -> Option<UntilCommit> {
        extensions.get::<UntilCommit>().cloned()
    }

    /// Makes the request's locks wait for this transaction.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn insert(&self, extensions: &mut Extensions) {
        extensions.insert(self.clone());
    }

    /// Keeps `release` until [`ended`](Self::ended). Dropped unrun (the
    /// task that settles the transaction is gone), it lets go of what it
    /// holds as any dropped lock does: in the background.
    pub(crate) fn keep(&self, release: BoxFuture<'static, ()>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(release);
    }

    /// The transaction has committed or rolled back: runs the releases kept.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) async fn ended(self) {
        let releases = std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner));
        futures_util::future::join_all(releases).await;
    }
}
