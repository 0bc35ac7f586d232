//! The behavioural suites on a real PostgreSQL cluster, plus what only
//! PostgreSQL has: a dead or hung server, NOTIFY wake-ups, durable leases
//! and tokens across a restart, the schema made by processes starting at once;
//! and the suites again through PgBouncer in transaction mode (`mod pooled`).

mod suite;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::postgres::{PostgresBackend, PostgresOptions};
use dlock_core::backend::{AcquireRequest, Backend, LockMode, Release, Renewal};
use dlock_core::test_support::postgres_waiters;
use dlock_core::{AcquireOptions, Error, LockKey, Locker, LockerOptions, Owner};
use dlock_testing::{FaultProxy, PgBouncer, PostgresServer};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

struct Postgres {
    /// PgBouncer in transaction mode between the clients and the server,
    /// when the suites run through a pool (`mod pooled`). Dropped before
    /// its server.
    pooler: Option<PgBouncer>,
    server: PostgresServer,
    /// Every backend handed out, to count their parked waiters.
    backends: Mutex<Vec<Arc<PostgresBackend>>>,
}

async fn connect(url: &str) -> Arc<PostgresBackend> {
    Arc::new(PostgresBackend::connect(url, "dlock").await.expect("connect to the test PostgreSQL"))
}

impl Postgres {
    /// A backend of a new client: on the server, or through the pool with
    /// its listener on the server (`LISTEN` needs a session of its own).
    async fn connect(&self) -> Arc<PostgresBackend> {
        let backend = match &self.pooler {
            None => connect(&self.server.url()).await,
            Some(pooler) => {
                let options = PostgresOptions::default().with_listen_url(self.server.url());
                let backend = PostgresBackend::connect_with(&pooler.url(), "dlock", options).await;
                Arc::new(backend.expect("connect through PgBouncer"))
            }
        };
        self.backends.lock().expect("backends").push(backend.clone());
        backend
    }
}

impl suite::Harness for Postgres {
    async fn client(&self) -> Locker {
        let backend = self.connect().await;
        let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
        Locker::with_options(backend as Arc<dyn Backend>, opts).expect("valid options")
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        self.connect().await
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        // The key's head, and its holders when it is held by permits (not
        // what waiters left: owner '~<owner>').
        let k = literal(key.as_str());
        let deleted = self.server.psql(&format!(
            "WITH h AS (DELETE FROM dlock_holders WHERE key = {k} AND left(owner, 1) <> '~' RETURNING 1), \
             l AS (DELETE FROM dlock_locks WHERE key = {k} RETURNING owner) \
             SELECT (SELECT count(*) FROM l WHERE owner <> '') + (SELECT count(*) FROM h)"
        ));
        assert_eq!(deleted, "1", "the key was held");
    }

    async fn lock_keys_left(&self) -> usize {
        live_keys(&self.server)
    }

    async fn parked(&self, key: &LockKey) -> usize {
        self.backends.lock().expect("backends").iter().map(|b| postgres_waiters(b, key)).sum()
    }
}

/// Keys with a holder whose lease has not ended, or a waiter's place: a
/// live exclusive head, or a live shared head with a live holder or
/// place (writers' intents and expired rows hold nothing).
fn live_keys(server: &PostgresServer) -> usize {
    let n = server.psql(
        "SELECT count(*) FROM dlock_locks AS l WHERE l.expires_at > clock_timestamp() AND (l.owner <> '' OR EXISTS \
         (SELECT 1 FROM dlock_holders AS h WHERE h.key = l.key AND h.mode <> 'i' AND h.expires_at > clock_timestamp()))",
    );
    n.parse().expect("a count")
}

/// `text` as an SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

async fn postgres() -> Postgres {
    Postgres { pooler: None, server: PostgresServer::start(), backends: Mutex::new(Vec::new()) }
}

backend_suite!(postgres());
primitives_suite!(postgres());
mod waiters {
    use super::*;
    primitives_suite!(@tests postgres();
        a_writer_that_hangs_up_lets_readers_in,
        a_waiting_semaphore_keeps_its_limit_against_a_newcomer,
    );
}

fn request(key: &LockKey, owner: &Owner, lease_ms: u64) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner.clone(), Duration::from_millis(lease_ms))
}

fn test_key(name: &str) -> LockKey {
    LockKey::builder("dlock", name).part(1).build().expect("key")
}

