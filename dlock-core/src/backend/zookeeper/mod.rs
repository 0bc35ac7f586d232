//! ZooKeeper: Apache Curator's `InterProcessMutex` recipe.
//!
//! * A lock is a container node `/<prefix>/<key>`; each contender creates an
//!   ephemeral sequential child `_c_<random 128 bits>-lock-<seq>` and holds
//!   the lock when its child sorts first. Otherwise it watches only its
//!   immediate predecessor (no herd effect) and re-checks when that goes.
//!   Waiters are served in the order they arrived (FIFO).
//! * The lease is the session: the guard's lost signal fires when the session
//!   expires or our node is deleted. A disconnected ("suspended") session is
//!   reported distinctly, through [`ZooKeeperBackend::connection_state`]; the
//!   lock is still ours until the session timeout passes. "Passes" is
//!   counted from our side, not by waiting to hear of the expiry: a
//!   heartbeat read every quarter of the session timeout records when the
//!   last request the server answered was sent, and the lost signal fires at
//!   that instant plus the negotiated timeout (less a small margin), the
//!   earliest the ensemble could expire the session. Waiting for the
//!   client's own verdict would be late: cut off from every server (its
//!   leader isolated, say), it declares the session expired only after 7/5
//!   of the timeout, while the rest of the ensemble may expire it and grant
//!   the lock after one timeout (measured in
//!   `dlock-core/tests/zookeeper_partition.rs`). After a session
//!   is lost the backend opens a new one (with backoff) and goes on granting
//!   locks; the guards of the old session have already fired `lost`.
//! * The fencing token is our node's creation zxid: ZooKeeper's transaction
//!   ids only grow, for every node of the ensemble, so it is strictly
//!   increasing per key even when the lock's container node is removed and
//!   re-created (a per-parent sequence number would restart at 0).
//! * Release deletes only our own node, retrying a failed delete; the lock's
//!   node is removed when it is empty, so one-off keys do not pile up.
//! * A reply lost with the connection (ZOOKEEPER-1262) leaves the outcome
//!   unknown. After a create, we look for our node by its random prefix
//!   (Curator's protection mode); a node we can neither find nor delete is
//!   swept up by a background task, since no one else would delete it while
//!   our session, which survives reconnects, lives. A delete whose retry
//!   finds nothing had gone through.
//! * Re-entry is counted by the engine, in process (as Curator does): only
//!   a first acquire creates a node, and only a last release deletes it.
//! * Leases are honoured as on the other backends: a hold that is neither
//!   renewed nor released by the end of its lease has its node deleted by
//!   this process, so a fixed lease frees the lock even while the session
//!   lives. A crashed process loses its locks with its session.
//! * Requests are bounded. zookeeper-client holds a request while it
//!   reconnects, until it learns the session's fate: with the ensemble
//!   unreachable, an acquire that may not wait at all came back after 4/3 of
//!   the session timeout. An acquire now answers within its wait plus the
//!   response timeout (by default 2/3 of the session timeout, when the
//!   client itself gives up on a silent server), a release within the
//!   response timeout; the node is deleted in the background.
//! * A waiting acquire that finds its session over waits, within its wait,
//!   for the new session the backend opens, rather than failing at once.
//! * Without credentials every node is open to every client of the ensemble
//!   (`world:anyone`, all rights): any of them can delete a lock node and so
//!   free a lock someone holds. With digest credentials
//!   ([`ZooKeeperOptions::with_auth`], `DLOCK_ZOOKEEPER_AUTH`) every session
//!   authenticates and every node is created with the creator-only ACL, so
//!   only clients with the same credentials can create, change or delete
//!   lock nodes. The prefix node `/<prefix>` is then persistent and checked
//!   when connecting: open to anyone, or not granting our identity, it is a
//!   configuration error, since nodes created under it could be taken over.
//!   It also gets a persistent creator-only child, `_dlock_acl_anchor`, so
//!   that it is never empty: ZooKeeper deletes no node with children, and
//!   `/` (or the chroot) is usually open to anyone, who could otherwise
//!   delete an empty `/<prefix>` and make it again with an ACL of their own.
//!   ZooKeeper's ACLs do not hide that a lock exists (`exists` needs no
//!   right), nor stop a client that may delete nodes in `/` from other harm
//!   there; give `/` or the chroot a restrictive ACL too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client as zk;

pub use super::zookeeper_auth::ZooKeeperAuth;
use super::zookeeper_auth::AUTH_VAR;
use super::{
    contention, AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, LostReason, LostSignal, Release, Renewal,
};
use crate::error::{Error, Result};
use crate::key::{validate_prefix, LockKey};
use crate::owner::{random_hex, Owner};

/// The default session timeout: how long a holder may be unreachable
/// before ZooKeeper frees its locks.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

const LOCK_NAME: &str = "-lock-";

/// The state of the ZooKeeper session that carries every lock of this
/// process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionState {
    /// Connected; locks are held.
    Connected,
    /// Disconnected, but the session may still be alive (Curator's
    /// SUSPENDED): locks are held until the session timeout passes.
    Suspended,
    /// The session expired or was closed (Curator's LOST): every lock of
    /// this process is gone.
    Lost,
}

/// Locks in a ZooKeeper ensemble.
///
/// ```no_run
/// # async fn demo() -> dlock_core::Result<()> {
/// use std::sync::Arc;
/// use dlock_core::{Locker, LockerOptions};
/// use dlock_core::backend::zookeeper::ZooKeeperBackend;
/// let backend = ZooKeeperBackend::connect("127.0.0.1:2181", "dlock").await?;
/// let locker = Locker::with_options(Arc::new(backend), LockerOptions::default())?;
/// # Ok(()) }
/// ```
pub struct ZooKeeperBackend {
    /// The session new locks are taken in; replaced when it is lost.
    session: Arc<RwLock<Session>>,
    prefix: String,
    /// The state across sessions, for [`ZooKeeperBackend::connection_state`].
    state: watch::Receiver<ConnectionState>,
    /// Our holds: (key, owner) -> (node path, fencing token, holds).
    holds: Holds,
    /// How long an acquire may take past its wait, and a release at all.
    response_timeout: Duration,
    /// The credentials of every session; with them nodes are creator-only.
    auth: Option<ZooKeeperAuth>,
}

