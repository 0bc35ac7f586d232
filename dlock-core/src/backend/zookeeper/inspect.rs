//! A ZooKeeper lock as an operator sees it: its line of contender nodes,
//! those whose turn has come holding it (as their own acquires decide,
//! `node::turn`), the rest waiting; the lock directories under the prefix
//! that have contenders; and a holder freed by force: its node deleted,
//! which its owner's watch sees at once (`hold::follow`) and which wakes
//! the contender behind it.

use zookeeper_client as zk;

use super::error::zk_error;
use super::node::turn;
use super::path::{key_of_dir, Contender};
use super::ZooKeeperBackend;
use crate::backend::{Holder, KeyPage, ListQuery, LockState, Release};
use crate::error::{Error, Result};
use crate::key::LockKey;

impl ZooKeeperBackend {
    pub(super) async fn inspect_in_ensemble(&self, key: &LockKey) -> Result<LockState> {
        let client = self.current().client;
        let dir = self.lock_path(key);
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(LockState::new(key.clone()).with_waiting(0)),
            Err(e) => return Err(zk_error(e)),
        };
        let line = Contender::line(&children);
        let mut state = LockState::new(key.clone());
        let mut waiting = 0;
        for (position, contender) in line.iter().enumerate() {
            // A line that mixes modes which cannot share a key holds no
            // contender past the mismatch: it waits (and fails its acquire).
            if !matches!(turn(&line, position, contender.mode, key), Ok(None)) {
                waiting += 1;
                continue;
            }
            // Its creation zxid, the fencing token its acquire returned.
            match client.check_stat(&format!("{dir}/{}", contender.name)).await {
                Ok(Some(stat)) => {
                    let fence = u64::try_from(stat.czxid).unwrap_or(0);
                    state.holders.push(Holder::new(contender.name.clone(), contender.mode, fence));
                }
                // Gone between the two reads: no holder any more.
                Ok(None) => {}
                Err(e) => return Err(zk_error(e)),
            }
        }
        Ok(state.with_waiting(waiting))
    }

    /// The lock directories under the prefix, in name order after the
    /// cursor (the last one of the page before), that have a contender.
    pub(super) async fn list_in_ensemble(&self, query: &ListQuery) -> Result<KeyPage> {
        let client = self.current().client;
        let root = format!("/{}", self.prefix);
        let mut names = match client.list_children(&root).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(KeyPage::default()),
            Err(e) => return Err(zk_error(e)),
        };
        names.sort_unstable();
        let after = query.cursor.as_deref().unwrap_or("");
        // (directory name, key) of the page; a candidate past a full page
        // says another follows, from the page's last directory.
        let mut page: Vec<(&String, LockKey)> = Vec::new();
        let mut more = false;
        for name in names.iter().filter(|n| n.as_str() > after) {
            let Some(key) = key_of_dir(name).filter(|k| k.as_str().starts_with(&query.starts_with)) else {
                continue;
            };
            if page.len() == query.limit {
                more = true;
                break;
            }
            match client.list_children(&format!("{root}/{name}")).await {
                Ok(children) if !Contender::line(&children).is_empty() => page.push((name, key)),
                Ok(_) | Err(zk::Error::NoNode) => {}
                Err(e) => return Err(zk_error(e)),
            }
        }
        let next = more.then(|| page.last().map(|(name, _)| (*name).clone())).flatten();
        Ok(KeyPage::new(page.into_iter().map(|(_, k)| k).collect(), next))
    }

    /// Deletes `holder`'s node, if it is still there.
    pub(super) async fn force_unlock_in_ensemble(&self, key: &LockKey, holder: &Holder) -> Result<Release> {
        if Contender::parse(holder.handle()).is_none() {
            return Err(Error::invalid_argument("holder", "not a holder this backend showed"));
        }
        let node = format!("{}/{}", self.lock_path(key), holder.handle());
        match self.current().client.delete(&node, None).await {
            Ok(()) => Ok(Release::Freed),
            Err(zk::Error::NoNode) => Ok(Release::NotHeld),
            Err(e) => Err(zk_error(e)),
        }
    }
}
