//! The Redis store. Where each entry and pool lives, on one server and on
//! a Cluster: [`layout`].
//!
//! * A fresh token is the key `prefix:idem:t:<home>:<token>`, its value the
//!   bucket its pools count it in (ledger.lua), with its TTL; consuming it
//!   is one `DEL` in a script, and only the caller whose `DEL` counted 1
//!   proceeds. A token claimed by a running request is renamed to
//!   `prefix:idem:tu:<home>:<token>` (its TTL goes with it) with the value
//!   `<owner>:<lease end>:<bucket>`, so no `DEL` of the fresh name can take
//!   it meanwhile; its owner renews the lease, returns it (renamed back) or
//!   spends it (one `DEL` of the claimed name), and a claim whose lease ran
//!   out answers "outcome unknown". The home of a token bound to a caller
//!   is in the slot of the caller's pools; an unbound one's is `{anon}`,
//!   the slot of the unbound tokens' pool, so that pool is enforced on a
//!   Cluster too.
//! * A key record is one string `prefix:idem:r:<tag>:<sha1(scope, key)>`:
//!   state, fingerprint, owner and lease end while in progress, the bucket
//!   and bytes its pools count, and the encoded response once completed
//!   (record.lua). It lives the claim terms' TTL from its claim. Begin,
//!   renew, complete and abandon are one Lua script each, touching only this
//!   key and its pools, so they are atomic and run on the one node of a
//!   Redis Cluster that owns the slot.
//! * **Pools** ([`IdempotencyLimits`], ledger.lua): a hash per caller, one
//!   for the total (on a Cluster, one per shard of the total, in the
//!   shard's slot) and one for unbound tokens count live entries and their
//!   bytes by when they expire, two commands to read and two to change
//!   whatever they hold. Every deployment is bounded in total, records and
//!   bytes.
//!
//! Scope and key are hashed into the Redis key so that any bytes a client
//! sends give a short, fixed-shape key that no other `(scope, key)` can reach.
//!
//! The records (`r:`) and pools (`rp:`, `tp:`) have names of their own, apart
//! from the hashes and sorted sets of earlier versions (`k:`, `kn:`, `tn:`):
//! a store of this version never meets one of another type, which would be
//! an error (`WRONGTYPE`) on every request for it; the old keys expire.
//!
//! **Upgrading a Cluster.** On Redis Cluster this version keeps a caller's
//! records and bound tokens in the slot of its shard, no longer of its own
//! hash: new names, which never meet the old ones (a shard's tag is never a
//! 40-digit hash), so no bump of the prefix is needed. The store does not
//! look for a record under its old name. The old and the new name of a key
//! are in different slots, so no script can read one and claim the other
//! at once: during a rolling upgrade an old instance would claim the old
//! name, a new one the new name, and both would run the route whatever the
//! new one read first; and the read would cost every claim a command on
//! another node, for as long as the code is kept, to cover one TTL of old
//! records. So a Cluster deployment is upgraded as onto an empty store:
//! stop every instance of the earlier version first; a key answered before
//! the upgrade runs again if it is retried after it (once), a bound token
//! issued before it is unknown (fetched again), and the old keys expire
//! within their TTL. One server and Sentinel keep their names, and unbound
//! tokens theirs everywhere.

use std::time::Duration;

use redis::Script;

use super::{
    token_well_formed, Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, StoredResponse, TokenClaim,
    TOKEN_BYTES,
};
use crate::backend::redis::script::ScriptCall;
use crate::backend::redis::{lease_ms, Client, RedisBackend, RedisOptions};
use crate::backend::BoxFuture;
use crate::error::{Error, Result};

mod layout;

use layout::{Layout, Pool};

/// The pools' helpers, prepended to every script (ledger.lua).
const LEDGER: &str = include_str!("ledger.lua");
/// The key record's format, prepended to the scripts that read it.
const RECORD: &str = include_str!("record.lua");

