//! The Redis store: each token and key record is one key (its name a hash
//! of scope and key, so no client bytes reach Redis's keyspace), changed by
//! one Lua script per step together with its pools ([`IdempotencyLimits`]),
//! so every step is atomic and runs on the one Cluster node that owns the
//! slot. Where each entry and pool lives: [`layout`]; why, and upgrading a
//! Cluster deployment: `docs/core-design.md`, `docs/operations.md`.

use std::time::Duration;

use redis::Script;

use super::{
    token_well_formed, Begin, Claim, ClaimTerms, IdempotencyLimits, IdempotencyStore, RecordState, RecordView,
    StoredResponse, TokenClaim, Usage, TOKEN_BYTES,
};
use crate::backend::{BoxFuture, RedisBackend};
use crate::error::{Error, Result};
use crate::redis::{lease_ms, Client, RedisOptions, ScriptCall};

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
/// let token = store.issue_token(None, std::time::Duration::from_secs(60)).await?;
/// let claim = match store.claim_token(&token, None, std::time::Duration::from_secs(10)).await? {
///     dlock_core::idempotency::TokenClaim::Claimed(claim) => claim,
///     other => panic!("a fresh token is claimed: {other:?}"),
/// };
/// assert!(store.spend_token(&claim).await?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    /// The lock backend's client, so its restart quarantine covers records.
    client: Client,
    /// Where records, tokens and pools live.
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
    /// Reads a record for an operator.
    inspect: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("layout", &self.layout).field("limits", &self.limits).finish_non_exhaustive()
    }
}

/// A script's keys: `first`, then the pools'.
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
            inspect: Script::new(include_str!("inspect_record.lua")),
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

    /// The records server's `maxmemory-policy` (an error if `CONFIG` is refused).
    pub(crate) async fn maxmemory_policy(&self) -> Result<String> {
        let reply: Vec<String> = self.client.query(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy")).await?;
        match reply.as_slice() {
            [_, policy] => Ok(policy.clone()),
            other => Err(Error::backend("redis", format!("CONFIG GET maxmemory-policy answered {other:?}"))),
        }
    }

    /// Whether the records server persists (AOF or RDB; an error if
    /// `CONFIG` is refused).
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

    fn issue_token<'a>(&'a self, principal: Option<&'a str>, ttl: Duration) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move { self.issue(principal, ttl).await })
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
            // Stored hashed: the record's fields are separated by `|`.
            let fingerprint = super::fingerprint(&[fingerprint]);
            // The script checks the data marker: no round trip of its own.
            let marker = self.client.marker();
            let keys = keys_and_pools(&[&record, marker.unwrap_or(&record)], &pools);
            let mut call = ScriptCall::new(&self.begin, &keys, 7 + 2 * pools.len());
            call.arg(&fingerprint).arg(claim.owner()).arg(lease_ms(terms.lease()));
            call.arg(if marker.is_some() { "1" } else { "0" });
            call.arg(lease_ms(terms.ttl())).arg(if terms.runs_again_after_lease() { "1" } else { "0" });
            // What an operator is shown of the claim (record.lua's tail).
            call.arg(format!("{}:{scope}{key}", scope.len()));
            caps(&mut call, &pools);
            let marker_gone = |reply: &redis::Value| matches!(reply, redis::Value::Array(items) if matches!(items.as_slice(), [redis::Value::Int(5)]));
            let reply: redis::Value = match self.client.guarded(|| self.client.invoke(&call), marker_gone).await {
                Ok(reply) => reply,
                Err(e) => {
                    if e.outcome_unknown() {
                        // Redis may still run it: the request retries, so give it back.
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

    fn inspect_record<'a>(&'a self, scope: &'a str, key: &'a str) -> BoxFuture<'a, Result<Option<RecordView>>> {
        Box::pin(async move {
            let (record, _) = self.record(scope, key);
            let reply: Vec<Vec<u8>> =
                self.client.invoke(&ScriptCall::new(&self.inspect, &[record.as_str()], 0)).await?;
            let (Some(now), Some(ttl), Some(value)) = (reply.first(), reply.get(1), reply.get(2)) else {
                return Ok(None);
            };
            let (now, ttl) = (number(now).ok_or_else(not_ours)?, number(ttl).ok_or_else(not_ours)?);
            Ok(Some(Record::parse(value)?.view(scope, key, now, ttl)?))
        })
    }

    /// Every record walked with `SCAN` (on each master of a Cluster), the
    /// claims past their lease kept, longest overdue first. An operator's
    /// look: it reads every record, a page of keys at a time, and never
    /// blocks the server. A claim made by an earlier version, which did not
    /// keep its caller and key, is left out.
    fn stuck_records(&self, limit: usize) -> BoxFuture<'_, Result<Vec<RecordView>>> {
        Box::pin(async move {
            let glob = self.layout.records_glob();
            let mut stuck: Vec<(i64, RecordView)> = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let (keys, next) = self.client.scan_page(&glob, cursor.as_deref(), SCAN_PAGE).await?;
                let reads = keys.iter().map(|key| async move {
                    self.client.invoke::<Vec<Vec<u8>>>(&ScriptCall::new(&self.inspect, &[key.as_str()], 0)).await
                });
                for reply in futures_util::future::join_all(reads).await {
                    let reply = reply?;
                    let (Some(now), Some(ttl), Some(value)) = (reply.first(), reply.get(1), reply.get(2)) else {
                        continue; // expired since the scan found it
                    };
                    let (now, ttl) = (number(now).ok_or_else(not_ours)?, number(ttl).ok_or_else(not_ours)?);
                    let record = Record::parse(value)?;
                    let Some((scope, key, _)) = record.claim_tail() else { continue };
                    if record.state == b"p" && record.lease <= now {
                        let overdue = now - record.lease;
                        stuck.push((overdue, record.view(&scope, &key, now, ttl)?));
                    }
                }
                if stuck.len() > limit.saturating_mul(2).max(SCAN_PAGE) {
                    keep_longest(&mut stuck, limit);
                }
                match next {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
            }
            keep_longest(&mut stuck, limit);
            Ok(stuck.into_iter().map(|(_, view)| view).collect())
        })
    }

    /// Each caller's pool (ledger.lua's `t`: its count and bytes), or
    /// every total's summed.
    fn usage<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Usage>> {
        Box::pin(async move {
            let pools = match scope {
                Some(scope) => {
                    let (_, pools) = self.record(scope, "");
                    pools.into_iter().filter(|p| p.per_scope).map(|p| p.key).collect()
                }
                None => self.layout.record_totals(),
            };
            let (mut records, mut bytes) = (0u64, 0u64);
            for pool in &pools {
                let t: Option<String> = self.client.query(redis::cmd("HGET").arg(pool).arg("t")).await?;
                let (n, b) = t.as_deref().and_then(|t| t.split_once(':')).unwrap_or(("0", "0"));
                records += n.parse::<i64>().ok().and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
                bytes += b.parse::<i64>().ok().and_then(|b| u64::try_from(b).ok()).unwrap_or(0);
            }
            let l = &self.limits;
            Ok(match scope {
                Some(_) => Usage::new(records, bytes, l.max_per_scope(), l.max_bytes_per_scope()),
                None => Usage::new(records, bytes, l.max_records(), l.max_bytes()),
            })
        })
    }
}

