//! What dlock answers on is on disk, whatever the server's tuning (issue
//! 38): a cluster with `synchronous_commit = off` answers a commit before
//! its WAL is written, and a crash of the machine then forgets it. Each
//! test here answers a step of dlock's (a grant, a release, a renewal, a
//! fence, an idempotency record, a token), crashes the server inside that
//! window, and looks for the step afterwards.
//!
//! The crash: the server's background WAL writers are stopped before the
//! step and killed after it (`PostgresServer::hold_wal_writes` and
//! `crash_losing_unwritten_wal`), so an asynchronous commit is lost every
//! time, not only when the crash happens to land in its 600 ms. The first
//! test shows the emulation both ways: an asynchronous commit is lost, a
//! synchronous one kept, and the lease test passes on a server with the
//! default setting too.
//!
//! Before the fix (each statement pins `synchronous_commit` for its own
//! transaction), every test of a dlock step here failed: the second client
//! was granted the key with the first holder's token, and the record,
//! fence or token was gone.

#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::{AcquireRequest, Backend, LockMode, Release, Renewal};
use dlock_core::fence::postgres::Fences;
use dlock_core::idempotency::{Begin, ClaimTerms, IdempotencyStore, PostgresStore, StoredResponse, TokenClaim};
use dlock_core::{Error, LockKey, Owner};
use dlock_testing::{PgBouncer, PostgresServer};
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;

/// The server setting under test.
const ASYNC: &[(&str, &str)] = &[("synchronous_commit", "off")];

fn key(name: &str) -> LockKey {
    LockKey::builder("dlock", name).part(1).build().expect("key")
}

fn request(key: &LockKey, owner: &Owner, lease: Duration) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner.clone(), lease)
}

async fn backend(url: &str) -> PostgresBackend {
    PostgresBackend::connect(url, "dlock").await.expect("connect")
}

/// Everything committed so far written to the data files, so that only
/// the steps after it are at stake (the tables dlock made at connect
/// among them).
fn checkpoint(server: &PostgresServer) {
    server.psql("CHECKPOINT");
}

/// The rows of `dlock_locks` for `key` and `owner`, with their token.
fn lease_rows(server: &PostgresServer, key: &LockKey, owner: &Owner) -> String {
    server.psql(&format!(
        "SELECT count(*) || ' row(s), token ' || coalesce(max(fence), 0) FROM dlock_locks \
         WHERE key = '{}' AND owner = '{}' AND expires_at > clock_timestamp()",
        key.as_str(),
        owner.as_str()
    ))
}

/// The emulation itself, without dlock: on a server with
/// `synchronous_commit = off`, the crash loses a plain commit, keeps one
/// whose transaction set `synchronous_commit = on` locally (what dlock's
/// statements do), and loses one made inside a function with a
/// `SET synchronous_commit = on` clause (PostgreSQL restores the value
/// when the function returns, before the commit). On a server with the
/// default setting, all three are kept. One crash each: a commit that
/// writes its WAL writes all the WAL before it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crash_loses_exactly_the_commits_answered_before_their_wal_was_written() {
    let steps = [
        ("plain", "INSERT INTO t VALUES ('plain')"),
        ("pinned", "INSERT INTO t SELECT 'pinned' WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL"),
        ("clause", "SELECT clause('clause')"),
    ];
    for (settings, kept) in [(ASYNC, ["pinned"].as_slice()), (&[][..], ["plain", "pinned", "clause"].as_slice())] {
        let mut server = PostgresServer::start_with(settings);
        server.psql(
            "CREATE TABLE t (what text); \
             CREATE FUNCTION clause(w text) RETURNS void LANGUAGE sql SET synchronous_commit = on \
               AS $$ INSERT INTO t VALUES (w) $$",
        );
        let mut survived = Vec::new();
        for (name, sql) in steps {
            checkpoint(&server);
            server.hold_wal_writes();
            let mut conn = sqlx::PgConnection::connect(&server.url()).await.expect("connect");
            sqlx::query(sql).execute(&mut conn).await.expect(sql);
            drop(conn);
            server.crash_losing_unwritten_wal();
            if server.psql(&format!("SELECT count(*) FROM t WHERE what = '{name}'")) == "1" {
                survived.push(name);
            }
        }
        assert_eq!(survived, kept, "settings {settings:?}");
    }
}

