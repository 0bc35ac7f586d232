//! Exactly once through hang-ups (issue 24): a client that closes its
//! socket while its route runs — before the route's side effect, after it,
//! or after the answer — never makes a retry run the route again, with an
//! `Idempotency-Key` or a one-time token, on the memory and the Redis store.
//!
//! Over a real socket (`axum::serve`), because what goes wrong is hyper
//! dropping the request's future when its client goes away: `oneshot`
//! never does that.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use dlock_axum::{
    idempotency::{IdempotencyLayer, TokenLayer},
    Caller,
};
use dlock_core::idempotency::{IdempotencyStore, MemoryStore, RedisStore};
use tower::ServiceExt;

/// How long the route works; the side effect comes at its start or its end.
const WORK: Duration = Duration::from_millis(400);

#[derive(Clone, Copy, Debug)]
enum Effect {
    /// The side effect first, then the slow part (a receipt, a PSP call).
    First,
    /// The slow part first, then the side effect.
    Last,
}

/// `/pay` behind `IdempotencyLayer` (scoped by `x-user`) and `/submit`
/// behind `TokenLayer`; both count their side effects in `runs`.
fn app(
    store: Arc<dyn IdempotencyStore>,
    effect: Effect,
    runs: Arc<AtomicUsize>,
) -> (Router, Arc<dyn IdempotencyStore>) {
    let idem: Arc<dyn IdempotencyStore> = store;
    let route = move || {
        let runs = runs.clone();
        async move {
            let mut run = 0;
            if let Effect::First = effect {
                run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            }
            tokio::time::sleep(WORK).await;
            if let Effect::Last = effect {
                run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            }
            (StatusCode::CREATED, format!("run {run}"))
        }
    };
    let app = Router::new()
        .route(
            "/pay",
            post(route.clone()).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::header("x-user"))),
        )
        .route("/submit", post(route).layer(TokenLayer::new().store(idem.clone())));
    (app, idem)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn request(path: &str, header: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nx-user: alice\r\n{header}\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    )
}

/// Sends `req`, waits `after`, and closes the socket without reading.
fn send_and_hang_up(addr: SocketAddr, req: &str, after: Duration) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(req.as_bytes()).expect("write");
    std::thread::sleep(after);
    drop(s);
}

/// Sends `req` and reads the whole answer (the server closes: `connection: close`).
fn send(addr: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(req.as_bytes()).expect("write");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    answer.to_ascii_lowercase()
}

