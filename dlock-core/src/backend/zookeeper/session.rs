//! The ZooKeeper session that carries every lock of this process: opening
//! it, supervising it ([`supervise`] replaces a lost one), and telling its
//! holds when it may be over, counted from our side: the last answered
//! [`heartbeat`] plus the timeout, less [`expiry_margin`]. The client's own
//! verdict would come late (`docs/core-design.md`).

use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client as zk;

use super::error::answered;
use super::hold::{lock_holds, HoldMap};
use crate::backend::zookeeper_auth::ZooKeeperAuth;
use crate::backend::{LostReason, LostSignal};
use crate::error::{Error, Result};
use crate::key::LockKey;

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

/// One ZooKeeper session and its own state: a hold belongs to the session
/// that created its node and dies with it.
#[derive(Clone)]
pub(super) struct Session {
    pub(super) client: zk::Client,
    pub(super) state: watch::Receiver<ConnectionState>,
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

/// Marks `signal` lost when its session is over or may be, for a grant
/// made just as the supervisor gave the session up.
pub(super) fn lose_if_session_over(session: &Session, key: &LockKey, signal: &LostSignal) {
    if session_may_be_over(session) && signal.lose(LostReason::SessionExpired) {
        tracing::warn!(key = %key.log_id(), reason = %LostReason::SessionExpired, "dlock.lost");
    }
}

/// Opens a session and maps its states to [`ConnectionState`] on a channel
/// of its own.
pub(super) async fn open_session(
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

/// Follows the current session: reports its states and, when it is lost,
/// forgets its holds and opens a new session (with backoff). Ends when the
/// backend is dropped.
pub(super) async fn supervise(
    session: Weak<RwLock<Session>>,
    holds: Weak<Mutex<HoldMap>>,
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
fn lose_session(holds: &mut HoldMap, id: zk::SessionId) {
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
/// each answered read was sent ([`Session::confirmed`]; ZooKeeper's own
/// pings are invisible to us). Holds no client between reads.
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