/// Runs `step` while the server's WAL writes are held, then crashes it:
/// what the step committed asynchronously is lost, what it wrote is kept.
/// Whatever ran before is on disk (a checkpoint first), and every step has
/// a crash of its own: a commit that writes its WAL writes all the WAL
/// before it, so a later step's would save an earlier one's.
async fn crash_after<T>(server: &mut PostgresServer, step: impl std::future::Future<Output = T>) -> T {
    checkpoint(server);
    server.hold_wal_writes();
    let answered = step.await;
    server.crash_losing_unwritten_wal();
    answered
}

/// Fails with every step a crash forgot, not the first alone.
fn none_lost(lost: &[String]) {
    assert!(lost.is_empty(), "answered before the crash, gone after it:\n{}", lost.join("\n"));
}

/// B's exclusive acquire of `key`, which A holds for a minute: `None` when
/// refused, as it must be, else what B got.
async fn taken_from_a(b: &PostgresBackend, key: &LockKey) -> Option<String> {
    let owner = Owner::random().expect("owner");
    match b.acquire(&request(key, &owner, Duration::from_secs(60)), &CancellationToken::new()).await {
        Err(e) if e.is_contention() => None,
        Ok(grant) => Some(format!("granted, token {}", grant.fencing_token)),
        Err(e) => Some(format!("{e:?}")),
    }
}

/// The pin raises `off` to `on` for its transaction and keeps any other
/// value (`local`, `remote_write`, `remote_apply` are the operator's
/// choice for replication, and never weaker locally), and it ends with the
/// transaction: the session keeps its own setting (a pooler's next client
/// gets the session as it was). Seen inside routes' transactions, where a
/// fence check and a key claim (`begin_in`) run, on a session whose
/// setting stands for the server's, a database's or a role's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pin_raises_off_keeps_every_other_value_and_ends_with_the_transaction() {
    let server = PostgresServer::start();
    let fences = Fences::new("dlock").expect("prefix");
    let s = store(&server.url()).await;
    fences.create(s.pool()).await.expect("create");
    let mut conn = s.pool().acquire().await.expect("connection");
    let show = "SHOW synchronous_commit";
    let values = [
        ("off", "on"),
        ("local", "local"),
        ("remote_write", "remote_write"),
        ("on", "on"),
        ("remote_apply", "remote_apply"),
    ];
    for (i, (session, in_tx)) in values.into_iter().enumerate() {
        sqlx::query(&format!("SET synchronous_commit = {session}")).execute(&mut *conn).await.expect("set");
        for face in ["fence", "claim"] {
            let mut tx = conn.begin().await.expect("begin");
            match face {
                "fence" => fences.check(&mut tx, "pin", i as u64 + 1).await.expect("check"),
                _ => {
                    let key = format!("pin-{i}");
                    let begun = s.begin_in(&mut tx, "alice", &key, "fp", terms()).await.expect("begin_in");
                    assert!(matches!(begun, Begin::New(_)), "{begun:?}");
                }
            }
            let seen: String = sqlx::query_scalar(show).fetch_one(&mut *tx).await.expect("show");
            assert_eq!(seen, in_tx, "{face} in a transaction of a session set to {session}");
            tx.commit().await.expect("commit");
            let after: String = sqlx::query_scalar(show).fetch_one(&mut *conn).await.expect("show");
            assert_eq!(after, session, "the session's own setting after the {face}'s transaction");
        }
    }
    sqlx::query("RESET synchronous_commit").execute(&mut *conn).await.expect("reset");
}

