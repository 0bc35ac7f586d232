//! Taking a place in a lock's line: creating our ephemeral sequential node
//! (found again by its random prefix when the create's reply was lost, or
//! left to [`sweep`]), then waiting for its turn.

use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client as zk;

use super::acl::{node_acls, not_allowed, secure_root};
use super::delete::sweep;
use super::error::{answered, zk_error};
use futures_util::FutureExt;

use super::path::{path_log_id, Contender};
use crate::backend::zookeeper_auth::ZooKeeperAuth;
use crate::backend::{contention, AcquireRequest, CancellationToken, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;

/// Creates our sequential node (and the lock's container node on the way).
/// Returns its path and creation zxid, the fencing token (a sequence number
/// would restart when the container is re-created). A failure that is not
/// the server's answer is followed by a look for our node before a retry.
pub(super) async fn create_node(
    client: &zk::Client,
    dir: &str,
    prefix: &str,
    auth: Option<&ZooKeeperAuth>,
) -> Result<(String, u64)> {
    let name = format!("{dir}/{prefix}");
    let acls = node_acls(auth);
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
                match find_node(client, dir, prefix).await {
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
    Err(last
        .map_or_else(|| Error::backend("zookeeper", format!("could not create a lock node under `{dir}`")), zk_error))
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

/// Waits until `node`'s turn comes, as Curator's recipes decide it from the
/// line (in arrival order): exclusive when first, watching its predecessor;
/// shared when no exclusive node is before it, watching the nearest one;
/// one of N permits when fewer than N are before it, watching the line. A
/// line whose modes cannot share the key is [`Error::ModeConflict`].
///
/// Returns when the read that found its turn was sent: the server saw our
/// node, and our session alive, after that, so a grant's validity is
/// measured from there, as the Redis backend measures it from before its
/// request (a client paused after that read, past its lease, gets back a
/// grant already over, not one it would believe for a lease more).
pub(super) async fn wait_turn(
    client: &zk::Client,
    req: &AcquireRequest,
    dir: &str,
    node: &str,
    cancel: &CancellationToken,
) -> Result<Instant> {
    let started = Instant::now();
    let ours = node.rsplit('/').next().unwrap_or_default();
    loop {
        let sent = Instant::now();
        let (children, line_watch) = match req.mode {
            LockMode::Permits { .. } => {
                let (children, watcher) = client.list_and_watch_children(dir).await.map_err(zk_error)?;
                (children, Some(watcher))
            }
            _ => (client.list_children(dir).await.map_err(zk_error)?, None),
        };
        let line = Contender::line(&children);
        let Some(position) = line.iter().position(|c| c.name == ours) else {
            return Err(Error::backend("zookeeper", "our lock node vanished (session expired?)"));
        };
        let blocker = match turn(&line, position, req.mode, &req.key)? {
            None => return Ok(sent),
            Some(blocker) => blocker,
        };
        let Some(deadline) = req.deadline else {
            return Err(contention(req, started));
        };
        let wake = match line_watch {
            Some(watcher) => watcher.changed().boxed(),
            None => {
                let blocker = format!("{dir}/{}", line[blocker].name);
                let (stat, watcher) = client.check_and_watch_stat(&blocker).await.map_err(zk_error)?;
                if stat.is_none() {
                    continue;
                }
                watcher.changed().boxed()
            }
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = wake => {}
            _ = tokio::time::sleep_until(deadline) => return Err(contention(req, started)),
        }
    }
}

/// Whether the contender at `position` holds the key: `None` when it does,
/// else the place of the contender it waits for (for a semaphore, any
/// before it).
pub(super) fn turn(line: &[Contender], position: usize, mode: LockMode, key: &LockKey) -> Result<Option<usize>> {
    let ahead = &line[..position];
    let conflict = |other: &Contender| {
        Error::mode_conflict(key, format!("it is held as {}, and was asked for as {mode}", other.mode))
    };
    match mode {
        LockMode::Permits { limit } => {
            if let Some(other) = ahead.iter().find(|c| c.mode != mode) {
                return Err(conflict(other));
            }
            #[cfg(feature = "broken-variants")]
            let limit = crate::broken_variants::permit_limit(limit);
            Ok((position >= limit as usize).then(|| position - 1))
        }
        mode => {
            if let Some(other) = ahead.iter().find(|c| matches!(c.mode, LockMode::Permits { .. })) {
                return Err(conflict(other));
            }
            Ok(match mode {
                LockMode::Shared => {
                    let writer = ahead.iter().rposition(|c| c.mode == LockMode::Exclusive);
                    #[cfg(feature = "broken-variants")]
                    let writer = crate::broken_variants::readers_wait(writer);
                    writer
                }
                _ => position.checked_sub(1),
            })
        }
    }
}
