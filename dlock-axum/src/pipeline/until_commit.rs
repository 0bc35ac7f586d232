//! Locks held until the route's transaction has ended, so the next holder
//! reads what it committed (`docs/axum-design.md`).

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

    /// Keeps `release` until [`ended`](Self::ended) (dropped unrun, it lets go in the background).
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
