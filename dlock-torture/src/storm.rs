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
//! The idempotency records live behind a proxy that, for a tenth of the
//! storm from its middle, delivers the store's answers late
//! ([`hang_up::SLOW`]); meanwhile clients of keys of their own hang up at
//! random moments, some while their claim is in flight, then retry until
//! the key settles ([`hang_up`]): no such key may run twice or be left
//! claimed by nobody, and a run in which no hang-up landed while its claim
//! was in flight tested nothing and fails. A second row, the twin ([`twin`]), does the same with the claim
//! awaited in the request's own future (the old layer): its stranded claims
//! must be caught. Some token requests hang up too; their tokens are
//! checked for double spending (`orders` claims a token in its handler, so
//! a hang-up may leave it claimed, as its docs say).
//!
//! The `orders` binary is looked up next to this one (`cargo test` and
//! `cargo build --workspace` put it there; for `cargo run --bin
//! dlock-torture` run `cargo build --bin orders` first), or at
//! `DLOCK_TORTURE_ORDERS_BIN`. Missing, the row fails.

mod hang_up;
mod moment;
mod record;
mod tokens;
mod twin;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_testing::{FaultProxy, RedisServer};
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
/// The storm's schedule runs over `0..SPAN`; a tenth of it from its
/// middle, `SLOW_FROM..SLOW_TO`, with the store's answers
/// [`hang_up::SLOW`] late and the hang-ups in it. In the middle, so that a
/// hung-up key's retries overlap the rest of the storm and the wait for the
/// keys A died with.
const SPAN: u64 = 1_000_000;
const SLOW_FROM: u64 = SPAN / 2;
const SLOW_TO: u64 = SLOW_FROM + SPAN / 10;
/// The order every token request places.
const ORDER_BODY: &str = r#"{"product": {"id": 9}, "quantity": 1}"#;

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
        head.push_str(&format!("idempotency-key: {k}\r\nauthorization: {}\r\n", record::CALLER));
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
    /// An instance on `redis_url`, its idempotency records reached at
    /// `records_url` (the storm's proxy to the same Redis).
    async fn start(
        bin: &PathBuf,
        redis_url: &str,
        records_url: &str,
        charges_unguarded: bool,
    ) -> Result<Orders, String> {
        let mut child = Command::new(bin)
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("DLOCK_BACKEND", "redis")
            .env("DLOCK_REDIS_URL", redis_url)
            .env("ORDERS_REDIS_URL", redis_url)
            .env("DLOCK_IDEMPOTENCY_REDIS_URL", records_url)
            .env("DLOCK_PREFIX", record::PREFIX)
            .env("DLOCK_IDEMPOTENCY_TTL_SECS", record::TTL.as_secs().to_string())
            // The token rate per address is not what this storm measures.
            .env("ORDERS_TOKEN_RATE", "100000")
            .env("ORDERS_PAYMENT_LEASE_MS", LEASE.as_millis().to_string())
            .env_remove("ORDERS_UNLOCKED")
            .env("ORDERS_CHARGES_UNGUARDED", if charges_unguarded { "1" } else { "0" })
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
    /// A token request to B whose client hangs up this long after sending.
    TokenHangUp(u32, Duration),
    /// Hang-up client `j` of `orders`' own claim, or of the twin's.
    HangUp(usize),
    Twin(usize),
}

#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    executed: u64,
    replays: u64,
    in_progress_409: u64,
    duplicate_409: u64,
    /// Token requests answered `409` in progress: the token is claimed by a
    /// request still running, or by one whose client hung up.
    token_in_progress: u64,
    /// Token requests whose client hung up (to B, while the store is
    /// slow), and what their retries were answered.
    token_hang_ups: u64,
    token_retry: tokens::Retried,
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

/// The storm's row and its twin's ([`twin`]).
pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let (real, twin) = storm(size, seed, false).await?;
    Ok(std::iter::once(real).chain(twin).collect())
}

/// The negative control of `checker-self-test`: the same storm with
/// `POST /charges` served without `IdempotencyLayer`
/// (`ORDERS_CHARGES_UNGUARDED=1`); the storm's checks must catch duplicates
/// running twice.
pub(crate) async fn run_unguarded(size: Size, seed: u64) -> Result<Report, String> {
    storm(size, seed, true).await.map(|(r, _)| r)
}

