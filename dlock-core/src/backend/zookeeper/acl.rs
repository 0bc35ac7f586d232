//! Who may touch the lock nodes: the ACL each node is created with, and,
//! with credentials, the check of `/<prefix>` that makes that ACL worth
//! having.
//!
//! A creator-only ACL on a lock node protects nothing if someone else may
//! create nodes in its parent: they could make a lock's node with an ACL of
//! their choosing and then delete every contender's node in it. So with
//! credentials `/<prefix>` must itself be ours, and stay ours (see
//! [`secure_root`] and [`ANCHOR`]). The credentials themselves
//! ([`ZooKeeperAuth`]) live outside the `zookeeper` feature, for the
//! configuration to read in every build.

use zookeeper_client as zk;

use super::error::zk_error;
use crate::backend::zookeeper_auth::{ZooKeeperAuth, AUTH_VAR};
use crate::error::{Error, Result};

/// The child that keeps a secured `/<prefix>` from ever being empty:
/// ZooKeeper deletes no node with children, and `/` (or the chroot) is
/// usually open to anyone, who could otherwise delete an empty `/<prefix>`
/// and make it again with an ACL of their own. Persistent and creator-only.
/// No lock key can have this name: every key contains `{`.
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

/// Makes `root` (`/<prefix>`) a persistent node with the creator-only ACL
/// if it is missing, and checks, when it was there already, that it is
/// neither open to anyone nor closed to us: whoever may create nodes in it
/// can create a lock's node with an ACL of their choosing and then delete
/// every contender's node in it, and without create and delete rights of
/// our own no lock could be taken. Persistent rather than a container, so
/// that the server does not reap it and leave the name free for anyone.
/// Gives it the [`ANCHOR`] child.
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
