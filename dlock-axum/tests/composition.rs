//! Issue 37: dlock's layers composed as a user writes them, over real
//! sockets (`axum::serve`), because what goes wrong is hyper dropping a
//! request's future when its client hangs up.
//!
//! * A lock outside an idempotency layer covers the detached route through
//!   a hang-up: the next request on the same account waits for its write.
//! * A lock inside an in-transaction idempotency layer (a `LockLayer` or
//!   `#[lockable]`) lasts until the transaction has committed.
//! * A hang-up while the route's transaction is being begun leaves no
//!   transaction open on the application's pool.
//! * A multi-key route sees every key's fencing token (`HeldLocks`).
//! * A hang-up while a claim is on its way to the store leaves the key (or
//!   the one-time token) free for its retry (issue 38 item 3).

use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use dlock_axum::idempotency::{IdempotencyLayer, TokenLayer, Tx};
use dlock_axum::{lockable, Caller, DlockExt, FencingToken, HeldLocks, LockLayer};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore, PostgresStore, RedisStore};
use dlock_core::{Locker, MemoryBackend};
use dlock_testing::{FaultProxy, PostgresServer, RedisServer};
use serde_json::{json, Value};

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn request(path: &str, key: Option<&str>, body: &str) -> String {
    let key = key.map(|k| format!("idempotency-key: {k}\r\n")).unwrap_or_default();
    format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nx-user: alice\r\ncontent-type: application/json\r\n{key}\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `req`, waits `after`, and closes the socket without reading.
async fn hang_up(addr: SocketAddr, req: String, after: Duration) {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(req.as_bytes()).expect("write");
        std::thread::sleep(after);
        drop(s);
    })
    .await
    .expect("the hang-up thread");
}

/// Sends `req` and reads the whole answer, lower-cased.
async fn send(addr: SocketAddr, req: String) -> String {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        s.write_all(req.as_bytes()).expect("write");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        answer.to_ascii_lowercase()
    })
    .await
    .expect("the client thread")
}

fn status(answer: &str) -> &str {
    answer.get(9..12).unwrap_or("")
}

/// A balance read, then written after a gap: the lost update a lock exists
/// to prevent, made easy to hit.
#[derive(Clone, Default)]
struct Account {
    balance: Arc<AtomicI64>,
    runs: Arc<AtomicUsize>,
}

impl Account {
    async fn debit(&self, amount: i64, gap: Duration) {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let read = self.balance.load(Ordering::SeqCst);
        tokio::time::sleep(gap).await;
        self.balance.store(read - amount, Ordering::SeqCst);
    }
}

/// W1: `LockLayer` outside `IdempotencyLayer`. The client of the first
/// debit hangs up while its route sleeps between its read and its write;
/// the second debit (another key, the same account) must wait for that
/// write, not read the balance under it. The hung-up key's retry, sent
/// while its route still runs, waits on the lock and gets the stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_outside_the_idempotency_layer_covers_its_detached_route_through_a_hang_up() {
    let (account, other, retry) = hang_up_then_debit(true).await;
    assert_eq!(status(&other), "201", "{other}");
    assert_eq!(status(&retry), "201", "{retry}");
    assert!(retry.contains("idempotent-replayed: true"), "the retry waited on the lock, then replayed: {retry}");
    assert_eq!(account.runs.load(Ordering::SeqCst), 2, "k1 once, k2 once");
    assert_eq!(account.balance.load(Ordering::SeqCst), 980, "both debits landed: neither read under the other");
}

/// The control: the same requests with no lock lose k1's debit, so the
/// test above reaches the gap it says it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_lock_the_same_hang_up_loses_a_debit() {
    let (account, _, _) = hang_up_then_debit(false).await;
    assert_eq!(account.runs.load(Ordering::SeqCst), 2);
    assert_eq!(account.balance.load(Ordering::SeqCst), 990, "k2 read under k1's gap and overwrote it");
}

