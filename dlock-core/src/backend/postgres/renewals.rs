//! The watchdog's renewals of a tick ([`Backend::renew_many`](crate::backend::Backend::renew_many)),
//! sent as shared statements: `UPDATE … FROM unnest(keys, owners, leases)`,
//! up to [`MAX_BATCH`] holds each, instead of a round trip and a pooled
//! connection per hold.

use std::collections::HashSet;

use tokio::time::Instant;

use super::{millis, Shared};
use crate::backend::{RenewRequest, Renewal};
use crate::error::{Error, Result};
use crate::postgres::{column, Repeat, BACKEND};

/// The most holds renewed by one statement.
const MAX_BATCH: usize = 512;

/// Extends each hold of `holds` by its lease from the server's now; one
/// answer per hold, in order: [`Renewal::Lost`] for one no longer ours.
pub(super) async fn renew(shared: &Shared, holds: &[RenewRequest]) -> Vec<Result<Renewal>> {
    let mut answers = Vec::with_capacity(holds.len());
    for batch in holds.chunks(MAX_BATCH) {
        let sent = Instant::now();
        let keys: Vec<&str> = batch.iter().map(|h| h.key.as_str()).collect();
        let owners: Vec<&str> = batch.iter().map(|h| h.owner.as_str()).collect();
        let leases: Vec<i64> = batch.iter().map(|h| millis(h.lease).max(1)).collect();
        let query = || sqlx::query(&shared.renew).bind(&keys).bind(&owners).bind(&leases);
        // Extending a lease twice extends it once: safe to repeat.
        match shared.fetch_all(query, Repeat::Safe).await {
            Ok(rows) => {
                let renewed: HashSet<(String, String)> =
                    rows.iter().filter_map(|row| Some((column(row, 0).ok()?, column(row, 1).ok()?))).collect();
                answers.extend(batch.iter().map(|h| {
                    let ours = renewed.contains(&(h.key.as_str().to_owned(), h.owner.as_str().to_owned()));
                    Ok(if ours { Renewal::Held { valid_until: sent + h.lease } } else { Renewal::Lost })
                }));
            }
            Err(e) => {
                let message = e.to_string();
                answers.extend(batch.iter().map(|_| Err(Error::backend(BACKEND, message.clone()))));
            }
        }
    }
    answers
}
