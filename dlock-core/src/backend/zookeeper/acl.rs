//! Who may touch the lock nodes: the ACL each node is created with and,
//! with credentials, the check that `/<prefix>` is ours and stays ours
//! ([`secure_root`], [`ANCHOR`]), without which a creator-only ACL on the
//! lock nodes would protect nothing.

use zookeeper_client as zk;

use super::error::zk_error;
use crate::backend::zookeeper_auth::{ZooKeeperAuth, AUTH_VAR};
use crate::error::{Error, Result};

/// The persistent, creator-only child that keeps a secured `/<prefix>` from
/// ever being empty, so nobody can delete it and make it again. No lock key
/// has this name: every key contains `{`.
const ANCHOR: &str = "_dlock_acl_anchor";

/// The ACL of every node we create: all rights to the creator's identity
/// and none to anyone else with credentials (ZooKeeper's `CREATOR_ALL_ACL`),
/// all rights to anyone (`world:anyone`) without.
pub(super) fn node_acls(auth: Option<&ZooKeeperAuth>) -> zk::Acls<'static> {
    if auth.is_some() {
        zk::Acls::creator_all()
    } else {
        zk::Acls::anyone_all()
    }
}

/// The error for a create ZooKeeper refused for want of permission: the
/// credentials are missing or not those of whoever made the nodes.
pub(super) fn not_allowed(dir: &str, auth: Option<&ZooKeeperAuth>) -> Error {
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

/// Makes `root` (`/<prefix>`) a persistent creator-only node with the
/// [`ANCHOR`] child if it is missing, and checks, when it was there, that
/// it is neither open to anyone nor closed to us.
pub(super) async fn secure_root(client: &zk::Client, root: &str, auth: &ZooKeeperAuth) -> Result<()> {
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