/// Idempotency records in Redis, shared by every instance on that Redis,
/// bounded by [`IdempotencyLimits`].
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use dlock_core::idempotency::{IdempotencyStore, RedisStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6400/1", "dlock").await?;
/// let token = store.issue_token(std::time::Duration::from_secs(60)).await?;
/// let claim = match store.claim_token(&token, None, std::time::Duration::from_secs(10)).await? {
///     dlock_core::idempotency::TokenClaim::Claimed(claim) => claim,
///     other => panic!("a fresh token is claimed: {other:?}"),
/// };
/// assert!(store.spend_token(&claim).await?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    /// The lock backend's client: its restart quarantine, when one is
    /// configured, hears of every failed command here too, and no key is
    /// claimed from a server that may have lost its records.
    client: Client,
    /// Where records, tokens and pools live: one server's names, or a
    /// Cluster's shards.
    layout: Layout,
    limits: IdempotencyLimits,
    begin: Script,
    renew: Script,
    complete: Script,
    abandon: Script,
    issue_token: Script,
    spend_token: Script,
    claim_token: Script,
    renew_token: Script,
    return_token: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("layout", &self.layout).field("limits", &self.limits).finish_non_exhaustive()
    }
}

/// A script's keys: `first`, then the pools', in the order its `KEYS`
/// expects them.
fn keys_and_pools<'a>(first: &[&'a str], pools: &'a [Pool]) -> Vec<&'a str> {
    first.iter().copied().chain(pools.iter().map(|p| p.key.as_str())).collect()
}

