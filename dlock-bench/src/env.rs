//! The server under test and the connections every benchmark shares.

use std::sync::Arc;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::{Locker, LockerOptions};
use redis::aio::MultiplexedConnection;

use crate::error::Result;
use crate::measure::CommandCounter;
use crate::pin::Pinning;

/// The server under test and the clients every benchmark shares.
pub(crate) struct Env {
    pub(crate) url: String,
    /// For connections a baseline opens itself (pub/sub).
    pub(crate) client: redis::Client,
    /// The one multiplexed connection of the hand-written baselines.
    pub(crate) conn: MultiplexedConnection,
    /// Reads `INFO commandstats` on a connection of its own.
    pub(crate) counter: CommandCounter,
    /// dlock over [`RedisBackend`].
    pub(crate) redis_locker: Locker,
    /// Namespace of every key of this run, so that runs against a shared
    /// server never meet.
    pub(crate) prefix: String,
    pub(crate) server_version: String,
    /// Where the servers a benchmark starts itself must run.
    pub(crate) pinning: Pinning,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env").field("url", &self.url).field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl Env {
    pub(crate) async fn connect(url: &str, pinning: Pinning) -> Result<Env> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        let counter = CommandCounter::new(client.get_multiplexed_async_connection().await?);
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn.clone()).await?;
        let server_version =
            info.lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or("unknown").trim().to_owned();
        let prefix = format!("dlock-bench-{}", std::process::id());
        let backend = RedisBackend::connect(url, &prefix).await?;
        let redis_locker = Locker::with_options(Arc::new(backend), LockerOptions::default().with_prefix(&prefix))?;
        Ok(Env { url: url.to_owned(), client, conn, counter, redis_locker, prefix, server_version, pinning })
    }
}
