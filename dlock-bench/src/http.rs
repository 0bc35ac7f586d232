//! What the HTTP layer costs: a `POST /stock/reduce`-style route served by
//! axum on loopback, driven by keep-alive HTTP/1.1 connections from this
//! process, each request with a product id of its own (no contention, so
//! the figure is the layer's overhead, not waiting).
//!
//! * `no-layer/memory`: the route alone — the baseline of the layer;
//! * `layer/memory`: the route behind `LockLayer::new("product.stock").json("product_id")`
//!   on the in-process backend (target: ≥ 0.9 of the route alone);
//! * `layer/redis`: the same layer on the bench's Redis;
//! * `raw-route/redis`: a hand-written route that does `SET NX PX` and a
//!   compare-and-delete `EVALSHA` around the same handler (the layer's
//!   `ratio` on Redis is to it; no target, as for the uncontended bench's
//!   bare baseline);
//! * `fenced-raw-route/redis`: the same with a fencing token (`SET NX PX` +
//!   `INCR` in one script, as the uncontended bench's fenced floor), to show
//!   how much of the gap fencing explains (target: the layer on Redis ≥ 0.9
//!   of it, since dlock's locks are fenced).
//!
//! The `http-in-process` rows call the first two routes without sockets,
//! one request at a time through `Router::call` on one task: the layer's own
//! CPU cost, without loopback TCP's (which is most of a request's cost above).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use dlock_axum::{DlockExt, LockLayer};
use dlock_core::{Locker, MemoryBackend};
use redis::aio::MultiplexedConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::args::Args;
use crate::env::Env;
use crate::error::{BenchError, Result};
use crate::locks::FENCED_SET_NX;
use crate::measure::{median, run_window, Timing};
use crate::report::Row;
use crate::series::{target, Series};

/// Keep-alive connections driving the server.
pub(crate) const CONNECTIONS: usize = 16;

pub(crate) const IN_PROCESS_TITLE: &str =
    "http-in-process: the same route and layer called through Router::call on one task, \
     no sockets (ops = requests/s; ratio = layer vs the route alone)";

pub(crate) const TITLE: &str =
    "http: POST /stock/reduce-style route on loopback, 16 keep-alive connections, a product id \
     per request (ops = requests/s; cli us = this process's CPU per request: the HTTP client, the server and \
     the lock alike; ratio = vs the route without the layer, or vs the raw SET NX route on Redis)";

/// The route's own work: parse the body, answer. Kept small so the layer's
/// cost shows.
async fn reduce(body: Bytes) -> (StatusCode, &'static str) {
    let ok = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v.get("product_id").is_some());
    if ok {
        (StatusCode::OK, "{\"remaining\":1}")
    } else {
        (StatusCode::BAD_REQUEST, "{}")
    }
}

/// The body of one request: a product id of its own, so nothing contends.
fn reduce_body(id: u64) -> String {
    format!("{{\"product_id\":{id},\"quantity\":1}}")
}

/// The hand-written lock a user would write without dlock.
#[derive(Clone)]
struct Raw {
    conn: MultiplexedConnection,
    script: Arc<redis::Script>,
    /// Take the lock with [`FENCED_SET_NX`] rather than a bare `SET NX PX`.
    fenced: Option<Arc<redis::Script>>,
    prefix: String,
    tokens: Arc<AtomicU64>,
}

async fn raw_reduce(State(raw): State<Raw>, body: Bytes) -> (StatusCode, &'static str) {
    let Some(id) = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v.get("product_id").cloned())
    else {
        return (StatusCode::BAD_REQUEST, "{}");
    };
    let key = format!("{}:raw:{id}", raw.prefix);
    let token = raw.tokens.fetch_add(1, Ordering::Relaxed).to_string();
    let mut conn = raw.conn.clone();
    let got = match &raw.fenced {
        Some(fenced) => fenced
            .key(&key)
            .key(format!("{key}:fence"))
            .arg(&token)
            .arg(30_000)
            .invoke_async::<u64>(&mut conn)
            .await
            .map(|fence| fence > 0),
        None => redis::cmd("SET")
            .arg(&key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async::<Option<String>>(&mut conn)
            .await
            .map(|v| v.is_some()),
    };
    match got {
        Ok(true) => {}
        Ok(false) => return (StatusCode::CONFLICT, "{}"),
        Err(_) => return (StatusCode::SERVICE_UNAVAILABLE, "{}"),
    }
    let out = reduce(body).await;
    let _: redis::RedisResult<i64> = raw.script.key(&key).arg(&token).invoke_async(&mut conn).await;
    out
}

/// Serves `router` on a free loopback port until the returned handle is
/// aborted.
async fn serve(router: Router) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| BenchError::Server(format!("bind: {e}")))?;
    let addr = listener.local_addr().map_err(|e| BenchError::Server(format!("address: {e}")))?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok((addr, task))
}

