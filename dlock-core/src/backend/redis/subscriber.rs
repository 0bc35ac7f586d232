//! One shared pub/sub connection for all waiters of a process.
//!
//! A single actor task owns the connection and a table `channel -> (Notify,
//! waiters)`. The first local waiter of a key subscribes to its release
//! channel, the last one to leave unsubscribes; a release message wakes one
//! local waiter (the one that will take the lock), not all of them. Because
//! one task performs every (un)subscribe in order, an unsubscribe can never
//! overtake a later subscribe of the same channel.
//!
//! When the connection drops, every waiter is woken to try again, and the
//! actor reconnects and resubscribes; until then waiters still wake when the
//! holder's TTL runs out.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
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
}

/// A waiter's registration: notified when the key may have come free.
/// Dropping it unregisters.
pub(crate) struct Registration {
    notify: Arc<Notify>,
    channel: String,
    commands: mpsc::UnboundedSender<Command>,
}

impl AsRef<Notify> for Registration {
    fn as_ref(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let channel = std::mem::take(&mut self.channel);
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
        let actor = Actor { client, commands: rx, channels: HashMap::new(), conn: Some((sink, stream)) };
        tokio::spawn(actor.run());
        Ok(Subscriber { commands: tx })
    }

    /// Registers a waiter for `channel`, subscribing if it is the first.
    pub(crate) async fn register(&self, channel: String) -> Registration {
        self.register_shared(channel, None).await
    }

    /// Registers a waiter whose wake-ups go to `shared` when this is the
    /// channel's first waiter (RedLock passes one `Notify` per key to every
    /// node, so a release on any node wakes the key's waiters).
    pub(crate) async fn register_shared(&self, channel: String, shared: Option<Arc<Notify>>) -> Registration {
        let (reply, answer) = oneshot::channel();
        let _ = self.commands.send(Command::Register { channel: channel.clone(), shared, reply });
        // If the actor is gone the waiter still wakes at the holder's TTL.
        let notify = answer.await.unwrap_or_default();
        Registration { notify, channel, commands: self.commands.clone() }
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
}

struct Actor {
    client: watch::Receiver<redis::Client>,
    commands: mpsc::UnboundedReceiver<Command>,
    channels: HashMap<String, Entry>,
    conn: Option<(PubSubSink, PubSubStream)>,
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
                msg = message => match msg {
                    Some(msg) => {
                        if let Some(entry) = self.channels.get(msg.get_channel_name()) {
                            entry.notify.notify_one();
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
                let entry = self
                    .channels
                    .entry(channel.clone())
                    .or_insert_with(|| Entry { notify: shared.unwrap_or_default(), waiters: 0 });
                entry.waiters += 1;
                let notify = entry.notify.clone();
                if entry.waiters == 1 {
                    if let Some((sink, _)) = &mut self.conn {
                        if let Err(e) = sink.subscribe(&channel).await {
                            tracing::warn!(error = %e, channel, "dlock subscribe failed");
                            self.disconnected();
                        }
                    }
                }
                let _ = reply.send(notify);
            }
            Command::Unregister { channel } => {
                let Some(entry) = self.channels.get_mut(&channel) else { return };
                entry.waiters = entry.waiters.saturating_sub(1);
                if entry.waiters == 0 {
                    self.channels.remove(&channel);
                    if let Some((sink, _)) = &mut self.conn {
                        if sink.unsubscribe(&channel).await.is_err() {
                            self.disconnected();
                        }
                    }
                }
            }
        }
    }

    /// Messages may have been missed: let every waiter try again.
    fn disconnected(&mut self) {
        self.conn = None;
        for entry in self.channels.values() {
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