/// A server that is gone, one that never was, and one that hangs: each is
/// an `Error::Backend` within the response timeout (plus one repeat of an
/// acquire whose answer was lost), never a hang or a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_hung_server_is_a_clean_error_within_a_bound() {
    let mut server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let timeout = Duration::from_millis(500);
    let options = PostgresOptions::default().with_response_timeout(timeout);
    let backend = PostgresBackend::connect_with(&url, "dlock", options.clone()).await.expect("connect");
    let (k, owner) = (test_key("dead"), Owner::random().expect("owner"));
    let cancel = CancellationToken::new();
    let grant = backend.acquire(&request(&k, &owner, 30_000), &cancel).await.expect("free");
    assert!(grant.fencing_token > 0);
    backend.ready().await.expect("ready while up");

    // Hung: every byte waits in the proxy.
    proxy.hold();
    let started = Instant::now();
    let err = backend.acquire(&request(&k, &owner, 30_000), &cancel).await.expect_err("hung server");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(started.elapsed() < 4 * timeout, "bounded: {:?}", started.elapsed());
    let err = backend.ready().await.expect_err("hung server is not ready");
    assert!(err.is_unavailable(), "{err:?}");
    proxy.heal();

    // Gone.
    server.stop();
    let started = Instant::now();
    let err = backend.acquire(&request(&k, &owner, 30_000), &cancel).await.expect_err("stopped server");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(started.elapsed() < 4 * timeout, "bounded: {:?}", started.elapsed());
    let err = backend.renew(&k, &owner, Duration::from_secs(30)).await.expect_err("stopped server");
    assert!(err.is_unavailable(), "{err:?}");
    let err = backend.release(&k, &owner).await.expect_err("stopped server");
    assert!(err.is_unavailable(), "{err:?}");

    // Never there: connecting fails within the bound, naming the variable's server.
    let started = Instant::now();
    let err = PostgresBackend::connect_with(&url, "dlock", options).await.expect_err("nothing listens");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(12), "bounded: {:?}", started.elapsed());
}

/// A waiter of another backend (another process) is woken by the holder's
/// release, long before the holder's lease (30 s) could end: the NOTIFY
/// reached its listener. The release announces itself once: one statement
/// frees the head and announces it (an announcement from a statement that
/// then freed nothing, followed by the release function's own, wakes the
/// waiter too early and costs the handoff a round of refusals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_notify_not_by_the_lease() {
    let h = postgres().await;
    let mut heard = sqlx::postgres::PgListener::connect(&h.server.url()).await.expect("listener");
    heard.listen("dlock_released").await.expect("listen");
    let (a, b) = (suite::Harness::client(&h).await, suite::Harness::client(&h).await);
    let k = a.key("notify").part(1).build().expect("key");
    let holder = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
    let (b2, k2) = (b.clone(), k.clone());
    let waiter = tokio::spawn(async move {
        let opts = AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(20));
        b2.acquire(&k2, opts).await
    });
    suite::until_parked(&h, &k).await;
    // Parked and asleep: nothing wakes it but a release.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    let released_at = Instant::now();
    assert!(holder.release().await.expect("release"));
    let g = waiter.await.expect("waiter task").expect("woken by the release");
    assert!(released_at.elapsed() < Duration::from_secs(2), "woken late: {:?}", released_at.elapsed());
    // Before the waiter's own release (its hold, granted to a waiting
    // acquire, announces its end too).
    let mut announced = 0;
    while let Ok(Ok(Some(n))) = tokio::time::timeout(Duration::from_millis(500), heard.try_recv()).await {
        assert_eq!(n.payload(), k.as_str());
        announced += 1;
    }
    assert_eq!(announced, 1, "one release, announced {announced} times");
    assert!(g.release().await.expect("release"));
}

/// A holder that leaves while a waiter's step waits for the key's head
/// (its release announces nothing: no one had marked it awaited yet) must
/// not strand the waiter until the holder's lease would have ended: the
/// waiter's step, let through, finds the key free. The interleaving is
/// forced with a row lock on the key's head, and a delete of it in that
/// transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_gone_while_a_waiters_step_waits_for_the_head_does_not_strand_it() {
    use sqlx::Connection as _;
    let h = postgres().await;
    let (a, b) = (suite::Harness::client(&h).await, suite::Harness::client(&h).await);
    let k = a.key("race").part(1).build().expect("key");
    let holder = a.acquire(&k, AcquireOptions::new().with_lease(Duration::from_secs(30))).await.expect("free");
    let mut blocker = sqlx::PgConnection::connect(&h.server.url()).await.expect("connect");
    let mut tx = blocker.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM dlock_locks WHERE key = $1 FOR UPDATE")
        .bind(k.as_str())
        .execute(&mut *tx)
        .await
        .expect("lock the holder's row");
    let (b2, k2) = (b.clone(), k.clone());
    let waiter = tokio::spawn(async move {
        let opts = AcquireOptions::new().with_lease(Duration::from_secs(30)).with_wait(Duration::from_secs(10));
        b2.acquire(&k2, opts).await
    });
    // The waiter's step waits for the row lock.
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.server.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") != "1" {
        assert!(Instant::now() < deadline, "the waiter never reached the head");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The holder leaves (as its release would), unannounced.
    sqlx::query("DELETE FROM dlock_locks WHERE key = $1")
        .bind(k.as_str())
        .execute(&mut *tx)
        .await
        .expect("delete the holder's row");
    let left_at = Instant::now();
    tx.commit().await.expect("commit");
    let g = waiter.await.expect("waiter task").expect("the key is free");
    assert!(left_at.elapsed() < Duration::from_secs(2), "stranded: {:?}", left_at.elapsed());
    assert!(!holder.release().await.expect("release"), "its row was gone");
    assert!(g.release().await.expect("release"));
}

