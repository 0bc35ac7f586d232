//! The herd check for `checker-self-test`: a ZooKeeper lock recipe where
//! every waiter watches the lowest node (broken: each release wakes every
//! waiter) against the recipe dlock uses, where each waiter watches its
//! predecessor (one wake-up per release). Herding is a liveness bug, not a
//! safety one, so the checker's measure here is wake-ups per release.

use std::time::Duration;

use zookeeper_client as zk;

/// Runs `waiters` clients taking the lock under `dir` `rounds` times each;
/// returns (releases, wake-ups).
pub(crate) async fn wakeups_per_release(
    connect: &str,
    dir: &str,
    waiters: usize,
    rounds: usize,
    watch_lowest: bool,
) -> Result<(u64, u64), String> {
    let admin = session(connect).await?;
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    match admin.create(dir, &[], &persistent).await {
        Ok(_) | Err(zk::Error::NodeExists) => {}
        Err(e) => return Err(format!("create {dir}: {e}")),
    }
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let client = session(connect).await?;
        let dir = dir.to_owned();
        tasks.push(tokio::spawn(async move { contend(client, dir, rounds, watch_lowest).await }));
    }
    let (mut releases, mut wakeups) = (0, 0);
    for t in tasks {
        let (r, w) = t.await.map_err(|e| e.to_string())??;
        releases += r;
        wakeups += w;
    }
    Ok((releases, wakeups))
}

async fn session(connect: &str) -> Result<zk::Client, String> {
    zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(connect)
        .await
        .map_err(|e| format!("cannot connect to ZooKeeper at {connect}: {e}"))
}

async fn contend(client: zk::Client, dir: String, rounds: usize, watch_lowest: bool) -> Result<(u64, u64), String> {
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (mut releases, mut wakeups) = (0, 0);
    for _ in 0..rounds {
        let prefix = format!("{dir}/n-");
        let (_, seq) = client.create(&prefix, &[], &ephemeral).await.map_err(|e| e.to_string())?;
        let ours = format!("n-{seq}");
        loop {
            let mut children = client.list_children(&dir).await.map_err(|e| e.to_string())?;
            // Sequence numbers are zero-padded, so text order is creation order.
            children.sort();
            let Some(pos) = children.iter().position(|c| *c == ours) else {
                return Err("our node vanished".into());
            };
            if pos == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                client.delete(&format!("{dir}/{ours}"), None).await.map_err(|e| e.to_string())?;
                releases += 1;
                break;
            }
            let target = if watch_lowest { &children[0] } else { &children[pos - 1] };
            let (stat, watcher) =
                client.check_and_watch_stat(&format!("{dir}/{target}")).await.map_err(|e| e.to_string())?;
            if stat.is_none() {
                continue;
            }
            watcher.changed().await;
            wakeups += 1;
        }
    }
    Ok((releases, wakeups))
}
