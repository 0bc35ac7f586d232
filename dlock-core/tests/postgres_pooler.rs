//! The PostgreSQL backend behind PgBouncer in transaction mode, the pooler
//! most PostgreSQL services run: every statement of a client may go to any
//! of the pool's few server connections, and a session lent between
//! statements belongs to someone else next. The lease table's promise is
//! that every step is one transaction, so nothing strands on a lent
//! session; these are the behavioural suites run through such a pool (the
//! listener on the server's own URL, as the docs say), and the conditions
//! the docs name, each shown failing without its setting.

mod suite;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::{AcquireRequest, Backend, CancellationToken};
use dlock_core::{Error, LockKey, Locker, LockerOptions, Owner};
use dlock_testing::{PgBouncer, PostgresServer};

struct Pooled {
    // Dropped first: the pooler goes before its server.
    pooler: PgBouncer,
    server: PostgresServer,
    backends: Mutex<Vec<Arc<PostgresBackend>>>,
}

impl Pooled {
    async fn connect(&self) -> Arc<PostgresBackend> {
        let options = PostgresOptions::default().with_listen_url(self.server.url());
        let backend = PostgresBackend::connect_with(&self.pooler.url(), "dlock", options)
            .await
            .expect("connect through PgBouncer");
        let backend = Arc::new(backend);
        self.backends.lock().expect("backends").push(backend.clone());
        backend
    }
}

impl suite::Harness for Pooled {
    async fn client(&self) -> Locker {
        let backend = self.connect().await;
        let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
        Locker::with_options(backend as Arc<dyn Backend>, opts).expect("valid options")
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        self.connect().await
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        let k = format!("'{}'", key.as_str().replace('\'', "''"));
        let deleted = self.server.psql(&format!(
            "WITH h AS (DELETE FROM dlock_holders WHERE key = {k} AND mode <> 'i' RETURNING 1), \
             l AS (DELETE FROM dlock_locks WHERE key = {k} RETURNING owner) \
             SELECT (SELECT count(*) FROM l WHERE owner <> '') + (SELECT count(*) FROM h)"
        ));
        assert_eq!(deleted, "1", "the key was held");
    }

    async fn lock_keys_left(&self) -> usize {
        let n = self.server.psql(
            "SELECT count(*) FROM dlock_locks AS l WHERE l.expires_at > clock_timestamp() AND (l.owner <> '' OR \
             EXISTS (SELECT 1 FROM dlock_holders AS h WHERE h.key = l.key AND h.mode <> 'i' \
             AND h.expires_at > clock_timestamp()))",
        );
        n.parse().expect("a count")
    }

    async fn parked(&self, key: &LockKey) -> usize {
        self.backends.lock().expect("backends").iter().map(|b| b.waiters(key)).sum()
    }
}

async fn pooled() -> Pooled {
    let server = PostgresServer::start();
    let pooler = PgBouncer::start(&server);
    Pooled { pooler, server, backends: Mutex::new(Vec::new()) }
}

backend_suite!(pooled());

mod primitives {
    use super::*;
    primitives_suite!(@tests pooled();
        readers_share_and_exclude_a_writer,
        a_waiting_writer_is_not_starved_by_new_readers,
        readers_and_writers_never_overlap,
        a_multi_key_lock_takes_all_or_none,
        a_semaphore_admits_its_limit_and_wakes_a_waiter,
        never_more_than_the_limit_under_contention,
    );
}

fn request(key: &LockKey, owner: &Owner) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner.clone(), Duration::from_secs(30))
}

/// Take and free one key per client, `clients` at once, `rounds` times
/// each; the errors met, as text.
async fn cycles(url: &str, listen: &str, clients: usize, rounds: usize) -> Vec<String> {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (url, listen) = (url.to_owned(), listen.to_owned());
        tasks.push(tokio::spawn(async move {
            let options = PostgresOptions::default().with_listen_url(listen);
            let backend = match PostgresBackend::connect_with(&url, "dlock", options).await {
                Ok(backend) => backend,
                Err(e) => return vec![e.to_string()],
            };
            let cancel = CancellationToken::new();
            let mut errors = Vec::new();
            for r in 0..rounds {
                let key = LockKey::builder("dlock", "pooled").part(c).part(r).build().expect("key");
                let owner = Owner::random().expect("owner");
                match backend.acquire(&request(&key, &owner), &cancel).await {
                    Ok(_) => {
                        if let Err(e) = backend.release(&key, &owner).await {
                            errors.push(e.to_string());
                        }
                    }
                    Err(e) => errors.push(e.to_string()),
                }
            }
            errors
        }));
    }
    let mut errors = Vec::new();
    for task in tasks {
        errors.extend(task.await.expect("task"));
    }
    errors
}

