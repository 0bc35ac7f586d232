//! Release announcements: the connection that listens on the prefix's
//! channel and wakes this process's waiters of the key ([`Waiters`]), and
//! the sweep of rows whose lease ended long ago.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::time::Instant;

use super::schema::Names;
use super::CancellationToken;
use crate::backend::redact;
use crate::backend::wait::{Freed, Waiters};
use crate::error::{Error, Result};
use crate::postgres::{connect_options, pool, within, PostgresOptions};

/// The variable that names where the listener connects.
const LISTEN_URL_VAR: &str = "DLOCK_POSTGRES_LISTEN_URL";

/// An error of the listen URL names its own variable.
fn listen_url_error(e: Error) -> Error {
    match e {
        Error::Config { reason, .. } => Error::config(LISTEN_URL_VAR, reason),
        other => other,
    }
}

/// The connection that listens on the channel of `names`: one of `pool`'s,
/// or of a pool of one of its own when `options` give it its own URL (the
/// listener takes a connection of its pool, and makes it again when it
/// breaks).
pub(super) async fn connect(pool: &PgPool, names: &Names, options: &PostgresOptions) -> Result<PgListener> {
    let listen_pool = match options.listen_url() {
        Some(url) => {
            let one = options.clone().with_max_connections(1);
            self::pool(connect_options(url, options).map_err(listen_url_error)?, &one)
        }
        None => pool.clone(),
    };
    let what = match options.listen_url() {
        Some(url) => format!("listening for releases at {LISTEN_URL_VAR} ({})", redact(url)),
        None => "listening for releases".to_owned(),
    };
    within(options.response_timeout(), &what, async {
        let mut listener = PgListener::connect_with(&listen_pool).await?;
        listener.listen(&names.channel).await?;
        Ok(listener)
    })
    .await
}

/// The sweep's statement: the rows of `names` whose lease ended over a
/// minute ago.
pub(super) fn sweep(names: &Names) -> String {
    names.fill(
        "WITH h AS (DELETE FROM {holders} WHERE expires_at < clock_timestamp() - interval '1 minute') \
         DELETE FROM {locks} WHERE expires_at < clock_timestamp() - interval '1 minute'",
    )
}

/// Wakes the waiters of this process when a release is announced; every
/// minute, deletes the rows whose lease ended long ago (holders that never
/// released: every other row goes with its release).
pub(super) async fn listen(
    mut listener: PgListener,
    waiters: Arc<Waiters>,
    pool: PgPool,
    sweep: String,
    stop: CancellationToken,
) {
    let mut sweeps = tokio::time::interval_at(Instant::now() + SWEEP_EVERY, SWEEP_EVERY);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return,
            _ = sweeps.tick() => {
                // Best effort: a row left behind costs space, nothing else.
                let _ = tokio::time::timeout(Duration::from_secs(10), sqlx::query(&sweep).execute(&pool)).await;
                continue;
            }
            next = listener.try_recv() => next,
        };
        match next {
            Ok(Some(notification)) => waiters.wake(notification.payload(), Freed::Hold),
            // The connection was lost and made again: announcements sent in
            // between are lost, so everyone tries again.
            Ok(None) => waiters.wake_every_key(),
            Err(e) => {
                tracing::debug!(error = %e, "dlock: the PostgreSQL release listener is down; retrying");
                waiters.wake_every_key();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(LISTENER_BACKOFF) => {}
                }
            }
        }
    }
}

const SWEEP_EVERY: Duration = Duration::from_secs(60);
const LISTENER_BACKOFF: Duration = Duration::from_millis(250);