/// The pools' caps, as the scripts take them: count, bytes, for each.
fn caps(call: &mut ScriptCall<'_>, pools: &[Pool]) {
    for pool in pools {
        call.arg(pool.max).arg(pool.max_bytes);
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
    /// [`Config::build`](crate::Config::build) does this
    /// when locks and records live in the same Redis.
    pub fn from_backend(backend: &RedisBackend) -> Self {
        let client = backend.client().clone();
        let layout = Layout::new(backend.key_prefix(), client.is_cluster());
        let counting = |script: &str| Script::new(&format!("{LEDGER}{script}"));
        let on_records = |script: &str| Script::new(&format!("{LEDGER}{RECORD}{script}"));
        RedisStore {
            client,
            layout,
            limits: IdempotencyLimits::default(),
            begin: on_records(include_str!("begin.lua")),
            renew: on_records(include_str!("renew_claim.lua")),
            complete: on_records(include_str!("complete.lua")),
            abandon: on_records(include_str!("abandon.lua")),
            issue_token: counting(include_str!("issue_token.lua")),
            spend_token: counting(include_str!("spend_token.lua")),
            claim_token: counting(include_str!("claim_token.lua")),
            renew_token: counting(include_str!("renew_token.lua")),
            return_token: Script::new(include_str!("return_token.lua")),
        }
    }

    /// Replaces the caps on live records and tokens (default
    /// [`IdempotencyLimits::default`]).
    ///
    /// ```no_run
    /// # async fn demo() -> dlock_core::Result<()> {
    /// use dlock_core::idempotency::{IdempotencyLimits, RedisStore};
    /// let store = RedisStore::connect("redis://127.0.0.1:6400/1", "dlock")
    ///     .await?
    ///     .with_limits(IdempotencyLimits::default().with_max_per_scope(500));
    /// # Ok(()) }
    /// ```
    pub fn with_limits(mut self, limits: IdempotencyLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The refusal for the `i`-th (1-based) of `pools` being full.
    fn full(pools: &[Pool], i: i64, ms: i64) -> Error {
        let per_scope = usize::try_from(i - 1).ok().and_then(|i| pools.get(i)).is_some_and(|p| p.per_scope);
        Error::IdempotencyFull { per_scope, retry_after: Duration::from_millis(u64::try_from(ms).unwrap_or(1)) }
    }

    /// Issues a token, bound to `principal` or not.
    async fn issue(&self, principal: Option<&str>, ttl: Duration) -> Result<String> {
        let token = crate::owner::random_hex::<TOKEN_BYTES>()?;
        let pools = self.layout.token_pools(principal, &self.limits);
        let name = self.token_names(&token, principal).0;
        let keys = keys_and_pools(&[&name], &pools);
        let mut call = ScriptCall::new(&self.issue_token, &keys, 1 + 2 * pools.len());
        call.arg(lease_ms(ttl));
        caps(&mut call, &pools);
        let reply: Vec<i64> = self.client.invoke(&call).await?;
        match reply.as_slice() {
            [0] => Ok(token),
            [i, ms] => Err(Self::full(&pools, *i, *ms)),
            other => Err(Error::backend("redis", format!("unexpected reply from the issue script: {other:?}"))),
        }
    }

    /// The fresh and the claimed name of `token`, bound to `principal` or not.
    fn token_names(&self, token: &str, principal: Option<&str>) -> (String, String) {
        self.layout.token_names(token, principal)
    }

    /// Deletes a token's `name` (the claimed one: only if `owner` holds it)
    /// and takes it out of its pools, in one step.
    async fn spend(&self, name: String, principal: Option<&str>, owner: &str) -> Result<bool> {
        let pools = self.layout.token_pools(principal, &self.limits);
        let keys = keys_and_pools(&[&name], &pools);
        let mut call = ScriptCall::new(&self.spend_token, &keys, 1);
        call.arg(owner);
        let removed: i64 = self.client.invoke(&call).await?;
        Ok(removed == 1)
    }

    /// The `maxmemory-policy` of the server the records live on; an error
    /// when it cannot be read (`CONFIG` refused by an ACL, say).
    pub(crate) async fn maxmemory_policy(&self) -> Result<String> {
        let reply: Vec<String> = self.client.query(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy")).await?;
        match reply.as_slice() {
            [_, policy] => Ok(policy.clone()),
            other => Err(Error::backend("redis", format!("CONFIG GET maxmemory-policy answered {other:?}"))),
        }
    }

    /// Whether the server the records live on keeps them over a restart:
    /// an append-only file, or RDB snapshots. An error when it cannot be
    /// read (`CONFIG` refused by an ACL, say).
    pub(crate) async fn persists(&self) -> Result<bool> {
        let config = |name: &'static str| async move {
            let reply: Vec<String> = self.client.query(redis::cmd("CONFIG").arg("GET").arg(name)).await?;
            match reply.as_slice() {
                [_, value] => Ok(value.clone()),
                other => Err(Error::backend("redis", format!("CONFIG GET {name} answered {other:?}"))),
            }
        };
        let aof = config("appendonly").await?;
        let rdb = config("save").await?;
        Ok(aof == "yes" || !rdb.trim().is_empty())
    }

    /// The record's key and its pools.
    fn record(&self, scope: &str, key: &str) -> (String, Vec<Pool>) {
        self.layout.record(scope, key, &self.limits)
    }
}

impl IdempotencyStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.client.ready())
    }

    fn issue_token<'a>(&'a self, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(None, ttl).await })
    }

    fn issue_bound_token<'a>(&'a self, principal: &'a str, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(Some(principal), ttl).await })
    }

    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<TokenClaim>> {
        Box::pin(async move {
            if !token_well_formed(token) {
                return Ok(TokenClaim::Unknown);
            }
            let claim = Claim::token(token, principal)?;
            let (fresh, claimed) = self.token_names(token, principal);
            let mut call = ScriptCall::new(&self.claim_token, &[&fresh, &claimed], 2);
            call.arg(claim.owner()).arg(lease_ms(lease));
            let reply: i64 = match self.client.invoke(&call).await {
                Ok(reply) => reply,
                Err(e) => {
                    if e.outcome_unknown() {
                        super::give_back_later(self, claim, lease);
                    }
                    return Err(e);
                }
            };
            Ok(match reply {
                1 => TokenClaim::Claimed(claim),
                2 => TokenClaim::InUse,
                3 => TokenClaim::OutcomeUnknown,
                _ => TokenClaim::Unknown,
            })
        })
    }

    fn spend_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (token, principal) = (claim.key(), claim.principal());
            let claimed = self.token_names(token, principal).1;
            Ok(token_well_formed(token) && self.spend(claimed, principal, claim.owner()).await?)
        })
    }

    fn return_token<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !token_well_formed(claim.key()) {
                return Ok(false);
            }
            let (fresh, claimed) = self.token_names(claim.key(), claim.principal());
            let mut call = ScriptCall::new(&self.return_token, &[&claimed, &fresh], 1);
            call.arg(claim.owner());
            let returned: i64 = self.client.invoke(&call).await?;
            Ok(returned == 1)
        })
    }

    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: ClaimTerms,
    ) -> BoxFuture<'a, Result<Begin>> {
        Box::pin(async move {
            let claim = Claim::new(scope, key)?;
            let (record, pools) = self.record(scope, key);
            // The record's fields are separated by `|`: a fingerprint is
            // stored as its own hash, whatever bytes it holds.
            let fingerprint = super::fingerprint(&[fingerprint]);
            // The script checks the data marker itself, as the lock's
            // acquire does: no round trip of its own per claim.
            let marker = self.client.marker();
            let keys = keys_and_pools(&[&record, marker.unwrap_or(&record)], &pools);
            let mut call = ScriptCall::new(&self.begin, &keys, 6 + 2 * pools.len());
            call.arg(&fingerprint).arg(claim.owner()).arg(lease_ms(terms.lease()));
            call.arg(if marker.is_some() { "1" } else { "0" });
            call.arg(lease_ms(terms.ttl())).arg(if terms.runs_again_after_lease() { "1" } else { "0" });
            caps(&mut call, &pools);
            let marker_gone = |reply: &redis::Value| matches!(reply, redis::Value::Array(items) if matches!(items.as_slice(), [redis::Value::Int(5)]));
            let reply: redis::Value = match self.client.guarded(|| self.client.invoke(&call), marker_gone).await {
                Ok(reply) => reply,
                Err(e) => {
                    if e.outcome_unknown() {
                        // Redis may run the claim when it answers again:
                        // the request is told to retry, so give it back.
                        super::give_back_later(self, claim, terms.lease());
                    }
                    return Err(e);
                }
            };
            let unexpected =
                |v: &redis::Value| Error::backend("redis", format!("unexpected reply from the begin script: {v:?}"));
            let redis::Value::Array(items) = &reply else { return Err(unexpected(&reply)) };
            Ok(match items.as_slice() {
                // The fingerprint as stored and the record's bucket: what
                // `complete` writes back in one command.
                [redis::Value::Int(0), bucket] => {
                    let bucket = match bucket {
                        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                        redis::Value::Int(n) => n.to_string(),
                        _ => return Err(unexpected(&reply)),
                    };
                    Begin::New(claim.with_memo(format!("{fingerprint}|{bucket}")))
                }
                [redis::Value::Int(1)] => Begin::InProgress,
                [redis::Value::Int(3)] => Begin::Mismatch,
                [redis::Value::Int(6)] => Begin::OutcomeUnknown,
                [redis::Value::Int(2), redis::Value::BulkString(bytes)] => {
                    Begin::Completed(StoredResponse::decode(bytes)?)
                }
                [redis::Value::Int(4), redis::Value::Int(i), redis::Value::Int(ms)] => {
                    return Err(Self::full(&pools, *i, *ms))
                }
                _ => return Err(unexpected(&reply)),
            })
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (script, name) = if claim.is_token() {
                (&self.renew_token, self.token_names(claim.key(), claim.principal()).1)
            } else {
                (&self.renew, self.record(claim.scope(), claim.key()).0)
            };
            let mut call = ScriptCall::new(script, &[&name], 2);
            call.arg(claim.owner()).arg(lease_ms(lease));
            let renewed: i64 = self.client.invoke(&call).await?;
            Ok(renewed == 1)
        })
    }

    fn complete<'a>(&'a self, claim: &'a Claim, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (record, pools) = self.record(claim.scope(), claim.key());
            let keys = keys_and_pools(&[&record], &pools);
            let Some((fingerprint, bucket)) = claim.memo.split_once('|') else {
                return Err(Error::backend("redis", "this claim was not made by a Redis store"));
            };
            let answer = response.encode();
            let mut completed = format!("c|{fingerprint}||0|{bucket}|{}|", answer.len()).into_bytes();
            completed.extend_from_slice(&answer);
            let mut call = ScriptCall::new(&self.complete, &keys, 3 + 2 * pools.len());
            call.arg(claim.owner()).arg(completed).arg(answer.len());
            caps(&mut call, &pools);
            let reply: Vec<i64> = self.client.invoke(&call).await?;
            match reply.as_slice() {
                [1] => Ok(true),
                [0] => Ok(false),
                [4, i, ms] => Err(Self::full(&pools, *i, *ms)),
                other => Err(Error::backend("redis", format!("unexpected reply from the complete script: {other:?}"))),
            }
        })
    }

    fn abandon<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (record, pools) = self.record(claim.scope(), claim.key());
            let keys = keys_and_pools(&[&record], &pools);
            let mut call = ScriptCall::new(&self.abandon, &keys, 1);
            call.arg(claim.owner());
            let done: i64 = self.client.invoke(&call).await?;
            Ok(done == 1)
        })
    }
}