/// k1 hangs up at 50 ms into its 300 ms gap; k1's retry and k2 come at
/// 50 and 100 ms. The account, k2's answer and the retry's.
async fn hang_up_then_debit(locked: bool) -> (Account, String, String) {
    let account = Account::default();
    account.balance.store(1000, Ordering::SeqCst);
    let a = account.clone();
    let route = move || {
        let a = a.clone();
        async move {
            a.debit(10, Duration::from_millis(300)).await;
            (StatusCode::CREATED, "debited")
        }
    };
    let idempotency = IdempotencyLayer::new().store(Arc::new(MemoryStore::new())).caller(Caller::header("x-user"));
    let route = post(route).layer::<_, Infallible>(idempotency);
    let route = match locked {
        true => route.layer(LockLayer::new("account").json("account").wait(Duration::from_secs(5))),
        false => route,
    };
    let app = Router::new().route("/debit", route);
    let addr = serve(app.with_dlock(Locker::new(MemoryBackend::new()))).await;
    let body = r#"{"account": 1}"#;

    hang_up(addr, request("/debit", Some("k1"), body), Duration::from_millis(50)).await;
    let retry = tokio::spawn(send(addr, request("/debit", Some("k1"), body)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let other = send(addr, request("/debit", Some("k2"), body)).await;
    let retry = retry.await.expect("the retry");
    // Whatever the answers, every route has ended.
    tokio::time::sleep(Duration::from_millis(400)).await;
    (account, other, retry)
}

/// The application's tables: one account, and the rows every debit wrote.
fn create_tables(server: &PostgresServer) {
    server.psql(
        "CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, balance bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS ledger (id serial PRIMARY KEY, account int NOT NULL, amount bigint NOT NULL);
         INSERT INTO accounts VALUES (1, 1000) ON CONFLICT (id) DO UPDATE SET balance = 1000;
         TRUNCATE ledger;",
    );
}

/// A read-modify-write in the route's transaction: no `FOR UPDATE`, the
/// dlock lock is what orders the debits.
async fn debit_in(tx: &mut Tx, gap: Duration) {
    let (balance,): (i64,) =
        sqlx::query_as("SELECT balance FROM accounts WHERE id = 1").fetch_one(&mut **tx).await.expect("read");
    tokio::time::sleep(gap).await;
    sqlx::query("UPDATE accounts SET balance = $1 WHERE id = 1")
        .bind(balance - 1)
        .execute(&mut **tx)
        .await
        .expect("write");
    sqlx::query("INSERT INTO ledger (account, amount) VALUES (1, -1)").execute(&mut **tx).await.expect("ledger");
}

/// Sends `n` debits from 8 concurrent clients, each with its own key, and
/// checks the balance against the ledger.
async fn debits_match_the_ledger(server: &PostgresServer, addr: SocketAddr, path: &str, n: usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let next = next.clone();
            let path = path.to_owned();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        return;
                    }
                    let answer = send(addr, request(&path, Some(&format!("d{i}")), "{}")).await;
                    assert_eq!(status(&answer), "201", "{answer}");
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("a client");
    }
    let balance = server.psql("SELECT balance FROM accounts WHERE id = 1");
    let ledger = server.psql("SELECT 1000 + coalesce(sum(amount), 0) FROM ledger");
    assert_eq!(
        (balance.as_str(), ledger.as_str()),
        (format!("{}", 1000 - n).as_str(), format!("{}", 1000 - n).as_str())
    );
}

/// W2: `IdempotencyLayer::in_transaction` outside, `LockLayer` inside. The
/// lock must last until the route's transaction commits: released when the
/// handler returns, the next holder reads the balance from before that
/// commit and the debits overwrite each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_inside_an_in_transaction_layer_lasts_until_the_commit() {
    let server = PostgresServer::start();
    create_tables(&server);
    let store = PostgresStore::connect(&server.url(), "w2").await.expect("connect");
    let route = |mut tx: Tx| async move {
        debit_in(&mut tx, Duration::ZERO).await;
        (StatusCode::CREATED, "debited")
    };
    let lock = LockLayer::new("account").wait(Duration::from_secs(10));
    let idempotency = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(store);
    let app = Router::new().route("/debit", post(route).layer::<_, Infallible>(lock).layer(idempotency));
    let addr = serve(app.with_dlock(Locker::new(MemoryBackend::new()))).await;
    debits_match_the_ledger(&server, addr, "/debit", 120).await;
}