/// A holder that never releases (a process that died) keeps the key until
/// its lease ends on the server, then the next gets it, with a greater token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_runs_out_lets_the_next_in() {
    let server = PostgresServer::start();
    let (dead, next) = (connect(&server.url()).await, connect(&server.url()).await);
    let k = test_key("lease-end");
    let cancel = CancellationToken::new();
    let gone = dead.acquire(&request(&k, &Owner::random().expect("owner"), 400), &cancel).await.expect("free");
    let me = Owner::random().expect("owner");
    let err = next.acquire(&request(&k, &me, 30_000), &cancel).await.expect_err("held");
    assert!(err.is_contention(), "{err:?}");
    let started = Instant::now();
    let wait = request(&k, &me, 30_000).with_deadline(Instant::now() + Duration::from_secs(10));
    let grant = next.acquire(&wait, &cancel).await.expect("the lease ran out");
    assert!(started.elapsed() >= Duration::from_millis(250), "too early: {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(3), "too late: {:?}", started.elapsed());
    assert!(grant.fencing_token > gone.fencing_token);
    assert_eq!(next.release(&k, &me).await.expect("release"), Release::Freed);
}

/// Tokens follow the order grants are answered in, even when a first try
/// is held up between drawing its token and writing its row: in life, a
/// wait for a holder's release being written, or a server process
/// descheduled; here, a trigger that waits for an advisory lock the test
/// holds. Another owner that asks while it is held up, exclusive (its own
/// first try) or shared (the acquire function), must not be granted a
/// token above the one the held-up try is granted after it. (Before each
/// grant drew under the key's advisory lock, the other owner came and
/// went in the gap, and the held-up try was granted a smaller token after
/// it: a storage check would have turned a lawful holder away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_try_held_up_after_drawing_its_token_is_not_granted_below_a_later_grant() {
    let server = PostgresServer::start();
    server.psql(
        "CREATE TABLE held_up (owner text PRIMARY KEY); \
         CREATE FUNCTION hold_up() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF EXISTS (SELECT 1 FROM held_up WHERE owner = NEW.owner) THEN PERFORM pg_advisory_xact_lock(42); END IF; \
           RETURN NEW; END $$",
    );
    for (i, mode) in [LockMode::Exclusive, LockMode::Shared].into_iter().enumerate() {
        let answered = held_up_first_try(&server, LockKey::builder("dlock", "held-up").part(i), mode).await;
        assert_eq!(answered.len(), 2, "{mode}: {answered:?}");
        assert!(answered[0].1 < answered[1].1, "{mode}: a later grant has a smaller token: {answered:?}");
    }
    // The control: the first try as it was, its token drawn with no lock
    // on the key, held up the same way, is granted below the other owner
    // who came and went meanwhile. So the gate does reach the gap.
    let (held_up, later) = first_try_without_the_key_lock(&server).await;
    assert!(held_up < later, "the control did not reach the gap: held up {held_up}, later {later}");
}

/// The control of the test above: the tokens of the first try of the
/// earlier build (its `nextval` with no lock on the key), held up by the
/// trigger, and of another owner's first try and release meanwhile.
async fn first_try_without_the_key_lock(server: &PostgresServer) -> (i64, i64) {
    use sqlx::Connection as _;
    const TAKE: &str = "INSERT INTO dlock_locks AS l (key, owner, mode, fence, expires_at) \
        VALUES ($1, $2, 'x', nextval('\"dlock_fence\"'), clock_timestamp() + interval '30 seconds') \
        ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, fence = excluded.fence, \
          expires_at = excluded.expires_at WHERE l.expires_at <= clock_timestamp() \
        RETURNING l.fence";
    let key = "control";
    server.psql("INSERT INTO held_up VALUES ('slow')");
    let gate = Gate::close(server).await;
    let url = server.url();
    let slow = tokio::spawn(async move {
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        let fence: i64 = sqlx::query_scalar(TAKE).bind(key).bind("slow").fetch_one(&mut conn).await.expect("granted");
        fence
    });
    gate.until_waiting(1, || false, "the control's first try never reached the trigger").await;
    let mut fast = sqlx::PgConnection::connect(&server.url()).await.expect("connect");
    let later: i64 = sqlx::query_scalar(TAKE).bind(key).bind("fast").fetch_one(&mut fast).await.expect("granted");
    sqlx::query("DELETE FROM dlock_locks WHERE key = $1 AND owner = 'fast'")
        .bind(key)
        .execute(&mut fast)
        .await
        .expect("release");
    gate.open().await;
    (slow.await.expect("held-up task"), later)
}

