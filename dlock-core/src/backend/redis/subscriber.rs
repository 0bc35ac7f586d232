//! One shared pub/sub connection for all waiters of a process.
//!
//! A single actor task owns the connection and a table of the channels it
//! subscribes to. The first local waiter of a key subscribes to its release
//! channel, the last one to leave unsubscribes; a release message wakes the
//! key's waiters in the process's [`Waiters`] by the one wake rule: one
//! (the one that will take the lock), unless its payload says every waiter
//! may go (see [`freed`]). Because
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
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::backend::wait::{self, Freed, Waiters};
use crate::backend::LockMode;
use crate::error::{Error, Result};
use crate::redis::redis_error;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

enum Command {
    Subscribe { channel: String, reply: oneshot::Sender<()> },
    Unsubscribe { channel: String },
}

/// Handle to the actor; dropping every handle stops it.
#[derive(Debug, Clone)]
pub(crate) struct Subscriber {
    commands: mpsc::UnboundedSender<Command>,
    /// The acquires its messages wake (RedLock's nodes share one).
    waiters: Arc<Waiters>,
}

/// A channel subscribed to for one waiter; dropping it unsubscribes when
/// it is the channel's last.
pub(crate) struct Subscription {
    channel: String,
    commands: mpsc::UnboundedSender<Command>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let channel = std::mem::take(&mut self.channel);
        let _ = self.commands.send(Command::Unsubscribe { channel });
    }
}

/// A waiter parked in the registry and subscribed to its key's channel:
/// notified when the key may have come free. Dropping it unregisters.
pub(crate) struct Registration {
    wait: wait::Registration,
    _subscription: Subscription,
}

impl AsRef<Notify> for Registration {
    fn as_ref(&self) -> &Notify {
        self.wait.as_ref()
    }
}

impl Subscriber {
    /// Connects (so that a wrong address or a missing ACL permission shows at
    /// start-up) and starts the actor.
    ///
    /// The actor reconnects to whatever server `client` names at the time
    /// (Sentinel moves it to the new master after a failover).
    pub(crate) async fn start(
        client: watch::Receiver<redis::Client>,
        probe_channel: &str,
        waiters: Arc<Waiters>,
    ) -> Result<Self> {
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
                redis_error(e)
            }
        })?;
        let _ = sink.unsubscribe(probe_channel).await;
        let (tx, rx) = mpsc::unbounded_channel();
        let actor = Actor {
            client,
            waiters: waiters.clone(),
            commands: rx,
            channels: HashMap::new(),
            conn: Some((sink, stream)),
            epoch: 0,
            generations: 0,
            confirmations: FuturesUnordered::new(),
        };
        tokio::spawn(actor.run());
        Ok(Subscriber { commands: tx, waiters })
    }

    /// Whether a task of this process waits on `channel` now (built only
    /// when some task waits on any).
    pub(crate) fn waited_on(&self, channel: impl FnOnce() -> String) -> bool {
        self.waiters.waited_on(channel)
    }

    /// How many waiters of this process are registered on `channel`.
    #[cfg(feature = "test-support")]
    pub(crate) fn waiters(&self, channel: &str) -> usize {
        self.waiters.count(channel)
    }

    /// Parks a waiter in `mode` on `channel`, subscribing if it is the
    /// channel's first; resolves once the subscription is confirmed.
    pub(crate) async fn register(&self, channel: String, mode: LockMode) -> Registration {
        let wait = self.waiters.register(&channel, mode);
        Registration { wait, _subscription: self.subscribe(channel).await }
    }

    /// Subscribes to `channel` for one more waiter (parked by the caller in
    /// this subscriber's [`Waiters`]). Resolves once the subscription is
    /// confirmed (at once without a connection: the waiter then wakes at
    /// the holder's TTL, or when the actor reconnects).
    ///
    /// Dropping the future after its first poll still unsubscribes.
    pub(crate) async fn subscribe(&self, channel: String) -> Subscription {
        let (reply, answer) = oneshot::channel();
        let _ = self.commands.send(Command::Subscribe { channel: channel.clone(), reply });
        // The actor counts this waiter from now on; if we are dropped before
        // the answer, the subscription's `Drop` uncounts it.
        let subscription = Subscription { channel, commands: self.commands.clone() };
        let _ = answer.await;
        subscription
    }
}

/// What a release announcement frees: room for all when its payload is
/// `a` (readers waited, or a reader left a read-write lock: the release
/// script decides), else for one, the one that will take the lock.
fn freed(payload: &[u8]) -> Freed {
    match payload {
        b"a" => Freed::All,
        _ => Freed::One,
    }
}

async fn connect(client: &redis::Client) -> Result<(PubSubSink, PubSubStream)> {
    match tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub()).await {
        Ok(Ok(pubsub)) => Ok(pubsub.split()),
        Ok(Err(e)) => Err(redis_error(e)),
        Err(_) => Err(Error::backend("redis", format!("pub/sub connection timed out after {CONNECT_TIMEOUT:?}"))),
    }
}

struct Entry {
    /// The waiters subscribed through it.
    waiters: usize,
    /// Tells this entry's subscription from an earlier one of the same
    /// channel whose confirmation may still be on its way.
    generation: u64,
    /// Waiters to answer once the subscription is confirmed.
    unconfirmed: Vec<oneshot::Sender<()>>,
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
    waiters: Arc<Waiters>,
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
                    Some(msg) => self.waiters.wake(msg.get_channel_name(), freed(msg.get_payload_bytes())),
                    None => self.disconnected(),
                },
            }
        }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Subscribe { channel, reply } => {
                let generation = self.generations;
                let entry = self.channels.entry(channel.clone()).or_insert_with(|| Entry {
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
                    let _ = reply.send(());
                } else {
                    // The channel's subscription is on its way: wait with the first waiter.
                    entry.unconfirmed.push(reply);
                }
            }
            Command::Unsubscribe { channel } => {
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
        if let Sent::Subscribe { channel, generation } = sent
            && let Some(entry) = self.channels.get_mut(&channel).filter(|e| e.generation == generation)
        {
            for reply in entry.unconfirmed.drain(..) {
                let _ = reply.send(());
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
                let _ = reply.send(());
            }
        }
        self.waiters.wake_every_key();
    }

    async fn resubscribe(&mut self) {
        let channels: Vec<String> = self.channels.keys().cloned().collect();
        if let Some((sink, _)) = &mut self.conn
            && !channels.is_empty()
            && let Err(e) = sink.subscribe(&channels).await
        {
            tracing::warn!(error = %e, "dlock resubscribe failed");
            self.disconnected();
            return;
        }
        // Releases may have happened while we were away.
        self.waiters.wake_every_key();
    }
}
