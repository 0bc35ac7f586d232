//! The built `orders` binary, started as real processes: two instances
//! against one real Redis never sell more than the stock; without the lock
//! they do; a dead Redis is a quick 503 and the service recovers when Redis
//! returns.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dlock_testing::RedisServer;
use serde_json::{json, Value};

/// A plain HTTP/1.1 client over a fresh connection per request, enough for
/// these tests and nothing to build.
mod http {
    use serde_json::Value;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// A response: status, headers (lower-case names) and the body as JSON.
    #[derive(Debug)]
    pub(crate) struct Reply {
        pub(crate) status: u16,
        pub(crate) headers: Vec<(String, String)>,
        pub(crate) json: Value,
    }

    impl Reply {
        pub(crate) fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
        }
    }

    pub(crate) async fn request(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Reply, String> {
        request_raw(addr, method, path, &body.map(Value::to_string).unwrap_or_default()).await
    }

    /// `request` with the body as given, JSON or not.
    pub(crate) async fn request_raw(addr: &str, method: &str, path: &str, body: &str) -> Result<Reply, String> {
        tokio::time::timeout(Duration::from_secs(30), send(addr, method, path, body))
            .await
            .map_err(|_| format!("{method} {path}: no answer within 30 s"))?
    }

    async fn send(addr: &str, method: &str, path: &str, body: &str) -> Result<Reply, String> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        stream.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
        stream.write_all(body.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.map_err(|e| format!("read: {e}"))?;
        parse(&raw)
    }

    fn parse(raw: &[u8]) -> Result<Reply, String> {
        let text = String::from_utf8_lossy(raw);
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("no header end in {text:?}"))?;
        let mut lines = head.lines();
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {status_line:?}"))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked { dechunk(body)? } else { body.to_owned() };
        let text = headers.iter().any(|(n, v)| n == "content-type" && v.starts_with("text/plain"));
        let json = if body.is_empty() {
            Value::Null
        } else if text {
            Value::String(body)
        } else {
            serde_json::from_str(&body).map_err(|e| format!("status {status}, body not JSON ({e}): {body:?}"))?
        };
        Ok(Reply { status, headers, json })
    }

    fn dechunk(mut rest: &str) -> Result<String, String> {
        let mut out = String::new();
        loop {
            let (size, after) = rest.split_once("\r\n").ok_or("bad chunk header")?;
            let size = usize::from_str_radix(size.trim(), 16).map_err(|e| format!("bad chunk size: {e}"))?;
            if size == 0 {
                return Ok(out);
            }
            out.push_str(after.get(..size).ok_or("short chunk")?);
            rest = after.get(size + 2..).ok_or("short chunk")?;
        }
    }
}

use http::{request, request_raw};

/// One running `orders` process, killed on drop.
struct Orders {
    child: Child,
    addr: String,
}

impl Orders {
    /// Starts the binary on a free port with `env` and waits until
    /// `/health` answers.
    async fn start(env: &[(&str, &str)]) -> Orders {
        Orders::start_logged(env).await.0
    }

