//! [`Client`]: how every part of dlock talks to Redis — the lock backend,
//! its batcher, the watchdog's renewals, RedLock's nodes and the
//! idempotency store alike.
//!
//! It is the healing connection ([`Conn`]) with the restart quarantine
//! inside it: every command that fails is reported to the quarantine by
//! construction, so a new command path cannot forget to (the idempotency
//! store's scripts once did). The quarantine's own retry, "the data marker
//! is gone: decide, mark again, run once more", is written here once.

use std::sync::Arc;

use redis::FromRedisValue;

use super::connection::Conn;
use super::error::{lost_connection, redis_error};
use super::restart::RestartGuard;
use super::script::ScriptCall;
use crate::error::{Error, Result};

/// A connection to one Redis deployment (a server, a Sentinel-watched
/// master or a cluster), and its restart quarantine when one is on. Cheap
/// to clone.
#[derive(Clone)]
pub(crate) struct Client {
    conn: Conn,
    restart: Option<Arc<RestartGuard>>,
}

impl Client {
    pub(crate) fn new(conn: Conn, restart: Option<Arc<RestartGuard>>) -> Self {
        Client { conn, restart }
    }

    /// The connection, for what is not a command of dlock's protocol (the
    /// quarantine's own checks, start-up checks).
    pub(crate) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// The data marker every guarded script checks, when the quarantine is on.
    pub(crate) fn marker(&self) -> Option<&str> {
        self.restart.as_deref().map(|guard| guard.marker.as_str())
    }

    /// A failed command as an error; a broken connection may mean a
    /// restarted server, which the quarantine hears of first.
    ///
    /// On a cluster, a connection that broke, refused or timed out may
    /// follow a try that was sent: redis-rs sends a command once more on
    /// its own after an I/O error (`retries`), and the error it returns is
    /// the last try's. So such an error is marked "may have run", and an
    /// acquire that ends in it is undone like one whose answer was lost.
    pub(crate) fn failed(&self, e: redis::RedisError) -> Error {
        let resent = self.is_cluster() && lost_connection(&e);
        let error = match &self.restart {
            Some(guard) => guard.failed(e),
            None => redis_error(e),
        };
        match resent {
            true => error.may_have_run(),
            false => error,
        }
    }

    /// Sends a script call. On a cluster, a call redirected (`MOVED`,
    /// `ASK`) or refused while a master rejoins (`TRYAGAIN`, `CLUSTERDOWN`)
    /// goes once more: after a master restarts, redis-rs's one retry is
    /// spent reconnecting, and its slot map is refreshed by the redirect
    /// itself. Every lock script is safe to run twice for one owner (an
    /// acquire joins its own hold, release and renewal check the owner).
    pub(crate) async fn invoke<T: FromRedisValue>(&self, call: &ScriptCall<'_>) -> Result<T> {
        let mut conn = self.conn.clone();
        match call.invoke(&mut conn).await {
            Err(e) if self.is_cluster() && rerouted(&e) => {
                tracing::debug!(error = %e, "dlock: Redis Cluster redirected a call after a topology change; sending it again");
                call.invoke(&mut conn).await.map_err(|e| self.failed(e))
            }
            answered => answered.map_err(|e| self.failed(e)),
        }
    }

    /// Sends a plain command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        cmd.query_async(&mut self.conn.clone()).await.map_err(|e| self.failed(e))
    }

    /// Refuses while the quarantine holds this server's data in doubt.
    pub(crate) async fn check(&self) -> Result<()> {
        match &self.restart {
            Some(guard) => guard.check(&self.conn).await,
            None => Ok(()),
        }
    }

    /// Runs `attempt`, a script that checks the data marker, until it finds
    /// the marker: when it answers that the marker is gone (`gone`), the
    /// quarantine decides (a refusal while the loss is younger than the
    /// quarantine, or the marker set again) and the attempt runs once more.
    /// Without the quarantine, the first answer stands.
    pub(crate) async fn guarded<R, F, Fut>(&self, mut attempt: F, gone: fn(&R) -> bool) -> Result<R>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<R>>,
    {
        let mut remarked = false;
        loop {
            self.check().await?;
            let answer = attempt().await?;
            match &self.restart {
                Some(guard) if !remarked && gone(&answer) => {
                    guard.marker_missing(&self.conn).await?;
                    remarked = true;
                }
                _ => return Ok(answer),
            }
        }
    }

    /// Answers now and grants: a `PING` answered (on a cluster, by a
    /// node), and no restart quarantine in force (its refusal says how
    /// long it has left).
    pub(crate) async fn ready(&self) -> Result<()> {
        self.check().await?;
        let _: String = self.query(&redis::cmd("PING")).await?;
        Ok(())
    }

    /// Whether this is a Redis Cluster connection.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }
}

/// The cluster sent the call elsewhere, or asked for it later, while its
/// topology changed.
fn rerouted(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(kind) if matches!(kind,
        redis::ServerErrorKind::Moved | redis::ServerErrorKind::Ask | redis::ServerErrorKind::TryAgain | redis::ServerErrorKind::ClusterDown))
}
