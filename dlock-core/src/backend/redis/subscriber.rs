//! One shared pub/sub connection for all waiters of a process.
//!
//! A single actor task owns the connection and a table `channel -> (Notify,
//! waiters)`. The first local waiter of a key subscribes to its release
//! channel, the last one to leave unsubscribes; a release message wakes one
//! local waiter (the one that will take the lock), not all of them, unless
//! its payload says every waiter may go (see [`wake`]). Because
//! one task sends every (un)subscribe in order, an unsubscribe can never
//! overtake a later subscribe of the same channel. The actor does not wait
//! for a confirmation before sending the next command: on a slow server
//! (100 ms away, or a RedLock node that answers late) waiting in turn made
//! every waiter queue behind every other key's (un)subscribe, and waits ran
//! seconds past their deadline (found by the `redlock-slow` torture
//! scenario). A waiter is answered once its channel's subscription is
//! confirmed, so its next try happens while releases are heard.
//!
//! When the connection drops, every waiter is woken to try again, and the
//! actor reconnects and resubscribes; until then waiters still wake when the
//! holder's TTL runs out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::error::{Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

enum Command {
    Register { channel: String, shared: Option<Arc<Notify>>, reply: oneshot::Sender<Arc<Notify>> },
    Unregister { channel: String },
}

/// Handle to the actor; dropping every handle stops it.
#[derive(Debug, Clone)]
pub(crate) struct Subscriber {
    commands: mpsc::UnboundedSender<Command>,
    /// Registrations alive, counted by the callers (the actor's own table is
    /// its task's alone), for [`Subscriber::waited_on`].
    waiting: Arc<Waiting>,
}

/// Registrations alive: in all, and per channel.
#[derive(Debug, Default)]
struct Waiting {
    /// Lets the common answer, "nobody waits", skip the lock.
    total: AtomicUsize,
    per_channel: Mutex<HashMap<String, usize>>,
}

