//! A runtime does not create idempotency tables nobody uses (issue 37
//! item 5). With `DLOCK_BACKEND=postgres`, `Config::build` keeps a store on
//! the lock backend's pool; an application whose routes keep their records
//! in a store of their own never asks it for one. Its tables
//! (`dlock_idem_*`) are made on its first use, once, and a first use that
//! fails (the server away) is tried again by the next.
//!
//! Before the fix, `build` made them at start: the first test failed at its
//! first look ("dlock_idem_keys" existed right after the build).

#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_core::idempotency::{Begin, ClaimTerms};
use dlock_core::{Config, DlockRuntime};
use dlock_testing::PostgresServer;

/// The runtime `DLOCK_BACKEND=postgres` at `server` builds.
async fn runtime(server: &PostgresServer) -> DlockRuntime {
    let url = server.url();
    let config = Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("postgres".into()),
        "DLOCK_POSTGRES_URL" => Some(url.clone()),
        _ => None,
    })
    .expect("config");
    config.build().await.expect("build")
}

/// The store's tables that exist, by name, and how many of its functions.
fn idempotency_objects(server: &PostgresServer) -> String {
    server.psql(
        "SELECT coalesce(string_agg(relname, ',' ORDER BY relname), 'no table') || '; ' || \
         (SELECT count(*) FROM pg_proc WHERE proname ~ '^dlock_(ik|tk)_') || ' function(s)' \
         FROM pg_class WHERE relname LIKE 'dlock\\_idem\\_%' AND relkind = 'r'",
    )
}

/// Nothing of the store's.
const NONE: &str = "no table; 0 function(s)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_makes_no_idempotency_tables_until_a_record_is_asked_for() {
    let server = PostgresServer::start();
    let dlock = runtime(&server).await;
    assert_eq!(server.psql("SELECT to_regclass('dlock_locks') IS NOT NULL"), "t", "the lock table is made at start");
    assert_eq!(idempotency_objects(&server), NONE, "before a record is asked for");

    // Its readiness asks the server and makes nothing.
    let readiness = dlock.readiness().await;
    assert!(readiness.is_ready(), "{readiness:?}");
    assert_eq!(idempotency_objects(&server), NONE, "after a readiness probe");

    // The first requests for records, eight at once: made once, all answered.
    let store = dlock.idempotency_store().expect("records").clone();
    let terms = ClaimTerms::new(Duration::from_secs(10));
    let claims = (0..8).map(|i| {
        let store = store.clone();
        tokio::spawn(async move { store.begin("alice", &format!("k{i}"), "fp", terms).await })
    });
    for claim in claims {
        let begun = claim.await.expect("task").expect("a first use makes the tables");
        assert!(matches!(begun, Begin::New(_)), "{begun:?}");
    }
    let made = idempotency_objects(&server);
    assert!(made.starts_with("dlock_idem_keys,dlock_idem_tally,dlock_idem_tokens; "), "{made}");
    assert!(!made.ends_with("; 0 function(s)"), "{made}");
    let token = store.issue_token(None, Duration::from_secs(60)).await.expect("tokens too");
    assert_eq!(token.len(), 32);
}

/// A first use while the server is away fails like any request, and is
/// not remembered: the next one, with the server back, makes the tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_use_that_failed_is_tried_again() {
    let mut server = PostgresServer::start();
    let dlock = runtime(&server).await;
    let store = dlock.idempotency_store().expect("records").clone();
    let terms = ClaimTerms::new(Duration::from_secs(10));

    server.stop();
    let err = store.begin("alice", "k", "fp", terms).await.expect_err("the server is away");
    assert!(err.is_unavailable(), "{err:?}");
    server.start_again();
    assert_eq!(idempotency_objects(&server), NONE);

    let begun = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            // The pool's connections died with the server: a request or two
            // may find them dead before a new one is made.
            match store.begin("alice", "k", "fp", terms).await {
                Ok(begun) => return begun,
                Err(e) if e.is_unavailable() => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("{e:?}"),
            }
        }
    })
    .await
    .expect("the tables are made once the server is back");
    assert!(matches!(begun, Begin::New(_)), "{begun:?}");
    assert_eq!(server.psql("SELECT to_regclass('dlock_idem_keys') IS NOT NULL"), "t");
}