/// About how many keys each `SCAN` page of `stuck_records` reads.
const SCAN_PAGE: usize = 500;

/// The `limit` longest overdue of `stuck`, longest first.
fn keep_longest(stuck: &mut Vec<(i64, RecordView)>, limit: usize) {
    stuck.sort_by_key(|s| std::cmp::Reverse(s.0));
    stuck.truncate(limit);
}

fn number(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok().and_then(|t| t.parse::<i64>().ok())
}

fn not_ours() -> Error {
    Error::backend("redis", "an idempotency record dlock did not write")
}

/// A key record as stored: `state|fingerprint|owner|lease end|bucket|bytes|tail`
/// (record.lua).
struct Record<'a> {
    state: &'a [u8],
    owner: &'a [u8],
    lease: i64,
    bytes: i64,
    tail: &'a [u8],
}

impl<'a> Record<'a> {
    fn parse(value: &'a [u8]) -> Result<Self> {
        let mut parts = value.splitn(7, |b| *b == b'|');
        let (Some(state), Some(_fp), Some(owner), Some(lease), Some(_bucket), Some(bytes), Some(tail)) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(not_ours());
        };
        let (lease, bytes) = (number(lease).ok_or_else(not_ours)?, number(bytes).ok_or_else(not_ours)?);
        Ok(Record { state, owner, lease, bytes, tail })
    }

    /// A claim's caller, key and claim time (`<ms>:<scope's length>:<scope><key>`);
    /// `None` for a completed record or a claim of an earlier version.
    fn claim_tail(&self) -> Option<(String, String, i64)> {
        if self.state != b"p" {
            return None;
        }
        let text = std::str::from_utf8(self.tail).ok()?;
        let (at, rest) = text.split_once(':')?;
        let (len, rest) = rest.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let (scope, key) = (rest.get(..len)?, rest.get(len..)?);
        Some((scope.to_owned(), key.to_owned(), at.parse().ok()?))
    }

    /// As an operator sees it at `now` (the server's ms), `ttl` ms left.
    fn view(&self, scope: &str, key: &str, now: i64, ttl: i64) -> Result<RecordView> {
        let left = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        let state = match self.state {
            b"c" => RecordState::Completed { status: StoredResponse::decode(self.tail)?.status },
            b"p" if self.lease > now => RecordState::InProgress { lease_left: Some(left(self.lease - now)) },
            b"p" => RecordState::OutcomeUnknown,
            _ => return Err(not_ours()),
        };
        let view = RecordView::new(scope, key, state, u64::try_from(self.bytes).unwrap_or(0), left(ttl));
        Ok(match (state, self.claim_tail()) {
            (RecordState::Completed { .. }, _) => view,
            (_, Some((_, _, at))) => view.claimed_by(String::from_utf8_lossy(self.owner)).with_age(left(now - at)),
            (_, None) => view.claimed_by(String::from_utf8_lossy(self.owner)),
        })
    }
}