impl Waiting {
    fn channels(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        // Every change under this lock is one count.
        self.per_channel.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, channel: &str) {
        *self.channels().entry(channel.to_owned()).or_default() += 1;
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    fn remove(&self, channel: &str) {
        let mut channels = self.channels();
        if let Some(n) = channels.get_mut(channel) {
            *n -= 1;
            if *n == 0 {
                channels.remove(channel);
            }
            self.total.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A waiter's registration: notified when the key may have come free.
/// Dropping it unregisters.
pub(crate) struct Registration {
    notify: Arc<Notify>,
    channel: String,
    commands: mpsc::UnboundedSender<Command>,
    waiting: Arc<Waiting>,
}

impl AsRef<Notify> for Registration {
    fn as_ref(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let channel = std::mem::take(&mut self.channel);
        self.waiting.remove(&channel);
        let _ = self.commands.send(Command::Unregister { channel });
    }
}

impl Subscriber {
    /// Connects (so that a wrong address or a missing ACL permission shows at
    /// start-up) and starts the actor.
    ///
    /// The actor reconnects to whatever server `client` names at the time
    /// (Sentinel moves it to the new master after a failover).
    pub(crate) async fn start(client: watch::Receiver<redis::Client>, probe_channel: &str) -> Result<Self> {
        let first = client.borrow().clone();
        let (mut sink, stream) = connect(&first).await?;
        // Subscribing is what needs the ACL channel permission; check it now.
        sink.subscribe(probe_channel).await.map_err(|e| {
            if e.code() == Some("NOPERM") {
                Error::config(
                    "DLOCK_REDIS_URL",
                    format!(
                        "the Redis user may not subscribe to the lock channel `{probe_channel}`; \
                         grant it the channel pattern (ACL `&<prefix>:*`): {e}"
                    ),
                )
            } else {
                super::redis_error(e)
            }
        })?;
        let _ = sink.unsubscribe(probe_channel).await;
        let (tx, rx) = mpsc::unbounded_channel();
        let actor = Actor {
            client,
            commands: rx,
            channels: HashMap::new(),
            conn: Some((sink, stream)),
            epoch: 0,
            generations: 0,
            confirmations: FuturesUnordered::new(),
        };
        tokio::spawn(actor.run());
        Ok(Subscriber { commands: tx, waiting: Arc::default() })
    }

    /// Whether a task of this process waits on `channel` now (built only
    /// when some task waits on any).
    pub(crate) fn waited_on(&self, channel: impl FnOnce() -> String) -> bool {
        self.waiting.total.load(Ordering::Relaxed) > 0 && self.waiting.channels().contains_key(&channel())
    }

    /// How many waiters of this process are registered on `channel`.
    #[cfg(feature = "test-support")]
    pub(crate) fn waiters(&self, channel: &str) -> usize {
        self.waiting.channels().get(channel).copied().unwrap_or(0)
    }

    /// Registers a waiter for `channel`, subscribing if it is the first.
    pub(crate) async fn register(&self, channel: String) -> Registration {
        self.register_shared(channel, None).await
    }

    /// Registers a waiter whose wake-ups go to `shared` when this is the
    /// channel's first waiter (RedLock passes one `Notify` per key to every
    /// node, so a release on any node wakes the key's waiters). Resolves once
    /// the subscription is confirmed (at once without a connection: the
    /// waiter then wakes at the holder's TTL, or when the actor reconnects).
    ///
    /// Dropping the future after its first poll still unregisters.
    pub(crate) async fn register_shared(&self, channel: String, shared: Option<Arc<Notify>>) -> Registration {
        let (reply, answer) = oneshot::channel();
        self.waiting.add(&channel);
        let _ = self.commands.send(Command::Register { channel: channel.clone(), shared, reply });
        // The actor counts this waiter from now on; if we are dropped before
        // the answer, the registration's `Drop` uncounts it.
        let mut registration = Registration {
            notify: Arc::default(),
            channel,
            commands: self.commands.clone(),
            waiting: self.waiting.clone(),
        };
        if let Ok(notify) = answer.await {
            registration.notify = notify;
        }
        registration
    }
}

/// Wakes the waiters a release announcement lets in: all of them when its
/// payload is `a` (readers waited, or a reader left a read-write lock:
/// several may go at once, and one woken in a writer's place would let the
/// wake-up go to waste), else one, the one that will take the lock.
///
/// Every waiter has its `notified()` enabled before each try, so waking
/// all of them misses none that a release could let in: one between two
/// tries is about to try anyway.
fn wake(notify: &Notify, payload: &[u8]) {
    match payload {
        b"a" => notify.notify_waiters(),
        _ => notify.notify_one(),
    }
}

async fn connect(client: &redis::Client) -> Result<(PubSubSink, PubSubStream)> {
    match tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub()).await {
        Ok(Ok(pubsub)) => Ok(pubsub.split()),
        Ok(Err(e)) => Err(super::redis_error(e)),
        Err(_) => Err(Error::backend("redis", format!("pub/sub connection timed out after {CONNECT_TIMEOUT:?}"))),
    }
}

struct Entry {
    notify: Arc<Notify>,
    waiters: usize,
    /// Tells this entry's subscription from an earlier one of the same
    /// channel whose confirmation may still be on its way.
    generation: u64,
    /// Waiters to answer once the subscription is confirmed.
    unconfirmed: Vec<oneshot::Sender<Arc<Notify>>>,
}

/// What a sent (un)subscribe was, for when its confirmation comes.
enum Sent {
    Subscribe { channel: String, generation: u64 },
    Unsubscribe,
}

/// A sent command's confirmation: what it was, on which connection.
type Confirmation = BoxFuture<'static, (Sent, u64, redis::RedisResult<()>)>;

struct Actor {
    client: watch::Receiver<redis::Client>,
    commands: mpsc::UnboundedReceiver<Command>,
    channels: HashMap<String, Entry>,
    conn: Option<(PubSubSink, PubSubStream)>,
    /// Moves on whenever the connection drops (`disconnected`), so a late
    /// answer sent on a dropped connection is ignored.
    epoch: u64,
    generations: u64,
    confirmations: FuturesUnordered<Confirmation>,
}

impl Actor {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(50);
        loop {
            if self.conn.is_none() {
                let client = self.client.borrow().clone();
                match connect(&client).await {
                    Ok(conn) => {
                        self.conn = Some(conn);
                        backoff = Duration::from_millis(50);
                        self.resubscribe().await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "dlock pub/sub reconnect failed; waiters fall back to lease expiry");
                        // Keep serving registrations while we back off.
                        let sleep = tokio::time::sleep(backoff);
                        tokio::pin!(sleep);
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        loop {
                            tokio::select! {
                                _ = &mut sleep => break,
                                cmd = self.commands.recv() => match cmd {
                                    Some(cmd) => self.handle(cmd).await,
                                    None => return,
                                },
                            }
                        }
                        continue;
                    }
                }
            }
            let message = async {
                match &mut self.conn {
                    Some((_, stream)) => stream.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                cmd = self.commands.recv() => match cmd {
                    Some(cmd) => self.handle(cmd).await,
                    None => return,
                },
                Some((sent, epoch, result)) = self.confirmations.next(), if !self.confirmations.is_empty() => {
                    self.confirmed(sent, epoch, result);
                }
                msg = message => match msg {
                    Some(msg) => {
                        if let Some(entry) = self.channels.get(msg.get_channel_name()) {
                            wake(&entry.notify, msg.get_payload_bytes());
                        }
                    }
                    None => self.disconnected(),
                },
            }
        }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Register { channel, shared, reply } => {
                let generation = self.generations;
                let entry = self.channels.entry(channel.clone()).or_insert_with(|| Entry {
                    notify: shared.unwrap_or_default(),
                    waiters: 0,
                    generation,
                    unconfirmed: Vec::new(),
                });
                entry.waiters += 1;
                if entry.waiters == 1 && self.conn.is_some() {
                    self.generations += 1;
                    entry.unconfirmed.push(reply);
                    self.send(channel.clone(), Sent::Subscribe { channel, generation });
                } else if entry.unconfirmed.is_empty() {
                    let _ = reply.send(entry.notify.clone());
                } else {
                    // The channel's subscription is on its way: wait with the first waiter.
                    entry.unconfirmed.push(reply);
                }
            }
            Command::Unregister { channel } => {
                let Some(entry) = self.channels.get_mut(&channel) else { return };
                entry.waiters = entry.waiters.saturating_sub(1);
                if entry.waiters == 0 {
                    self.channels.remove(&channel);
                    if self.conn.is_some() {
                        self.send(channel, Sent::Unsubscribe);
                    }
                }
            }
        }
    }

    /// Sends an (un)subscribe now, and keeps its confirmation for later.
    ///
    /// The sink hands the command to the connection on the future's first
    /// poll, so polling it once here keeps commands in the order they were
    /// made.
    fn send(&mut self, channel: String, sent: Sent) {
        let Some((sink, _)) = &self.conn else { return };
        let mut sink = sink.clone();
        let subscribe = matches!(sent, Sent::Subscribe { .. });
        let mut confirmation: BoxFuture<'static, redis::RedisResult<()>> = Box::pin(async move {
            if subscribe {
                sink.subscribe(&channel).await
            } else {
                sink.unsubscribe(&channel).await
            }
        });
        let epoch = self.epoch;
        match (&mut confirmation).now_or_never() {
            Some(result) => self.confirmed(sent, epoch, result),
            None => self.confirmations.push(Box::pin(confirmation.map(move |result| (sent, epoch, result)))),
        }
    }

    fn confirmed(&mut self, sent: Sent, epoch: u64, result: redis::RedisResult<()>) {
        if epoch != self.epoch {
            // A connection since dropped: `resubscribe` answered its waiters.
            return;
        }
        if let Err(e) = result {
            tracing::warn!(error = %e, "dlock (un)subscribe failed");
            self.disconnected();
            return;
        }
        if let Sent::Subscribe { channel, generation } = sent {
            if let Some(entry) = self.channels.get_mut(&channel).filter(|e| e.generation == generation) {
                for reply in entry.unconfirmed.drain(..) {
                    let _ = reply.send(entry.notify.clone());
                }
            }
        }
    }

    /// Messages may have been missed: let every waiter try again, and answer
    /// those still waiting for a confirmation (they fall back to the TTL).
    fn disconnected(&mut self) {
        self.conn = None;
        self.epoch += 1;
        for entry in self.channels.values_mut() {
            for reply in entry.unconfirmed.drain(..) {
                let _ = reply.send(entry.notify.clone());
            }
            entry.notify.notify_waiters();
        }
    }

    async fn resubscribe(&mut self) {
        let channels: Vec<String> = self.channels.keys().cloned().collect();
        if let Some((sink, _)) = &mut self.conn {
            if !channels.is_empty() {
                if let Err(e) = sink.subscribe(&channels).await {
                    tracing::warn!(error = %e, "dlock resubscribe failed");
                    self.disconnected();
                    return;
                }
            }
        }
        // Releases may have happened while we were away.
        for entry in self.channels.values() {
            entry.notify.notify_waiters();
        }
    }
}