/// The storm; with the route guarded, its hang-ups and the twin's row too.
async fn storm(size: Size, seed: u64, unguarded: bool) -> Result<(Report, Option<Report>), String> {
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
            return Ok((r, None));
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
    // The records reached through a proxy, which answers late while the
    // hang-ups run; locks, stock and charge counters straight.
    let proxy = FaultProxy::try_start(redis.port()).map_err(|e| format!("the records' proxy: {e}"))?;
    let records_url = format!("redis://127.0.0.1:{}", proxy.port());
    let a = Arc::new(Mutex::new(Some(Orders::start(&bin, &url, &records_url, unguarded).await?)));
    let b = Orders::start(&bin, &url, &records_url, unguarded).await?;
    let a_addr = a.lock().map_err(|_| "poisoned")?.as_ref().map(|o| o.addr.clone()).unwrap_or_default();
    let b_addr = b.addr.clone();
    let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
    let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    let hang_ups = !unguarded;
    // Dating claims and the twin's claims rest on the layer's naming, proved
    // on one request before the storm (`record::check`, `Twin::check`).
    let (dating, twin_check, twin) = if hang_ups {
        let probe = hang_up::Client::new(seed, "probe", 0, Duration::ZERO);
        let answer = request(&b_addr, "POST", "/charges", Some(&probe.key), &probe.body).await?;
        if answer.status != 201 {
            return Err(format!("the probe charge: {} {}", answer.status, answer.body));
        }
        let dating = record::check(&mut conn, &probe.key).await;
        let twin = twin::Twin::connect(&records_url, LEASE).await?;
        let twin_check = twin.check(&probe.key, &probe.body).await;
        (dating, twin_check, Some(Arc::new(twin)))
    } else {
        (Ok(()), Ok(()), None)
    };
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
    let span = SPAN;
    let slow = |at: u64| (SLOW_FROM..SLOW_TO).contains(&at);
    let after = |rng: &mut Rng| Duration::from_micros(rng.below(hang_up::LATEST_HANG_UP.as_micros() as u64));
    for _ in 0..dups {
        for i in 0..keys {
            jobs.push((u64::from(i) * span / u64::from(keys) + rng.below(span / 20), Job::Pay(i), rng.chance(0.5)));
        }
        for t in 0..tokens {
            let at = u64::from(t) * span / u64::from(tokens) + rng.below(span / 20);
            let (to_a, hang_up) = (rng.chance(0.5), rng.chance(0.5));
            let job = if hang_ups && slow(at) && !to_a && hang_up {
                Job::TokenHangUp(t, after(&mut rng))
            } else {
                Job::Token(t)
            };
            jobs.push((at, job, to_a));
        }
    }
    // Hang-up clients of keys of their own, spread over the slow tenth,
    // to B: the kill and the hang-ups do not excuse each other.
    let n_hang_ups = if hang_ups { size.pick(24u32, 100) } else { 0 };
    let real: Arc<Vec<hang_up::Client>> =
        Arc::new((0..n_hang_ups).map(|j| hang_up::Client::new(seed, "hup", j, after(&mut rng))).collect());
    let twins: Arc<Vec<hang_up::Client>> =
        Arc::new((0..n_hang_ups).map(|j| hang_up::Client::new(seed, "twin", j, after(&mut rng))).collect());
    for j in 0..n_hang_ups as usize {
        jobs.push((SLOW_FROM + rng.below(SLOW_TO - SLOW_FROM), Job::HangUp(j), false));
        jobs.push((SLOW_FROM + rng.below(SLOW_TO - SLOW_FROM), Job::Twin(j), false));
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
    let (mut real_handles, mut twin_handles) = (Vec::new(), Vec::new());
    let clients = hang_up::Storm {
        b: b_addr.clone(),
        redis: conn.clone(),
        done: done.clone(),
        hung: Arc::new(AtomicU64::new(0)),
        lease: LEASE,
    };
    let hang_up_clients = 2 * u64::from(n_hang_ups);
    // The store answers late from the slow tenth on, until every hang-up
    // client has hung up.
    let mut slowed = false;
    for (at, job, to_a) in jobs {
        let permit = gate.clone().acquire_owned().await.map_err(|e| e.to_string())?;
        if hang_ups && slow(at) && !slowed {
            proxy.set_delay(hang_up::SLOW);
            slowed = true;
        } else if slowed && at >= SLOW_TO && clients.hung.load(Ordering::SeqCst) >= hang_up_clients {
            proxy.set_delay(Duration::ZERO);
            slowed = false;
        }
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
        match job {
            Job::HangUp(j) => {
                let run = hang_up::run(hang_up::Front::Orders, real[j].clone(), clients.clone(), permit);
                real_handles.push((j, tokio::spawn(run)));
                continue;
            }
            Job::Twin(j) => {
                let Some(twin) = &twin else { continue };
                let front = hang_up::Front::Twin(twin.clone());
                let run = hang_up::run(front, twins[j].clone(), clients.clone(), permit);
                twin_handles.push((j, tokio::spawn(run)));
                continue;
            }
            Job::TokenHangUp(k, after) => {
                let (b, tally, done, tokens) = (b_addr.clone(), tally.clone(), done.clone(), token_list.clone());
                handles.push(tokio::spawn(async move {
                    let Some(token) = tokens.get(k as usize) else { return };
                    let path = format!("/orders?token={token}");
                    let sent = hang_up::send_and_hang_up(&b, &path, None, ORDER_BODY, after).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    drop(permit);
                    tokio::time::sleep(tokens::RETRY_AFTER).await;
                    let answer = tokens::ask(&b, token).await;
                    let Ok(mut t) = tally.lock() else { return };
                    t.requests += 2;
                    t.token_hang_ups += 1;
                    if let Err(e) = sent {
                        t.survivor_errors += 1;
                        t.sample.get_or_insert(e);
                    }
                    if matches!(&answer, Ok(rep) if rep.status == 201) {
                        t.token_created[k as usize] += 1;
                    }
                    t.token_retry.file(k, answer);
                }));
                continue;
            }
            Job::Pay(_) | Job::Token(_) => {}
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
                    request(&addr, "POST", &format!("/orders?token={}", tokens[t as usize]), None, ORDER_BODY).await
                }
                Job::TokenHangUp(..) | Job::HangUp(_) | Job::Twin(_) => return,
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
            if let (Job::Pay(i), Ok(rep)) = (job, &reply)
                && (200..300).contains(&rep.status)
            {
                t.check_body(i, &rep.body, seed);
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
                (Job::Token(_), Ok(rep))
                    if rep.status == 409 && rep.body.contains("idempotency_request_in_progress") =>
                {
                    t.token_in_progress += 1
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
    // Every hang-up client hangs up within a connect, its wait and a
    // claim's answer (the twin's); then the store may answer on time.
    let hung_by = Instant::now() + Duration::from_secs(10);
    while slowed && clients.hung.load(Ordering::SeqCst) < hang_up_clients && Instant::now() < hung_by {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.set_delay(Duration::ZERO);
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

    // The hung-up keys' retries have gone on meanwhile; each client's
    // outcome at its own index (they were sent in time order).
    let (mut real_outcomes, mut twin_outcomes) = (Vec::new(), Vec::new());
    for (handles, outcomes) in [(real_handles, &mut real_outcomes), (twin_handles, &mut twin_outcomes)] {
        for (j, h) in handles {
            outcomes.push((j, h.await.map_err(|e| e.to_string())?));
        }
        outcomes.sort_by_key(|(j, _)| *j);
    }
    let real_outcomes: Vec<hang_up::Outcome> = real_outcomes.into_iter().map(|(_, o)| o).collect();
    let twin_outcomes: Vec<hang_up::Outcome> = twin_outcomes.into_iter().map(|(_, o)| o).collect();

    // Runs per logical charge: the counter `POST /charges` increments.
    let names: Vec<String> = (0..keys).map(|i| format!("orders:charges:ord_{i}")).collect();
    let runs = counts(&mut conn, &names).await?;
    let missing = runs.iter().filter(|&&n| n == 0).count();
    let real_runs = counts(&mut conn, &real.iter().map(hang_up::Client::runs_key).collect::<Vec<_>>()).await?;
    let twin_runs = counts(&mut conn, &twins.iter().map(hang_up::Client::runs_key).collect::<Vec<_>>()).await?;
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
    // the lease — the crash window `docs/idempotency.md` documents, which only the
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
    // The hung-up keys: the route run once per key, whatever the moment.
    let hung = hang_up::Tally::of(&real, &real_outcomes, &real_runs);
    pay_double += hung.extra_runs;
    doubled.extend(hung.doubled.iter().cloned());
    let token_double: u64 = t.token_created.iter().map(|&n| u64::from(n.saturating_sub(1))).sum();
    let tokens_spent = t.token_created.iter().filter(|&&n| n > 0).count();
    let sold_double = sold.saturating_sub(u64::from(tokens));
    let doubles = pay_double + token_double + sold_double;
    r.operations = t.requests + retry_requests + hung.requests;
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
        return Ok((r, None));
    }
    r.note(format!(
        "store answers {:?} late over a tenth of the storm; {}; token requests hung up {}, each token asked once more {:?} later: {} spent, {} still claimed (by a hung-up request or a running one), {} spent by that retry; {} x 409 in progress to other token requests",
        hang_up::SLOW,
        hung.note("hang-ups"),
        t.token_hang_ups,
        tokens::RETRY_AFTER,
        t.token_retry.spent,
        t.token_retry.claimed,
        t.token_retry.fresh.len(),
        t.token_in_progress,
    ));
    r.faults += hung.in_flight;
    r.residual_keys = Some(hung.unsettled.len() as u64);
    if let Err(e) = &dating {
        r.fail(format!("cannot date the hang-ups against their claims: {e}"));
    }
    hang_up::judge(&mut r, &hung);
    if let Some(other) = t.token_retry.other.first() {
        // A refusal is no double spend: the order's lock still held by A's
        // kill (`lock_wait_timeout`), say.
        r.note(format!(
            "hung-up tokens asked once more answered otherwise {} time(s), first {other}",
            t.token_retry.other.len()
        ));
    }
    if t.token_retry.fives > 0 {
        r.fail(format!("{} 5xx answer(s) to hung-up tokens' retries", t.token_retry.fives));
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
    let twin_hung = hang_up::Tally::of(&twins, &twin_outcomes, &twin_runs);
    let twin_row = hang_up::twin_row(seed, &twin_hung, twin_check.and(dating));
    Ok((r, Some(twin_row)))
}

/// The counters at `names` (0 where unset), read straight from Redis.
async fn counts(conn: &mut redis::aio::MultiplexedConnection, names: &[String]) -> Result<Vec<u64>, String> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let got: Vec<Option<u64>> =
        redis::cmd("MGET").arg(names).query_async(conn).await.map_err(|e| format!("MGET: {e}"))?;
    Ok(got.into_iter().map(Option::unwrap_or_default).collect())
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