    /// [`start`](Self::start), and the lines it logged until it listened.
    async fn start_logged(env: &[(&str, &str)]) -> (Orders, Vec<String>) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_orders"));
        cmd.env("ORDERS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("DLOCK_BACKEND")
            .env_remove("ORDERS_REDIS_URL")
            .env_remove("ORDERS_UNLOCKED")
            .env_remove("ORDERS_POSTGRES_URL")
            .env_remove("ORDERS_UNFENCED")
            .env_remove("ORDERS_STOCK_WORK_MS")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the orders binary");
        let stdout = child.stdout.take().expect("piped stdout");
        // Killed on drop from here on, even if it never says where it listens.
        let mut orders = Orders { child, addr: String::new() };
        // The log line names the port the OS picked; the rest of the log is
        // shown with ORDERS_TEST_LOG set, so a failing test can tell why.
        let echo = std::env::var_os("ORDERS_TEST_LOG").is_some().then_some("orders");
        let (addr, startup) = tokio::task::spawn_blocking(move || start_up_log(stdout, Duration::from_secs(30), echo))
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("orders: {e}"));
        orders.addr = addr;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match request(&orders.addr, "GET", "/health", None).await {
                Ok(r) if r.status == 200 => return (orders, startup),
                other => {
                    assert!(Instant::now() < deadline, "orders /health not ready within 30 s: {other:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// What the service logs once it listens: `… listening on http://ADDR …`.
const LISTENING: &str = "listening on http://";

/// Reads the service's `stdout` until it logs that it listens: the address
/// and every line until then. A thread keeps draining the pipe afterwards
/// (so the service never blocks on a full pipe), echoing each line to stderr
/// with `[name]` when `echo` is set (as `dlock_testing::announced_address`,
/// which keeps no lines).
fn start_up_log(
    stdout: std::process::ChildStdout,
    timeout: Duration,
    echo: Option<&'static str>,
) -> Result<(String, Vec<String>), String> {
    use std::io::{BufRead, BufReader};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut tx, mut lines) = (Some(tx), Vec::new());
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(name) = echo {
                eprintln!("[{name}] {line}");
            }
            if tx.is_none() {
                continue;
            }
            let addr = line.split(LISTENING).nth(1).map(|rest| rest.split_whitespace().next().unwrap_or_default());
            let addr = addr.map(str::to_owned);
            lines.push(line);
            if let Some(addr) = addr
                && let Some(tx) = tx.take()
            {
                let _ = tx.send((addr, std::mem::take(&mut lines)));
            }
        }
    });
    rx.recv_timeout(timeout)
        .map_err(|_| format!("the service did not log `{LISTENING}…` within {timeout:?} (it may have failed to start)"))
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Outcome of one burst of sales.
#[derive(Debug, Default)]
struct Burst {
    ok: usize,
    sold_out: usize,
    other: Vec<(u16, Value)>,
    stock: i64,
    sold: i64,
}

/// Sets the stock of product `id` to `stock`, then fires `requests`
/// concurrent `/stock/reduce` of one unit each, alternating between the
/// instances, and reads the product back.
async fn burst(instances: &[&Orders], id: u64, stock: i64, requests: usize) -> Burst {
    let put = request(&instances[0].addr, "PUT", &format!("/products/{id}"), Some(&json!({"stock": stock})))
        .await
        .expect("PUT product");
    assert_eq!(put.status, 200, "{:?}", put.json);
    assert_eq!(put.json, json!({"id": id, "stock": stock, "sold": 0}));

    let body = json!({"product_id": id, "quantity": 1});
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let addr = instances[i % instances.len()].addr.clone();
            let body = body.clone();
            tokio::spawn(async move { request(&addr, "POST", "/stock/reduce", Some(&body)).await })
        })
        .collect();
    let mut out = Burst::default();
    for t in tasks {
        let r = t.await.expect("task").expect("reduce answered");
        match (r.status, r.json["error"].as_str()) {
            (200, _) => out.ok += 1,
            (409, Some("sold_out")) => out.sold_out += 1,
            _ => out.other.push((r.status, r.json)),
        }
    }
    let product = request(&instances[1 % instances.len()].addr, "GET", &format!("/products/{id}"), None)
        .await
        .expect("GET product");
    assert_eq!(product.status, 200);
    out.stock = product.json["stock"].as_i64().expect("stock");
    out.sold = product.json["sold"].as_i64().expect("sold");
    out
}

fn redis_env(url: &str) -> Vec<(&'static str, String)> {
    vec![("DLOCK_BACKEND", "redis".into()), ("DLOCK_REDIS_URL", url.into()), ("ORDERS_REDIS_URL", url.into())]
}