/// A lease and its token: A is granted `k` (the first try, one plain
/// statement) and, after another crash, a shared hold of `s` (the acquire
/// function). After each crash B must be refused (A's row survived, with
/// its token), and B's next grant of another key must be above A's tokens.
/// Before the fix: "B was granted the key with token 2 while A holds it
/// with token 2".
async fn leases_survive_the_crash(settings: &[(&str, &str)]) {
    let mut server = PostgresServer::start_with(settings);
    let cancel = CancellationToken::new();
    let (k, s, other) = (key("crash-held"), key("crash-shared"), key("crash-other"));
    let a_owner = Owner::random().expect("owner");
    let lease = Duration::from_secs(60);
    // Warm-up: the sequence has drawn.
    let a = backend(&server.url()).await;
    a.acquire(&request(&other, &a_owner, Duration::from_secs(5)), &cancel).await.expect("free");
    assert_eq!(a.release(&other, &a_owner).await.expect("release"), Release::Freed);
    let mut lost = Vec::new();
    let mut tokens = Vec::new();
    for (held, mode) in [(&k, LockMode::Exclusive), (&s, LockMode::Shared)] {
        let a = backend(&server.url()).await;
        let req = request(held, &a_owner, lease).with_mode(mode);
        let token = crash_after(&mut server, a.acquire(&req, &cancel)).await.expect("free").fencing_token;
        tokens.push(token);
        let rows = lease_rows(&server, held, &a_owner);
        let b = backend(&server.url()).await;
        if let Some(got) = taken_from_a(&b, held).await {
            lost.push(format!("A's {mode} grant (token {token}): B {got}; A's rows: {rows}"));
        }
    }
    let b = backend(&server.url()).await;
    let next = b.acquire(&request(&other, &Owner::random().expect("owner"), lease), &cancel).await;
    let next = next.expect("free").fencing_token;
    if tokens.iter().any(|&t| next <= t) {
        lost.push(format!("B's token {next} after A's {tokens:?}"));
    }
    none_lost(&lost);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_and_its_token_survive_a_crash_under_async_commit() {
    leases_survive_the_crash(ASYNC).await;
}

/// The control: the same steps and crashes on a server with the default
/// `synchronous_commit = on` (it passed before the fix too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_lease_survives_the_same_crash_under_the_default_setting() {
    leases_survive_the_crash(&[]).await;
}

/// Releases and a renewal answered before a crash hold after it: a key
/// released (exclusive: the plain delete; shared: the release function) is
/// free at once, not held until its lease ends; a lease renewed (the renew
/// function) still holds after the one it replaced has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_and_a_renewal_survive_a_crash_under_async_commit() {
    let mut server = PostgresServer::start_with(ASYNC);
    let cancel = CancellationToken::new();
    let a_owner = Owner::random().expect("owner");
    let mut lost = Vec::new();
    for (name, mode) in [("crash-freed", LockMode::Exclusive), ("crash-freed-shared", LockMode::Shared)] {
        let k = key(name);
        let a = backend(&server.url()).await;
        a.acquire(&request(&k, &a_owner, Duration::from_secs(60)).with_mode(mode), &cancel).await.expect("free");
        let released = crash_after(&mut server, a.release(&k, &a_owner)).await.expect("release");
        assert_eq!(released, Release::Freed);
        let b = backend(&server.url()).await;
        let taken = b.acquire(&request(&k, &Owner::random().expect("owner"), Duration::from_secs(5)), &cancel).await;
        if let Err(e) = taken {
            lost.push(format!("A's {mode} release: the key is held again after the crash ({e:?})"));
        }
    }
    let k = key("crash-renewed");
    let short = Duration::from_millis(1_500);
    let a = backend(&server.url()).await;
    a.acquire(&request(&k, &a_owner, short), &cancel).await.expect("free");
    let granted = tokio::time::Instant::now();
    let renewal = crash_after(&mut server, a.renew(&k, &a_owner, Duration::from_secs(60))).await.expect("renew");
    assert!(matches!(renewal, Renewal::Held { .. }), "{renewal:?}");
    tokio::time::sleep_until(granted + short + Duration::from_millis(200)).await;
    let b = backend(&server.url()).await;
    if let Some(got) = taken_from_a(&b, &k).await {
        lost.push(format!("A's renewal to 60 s: once the old lease of 1.5 s ended, B {got}"));
    }
    none_lost(&lost);
}

