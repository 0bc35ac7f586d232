//! The storm's hang-ups: clients that send `POST /charges` with a key of
//! their own to the survivor B, hang up at a random moment while the store
//! answers [`SLOW`] late (before the claim, while it is in flight, after
//! its answer), then retry the key on B until it settles.
//!
//! Each such key has one client, so the key's record, read straight from
//! Redis just after the hang-up, is that client's own claim and dates it
//! ([`super::moment`]). A key settles when B answers it `2xx`: a replay
//! (the hung-up request's route ran to its end on its own) or a fresh run
//! (its claim was given back, or never made). One still answering `409`
//! [`settle_within`] after its hang-up is stranded: a claim nobody runs or
//! frees, which blocks it until its lease ends (`POST /charges` runs again
//! after the lease) or, on a route that does not, for the record's TTL.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::moment::{self, Moment};
use super::twin::Twin;
use super::{record, request};

/// How late the proxy delivers the store's answers while the hang-ups run.
pub(super) const SLOW: Duration = Duration::from_millis(150);
/// How long after sending a client hangs up, at most: past the claim's
/// answer, so that every moment is drawn.
pub(super) const LATEST_HANG_UP: Duration = Duration::from_millis(250);
/// Between two retries of a hung-up key.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// How long a hung-up key may take to settle. A claim stranded by the
/// hang-up was made at most [`SLOW`] before it, so it blocks the key until
/// at least `lease - SLOW` after the hang-up; a settled one frees it within
/// the claim's answer, the route's 200 ms and the answer's storing, both
/// [`SLOW`] late. The bound lies between, 300 ms short of the first.
pub(super) fn settle_within(lease: Duration) -> Duration {
    lease.saturating_sub(SLOW + Duration::from_millis(300))
}

/// Who makes a hung-up key's first claim.
#[derive(Clone)]
pub(super) enum Front {
    /// `orders` itself (B): the claim runs as `IdempotencyLayer` runs it.
    Orders,
    /// The harness's twin of the old layer ([`super::twin`]).
    Twin(Arc<Twin>),
}

/// One hang-up client and its key.
#[derive(Debug, Clone)]
pub(super) struct Client {
    pub(super) key: String,
    /// The charge's order id: `orders` counts the route's runs by it.
    pub(super) order: String,
    pub(super) body: String,
    /// How long after sending the client hangs up.
    pub(super) after: Duration,
}

