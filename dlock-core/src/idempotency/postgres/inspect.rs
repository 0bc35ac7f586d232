//! The PostgreSQL store's records as an operator sees them: one record,
//! the claims stuck past their lease, and a caller's tally against its
//! caps. Reads only; a claim is released by `abandon` (`release_claim`).

use std::time::Duration;

use super::PostgresStore;
use crate::error::{Error, Result};
use crate::idempotency::{RecordState, RecordView, StoredResponse, Usage};
use crate::postgres::{column, Repeat};

/// A record's row: `scope, key, owner, lease_ms, response, bytes,
/// expires_ms, age_ms`, its times on the server's clock.
const COLUMNS: &str = "k.scope, k.key, k.owner, \
     (extract(epoch FROM k.lease_until - clock_timestamp()) * 1000)::bigint, k.response, k.bytes, \
     (extract(epoch FROM k.expires_at - clock_timestamp()) * 1000)::bigint, \
     (extract(epoch FROM clock_timestamp() - k.claimed_at) * 1000)::bigint";

/// The statements, for the store's prefix (`fill` names its objects).
pub(super) struct Inspect {
    record: String,
    stuck: String,
    usage: String,
}

impl Inspect {
    pub(super) fn new(fill: impl Fn(&str) -> String) -> Self {
        Inspect {
            record: fill(&format!(
                "SELECT {COLUMNS} FROM {{keys}} AS k WHERE k.scope = $1 AND k.key = $2 \
                 AND k.expires_at > clock_timestamp()"
            )),
            // Not indexed by lease: an operator's look, not a request's.
            stuck: fill(&format!(
                "SELECT {COLUMNS} FROM {{keys}} AS k WHERE k.response IS NULL \
                 AND k.lease_until <= clock_timestamp() AND k.expires_at > clock_timestamp() \
                 ORDER BY k.lease_until LIMIT $1"
            )),
            usage: fill(
                "SELECT coalesce(sum(t.records), 0)::bigint, coalesce(sum(t.bytes), 0)::bigint \
                 FROM {tally} AS t WHERE t.pool = $1",
            ),
        }
    }
}

fn ms(n: Option<i64>) -> Option<Duration> {
    n.map(|n| Duration::from_millis(u64::try_from(n).unwrap_or(0)))
}

fn view(row: &sqlx::postgres::PgRow) -> Result<RecordView> {
    let (scope, key): (String, String) = (column(row, 0)?, column(row, 1)?);
    let (owner, lease): (Option<String>, Option<i64>) = (column(row, 2)?, column(row, 3)?);
    let (response, bytes, expires): (Option<Vec<u8>>, i64, i64) = (column(row, 4)?, column(row, 5)?, column(row, 6)?);
    let state = match (&response, lease) {
        (Some(r), _) => RecordState::Completed { status: StoredResponse::decode(r)?.status },
        // Claimed inside the route's transaction: held while it lives.
        (None, None) => RecordState::InProgress { lease_left: None },
        (None, Some(left)) if left > 0 => RecordState::InProgress { lease_left: ms(Some(left)) },
        (None, Some(_)) => RecordState::OutcomeUnknown,
    };
    let bytes = u64::try_from(bytes).unwrap_or(0);
    let mut view = RecordView::new(&scope, &key, state, bytes, ms(Some(expires)).unwrap_or_default());
    let age: Option<i64> = column(row, 7)?;
    if let Some(age) = ms(age) {
        view = view.with_age(age);
    }
    Ok(match owner {
        Some(owner) if response.is_none() => view.claimed_by(owner),
        _ => view,
    })
}

impl PostgresStore {
    pub(super) async fn record_in_table(&self, scope: &str, key: &str) -> Result<Option<RecordView>> {
        let query = || sqlx::query(&self.inner.inspect.record).bind(scope).bind(key);
        self.db().await?.fetch(query, Repeat::Safe).await?.as_ref().map(view).transpose()
    }

    pub(super) async fn stuck_in_table(&self, limit: usize) -> Result<Vec<RecordView>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows =
            self.db().await?.fetch_all(|| sqlx::query(&self.inner.inspect.stuck).bind(limit), Repeat::Safe).await?;
        rows.iter().map(view).collect()
    }

    pub(super) async fn usage_in_tally(&self, scope: Option<&str>) -> Result<Usage> {
        let pool = scope.map_or_else(|| "k".to_owned(), |s| format!("k:{s}"));
        let query = || sqlx::query(&self.inner.inspect.usage).bind(pool.as_str());
        let row = self.db().await?.fetch(query, Repeat::Safe).await?;
        let row = row.ok_or_else(|| Error::backend("postgres", "the tally answered no row"))?;
        let (records, bytes): (i64, i64) = (column(&row, 0)?, column(&row, 1)?);
        let (records, bytes) = (u64::try_from(records).unwrap_or(0), u64::try_from(bytes).unwrap_or(0));
        let l = &self.limits;
        Ok(match scope {
            Some(_) => Usage::new(records, bytes, l.max_per_scope(), l.max_bytes_per_scope()),
            None => Usage::new(records, bytes, l.max_records(), l.max_bytes()),
        })
    }
}
