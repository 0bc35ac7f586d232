//! ZooKeeper: Apache Curator's `InterProcessMutex`, `InterProcessReadWriteLock`
//! and semaphore recipes, one ephemeral sequential node per contender under
//! `/<prefix>/<key>`, served in arrival order.
//!
//! * The lease is the session: the lost signal fires when our node is
//!   deleted behind our back, or as soon as the ensemble could have expired
//!   the session. A disconnected session is
//!   [`ConnectionState::Suspended`] ([`ZooKeeperBackend::connection_state`]);
//!   its locks are ours until the session timeout passes. A lost session is
//!   replaced, and waiting acquires wait for the new one.
//! * The fencing token is our node's creation zxid: strictly increasing per
//!   key, across modes, even when the lock's node is re-created.
//! * A fixed lease frees the lock even while the session lives (this process
//!   deletes the node); a crashed process loses its locks with its session.
//! * An acquire answers within its wait plus the response timeout, a
//!   release within the response timeout
//!   ([`ZooKeeperOptions::with_response_timeout`]).
//! * Without credentials ([`ZooKeeperOptions::with_auth`]) every client of
//!   the ensemble may delete the lock nodes, and so free a held lock.
//!
//! How: `docs/core-design.md`.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client as zk;

pub(crate) use super::zookeeper_auth::ZooKeeperAuth;
use super::{
    AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Holder, KeyPage, ListQuery, LockMode, LockState,
    LostSignal, Release, Renewal,
};
use crate::error::{Error, Result};
use crate::key::{validate_prefix, LockKey};
use crate::owner::Owner;

mod acl;
mod delete;
mod error;
mod hold;
mod inspect;
mod node;
mod path;
mod session;

use acl::secure_root;
use delete::{delete_node, sweep};
use error::zk_error;
use hold::{follow, lock_holds, Hold, HoldMap, Holds};
use node::{create_node, wait_turn};
use path::{node_prefix, path_log_id};
pub use session::ConnectionState;
use session::{lose_if_session_over, open_session, supervise, Session};

/// The default session timeout: how long a holder may be unreachable
/// before ZooKeeper frees its locks.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Our holds, by key and owner: node, session, fencing token, lease.
    holds: Holds,
    /// How long an acquire may take past its wait, and a release at all.
    response_timeout: Duration,
    /// The credentials of every session; with them nodes are creator-only.
    auth: Option<ZooKeeperAuth>,
}

impl std::fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperBackend").field("prefix", &self.prefix).field("state", &*self.state.borrow()).finish()
    }
}

