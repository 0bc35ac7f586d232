//! Idempotency across two `orders` processes sharing one real Redis: a storm
//! of one token or one `Idempotency-Key` executes exactly once, every other
//! answer is a replay or a 409.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dlock_testing::RedisServer;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response: status, headers (lower-case names) and the raw body.
#[derive(Debug, Clone)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("status {}, body not JSON ({e}): {:?}", self.status, self.body))
    }
}

/// One HTTP/1.1 request on a fresh connection (`connection: close`, so the
/// body ends with the stream; axum answers these bodies unchunked).
async fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n", body.len());
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(head.as_bytes()).await.expect("write");
        stream.write_all(body.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read");
        raw
    };
    let raw = tokio::time::timeout(Duration::from_secs(30), exchange).await.expect("answer within 30 s");
    let text = String::from_utf8(raw).expect("utf-8 reply");
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok()).expect("status");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    assert!(
        !headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked")),
        "unexpected chunked reply"
    );
    Reply { status, headers, body: body.to_owned() }
}

/// One running `orders` process, killed on drop.
struct Orders {
    child: Child,
    addr: String,
}

impl Orders {
    async fn start(redis_url: &str) -> Orders {
        Orders::start_with(redis_url, &[]).await
    }

    async fn start_with(redis_url: &str, env: &[(&str, &str)]) -> Orders {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_orders"));
        // Nothing of the caller's environment switches a guard off; `env` may.
        cmd.env_remove("ORDERS_UNLOCKED").env_remove("ORDERS_CHARGES_UNGUARDED").envs(env.iter().copied());
        cmd.env("ORDERS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("DLOCK_BACKEND", "redis")
            .env("DLOCK_REDIS_URL", redis_url)
            .env("ORDERS_REDIS_URL", redis_url)
            .env_remove("DLOCK_IDEMPOTENCY_REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start the orders binary");
        let stdout = child.stdout.take().expect("piped stdout");
        let addr = tokio::task::spawn_blocking(move || {
            dlock_testing::announced_address(stdout, Duration::from_secs(30), None)
        })
        .await
        .expect("join")
        .expect("orders logged its address within 30 s");
        let deadline = Instant::now() + Duration::from_secs(30);
        while request(&addr, "GET", "/health", &[], "").await.status != 200 {
            assert!(Instant::now() < deadline, "orders not healthy within 30 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Orders { child, addr }
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs of `POST /charges` for `order_id`, from its own counter.
fn charge_runs(redis: &RedisServer, order_id: &str) -> u64 {
    let runs: Option<u64> =
        redis::cmd("GET").arg(format!("orders:charges:{order_id}")).query(&mut redis.connection()).expect("GET");
    runs.unwrap_or(0)
}

/// Ten copies of one charge, five to each instance at once: the statuses of
/// the answers, and the bodies of the 2xx ones.
async fn charge_storm(a: &Orders, b: &Orders, order_id: &str) -> (Vec<u16>, Vec<String>) {
    let body = format!(r#"{{"order_id": "{order_id}", "amount": 700}}"#);
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let (addr, body) = (if i % 2 == 0 { a.addr.clone() } else { b.addr.clone() }, body.clone());
            tokio::spawn(async move {
                let headers = [("idempotency-key", "charge-storm"), ("authorization", "Bearer carol")];
                request(&addr, "POST", "/charges", &headers, &body).await
            })
        })
        .collect();
    let (mut statuses, mut bodies) = (Vec::new(), Vec::new());
    for t in tasks {
        let r = t.await.expect("task");
        statuses.push(r.status);
        if r.status == 201 {
            bodies.push(r.body);
        }
    }
    (statuses, bodies)
}

/// `POST /charges` has no deduplication of its own, so the layer alone
/// keeps a duplicate from running twice; without it (the torture harness's
/// negative control) every copy runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_run_once_per_key_behind_the_layer_and_every_time_without_it() {
    let redis = RedisServer::start();
    let (a, b) = (Orders::start(&redis.url()).await, Orders::start(&redis.url()).await);
    let (statuses, _) = charge_storm(&a, &b, "ord_guarded").await;
    assert_eq!(statuses.iter().filter(|&&s| s == 201).count(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|&s| s == 201 || s == 409), "{statuses:?}");
    assert_eq!(charge_runs(&redis, "ord_guarded"), 1);
    drop((a, b));

    let unguarded = [("ORDERS_CHARGES_UNGUARDED", "1")];
    let (a, b) =
        (Orders::start_with(&redis.url(), &unguarded).await, Orders::start_with(&redis.url(), &unguarded).await);
    let (statuses, bodies) = charge_storm(&a, &b, "ord_unguarded").await;
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    assert_eq!(charge_runs(&redis, "ord_unguarded"), 10, "without the layer every copy runs");
    let first = bodies.first().expect("a body");
    assert!(bodies.iter().any(|b| b != first), "ten runs, ten charges: {bodies:?}");
}

fn payment_count(redis: &RedisServer) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS").arg("orders:payment:*").query(&mut redis.connection()).expect("KEYS");
    keys.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_twenty_submits_two_instances_one_order() {
    let redis = RedisServer::start();
    let (a, b) = (Orders::start(&redis.url()).await, Orders::start(&redis.url()).await);
    assert_eq!(request(&a.addr, "PUT", "/products/9", &[], r#"{"stock": 100}"#).await.status, 200);
    let issued = request(&b.addr, "GET", "/idempotency/token", &[], "").await;
    assert_eq!(issued.status, 200, "{}", issued.body);
    let token = issued.json()["token"].as_str().expect("token").to_owned();
    assert_eq!(issued.json()["expires_in_secs"], 86_400);

    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let addr = if i % 2 == 0 { a.addr.clone() } else { b.addr.clone() };
            let path = format!("/orders?token={token}");
            tokio::spawn(
                async move { request(&addr, "POST", &path, &[], r#"{"product": {"id": 9}, "quantity": 1}"#).await },
            )
        })
        .collect();
    let (mut created, mut duplicate) = (0, 0);
    for t in tasks {
        let r = t.await.expect("task");
        match (r.status, r.json()["error"].as_str().map(str::to_owned)) {
            (201, _) => created += 1,
            // The lock is held by the running submit (transient) or the
            // token is spent already (permanent).
            (409, Some(e)) if e == "duplicate_submission" || e == "idempotency_token_unknown" => duplicate += 1,
            other => panic!("unexpected {other:?}: {}", r.body),
        }
    }
    assert_eq!((created, duplicate), (1, 19));
    let product = request(&a.addr, "GET", "/products/9", &[], "").await.json();
    assert_eq!(product["sold"], 1, "exactly one execution");

    let missing = request(&a.addr, "POST", "/orders", &[], r#"{"product": {"id": 9}, "quantity": 1}"#).await;
    // 400 either way; today the route's LockLayer (keyed on `token`) answers
    // `lock_key_field_missing` before the handler can say `idempotency_token_missing`.
    assert_eq!(missing.status, 400, "{}", missing.body);
    let made_up = request(&a.addr, "POST", "/orders?token=t-1", &[], r#"{"product": {"id": 9}, "quantity": 1}"#).await;
    assert_eq!((made_up.status, made_up.json()["error"].clone()), (409, json!("idempotency_token_unknown")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_storm_across_two_instances_pays_once() {
    let redis = RedisServer::start();
    let (a, b) = (Orders::start(&redis.url()).await, Orders::start(&redis.url()).await);
    let body = r#"{"order_id": "ord_1", "amount": 4200}"#;
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let addr = if i % 2 == 0 { a.addr.clone() } else { b.addr.clone() };
            tokio::spawn(async move {
                request(
                    &addr,
                    "POST",
                    "/payments",
                    &[("idempotency-key", "pay-storm"), ("authorization", "Bearer alice")],
                    body,
                )
                .await
            })
        })
        .collect();
    let (mut created, mut in_progress, mut replayed) = (Vec::new(), 0, 0);
    for t in tasks {
        let r = t.await.expect("task");
        match (r.status, r.header("idempotent-replayed")) {
            (201, None) => created.push(r),
            (201, Some("true")) => replayed += 1,
            (409, _) => {
                assert_eq!(r.json()["error"], "idempotency_request_in_progress", "{}", r.body);
                in_progress += 1
            }
            _ => panic!("unexpected {r:?}"),
        }
    }
    assert_eq!(created.len(), 1, "exactly one execution ({in_progress} in progress, {replayed} replays)");
    assert_eq!(payment_count(&redis), 1);
    let first = &created[0];
    let p = first.json();
    assert!(p["payment_id"].as_str().is_some_and(|s| s.starts_with("pay_")));
    assert_eq!((p["order_id"].clone(), p["amount"].clone()), (json!("ord_1"), json!(4200)));

    // After completion every retry, on either instance, is the same bytes.
    for addr in [&a.addr, &b.addr] {
        let again = request(
            addr,
            "POST",
            "/payments",
            &[("idempotency-key", "pay-storm"), ("authorization", "Bearer alice")],
            body,
        )
        .await;
        assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
        assert_eq!(again.body, first.body, "byte for byte");
        assert_eq!(again.header("content-type"), first.header("content-type"));
    }
    assert_eq!(payment_count(&redis), 1);

    let other = request(
        &b.addr,
        "POST",
        "/payments",
        &[("idempotency-key", "pay-storm"), ("authorization", "Bearer alice")],
        r#"{"order_id": "ord_1", "amount": 1}"#,
    )
    .await;
    assert_eq!((other.status, other.json()["error"].clone()), (422, json!("idempotency_key_mismatch")));
    let none = request(&a.addr, "POST", "/payments", &[], body).await;
    assert_eq!((none.status, none.json()["error"].clone()), (400, json!("idempotency_key_missing")));
    // A caller without credentials is refused, never put in a shared scope
    // where another anonymous caller's key would replay this payment.
    let anonymous = request(&a.addr, "POST", "/payments", &[("idempotency-key", "pay-storm")], body).await;
    assert_eq!((anonymous.status, anonymous.json()["error"].clone()), (400, json!("idempotency_scope_missing")));
    // Another caller (other credentials) with the same key is a new payment.
    let bob = request(
        &a.addr,
        "POST",
        "/payments",
        &[("idempotency-key", "pay-storm"), ("authorization", "Bearer bob")],
        body,
    )
    .await;
    assert_eq!((bob.status, bob.header("idempotent-replayed")), (201, None));
    assert_ne!(bob.body, first.body);
    assert_eq!(payment_count(&redis), 2);
}

/// The caller's credentials and its `Idempotency-Key` are secrets: the
/// payment's own claim in Redis is named by their hash, not their text (key
/// names show in `MONITOR`, `SCAN`, slow logs and dumps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_redis_key_name_holds_a_credential_or_an_idempotency_key() {
    let redis = RedisServer::start();
    let a = Orders::start(&redis.url()).await;
    let headers = [("idempotency-key", "key-s3cret"), ("authorization", "Bearer cred-s3cret")];
    let paid = request(&a.addr, "POST", "/payments", &headers, r#"{"order_id": "ord_1", "amount": 1}"#).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut redis.connection()).expect("KEYS");
    assert!(keys.iter().any(|k| k.starts_with("orders:paykey:")), "the claim was made: {keys:?}");
    for k in &keys {
        assert!(!k.contains("s3cret"), "a secret in a key name: {k}");
    }
}