/// The trigger's gate: advisory lock 42, held by a session of the test's
/// while it is closed. A held-up first try waits at it, its token drawn.
struct Gate<'a> {
    server: &'a PostgresServer,
    session: sqlx::PgConnection,
}

impl<'a> Gate<'a> {
    async fn close(server: &'a PostgresServer) -> Gate<'a> {
        use sqlx::Connection as _;
        let mut session = sqlx::PgConnection::connect(&server.url()).await.expect("connect");
        sqlx::query("SELECT pg_advisory_lock(42)").execute(&mut session).await.expect("close the gate");
        Gate { server, session }
    }

    /// Returns once `n` sessions wait for an advisory lock (the gate's, or
    /// a key's that a held-up try holds), or `done` says so; fails after
    /// 10 s with `never`.
    async fn until_waiting(&self, n: usize, done: impl Fn() -> bool, never: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let waiting = || self.server.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'");
        while !done() && waiting() != n.to_string() {
            assert!(Instant::now() < deadline, "{never}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn open(mut self) {
        sqlx::query("SELECT pg_advisory_unlock(42)").execute(&mut self.session).await.expect("open the gate");
    }
}

/// A first try at `key` held up after its token is drawn, and another
/// owner asking in `mode` meanwhile: the grants as answered, (who, token).
async fn held_up_first_try(
    server: &PostgresServer,
    key: dlock_core::KeyBuilder,
    mode: LockMode,
) -> Vec<(&'static str, u64)> {
    let options = || PostgresOptions::default().with_response_timeout(Duration::from_secs(10));
    let (slow, fast) = (
        Arc::new(PostgresBackend::connect_with(&server.url(), "dlock", options()).await.expect("connect")),
        Arc::new(PostgresBackend::connect_with(&server.url(), "dlock", options()).await.expect("connect")),
    );
    // Made after the backends made their table.
    server
        .psql("CREATE OR REPLACE TRIGGER hold_up BEFORE INSERT ON dlock_locks FOR EACH ROW EXECUTE FUNCTION hold_up()");
    let k = key.build().expect("key");
    let (slow_owner, fast_owner) = (Owner::random().expect("owner"), Owner::random().expect("owner"));
    server.psql(&format!("INSERT INTO held_up VALUES ({})", literal(slow_owner.as_str())));
    let gate = Gate::close(server).await;
    let answered = Arc::new(Mutex::new(Vec::new()));
    let slow_try = {
        let (slow, k, owner, answered) = (slow.clone(), k.clone(), slow_owner.clone(), answered.clone());
        tokio::spawn(async move {
            let grant = slow.acquire(&request(&k, &owner, 30_000), &CancellationToken::new()).await;
            let token = grant.expect("the held-up try is granted").fencing_token;
            answered.lock().expect("answered").push(("held up", token));
        })
    };
    gate.until_waiting(1, || false, "the first try never reached the trigger").await;
    let other = {
        let (fast, k, owner, answered) = (fast.clone(), k.clone(), fast_owner.clone(), answered.clone());
        tokio::spawn(async move {
            let wait =
                request(&k, &owner, 30_000).with_mode(mode).with_deadline(Instant::now() + Duration::from_secs(10));
            let grant = fast.acquire(&wait, &CancellationToken::new()).await.expect("granted in time");
            answered.lock().expect("answered").push(("other", grant.fencing_token));
            assert_eq!(fast.release(&k, &owner).await.expect("release"), Release::Freed);
        })
    };
    // The other owner either comes and goes in the gap, or waits for the
    // held-up try's token to be written.
    gate.until_waiting(2, || other.is_finished(), "the other owner neither finished nor waited").await;
    gate.open().await;
    slow_try.await.expect("held-up task");
    assert_eq!(slow.release(&k, &slow_owner).await.expect("release"), Release::Freed);
    other.await.expect("other task");

    answered.lock().expect("answered").clone()
}

/// The table and the sequence are durable: a lease taken before a clean
/// stop and before a crash still holds the key afterwards, and every token
/// granted after is greater than every token before. (With the server's
/// default `synchronous_commit` and a crash that keeps what the server had
/// in memory written; the next test crashes a server set to `off` inside
/// the window where that setting loses commits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_fencing_tokens_survive_a_restart_and_a_crash() {
    let server = PostgresServer::start();
    survive_each(server, &[Outage::Stop, Outage::Crash]).await;
}

/// The same with the server set to `synchronous_commit = off` (a common
/// throughput setting, which answers a commit before its WAL is written)
/// and a crash of the machine inside that window: the WAL writers are held
/// while the leases are taken and the tokens drawn, and killed after
/// (`crash_losing_unwritten_wal`), so what dlock's commits did not write
/// themselves is lost every time. Without the durability pin (durable.rs)
/// this fails: the lease taken in the window is gone and another client is
/// granted its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_fencing_tokens_survive_an_os_crash_with_asynchronous_commit() {
    let server = PostgresServer::start_with(&[("synchronous_commit", "off")]);
    // The tables dlock made at connect, on disk before the first hold.
    connect(&server.url()).await;
    server.psql("CHECKPOINT");
    survive_each(server, &[Outage::CrashLosingUnwrittenWal, Outage::CrashLosingUnwrittenWal]).await;
}

/// How the server goes down in [`survive_each`].
#[derive(Clone, Copy, Debug)]
enum Outage {
    /// `pg_ctl stop -m fast`, then start.
    Stop,
    /// `pg_ctl stop -m immediate` (what the server wrote stays), then start.
    Crash,
    /// The WAL writers held from before the round's steps, then killed: a
    /// crash of the machine, losing what commits left unwritten.
    CrashLosingUnwrittenWal,
}

/// One round per outage: a holder takes a key of its own with a long lease
/// and five cycles draw tokens on another, then the server goes down and
/// comes back; a fresh backend (a restarted process) must be refused every
/// key held so far and granted tokens above every earlier one. At the end
/// the first backend, whose connections died with the server, renews and
/// releases every hold.
async fn survive_each(mut server: PostgresServer, outages: &[Outage]) {
    let backend = connect(&server.url()).await;
    let cancel = CancellationToken::new();
    let other = test_key("restart-free");
    let holder = Owner::random().expect("owner");
    let mut held = Vec::new();
    let mut last = 0;
    for (round, &outage) in outages.iter().enumerate() {
        if let Outage::CrashLosingUnwrittenWal = outage {
            server.hold_wal_writes();
        }
        let key = test_key(&format!("restart-held-{round}"));
        let t = backend.acquire(&request(&key, &holder, 60_000), &cancel).await.expect("free").fencing_token;
        assert!(t > last, "{t} after {last}");
        last = t;
        held.push(key);
        let owner = Owner::random().expect("owner");
        for _ in 0..5 {
            let t = backend.acquire(&request(&other, &owner, 30_000), &cancel).await.expect("free").fencing_token;
            assert!(t > last, "{t} after {last}");
            last = t;
            assert_eq!(backend.release(&other, &owner).await.expect("release"), Release::Freed);
        }
        match outage {
            Outage::Stop => server.stop(),
            Outage::Crash => server.crash(),
            Outage::CrashLosingUnwrittenWal => server.crash_losing_unwritten_wal(),
        }
        server.start_again();
        // A fresh backend, as a restarted process would have.
        let after = connect(&server.url()).await;
        for key in &held {
            match after.acquire(&request(key, &owner, 30_000), &cancel).await {
                Err(e) => assert!(e.is_contention(), "{key}: {e:?}"),
                Ok(grant) => panic!(
                    "{key}, held across the {outage:?}, was granted to another client with token {} (last before: \
                     {last})",
                    grant.fencing_token
                ),
            }
        }
        let t = after.acquire(&request(&other, &owner, 30_000), &cancel).await.expect("free").fencing_token;
        assert!(t > last, "token {t} after the {outage:?}, {last} before");
        last = t;
        assert_eq!(after.release(&other, &owner).await.expect("release"), Release::Freed);
    }
    // The first backend's connections died with the server; it recovers.
    for key in &held {
        let renewed = backend.renew(key, &holder, Duration::from_secs(60)).await.expect("renew after the restarts");
        assert!(matches!(renewed, Renewal::Held { .. }), "{renewed:?}");
        assert_eq!(backend.release(key, &holder).await.expect("release"), Release::Freed);
    }
}

/// A waiting permit's place keeps the semaphore's limit until its wait
/// would have ended, and no longer: a waiter whose process died (here an
/// acquire dropped past the engine, which sends no withdrawal) fixes the
/// limit for the rest of its wait, against another limit and the key
/// asked exclusive; then the key is free for any limit. A permit that
/// waits for a key held exclusive keeps no place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_nobody_withdraws_ends_with_its_wait() {
    let server = PostgresServer::start();
    let backend = connect(&server.url()).await;
    let cancel = CancellationToken::new();
    let k = test_key("sem-place");
    let owners: Vec<Owner> = (0..4).map(|_| Owner::random().expect("owner")).collect();
    let two = |o: &Owner| request(&k, o, 30_000).with_mode(LockMode::permits(2));
    let places = || server.psql("SELECT count(*) FROM dlock_holders WHERE left(owner, 1) = '~'");
    let awaited = || server.psql(&format!("SELECT awaited FROM dlock_locks WHERE key = {}", literal(k.as_str())));
    for o in &owners[..2] {
        backend.acquire(&two(o), &cancel).await.expect("a free permit");
    }
    let wait = Duration::from_secs(3);
    let started = Instant::now();
    vanish_once(&backend, &two(&owners[2]).with_deadline(started + wait), || places() == "1").await;
    for o in &owners[..2] {
        assert_eq!(backend.release(&k, o).await.expect("release"), Release::Freed);
    }
    let three = request(&k, &owners[3], 30_000).with_mode(LockMode::permits(3));
    let exclusive = request(&k, &owners[3], 30_000);
    for (req, what) in [(&three, "3 permits"), (&exclusive, "exclusive")] {
        match backend.acquire(req, &cancel).await {
            Err(Error::ModeConflict { reason, .. }) => assert!(reason.contains("2 permits"), "{reason}"),
            other => panic!("{what} while a place for one of 2 lives ({:?} of its wait): {other:?}", started.elapsed()),
        }
    }
    // The place ends when its wait does on the server's clock, counted
    // from when its try ran there: a try held up in flight on a loaded
    // machine ends it that much later.
    tokio::time::sleep_until(started + wait + Duration::from_millis(250)).await;
    backend.acquire(&three, &cancel).await.expect("the place ended with its wait: a new limit");
    assert_eq!(backend.release(&k, &owners[3]).await.expect("release"), Release::Freed);

