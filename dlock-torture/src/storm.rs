//! `idempotency-storm`: duplicate submissions (Idempotency-Keys on
//! `POST /charges`, one-time tokens on `POST /orders`) across two `orders`
//! processes sharing one Redis, one of them killed with SIGKILL mid-storm.
//! `POST /charges` has no deduplication of its own (it counts its runs per
//! order), so `IdempotencyLayer` alone is under test: at most one fresh 2xx
//! per key, every 2xx of a key byte-identical, a key run twice only when its
//! first run died with A (the documented crash window), no 5xx from a live
//! instance, and no key in progress past its lease: afterwards every key is
//! retried on the survivor until it answers 2xx.
//!
//! The `orders` binary is looked up next to this one (`cargo test` and
//! `cargo build --workspace` put it there; for `cargo run --bin
//! dlock-torture` run `cargo build --bin orders` first), or at
//! `DLOCK_TORTURE_ORDERS_BIN`. Missing, the row fails.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_testing::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::harness::Report;
use crate::rng::Rng;
use crate::scenario::Size;

/// In-progress lease of `POST /payments` given to both instances.
const LEASE: Duration = Duration::from_millis(3000);
/// Slack past the lease for the survivor to answer a freed key.
const MARGIN: Duration = Duration::from_millis(3000);

fn orders_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("DLOCK_TORTURE_ORDERS_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("DLOCK_TORTURE_ORDERS_BIN={} is not a file", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate this binary: {e}"))?;
    let dir = exe.parent().ok_or("this binary has no directory")?;
    let p = dir.join(format!("orders{}", std::env::consts::EXE_SUFFIX));
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!("the `orders` binary is not at {} (run `cargo build --workspace --all-features --bin orders` first, or set DLOCK_TORTURE_ORDERS_BIN)", p.display()))
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    replayed: bool,
    body: String,
}

/// One HTTP/1.1 request on a fresh connection (`connection: close`).
async fn request(addr: &str, method: &str, path: &str, key: Option<&str>, body: &str) -> Result<Reply, String> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n", body.len());
    if let Some(k) = key {
        // One caller: `orders` scopes its Idempotency-Key records by the
        // `Authorization` header and refuses a request without one.
        head.push_str(&format!("idempotency-key: {k}\r\nauthorization: Bearer storm\r\n"));
    }
    head.push_str("\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        stream.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        stream.write_all(body.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| "no answer within 30 s".to_owned())??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("connection closed before the headers ended")?;
    let mut lines = head.lines();
    let status =
        lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok()).ok_or("no status line")?;
    let replayed = lines.any(|l| {
        l.split_once(':')
            .is_some_and(|(n, v)| n.trim().eq_ignore_ascii_case("idempotent-replayed") && v.trim() == "true")
    });
    Ok(Reply { status, replayed, body: body.to_owned() })
}

/// Whether a reaped child died of SIGKILL (and not of anything else, or
/// still unknown because it could not be waited for).
fn killed_by_sigkill(status: std::io::Result<std::process::ExitStatus>) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.is_ok_and(|s| s.signal() == Some(rustix::process::Signal::KILL.as_raw()))
}

/// One `orders` process; killed (SIGKILL) on drop if still running.
struct Orders {
    child: Child,
    addr: String,
}