#[lockable(key = "account", wait_ms = 10000)]
async fn lockable_debit(mut tx: Tx) -> (StatusCode, &'static str) {
    debit_in(&mut tx, Duration::ZERO).await;
    (StatusCode::CREATED, "debited")
}

/// The same for `#[lockable]` inside an in-transaction layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lockable_route_inside_an_in_transaction_layer_holds_its_lock_until_the_commit() {
    let server = PostgresServer::start();
    create_tables(&server);
    let store = PostgresStore::connect(&server.url(), "w2m").await.expect("connect");
    let idempotency = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(store);
    let app = Router::new().route("/debit", post(lockable_debit).layer(idempotency));
    let addr = serve(app.with_dlock(Locker::new(MemoryBackend::new()))).await;
    debits_match_the_ledger(&server, addr, "/debit", 120).await;
}

/// W4: hundreds of clients hang up at 1–20 ms on an in-transaction route
/// whose store is on the application's own pool, behind a network whose
/// answers take 10 ms (so many hang-ups land while a `BEGIN` is on its
/// way). No connection stays `idle in transaction`, and an autocommit write
/// on that pool afterwards is visible to another session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hang_ups_leave_no_transaction_open_on_the_applications_pool() {
    let server = PostgresServer::start();
    create_tables(&server);
    let proxy = FaultProxy::start(server.port());
    // Every connection the pool lends is asked whether it is inside a
    // transaction already: one is a transaction left open by a cut `BEGIN`
    // (inside one, `now()` is its start, earlier than the statement's).
    let lent_in_a_transaction = Arc::new(AtomicUsize::new(0));
    let seen = lent_in_a_transaction.clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .before_acquire(move |conn, _| {
            let seen = seen.clone();
            Box::pin(async move {
                // A simple query (one protocol message): in autocommit, its
                // statement and its transaction start together.
                let row = sqlx::Executor::fetch_one(conn, "SELECT now() <> statement_timestamp()").await?;
                let open: bool = sqlx::Row::try_get(&row, 0)?;
                if open {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                Ok(true)
            })
        })
        .connect(&format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port()))
        .await
        .expect("the application's pool");
    let store = PostgresStore::with_pool(pool.clone(), "w4").await.expect("store");
    // Credits commute: no lock is needed for them to add up.
    let route = |mut tx: Tx| async move {
        sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = 1").execute(&mut *tx).await.expect("write");
        sqlx::query("INSERT INTO ledger (account, amount) VALUES (1, 1)").execute(&mut *tx).await.expect("ledger");
        (StatusCode::CREATED, "credited")
    };
    // No lock: the requests crowd the pool, so many are cut while their
    // `BEGIN` is on its way, the window sqlx 0.8 does not survive.
    let idempotency = IdempotencyLayer::new().caller(Caller::header("x-user")).in_transaction(store);
    let app = Router::new().route("/credit", post(route).layer(idempotency));
    let addr = serve(app).await;
    proxy.set_delay(Duration::from_millis(10));
    // Four at a time, as many as the pool has connections: each request
    // gets one at once, and its hang-up (1–30 ms) lands anywhere in its
    // first round trips, its `BEGIN`'s among them.
    for wave in 0..75 {
        let hang_ups: Vec<_> = (0..4)
            .map(|i| {
                let after = Duration::from_millis(1 + (wave * 4 + i) * 7 % 30);
                tokio::spawn(hang_up(addr, request("/credit", Some(&format!("h{wave}-{i}")), "{}"), after))
            })
            .collect();
        for h in hang_ups {
            h.await.expect("a hang-up");
        }
    }
    proxy.set_delay(Duration::ZERO);
    // Every route that started ends; then nothing is left open.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let open = server.psql("SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'");
        let active =
            server.psql("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid()");
        if open == "0" && active == "0" {
            break;
        }
        assert!(Instant::now() < deadline, "{open} connections idle in transaction, {active} active");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lent_in_a_transaction.load(Ordering::SeqCst), 0, "connections lent inside a transaction left open");
    // Each of the pool's connections takes an autocommit write; another
    // session sees every one.
    for i in 0..8 {
        sqlx::query("INSERT INTO ledger (account, amount) VALUES (2, $1)").bind(i).execute(&pool).await.expect("write");
    }
    assert_eq!(server.psql("SELECT count(*) FROM ledger WHERE account = 2"), "8");
    let balance = server.psql("SELECT balance FROM accounts WHERE id = 1");
    let ledger = server.psql("SELECT 1000 + coalesce(sum(amount), 0) FROM ledger WHERE account = 1");
    assert_eq!(balance, ledger, "every debit that committed is in the ledger, and none other");
}