    backend.acquire(&exclusive, &cancel).await.expect("free");
    // Its try after parking marks the head awaited.
    let waiting = two(&owners[2]).with_deadline(Instant::now() + Duration::from_secs(5));
    vanish_once(&backend, &waiting, || awaited() == "t").await;
    assert_eq!(places(), "0", "a permit waiting for an exclusive hold keeps no place");
    assert_eq!(backend.release(&k, &owners[3]).await.expect("release"), Release::Freed);
    assert_eq!(live_keys(&server), 0);
}

/// Runs `req` on `backend` until `seen` says its tries have landed, then
/// drops it mid-wait, past the engine: as a process that died would, it
/// withdraws nothing.
async fn vanish_once(backend: &PostgresBackend, req: &AcquireRequest, seen: impl Fn() -> bool) {
    let cancel = CancellationToken::new();
    let acquire = backend.acquire(req, &cancel);
    tokio::pin!(acquire);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen() {
        tokio::select! {
            r = &mut acquire => panic!("the waiter stopped waiting: {r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
        assert!(Instant::now() < deadline, "the waiter's tries never landed");
    }
}

/// Renew and release check the owner, in every mode: another owner's are
/// refused and leave the hold as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_and_release_by_another_owner_are_refused() {
    let server = PostgresServer::start();
    let backend = connect(&server.url()).await;
    let cancel = CancellationToken::new();
    for (i, mode) in [LockMode::Exclusive, LockMode::Shared, LockMode::permits(2)].into_iter().enumerate() {
        let k = LockKey::builder("dlock", "owners").part(i).build().expect("key");
        let (mine, theirs) = (Owner::random().expect("owner"), Owner::random().expect("owner"));
        let req = request(&k, &mine, 2_000).with_mode(mode);
        backend.acquire(&req, &cancel).await.expect("free");
        assert_eq!(backend.renew(&k, &theirs, Duration::from_secs(60)).await.expect("renew"), Renewal::Lost, "{mode}");
        assert_eq!(backend.release(&k, &theirs).await.expect("release"), Release::NotHeld, "{mode}");
        let expires = server.psql(&format!(
            "SELECT expires_at < clock_timestamp() + interval '10 seconds' FROM dlock_locks WHERE key = {}",
            literal(k.as_str())
        ));
        assert_eq!(expires, "t", "{mode}: another owner's renewal extended the lease");
        assert!(matches!(backend.renew(&k, &mine, Duration::from_secs(2)).await.expect("renew"), Renewal::Held { .. }));
        assert_eq!(backend.release(&k, &mine).await.expect("release"), Release::Freed, "{mode}");
    }
    assert_eq!(live_keys(&server), 0);
}

/// Processes that start at once on an empty database all create (or find)
/// the table, the sequence and the functions: none fails its start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_starting_at_once_all_find_the_schema() {
    let server = PostgresServer::start();
    let mut starts = Vec::new();
    for _ in 0..6 {
        let url = server.url();
        starts.push(tokio::spawn(async move { PostgresBackend::connect(&url, "race").await.map(|_| ()) }));
    }
    for start in starts {
        start.await.expect("task").expect("start-up despite the others");
    }
    assert_eq!(server.psql("SELECT count(*) FROM pg_proc WHERE proname LIKE 'race\\_%'"), "3");
}