impl Client {
    /// Client `j` of `kind` (`hup`, `twin`); canonical JSON bodies (keys
    /// sorted, no spaces), so that the twin's fingerprint is the layer's
    /// whether or not it canonicalizes bodies.
    pub(super) fn new(seed: u64, kind: &str, j: u32, after: Duration) -> Client {
        let order = format!("{kind}_{j}");
        let body = format!(r#"{{"amount":{},"order_id":"{order}"}}"#, 100 + j);
        Client { key: format!("storm-{seed}-{kind}-{j}"), order, body, after }
    }

    /// The counter of the route's runs for this key's order.
    pub(super) fn runs_key(&self) -> String {
        format!("orders:charges:{}", self.order)
    }
}

/// How a hung-up key ended.
#[derive(Debug)]
pub(super) enum Settled {
    /// Answered `2xx` by B, `after` the hang-up: `fresh` when B ran the
    /// route for the retry, else a replay of the hung-up request's run.
    Ran { fresh: bool, after: Duration },
    /// Not `2xx` within [`settle_within`]: B's last answer.
    Not(String),
}

/// One hang-up client's history.
#[derive(Debug)]
pub(super) struct Outcome {
    pub(super) moment: Moment,
    /// Requests sent (or claims, for the twin), the hung-up one included.
    pub(super) requests: u64,
    /// `5xx` answers from B, which is alive all along.
    pub(super) fives: u64,
    pub(super) settled: Settled,
    /// What broke the client's own exchange: a harness or connection error.
    pub(super) error: Option<String>,
}

/// What every hang-up client of a storm shares.
#[derive(Clone)]
pub(super) struct Storm {
    /// The survivor's address.
    pub(super) b: String,
    /// Straight to Redis, not through the proxy: to date claims.
    pub(super) redis: MultiplexedConnection,
    /// The storm's requests done, for its kill point.
    pub(super) done: Arc<AtomicU64>,
    /// Clients that have hung up (and dated their hang-up): the store may
    /// answer on time again once all have.
    pub(super) hung: Arc<AtomicU64>,
    /// The in-progress lease of `POST /charges`.
    pub(super) lease: Duration,
}

/// Runs `client` against B: its hung-up request through `front`, then,
/// its `permit` given back and its hang-up counted, its retries until the
/// key settles or [`settle_within`] the lease has passed.
pub(super) async fn run(front: Front, client: Client, mut storm: Storm, permit: OwnedSemaphorePermit) -> Outcome {
    let b = storm.b.clone();
    let first = first_request(&front, &client, &b, &mut storm.redis).await;
    storm.done.fetch_add(1, Ordering::SeqCst);
    storm.hung.fetch_add(1, Ordering::SeqCst);
    drop(permit);
    let (moment, hung_up) = match first {
        Ok(first) => first,
        Err(e) => {
            return Outcome {
                moment: Moment::Unclear,
                requests: 1,
                fives: 0,
                settled: Settled::Not(e.clone()),
                error: Some(e),
            }
        }
    };
    let deadline = hung_up + settle_within(storm.lease);
    let (mut requests, mut fives) = (1, 0);
    loop {
        requests += 1;
        let last = match request(&b, "POST", "/charges", Some(&client.key), &client.body).await {
            Ok(rep) if (200..300).contains(&rep.status) => {
                let settled = Settled::Ran { fresh: !rep.replayed, after: hung_up.elapsed() };
                return Outcome { moment, requests, fives, settled, error: None };
            }
            Ok(rep) => {
                fives += u64::from(rep.status >= 500);
                format!("{} {}", rep.status, error_code(&rep.body))
            }
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Outcome { moment, requests, fives, settled: Settled::Not(last), error: None };
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// The hung-up request and when it hung up, dated against its claim.
async fn first_request(
    front: &Front,
    client: &Client,
    b: &str,
    redis: &mut MultiplexedConnection,
) -> Result<(Moment, Instant), String> {
    let (hung_up, answered) = match front {
        Front::Orders => (send_and_hang_up(b, "/charges", Some(&client.key), &client.body, client.after).await?, false),
        Front::Twin(twin) => {
            let ended = twin.claim_and_hang_up(&client.key, &client.body, client.after).await?;
            (ended.hung_up, ended.answered)
        }
    };
    let looked = Instant::now();
    let age = record::age(redis, &client.key).await?;
    let seen = Instant::now();
    let moment = if answered { Moment::AfterAnswer } else { moment::of(hung_up, looked, seen, age, SLOW) };
    Ok((moment, hung_up))
}

/// Sends a `POST` on a keep-alive connection (so the server watches it for
/// its close while the request runs) and closes it `after` the last byte
/// went out, unread. Returns when it hung up.
pub(super) async fn send_and_hang_up(
    addr: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
    after: Duration,
) -> Result<Instant, String> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    if let Some(k) = key {
        head.push_str(&format!("idempotency-key: {k}\r\nauthorization: {}\r\n", record::CALLER));
    }
    head.push_str("\r\n");
    let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    stream.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
    stream.write_all(body.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
    tokio::time::sleep(after).await;
    drop(stream);
    Ok(Instant::now())
}

/// The `error` member of a Problem Details body, or the body itself.
fn error_code(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.trim().chars().take(120).collect())
}

/// What a set of hang-up clients came to, with the route's runs per key
/// (`runs[i]` for `clients[i]`).
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) clients: u64,
    pub(super) before: u64,
    pub(super) in_flight: u64,
    pub(super) after: u64,
    pub(super) unclear: u64,
    pub(super) requests: u64,
    pub(super) fives: u64,
    /// Keys whose retry B ran (their claim given back, or never made), and
    /// those of them hung up in flight.
    pub(super) fresh: u64,
    pub(super) fresh_in_flight: u64,
    /// Keys whose retry B answered with the hung-up request's own run.
    pub(super) replayed: u64,
    /// The longest a settled key took from its hang-up.
    pub(super) slowest: Duration,
    /// Keys not settled in time: stranded claims (`key (last answer, runs)`).
    pub(super) unsettled: Vec<String>,
    /// Those of them whose route never ran, last answered `409`.
    pub(super) stranded: u64,
    /// Keys whose route ran more than once, and the runs beyond one.
    pub(super) doubled: Vec<String>,
    pub(super) extra_runs: u64,
    /// Keys answered `2xx` whose route never ran.
    pub(super) unrun: Vec<String>,
    pub(super) errors: Vec<String>,
}

impl Tally {
    pub(super) fn of(clients: &[Client], outcomes: &[Outcome], runs: &[u64]) -> Tally {
        let mut t = Tally { clients: clients.len() as u64, ..Tally::default() };
        for ((c, o), &n) in clients.iter().zip(outcomes).zip(runs) {
            match o.moment {
                Moment::BeforeClaim => t.before += 1,
                Moment::InFlight => t.in_flight += 1,
                Moment::AfterAnswer => t.after += 1,
                Moment::Unclear => t.unclear += 1,
            }
            t.requests += o.requests;
            t.fives += o.fives;
            if let Some(e) = &o.error {
                t.errors.push(format!("{}: {e}", c.key));
            }
            if let Settled::Ran { after, .. } = o.settled {
                t.slowest = t.slowest.max(after);
            }
            match &o.settled {
                Settled::Ran { fresh: true, .. } => {
                    t.fresh += 1;
                    t.fresh_in_flight += u64::from(o.moment == Moment::InFlight);
                }
                Settled::Ran { fresh: false, .. } => t.replayed += 1,
                Settled::Not(last) => {
                    t.stranded += u64::from(n == 0 && last.starts_with("409"));
                    t.unsettled.push(format!("{} ({last}, runs {n}, hung up {:?})", c.key, o.moment));
                }
            }
            if n > 1 {
                t.doubled.push(format!("{}: {n} runs", c.key));
                t.extra_runs += n - 1;
            }
            if n == 0 && matches!(o.settled, Settled::Ran { .. }) {
                t.unrun.push(c.key.clone());
            }
        }
        t
    }