/// One ZooKeeper session and its own state: a hold belongs to the session
/// that created its node and dies with it.
#[derive(Clone)]
struct Session {
    client: zk::Client,
    state: watch::Receiver<ConnectionState>,
    /// When the latest request that the server answered was sent. The
    /// server touched the session after that, so it cannot expire it before
    /// this instant plus the session timeout.
    confirmed: Arc<Mutex<Instant>>,
}

/// The margin the lost signal keeps before the earliest instant the server
/// could expire the session, for the delay of our own timer.
fn expiry_margin(timeout: Duration) -> Duration {
    (timeout / 10).min(Duration::from_millis(500))
}

/// How long the session may go unconfirmed before the server could have
/// expired it, less the margin.
fn allowed_silence(client: &zk::Client) -> Duration {
    let timeout = client.session_timeout();
    timeout.saturating_sub(expiry_margin(timeout))
}

/// Whether the session is over, or the server could have expired it (see
/// the module documentation).
fn session_may_be_over(session: &Session) -> bool {
    *session.state.borrow() == ConnectionState::Lost
        || confirmed_at(&session.confirmed) + allowed_silence(&session.client) <= Instant::now()
}

fn confirmed_at(confirmed: &Mutex<Instant>) -> Instant {
    *confirmed.lock().unwrap_or_else(|p| p.into_inner())
}

fn confirm(confirmed: &Mutex<Instant>, sent: Instant) {
    let mut at = confirmed.lock().unwrap_or_else(|p| p.into_inner());
    if sent > *at {
        *at = sent;
    }
}

#[derive(Debug)]
struct Hold {
    node: String,
    /// The session whose ephemeral node this is.
    client: zk::Client,
    fence: u64,
    /// The end of the lease; the hold's task deletes the node then unless
    /// it was moved by a renewal. Dropping the sender (release) ends the task.
    expires: watch::Sender<Instant>,
    /// The lost signal of the engine's hold, marked when the node is
    /// deleted behind our back or the session that carries it may be over;
    /// `None` once released (our own delete is not a loss) or told.
    signal: Option<LostSignal>,
}

impl Hold {
    /// Moves the end of the lease (never backwards).
    fn extend(&self, until: Instant) {
        self.expires.send_if_modified(|at| {
            let later = until > *at;
            if later {
                *at = until;
            }
            later
        });
    }

    /// Marks the hold lost; returns whether it was news.
    fn lose(&mut self, reason: LostReason) -> bool {
        self.signal.take().is_some_and(|signal| signal.lose(reason))
    }
}

impl std::fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperBackend").field("prefix", &self.prefix).field("state", &*self.state.borrow()).finish()
    }
}

fn zk_error(e: zk::Error) -> Error {
    Error::Backend {
        backend: "zookeeper",
        message: format!("ZooKeeper request failed: {e}"),
        source: Some(Box::new(e)),
    }
}

/// Whether an error is the server's answer to the request, as opposed to
/// a lost connection or timeout after which the request may or may not
/// have been applied.
fn answered(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::NoNode
            | zk::Error::NodeExists
            | zk::Error::NoAuth
            | zk::Error::BadVersion
            | zk::Error::NoChildrenForEphemerals
            | zk::Error::NotEmpty
            | zk::Error::InvalidAcl
            | zk::Error::BadArguments(_)
            | zk::Error::Unimplemented
            | zk::Error::QuotaExceeded
            | zk::Error::NotReadOnly
            // The session is over: an ephemeral node it made is gone too.
            | zk::Error::SessionExpired
            | zk::Error::SessionMoved
            | zk::Error::AuthFailed
            | zk::Error::ClientClosed
    )
}

/// How to reach ZooKeeper, how long locks survive a silent server, and
/// who may touch the lock nodes. Its `Debug` hides the password.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::zookeeper::{ZooKeeperAuth, ZooKeeperOptions};
/// let opts = ZooKeeperOptions::default()
///     .with_session_timeout(Duration::from_secs(6))
///     .with_response_timeout(Duration::from_secs(2))
///     .with_auth(ZooKeeperAuth::digest("orders", "s3cret").unwrap());
/// assert_eq!(opts.session_timeout(), Duration::from_secs(6));
/// assert_eq!(opts.response_timeout(), Duration::from_secs(2));
/// assert_eq!(opts.auth().map(ZooKeeperAuth::user), Some("orders"));
/// assert!(!format!("{opts:?}").contains("s3cret"));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ZooKeeperOptions {
    session_timeout: Duration,
    response_timeout: Option<Duration>,
    auth: Option<ZooKeeperAuth>,
}

impl Default for ZooKeeperOptions {
    fn default() -> Self {
        ZooKeeperOptions { session_timeout: DEFAULT_SESSION_TIMEOUT, response_timeout: None, auth: None }
    }
}

