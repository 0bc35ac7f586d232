//! The Redis store.
//!
//! * A fresh token is the key `prefix:idem:t:{<token>}` (value `1`, TTL);
//!   consuming it is one `DEL`, and only the caller whose `DEL` counted 1
//!   proceeds. A token claimed by a running request is renamed to
//!   `prefix:idem:tu:{<token>}` (its TTL goes with it), so no `DEL` of the
//!   fresh name can take it meanwhile; returning renames it back, spending
//!   is one `DEL` of the claimed name. The braces keep both names in one
//!   Redis Cluster slot, for the scripts that rename. A token bound to a
//!   caller has the caller's hash after both names (`...:{<token>}:<sha1>`):
//!   a claim naming another caller, or none, finds nothing.
//! * A key record is a hash `prefix:idem:k:<sha1(scope, key)>` with fields
//!   `s` (`p` in progress / `c` completed), `f` fingerprint, `o` owner while
//!   in progress, `r` the encoded response. Its TTL is the lease while in
//!   progress, then the response TTL. Begin, complete and abandon are one Lua
//!   script each, touching only this key, so they are atomic and run on the
//!   one node of a Redis Cluster that owns its slot.
//!
//! Scope and key are hashed into the Redis key so that any bytes a client
//! sends give a short, fixed-shape key that no other `(scope, key)` can reach.

use std::time::Duration;

use redis::Script;

use super::{fingerprint, token_well_formed, Begin, Claim, IdempotencyStore, StoredResponse, TokenClaim, TOKEN_BYTES};
use crate::backend::redis::{lease_ms, redis_error, Conn, RedisBackend, RedisOptions, RestartGuard};
use crate::backend::BoxFuture;
use crate::error::{Error, Result};

/// Idempotency records in Redis, shared by every instance on that Redis.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use dlock_core::idempotency::{IdempotencyStore, RedisStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6400", "dlock").await?;
/// let token = store.issue_token(std::time::Duration::from_secs(60)).await?;
/// assert!(store.consume_token(&token).await?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    /// The backend's restart quarantine, when one is configured: no key is
    /// claimed from a server that may have lost its records.
    restart: Option<std::sync::Arc<RestartGuard>>,
    begin: Script,
    complete: Script,
    abandon: Script,
    claim_token: Script,
    return_token: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to `url` (any URL the Redis lock backend takes: single,
    /// `redis+cluster://`, `redis+sentinel://`) with the backend's timeouts.
    ///
    /// # Errors
    ///
    /// As [`RedisBackend::connect`]: [`Error::Config`] for a bad URL,
    /// [`Error::Backend`] when Redis cannot be reached in time.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, RedisOptions::default()).await
    }

    /// As [`connect`](Self::connect), with connection options (timeouts,
    /// TLS material for a `rediss://` URL).
    ///
    /// ```no_run
    /// # async fn demo() -> dlock_core::Result<()> {
    /// use dlock_core::backend::redis::RedisOptions;
    /// use dlock_core::idempotency::RedisStore;
    /// use dlock_core::RedisTls;
    /// let options = RedisOptions::default().with_tls(RedisTls::new().with_ca_file("ca.crt")?);
    /// let store = RedisStore::connect_with("rediss://10.0.0.1:6380", "dlock", options).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`RedisBackend::connect_with`].
    pub async fn connect_with(url: &str, prefix: &str, options: RedisOptions) -> Result<Self> {
        let backend = RedisBackend::connect_with(url, prefix, options).await?;
        Ok(Self::from_backend(&backend))
    }

    /// Shares the command connection of a Redis lock backend, and its key
    /// prefix: records live beside the locks, under one namespace.
    /// [`Config::build_services`](crate::Config::build_services) does this
    /// when locks and records live in the same Redis.
    pub fn from_backend(backend: &RedisBackend) -> Self {
        RedisStore {
            conn: backend.command_conn(),
            prefix: backend.key_prefix().to_owned(),
            restart: backend.restart_guard(),
            begin: Script::new(include_str!("begin.lua")),
            complete: Script::new(include_str!("complete.lua")),
            abandon: Script::new(include_str!("abandon.lua")),
            claim_token: Script::new(include_str!("claim_token.lua")),
            return_token: Script::new(include_str!("return_token.lua")),
        }
    }

    fn token_key(&self, token: &str) -> String {
        format!("{}:idem:t:{{{token}}}", self.prefix)
    }

    /// Issues a token, bound to `principal` or not.
    async fn issue(&self, principal: Option<&str>, ttl: Duration) -> Result<String> {
        let token = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let () = redis::cmd("SET")
            .arg(self.token_names(&token, principal).0)
            .arg(1)
            .arg("PX")
            .arg(lease_ms(ttl))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(redis_error)?;
        Ok(token)
    }

    /// The fresh and the claimed name of `token`, bound to `principal` or not.
    fn token_names(&self, token: &str, principal: Option<&str>) -> (String, String) {
        let bound = principal.map(|p| format!(":{}", fingerprint(&[p]))).unwrap_or_default();
        (format!("{}:idem:t:{{{token}}}{bound}", self.prefix), format!("{}:idem:tu:{{{token}}}{bound}", self.prefix))
    }

    /// Runs a rename script from `from` to `to`.
    async fn rename(&self, script: &Script, from: String, to: String) -> Result<i64> {
        script.key(from).key(to).invoke_async(&mut self.conn.clone()).await.map_err(redis_error)
    }

    async fn del(&self, key: String) -> Result<bool> {
        let removed: i64 = redis::cmd("DEL").arg(key).query_async(&mut self.conn.clone()).await.map_err(redis_error)?;
        Ok(removed == 1)
    }

    fn record_key(&self, scope: &str, key: &str) -> String {
        format!("{}:idem:k:{}", self.prefix, fingerprint(&[scope, key]))
    }
}