fn as_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_one_redis_sell_exactly_the_stock() {
    let redis = RedisServer::start();
    let env = redis_env(&redis.url());
    let a = Orders::start(&as_refs(&env)).await;
    let b = Orders::start(&as_refs(&env)).await;
    let health = request(&a.addr, "GET", "/health", None).await.expect("health");
    assert_eq!(health.json, json!({"status": "ok", "backend": "redis"}));

    let started = Instant::now();
    let r = burst(&[&a, &b], 1, 50, 240).await;
    eprintln!("locked burst: {r:?} in {:?}", started.elapsed());
    assert!(r.other.is_empty(), "unexpected answers: {:?}", r.other);
    assert_eq!(r.ok, 50, "{r:?}");
    assert_eq!(r.sold_out, 190, "{r:?}");
    assert_eq!((r.stock, r.sold), (0, 50), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_lock_two_instances_oversell() {
    let redis = RedisServer::start();
    let mut env = redis_env(&redis.url());
    env.push(("ORDERS_UNLOCKED", "1".into()));
    let a = Orders::start(&as_refs(&env)).await;
    let b = Orders::start(&as_refs(&env)).await;
    // The race is a matter of timing; three rounds make a miss all but
    // impossible, and one oversell is all this test needs to see.
    let mut rounds = Vec::new();
    for round in 0..3 {
        let r = burst(&[&a, &b], 100 + round, 50, 240).await;
        let oversold = r.ok > 50 || r.sold > 50 || r.stock + r.sold != 50;
        rounds.push(r);
        if oversold {
            eprintln!("oversold in round {round}: {:?}", rounds.last());
            return;
        }
    }
    panic!("no oversell without the lock in 3 rounds: {rounds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_redis_is_a_quick_503_and_the_service_recovers() {
    let mut redis = RedisServer::start();
    let env = redis_env(&redis.url());
    let orders = Orders::start(&as_refs(&env)).await;
    let put = request(&orders.addr, "PUT", "/products/7", Some(&json!({"stock": 5}))).await.expect("PUT");
    assert_eq!(put.status, 200);
    let reduce = json!({"product_id": 7, "quantity": 1});
    assert_eq!(request(&orders.addr, "POST", "/stock/reduce", Some(&reduce)).await.expect("reduce").status, 200);
    let ready = request(&orders.addr, "GET", "/ready", None).await.expect("ready");
    assert_eq!((ready.status, &ready.json["ready"]), (200, &json!(true)), "{}", ready.json);

    redis.kill();
    let started = Instant::now();
    let r =
        tokio::time::timeout(Duration::from_secs(10), request(&orders.addr, "POST", "/stock/reduce", Some(&reduce)))
            .await
            .expect("an answer within 10 s, not a hang")
            .expect("an HTTP answer");
    eprintln!("dead redis answered {} in {:?}: {}", r.status, started.elapsed(), r.json);
    assert_eq!(r.status, 503, "{}", r.json);
    assert_eq!(r.json["error"], "lock_backend_unavailable");
    // RFC 9457 Problem Details, with dlock's `error` and `code` kept.
    assert!(r.json["code"].is_u64() && r.json["detail"].is_string(), "{}", r.json);
    assert_eq!((r.json["status"].as_u64(), r.json["type"].as_str()), (Some(503), Some("about:blank")), "{}", r.json);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(request(&orders.addr, "GET", "/health", None).await.expect("health").status, 200);
    // The readiness probe says which part is down: the locks' Redis (and the
    // records', the same server here).
    let ready = request(&orders.addr, "GET", "/ready", None).await.expect("ready");
    assert_eq!((ready.status, &ready.json["ready"]), (503, &json!(false)), "{}", ready.json);
    assert_eq!(ready.json["checks"][0]["part"], "locks", "{}", ready.json);
    assert_eq!(ready.json["checks"][0]["ok"], false, "{}", ready.json);
    assert!(ready.json["checks"][0]["problem"].is_string(), "{}", ready.json);

    // Redis comes back empty (no persistence): restock, then sales work again.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let put = request(&orders.addr, "PUT", "/products/7", Some(&json!({"stock": 5}))).await.expect("PUT");
        let sale = if put.status == 200 {
            Some(request(&orders.addr, "POST", "/stock/reduce", Some(&reduce)).await.expect("reduce"))
        } else {
            None
        };
        match sale {
            Some(r) if r.status == 200 => {
                assert_eq!(r.json, json!({"product_id": 7, "remaining": 4}));
                let ready = request(&orders.addr, "GET", "/ready", None).await.expect("ready");
                assert_eq!(ready.status, 200, "ready again once sales work: {}", ready.json);
                break;
            }
            other => {
                assert!(
                    Instant::now() < deadline,
                    "not recovered 30 s after Redis came back: PUT {} {}, sale {other:?}",
                    put.status,
                    put.json
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_spend_their_token_once() {
    let orders = Orders::start(&[]).await;
    let addr = orders.addr.as_str();
    assert_eq!(
        request(addr, "GET", "/health", None).await.expect("health").json,
        json!({"status": "ok", "backend": "memory"})
    );
    assert_eq!(request(addr, "PUT", "/products/5", Some(&json!({"stock": 2}))).await.expect("PUT").status, 200);
    let order = json!({"product": {"id": 5}, "quantity": 1});

    // Real one-time tokens from the service.
    let token = || async {
        let r = request(addr, "GET", "/idempotency/token", None).await.expect("token");
        assert_eq!(r.status, 200, "{}", r.json);
        r.json["token"].as_str().expect("token").to_owned()
    };
    let t1 = token().await;
    let first = request(addr, "POST", &format!("/orders?token={t1}"), Some(&order)).await.expect("order");
    assert_eq!(first.status, 201, "{}", first.json);
    assert!(first.json["order_id"].as_str().is_some_and(|s| !s.is_empty()), "{}", first.json);
    assert_eq!((first.json["product_id"].clone(), first.json["quantity"].clone()), (json!(5), json!(1)));

    let again = request(addr, "POST", &format!("/orders?token={t1}"), Some(&order)).await.expect("order");
    assert_eq!(
        (again.status, again.json["error"].as_str()),
        (409, Some("idempotency_token_unknown")),
        "{}",
        again.json
    );

    let missing = request(addr, "POST", "/orders", Some(&order)).await.expect("order");
    assert_eq!(missing.status, 400, "{}", missing.json);

    let big = json!({"product": {"id": 5}, "quantity": 5});
    let t2 = token().await;
    let sold_out = request(addr, "POST", &format!("/orders?token={t2}"), Some(&big)).await.expect("order");
    assert_eq!((sold_out.status, sold_out.json["error"].as_str()), (409, Some("sold_out")), "{}", sold_out.json);

    let product = request(addr, "GET", "/products/5", None).await.expect("GET");
    assert_eq!(product.json, json!({"id": 5, "stock": 1, "sold": 1}));
    let unknown = request(addr, "GET", "/products/404", None).await.expect("GET");
    assert_eq!((unknown.status, unknown.json["error"].as_str()), (404, Some("product_not_found")));
}

/// axum's own extractors refuse in the service's shape too: RFC 9457
/// Problem Details with `error` and `code`, not axum's `text/plain`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_answered_as_problem_details() {
    let orders = Orders::start(&[]).await;
    let addr = orders.addr.as_str();
    let order = json!({"product": {"id": 5}, "quantity": 1}).to_string();
    let cases = [
        // `Query`: a field sent twice (serde refuses the duplicate).
        ("POST", "/orders?token=a&token=b", order.as_str(), "invalid_query", "duplicate field `token`"),
        // `Path`: not UTF-8 once percent-decoded.
        ("GET", "/products/%FF", "", "invalid_path", "UTF-8"),
        // `JsonBody`: not JSON.
        ("PUT", "/products/5", r#"{"stock": "#, "invalid_json", "not valid JSON"),
    ];
    for (method, path, body, error, detail) in cases {
        let r = request_raw(addr, method, path, body).await.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert_eq!(r.header("content-type"), Some("application/problem+json"), "{method} {path}: {}", r.json);
        assert_eq!(
            (r.status, r.json["status"].as_u64(), r.json["type"].as_str(), r.json["title"].as_str()),
            (400, Some(400), Some("about:blank"), Some("Bad Request")),
            "{method} {path}: {}",
            r.json
        );
        assert_eq!(r.json["error"].as_str(), Some(error), "{method} {path}: {}", r.json);
        assert!(r.json["code"].is_u64(), "{method} {path}: {}", r.json);
        let text = r.json["detail"].as_str().unwrap_or_default();
        assert!(text.contains(detail), "{method} {path}: detail {text:?} should name {detail:?}");
    }
    // A route or method the service does not serve: the same shape, not
    // axum's empty body; the 405 keeps axum's `Allow`.
    let r = request_raw(addr, "GET", "/nowhere", "").await.expect("404");
    assert_eq!((r.status, r.json["error"].as_str()), (404, Some("route_not_found")), "{}", r.json);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let r = request_raw(addr, "DELETE", "/orders", "").await.expect("405");
    assert_eq!((r.status, r.json["error"].as_str()), (405, Some("method_not_allowed")), "{}", r.json);
    assert_eq!(r.header("allow"), Some("POST"), "{}", r.json);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_service_cleanly() {
    let mut orders = Orders::start(&[]).await;
    let pid = orders.child.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
    assert!(sent.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = orders.child.try_wait().expect("wait for orders") {
            break status;
        }
        assert!(Instant::now() < deadline, "orders still running 10 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "orders exited with {status} after SIGTERM");
}

/// Issue 24: the token endpoint is rated per client address, so one client
/// cannot drain the store's pool of unbound tokens for everyone: beyond its
/// burst it gets `429 token_rate_limited` as Problem Details, with
/// `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_endpoint_is_rated_per_address() {
    let orders = Orders::start(&[("ORDERS_TOKEN_RATE", "1")]).await;
    let addr = orders.addr.as_str();
    let mut statuses = Vec::new();
    for _ in 0..12 {
        statuses.push(request(addr, "GET", "/idempotency/token", None).await.expect("token").status);
    }
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 10, "a burst of 10: {statuses:?}");
    let refused = request(addr, "GET", "/idempotency/token", None).await.expect("token");
    assert_eq!(refused.status, 429, "{}", refused.json);
    assert_eq!(refused.header("content-type"), Some("application/problem+json"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.json["error"], "token_rate_limited");
}

/// Issue 26: transfers lock both accounts as one set. Transfers 1→2 and
/// 2→1 fired at once all complete (the set is taken in one order of keys,
/// whatever order a request names them in, so none waits for another in a
/// cycle), and no money is lost or made (the read-modify-write of each
/// transfer runs alone on its accounts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_transfers_never_deadlock_and_keep_the_money() {
    let orders = Orders::start(&[]).await;
    let addr = orders.addr.as_str();
    for (id, balance) in [(1, 1000), (2, 1000)] {
        let put =
            request(addr, "PUT", &format!("/accounts/{id}"), Some(&json!({"balance": balance}))).await.expect("PUT");
        assert_eq!((put.status, &put.json), (200, &json!({"id": id, "balance": balance})));
    }
    // 20 of 1→2 (3 each) and 20 of 2→1 (1 each), all at once.
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let addr = addr.to_owned();
            let body = if i % 2 == 0 {
                json!({"from": 1, "to": 2, "amount": 3})
            } else {
                json!({"from": 2, "to": 1, "amount": 1})
            };
            tokio::spawn(async move { request(&addr, "POST", "/transfers", Some(&body)).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.expect("task").expect("every transfer answers (no deadlock)");
        assert_eq!(r.status, 200, "{}", r.json);
    }
    let balance = |id: u64| async move {
        let r = request(addr, "GET", &format!("/accounts/{id}"), None).await.expect("GET");
        r.json["balance"].as_i64().expect("balance")
    };
    assert_eq!((balance(1).await, balance(2).await), (1000 - 60 + 20, 1000 + 60 - 20));

    let broke =
        request(addr, "POST", "/transfers", Some(&json!({"from": 1, "to": 2, "amount": 5000}))).await.expect("POST");
    assert_eq!((broke.status, broke.json["error"].as_str()), (409, Some("insufficient_funds")), "{}", broke.json);
}

/// Issue 26: at most two exports of one user at once; the third is
/// `429 lock_permits_exhausted` with `Retry-After`, as Problem Details;
/// another user is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_concurrent_export_is_429() {
    let orders = Orders::start(&[("ORDERS_EXPORT_MS", "2000")]).await;
    let addr = orders.addr.as_str();
    let running: Vec<_> = (0..2)
        .map(|_| {
            let addr = addr.to_owned();
            tokio::spawn(async move { request(&addr, "POST", "/users/alice/export", None).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let third = request(addr, "POST", "/users/alice/export", None).await.expect("POST");
    assert_eq!(third.status, 429, "{}", third.json);
    // The watchdog lease (`DLOCK_LEASE_MS`, 30 s): how long the permits may last.
    assert_eq!(third.header("retry-after"), Some("30"));
    assert_eq!(third.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        (third.json["error"].as_str(), third.json["code"].as_u64()),
        (Some("lock_permits_exhausted"), Some(2403))
    );
    let other = request(addr, "POST", "/users/bob/export", None).await.expect("POST");
    assert_eq!((other.status, &other.json), (200, &json!({"user": "bob", "export": "done"})));
    for r in running {
        let r = r.await.expect("task").expect("export");
        assert_eq!(r.status, 200, "{}", r.json);
    }
    // The permits were given back.
    assert_eq!(request(addr, "POST", "/users/alice/export", None).await.expect("POST").status, 200);
}

/// `/metrics` answers dlock's metrics in the Prometheus text format, with
/// the sales just made and no request value in any label.
#[tokio::test]
async fn metrics_are_scraped_in_the_prometheus_format() {
    let orders = Orders::start(&[]).await;
    let sold = burst(&[&orders], 4242, 3, 5).await;
    assert_eq!((sold.ok, sold.sold_out), (3, 2), "{:?}", sold.other);
    let scraped = request(&orders.addr, "GET", "/metrics", None).await.expect("GET /metrics");
    assert_eq!(scraped.status, 200);
    assert_eq!(scraped.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = scraped.json.as_str().expect("text");
    let acquired = text
        .lines()
        .find(|l| {
            l.starts_with("dlock_lock_acquire_duration_count{")
                && l.contains("dlock_lock_name=\"product.stock\"")
                && l.contains("dlock_outcome=\"acquired\"")
        })
        .unwrap_or_else(|| panic!("no acquire count for product.stock in:\n{text}"));
    // The stock set by `PUT /products/{id}` and five sales took the lock.
    assert!(acquired.ends_with(" 6"), "six acquires: {acquired}");
    assert!(text.contains("# TYPE dlock_lock_held gauge"), "{text}");
    assert!(text.contains("dlock_lock_hold_duration_bucket{"), "{text}");
    // The idempotency store's usage against its caps, read at each scrape.
    let gauge = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("dlock_store="))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
    };
    assert!(gauge("dlock_idempotency_records_limit") > 0.0 && gauge("dlock_idempotency_bytes_limit") > 0.0);
    assert!(gauge("dlock_idempotency_records") >= 0.0 && gauge("dlock_idempotency_bytes") >= 0.0);
    for line in text.lines() {
        let labels = line.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map_or("", |(labels, _)| labels);
        assert!(!labels.contains("4242"), "a request value in a label: {line}");
    }
}

/// Sends `signal` (`STOP`, `CONT`) to the instance's process.
fn signal(orders: &Orders, signal: &str) {
    let status =
        Command::new("kill").arg(format!("-{signal}")).arg(orders.child.id().to_string()).status().expect("kill");
    assert!(status.success(), "kill -{signal}");
}

/// A sale whose instance is stopped (`SIGSTOP`) between reading the stock
/// and writing it, past its lock's lease (300 ms); another instance takes
/// the lock and sells; the stopped one resumes and writes. Returns both
/// answers and the product after.
async fn stale_sale(env: &[(&'static str, String)]) -> (http::Reply, http::Reply, Value) {
    let mut env = env.to_vec();
    env.push(("DLOCK_LEASE_MS", "300".into()));
    let b = Orders::start(&as_refs(&env)).await;
    env.push(("ORDERS_STOCK_WORK_MS", "800".into()));
    let a = Orders::start(&as_refs(&env)).await;
    let put = request(&b.addr, "PUT", "/products/500", Some(&json!({"stock": 10}))).await.expect("PUT");
    assert_eq!(put.status, 200, "{}", put.json);
    let body = json!({"product_id": 500, "quantity": 1});
    let slow = tokio::spawn({
        let (addr, body) = (a.addr.clone(), body.clone());
        async move { request(&addr, "POST", "/stock/reduce", Some(&body)).await }
    });
    // A has the lock and has read the stock: it is in its 800 ms of work.
    tokio::time::sleep(Duration::from_millis(250)).await;
    signal(&a, "STOP");
    tokio::time::sleep(Duration::from_millis(900)).await;
    // B's sale may wait for A (the PostgreSQL store orders them by the
    // fence's row lock, which A holds): A resumes while B's sale runs.
    let fresh = tokio::spawn({
        let addr = b.addr.clone();
        async move { request(&addr, "POST", "/stock/reduce", Some(&body)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&a, "CONT");
    let fresh = fresh.await.expect("join").expect("B answers");
    let stale = slow.await.expect("join").expect("A answers");
    let product = request(&b.addr, "GET", "/products/500", None).await.expect("GET").json;
    (fresh, stale, product)
}

/// A holder whose lease ran out while it was stopped cannot oversell: its
/// write carries the old fencing token, the store refuses it, and it
/// answers `409 lock_token_stale` with nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_holder_cannot_oversell() {
    let redis = RedisServer::start();
    let (fresh, stale, product) = stale_sale(&redis_env(&redis.url())).await;
    assert_eq!((fresh.status, &fresh.json["remaining"]), (200, &json!(9)), "{}", fresh.json);
    assert_eq!(stale.status, 409, "{}", stale.json);
    assert_eq!((&stale.json["error"], &stale.json["code"]), (&json!("lock_token_stale"), &json!(2105)));
    assert_eq!(stale.header("retry-after"), Some("1"));
    assert_eq!(product, json!({"id": 500, "stock": 9, "sold": 1}));
}

/// The control: the same sequence without the token in the write
/// (`ORDERS_UNFENCED=1`) sells two units and takes one off the stock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_fence_a_stale_holder_oversells() {
    let redis = RedisServer::start();
    let mut env = redis_env(&redis.url());
    env.push(("ORDERS_UNFENCED", "1".into()));
    let (fresh, stale, product) = stale_sale(&env).await;
    assert_eq!((fresh.status, stale.status), (200, 200), "{} {}", fresh.json, stale.json);
    assert_eq!(product, json!({"id": 500, "stock": 9, "sold": 1}), "two sold, one taken off: the oversell");
}

/// The PostgreSQL store: stock, orders and fences in one database
/// (`ORDERS_POSTGRES_URL`), the locks in Redis.
#[cfg(feature = "postgres")]
fn postgres_env(redis: &RedisServer, pg: &dlock_testing::PostgresServer) -> Vec<(&'static str, String)> {
    vec![("DLOCK_BACKEND", "redis".into()), ("DLOCK_REDIS_URL", redis.url()), ("ORDERS_POSTGRES_URL", pg.url())]
}

/// On the PostgreSQL store a holder stopped inside its sale's transaction
/// holds the fence's row lock: the next holder's sale waits for it and then
/// reads what it wrote. Both sales count; nothing is oversold.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_stale_holder_inside_its_transaction_is_ordered_first() {
    let (redis, pg) = (RedisServer::start(), dlock_testing::PostgresServer::start());
    let (fresh, stale, product) = stale_sale(&postgres_env(&redis, &pg)).await;
    assert_eq!((fresh.status, stale.status), (200, 200), "{} {}", fresh.json, stale.json);
    assert_eq!(product, json!({"id": 500, "stock": 8, "sold": 2}));
}

/// Its control: without the token the same pause loses B's sale.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_without_the_fence_a_stale_holder_oversells() {
    let (redis, pg) = (RedisServer::start(), dlock_testing::PostgresServer::start());
    let mut env = postgres_env(&redis, &pg);
    env.push(("ORDERS_UNFENCED", "1".into()));
    let (fresh, stale, product) = stale_sale(&env).await;
    assert_eq!((fresh.status, stale.status), (200, 200), "{} {}", fresh.json, stale.json);
    assert_eq!(product, json!({"id": 500, "stock": 9, "sold": 1}), "two sold, one taken off");
}

/// `requests` concurrent one-unit sales on `path`, alternating instances,
/// of a product of stock 50: (answers by status and error, the product).
#[cfg(feature = "postgres")]
async fn db_burst(instances: &[&Orders], path: &str, id: u64, requests: usize) -> (Vec<(u16, String)>, Value) {
    let put = request(&instances[0].addr, "PUT", &format!("/products/{id}"), Some(&json!({"stock": 50})))
        .await
        .expect("PUT product");
    assert_eq!(put.status, 200, "{}", put.json);
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let addr = instances[i % instances.len()].addr.clone();
            let (path, body) = (path.to_owned(), json!({"product_id": id, "quantity": 1}));
            tokio::spawn(async move { request(&addr, "POST", &path, Some(&body)).await })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        let r = t.await.expect("task").expect("answered");
        answers.push((r.status, r.json["error"].as_str().unwrap_or_default().to_owned()));
    }
    let product = request(&instances[0].addr, "GET", &format!("/products/{id}"), None).await.expect("GET").json;
    (answers, product)
}

#[cfg(feature = "postgres")]
fn count(answers: &[(u16, String)], status: u16, error: &str) -> usize {
    answers.iter().filter(|(s, e)| *s == status && e == error).count()
}

/// `SELECT … FOR UPDATE`, no dlock lock: two instances sell exactly the
/// stock, every sale queued on the product's row.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_select_for_update_sells_exactly_the_stock() {
    let (redis, pg) = (RedisServer::start(), dlock_testing::PostgresServer::start());
    let env = postgres_env(&redis, &pg);
    let (a, b) = (Orders::start(&as_refs(&env)).await, Orders::start(&as_refs(&env)).await);
    let (answers, product) = db_burst(&[&a, &b], "/db/stock/reduce-for-update", 601, 120).await;
    assert_eq!((count(&answers, 200, ""), count(&answers, 409, "sold_out")), (50, 70), "{answers:?}");
    assert_eq!(product, json!({"id": 601, "stock": 0, "sold": 50}));
}

/// An optimistic `version` column, no lock at all: a lost race reads again
/// (or gives up as `409 stock_contended`); what was answered sold is
/// exactly what left the stock.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_version_column_loses_no_sale() {
    let (redis, pg) = (RedisServer::start(), dlock_testing::PostgresServer::start());
    let env = postgres_env(&redis, &pg);
    let (a, b) = (Orders::start(&as_refs(&env)).await, Orders::start(&as_refs(&env)).await);
    let (answers, product) = db_burst(&[&a, &b], "/db/stock/reduce-optimistic", 602, 120).await;
    let (ok, out, contended) =
        (count(&answers, 200, ""), count(&answers, 409, "sold_out"), count(&answers, 409, "stock_contended"));
    assert_eq!(ok + out + contended, 120, "{answers:?}");
    let (stock, sold) = (product["stock"].as_i64().expect("stock"), product["sold"].as_i64().expect("sold"));
    assert_eq!((sold, stock + sold), (ok as i64, 50), "{product} {answers:?}");
    assert!(ok > 0, "{answers:?}");
}

/// A unique index on the order's `request_id`, no lock: twenty copies of one
/// order over two instances place one order and take the stock once; the
/// other copies answer that order.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_unique_index_places_one_order_per_request_id() {
    let (redis, pg) = (RedisServer::start(), dlock_testing::PostgresServer::start());
    let env = postgres_env(&redis, &pg);
    let (a, b) = (Orders::start(&as_refs(&env)).await, Orders::start(&as_refs(&env)).await);
    let put = request(&a.addr, "PUT", "/products/603", Some(&json!({"stock": 10}))).await.expect("PUT");
    assert_eq!(put.status, 200);
    let body = json!({"request_id": "req-1", "product": {"id": 603}, "quantity": 2});
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let (addr, body) = (if i % 2 == 0 { &a.addr } else { &b.addr }.clone(), body.clone());
            tokio::spawn(async move { request(&addr, "POST", "/db/orders", Some(&body)).await })
        })
        .collect();
    let mut created = 0;
    let mut order_ids = std::collections::HashSet::new();
    for t in tasks {
        let r = t.await.expect("task").expect("answered");
        assert!(r.status == 201 || r.status == 200, "{} {}", r.status, r.json);
        created += usize::from(r.status == 201);
        order_ids.insert(r.json["order_id"].as_str().expect("order_id").to_owned());
    }
    assert_eq!((created, order_ids.len()), (1, 1));
    let product = request(&a.addr, "GET", "/products/603", None).await.expect("GET").json;
    assert_eq!(product, json!({"id": 603, "stock": 8, "sold": 2}));
    // Another request id is another order.
    let other = json!({"request_id": "req-2", "product": {"id": 603}, "quantity": 2});
    assert_eq!(request(&b.addr, "POST", "/db/orders", Some(&other)).await.expect("answered").status, 201);
}

/// Issue 37: RedLock cannot keep the export route's semaphore of two
/// permits. The service starts anyway, says so once at start-up (a `WARN`
/// naming the route and the backend), answers that route alone with
/// `501 lock_mode_unsupported` as Problem Details saying why, and serves
/// every other route, locked ones included, on the RedLock set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redlock_only_the_export_route_is_refused() {
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls = nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(",");
    // Idempotency records (the order tokens) on a Redis of their own.
    let records = RedisServer::start();
    let records_url = records.url();
    let env = [
        ("DLOCK_BACKEND", "redlock"),
        ("DLOCK_REDLOCK_URLS", urls.as_str()),
        ("DLOCK_IDEMPOTENCY_REDIS_URL", &records_url),
    ];
    let (orders, startup) = Orders::start_logged(&env).await;
    let addr = orders.addr.as_str();

    let warned: Vec<&String> = startup.iter().filter(|l| l.contains(" WARN ") && l.contains("/export")).collect();
    assert_eq!(warned.len(), 1, "one WARN about the export route: {startup:#?}");
    assert!(warned[0].contains("POST /users/{user}/export") && warned[0].contains("redlock"), "{}", warned[0]);
    let health = request(addr, "GET", "/health", None).await.expect("health");
    assert_eq!(health.json, json!({"status": "ok", "backend": "redlock"}));

    let export = request(addr, "POST", "/users/alice/export", None).await.expect("POST");
    assert_eq!(export.status, 501, "{}", export.json);
    assert_eq!(export.header("content-type"), Some("application/problem+json"));
    assert_eq!(export.header("retry-after"), None, "permanent: only another backend serves it");
    assert_eq!(
        (export.json["error"].as_str(), export.json["code"].as_u64(), export.json["status"].as_u64()),
        (Some("lock_mode_unsupported"), Some(2902), Some(501))
    );
    let detail = export.json["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("redlock") && detail.contains("2 exports"), "{detail}");
    let get = request(addr, "GET", "/users/alice/export", None).await.expect("GET");
    assert_eq!((get.status, get.json["error"].as_str()), (405, Some("method_not_allowed")));

    // Every other route, on the RedLock set: a sale behind `LockLayer`, a
    // transfer holding two accounts, an order spending its token.
    let put = request(addr, "PUT", "/products/5", Some(&json!({"stock": 3}))).await.expect("PUT");
    assert_eq!(put.status, 200, "{}", put.json);
    let sale = request(addr, "POST", "/stock/reduce", Some(&json!({"product_id": 5, "quantity": 1}))).await;
    assert_eq!(sale.map(|r| (r.status, r.json)), Ok((200, json!({"product_id": 5, "remaining": 2}))));
    for id in [1, 2] {
        let put = request(addr, "PUT", &format!("/accounts/{id}"), Some(&json!({"balance": 100}))).await;
        assert_eq!(put.map(|r| r.status), Ok(200));
    }
    let transfer =
        request(addr, "POST", "/transfers", Some(&json!({"from": 1, "to": 2, "amount": 30}))).await.expect("POST");
    assert_eq!(transfer.status, 200, "{}", transfer.json);
    assert_eq!(transfer.json["to"]["balance"], 130);
    let token = request(addr, "GET", "/idempotency/token", None).await.expect("token");
    let token = token.json["token"].as_str().expect("a token").to_owned();
    let order = json!({"product": {"id": 5}, "quantity": 1});
    let placed = request(addr, "POST", &format!("/orders?token={token}"), Some(&order)).await.expect("POST");
    assert_eq!(placed.status, 201, "{}", placed.json);
}