/// A fence checked in a committed transaction holds after the crash: an
/// older token is refused. Before the fix the fence was forgotten and the
/// older token passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_survives_a_crash_under_async_commit() {
    let mut server = PostgresServer::start_with(ASYNC);
    let fences = Fences::new("dlock").expect("prefix");
    let pool = sqlx::PgPool::connect(&server.url()).await.expect("pool");
    fences.create(&pool).await.expect("create");
    crash_after(&mut server, async {
        let mut tx = pool.begin().await.expect("begin");
        fences.check(&mut tx, "stock:42", 7).await.expect("the first token");
        tx.commit().await.expect("commit");
    })
    .await;
    pool.close().await;

    let pool = sqlx::PgPool::connect(&server.url()).await.expect("pool");
    let mut tx = pool.begin().await.expect("begin");
    match fences.check(&mut tx, "stock:42", 6).await {
        Err(Error::StaleToken { newest: 7, .. }) => {}
        other => panic!("an older token after the crash: {other:?} (the fence of token 7 was forgotten)"),
    }
}

fn terms() -> ClaimTerms {
    ClaimTerms::new(Duration::from_secs(30))
}

fn paid() -> StoredResponse {
    StoredResponse::new(201, vec![], b"paid".to_vec())
}

async fn store(url: &str) -> PostgresStore {
    PostgresStore::connect(url, "dlock").await.expect("store")
}

/// The claim of a new key.
async fn claim(store: &PostgresStore, key: &str) -> dlock_core::idempotency::Claim {
    match store.begin("alice", key, "fp", terms()).await.expect("begin") {
        Begin::New(claim) => claim,
        other => panic!("{key}: a new key, not {other:?}"),
    }
}

/// A claim and an answer (by the store's own statements, `begin` and
/// `complete`) and an answer committed in the route's transaction
/// (`begin_in`, `complete_in`, commit), each followed by a crash: a retry
/// after it finds the key in progress, or replays the answer. Before the
/// fix each retry was `Begin::New`: the route would run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_and_a_completed_key_survive_a_crash_under_async_commit() {
    let mut server = PostgresServer::start_with(ASYNC);
    let mut lost = Vec::new();
    let retry = |s: PostgresStore, key: &'static str| async move { s.begin("alice", key, "fp", terms()).await };

    let s = store(&server.url()).await;
    crash_after(&mut server, claim(&s, "claimed")).await;
    let found = retry(store(&server.url()).await, "claimed").await.expect("begin");
    if !matches!(found, Begin::InProgress) {
        lost.push(format!("a claim in progress: the retry found {found:?}, and would run the route beside it"));
    }

    let s = store(&server.url()).await;
    let c = claim(&s, "completed").await;
    assert!(crash_after(&mut server, s.complete(&c, &paid())).await.expect("complete"));
    let found = retry(store(&server.url()).await, "completed").await.expect("begin");
    if !matches!(&found, Begin::Completed(r) if *r == paid()) {
        lost.push(format!("an answer stored by complete: the retry found {found:?}"));
    }

    let s = store(&server.url()).await;
    crash_after(&mut server, async {
        let mut tx = s.pool().begin().await.expect("begin");
        let Begin::New(c) = s.begin_in(&mut tx, "alice", "in-tx", "fp", terms()).await.expect("begin_in") else {
            panic!("a new key")
        };
        assert!(s.complete_in(&mut tx, &c, &paid()).await.expect("complete_in"));
        tx.commit().await.expect("commit");
    })
    .await;
    let found = retry(store(&server.url()).await, "in-tx").await.expect("begin");
    if !matches!(&found, Begin::Completed(r) if *r == paid()) {
        lost.push(format!("an answer committed in the route's transaction: the retry found {found:?}"));
    }
    none_lost(&lost);
}