impl ZooKeeperOptions {
    /// How long a holder may be unreachable before ZooKeeper frees its
    /// locks (`DLOCK_ZOOKEEPER_SESSION_MS`, default [`DEFAULT_SESSION_TIMEOUT`]).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How long an acquire may take past its wait (a try-once acquire: at
    /// all), and a release at all, before it fails with [`Error::Backend`];
    /// by default 2/3 of the session timeout, when the client itself counts
    /// a silent server as gone. A lock node left by an attempt cut short
    /// is deleted in the background.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// Authenticates every session with these digest credentials
    /// (`DLOCK_ZOOKEEPER_AUTH`) and creates every node with the creator-only
    /// ACL: clients without the same credentials can then neither create,
    /// change nor delete lock nodes. Every instance that shares the locks
    /// must use the same credentials. See the [module docs](self) for the
    /// check of `/<prefix>` when connecting.
    ///
    /// ```
    /// use dlock_core::backend::zookeeper::{ZooKeeperAuth, ZooKeeperOptions};
    /// let auth: ZooKeeperAuth = "orders:s3cret".parse().unwrap();
    /// let opts = ZooKeeperOptions::default().with_auth(auth);
    /// assert!(opts.auth().is_some());
    /// ```
    pub fn with_auth(mut self, auth: ZooKeeperAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// The credentials, if any.
    pub fn auth(&self) -> Option<&ZooKeeperAuth> {
        self.auth.as_ref()
    }

    /// The session timeout.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// The response timeout.
    pub fn response_timeout(&self) -> Duration {
        self.response_timeout.unwrap_or(self.session_timeout * 2 / 3)
    }
}

impl ZooKeeperBackend {
    /// Connects with the default options (a 10 s session); see
    /// [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    ///
    /// As [`ZooKeeperBackend::connect_with`].
    pub async fn connect(connect_string: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(connect_string, prefix, ZooKeeperOptions::default()).await
    }

    /// Connects to `connect_string` (`host:port[,host:port…][/chroot]`);
    /// locks live under the node `/<prefix>`.
    ///
    /// ```no_run
    /// # async fn demo() -> dlock_core::Result<()> {
    /// use std::time::Duration;
    /// use dlock_core::backend::zookeeper::{ZooKeeperBackend, ZooKeeperOptions};
    /// let options = ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(6));
    /// let backend = ZooKeeperBackend::connect_with("127.0.0.1:2181", "dlock", options).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_ZOOKEEPER` for a malformed connect
    /// string, `DLOCK_PREFIX` for an invalid prefix, or
    /// `DLOCK_ZOOKEEPER_AUTH` when, with credentials, `/<prefix>` is open to
    /// anyone or does not grant them; [`Error::Backend`] when no server
    /// answers within the session timeout.
    pub async fn connect_with(connect_string: &str, prefix: &str, options: ZooKeeperOptions) -> Result<Self> {
        validate_prefix(prefix)?;
        let session_timeout = options.session_timeout;
        let first = open_session(connect_string, session_timeout, options.auth.as_ref()).await?;
        if let Some(auth) = &options.auth {
            secure_root(&first.client, &format!("/{prefix}"), auth).await?;
        }
        let (public, state) = watch::channel(ConnectionState::Connected);
        let session = Arc::new(RwLock::new(first));
        let holds = Holds::default();
        tokio::spawn(supervise(
            Arc::downgrade(&session),
            Arc::downgrade(&holds),
            public,
            connect_string.to_owned(),
            session_timeout,
            options.auth.clone(),
        ));
        Ok(ZooKeeperBackend {
            session,
            prefix: prefix.to_owned(),
            state,
            holds,
            response_timeout: options.response_timeout(),
            auth: options.auth,
        })
    }

    /// The current session; when it is over and the request may wait, the
    /// one the supervisor opens next, within the wait. A waiting acquire so
    /// rides through a session's replacement instead of failing at once;
    /// past its deadline it gets the old session, whose requests fail with
    /// "session expired".
    async fn session_for(&self, req: &AcquireRequest, cancel: &CancellationToken) -> Result<Session> {
        let mut reported = self.state.clone();
        loop {
            // Marked seen before looking: a session opened after this look
            // is reported as a change below.
            reported.borrow_and_update();
            let session = self.current();
            let Some(deadline) = req.deadline else { return Ok(session) };
            if *session.state.borrow() != ConnectionState::Lost {
                return Ok(session);
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                changed = reported.changed() => if changed.is_err() { return Ok(session) },
                _ = tokio::time::sleep_until(deadline) => return Ok(session),
            }
        }
    }

    fn no_answer(&self) -> Error {
        Error::backend(
            "zookeeper",
            format!("no answer from ZooKeeper within the response timeout ({:?})", self.response_timeout),
        )
    }