/// One window of keep-alive connections posting distinct product ids.
async fn measure(addr: std::net::SocketAddr, timing: Timing, round: usize) -> Result<crate::measure::Sample> {
    let ids = Arc::new(AtomicU64::new((round as u64) << 40));
    run_window(CONNECTIONS, timing, None, move |_slot, clock, stop| {
        let ids = ids.clone();
        async move {
            let mut conn =
                TcpStream::connect(addr).await.map_err(|e| BenchError::Invariant(format!("connect: {e}")))?;
            let _ = conn.set_nodelay(true);
            let mut records = Vec::with_capacity(4096);
            let mut buf = vec![0u8; 4096];
            while !stop.load(Ordering::Relaxed) {
                let req = post_request(ids.fetch_add(1, Ordering::Relaxed));
                let started = clock.now_ns();
                send(&mut conn, &req, &mut buf).await?;
                let done = clock.now_ns();
                records.push((done, done - started));
            }
            Ok(records)
        }
    })
    .await
}

/// One window of requests sent through `router` in process, one at a
/// time, each with a product id of its own.
async fn measure_in_process(router: Router, timing: Timing, round: usize) -> Result<crate::measure::Sample> {
    use tower::ServiceExt;
    let ids = Arc::new(AtomicU64::new((round as u64) << 40));
    run_window(1, timing, None, move |_slot, clock, stop| {
        let (router, ids) = (router.clone(), ids.clone());
        async move {
            let mut records = Vec::with_capacity(1 << 16);
            while !stop.load(Ordering::Relaxed) {
                let id = ids.fetch_add(1, Ordering::Relaxed);
                let body = reduce_body(id);
                let req = axum::http::Request::post("/stock/reduce")
                    .header("content-type", "application/json")
                    .header("content-length", body.len())
                    .body(axum::body::Body::from(body))
                    .map_err(|e| BenchError::Invariant(format!("request: {e}")))?;
                let started = clock.now_ns();
                let Ok(response) = router.clone().oneshot(req).await;
                if response.status() != StatusCode::OK {
                    return Err(BenchError::Invariant(format!("the route answered {}", response.status())));
                }
                drop(response);
                let done = clock.now_ns();
                records.push((done, done - started));
                // Let the runtime's other tasks (the watchdog) run.
                if records.len() % 256 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            Ok(records)
        }
    })
    .await
}

/// The HTTP/1.1 text of a reduce request for product `id`.
fn post_request(id: u64) -> String {
    let body = reduce_body(id);
    format!(
        "POST /stock/reduce HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `req` on `conn` and reads its answer, which must be `200`.
async fn send(conn: &mut TcpStream, req: &str, buf: &mut [u8]) -> Result<()> {
    conn.write_all(req.as_bytes()).await.map_err(|e| BenchError::Invariant(format!("write: {e}")))?;
    match read_response(conn, buf).await? {
        200 => Ok(()),
        status => Err(BenchError::Invariant(format!("the route answered {status}"))),
    }
}

/// One request through the route at `addr` before any window: the first
/// ever pays for what no later one does (the server's first accept, the
/// route's first Redis call and its script's load), which a quick run's
/// short windows cannot absorb on a loaded machine.
async fn warm(addr: std::net::SocketAddr) -> Result<()> {
    let mut conn = TcpStream::connect(addr).await.map_err(|e| BenchError::Invariant(format!("connect: {e}")))?;
    send(&mut conn, &post_request(u64::MAX), &mut [0u8; 4096]).await
}

/// Reads one response (headers plus a `content-length` body) and returns
/// its status.
async fn read_response(conn: &mut TcpStream, buf: &mut [u8]) -> Result<u16> {
    let mut have = 0;
    loop {
        let n = conn.read(&mut buf[have..]).await.map_err(|e| BenchError::Invariant(format!("read: {e}")))?;
        if n == 0 {
            return Err(BenchError::Invariant("the server closed the connection".into()));
        }
        have += n;
        let text = String::from_utf8_lossy(&buf[..have]);
        if let Some(end) = text.find("\r\n\r\n") {
            let head = &text[..end];
            let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            if have >= end + 4 + len {
                return Ok(status);
            }
        }
        if have == buf.len() {
            return Err(BenchError::Invariant("response larger than the read buffer".into()));
        }
    }
}

/// Runs every round and returns the rows.
pub(crate) async fn run(env: &Env, args: &Args) -> Result<Vec<Row>> {
    // Three times the rounds of a third the length: the ratios compare
    // windows measured back to back, and a shared machine's slow phases last
    // about as long as a few full windows, so short adjacent pairs meet the
    // same phase far more often.
    let rounds = args.uncontended_rounds * 3;
    // At least 40 ms: a quick run's third of a window (13 ms) saw no answer
    // at all from a Redis route on a loaded machine (a row of 0 req/s).
    let timing =
        Timing { warmup: args.warmup, duration: (args.duration / 3).max(std::time::Duration::from_millis(40)) };
    let memory = Locker::new(MemoryBackend::new());
    let layer = || LockLayer::new("product.stock").json("product_id");
    let raw = Raw {
        conn: env.conn.clone(),
        script: Arc::new(redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
        )),
        fenced: None,
        prefix: env.prefix.clone(),
        tokens: Arc::new(AtomicU64::new(1)),
    };
    let fenced = Raw {
        fenced: Some(Arc::new(redis::Script::new(FENCED_SET_NX))),
        prefix: format!("{}:fenced", env.prefix),
        ..raw.clone()
    };
    // The route alone and behind the layer on the in-process backend, served
    // over loopback and called in process alike. `with_state` turns each
    // route into its final service once, as `axum::serve` does; without it a
    // router called directly would convert its handler per call.
    let in_process = [
        Router::new().route("/stock/reduce", post(reduce)).with_state(()),
        Router::new().route("/stock/reduce", post(reduce).layer(layer())).with_dlock(memory).with_state(()),
    ];
    let routers: [(&'static str, &'static str, Router); 5] = [
        ("no-layer", "memory", in_process[0].clone()),
        ("layer", "memory", in_process[1].clone()),
        (
            "layer",
            "redis",
            Router::new().route("/stock/reduce", post(reduce).layer(layer())).with_dlock(env.redis_locker.clone()),
        ),
        ("raw-route", "redis", Router::new().route("/stock/reduce", post(raw_reduce)).with_state(raw)),
        ("fenced-raw-route", "redis", Router::new().route("/stock/reduce", post(raw_reduce)).with_state(fenced)),
    ];
    let mut in_process_series =
        [Series::new("http-in-process", "no-layer", "memory", 1), Series::new("http-in-process", "layer", "memory", 1)];
    let mut ratio_in_process = Vec::new();
    let mut served = Vec::new();
    for (imp, backend, router) in routers {
        let (addr, task) = serve(router).await?;
        warm(addr).await?;
        served.push((Series::new("http", imp, backend, CONNECTIONS), addr, task));
    }
    let mut ratio_memory = Vec::new();
    let mut ratio_redis = Vec::new();
    let mut ratio_fenced = Vec::new();
    for round in 0..rounds {
        let n = served.len();
        // Each ratio's routes run back to back: the in-process pair, then the
        // Redis three, the order alternating so that none always meets a
        // warmer machine.
        let memory_pair = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        let redis_three = [2, 3, 4].map(|i| 2 + (i - 2 + round) % 3);
        for j in memory_pair.into_iter().chain(redis_three) {
            let addr = served[j].1;
            let sample = measure(addr, timing, round * n + j).await?;
            served[j].0.samples.push(sample);
        }
        let last = |i: usize| served[i].0.samples.last().map_or(0.0, |s| s.ops_per_sec);
        if last(0) > 0.0 {
            ratio_memory.push(last(1) / last(0));
        }
        if last(3) > 0.0 {
            ratio_redis.push(last(2) / last(3));
        }
        if last(4) > 0.0 {
            ratio_fenced.push(last(2) / last(4));
        }
        for j in memory_pair {
            // Ids of their own: the layer's locker is the one served above.
            let sample = measure_in_process(in_process[j].clone(), timing, (rounds + round) * n + j).await?;
            in_process_series[j].samples.push(sample);
        }
        let [route, layered] = &in_process_series;
        if let (Some(r), Some(l)) = (route.samples.last(), layered.samples.last())
            && r.ops_per_sec > 0.0
        {
            ratio_in_process.push(l.ops_per_sec / r.ops_per_sec);
        }
        eprintln!(
            "http round {}/{rounds}: req/s no-layer {:.0}, layer/memory {:.0}, layer/redis {:.0}, raw-route/redis {:.0}, \
             fenced-raw-route/redis {:.0}",
            round + 1,
            last(0),
            last(1),
            last(2),
            last(3),
            last(4)
        );
    }
    let mut rows = Vec::new();
    for (i, (series, _, task)) in served.iter().enumerate() {
        task.abort();
        let mut row = series.row();
        row.cmds_per_acquisition = None;
        row.server_cmds_per_acquisition = None;
        if i == 1 || i == 2 {
            let ratio =
                median(if i == 1 { ratio_memory.iter().copied() } else { ratio_redis.iter().copied() }).unwrap_or(0.0);
            row.ratio = Some(ratio);
            if i == 1 {
                // On Redis the bar is the fenced route below: dlock's locks are fenced.
                row.targets.push(target("ratio", ratio, false, 0.9, ""));
            }
        }
        if i == 2 {
            row.vs_floor = median(ratio_fenced.iter().copied());
            row.targets.push(target("vs fenced-raw-route", row.vs_floor.unwrap_or(0.0), false, 0.9, ""));
        }
        rows.push(row);
    }
    for (i, series) in in_process_series.iter().enumerate() {
        let mut row = series.row();
        row.cmds_per_acquisition = None;
        row.server_cmds_per_acquisition = None;
        if i == 1 {
            row.ratio = median(ratio_in_process.iter().copied());
        }
        rows.push(row);
    }
    Ok(rows)
}