/// `DLOCK_BACKEND=postgres` with `DLOCK_POSTGRES_URL` builds a locker on
/// this backend, and keeps idempotency records in the same database
/// (shared by every instance, not each process's own); a URL that does not
/// parse names the variable and hides the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_names_the_backend() {
    let server = PostgresServer::start();
    let url = server.url();
    let config = dlock_core::Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("postgres".into()),
        "DLOCK_POSTGRES_URL" => Some(url.clone()),
        _ => None,
    })
    .expect("valid configuration");
    let dlock = config.build().await.expect("connect");
    assert_eq!(dlock.locker().backend_name(), "postgres");
    let records = dlock.idempotency_store().expect("records in the lock database");
    assert_eq!(records.name(), "postgres");
    let token = records.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    let live = server.psql(&format!("SELECT count(*) FROM dlock_idem_tokens WHERE token = '{token}'"));
    assert_eq!(live, "1", "kept in the database, where another instance finds it");
    let k = dlock.locker().key("env").part(1).build().expect("key");
    dlock.locker().try_acquire(&k).await.expect("free").release().await.expect("release");

    let bad = dlock_core::Config::from_lookup(|var| match var {
        "DLOCK_BACKEND" => Some("postgres".into()),
        "DLOCK_POSTGRES_URL" => Some("postgres://app:s3cret@127.0.0.1:notaport/db".into()),
        _ => None,
    })
    .expect("read without I/O");
    let err = bad.build().await.expect_err("a URL that does not parse");
    let text = err.to_string();
    assert!(matches!(err, Error::Config { var: "DLOCK_POSTGRES_URL", .. }), "{err:?}");
    assert!(!text.contains("s3cret"), "{text}");
}