    /// The current session.
    fn current(&self) -> Session {
        self.session.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The session's state, to tell a suspended connection from a lost one.
    pub fn connection_state(&self) -> watch::Receiver<ConnectionState> {
        self.state.clone()
    }

    /// The session's id and password, for tests that expire it from a twin
    /// connection (the way a network partition longer than the session
    /// timeout would). Hidden: it hands out a `zookeeper_client` type, whose
    /// version is not ours to promise.
    #[doc(hidden)]
    pub fn session_info(&self) -> zk::SessionInfo {
        self.current().client.session().clone()
    }

    /// The container node of `key`. Hidden: it names how locks are stored
    /// in ZooKeeper, which may change between releases; public only so that
    /// the tests can inspect and damage the nodes from outside.
    #[doc(hidden)]
    pub fn lock_path(&self, key: &LockKey) -> String {
        let mut path = String::with_capacity(self.prefix.len() + key.as_str().len() + 2);
        path.push('/');
        path.push_str(&self.prefix);
        path.push('/');
        for c in key.as_str().chars() {
            // Characters ZooKeeper refuses in a path; `%u` + 4 hex digits
            // cannot clash with the key's own `%XX` escapes.
            if matches!(c, '\u{80}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}') {
                path.push_str(&format!("%u{:04X}", c as u32));
            } else {
                path.push(c);
            }
        }
        path
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, HashMap<(LockKey, Owner), Hold>> {
        lock_holds(&self.holds)
    }

    /// Moves the end of a hold's lease (never backwards).
    fn extend(&self, id: &(LockKey, Owner), until: Instant) {
        if let Some(hold) = self.holds().get(id) {
            hold.extend(until);
        }
    }

    /// Joins our hold `id` (the engine asks again only after its own hold
    /// lapsed): moves the end of its lease to `until` and watches it with
    /// `signal` from now on. `None` when the hold is gone or lost already.
    fn join(&self, id: &(LockKey, Owner), until: Instant, signal: &LostSignal) -> Option<u64> {
        let mut holds = self.holds();
        let hold = holds.get_mut(id).filter(|h| h.signal.as_ref().is_some_and(|s| !s.is_lost()))?;
        hold.extend(until);
        hold.signal = Some(signal.clone());
        Some(hold.fence)
    }

    /// Creates our sequential node, creating the lock's container node on
    /// the way. Returns the node's path and its creation zxid.
    ///
    /// A create whose reply is lost may still have happened (ZOOKEEPER-1262):
    /// every failure that is not the server's own answer is followed by a
    /// look for our node, found by the random prefix only we use, before
    /// trying again. Giving up without that look would leave a node that
    /// sorts ahead of every later contender for as long as our session
    /// lives, and the session survives the reconnect.
    async fn create_node(
        client: &zk::Client,
        dir: &str,
        prefix: &str,
        auth: Option<&ZooKeeperAuth>,
    ) -> Result<(String, u64)> {
        let name = format!("{dir}/{prefix}");
        let acls = if auth.is_some() { zk::Acls::creator_all() } else { zk::Acls::anyone_all() };
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(acls);
        let container = zk::CreateMode::Container.with_acls(acls);
        let mut last = None;
        for _ in 0..8 {
            match client.create(&name, &[], &ephemeral).await {
                Ok((stat, sequence)) => {
                    return Ok((format!("{name}{sequence}"), u64::try_from(stat.czxid).unwrap_or(0)));
                }
                // The container is missing, or was just reaped: make it again.
                Err(zk::Error::NoNode) => {
                    let made = match auth {
                        // Without credentials, `mkdir` makes `/<prefix>` too
                        // if it is missing, as a container.
                        None => client.mkdir(dir, &container).await,
                        Some(auth) => match client.create(dir, &[], &container).await {
                            Ok(_) => Ok(()),
                            // `/<prefix>` was deleted (only possible while
                            // empty): make it again, and check it, since
                            // whoever made it owns every lock node under it.
                            Err(zk::Error::NoNode) => match dir.rsplit_once('/') {
                                Some((root, _)) => {
                                    secure_root(client, root, auth).await?;
                                    Ok(())
                                }
                                None => Err(zk::Error::NoNode),
                            },
                            Err(e) => Err(e),
                        },
                    };
                    match made {
                        Ok(()) | Err(zk::Error::NodeExists) => continue,
                        // Made or not, the next create tells.
                        Err(e) if !answered(&e) => last = Some(e),
                        Err(zk::Error::NoAuth) => return Err(not_allowed(dir, auth)),
                        Err(e) => return Err(zk_error(e)),
                    }
                }
                Err(zk::Error::NoAuth) => return Err(not_allowed(dir, auth)),
                Err(e) if !answered(&e) => {
                    tracing::debug!(error = %e, dir = %path_log_id(dir), "create's outcome unknown; looking for our node");
                    match Self::find_node(client, dir, prefix).await {
                        Ok(Some(found)) => return Ok(found),
                        Ok(None) => last = Some(e),
                        Err(lookup) => {
                            tokio::spawn(sweep(client.clone(), dir.to_owned(), prefix.to_owned()));
                            return Err(lookup);
                        }
                    }
                }
                Err(e) => return Err(zk_error(e)),
            }
        }
        Err(last.map_or_else(
            || Error::backend("zookeeper", format!("could not create a lock node under `{dir}`")),
            zk_error,
        ))
    }

    /// Our node under `dir`, by the prefix only we use, with its creation
    /// zxid; `None` when the server never made it.
    async fn find_node(client: &zk::Client, dir: &str, prefix: &str) -> Result<Option<(String, u64)>> {
        let mut last = None;
        for attempt in 0..6 {
            if attempt > 0 {
                // The client is reconnecting; a request sent now waits for it.
                tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
            }
            let children = match client.list_children(dir).await {
                Ok(children) => children,
                // No lock node, so no node of ours in it.
                Err(zk::Error::NoNode) => return Ok(None),
                Err(e) if !answered(&e) => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(zk_error(e)),
            };
            let Some(child) = children.iter().find(|c| c.starts_with(prefix)) else { return Ok(None) };
            let path = format!("{dir}/{child}");
            match client.check_stat(&path).await {
                Ok(Some(stat)) => return Ok(Some((path, u64::try_from(stat.czxid).unwrap_or(0)))),
                // Ours, yet gone: only the session's end deletes it, and
                // the next create will say so.
                Ok(None) => return Ok(None),
                Err(e) if !answered(&e) => last = Some(e),
                Err(e) => return Err(zk_error(e)),
            }
        }
        let e = last.map_or_else(|| Error::backend("zookeeper", "lookup failed"), zk_error);
        tracing::warn!(
            error = %e,
            dir = %path_log_id(dir),
            prefix,
            "cannot tell whether a lost create made our node; it goes with the session"
        );
        Err(e)
    }

    /// Deletes our node (only ours: the path is unique to this contender),
    /// retrying transient failures, then the lock's node if it is empty.
    /// Returns whether the node was ours until this delete.
    ///
    /// A delete whose reply was lost may have happened; the retry then finds
    /// no node, which means our own delete went through, not that the lock
    /// had been lost already.
    async fn delete_node(client: &zk::Client, node: &str) -> Result<bool> {
        let mut last = None;
        let mut maybe_deleted = false;
        for attempt in 0..3 {
            let deleted = match client.delete(node, None).await {
                Ok(()) => true,
                Err(zk::Error::NoNode) => maybe_deleted,
                Err(e @ (zk::Error::SessionExpired | zk::Error::ClientClosed)) => {
                    // The node died with the session.
                    tracing::debug!(error = %e, node = %path_log_id(node), "lock node went with the session");
                    return Ok(false);
                }
                Err(e) => {
                    tracing::warn!(error = %e, node = %path_log_id(node), attempt, "deleting a lock node failed; retrying");
                    maybe_deleted |= !answered(&e);
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                    continue;
                }
            };
            if deleted {
                if let Some((dir, _)) = node.rsplit_once('/') {
                    // Fails harmlessly when another contender is inside.
                    let _ = client.delete(dir, None).await;
                }
            }
            return Ok(deleted);
        }
        Err(last.map_or_else(|| Error::backend("zookeeper", "delete failed"), zk_error))
    }

    /// Waits until `node` sorts first among the contenders of `dir`.
    async fn wait_turn(
        client: &zk::Client,
        req: &AcquireRequest,
        dir: &str,
        node: &str,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let started = Instant::now();
        let ours = node.rsplit('/').next().unwrap_or_default();
        loop {
            let mut children = client.list_children(dir).await.map_err(zk_error)?;
            children.retain(|c| c.contains(LOCK_NAME));
            children.sort_by_key(|c| sequence_of(c));
            let Some(position) = children.iter().position(|c| c == ours) else {
                return Err(Error::backend("zookeeper", "our lock node vanished (session expired?)"));
            };
            if position == 0 {
                return Ok(());
            }
            let Some(deadline) = req.deadline else {
                return Err(contention(req, started));
            };
            let predecessor = format!("{dir}/{}", children[position - 1]);
            let (stat, watcher) = client.check_and_watch_stat(&predecessor).await.map_err(zk_error)?;
            if stat.is_none() {
                continue;
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                _ = watcher.changed() => {}
                _ = tokio::time::sleep_until(deadline) => return Err(contention(req, started)),
            }
        }
    }
}

type Holds = Arc<Mutex<HashMap<(LockKey, Owner), Hold>>>;

/// The child that keeps a secured `/<prefix>` from ever being empty (see
/// the module docs). No lock key can have this name: every key contains
/// `{`.
const ANCHOR: &str = "_dlock_acl_anchor";

/// The error for a create ZooKeeper refused for want of permission: the
/// credentials are missing or not those of whoever made the nodes.
fn not_allowed(dir: &str, auth: Option<&ZooKeeperAuth>) -> Error {
    let who = match auth {
        Some(auth) => format!("the identity `{}`", auth.user()),
        None => "a client without credentials".to_owned(),
    };
    Error::config(
        AUTH_VAR,
        format!(
            "ZooKeeper does not let {who} create lock nodes under `{dir}`: the nodes were made with other \
             credentials; every instance sharing these locks needs the same DLOCK_ZOOKEEPER_AUTH"
        ),
    )
}

/// Makes `root` (`/<prefix>`) a persistent node with the creator-only ACL
/// if it is missing, and checks, when it was there already, that it is
/// neither open to anyone nor closed to us: whoever may create nodes in it
/// can create a lock's node with an ACL of their choosing and then delete
/// every contender's node in it, and without create and delete rights of
/// our own no lock could be taken. Persistent rather than a container, so
/// that the server does not reap it and leave the name free for anyone.
async fn secure_root(client: &zk::Client, root: &str, auth: &ZooKeeperAuth) -> Result<()> {
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all());
    match client.create(root, &[], &persistent).await {
        Ok(_) | Err(zk::Error::NodeExists) => {}
        Err(zk::Error::NoAuth) => return Err(not_allowed(root, Some(auth))),
        Err(e) => return Err(zk_error(e)),
    }
    let acls = match client.get_acl(root).await {
        Ok((acls, _)) => acls,
        // ZooKeeper reads an ACL only for a client with read or admin rights.
        Err(zk::Error::NoAuth) => return Err(not_allowed(root, Some(auth))),
        Err(e) => return Err(zk_error(e)),
    };
    let changes = [zk::Permission::WRITE, zk::Permission::CREATE, zk::Permission::DELETE, zk::Permission::ADMIN];
    let open = acls.iter().find(|acl| {
        acl.scheme() == "world" && acl.id() == "anyone" && changes.iter().any(|p| acl.permission().has(*p))
    });
    if let Some(open) = open {
        return Err(Error::config(
            AUTH_VAR,
            format!(
                "`{root}` lets anyone change its lock nodes ({:?} for world:anyone; made before credentials were \
                 configured?): delete it while no lock is held, or give it the ACL digest:{}:cdrwa",
                open.permission(),
                auth.digest_id()
            ),
        ));
    }
    let ours = auth.digest_id();
    let needed = zk::Permission::READ | zk::Permission::CREATE | zk::Permission::DELETE;
    if !acls.iter().any(|acl| acl.scheme() == "digest" && acl.id() == ours && acl.permission().has(needed)) {
        return Err(not_allowed(root, Some(auth)));
    }
    match client.create(&format!("{root}/{ANCHOR}"), &[], &persistent).await {
        Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
        Err(zk::Error::NoAuth) => Err(not_allowed(root, Some(auth))),
        Err(e) => Err(zk_error(e)),
    }
}

/// Opens a session and maps its states to [`ConnectionState`] on a channel
/// of its own.
async fn open_session(
    connect_string: &str,
    session_timeout: Duration,
    auth: Option<&ZooKeeperAuth>,
) -> Result<Session> {
    // The server starts the session's clock when our connect request
    // arrives, which is after this.
    let started = Instant::now();
    let mut connector = zk::Client::connector()
        .with_session_timeout(session_timeout)
        .with_connection_timeout(session_timeout.min(Duration::from_secs(2)));
    if let Some(auth) = auth {
        // Sent before any request of the session, and again after every
        // reconnect, by the client.
        connector = connector.with_auth("digest", auth.credentials().as_bytes());
    }
    let connecting = connector.connect(connect_string);
    let client = match tokio::time::timeout(session_timeout + Duration::from_secs(1), connecting).await {
        Ok(Ok(client)) => client,
        Ok(Err(e @ zk::Error::BadArguments(_))) => {
            return Err(Error::config("DLOCK_ZOOKEEPER", format!("cannot use `{connect_string}`: {e}")))
        }
        Ok(Err(e)) => {
            return Err(Error::Backend {
                backend: "zookeeper",
                message: format!("cannot connect to `{connect_string}`: {e}"),
                source: Some(Box::new(e)),
            })
        }
        Err(_) => {
            return Err(Error::backend(
                "zookeeper",
                format!("no session with `{connect_string}` within {session_timeout:?}"),
            ))
        }
    };
    let (tx, state) = watch::channel(ConnectionState::Connected);
    let mut states = client.state_watcher();
    tokio::spawn(async move {
        loop {
            let mapped = match states.changed().await {
                zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => ConnectionState::Connected,
                zk::SessionState::Disconnected => ConnectionState::Suspended,
                _ => ConnectionState::Lost,
            };
            if tx.send(mapped).is_err() || mapped == ConnectionState::Lost {
                return;
            }
        }
    });
    Ok(Session { client, state, confirmed: Arc::new(Mutex::new(started)) })
}

/// Follows the current session: reports its states on the backend's channel
/// and, when it is lost, forgets its holds (their guards have fired `lost`)
/// and opens a new session, retrying with backoff, so that one long pause
/// does not leave the process unable to lock for the rest of its life.
/// Ends when the backend is dropped.
async fn supervise(
    session: Weak<RwLock<Session>>,
    holds: Weak<Mutex<HashMap<(LockKey, Owner), Hold>>>,
    public: watch::Sender<ConnectionState>,
    connect_string: String,
    session_timeout: Duration,
    auth: Option<ZooKeeperAuth>,
) {
    loop {
        let Some(current) = session.upgrade() else { return };
        // No client is kept here: a dropped backend must close its session.
        let (mut state, lost_id, confirmed, timeout) = {
            let s = current.read().unwrap_or_else(|p| p.into_inner());
            (s.state.clone(), s.client.session_id(), s.confirmed.clone(), s.client.session_timeout())
        };
        let allowed = timeout.saturating_sub(expiry_margin(timeout));
        drop(current);
        tokio::spawn(heartbeat(session.clone(), lost_id, confirmed.clone()));
        // The instant of the last answer after which the guards of this
        // session were told it may be over; not told twice for one silence.
        let mut told_after = None;
        loop {
            let now = *state.borrow_and_update();
            match now {
                ConnectionState::Suspended => {
                    tracing::warn!("ZooKeeper session suspended: locks held until the session timeout")
                }
                ConnectionState::Lost => tracing::error!("ZooKeeper session lost: every lock it held is gone"),
                ConnectionState::Connected => tracing::debug!("ZooKeeper session connected"),
            }
            public.send_replace(now);
            if now == ConnectionState::Lost {
                break;
            }
            tokio::select! {
                changed = state.changed() => if changed.is_err() { break },
                silent_since = unanswered(&confirmed, allowed, told_after) => {
                    told_after = Some(silent_since);
                    tracing::warn!(?timeout, "no answer from ZooKeeper for a session timeout: its locks may be gone");
                    if let Some(holds) = holds.upgrade() {
                        lose_session(&mut lock_holds(&holds), lost_id);
                    }
                }
            }
        }
        public.send_replace(ConnectionState::Lost);
        if let Some(holds) = holds.upgrade() {
            let mut holds = lock_holds(&holds);
            lose_session(&mut holds, lost_id);
            holds.retain(|_, h| h.client.session_id() != lost_id);
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            if session.strong_count() == 0 {
                return;
            }
            match open_session(&connect_string, session_timeout, auth.as_ref()).await {
                Ok(fresh) => {
                    let Some(current) = session.upgrade() else { return };
                    *current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                    tracing::info!("ZooKeeper: new session opened after the old one was lost");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "ZooKeeper: cannot open a new session yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Marks lost every guard of every hold of the session `id`: the one
/// session watcher speaks for all of them.
fn lose_session(holds: &mut HashMap<(LockKey, Owner), Hold>, id: zk::SessionId) {
    for ((key, _), hold) in holds.iter_mut().filter(|(_, h)| h.client.session_id() == id) {
        if hold.lose(LostReason::SessionExpired) {
            tracing::warn!(key = %key.log_id(), reason = %LostReason::SessionExpired, "dlock.lost");
        }
    }
}

/// Resolves when no request has been answered for `allowed` (the server
/// may have expired the session), with the send instant of the last one
/// answered; never again for the silence after `told_after`, which the
/// caller already acted on.
async fn unanswered(confirmed: &Mutex<Instant>, allowed: Duration, told_after: Option<Instant>) -> Instant {
    loop {
        let last = confirmed_at(confirmed);
        if told_after == Some(last) {
            // Nothing answered since: look again when the heartbeat may
            // have been.
            tokio::time::sleep((allowed / 4).max(Duration::from_millis(10))).await;
            continue;
        }
        tokio::time::sleep_until(last + allowed).await;
        if confirmed_at(confirmed) == last {
            return last;
        }
    }
}

/// Reads `/`'s stat every quarter of the session timeout and records when
/// each answered read was sent (see [`Session::confirmed`]). ZooKeeper's own
/// pings keep the session alive but are invisible to us. Holds no client
/// between reads, so a dropped backend closes its session; ends when the
/// backend is dropped or the session is replaced or over.
async fn heartbeat(session: Weak<RwLock<Session>>, id: zk::SessionId, confirmed: Arc<Mutex<Instant>>) {
    loop {
        let client = {
            let Some(current) = session.upgrade() else { return };
            let s = current.read().unwrap_or_else(|p| p.into_inner());
            if s.client.session_id() != id {
                return;
            }
            s.client.clone()
        };
        let every = client.session_timeout() / 4;
        let sent = Instant::now();
        match client.check_stat("/").await {
            Ok(_) => confirm(&confirmed, sent),
            Err(
                zk::Error::SessionExpired | zk::Error::SessionMoved | zk::Error::ClientClosed | zk::Error::AuthFailed,
            ) => return,
            // Any other answer (a chroot without `/`'s permission, say) came
            // from a server that touched the session all the same.
            Err(e) if answered(&e) => confirm(&confirmed, sent),
            Err(_) => {}
        }
        drop(client);
        tokio::time::sleep_until(sent + every).await;
    }
}

fn lock_holds(
    holds: &Mutex<HashMap<(LockKey, Owner), Hold>>,
) -> std::sync::MutexGuard<'_, HashMap<(LockKey, Owner), Hold>> {
    // Every update of the map is a single insert, remove or field write, so a
    // panic elsewhere cannot leave it half-done.
    holds.lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks `signal` lost when its session is over or may be, for a grant
/// made just as the supervisor gave the session up.
fn lose_if_session_over(session: &Session, key: &LockKey, signal: &LostSignal) {
    if session_may_be_over(session) && signal.lose(LostReason::SessionExpired) {
        tracing::warn!(key = %key.log_id(), reason = %LostReason::SessionExpired, "dlock.lost");
    }
}

/// Follows one hold until it is released: deletes its node when its lease
/// ends without renewal or release, and marks its guards lost when the node
/// is deleted behind our back. One task per hold, however many guards
/// re-enter it; the session's end reaches them through [`supervise`].
async fn follow(
    client: zk::Client,
    holds: Holds,
    id: (LockKey, Owner),
    node: String,
    mut expiry: watch::Receiver<Instant>,
) {
    let deleted = node_deleted(&client, &node);
    tokio::pin!(deleted);
    let mut watching = true;
    loop {
        let at = *expiry.borrow_and_update();
        tokio::select! {
            changed = expiry.changed() => if changed.is_err() { return },
            gone = &mut deleted, if watching => {
                watching = false;
                if gone {
                    if let Some(hold) = lock_holds(&holds).get_mut(&id).filter(|h| h.node == node) {
                        if hold.lose(LostReason::Stolen) {
                            tracing::warn!(key = %id.0.log_id(), reason = %LostReason::Stolen, "dlock.lost");
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(at) => {
                let still_ours = {
                    let mut holds = lock_holds(&holds);
                    let expired = holds.get(&id).is_some_and(|h| h.node == node && *h.expires.borrow() <= Instant::now());
                    if expired {
                        holds.remove(&id);
                    }
                    expired
                };
                if still_ours {
                    tracing::debug!(key = %id.0.log_id(), "lease ran out; deleting the lock node");
                    let _ = client.delete(&node, None).await;
                }
                return;
            }
        }
    }
}

/// Resolves to `true` when `node` is deleted, `false` when its session ended
/// first (the supervisor tells the guards of that).
async fn node_deleted(client: &zk::Client, node: &str) -> bool {
    loop {
        match client.check_and_watch_stat(node).await {
            Ok((Some(_), watcher)) => {
                let event = watcher.changed().await;
                if event.event_type == zk::EventType::NodeDeleted {
                    return true;
                }
                if event.session_state.is_terminated() {
                    return false;
                }
                // Disconnected or a data change: the node is still ours
                // until the session says otherwise.
            }
            Ok((None, _)) => return true,
            Err(zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed) => return false,
            // Not connected right now: watch again once it is.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A lock directory or node path as logs write it: `zk#` and a short hash
/// of the lock's directory, then the node's own name when there is one
/// (`zk#1a2b3c4d5e6f/_c_…lock-0000000007`).
///
/// The directory is the lock key's text, and a key's parts are often
/// request values (account ids, one-time tokens) that do not belong in
/// logs; the node's name is ours (random hex and a sequence number). The
/// hash is the same in every process, so the lines of one lock match
/// across instances.
fn path_log_id(path: &str) -> String {
    // Only a name we made, `_c_…`, is split off as the node: the rest is
    // the key's text, whatever it holds.
    let (dir, node) = match path.rsplit_once('/') {
        Some((dir, node)) if node.starts_with("_c_") => (dir, Some(node)),
        _ => (path, None),
    };
    let digest = sha1_smol::Sha1::from(dir).digest().to_string();
    match node {
        Some(node) => format!("zk#{}/{node}", &digest[..12]),
        None => format!("zk#{}", &digest[..12]),
    }
}

/// Deletes, in the background, our node under `dir` whose name starts with
/// `name`, when we could neither find it again after a lost reply nor
/// delete it after giving up our place. Nobody else would: it would sort
/// ahead of every later contender for as long as our session lives, and the
/// session outlives reconnects. Ends when the node is deleted or not there,
/// or the session is over.
async fn sweep(client: zk::Client, dir: String, name: String) {
    let mut backoff = Duration::from_millis(100);
    loop {
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return,
            Err(
                e @ (zk::Error::SessionExpired
                | zk::Error::SessionMoved
                | zk::Error::ClientClosed
                | zk::Error::AuthFailed),
            ) => {
                // An ephemeral node goes with its session.
                tracing::debug!(error = %e, dir = %path_log_id(&dir), name, "session over; no orphan left to sweep");
                return;
            }
            Err(e) if answered(&e) => {
                tracing::warn!(
                    error = %e,
                    dir = %path_log_id(&dir),
                    name,
                    "giving up on a possible orphan lock node; it goes with the session"
                );
                return;
            }
            Err(_) => continue,
        };
        let Some(child) = children.iter().find(|c| c.starts_with(&name)) else { return };
        let node = format!("{dir}/{child}");
        if ZooKeeperBackend::delete_node(&client, &node).await.is_ok() {
            tracing::info!(node = %path_log_id(&node), "deleted an orphan lock node");
            return;
        }
    }
}

/// The sequence suffix of a node name, for ordering.
fn sequence_of(name: &str) -> u64 {
    name.rsplit(LOCK_NAME).next().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

impl Backend for ZooKeeperBackend {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    fn prefix(&self) -> Option<&str> {
        Some(&self.prefix)
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(async move {
            let id = (req.key.clone(), req.owner.clone());
            let session = self.session_for(req, cancel).await?;
            let valid_until = Instant::now() + req.lease;
            let signal = LostSignal::new(valid_until);
            if let Some(fence) = self.join(&id, valid_until, &signal) {
                lose_if_session_over(&session, &req.key, &signal);
                return Ok(Grant::until(fence, valid_until).with_lost_signal(signal));
            }
            let dir = self.lock_path(&req.key);
            let client = &session.client;
            // Ours alone: it finds our node again after a lost reply, or
            // after this attempt is cut short.
            let prefix = format!("_c_{}{LOCK_NAME}", random_hex::<16>()?);
            let attempt = async {
                let (node, fence) = Self::create_node(client, &dir, &prefix, self.auth.as_ref()).await?;
                if let Err(e) = Self::wait_turn(client, req, &dir, &node, cancel).await {
                    // Leave no node behind: a timeout, a cancel or an error gives up our place.
                    if let Err(del) = Self::delete_node(client, &node).await {
                        tracing::warn!(
                            error = %del,
                            node = %path_log_id(&node),
                            "could not delete an abandoned lock node yet; retrying in the background"
                        );
                        tokio::spawn(sweep(client.clone(), dir.clone(), prefix.clone()));
                    }
                    return Err(e);
                }
                Ok((node, fence))
            };
            let answer_by = req.deadline.unwrap_or_else(Instant::now) + self.response_timeout;
            let (node, fence) = match tokio::time::timeout_at(answer_by, attempt).await {
                Ok(done) => done?,
                Err(_) => {
                    // A create may still land (the client sends it once it
                    // reconnects); the sweep's later requests queue behind it.
                    tokio::spawn(sweep(client.clone(), dir.clone(), prefix));
                    return Err(self.no_answer());
                }
            };
            let valid_until = Instant::now() + req.lease;
            let signal = LostSignal::new(valid_until);
            let (expires, expiry) = watch::channel(valid_until);
            let hold =
                Hold { node: node.clone(), client: client.clone(), fence, expires, signal: Some(signal.clone()) };
            self.holds().insert(id.clone(), hold);
            // After filing the hold: a session the supervisor gives up from
            // now on finds it there, and one given up before is seen here.
            lose_if_session_over(&session, &req.key, &signal);
            tokio::spawn(follow(client.clone(), self.holds.clone(), id, node, expiry));
            Ok(Grant::until(fence, valid_until).with_lost_signal(signal))
        })
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        Box::pin(async move {
            let hold = self.holds().get(&(key.clone(), owner.clone())).map(|h| (h.node.clone(), h.client.clone()));
            let Some((node, client)) = hold else { return Ok(Renewal::Lost) };
            let sent = Instant::now();
            match client.check_stat(&node).await {
                Ok(Some(stat)) if stat.ephemeral_owner == client.session_id().0 => {
                    self.extend(&(key.clone(), owner.clone()), sent + lease);
                    Ok(Renewal::Held { valid_until: sent + lease })
                }
                Ok(_) | Err(zk::Error::SessionExpired | zk::Error::ClientClosed) => Ok(Renewal::Lost),
                Err(e) => Err(zk_error(e)),
            }
        })
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move {
            let id = (key.clone(), owner.clone());
            let node = {
                let mut holds = self.holds();
                match holds.get_mut(&id) {
                    None => return Ok(Release::NotHeld),
                    Some(hold) => {
                        // Our own delete is not a loss: the hold's task must
                        // not mark the guards when it sees the node go.
                        hold.signal = None;
                        (hold.node.clone(), hold.client.clone())
                    }
                }
            };
            let (node, client) = node;
            // Forget the hold only once ZooKeeper no longer has the node.
            let holds = self.holds.clone();
            let mut delete = Box::pin(async move {
                let result = Self::delete_node(&client, &node).await;
                if result.is_ok() {
                    lock_holds(&holds).remove(&id);
                }
                result
            });
            match tokio::time::timeout(self.response_timeout, &mut delete).await {
                Ok(deleted) => Ok(if deleted? { Release::Freed } else { Release::NotHeld }),
                Err(_) => {
                    // Run inline until cut short, then on a task of its own, so
                    // the node is still deleted once the server answers.
                    tokio::spawn(delete);
                    Err(self.no_answer())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock key's text never reaches a log line; the node's own name
    /// does, and one lock's directory and nodes share one hash.
    #[test]
    fn a_logged_path_hides_the_key_text() {
        let key = LockKey::builder("dlock", "order.create").part("tok-secret").build().expect("key");
        let backend_dir = format!("/dlock/{}", key.as_str());
        let node = format!("{backend_dir}/_c_0123abcd-lock-0000000007");
        for logged in [path_log_id(&backend_dir), path_log_id(&node)] {
            assert!(!logged.contains("secret") && !logged.contains("order"), "{logged}");
        }
        assert_eq!(path_log_id(&node), format!("{}/_c_0123abcd-lock-0000000007", path_log_id(&backend_dir)));
    }
}
