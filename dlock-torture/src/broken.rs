//! Deliberately broken lock clients for `checker-self-test`. Each has one
//! classic bug; the checker must catch every one under the same workload
//! that the real dlock passes, or its "0 violations" elsewhere mean nothing.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncCommands, Script};
use tokio::sync::watch;
use tokio::time::{sleep, Instant};

use crate::history::mono_ns;
use crate::rng::Rng;

/// The bug a broken variant carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bug {
    /// Release with a plain `DEL`, without checking the owner.
    PlainDel,
    /// Acquire as `GET`, then `SET` (not atomic).
    GetThenSet,
    /// Renew with `PEXPIRE` without checking the owner.
    RenewNoOwnerCheck,
    /// RedLock that measures validity from the end of the acquire, ignoring
    /// the time the acquire took.
    RedlockIgnoresElapsed,
    /// A correct lock (atomic acquire, owner-checked release) whose fencing
    /// tokens count *down*: every new holder gets a lower token than the
    /// last. Only the fencing check (C4) can see it: nothing overlaps, and
    /// the register refuses the fresh holder instead of the stale one.
    TokenRegresses,
    /// Release with a plain `DEL` (as [`Bug::PlainDel`]), and a fence that
    /// never advances: every holder gets the same token, so the register
    /// cannot tell a stale holder from a fresh one and the fenced counter
    /// and fenced set lose what the overlaps clobber.
    DuplicateToken,
    /// A correct lock whose release forgets to delete the key: every lock
    /// is left on the server until its lease runs out. Only the residue
    /// check (C6) sees it.
    ReleaseForgets,
    /// RedLock as dlock did it before the review of 2026-11-27 (A2): each
    /// node grants `max(mark + 1, node time)` and moves its mark there, all
    /// nodes are asked at once, and the token is the maximum over the first
    /// quorum of grants, with no write-back. A node whose mark (or clock)
    /// runs ahead and which is out of the next quorum (slow, or merely
    /// third to answer) then leaves the next holder a lower token. Run by
    /// `redlock-skew`'s workload; only the fencing check (C4) sees it.
    RedlockMaxOverQuorum,
}

impl Bug {
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "broken-plain-del" => Bug::PlainDel,
            "broken-get-then-set" => Bug::GetThenSet,
            "broken-renew-no-owner-check" => Bug::RenewNoOwnerCheck,
            "broken-redlock-ignores-elapsed" => Bug::RedlockIgnoresElapsed,
            "broken-token-regresses" => Bug::TokenRegresses,
            "broken-duplicate-token" => Bug::DuplicateToken,
            "broken-release-forgets" => Bug::ReleaseForgets,
            "broken-redlock-max-over-quorum" => Bug::RedlockMaxOverQuorum,
            _ => return None,
        })
    }

    /// Every variant's backend name, as the scenario table prints it.
    pub(crate) const ALL: [&'static str; 8] = [
        "broken-plain-del",
        "broken-get-then-set",
        "broken-renew-no-owner-check",
        "broken-redlock-ignores-elapsed",
        "broken-token-regresses",
        "broken-duplicate-token",
        "broken-release-forgets",
        "broken-redlock-max-over-quorum",
    ];
}

/// Where [`Bug::TokenRegresses`] counts down from.
const TOKEN_CEILING: u64 = 1_000_000_000;

const RELEASE_IF_OWNER: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// The high-water mark [`Bug::RedlockMaxOverQuorum`] keeps on every node
/// (as dlock's `prefix:fence`); `redlock-skew` pushes one node's ahead.
pub(crate) const REDLOCK_MARK: &str = "broken:fence";

/// One node's part of [`Bug::RedlockMaxOverQuorum`]: `SET NX`, and when
/// granted the token `max(mark + 1, TIME in µs)`, stored as the mark.
/// `KEYS[1]` the lock, `KEYS[2]` the mark; `ARGV[1]` owner, `ARGV[2]` lease ms.
/// Returns the token as text, or nil when held.
const NODE_GRANT: &str = r#"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mark = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = math.max(mark + 1, now)
redis.call('SET', KEYS[2], string.format('%d', token))
return string.format('%d', token)
"#;

/// How long [`Bug::RedlockMaxOverQuorum`] waits for the nodes, as dlock's
/// RedLock with the harness's 50 ms node timeout.
const NODE_TIMEOUT: Duration = Duration::from_millis(50);

