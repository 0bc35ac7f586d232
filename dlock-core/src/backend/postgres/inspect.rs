//! A PostgreSQL lock as an operator sees it (`inspect.sql`), one page of
//! held keys (`list.sql`), and a holder freed by force: the release
//! function run for it.

use std::time::Duration;

use super::schema::parse_mode;
use super::PostgresBackend;
use crate::backend::{Holder, KeyPage, ListQuery, LockState, Release};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::postgres::{column, Repeat};

fn unexpected(what: &str) -> Error {
    Error::backend("postgres", format!("a lock row holds {what}, which dlock does not write"))
}

impl PostgresBackend {
    pub(super) async fn inspect_on_server(&self, key: &LockKey) -> Result<LockState> {
        let rows = self.db().fetch_all(|| sqlx::query(&self.shared.inspect).bind(key.as_str()), Repeat::Safe).await?;
        let mut state = LockState::new(key.clone());
        for row in &rows {
            let kind: String = column(row, 0)?;
            if kind == "w" {
                state.intents += 1;
                continue;
            }
            let (owner, mode): (String, String) = (column(row, 1)?, column(row, 2)?);
            let (fence, left): (i64, i64) = (column(row, 3)?, column(row, 4)?);
            let mode = parse_mode(&mode).ok_or_else(|| unexpected("an unknown mode"))?;
            let fence = u64::try_from(fence).map_err(|_| unexpected("a negative token"))?;
            let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
            state.holders.push(Holder::new(owner, mode, fence).with_time_left(left));
        }
        state.holders.sort_by_key(|h| h.fencing_token);
        Ok(state)
    }

    pub(super) async fn list_on_server(&self, query: &ListQuery) -> Result<KeyPage> {
        let after = query.cursor.as_deref().unwrap_or("");
        // One more than a page, to know whether another follows.
        let limit = i64::try_from(query.limit).unwrap_or(i64::MAX - 1) + 1;
        let rows = self
            .db()
            .fetch_all(
                || sqlx::query(&self.shared.list).bind(query.starts_with.as_str()).bind(after).bind(limit),
                Repeat::Safe,
            )
            .await?;
        let mut keys = Vec::with_capacity(rows.len());
        for row in rows.iter().take(query.limit) {
            let key: String = column(row, 0)?;
            keys.push(LockKey::parse(&key)?);
        }
        let next = (rows.len() > query.limit).then(|| keys.last().map(|k| k.as_str().to_owned())).flatten();
        Ok(KeyPage::new(keys, next))
    }

    /// The release function (`release_any.sql`) run for `holder`: it frees
    /// the hold whatever its mode, and announces it to the waiters.
    pub(super) async fn force_unlock_on_server(&self, key: &LockKey, holder: &Holder) -> Result<Release> {
        Ok(match self.release_any(key, &holder.owner()?, false).await? {
            true => Release::Freed,
            false => Release::NotHeld,
        })
    }
}