/// Retries `req` until it is no longer answered "in progress"; every
/// answer, in order.
fn retry_until_settled(addr: SocketAddr, req: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut answers = Vec::new();
    loop {
        let answer = send(addr, req);
        let in_progress = answer.contains("idempotency_request_in_progress");
        answers.push(answer);
        if !in_progress || Instant::now() > deadline {
            return answers;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn status(answer: &str) -> &str {
    answer.get(9..12).unwrap_or(answer)
}

/// Hangs up before the side effect (`Last`, at 100 ms), after it and
/// before the answer (`First`, at 100 ms), and after the answer (at
/// `WORK` + 200 ms), then retries: the route ran once, and the retry is
/// its stored answer (a key) or the refusal of a spent token.
async fn hang_ups_never_run_twice(store: Arc<dyn IdempotencyStore>) {
    let cases = [
        (Effect::Last, Duration::from_millis(100), "before the side effect"),
        (Effect::First, Duration::from_millis(100), "after the side effect"),
        (Effect::First, WORK + Duration::from_millis(200), "after the answer"),
    ];
    for (n, (effect, after, when)) in cases.into_iter().enumerate() {
        let runs = Arc::new(AtomicUsize::new(0));
        let (app, idem) = app(store.clone(), effect, runs.clone());
        let addr = serve(app).await;
        let token = idem.issue_token(None, Duration::from_secs(60)).await.expect("issue");
        let key = format!("idempotency-key: hang-up-{n}-{}", std::process::id());
        let (pay, submit) = (request("/pay", &key), request("/submit", &format!("idempotency-token: {token}")));
        let (pay_answers, submit_answers) = tokio::task::spawn_blocking(move || {
            send_and_hang_up(addr, &pay, after);
            let pay_answers = retry_until_settled(addr, &pay);
            send_and_hang_up(addr, &submit, after);
            let submit_answers = retry_until_settled(addr, &submit);
            (pay_answers, submit_answers)
        })
        .await
        .expect("client");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{when}: one run per route, {pay_answers:?} {submit_answers:?}");
        let last = pay_answers.last().expect("an answer");
        assert_eq!(status(last), "201", "{when}: the key's retry: {pay_answers:?}");
        assert!(last.contains("idempotent-replayed: true"), "{when}: a replay, not a new run: {pay_answers:?}");
        let last = submit_answers.last().expect("an answer");
        assert_eq!(status(last), "409", "{when}: the token's resubmit: {submit_answers:?}");
        assert!(last.contains("idempotency_token_unknown"), "{when}: the token is spent: {submit_answers:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_ups_never_run_a_route_twice_on_the_memory_store() {
    hang_ups_never_run_twice(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_ups_never_run_a_route_twice_on_the_redis_store() {
    let redis = dlock_testing::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), "hangup").await.expect("connect");
    hang_ups_never_run_twice(Arc::new(store)).await;
}

/// A route whose status says it ran, and whose body then fails mid-stream:
/// the work is done, so the key stays completed and a retry is told its
/// answer was not kept, never run again.
#[tokio::test]
async fn a_body_that_fails_after_the_side_effect_does_not_free_the_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let app: Router = Router::new().route(
        "/pay",
        post(move || {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let chunks: Vec<Result<&'static str, std::io::Error>> =
                    vec![Ok("{\"paid\":"), Err(std::io::Error::other("the stream broke"))];
                (StatusCode::CREATED, Body::from_stream(futures_util::stream::iter(chunks))).into_response()
            }
        })
        .layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared())),
    );
    let pay =
        || Request::post("/pay").header("idempotency-key", "broken-body").body(Body::from("{}")).expect("request");
    let first = app.clone().oneshot(pay()).await.expect("first");
    assert_ne!(first.status(), StatusCode::CREATED, "the client is told its answer broke");
    let retry = app.oneshot(pay()).await.expect("retry");
    let body = axum::body::to_bytes(retry.into_body(), 1 << 16).await.expect("body");
    assert!(String::from_utf8_lossy(&body).contains("idempotency_response_not_stored"), "{body:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A route slower than its claim's lease still runs once: the layer renews
/// the claim while it runs, so a retry meanwhile is "in progress", never a
/// second run. A claim whose instance died (taken in the store and never
/// renewed) answers `409 idempotency_outcome_unknown` once its lease runs
/// out: final, without `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_route_keeps_its_claim_and_a_dead_ones_outcome_is_unknown() {
    use dlock_core::idempotency::{fingerprint, Begin, ClaimTerms};
    let lease = Duration::from_millis(300);
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let idem: Arc<dyn IdempotencyStore> = store.clone();
    let app: Router = Router::new().route(
        "/pay",
        post(move || {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                StatusCode::CREATED
            }
        })
        .layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::shared()).lease(lease)),
    );
    let pay = |key: &str| Request::post("/pay").header("idempotency-key", key).body(Body::from("{}")).expect("request");
    let first = tokio::spawn(app.clone().oneshot(pay("slow")));
    // Retries at 300, 600 and 900 ms: each one past a lease of the first.
    for _ in 0..3 {
        tokio::time::sleep(lease).await;
        let retry = app.clone().oneshot(pay("slow")).await.expect("retry");
        let body = axum::body::to_bytes(retry.into_body(), 1 << 16).await.expect("body");
        assert!(String::from_utf8_lossy(&body).contains("idempotency_request_in_progress"), "{body:?}");
    }
    assert_eq!(first.await.expect("task").expect("first").status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the slow route ran once");
    // A dead instance's claim: the request's fingerprint, as the layer makes it.
    let fp = fingerprint(&[&b"POST"[..], b"/pay", b"{}"]);
    let dead = store.begin("shared", "dead", &fp, ClaimTerms::new(lease)).await.expect("begin");
    assert!(matches!(dead, Begin::New(_)), "{dead:?}");
    let during = app.clone().oneshot(pay("dead")).await.expect("during");
    assert_eq!(during.headers().get("retry-after").map(|v| v.as_bytes()), Some(&b"1"[..]), "in progress");
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let after = app.oneshot(pay("dead")).await.expect("after");
    assert_eq!(after.status(), StatusCode::CONFLICT);
    assert!(after.headers().get("retry-after").is_none(), "final: no Retry-After");
    let body = axum::body::to_bytes(after.into_body(), 1 << 16).await.expect("body");
    assert!(String::from_utf8_lossy(&body).contains("idempotency_outcome_unknown"), "{body:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the dead claim's route never ran here");
}