/// How to reach ZooKeeper, how long locks survive a silent server, and
/// who may touch the lock nodes. Its `Debug` hides the password.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::zookeeper::ZooKeeperOptions;
/// use dlock_core::ZooKeeperAuth;
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

    /// How long an acquire may take past its wait, and a release at all,
    /// before it fails with [`Error::Backend`]; by default 2/3 of the
    /// session timeout. Without it, zookeeper-client holds a request while
    /// it reconnects (a try-once acquire came back after 4/3 of the session
    /// timeout). A node left by an attempt cut short is deleted later.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// Authenticates every session with these digest credentials
    /// (`DLOCK_ZOOKEEPER_AUTH`; the same on every instance) and creates every
    /// node creator-only: other clients can then neither create, change nor
    /// delete lock nodes. Without them every node is open to every client.
    ///
    /// `/<prefix>` is then persistent, kept from being emptied by a
    /// creator-only child `_dlock_acl_anchor`, and checked at connect: open
    /// to anyone, or not granting us, it is a configuration error. ACLs do
    /// not hide that a lock exists; give `/` or the chroot a restrictive ACL
    /// too.
    ///
    /// ```
    /// use dlock_core::backend::zookeeper::ZooKeeperOptions;
    /// use dlock_core::ZooKeeperAuth;
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
    /// next one, within the wait (past it, the old one, which fails).
    async fn session_for(&self, req: &AcquireRequest, cancel: &CancellationToken) -> Result<Session> {
        let mut reported = self.state.clone();
        loop {
            // Marked seen before looking, so a later session is a change.
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
    /// connection. Public only in [`test_support`](crate::test_support).
    #[cfg(feature = "test-support")]
    pub(crate) fn session_info(&self) -> zk::SessionInfo {
        self.current().client.session().clone()
    }

    /// The container node of `key`. Public only in
    /// [`test_support`](crate::test_support).
    pub(crate) fn lock_path(&self, key: &LockKey) -> String {
        path::lock_path(&self.prefix, key)
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, HoldMap> {
        lock_holds(&self.holds)
    }
}

impl Backend for ZooKeeperBackend {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    /// Every mode.
    fn supports(&self, _: LockMode) -> Result<()> {
        Ok(())
    }

    /// The session is connected and the ensemble answers a read in time.
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            match *self.state.borrow() {
                ConnectionState::Connected => {}
                ConnectionState::Suspended => {
                    return Err(Error::backend("zookeeper", "disconnected; the session may still be alive"))
                }
                ConnectionState::Lost => return Err(Error::backend("zookeeper", "the session is lost")),
            }
            let client = self.current().client;
            match tokio::time::timeout(self.response_timeout, client.check_stat("/")).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(Error::backend("zookeeper", format!("the ensemble did not answer a read: {e}"))),
                Err(_) => Err(self.no_answer()),
            }
        })
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
            if let Some(fence) = hold::join(&self.holds, &id, valid_until, &signal) {
                lose_if_session_over(&session, &req.key, &signal);
                return Ok(Grant::until(fence, valid_until).with_lost_signal(signal));
            }
            let dir = self.lock_path(&req.key);
            let client = &session.client;
            // Ours alone, to find our node again.
            let prefix = node_prefix(req.mode)?;
            let attempt = async {
                let (node, fence) = create_node(client, &dir, &prefix, self.auth.as_ref()).await?;
                let confirmed = match wait_turn(client, req, &dir, &node, cancel).await {
                    Ok(confirmed) => confirmed,
                    Err(e) => {
                        // Leave no node behind: a timeout, a cancel or an error gives up our place.
                        if let Err(del) = delete_node(client, &node).await {
                            tracing::warn!(
                                error = %del,
                                node = %path_log_id(&node),
                                "could not delete an abandoned lock node yet; retrying in the background"
                            );
                            tokio::spawn(sweep(client.clone(), dir.clone(), prefix.clone()));
                        }
                        return Err(e);
                    }
                };
                Ok((node, fence, confirmed))
            };
            let answer_by = req.deadline.unwrap_or_else(Instant::now) + self.response_timeout;
            let (node, fence, confirmed) = match tokio::time::timeout_at(answer_by, attempt).await {
                Ok(done) => done?,
                Err(_) => {
                    // A create may still land; the sweep queues behind it.
                    tokio::spawn(sweep(client.clone(), dir.clone(), prefix));
                    return Err(self.no_answer());
                }
            };
            // From when the read that found our turn was sent (`wait_turn`).
            let valid_until = confirmed + req.lease;
            let signal = LostSignal::new(valid_until);
            let (expires, expiry) = watch::channel(valid_until);
            let hold =
                Hold { node: node.clone(), client: client.clone(), fence, expires, signal: Some(signal.clone()) };
            self.holds().insert(id.clone(), hold);
            // After filing the hold, so no session's end is missed.
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
                    hold::extend(&self.holds, &(key.clone(), owner.clone()), sent + lease);
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
                        // Our own delete is not a loss.
                        hold.signal = None;
                        (hold.node.clone(), hold.client.clone())
                    }
                }
            };
            let (node, client) = node;
            // Forget the hold only once ZooKeeper no longer has the node.
            let holds = self.holds.clone();
            let mut delete = Box::pin(async move {
                let result = delete_node(&client, &node).await;
                if result.is_ok() {
                    lock_holds(&holds).remove(&id);
                }
                result
            });
            match tokio::time::timeout(self.response_timeout, &mut delete).await {
                Ok(deleted) => Ok(if deleted? { Release::Freed } else { Release::NotHeld }),
                Err(_) => {
                    // Timed out: finished on a task, so the node still goes.
                    tokio::spawn(delete);
                    Err(self.no_answer())
                }
            }
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.bounded(self.inspect_in_ensemble(key)))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        Box::pin(self.bounded(self.list_in_ensemble(query)))
    }

    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.bounded(self.force_unlock_in_ensemble(key, holder)))
    }
}

impl ZooKeeperBackend {
    /// `work`, failed with [`no_answer`](Self::no_answer) past the response
    /// timeout: a request sent while the session reconnects waits for it.
    async fn bounded<T>(&self, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        tokio::time::timeout(self.response_timeout, work).await.unwrap_or_else(|_| Err(self.no_answer()))
    }
}
