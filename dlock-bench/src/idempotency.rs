//! The cost of `Idempotency-Key` mode on a fast handler, through the axum
//! router in process (no sockets, so the layer's own cost shows):
//!
//! * `no-layer` — the route alone (the baseline of this run);
//! * `first-request` — every request a new key: claim + store, two scripts
//!   on Redis (or the memory store);
//! * `replay` — every request the same, finished key: one script on Redis,
//!   the stored response replayed;
//! * `hand-claim` / `hand-replay` (Redis) — the same route behind a
//!   hand-written middleware with none of the layer's guarantees: a claim
//!   is `SET key NX PX`, then `SET` of the answer (2 commands); a replay one
//!   `GET`. They are the floors the layer's rows are held to (issue 24:
//!   first request ≥ 0.7 × `hand-claim` with at most 8 server commands,
//!   replay ≥ 0.9 × `hand-replay`), printed PASS or MISS.
//!
//! `ratio` is the row's requests/s over `no-layer`'s, measured in the same round.
//! On Redis the rows also carry the store's commands per request from
//! `INFO commandstats` deltas: client commands (`cmds_per_acquisition`: 2
//! for a first request, 1 for a replay) and every server call, the scripts'
//! own included (`server_cmds_per_acquisition`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use dlock_axum::{
    idempotency::{IdempotencyLayer, REPLAYED_HEADER},
    Caller,
};
use dlock_core::idempotency::{IdempotencyLimits, IdempotencyStore, MemoryStore, RedisStore};
use tower::Service;

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::measure::{median, run_window, CommandCounter, Counting, Sample, Timing};
use crate::report::Row;
use crate::series::{target, Series};

pub(crate) const TITLE: &str = "idempotency key mode on a fast handler, in-process router (ops = requests/s; on Redis \
     cmds/acq = client commands per request, srv/acq = server commands per request incl. the scripts' calls: \
     a first request claims + completes, a replay reads once; ratio = vs no-layer in the same round)";

/// Windows measured so far in this process, to name their keys.
static WINDOWS: AtomicU64 = AtomicU64::new(0);

/// Tasks sending requests at once.
const CONCURRENCY: usize = 8;

/// Commands the idempotency scripts make inside Redis.
const SCRIPT_INTERNAL: &[&str] =
    &["get", "hgetall", "hmget", "hset", "hdel", "pexpireat", "del", "exists", "set", "time"];

/// The issue-24 targets: the layer's first request and replay against the
/// hand-written ones, and its server commands per first request.
const FIRST_VS_HAND: f64 = 0.7;
const REPLAY_VS_HAND: f64 = 0.9;
const FIRST_SERVER_CMDS: f64 = 8.0;