/// The pool these tests run through really lends its server connections
/// per transaction, and the docs' first condition is real: with the
/// pooler's tracking of prepared statements off, sqlx's statements (each
/// client numbers its own from 1) land on server connections that have
/// another client's statement of that name, or none, and fail. With it on,
/// the same load runs clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_transaction_pool_prepared_statements_must_be_kept() {
    let server = PostgresServer::start();
    let kept = PgBouncer::start(&server);
    let errors = cycles(&kept.url(), &server.url(), 8, 20).await;
    assert!(errors.is_empty(), "{errors:?}");
    let not_kept = PgBouncer::start_with(&server, &[("max_prepared_statements", "0")]);
    let errors = cycles(&not_kept.url(), &server.url(), 8, 20).await;
    assert!(!errors.is_empty(), "every statement found its prepared statement: not a transaction pool?");
    // Most name the setting to change. A statement of the same name and
    // another shape ("bind message supplies 2 parameters") is a protocol
    // violation, which also ends the connection: it is a lost answer.
    assert!(errors.iter().all(|e| e.contains("prepared statement")), "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("max_prepared_statements")), "the setting is named: {errors:?}");
}

/// PgBouncer refuses a startup parameter it was not told about, and dlock
/// sends `statement_timeout`: the refusal is a configuration error that
/// names the URL's variable and the pooler's setting, not a server that
/// seems to be down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_that_refuses_the_statement_timeout_is_named_at_connect() {
    let server = PostgresServer::start();
    let pooler = PgBouncer::start_with(&server, &[("ignore_startup_parameters", "extra_float_digits")]);
    let options = PostgresOptions::default().with_listen_url(server.url());
    let err = PostgresBackend::connect_with(&pooler.url(), "dlock", options).await.expect_err("refused");
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    let text = err.to_string();
    for needed in ["DLOCK_POSTGRES_URL", "ignore_startup_parameters", "statement_timeout"] {
        assert!(text.contains(needed), "{needed} in {text}");
    }
}

/// Why the backend has no session advisory locks (its module docs): through
/// a transaction pool, a client's `pg_advisory_unlock` runs on whichever
/// server session is free, not the one its `pg_try_advisory_lock` took
/// the lock on. Here another client's transaction holds that session (the
/// pool hands out its most recently used one first), the unlock runs on a
/// second session and answers "not held", and the lock stays taken on a
/// session the pool lends to others: stranded, with no lease to end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_advisory_lock_strands_behind_a_transaction_pool() {
    use sqlx::{Connection, PgConnection};
    // Take lock 42 as `a`, let `b` run a transaction, unlock as `a`:
    // whether the unlock freed it.
    async fn lock_and_unlock(url: &str) -> bool {
        let mut a = PgConnection::connect(url).await.expect("a");
        let mut b = PgConnection::connect(url).await.expect("b");
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(42)").fetch_one(&mut a).await.expect("lock");
        assert!(taken, "a free lock");
        let mut tx = b.begin().await.expect("b's transaction");
        sqlx::query("SELECT 1").execute(&mut *tx).await.expect("b's statement");
        let freed = sqlx::query_scalar("SELECT pg_advisory_unlock(42)").fetch_one(&mut a).await.expect("unlock");
        tx.commit().await.expect("commit");
        freed
    }
    let held = |server: &PostgresServer| {
        server.psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 42 AND granted")
    };
    // The control: on the server's own sessions, the unlock frees it.
    let server = PostgresServer::start();
    assert!(lock_and_unlock(&server.url()).await, "a session lock is freed by its own session");
    assert_eq!(held(&server), "0");
    let pooler = PgBouncer::start(&server);
    assert!(!lock_and_unlock(&pooler.url()).await, "the unlock ran on the session that took the lock");
    assert_eq!(held(&server), "1", "the lock is still taken, on a pooled session");
}