/// The same for one-time tokens: a slow route keeps its token's claim
/// (renewed), and a token claimed by an instance that died answers
/// `409 idempotency_outcome_unknown` once its lease ran out (counted as
/// spent: it never runs), instead of "in progress" for the token's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_route_keeps_its_token_and_a_dead_ones_outcome_is_unknown() {
    use dlock_core::idempotency::TokenClaim;
    let lease = Duration::from_millis(300);
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let idem: Arc<dyn IdempotencyStore> = store.clone();
    let app: Router = Router::new().route(
        "/submit",
        post(move || {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                StatusCode::CREATED
            }
        })
        .layer(TokenLayer::new().store(idem.clone()).lease(lease)),
    );
    let submit =
        |token: &str| Request::post("/submit").header("idempotency-token", token).body(Body::empty()).expect("request");
    let error = |res: axum::response::Response| async move {
        let body = axum::body::to_bytes(res.into_body(), 1 << 16).await.expect("body");
        String::from_utf8_lossy(&body).into_owned()
    };
    let token = store.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    let first = tokio::spawn(app.clone().oneshot(submit(&token)));
    for _ in 0..3 {
        tokio::time::sleep(lease).await;
        let again = app.clone().oneshot(submit(&token)).await.expect("resubmit");
        assert!(error(again).await.contains("idempotency_request_in_progress"));
    }
    assert_eq!(first.await.expect("task").expect("first").status(), StatusCode::CREATED);
    // A dead instance's claim.
    let dead = store.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    assert!(matches!(store.claim_token(&dead, None, lease).await.expect("claim"), TokenClaim::Claimed(_)));
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let after = app.oneshot(submit(&dead)).await.expect("after");
    assert_eq!(after.status(), StatusCode::CONFLICT);
    assert!(after.headers().get("retry-after").is_none(), "final: no Retry-After");
    assert!(error(after).await.contains("idempotency_outcome_unknown"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[derive(serde::Deserialize)]
struct Pay {
    order: u64,
}

/// Counts the runs of [`locked_payment`].
static LOCKED_RUNS: AtomicUsize = AtomicUsize::new(0);

/// A `#[lockable]` route: its lock is taken inside the layer's claim, so it
/// runs on the claim's own task too and is released when the route ends,
/// not when the client hangs up.
#[dlock_axum::lockable(key = "pay", fields = ["order"], wait_ms = 0)]
async fn locked_payment(axum::extract::Query(Pay { order }): axum::extract::Query<Pay>) -> impl IntoResponse {
    let _ = order;
    LOCKED_RUNS.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(WORK).await;
    (StatusCode::CREATED, "paid")
}

/// Issue 24: a client that hangs up after the side effect of a
/// `#[lockable]` route behind `IdempotencyLayer` gets, on retry, `409` in
/// progress and then the stored answer; the route ran once, and its lock
/// is free once it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockable_route_behind_the_layer_runs_once_through_a_hang_up() {
    use dlock_axum::DlockExt;
    let locker = dlock_core::Locker::new(dlock_core::MemoryBackend::new());
    let idem: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let app = Router::new()
        .route(
            "/pay",
            post(locked_payment).layer(IdempotencyLayer::new().store(idem.clone()).caller(Caller::header("x-user"))),
        )
        .with_dlock(dlock_axum::DlockRuntime::new(locker.clone()));
    let addr = serve(app).await;
    let pay = request("/pay?order=7", "idempotency-key: locked-1");
    let answers = tokio::task::spawn_blocking(move || {
        send_and_hang_up(addr, &pay, Duration::from_millis(100));
        retry_until_settled(addr, &pay)
    })
    .await
    .expect("client");
    let last = answers.last().expect("an answer");
    assert_eq!(status(last), "201", "{answers:?}");
    assert!(last.contains("idempotent-replayed: true"), "{answers:?}");
    assert_eq!(LOCKED_RUNS.load(Ordering::SeqCst), 1);
    let key = locker.key("pay").part(7).build().expect("key");
    let guard = locker.try_acquire(&key).await.expect("the route's lock is free once it ended");
    assert!(guard.release().await.expect("release"));
}