/// A hand-written idempotency middleware on one multiplexed connection:
/// `claim` — `SET key "" NX PX`, the route, `SET key answer PX` (a key
/// already set is answered 409: the bench never repeats one); else
/// `replay` — `GET key`, the stored body answered (the route only on a
/// miss, to make the key once).
async fn hand_written(
    axum::extract::State((conn, replay)): axum::extract::State<(redis::aio::MultiplexedConnection, bool)>,
    req: Request<Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut conn = conn;
    let Some(key) = req.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map(|k| format!("hand:{k}"))
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    if replay {
        let stored: Option<Vec<u8>> = match redis::cmd("GET").arg(&key).query_async(&mut conn).await {
            Ok(v) => v,
            Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
        if let Some(body) = stored {
            return (StatusCode::CREATED, [(REPLAYED_HEADER, "true")], body).into_response();
        }
    } else {
        let claimed: Option<String> = match redis::cmd("SET")
            .arg(&key)
            .arg("")
            .arg("NX")
            .arg("PX")
            .arg(86_400_000)
            .query_async(&mut conn)
            .await
        {
            Ok(v) => v,
            Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
        if claimed.is_none() {
            return StatusCode::CONFLICT.into_response();
        }
    }
    let response = next.run(req).await;
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let stored: redis::RedisResult<()> =
        redis::cmd("SET").arg(&key).arg(bytes.as_ref()).arg("PX").arg(86_400_000).query_async(&mut conn).await;
    if stored.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    axum::response::Response::from_parts(parts, Body::from(bytes))
}

/// The route behind [`hand_written`].
fn hand_app(conn: redis::aio::MultiplexedConnection, replay: bool) -> Router {
    app(None).layer(axum::middleware::from_fn_with_state((conn, replay), hand_written))
}

fn app(layer: Option<IdempotencyLayer>) -> Router {
    let route = post(|| async {
        (StatusCode::CREATED, [("content-type", "application/json")], r#"{"payment_id":"pay_1","amount":1}"#)
    });
    let route = match layer {
        Some(l) => route.layer(l),
        None => route,
    };
    Router::new().route("/pay", route)
}

/// How each request picks its key.
#[derive(Clone, Copy)]
enum Keys {
    None,
    Fresh,
    Same,
}

async fn measure(
    router: Router,
    keys: Keys,
    timing: Timing,
    counter: Option<&CommandCounter>,
    script_internal: &'static [&'static str],
) -> Result<Sample> {
    let seq = Arc::new(AtomicU64::new(0));
    // Keys of their own per window: a later round reusing an earlier
    // round's keys would measure replays in the first-request rows.
    let run = format!("{}-{}", std::process::id(), WINDOWS.fetch_add(1, Ordering::Relaxed));
    if let Keys::Same = keys {
        // Complete the key once, so that every measured request is a replay.
        let req = Request::post("/pay")
            .header("idempotency-key", format!("b{run}-replayed"))
            .body(Body::from(r#"{"amount":1}"#))
            .map_err(|e| BenchError::Invariant(e.to_string()))?;
        let first = match router.clone().call(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        };
        if first.status() != StatusCode::CREATED {
            return Err(BenchError::Invariant(format!("the first request answered {}", first.status())));
        }
    }
    let counting = counter.map(|counter| Counting { counter, script_internal, client_sent: None });
    run_window(CONCURRENCY, timing, counting, |_, clock, stop| {
        let (mut router, seq, run) = (router.clone(), seq.clone(), run.clone());
        async move {
            let mut records = Vec::with_capacity(4096);
            while !stop.load(Ordering::Relaxed) {
                let mut req = Request::post("/pay");
                match keys {
                    Keys::None => {}
                    Keys::Fresh => {
                        req = req.header("idempotency-key", format!("b{run}-{}", seq.fetch_add(1, Ordering::Relaxed)))
                    }
                    Keys::Same => req = req.header("idempotency-key", format!("b{run}-replayed")),
                }
                let req = req.body(Body::from(r#"{"amount":1}"#)).map_err(|e| BenchError::Invariant(e.to_string()))?;
                let started = clock.now_ns();
                let res = match router.call(req).await {
                    Ok(res) => res,
                    Err(never) => match never {},
                };
                let done = clock.now_ns();
                if res.status() != StatusCode::CREATED {
                    return Err(BenchError::Invariant(format!("the route answered {}", res.status())));
                }
                let replayed = res.headers().get(REPLAYED_HEADER).is_some_and(|v| v == "true");
                match keys {
                    Keys::Fresh if replayed => {
                        return Err(BenchError::Invariant("a first request was answered as a replay".into()))
                    }
                    Keys::Same if !replayed => {
                        return Err(BenchError::Invariant("a replay was not answered from the store".into()))
                    }
                    _ => {}
                }
                records.push((done, done - started));
                // In-process routes never wait, so without this a worker
                // would never give the window's timer a turn.
                if records.len() % 32 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            Ok(records)
        }
    })
    .await
}

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    let timing = Timing { warmup: args.warmup, duration: args.duration };
    // Every request of the bench comes from one caller and leaves a record
    // for the whole TTL: the caps that guard a service against a flood would
    // refuse the bench's own load, so it lifts them.
    let unbounded = IdempotencyLimits::default().with_max_per_scope(u64::MAX).with_max_records(u64::MAX);
    let redis: Arc<dyn IdempotencyStore> =
        Arc::new(RedisStore::connect(&env.url, &env.prefix).await?.with_limits(unbounded));
    let memory: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new().with_limits(unbounded));
    let plain = app(None);
    // The bench's requests carry no credentials: one caller, said explicitly
    // (the default scope, `Authorization`, would refuse them).
    let redis_app = app(Some(IdempotencyLayer::new().store(redis).caller(Caller::shared())));
    let memory_app = app(Some(IdempotencyLayer::new().store(memory).caller(Caller::shared())));

    let mut base = Series::new("idempotency", "no-layer", "memory", CONCURRENCY);
    let mut cases = [
        (
            Series::new("idempotency", "hand-claim", "redis", CONCURRENCY),
            hand_app(env.conn.clone(), false),
            Keys::Fresh,
            Vec::new(),
        ),
        (
            Series::new("idempotency", "hand-replay", "redis", CONCURRENCY),
            hand_app(env.conn.clone(), true),
            Keys::Same,
            Vec::new(),
        ),
        (Series::new("idempotency", "first-request", "redis", CONCURRENCY), redis_app.clone(), Keys::Fresh, Vec::new()),
        (Series::new("idempotency", "replay", "redis", CONCURRENCY), redis_app, Keys::Same, Vec::new()),
        (
            Series::new("idempotency", "first-request", "memory", CONCURRENCY),
            memory_app.clone(),
            Keys::Fresh,
            Vec::new(),
        ),
        (Series::new("idempotency", "replay", "memory", CONCURRENCY), memory_app, Keys::Same, Vec::new()),
    ];
    let rounds = args.uncontended_rounds;
    for round in 0..rounds {
        let b = measure(plain.clone(), Keys::None, timing, None, &[]).await?;
        for (series, router, keys, ratios) in cases.iter_mut() {
            let counter = (series.backend == "redis").then_some(&env.counter);
            // The hand-written rows send their GET and SET themselves.
            let internal = if series.imp.starts_with("hand-") { &[][..] } else { SCRIPT_INTERNAL };
            let s = measure(router.clone(), *keys, timing, counter, internal).await?;
            if b.ops_per_sec > 0.0 {
                ratios.push(s.ops_per_sec / b.ops_per_sec);
            }
            series.samples.push(s);
        }
        eprintln!(
            "idempotency round {}/{rounds}: no-layer {:.0}/s, {}",
            round + 1,
            b.ops_per_sec,
            cases
                .iter()
                .map(|(s, ..)| format!(
                    "{} {} {:.0}/s",
                    s.imp,
                    s.backend,
                    s.samples.last().map_or(0.0, |x| x.ops_per_sec)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        base.samples.push(b);
    }
    let mut rows = vec![base.row()];
    for (series, _, _, ratios) in &cases {
        let mut row = series.row();
        row.ratio = median(ratios.iter().copied());
        rows.push(row);
    }
    // The layer's rows against the hand-written ones, round by round.
    let vs = |imp: &str, hand: &str| -> Option<f64> {
        let find = |name: &str| cases.iter().find(|(s, ..)| s.imp == name && s.backend == "redis").map(|c| &c.0);
        let (layer, hand) = (find(imp)?, find(hand)?);
        median(
            layer
                .samples
                .iter()
                .zip(&hand.samples)
                .filter(|(_, h)| h.ops_per_sec > 0.0)
                .map(|(l, h)| l.ops_per_sec / h.ops_per_sec),
        )
    };
    let (first_vs, replay_vs) = (vs("first-request", "hand-claim"), vs("replay", "hand-replay"));
    for row in rows.iter_mut().filter(|r| r.backend == "redis") {
        match row.imp.as_str() {
            "first-request" => {
                row.targets.push(target("ops vs hand-claim", first_vs.unwrap_or(0.0), false, FIRST_VS_HAND, ""));
                let cmds = row.server_cmds_per_acquisition.unwrap_or(f64::MAX);
                row.targets.push(target("srv cmds/request", cmds, true, FIRST_SERVER_CMDS, ""));
            }
            "replay" => {
                row.targets.push(target("ops vs hand-replay", replay_vs.unwrap_or(0.0), false, REPLAY_VS_HAND, ""))
            }
            _ => {}
        }
    }
    Ok(rows)
}
