//! Issue 37: a refusal for a busy lock says in `Retry-After` how long the
//! lock may last — the route's lease, else the watchdog lease
//! (`DLOCK_LEASE_MS`) — rather than `1`: a holder whose instance died keeps
//! its lock that long, and a client told `1` polls all the while. Through
//! `LockLayer`, `#[lockable]` and `Policy::run_locked`, on the in-process
//! backend, with the lock held by another owner.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use dlock_axum::lock::Policy;
use dlock_axum::{lockable, DlockExt, LockLayer};
use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::{LockGuard, Locker, LockerOptions, MemoryBackend, Owner};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// A locker whose watchdog lease is `lease` (what `DLOCK_LEASE_MS` sets).
fn locker_with_lease(lease: Duration) -> Locker {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    Locker::with_options(backend, LockerOptions::default().with_watchdog_lease(lease)).expect("valid options")
}

/// Holds `name:7` as another owner, in watchdog mode.
async fn hold(locker: &Locker, name: &str) -> LockGuard {
    let key = locker.key(name).part(7).build().expect("key");
    locker.try_acquire(&key).await.expect("the lock is free")
}

fn app(locker: &Locker, layer: LockLayer) -> Router {
    Router::new().route("/r/{id}", post(|| async { "ran" }).layer(layer)).with_dlock(locker.clone())
}

/// The status, `error` and `Retry-After` of the answer to `POST /r/7`.
async fn refused(app: &Router) -> (StatusCode, String, Option<String>) {
    let res = app.clone().oneshot(Request::post("/r/7").body(Body::empty()).expect("request")).await;
    answer(res.expect("infallible")).await
}

async fn answer(res: Response) -> (StatusCode, String, Option<String>) {
    let status = res.status();
    let retry_after = res.headers().get("retry-after").map(|v| v.to_str().expect("ASCII").to_owned());
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("a JSON refusal");
    (status, v["error"].as_str().expect("error").to_owned(), retry_after)
}

fn says(status: StatusCode, error: &str, seconds: &str) -> (StatusCode, String, Option<String>) {
    (status, error.to_owned(), Some(seconds.to_owned()))
}

/// A route with a fixed lease: that lease, in whole seconds rounded up.
#[tokio::test]
async fn a_fixed_lease_is_said_rounded_up() {
    let locker = locker_with_lease(Duration::from_secs(20));
    let _held = hold(&locker, "fixed").await;
    let app = app(&locker, LockLayer::new("fixed").path("id").lease(Duration::from_millis(7_500)));
    assert_eq!(refused(&app).await, says(StatusCode::CONFLICT, "duplicate_submission", "8"));
}

/// A watchdog route: the locker's watchdog lease, `DLOCK_LEASE_MS`'s.
#[tokio::test]
async fn a_watchdog_route_says_the_watchdog_lease() {
    let locker = locker_with_lease(Duration::from_secs(12));
    let _held = hold(&locker, "watched").await;
    let app = app(&locker, LockLayer::new("watched").path("id"));
    assert_eq!(refused(&app).await, says(StatusCode::CONFLICT, "duplicate_submission", "12"));
}

/// With nothing configured: the default lease, 30 s.
#[tokio::test]
async fn the_default_lease_is_30_seconds() {
    let locker = Locker::new(MemoryBackend::new());
    assert_eq!(locker.options().watchdog_lease(), dlock_core::DEFAULT_LEASE);
    let _held = hold(&locker, "default").await;
    let app = app(&locker, LockLayer::new("default").path("id"));
    assert_eq!(refused(&app).await, says(StatusCode::CONFLICT, "duplicate_submission", "30"));
}

/// A wait that ran out and a full semaphore say it too.
#[tokio::test]
async fn a_wait_that_ran_out_and_a_full_semaphore_say_the_lease() {
    let locker = locker_with_lease(Duration::from_secs(9));
    let _held = hold(&locker, "queue").await;
    let waits = app(&locker, LockLayer::new("queue").path("id").wait(Duration::from_millis(20)));
    assert_eq!(refused(&waits).await, says(StatusCode::CONFLICT, "lock_wait_timeout", "9"));

    let key = locker.key("exports").part(7).build().expect("key");
    let one = dlock_core::AcquireOptions::new().with_mode(dlock_core::LockMode::permits(1));
    let _permit = locker.acquire(&key, one).await.expect("the permit is free");
    let full = app(&locker, LockLayer::new("exports").path("id").permits(1).lease(Duration::from_secs(4)));
    assert_eq!(refused(&full).await, says(StatusCode::TOO_MANY_REQUESTS, "lock_permits_exhausted", "4"));
}

#[lockable(key = "macro", fields = ["id"], lease_ms = 2_001)]
async fn by_macro(Path(id): Path<u64>) -> String {
    format!("ran {id}")
}

/// `#[lockable]` answers the same way.
#[tokio::test]
async fn a_lockable_handler_says_its_lease() {
    let locker = locker_with_lease(Duration::from_secs(12));
    let _held = hold(&locker, "macro").await;
    let app = Router::new().route("/r/{id}", post(by_macro)).with_dlock(locker.clone());
    assert_eq!(refused(&app).await, says(StatusCode::CONFLICT, "duplicate_submission", "3"));
}

/// A lock taken by hand with a `Policy` answers the same way.
#[tokio::test]
async fn run_locked_says_the_watchdog_lease() {
    let locker = locker_with_lease(Duration::from_millis(45_001));
    let _held = hold(&locker, "by-hand").await;
    let key = locker.key("by-hand").part(7).build().expect("key");
    let owner = Owner::random().expect("owner");
    let refused = Policy::new("by-hand").run_locked(&locker, owner, key, async {}).await.expect_err("held");
    assert_eq!(answer(refused).await, says(StatusCode::CONFLICT, "duplicate_submission", "46"));
}

/// A refusal that is not about a held lock keeps its own: an unreachable
/// lock service says 1 (nothing bounds an outage), a request without its
/// key field none (permanent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_that_is_not_a_busy_lock_keeps_its_retry_after() {
    let mut server = dlock_testing::RedisServer::start();
    let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect");
    let options = LockerOptions::default().with_watchdog_lease(Duration::from_secs(12));
    let locker = Locker::with_options(Arc::new(backend), options).expect("valid options");
    server.kill();
    let down = app(&locker, LockLayer::new("down").path("id"));
    assert_eq!(refused(&down).await, says(StatusCode::SERVICE_UNAVAILABLE, "lock_backend_unavailable", "1"));

    let fields = app(&locker, LockLayer::new("fields").json("id"));
    let bad = Request::post("/r/7").header("content-type", "application/json").body(Body::from("{}"));
    let res = fields.oneshot(bad.expect("request")).await.expect("infallible");
    assert_eq!(answer(res).await, (StatusCode::BAD_REQUEST, "lock_key_field_missing".to_owned(), None));
}