/// A token issued, one claimed and one spent, each followed by a crash:
/// the issued one can be claimed, the claimed one is still in use, the
/// spent one stays spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issued_claimed_and_spent_tokens_survive_a_crash_under_async_commit() {
    let mut server = PostgresServer::start_with(ASYNC);
    let ttl = Duration::from_secs(300);
    let mut lost = Vec::new();

    let s = store(&server.url()).await;
    let issued = crash_after(&mut server, s.issue_token(None, ttl)).await.expect("issue");
    let s = store(&server.url()).await;
    let issued = match s.claim_token(&issued, None, ttl).await.expect("claim") {
        // Given back, to be claimed again below.
        TokenClaim::Claimed(claimed) => {
            assert!(s.return_token(&claimed).await.expect("give back"));
            issued
        }
        found => {
            lost.push(format!("an issued token: claimed after the crash, {found:?}"));
            // Another, for the steps below: the next crash keeps it (a
            // checkpoint comes first).
            s.issue_token(None, ttl).await.expect("issue")
        }
    };

    let s = store(&server.url()).await;
    let found = crash_after(&mut server, s.claim_token(&issued, None, ttl)).await.expect("claim");
    let TokenClaim::Claimed(claimed) = found else { panic!("a token given back: {found:?}") };
    let s = store(&server.url()).await;
    let claimed = match s.claim_token(&issued, None, ttl).await.expect("claim") {
        TokenClaim::InUse => claimed,
        found => {
            lost.push(format!("a token claimed by a running request: claimed again after the crash, {found:?}"));
            // That claim, for the step below.
            let TokenClaim::Claimed(again) = found else { panic!("unclaimed: {found:?}") };
            again
        }
    };

    let s = store(&server.url()).await;
    assert!(crash_after(&mut server, s.spend_token(&claimed)).await.expect("spend"));
    let s = store(&server.url()).await;
    let found = s.claim_token(&issued, None, ttl).await.expect("claim");
    if found != TokenClaim::Unknown {
        lost.push(format!("a spent token: claimed after the crash, {found:?}"));
    }
    none_lost(&lost);
}

/// Through PgBouncer in transaction mode, which lends a server session per
/// transaction and does not pass a client's startup parameters on: a
/// grant is durable all the same (the setting is pinned in the statement's
/// own transaction). A per-connection setting does not reach the session:
/// `synchronous_commit = on` sent at connect, which the pooler is told to
/// ignore, leaves the session `off`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_transaction_pool_a_grant_is_durable() {
    let mut server = PostgresServer::start_with(ASYNC);
    let ignore = "extra_float_digits, statement_timeout, synchronous_commit";
    let pooler = PgBouncer::start_with(&server, &[("ignore_startup_parameters", ignore)]);
    let per_connection: sqlx::postgres::PgConnectOptions = pooler.url().parse().expect("url");
    let mut conn = sqlx::PgConnection::connect_with(&per_connection.options([("synchronous_commit", "on")]))
        .await
        .expect("connect through the pooler");
    let seen: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut conn).await.expect("show");
    assert_eq!(seen, "off", "a setting sent at connect reached the session through the pooler");
    drop(conn);

    let options = PostgresOptions::default().with_listen_url(server.url());
    let a = PostgresBackend::connect_with(&pooler.url(), "dlock", options.clone()).await.expect("connect");
    let (k, a_owner) = (key("pooled-crash"), Owner::random().expect("owner"));
    let req = request(&k, &a_owner, Duration::from_secs(60));
    let token = crash_after(&mut server, a.acquire(&req, &CancellationToken::new())).await.expect("free");
    let rows = lease_rows(&server, &k, &a_owner);
    let b = PostgresBackend::connect_with(&pooler.url(), "dlock", options).await.expect("connect");
    if let Some(got) = taken_from_a(&b, &k).await {
        panic!(
            "through the pool, A's grant (token {}): after the crash B {got}; A's rows: {rows}",
            token.fencing_token
        );
    }
}