impl Orders {
    async fn start(bin: &PathBuf, redis_url: &str, charges_unguarded: bool) -> Result<Orders, String> {
        let mut child = Command::new(bin)
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("DLOCK_BACKEND", "redis")
            .env("DLOCK_REDIS_URL", redis_url)
            .env("ORDERS_REDIS_URL", redis_url)
            // The token rate per address is not what this storm measures.
            .env("ORDERS_TOKEN_RATE", "100000")
            .env("ORDERS_PAYMENT_LEASE_MS", LEASE.as_millis().to_string())
            .env_remove("ORDERS_UNLOCKED")
            .env("ORDERS_CHARGES_UNGUARDED", if charges_unguarded { "1" } else { "0" })
            .env_remove("DLOCK_IDEMPOTENCY_REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut orders = Orders { child, addr: String::new() };
        orders.addr = tokio::task::spawn_blocking(move || {
            dlock_testing::announced_address(stdout, Duration::from_secs(30), None)
        })
        .await
        .map_err(|e| e.to_string())??;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if matches!(request(&orders.addr, "GET", "/health", None, "").await, Ok(r) if r.status == 200) {
                return Ok(orders);
            }
            if Instant::now() > deadline {
                return Err("orders not healthy within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone, Copy)]
enum Job {
    Pay(u32),
    Token(u32),
}

#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    executed: u64,
    replays: u64,
    in_progress_409: u64,
    duplicate_409: u64,
    killed_errors: u64,
    survivor_errors: u64,
    other: HashMap<u16, u64>,
    token_created: Vec<u32>,
    /// Fresh (not replayed) 2xx answers per charge key.
    fresh: Vec<u32>,
    /// The first 2xx body per charge key: every later one must equal it.
    bodies: Vec<Option<String>>,
    /// 2xx answers whose body differed from their key's first.
    body_mismatch: Vec<String>,
    /// Keys with a request that A left unanswered when it died: sent to A
    /// while it was alive and never answered. Their first run may have died
    /// with A after its side effect, before its answer was stored, and run
    /// again on B (the documented crash window). A request routed to A once
    /// it was dead never reached it, and puts nothing in doubt.
    in_doubt: Vec<bool>,
    /// Requests sent to A while it was alive and still unanswered when it
    /// was killed: what the in-doubt keys are bounded by.
    cut_by_kill: u64,
    /// 5xx answers from an instance that was alive.
    live_5xx: u64,
    sample: Option<String>,
}

pub(crate) async fn run(size: Size, seed: u64) -> Result<Report, String> {
    storm(size, seed, false).await
}

/// The negative control of `checker-self-test`: the same storm with
/// `POST /charges` served without `IdempotencyLayer`
/// (`ORDERS_CHARGES_UNGUARDED=1`); the storm's checks must catch duplicates
/// running twice.
pub(crate) async fn run_unguarded(size: Size, seed: u64) -> Result<Report, String> {
    storm(size, seed, true).await
}

async fn storm(size: Size, seed: u64, unguarded: bool) -> Result<Report, String> {
    let mut r = if unguarded {
        let mut r = Report::new("checker-self-test", "broken-no-idempotency", seed);
        r.tokens_promised = false;
        r.fault_kind = "none (the route has no idempotency layer)".into();
        r
    } else {
        let mut r = Report::new("idempotency-storm", "redis+orders", seed);
        r.expected_safe = true;
        r.fault_kind = "kill -9 orders A mid-storm".into();
        r
    };
    let bin = match orders_binary() {
        Ok(b) => b,
        Err(e) => {
            r.fail(e);
            return Ok(r);
        }
    };
    let (keys, dups, tokens, inflight) =
        if size.short { (200u32, 10u32, 20u32, 64usize) } else { (1000, 10, 100, 128) };
    r.processes = 2;
    r.tasks = inflight as u32;
    r.keys = keys;
    r.lease_ms = LEASE.as_millis() as u64;

    let redis = RedisServer::start();
    let url = redis.url();
    let a = Arc::new(Mutex::new(Some(Orders::start(&bin, &url, unguarded).await?)));
    let b = Orders::start(&bin, &url, unguarded).await?;
    let a_addr = a.lock().map_err(|_| "poisoned")?.as_ref().map(|o| o.addr.clone()).unwrap_or_default();
    let b_addr = b.addr.clone();
    let stock = request(&b_addr, "PUT", "/products/9", None, &format!(r#"{{"stock": {}}}"#, tokens * 10)).await?;
    if stock.status != 200 {
        return Err(format!("PUT /products/9: {} {}", stock.status, stock.body));
    }
    let mut token_list = Vec::new();
    for _ in 0..tokens {
        let t = request(&b_addr, "GET", "/idempotency/token", None, "").await?;
        let v: serde_json::Value = serde_json::from_str(&t.body)
            .map_err(|e| format!("token reply {} not JSON ({e}): {}", t.status, t.body))?;
        token_list.push(v["token"].as_str().ok_or_else(|| format!("no token in {}", t.body))?.to_owned());
    }
    let token_list = Arc::new(token_list);

    // Every duplicate of every logical request, each to A or B at random,
    // in a rolling wave: a request's duplicates are sent close together (a
    // jitter of 5 % of the run), so requests are in progress on A all along
    // the storm, and when A dies.
    let mut rng = Rng::new(seed);
    let mut jobs: Vec<(u64, Job, bool)> = Vec::new();
    let span = 1_000_000u64;
    for _ in 0..dups {
        for i in 0..keys {
            jobs.push((u64::from(i) * span / u64::from(keys) + rng.below(span / 20), Job::Pay(i), rng.chance(0.5)));
        }
        for t in 0..tokens {
            jobs.push((u64::from(t) * span / u64::from(tokens) + rng.below(span / 20), Job::Token(t), rng.chance(0.5)));
        }
    }
    jobs.sort_by_key(|j| j.0);
    let total = jobs.len() as u64;
    let kill_after = total / 4 + rng.below(total / 4);

    let tally = Arc::new(Mutex::new(Tally {
        token_created: vec![0; tokens as usize],
        fresh: vec![0; keys as usize],
        bodies: vec![None; keys as usize],
        in_doubt: vec![false; keys as usize],
        ..Tally::default()
    }));
    let done = Arc::new(AtomicU64::new(0));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let gate = Arc::new(Semaphore::new(inflight));
    let started = Instant::now();
    // Whether A was seen to die of the SIGKILL while the storm ran: the
    // row's fault, counted once A is reaped, not because it was sent.
    let mut reaped_mid_storm = false;
    let mut handles = Vec::with_capacity(jobs.len());
    for (_, job, to_a) in jobs {
        let permit = gate.clone().acquire_owned().await.map_err(|e| e.to_string())?;
        if done.load(Ordering::SeqCst) >= kill_after {
            let mut k = killed_at.lock().map_err(|_| "poisoned")?;
            if k.is_none() {
                if let Some(mut o) = a.lock().map_err(|_| "poisoned")?.take() {
                    o.child.kill().map_err(|e| format!("kill -9 A: {e}"))?;
                    reaped_mid_storm = killed_by_sigkill(o.child.wait());
                }
                *k = Some(Instant::now());
            }
        }
        let (addr, tally, done, tokens) =
            (if to_a { a_addr.clone() } else { b_addr.clone() }, tally.clone(), done.clone(), token_list.clone());
        let killed_at = killed_at.clone();
        handles.push(tokio::spawn(async move {
            // Whether A was alive when this request set out to it.
            let sent_to_live_a = to_a && killed_at.lock().map(|k| k.is_none()).unwrap_or(false);
            let reply = match job {
                Job::Pay(i) => {
                    request(
                        &addr,
                        "POST",
                        "/charges",
                        Some(&format!("storm-{seed}-{i}")),
                        &format!(r#"{{"order_id": "ord_{i}", "amount": {}}}"#, 100 + i),
                    )
                    .await
                }
                Job::Token(t) => {
                    request(
                        &addr,
                        "POST",
                        &format!("/orders?token={}", tokens[t as usize]),
                        None,
                        r#"{"product": {"id": 9}, "quantity": 1}"#,
                    )
                    .await
                }
            };
            done.fetch_add(1, Ordering::SeqCst);
            drop(permit);
            let a_dead = killed_at.lock().map(|k| k.is_some()).unwrap_or(true);
            let Ok(mut t) = tally.lock() else { return };
            t.requests += 1;
            // Unanswered because A died with it: sent while A lived, and the
            // exchange broke after it connected (a refused connection sent
            // nothing). An answer, 5xx included, is not a request in doubt.
            let cut = sent_to_live_a && a_dead && reply.as_ref().is_err_and(|e| !e.starts_with("connect:"));
            t.cut_by_kill += u64::from(cut);
            if let (Job::Pay(i), true) = (job, cut) {
                t.in_doubt[i as usize] = true;
            }
            if let (Job::Pay(i), Ok(rep)) = (job, &reply) {
                if (200..300).contains(&rep.status) {
                    t.check_body(i, &rep.body, seed);
                }
            }
            match (job, reply) {
                (_, Err(_)) if to_a && a_dead => t.killed_errors += 1,
                (_, Err(e)) => {
                    t.survivor_errors += 1;
                    t.sample.get_or_insert(e);
                }
                (_, Ok(rep)) if rep.status >= 500 && to_a && a_dead => t.killed_errors += 1,
                (_, Ok(rep)) if rep.status >= 500 => {
                    t.live_5xx += 1;
                    t.sample.get_or_insert(format!("{} {}", rep.status, rep.body));
                }
                (Job::Pay(_), Ok(rep)) if (200..300).contains(&rep.status) && rep.replayed => t.replays += 1,
                (Job::Pay(i), Ok(rep)) if (200..300).contains(&rep.status) => {
                    t.executed += 1;
                    t.fresh[i as usize] += 1;
                }
                (Job::Pay(_), Ok(rep)) if rep.status == 409 && rep.body.contains("idempotency_request_in_progress") => {
                    t.in_progress_409 += 1
                }
                (Job::Token(k), Ok(rep)) if rep.status == 201 => t.token_created[k as usize] += 1,
                // The order's lock held by the running submit, or the token
                // already spent (its own code since issue 15).
                (Job::Token(_), Ok(rep))
                    if rep.status == 409
                        && (rep.body.contains("duplicate_submission")
                            || rep.body.contains("idempotency_token_unknown")) =>
                {
                    t.duplicate_409 += 1
                }
                (_, Ok(rep)) => {
                    *t.other.entry(rep.status).or_default() += 1;
                    t.sample.get_or_insert(format!("{} {}", rep.status, rep.body));
                }
            }
        }));
    }
    for h in handles {
        h.await.map_err(|e| e.to_string())?;
    }
    let storm_s = started.elapsed().as_secs_f64();
    let killed = killed_at.lock().map_err(|_| "poisoned")?.unwrap_or_else(Instant::now);
    if let Some(mut o) = a.lock().map_err(|_| "poisoned")?.take() {
        // The storm ended before the kill point: a kill now injects nothing
        // into the storm, so it is not counted.
        let _ = o.child.kill();
        let _ = o.child.wait();
        r.note("the storm ended before A's kill point: A was killed after it, and no fault is counted");
    }
    r.faults = u64::from(reaped_mid_storm);

    // Every key must answer 2xx on the survivor within lease + margin.
    let deadline = std::cmp::max(killed + LEASE, Instant::now()) + MARGIN;
    let retry_gate = Arc::new(Semaphore::new(inflight));
    let mut retries = Vec::new();
    for i in 0..keys {
        let (addr, gate) = (b_addr.clone(), retry_gate.clone());
        retries.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.ok();
            let mut sent = 0u64;
            loop {
                sent += 1;
                let rep = request(
                    &addr,
                    "POST",
                    "/charges",
                    Some(&format!("storm-{seed}-{i}")),
                    &format!(r#"{{"order_id": "ord_{i}", "amount": {}}}"#, 100 + i),
                )
                .await;
                match rep {
                    Ok(rep) if (200..300).contains(&rep.status) => {
                        return (sent, Ok((Instant::now(), !rep.replayed, rep.body)))
                    }
                    Ok(rep) if Instant::now() > deadline => {
                        return (sent, Err(format!("{} {}", rep.status, rep.body.trim())))
                    }
                    Err(e) if Instant::now() > deadline => return (sent, Err(e)),
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }));
    }
    let (mut stuck, mut recovery, mut retry_requests, mut retry_fresh) =
        (Vec::new(), Duration::ZERO, 0u64, vec![0u32; keys as usize]);
    for (i, h) in retries.into_iter().enumerate() {
        let (sent, outcome) = h.await.map_err(|e| e.to_string())?;
        retry_requests += sent;
        match outcome {
            Ok((at, fresh, body)) => {
                recovery = recovery.max(at.saturating_duration_since(killed));
                retry_fresh[i] += u32::from(fresh);
                tally.lock().map_err(|_| "poisoned")?.check_body(i as u32, &body, seed);
            }
            Err(last) => stuck.push(format!("storm-{seed}-{i} ({last})")),
        }
    }

    // Runs per logical charge: the counter `POST /charges` increments.
    let mut conn = redis.connection();
    let names: Vec<String> = (0..keys).map(|i| format!("orders:charges:ord_{i}")).collect();
    let runs: Vec<Option<u64>> = redis::cmd("MGET").arg(&names).query(&mut conn).map_err(|e| e.to_string())?;
    let runs: Vec<u64> = runs.into_iter().map(Option::unwrap_or_default).collect();
    let missing = runs.iter().filter(|&&n| n == 0).count();
    let product = request(&b_addr, "GET", "/products/9", None, "").await?;
    let sold = serde_json::from_str::<serde_json::Value>(&product.body)
        .ok()
        .and_then(|v| v["sold"].as_u64())
        .ok_or_else(|| format!("GET /products/9: {}", product.body))?;

    let t = tally.lock().map_err(|_| "poisoned")?;
    let in_doubt = t.in_doubt.iter().filter(|&&d| d).count() as u64;
    // A key run twice is a double execution, unless A left a request of it
    // unanswered when it died: the first run may have made its side effect
    // and died before its answer was stored, and the key ran again on B after
    // the lease — the crash window the README documents, which only the
    // route's own deduplication closes. Two fresh answers for one key are
    // the layer's failure whatever A did.
    let (mut doubled, mut crash_window, mut pay_double) = (Vec::new(), 0u64, 0u64);
    for (i, (storm, retry)) in t.fresh.iter().zip(&retry_fresh).enumerate() {
        let (n, seen) = (runs[i], storm + retry);
        let allowed = if t.in_doubt[i] { 2 } else { 1 };
        if n > allowed || seen > 1 {
            pay_double += n.saturating_sub(1).max(u64::from(seen.saturating_sub(1)));
            doubled.push(format!(
                "storm-{seed}-{i}: {n} runs, {seen} fresh 2xx answers{}",
                if t.in_doubt[i] { " (A died with a request of it)" } else { "" }
            ));
        } else if n == 2 {
            crash_window += 1;
        }
    }
    let token_double: u64 = t.token_created.iter().map(|&n| u64::from(n.saturating_sub(1))).sum();
    let tokens_spent = t.token_created.iter().filter(|&&n| n > 0).count();
    let sold_double = sold.saturating_sub(u64::from(tokens));
    let doubles = pay_double + token_double + sold_double;
    r.operations = t.requests + retry_requests;
    r.lost_updates = doubles;
    r.overlaps = doubles;
    r.recovery_max_ms = Some(recovery.as_secs_f64() * 1000.0);
    r.note(format!(
        "{keys} keys x {dups} + {tokens} tokens x {dups} in {storm_s:.1} s, A killed after {kill_after}/{total}: charges {} fresh 2xx, {} replayed, {} x 409 in progress, {in_doubt} keys in doubt (A died with one of their requests: {} requests to A cut by the kill, of {inflight} in flight at most), {crash_window} of them run again on B (crash window); tokens {tokens_spent}/{tokens} spent by one 201, {} x 409 duplicate, {sold} sold; {} killed-instance errors (expected), {} survivor errors, {} 5xx from a live instance, other {:?}; {retry_requests} retries on B, every key 2xx within {:.0} ms of the kill",
        t.executed, t.replays, t.in_progress_409, t.cut_by_kill, t.duplicate_409, t.killed_errors, t.survivor_errors, t.live_5xx, t.other, recovery.as_secs_f64() * 1000.0
    ));
    if let Some(s) = &t.sample {
        r.note(format!("first unexpected answer: {s}"));
    }
    if unguarded {
        // The control: caught when the checks below the layer saw a charge
        // run twice or two different answers for one key.
        let caught = pay_double > 0 || !t.body_mismatch.is_empty();
        r.caught = Some(caught);
        r.note(format!(
            "must fire: double executions {pay_double}, 2xx answers unlike their key's first {}",
            t.body_mismatch.len()
        ));
        if !caught {
            r.fail("the storm's checks did not catch duplicates running without IdempotencyLayer");
        }
        return Ok(r);
    }
    if doubles > 0 {
        r.fail(format!(
            "double executions: {pay_double} charges ({}), {token_double} tokens with two 201s, {sold_double} orders beyond the token count",
            doubled.iter().take(5).cloned().collect::<Vec<_>>().join(", "),
        ));
    }
    if !stuck.is_empty() {
        r.fail(format!(
            "{} key(s) stuck past lease + {MARGIN:?}: {}",
            stuck.len(),
            stuck.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    if missing > 0 && stuck.is_empty() {
        r.fail(format!("{missing} key(s) answered 2xx with no charge made"));
    }
    if !t.body_mismatch.is_empty() {
        r.fail(format!(
            "{} 2xx answer(s) unlike their key's first (a replay must be byte-identical): {}",
            t.body_mismatch.len(),
            t.body_mismatch.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
        ));
    }
    if t.live_5xx > 0 {
        r.fail(format!("{} 5xx answer(s) from an instance that was alive", t.live_5xx));
    }
    if t.survivor_errors > 0 {
        r.fail(format!("{} request(s) to the surviving instance failed at the connection", t.survivor_errors));
    }
    if t.executed == 0 || tokens_spent == 0 {
        r.fail("the storm executed nothing");
    }
    // A key is in doubt only for a request A had when it died: no more
    // than were in flight. More would excuse double runs A never caused.
    if in_doubt > inflight as u64 || t.cut_by_kill > inflight as u64 {
        r.fail(format!(
            "{in_doubt} keys in doubt ({} requests cut by the kill) with at most {inflight} requests in flight",
            t.cut_by_kill
        ));
    }
    Ok(r)
}

impl Tally {
    /// Every 2xx of charge key `i` must carry the first one's body.
    fn check_body(&mut self, i: u32, body: &str, seed: u64) {
        match &self.bodies[i as usize] {
            None => self.bodies[i as usize] = Some(body.to_owned()),
            Some(first) if first != body => {
                self.body_mismatch.push(format!("storm-{seed}-{i}: {first} then {body}"));
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a child that died of SIGKILL counts as killed: one that exited
    /// on its own, or died of another signal, does not.
    #[test]
    fn a_kill_counts_only_once_the_child_died_of_it() {
        let mut victim = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        victim.kill().expect("kill");
        assert!(killed_by_sigkill(victim.wait()));
        let exited = std::process::Command::new("sh").args(["-c", "exit 0"]).status();
        assert!(!killed_by_sigkill(exited));
        let terminated = std::process::Command::new("sh").args(["-c", "kill -TERM $$"]).status();
        assert!(!killed_by_sigkill(terminated));
    }
}