impl IdempotencyStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn issue_token<'a>(&'a self, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(None, ttl).await })
    }

    fn issue_bound_token<'a>(&'a self, principal: &'a str, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(Some(principal), ttl).await })
    }

    fn consume_token<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(false);
            }
            self.del(self.token_key(token)).await
        })
    }

    fn claim_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<TokenClaim>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(TokenClaim::Unknown);
            }
            let (fresh, claimed) = self.token_names(token, principal);
            Ok(match self.rename(&self.claim_token, fresh, claimed).await? {
                1 => TokenClaim::Claimed,
                2 => TokenClaim::InUse,
                _ => TokenClaim::Unknown,
            })
        })
    }

    fn spend_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move { Ok(token_well_formed(token) && self.del(self.token_names(token, principal).1).await?) })
    }

    fn return_token<'a>(&'a self, token: &'a str, principal: Option<&'a str>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (fresh, claimed) = self.token_names(token, principal);
            Ok(token_well_formed(token) && self.rename(&self.return_token, claimed, fresh).await? == 1)
        })
    }

    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            if let Some(guard) = &self.restart {
                guard.check_data(&self.conn).await?;
            }
            let claim = Claim::new(scope, key)?;
            let reply: redis::Value = self
                .begin
                .key(self.record_key(scope, key))
                .arg(fingerprint)
                .arg(claim.owner())
                .arg(lease_ms(lease))
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(redis_error)?;
            let unexpected =
                |v: &redis::Value| Error::backend("redis", format!("unexpected reply from the begin script: {v:?}"));
            let redis::Value::Array(items) = &reply else { return Err(unexpected(&reply)) };
            Ok(match items.as_slice() {
                [redis::Value::Int(0)] => Begin::New(claim),
                [redis::Value::Int(1)] => Begin::InProgress,
                [redis::Value::Int(3)] => Begin::Mismatch,
                [redis::Value::Int(2), redis::Value::BulkString(bytes)] => {
                    Begin::Completed(StoredResponse::decode(bytes)?)
                }
                _ => return Err(unexpected(&reply)),
            })
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let done: i64 = self
                .complete
                .key(self.record_key(claim.scope(), claim.key()))
                .arg(claim.owner())
                .arg(response.encode())
                .arg(lease_ms(ttl))
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(redis_error)?;
            Ok(done == 1)
        })
    }

    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let done: i64 = self
                .abandon
                .key(self.record_key(claim.scope(), claim.key()))
                .arg(claim.owner())
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(redis_error)?;
            Ok(done == 1)
        })
    }
}
