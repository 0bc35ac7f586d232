//! Digest auth and ACLs on the ZooKeeper lock nodes, against a real server.
//!
//! Without credentials every lock node is open to every client of the
//! ensemble, which can free a lock someone holds by deleting its node (the
//! control below shows it). With `DLOCK_ZOOKEEPER_AUTH` the nodes belong to
//! the credentials' identity: other clients, anonymous or with other
//! credentials, can neither delete nor change them, while the holder and
//! other instances with the same credentials work as before.

use std::time::Duration;

use dlock_core::backend::zookeeper::{ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::{AcquireOptions, Config, Error, LockGuard, Locker, LostReason, ZooKeeperAuth};
use dlock_testing::ZooKeeperServer;
use zookeeper_client as zk;

const CREDENTIALS: &str = "orders:s3cret";

/// A locker configured the way a service is, through the `DLOCK_*`
/// variables.
async fn locker_from_env(server: &ZooKeeperServer, auth: Option<&str>) -> Locker {
    let connect = server.connect_string();
    let auth = auth.map(str::to_owned);
    let config = Config::from_lookup(move |var| match var {
        "DLOCK_BACKEND" => Some("zookeeper".into()),
        "DLOCK_ZOOKEEPER" => Some(connect.clone()),
        "DLOCK_ZOOKEEPER_SESSION_MS" => Some("4000".into()),
        "DLOCK_ZOOKEEPER_AUTH" => auth.clone(),
        _ => None,
    })
    .expect("valid configuration");
    tokio::time::timeout(Duration::from_secs(10), config.build())
        .await
        .expect("no hang")
        .expect("connect")
        .locker()
        .clone()
}

/// A plain ZooKeeper client, with digest credentials or none: the intruder,
/// or an operator's view of the nodes.
async fn raw(server: &ZooKeeperServer, credentials: Option<&str>) -> zk::Client {
    let mut connector = zk::Client::connector();
    if let Some(credentials) = credentials {
        connector = connector.with_auth("digest", credentials.as_bytes());
    }
    connector.connect(&server.connect_string()).await.expect("raw ZooKeeper client")
}

/// The path of the one contender node of the lock of `guard`, read with
/// the holder's credentials.
async fn lock_node(server: &ZooKeeperServer, guard: &LockGuard) -> (String, String) {
    let dir = format!("/dlock/{}", guard.key().as_str());
    let children = raw(server, Some(CREDENTIALS)).await.list_children(&dir).await.expect("list the lock's node");
    assert_eq!(children.len(), 1, "one contender: {children:?}");
    let node = format!("{dir}/{}", children[0]);
    (dir, node)
}

fn lease() -> AcquireOptions {
    AcquireOptions::new().with_lease(Duration::from_secs(60))
}

/// The hole: without credentials any client of the ensemble frees a held
/// lock by deleting its node. The holder learns it (lost, `Stolen`), but
/// another client may already hold the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_credentials_anyone_can_free_a_held_lock() {
    let server = ZooKeeperServer::start();
    let holder = locker_from_env(&server, None).await;
    let key = holder.key("open").part(1).build().expect("key");
    let guard = holder.acquire(&key, lease()).await.expect("free");
    let dir = format!("/dlock/{}", key.as_str());
    let intruder = raw(&server, None).await;
    let children = intruder.list_children(&dir).await.expect("anyone lists the contenders");
    assert_eq!(children.len(), 1, "{children:?}");
    intruder.delete(&format!("{dir}/{}", children[0]), None).await.expect("anyone deletes the holder's node");
    let reason = tokio::time::timeout(Duration::from_secs(5), guard.lost()).await.expect("the holder is told");
    assert_eq!(reason, LostReason::Stolen);
}

