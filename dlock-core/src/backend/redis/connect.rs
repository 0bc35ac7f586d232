//! How a URL becomes a [`RedisBackend`]: the client layer connects and
//! checks the server (`crate::redis::connect`, whatever topology the URL
//! names); then [`RedisBackend::finish`] starts the subscriber, puts the
//! restart quarantine in front of the connection where one is possible, and
//! picks where the high-water mark of fencing tokens lives (one key per
//! prefix, or one per slot in a cluster).

use std::sync::Arc;

use super::subscriber::Subscriber;
use super::{batch, high_water, HighWater, RedisBackend, RedisOptions};
use crate::backend::wait::Waiters;
use crate::error::Result;
use crate::key::validate_prefix;
use crate::redis::{self, Connected};

impl RedisBackend {
    /// Connects with the default timeouts; see [`RedisBackend::connect_with`].
    ///
    /// # Errors
    ///
    /// As [`RedisBackend::connect_with`].
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, RedisOptions::default()).await
    }

    /// Connects to the server at `url` and checks it: it must answer, the
    /// user must be allowed to subscribe to `prefix:*` channels, and a
    /// `maxmemory-policy` that evicts keys with a TTL (which are exactly the
    /// locks) is logged as a warning.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](crate::Error::Config) for a malformed URL, a
    /// missing ACL permission or a server older than Redis 7.0,
    /// [`Error::Backend`](crate::Error::Backend) when the server cannot be
    /// reached in time.
    pub async fn connect_with(url: &str, prefix: &str, options: RedisOptions) -> Result<Self> {
        Self::connect_waking(url, prefix, options, Arc::default()).await
    }

    /// As [`connect_with`](Self::connect_with), its release announcements
    /// waking the acquires parked in `waiters` (RedLock's nodes share one).
    pub(crate) async fn connect_waking(
        url: &str,
        prefix: &str,
        options: RedisOptions,
        waiters: Arc<Waiters>,
    ) -> Result<Self> {
        validate_prefix(prefix)?;
        let connected = redis::connect(url, &options).await?;
        Self::finish(connected, prefix, &options, waiters).await
    }

    async fn finish(connected: Connected, prefix: &str, options: &RedisOptions, waiters: Arc<Waiters>) -> Result<Self> {
        let Connected { conn, pubsub } = connected;
        let probe = format!("{prefix}:{{dlock-probe}}:released");
        let subscriber = Subscriber::start(pubsub, &probe, waiters).await?;
        let client = redis::client(conn, prefix, options).await?;
        let high_water = match client.is_cluster() {
            true => HighWater::PerSlot,
            false => HighWater::Prefix(high_water::prefix_mark(prefix)),
        };
        let batch = match &high_water {
            HighWater::Prefix(mark) => {
                Some((batch::Batcher::default(), batch::Calls { client: client.clone(), mark: mark.clone() }))
            }
            HighWater::PerSlot => None,
        };
        Ok(RedisBackend { client, prefix: prefix.into(), high_water, subscriber, batch })
    }
}
