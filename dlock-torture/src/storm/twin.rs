//! The negative control of the storm's hang-ups: a front that awaits a
//! key's claim in the request's own future, as `IdempotencyLayer` did
//! before the claim moved to a detached task (review of 2026-12-07, L2).
//!
//! Such a build cannot be run here (`dlock-axum` is what is under test),
//! so the harness plays its front itself, with `dlock-core`'s own store:
//! the twin claims a key on the storm's Redis, through the same slow proxy
//! and with the terms, scope and fingerprint `orders` uses, inside a future
//! that the client's hang-up drops, exactly as hyper dropped the old
//! layer's. Its retries then go to the real `orders`. When the hang-up
//! lands while the claim is in flight, the claim is made and its answer
//! read by nobody: the key answers `409` until its lease ends. The stranded
//! check must catch that, or it could not catch the real thing.

use std::time::{Duration, Instant};

use dlock_core::backend::redis::RedisOptions;
use dlock_core::idempotency::{canonical_body, fingerprint, Begin, ClaimTerms, IdempotencyStore, RedisStore};

use super::record;

/// The twin's front: the store `orders` keeps its records in, reached
/// through the same proxy.
pub(super) struct Twin {
    store: RedisStore,
    scope: String,
    terms: ClaimTerms,
}

/// How a twin request ended.
pub(super) struct Ended {
    pub(super) hung_up: Instant,
    /// The claim's answer came before the hang-up: the old layer went on to
    /// run the route. The twin cannot run `orders`' route, so it frees the
    /// key instead, and its retry runs the route on `orders`.
    pub(super) answered: bool,
}

impl Twin {
    /// `url`: the records' Redis as `orders` reaches it; `lease`: the lease
    /// `orders` gives `POST /charges`.
    pub(super) async fn connect(url: &str, lease: Duration) -> Result<Twin, String> {
        let store = RedisStore::connect_with(url, record::PREFIX, RedisOptions::default())
            .await
            .map_err(|e| format!("the twin's store: {e}"))?;
        // `orders`' `POST /charges` layer: `.lease(lease).run_again_after_lease()`.
        let terms = ClaimTerms::new(lease).with_ttl(record::TTL).run_again_after_lease();
        Ok(Twin { store, scope: record::scope(), terms })
    }

    /// The fingerprint `IdempotencyLayer` gives `POST /charges` with a JSON
    /// `body` (method, path, the body's canonical form). The storm's bodies
    /// are canonical already, so a layer that fingerprints the bytes as
    /// sent computes the same one; [`Twin::check`] proves it.
    fn fingerprint(body: &str) -> String {
        fingerprint(&[b"POST".as_slice(), b"/charges", &canonical_body(body.as_bytes(), true)])
    }

    /// Proves the twin claims the records `orders` claims: `key` was just
    /// answered by `orders` for `body`, so the twin must find it completed.
    pub(super) async fn check(&self, key: &str, body: &str) -> Result<(), String> {
        let begun = self.store.begin(&self.scope, key, &Self::fingerprint(body), self.terms).await;
        match begun.map_err(|e| format!("the twin's claim of {key}: {e}"))? {
            Begin::Completed(_) => Ok(()),
            Begin::Mismatch => {
                Err(format!("the twin's fingerprint of {key} is not IdempotencyLayer's (update storm/twin.rs)"))
            }
            Begin::New(claim) => {
                let _ = self.store.abandon(&claim).await;
                Err(format!(
                    "the twin found no record of {key}: its scope is not IdempotencyLayer's (update storm/record.rs)"
                ))
            }
            other => Err(format!("the twin's claim of {key}, answered by orders, answered {other:?}")),
        }
    }

    /// Claims `key` in a future the client's hang-up drops `after` from now.
    pub(super) async fn claim_and_hang_up(&self, key: &str, body: &str, after: Duration) -> Result<Ended, String> {
        let fp = Self::fingerprint(body);
        let claim = tokio::time::timeout(after, self.store.begin(&self.scope, key, &fp, self.terms)).await;
        let hung_up = Instant::now();
        match claim {
            // The hang-up: the claim's future is dropped wherever it stood.
            Err(_) => Ok(Ended { hung_up, answered: false }),
            Ok(Ok(Begin::New(claim))) => {
                self.store.abandon(&claim).await.map_err(|e| format!("the twin's give-back of {key}: {e}"))?;
                Ok(Ended { hung_up, answered: true })
            }
            Ok(Ok(other)) => Err(format!("the twin's first claim of {key} answered {other:?}")),
            Ok(Err(e)) => Err(format!("the twin's claim of {key}: {e}")),
        }
    }
}