/// With credentials, clients without them (anonymous, a wrong password,
/// another user) can neither delete nor change the lock nodes, the prefix
/// node or its ACLs, nor slip a node of their own in; the holder keeps its
/// lock, and a second instance with the same credentials contends and takes
/// the lock after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_credentials_identity_can_touch_the_lock_nodes() {
    let server = ZooKeeperServer::start();
    let holder = locker_from_env(&server, Some(CREDENTIALS)).await;
    let second = locker_from_env(&server, Some(CREDENTIALS)).await;
    let key = holder.key("secured").part(1).build().expect("key");
    let guard = holder.acquire(&key, lease()).await.expect("free");
    let (dir, node) = lock_node(&server, &guard).await;

    // Every node dlock made carries one ACL: all rights for the identity
    // ZooKeeper derived from the credentials, which is `digest_id`.
    let owner = raw(&server, Some(CREDENTIALS)).await;
    let id = CREDENTIALS.parse::<ZooKeeperAuth>().expect("valid").digest_id();
    for path in ["/dlock", dir.as_str(), node.as_str()] {
        let (acls, _) = owner.get_acl(path).await.expect("the owner reads the ACL");
        assert_eq!(acls, vec![zk::Acl::new(zk::Permission::ALL, zk::AuthId::new("digest", &id))], "{path}");
    }

    for credentials in [None, Some("orders:guess"), Some("mallory:s3cret")] {
        let intruder = raw(&server, credentials).await;
        let who = credentials.unwrap_or("anonymous");
        let refused = |what: &str, result: Result<(), zk::Error>| {
            assert!(matches!(result, Err(zk::Error::NoAuth)), "{who}: {what} gave {result:?}");
        };
        refused("delete the holder's node", intruder.delete(&node, None).await);
        refused("delete the lock's node", intruder.delete(&dir, None).await);
        refused("write the holder's node", intruder.set_data(&node, b"mine", None).await.map(drop));
        refused("open the node's ACL", intruder.set_acl(&node, &zk::Acls::anyone_all(), None).await.map(drop));
        refused("open the lock's ACL", intruder.set_acl(&dir, &zk::Acls::anyone_all(), None).await.map(drop));
        refused("open the prefix's ACL", intruder.set_acl("/dlock", &zk::Acls::anyone_all(), None).await.map(drop));
        // A node sorting ahead of the next contender would jump the queue.
        let jump = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        refused("queue a node", intruder.create(&format!("{dir}/_c_0-lock-"), &[], &jump).await.map(drop));
        // A lock's node made in advance, open to all, would expose every
        // contender's node in it.
        let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        refused("pre-make a lock's node", intruder.create("/dlock/shop:{next}", &[], &open).await.map(drop));
    }
    assert!(owner.check_stat(&node).await.expect("stat").is_some(), "the holder's node is still there");
    assert!(!guard.is_lost(), "nothing happened to the holder");

    // The holder and an instance with the same credentials work as before.
    let busy = second.acquire(&key, AcquireOptions::new()).await;
    assert!(busy.as_ref().is_err_and(Error::is_contention), "{busy:?}");
    let first_token = guard.fencing_token();
    assert!(guard.release().await.expect("the holder releases"), "it was held");
    let next = second.acquire(&key, lease()).await.expect("the second instance takes the lock");
    assert!(next.fencing_token() > first_token);
    assert!(next.release().await.expect("release"));

    // No lock is held now and the lock's node is gone. `/` is open to
    // anyone here, as it is by default: `/dlock` must still not be
    // deletable (its anchor keeps it non-empty), or it could be made again
    // with an open ACL.
    assert!(owner.check_stat(&dir).await.expect("stat").is_none(), "the released lock's node is removed");
    for credentials in [None, Some("orders:guess")] {
        let gone = raw(&server, credentials).await.delete("/dlock", None).await;
        assert!(matches!(gone, Err(zk::Error::NotEmpty)), "{credentials:?}: deleting /dlock gave {gone:?}");
    }
}

/// Credentials that cannot protect the lock nodes stop the service at
/// start-up (or at its first lock, for an instance without credentials)
/// with a configuration error naming `DLOCK_ZOOKEEPER_AUTH`, instead of
/// running with nodes someone else may change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_that_cannot_protect_the_nodes_are_refused() {
    let server = ZooKeeperServer::start();
    let auth = |credentials: &str| credentials.parse::<ZooKeeperAuth>().expect("valid");
    let connect = |prefix: &'static str, auth: Option<ZooKeeperAuth>| {
        let connect = server.connect_string();
        async move {
            let mut options = ZooKeeperOptions::default().with_session_timeout(Duration::from_secs(4));
            if let Some(auth) = auth {
                options = options.with_auth(auth);
            }
            ZooKeeperBackend::connect_with(&connect, prefix, options).await
        }
    };
    let names_the_variable = |what: &str, err: Error| {
        assert!(err.is_misconfigured(), "{what}: {err}");
        let text = err.to_string();
        assert!(text.contains("DLOCK_ZOOKEEPER_AUTH"), "{what}: {text}");
        assert!(!text.contains("s3cret") && !text.contains("guess"), "{what}: the password is shown: {text}");
    };

    // A prefix node made open before credentials were configured.
    let anonymous = raw(&server, None).await;
    let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    anonymous.create("/legacy", &[], &open).await.expect("an open prefix node");
    let err = connect("legacy", Some(auth(CREDENTIALS))).await.map(drop).expect_err("an open prefix is refused");
    names_the_variable("open prefix", err);
    // One that grants our identity everything, and anyone else too.
    let ours = zk::Acl::new(zk::Permission::ALL, zk::AuthId::new("digest", &auth(CREDENTIALS).digest_id()));
    let anyone = zk::Acl::new(zk::Permission::READ | zk::Permission::DELETE, zk::AuthId::anyone());
    let both = [ours, anyone];
    let half = zk::CreateMode::Persistent.with_acls(zk::Acls::new(&both));
    anonymous.create("/half", &[], &half).await.expect("a half-open prefix node");
    let err = connect("half", Some(auth(CREDENTIALS))).await.map(drop).expect_err("a half-open prefix is refused");
    assert!(err.to_string().contains("lets anyone"), "{err}");
    names_the_variable("half-open prefix", err);

    // A prefix node secured with other credentials: a wrong password.
    let _owner = connect("dlock", Some(auth(CREDENTIALS))).await.expect("secures /dlock");
    let err = connect("dlock", Some(auth("orders:guess"))).await.map(drop).expect_err("a wrong password is refused");
    names_the_variable("wrong password", err);

    // An instance without credentials cannot lock under a secured prefix,
    // and says why.
    let unsecured = Locker::new(connect("dlock", None).await.expect("connects"));
    let key = unsecured.key("secured").part(1).build().expect("key");
    let err = unsecured.acquire(&key, AcquireOptions::new()).await.map(drop).expect_err("refused by ZooKeeper");
    names_the_variable("no credentials", err);
}