/// W3: a route holding two keys sees each key's own fencing token, and
/// `FencingToken` stays the first declared key's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_key_route_sees_every_keys_fencing_token() {
    let route = |locks: HeldLocks, FencingToken(first): FencingToken, Json(t): Json<Value>| async move {
        let from = locks.token("account", t["from"].as_u64().unwrap_or_default()).map(|t| t.0);
        let to = locks.token("account", t["to"].as_u64().unwrap_or_default()).map(|t| t.0);
        Json(json!({ "from": from, "to": to, "first": first, "held": locks.len() }))
    };
    let locker = Locker::new(MemoryBackend::new());
    // Draw tokens on account 2 first, so its token and account 1's differ.
    for _ in 0..3 {
        let key = locker.key("account").part(2).build().expect("key");
        locker.acquire(&key, Default::default()).await.expect("take").release().await.expect("release");
    }
    let lock = LockLayer::new("account").json("from").also("account").json("to");
    let app = Router::new().route("/transfer", post(route).layer(lock));
    let addr = serve(app.with_dlock(locker)).await;
    let answer = send(addr, request("/transfer", None, r#"{"from": 2, "to": 1}"#)).await;
    assert_eq!(status(&answer), "200", "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or_default()).expect("json");
    let (from, to) = (body["from"].as_u64().expect("from's token"), body["to"].as_u64().expect("to's token"));
    assert_ne!(from, to, "each key has its own token: {body}");
    assert_eq!(body["first"].as_u64(), Some(from), "FencingToken is the first declared key's: {body}");
    assert_eq!(body["held"], 2);
}

/// The route of the claim-in-flight tests: counts its runs.
fn counted(runs: Arc<AtomicUsize>) -> impl Fn() -> std::future::Ready<(StatusCode, &'static str)> + Clone {
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready((StatusCode::CREATED, "paid"))
    }
}

/// Issue 38 item 3: a client hangs up while its claim is on its way to a
/// store that answers late. The claim is settled all the same: the key's
/// retry runs the route (once), and a one-time token is still good.
async fn a_claim_in_flight_is_settled(store: Arc<dyn IdempotencyStore>, slow: impl Fn(bool)) {
    let runs = Arc::new(AtomicUsize::new(0));
    let token = store.issue_token(None, Duration::from_secs(60)).await.expect("a token");
    let app = Router::new()
        .route(
            "/pay",
            post(counted(runs.clone()))
                .layer(IdempotencyLayer::new().store(store.clone()).caller(Caller::header("x-user"))),
        )
        .route(
            "/submit",
            post(counted(runs.clone())).layer(TokenLayer::new().store(store.clone()).query_param("token")),
        );
    let addr = serve(app).await;
    slow(true);
    hang_up(addr, request("/pay", Some("k1"), "{}"), Duration::from_millis(30)).await;
    let submit = format!("/submit?token={token}");
    hang_up(addr, request(&submit, None, "{}"), Duration::from_millis(30)).await;
    // The claims land and are answered; the requests are gone by then.
    tokio::time::sleep(Duration::from_millis(300)).await;
    slow(false);
    // Settling is quick once the store answers: well within the claim's
    // lease (10 s), after which a stranded claim would answer "outcome
    // unknown" instead.
    let settled = |path: String, key: Option<&'static str>| async move {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let answer = send(addr, request(&path, key, "{}")).await;
            if !answer.contains("in_progress") || Instant::now() > deadline {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let retry = settled("/pay".into(), Some("k1")).await;
    assert_eq!(status(&retry), "201", "the key was freed, its retry runs: {retry:?}");
    assert!(!retry.contains("idempotent-replayed"), "{retry}");
    let resubmit = settled(submit, None).await;
    assert_eq!(status(&resubmit), "201", "the token was given back: {resubmit:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// An in-memory store whose claims answer late, while a switch is on.
#[derive(Debug)]
struct Late {
    store: MemoryStore,
    on: Arc<std::sync::atomic::AtomicBool>,
}

impl Late {
    async fn wait(&self) {
        if self.on.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl IdempotencyStore for Late {
    fn name(&self) -> &'static str {
        "late memory"
    }
    fn ready(&self) -> dlock_core::backend::BoxFuture<'_, dlock_core::Result<()>> {
        self.store.ready()
    }
    fn issue_token<'a>(
        &'a self,
        principal: Option<&'a str>,
        ttl: Duration,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<String>> {
        self.store.issue_token(principal, ttl)
    }
    fn claim_token<'a>(
        &'a self,
        token: &'a str,
        principal: Option<&'a str>,
        lease: Duration,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<dlock_core::idempotency::TokenClaim>> {
        Box::pin(async move {
            let claimed = self.store.claim_token(token, principal, lease).await;
            self.wait().await;
            claimed
        })
    }
    fn spend_token<'a>(
        &'a self,
        claim: &'a dlock_core::idempotency::Claim,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<bool>> {
        self.store.spend_token(claim)
    }
    fn return_token<'a>(
        &'a self,
        claim: &'a dlock_core::idempotency::Claim,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<bool>> {
        self.store.return_token(claim)
    }
    fn begin<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        fingerprint: &'a str,
        terms: dlock_core::idempotency::ClaimTerms,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<dlock_core::idempotency::Begin>> {
        Box::pin(async move {
            let begun = self.store.begin(scope, key, fingerprint, terms).await;
            self.wait().await;
            begun
        })
    }
    fn renew<'a>(
        &'a self,
        claim: &'a dlock_core::idempotency::Claim,
        lease: Duration,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<bool>> {
        self.store.renew(claim, lease)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a dlock_core::idempotency::Claim,
        response: &'a dlock_core::idempotency::StoredResponse,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<bool>> {
        self.store.complete(claim, response)
    }
    fn abandon<'a>(
        &'a self,
        claim: &'a dlock_core::idempotency::Claim,
    ) -> dlock_core::backend::BoxFuture<'a, dlock_core::Result<bool>> {
        self.store.abandon(claim)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_when_its_client_hangs_up_is_settled_on_the_memory_store() {
    let on = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = Late { store: MemoryStore::new(), on: on.clone() };
    a_claim_in_flight_is_settled(Arc::new(store), move |slow| on.store(slow, Ordering::SeqCst)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_when_its_client_hangs_up_is_settled_on_the_redis_store() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(redis.port());
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{}", proxy.port()), "inflight").await.expect("connect");
    a_claim_in_flight_is_settled(Arc::new(store), move |slow| {
        proxy.set_delay(if slow { Duration::from_millis(150) } else { Duration::ZERO })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_when_its_client_hangs_up_is_settled_on_the_postgres_store() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let store = PostgresStore::connect(&url, "inflight").await.expect("connect");
    a_claim_in_flight_is_settled(Arc::new(store), move |slow| {
        proxy.set_delay(if slow { Duration::from_millis(150) } else { Duration::ZERO })
    })
    .await;
}