/// A broken lock client over one Redis (or five, for the RedLock bug).
#[derive(Clone)]
pub(crate) struct BrokenLock {
    bug: Bug,
    nodes: Vec<MultiplexedConnection>,
    lease: Duration,
}

impl std::fmt::Debug for BrokenLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokenLock").field("bug", &self.bug).finish()
    }
}

/// A hold of a broken lock.
#[derive(Debug)]
pub(crate) struct BrokenHold {
    key: String,
    owner: String,
    pub(crate) token: u64,
    /// The validity the client believes in (fixed-lease variants).
    pub(crate) valid_until_ns: Option<u64>,
    lost: Option<watch::Receiver<bool>>,
    renewer: Option<tokio::task::JoinHandle<()>>,
}

impl BrokenLock {
    pub(crate) async fn connect(bug: Bug, urls: &[String], lease: Duration) -> redis::RedisResult<Self> {
        let mut nodes = Vec::new();
        for url in urls {
            nodes.push(redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?);
        }
        if nodes.is_empty() {
            return Err(redis::RedisError::from((redis::ErrorKind::Client, "no Redis URL for the broken lock")));
        }
        Ok(BrokenLock { bug, nodes, lease })
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX).max(1)
    }

    /// Tries until `deadline`; `None` when it did not get the lock.
    pub(crate) async fn acquire(
        &self,
        key: u32,
        owner: &str,
        deadline: Instant,
        rng: &mut Rng,
    ) -> redis::RedisResult<Option<BrokenHold>> {
        let key = format!("broken:{key}");
        loop {
            let started_ns = mono_ns();
            let mut quorum_token = None;
            let got = match self.bug {
                Bug::RedlockIgnoresElapsed => self.redlock_try(&key, owner, rng.chance(0.5)).await?,
                Bug::RedlockMaxOverQuorum => {
                    quorum_token = self.max_over_quorum(&key, owner).await;
                    quorum_token.is_some()
                }
                Bug::GetThenSet => {
                    let mut c = self.nodes[0].clone();
                    let holder: Option<String> = c.get(&key).await?;
                    if holder.is_none() {
                        // The gap a network round trip would leave between
                        // the two commands.
                        sleep(Duration::from_micros(rng.below(1500))).await;
                        let () = c
                            .set_options(
                                &key,
                                owner,
                                redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(self.lease_ms())),
                            )
                            .await?;
                        true
                    } else {
                        false
                    }
                }
                Bug::PlainDel
                | Bug::RenewNoOwnerCheck
                | Bug::TokenRegresses
                | Bug::DuplicateToken
                | Bug::ReleaseForgets => {
                    let mut c = self.nodes[0].clone();
                    let set: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(owner)
                        .arg("NX")
                        .arg("PX")
                        .arg(self.lease_ms())
                        .query_async(&mut c)
                        .await?;
                    set.is_some()
                }
            };
            if got {
                let counted: u64 = match quorum_token {
                    Some(token) => token,
                    None => self.nodes[0].clone().incr(format!("{key}:fence"), 1u64).await?,
                };
                let token = match self.bug {
                    // The bugs: a fence counting down, and one that never moves.
                    Bug::TokenRegresses => TOKEN_CEILING.saturating_sub(counted),
                    Bug::DuplicateToken => 1,
                    _ => counted,
                };
                let lease_ns = u64::try_from(self.lease.as_nanos()).unwrap_or(u64::MAX / 4);
                let mut hold =
                    BrokenHold { key, owner: owner.to_owned(), token, valid_until_ns: None, lost: None, renewer: None };
                match self.bug {
                    // The bug: validity counted from *after* the slow
                    // acquire; the correct one is started + lease − drift.
                    Bug::RedlockIgnoresElapsed => hold.valid_until_ns = Some(mono_ns() + lease_ns),
                    Bug::PlainDel
                    | Bug::GetThenSet
                    | Bug::TokenRegresses
                    | Bug::DuplicateToken
                    | Bug::ReleaseForgets
                    | Bug::RedlockMaxOverQuorum => hold.valid_until_ns = Some(started_ns + lease_ns),
                    Bug::RenewNoOwnerCheck => self.start_renewer(&mut hold, rng.next_u64()),
                }
                return Ok(Some(hold));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            sleep(Duration::from_micros(500 + rng.below(2500))).await;
        }
    }

    async fn redlock_try(&self, key: &str, owner: &str, slow: bool) -> redis::RedisResult<bool> {
        let mut granted = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let mut c = node.clone();
            let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
                .arg(key)
                .arg(owner)
                .arg("NX")
                .arg("PX")
                .arg(self.lease_ms())
                .query_async(&mut c)
                .await;
            if matches!(set, Ok(Some(_))) {
                granted.push(i);
            }
            // Half of the attempts cross slow links (each node answers
            // after 0.3 × lease), as when one client's network degrades.
            if slow {
                sleep(self.lease.mul_f64(0.3)).await;
            }
        }
        if granted.len() > self.nodes.len() / 2 {
            return Ok(true);
        }
        self.release_all(key, owner).await;
        Ok(false)
    }

    /// [`Bug::RedlockMaxOverQuorum`]'s try: every node at once, the token
    /// the maximum over the first quorum of grants; `None` (and undone on
    /// every node) without a quorum within the node timeout. Answers not
    /// waited for still land: each node's call runs on a task of its own.
    async fn max_over_quorum(&self, key: &str, owner: &str) -> Option<u64> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for node in &self.nodes {
            let (mut c, tx) = (node.clone(), tx.clone());
            let (key, owner, lease) = (key.to_owned(), owner.to_owned(), self.lease_ms());
            tokio::spawn(async move {
                let got: redis::RedisResult<Option<u64>> = Script::new(NODE_GRANT)
                    .key(&key)
                    .key(REDLOCK_MARK)
                    .arg(&owner)
                    .arg(lease)
                    .invoke_async(&mut c)
                    .await;
                let _ = tx.send(got.ok().flatten());
            });
        }
        drop(tx);
        let quorum = self.nodes.len() / 2 + 1;
        let deadline = Instant::now() + NODE_TIMEOUT;
        let mut tokens = Vec::new();
        while tokens.len() < quorum {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Some(token))) => tokens.push(token),
                Ok(Some(None)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        if tokens.len() >= quorum {
            return tokens.into_iter().max();
        }
        self.release_all(key, owner).await;
        None
    }

    async fn release_all(&self, key: &str, owner: &str) {
        for node in &self.nodes {
            let mut c = node.clone();
            let _: redis::RedisResult<i64> =
                Script::new(RELEASE_IF_OWNER).key(key).arg(owner).invoke_async(&mut c).await;
        }
    }

    fn start_renewer(&self, hold: &mut BrokenHold, seed: u64) {
        let (tx, rx) = watch::channel(false);
        let mut c = self.nodes[0].clone();
        let key = hold.key.clone();
        let lease = self.lease;
        let lease_ms = self.lease_ms();
        hold.lost = Some(rx);
        hold.renewer = Some(tokio::spawn(async move {
            let mut rng = Rng::new(seed);
            loop {
                // A renewer that sometimes stalls past the lease, as a GC
                // pause or a starved thread would.
                let pause = if rng.chance(0.4) { lease.mul_f64(1.5) } else { lease / 3 };
                sleep(pause).await;
                // The bug: no owner check, so it may extend someone else's key.
                let extended: redis::RedisResult<bool> =
                    c.pexpire(&key, i64::try_from(lease_ms).unwrap_or(i64::MAX)).await;
                if !matches!(extended, Ok(true)) {
                    let _ = tx.send(true);
                    return;
                }
            }
        }));
    }

    /// Resolves when the client learns it lost the lock (never for the
    /// fixed-lease variants: their belief ends at `valid_until_ns`).
    pub(crate) async fn lost(&self, hold: &BrokenHold) {
        match &hold.lost {
            Some(rx) => {
                let mut rx = rx.clone();
                let _ = rx.wait_for(|lost| *lost).await;
            }
            None => std::future::pending().await,
        }
    }

    pub(crate) async fn release(&self, hold: BrokenHold) -> redis::RedisResult<()> {
        if let Some(r) = &hold.renewer {
            r.abort();
        }
        match self.bug {
            Bug::PlainDel | Bug::DuplicateToken => {
                let mut c = self.nodes[0].clone();
                let _: i64 = c.del(&hold.key).await?;
            }
            // The bug: nothing is deleted; the lease frees the key, later.
            Bug::ReleaseForgets => {}
            _ => self.release_all(&hold.key, &hold.owner).await,
        }
        Ok(())
    }
}