/// Starting logs no notices (issue 37): the DDL that makes the lock
/// table, the idempotency tables and the fences table when missing tells
/// of every object it finds made (`… already exists, skipping`), and of
/// the index an earlier build made that it drops when there (`index
/// "dlock_idem_keys_pending" does not exist, skipping`); sqlx logged each
/// at INFO, at every start of every process. The first start and the
/// next, on the same database.
#[tokio::test]
async fn a_start_logs_no_notices() {
    let server = PostgresServer::start();
    let (logs, _guard) = dlock_testing::capture_logs();
    for _ in 0..2 {
        let backend = PostgresBackend::connect(&server.url(), "dlock").await.expect("connect");
        let store = dlock_core::idempotency::PostgresStore::from_backend(&backend).await.expect("store");
        dlock_core::fence::postgres::Fences::new("dlock").expect("prefix").create(store.pool()).await.expect("fences");
    }
    let notices: Vec<String> =
        logs.take_lines().into_iter().filter(|line| line.contains("sqlx::postgres::notice")).collect();
    assert!(notices.is_empty(), "{notices:#?}");
}

/// A lock table left by an earlier dlock, keyed on `(key, owner)`, is
/// refused at connect with an error naming it, not at every acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_table_of_an_earlier_shape_is_refused_at_connect() {
    let server = PostgresServer::start();
    server.psql(
        "CREATE TABLE old_locks (key text NOT NULL, owner text NOT NULL, mode text NOT NULL, fence bigint NOT NULL, \
         expires_at timestamptz NOT NULL, awaited boolean NOT NULL DEFAULT false, PRIMARY KEY (key, owner))",
    );
    let err = PostgresBackend::connect(&server.url(), "old").await.expect_err("an old table");
    let message = err.to_string();
    assert!(message.contains("DLOCK_PREFIX") && message.contains("\"old_locks\""), "{message}");
    PostgresBackend::connect(&server.url(), "new").await.expect("a fresh prefix");
}