    /// The tally as a note.
    pub(super) fn note(&self, who: &str) -> String {
        format!(
            "{who}: {} keys hung up before the claim {}, while it was in flight {}, after its answer {}, too close to call {}; retries ran the route {} ({} of them hung up in flight: their claim given back), replayed the hung-up run {}, the slowest {:.0} ms after its hang-up; not settled within {:?} of the hang-up {} ({} stranded: 409, route never run); {} requests",
            self.clients,
            self.before,
            self.in_flight,
            self.after,
            self.unclear,
            self.fresh,
            self.fresh_in_flight,
            self.replayed,
            self.slowest.as_secs_f64() * 1000.0,
            settle_within(super::LEASE),
            self.unsettled.len(),
            self.stranded,
            self.requests,
        )
    }
}

/// The first `n` of `items`, for a note.
pub(super) fn first(items: &[String], n: usize) -> String {
    items.iter().take(n).cloned().collect::<Vec<_>>().join(", ")
}

/// Fails `r` (the storm's row) on what its hang-ups must show: some landed
/// while their claim was in flight, and every key settled, ran its route
/// (the route's runs beyond one are the storm's double executions), and
/// was answered by B without an error.
pub(super) fn judge(r: &mut crate::harness::Report, t: &Tally) {
    if t.in_flight == 0 {
        r.fail(format!(
            "no client hung up while its claim was in flight ({} hang-ups): the hang-ups tested nothing",
            t.clients
        ));
    }
    if !t.unsettled.is_empty() {
        r.fail(format!(
            "{} hung-up key(s) not settled within {:?} of the hang-up (stranded claims): {}",
            t.unsettled.len(),
            settle_within(super::LEASE),
            first(&t.unsettled, 5)
        ));
    }
    if !t.unrun.is_empty() {
        r.fail(format!("{} hung-up key(s) answered 2xx with no charge made: {}", t.unrun.len(), first(&t.unrun, 5)));
    }
    if !t.errors.is_empty() {
        r.fail(format!("{} hang-up client(s) failed: {}", t.errors.len(), first(&t.errors, 3)));
    }
    if t.fives > 0 {
        r.fail(format!("{} 5xx answer(s) to hung-up keys' retries", t.fives));
    }
}

/// The twin's row: caught when its hang-ups stranded claims (keys still
/// answering `409` with their route never run when they should have
/// settled). `check`: whether the twin claims what `orders` claims and its
/// hang-ups can be dated ([`Twin::check`](super::twin::Twin::check), [`record::check`]).
pub(super) fn twin_row(seed: u64, t: &Tally, check: Result<(), String>) -> crate::harness::Report {
    let mut r = crate::harness::Report::new("idempotency-storm", "twin: claim in the request's future", seed);
    r.expected_safe = false;
    r.fault_kind =
        "hang-ups while the claim is in flight, the claim awaited in the request's future (the harness's twin of the old layer)"
            .into();
    r.processes = 1;
    r.tasks = u32::try_from(t.clients).unwrap_or(u32::MAX);
    r.keys = r.tasks;
    r.lease_ms = super::LEASE.as_millis() as u64;
    r.operations = t.requests;
    r.faults = t.in_flight;
    r.residual_keys = Some(t.unsettled.len() as u64);
    r.note(t.note("twin hang-ups"));
    r.note(format!("must fire: stranded claims {}", t.stranded));
    if !t.unsettled.is_empty() {
        r.note(format!("not settled: {}", first(&t.unsettled, 5)));
    }
    let caught = t.stranded > 0;
    r.caught = Some(caught);
    if let Err(e) = check {
        r.fail(e);
    }
    if !caught {
        r.fail("the stranded-claim check did not fire on claims awaited in the request's future");
    }
    if !t.doubled.is_empty() {
        r.fail(format!("B ran a twin key's route twice: {}", first(&t.doubled, 3)));
    }
    r
}