/// Requests go to the URL, the listener where `with_listen_url` says (the
/// server, when the URL is a transaction-mode pooler that would lose
/// `LISTEN`). A waiter whose backend listens on the lock database is woken
/// by the release; one that listens on another database, where no
/// announcement arrives (as on a pooler's lent session), only when the
/// holder's lease ends: so the listen URL is the one listened on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_listens_where_its_url_says() {
    let server = PostgresServer::start();
    server.psql("CREATE DATABASE elsewhere");
    let url = server.url();
    let same = format!("postgres://postgres@localhost:{}/postgres", server.port());
    let elsewhere = format!("postgres://postgres@127.0.0.1:{}/elsewhere", server.port());
    let holder = connect(&url).await;
    let cancel = CancellationToken::new();
    for (i, (listen, heard)) in [(same, true), (elsewhere, false)].into_iter().enumerate() {
        let options = PostgresOptions::default().with_listen_url(listen.as_str());
        let waiter = Arc::new(PostgresBackend::connect_with(&url, "dlock", options).await.expect("connect"));
        let k = test_key(&format!("listen-{i}"));
        let owner = Owner::random().expect("owner");
        let granted = Instant::now();
        holder.acquire(&request(&k, &owner, 2_000), &cancel).await.expect("free");
        let (w, k2) = (waiter.clone(), k.clone());
        let waiting = tokio::spawn(async move {
            let me = Owner::random().expect("owner");
            let req = request(&k2, &me, 30_000).with_deadline(Instant::now() + Duration::from_secs(10));
            w.acquire(&req, &CancellationToken::new()).await.map(|_| me)
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while postgres_waiters(&waiter, &k) == 0 {
            assert!(Instant::now() < deadline, "{listen}: the waiter never parked");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Registered, then its try that follows: asleep after that, when
        // nothing wakes it but an announcement or the lease's end (a release
        // before that try would let it in at once, heard or not).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = Instant::now();
        assert_eq!(holder.release(&k, &owner).await.expect("release"), Release::Freed);
        let me = waiting.await.expect("task").expect("the key came free");
        let took = released.elapsed();
        if heard {
            assert!(took < Duration::from_millis(800), "{listen}: woken late, {took:?}");
        } else {
            assert!(granted.elapsed() >= Duration::from_millis(1_900), "{listen}: woken before the lease ended");
        }
        assert_eq!(waiter.release(&k, &me).await.expect("release"), Release::Freed);
    }
    let err = PostgresBackend::connect_with(&url, "dlock", PostgresOptions::default().with_listen_url("not a url"))
        .await
        .expect_err("not a PostgreSQL URL");
    assert!(err.to_string().contains("DLOCK_POSTGRES_LISTEN_URL"), "{err}");
}

/// TLS (feature `tls`): a cluster that refuses plain connections is
/// reached with `sslmode=verify-full` and the CA that signed its
/// certificate, and a lock taken and freed through it. Trusting another CA
/// fails at connect, and so does asking for no TLS.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_over_tls_verifies_the_server() {
    let certs = dlock_testing::TestCertificates::generate();
    let server = PostgresServer::start_tls(&certs);
    let base = server.url();
    let url = format!("{base}?sslmode=verify-full&sslrootcert={}", certs.ca_cert().display());
    let backend = connect(&url).await;
    let cancel = CancellationToken::new();
    let (k, owner) = (test_key("tls"), Owner::random().expect("owner"));
    backend.acquire(&request(&k, &owner, 5_000), &cancel).await.expect("free");
    assert_eq!(backend.release(&k, &owner).await.expect("release"), Release::Freed);

    let untrusted = format!("{base}?sslmode=verify-full&sslrootcert={}", certs.other_ca_cert().display());
    let err = PostgresBackend::connect(&untrusted, "dlock").await.expect_err("a server signed by another CA");
    assert!(err.to_string().contains("certificate"), "{err}");
    let plain = format!("{base}?sslmode=disable");
    let err = PostgresBackend::connect(&plain, "dlock").await.expect_err("refused without TLS");
    assert!(err.to_string().contains("no encryption"), "{err}");
}

/// The PostgreSQL backend behind PgBouncer in transaction mode, the pooler
/// most PostgreSQL services run: every statement of a client may go to any
/// of the pool's few server connections, and a session lent between
/// statements belongs to someone else next. The lease table's promise is
/// that every step is one transaction, so nothing strands on a lent
/// session; these are the behavioural suites run through such a pool (the
/// listener on the server's own URL, as the docs say), and the conditions
/// the docs name, each shown failing without its setting.
mod pooled {
    use super::*;

    async fn pooled() -> Postgres {
        let server = PostgresServer::start();
        let pooler = PgBouncer::start(&server);
        Postgres { pooler: Some(pooler), server, backends: Mutex::new(Vec::new()) }
    }

    backend_suite!(pooled());

    mod primitives {
        use super::*;
        primitives_suite!(@tests pooled();
            readers_share_and_exclude_a_writer,
            a_waiting_writer_is_not_starved_by_new_readers,
            a_writer_that_hangs_up_lets_readers_in,
            readers_and_writers_never_overlap,
            a_multi_key_lock_takes_all_or_none,
            a_semaphore_admits_its_limit_and_wakes_a_waiter,
            never_more_than_the_limit_under_contention,
        );
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
                    match backend.acquire(&request(&key, &owner, 30_000), &cancel).await {
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
            let taken: bool =
                sqlx::query_scalar("SELECT pg_try_advisory_lock(42)").fetch_one(&mut a).await.expect("lock");
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
}

/// A lock cycle is its two statements' round trips and no more: the
/// connection a request used is kept for the next one, not given back to
/// sqlx's pool, which tests each connection given back with a round trip
/// of its own before it lends it again. Made visible by a proxy that holds
/// every answer 40 ms, on a pool of one connection (the listener has its
/// own URL): 8 cycles take 16 answers, 640 ms, kept; through the pool each
/// statement waits for the test of the one before, 32 answers, 1,280 ms
/// (seen, with the connection given back after each request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cycle_costs_its_two_round_trips_on_a_kept_connection() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let options = PostgresOptions::default().with_max_connections(1).with_listen_url(server.url());
    let backend = PostgresBackend::connect_with(&url, "dlock", options).await.expect("connect");
    let (k, cancel) = (test_key("round-trips"), CancellationToken::new());
    let cycle = || async {
        let owner = Owner::random().expect("owner");
        backend.acquire(&request(&k, &owner, 30_000), &cancel).await.expect("free");
        assert_eq!(backend.release(&k, &owner).await.expect("release"), Release::Freed);
    };
    cycle().await; // The statements are prepared on the connection.
    let answer = Duration::from_millis(40);
    proxy.set_delay(answer);
    let started = Instant::now();
    for _ in 0..8 {
        cycle().await;
    }
    let took = started.elapsed();
    assert!(took >= 16 * answer, "every answer was held: {took:?}");
    assert!(took < 24 * answer, "more than the statements' round trips: {took:?} for 16 answers of {answer:?}");
}
