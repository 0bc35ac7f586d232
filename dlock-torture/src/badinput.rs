//! `bad-input`: a seeded fuzz loop over the LockLayer's key derivation and
//! the `#[lockable]` macro's runtime path (its hidden extractor building the
//! key from the handler's own extractors),
//! driven through `tower::ServiceExt::oneshot` (no sockets): malformed and
//! deeply nested JSON, huge numbers, separators, NUL and Unicode in fields,
//! oversized bodies, wrong content types, non-UTF-8 headers, query strings
//! and path segments. Every answer must be a 2xx/4xx, every 4xx a JSON
//! error, never a 5xx or a panic. A second loop checks that distinct key
//! tuples never build the same key.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Json, Query};
use axum::routing::{get, post};
use axum::Router;
use dlock_axum::{lockable, DlockExt, LockLayer};
use dlock_core::{LockKey, Locker, MemoryBackend};
use http::{HeaderValue, Request};
use http_body_util::BodyExt;
use tower::ServiceExt;

use crate::harness::Report;
use crate::rng::Rng;
use crate::scenario::Size;

const BODY_LIMIT: usize = 4096;

#[derive(serde::Deserialize)]
struct TextProduct {
    id: Option<String>,
}

#[derive(serde::Deserialize)]
struct TextOrder {
    product: TextProduct,
}

#[derive(serde::Deserialize)]
struct NumberProduct {
    id: u64,
}

#[derive(serde::Deserialize)]
struct NumberOrder {
    product: NumberProduct,
}

#[derive(serde::Deserialize)]
struct TokenParam {
    token: Option<String>,
}

/// The seed's `createOrder` shape, with text ids (`None` for `null`).
#[lockable(key = "fuzz.macro", fields = ["order.product.id", "token"], wait_ms = 0)]
async fn macro_text(Query(TokenParam { token }): Query<TokenParam>, Json(order): Json<TextOrder>) -> &'static str {
    let _ = (token, order.product.id);
    "ok"
}

/// The same with numeric ids.
#[lockable(key = "fuzz.macro.n", fields = ["order.product.id", "token"], wait_ms = 0)]
async fn macro_number(Query(TokenParam { token }): Query<TokenParam>, Json(order): Json<NumberOrder>) -> &'static str {
    let _ = (token, order.product.id);
    "ok"
}

fn app() -> Router {
    let ok = || async { "ok" };
    Router::new()
        .route("/m", post(macro_text))
        .route("/mn", post(macro_number))
        .route(
            "/j",
            post(ok).layer(LockLayer::new("fuzz.json").json("order.id").json("items.0.sku").max_body_bytes(BODY_LIMIT)),
        )
        .route("/q", get(ok).layer(LockLayer::new("fuzz.query").query("q")))
        .route("/h", get(ok).layer(LockLayer::new("fuzz.header").header("x-tenant")))
        .route("/p/{id}", get(ok).layer(LockLayer::new("fuzz.path").path("id")))
        .with_dlock(Locker::new(MemoryBackend::new()))
}

const NASTY: [&str; 16] =
    [":", "_", "{", "}", "/", "\0", "..", "\"", "null", "%", "%00", "é", "e\u{301}", "\u{202e}", "🦀", " "];

fn nasty_string(rng: &mut Rng) -> String {
    let n = rng.below(8);
    (0..n).map(|_| NASTY[usize::try_from(rng.below(NASTY.len() as u64)).unwrap_or(0)]).collect()
}

fn json_value(rng: &mut Rng) -> String {
    match rng.below(10) {
        0 => "123456789012345678901234567890123456789".into(),
        1 => "1e400".into(),
        2 => "-0.0000000000000000000001".into(),
        3 => "null".into(),
        4 => "true".into(),
        5 => "[1,2,{\"a\":3}]".into(),
        6 => "{\"nested\":{\"x\":1}}".into(),
        _ => serde_json::to_string(&nasty_string(rng)).unwrap_or_else(|_| "\"\"".into()),
    }
}

fn json_body(rng: &mut Rng) -> (Vec<u8>, &'static str) {
    let valid = format!("{{\"order\":{{\"id\":{}}},\"items\":[{{\"sku\":{}}}]}}", json_value(rng), json_value(rng));
    corrupt(rng, valid)
}

/// A body for the `#[lockable]` handlers: `{"product": {"id": …}}`, the id
/// mostly of the handler's type (text or number) so that most requests get
/// past the handler's own `Json` extractor to the key derivation.
fn macro_body(rng: &mut Rng, numeric: bool) -> (Vec<u8>, &'static str) {
    let id = match (numeric, rng.below(5)) {
        (_, 0) => json_value(rng),
        (true, _) => rng.below(u64::MAX).to_string(),
        (false, 1) => "null".into(),
        (false, _) => serde_json::to_string(&nasty_string(rng)).unwrap_or_else(|_| "\"\"".into()),
    };
    let valid = format!("{{\"product\":{{\"id\":{id}}},\"extra\":{}}}", json_value(rng));
    corrupt(rng, valid)
}

/// Sometimes breaks a valid body: cut, nested too deep, too large, not
/// UTF-8, the wrong content type.
fn corrupt(rng: &mut Rng, valid: String) -> (Vec<u8>, &'static str) {
    match rng.below(8) {
        0 => {
            let cut = usize::try_from(rng.below(valid.len() as u64)).unwrap_or(0);
            (valid.as_bytes()[..cut].to_vec(), "application/json")
        }
        1 => {
            let depth = 1 + usize::try_from(rng.below(20_000)).unwrap_or(0);
            (format!("{{\"order\":{}1{}}}", "[".repeat(depth), "]".repeat(depth)).into_bytes(), "application/json")
        }
        2 => (vec![b'x'; BODY_LIMIT + 1 + usize::try_from(rng.below(100_000)).unwrap_or(0)], "application/json"),
        3 => (vec![0xff, 0xfe, b'{', 0xc3, 0x28, b'}'], "application/json"),
        4 => (valid.into_bytes(), "text/plain"),
        5 => (valid.into_bytes(), "application/json; charset=utf-8"),
        _ => (valid.into_bytes(), "application/json"),
    }
}

fn percent_bytes(rng: &mut Rng) -> String {
    let n = rng.below(12);
    (0..n).map(|_| format!("%{:02X}", rng.below(256))).collect()
}

fn request(rng: &mut Rng) -> Option<Request<Body>> {
    match rng.below(6) {
        4 | 5 => {
            let numeric = rng.chance(0.5);
            let (body, ct) = macro_body(rng, numeric);
            let path = if numeric { "/mn" } else { "/m" };
            let uri = match rng.below(4) {
                0 => path.to_owned(),
                1 => format!("{path}?token={}", percent_bytes(rng)),
                _ => format!("{path}?token={}", nasty_string(rng).replace(' ', "+").replace('\0', "%00")),
            };
            Request::post(uri).header("content-type", ct).body(Body::from(body)).ok()
        }
        0 => {
            let (body, ct) = json_body(rng);
            Request::post("/j").header("content-type", ct).body(Body::from(body)).ok()
        }
        1 => {
            let q = if rng.chance(0.5) { percent_bytes(rng) } else { nasty_string(rng).replace(' ', "+") };
            let uri = if rng.chance(0.1) { format!("/q?q={q}&q=second") } else { format!("/q?q={q}") };
            Request::get(uri).body(Body::empty()).ok()
        }
        2 => {
            let bytes: Vec<u8> =
                (0..rng.below(300)).map(|_| (rng.below(224) + 32) as u8).filter(|b| *b != 127).collect();
            let value = HeaderValue::from_bytes(&bytes).ok()?;
            let mut req = Request::get("/h").body(Body::empty()).ok()?;
            if rng.chance(0.9) {
                req.headers_mut().append("x-tenant", value.clone());
            }
            if rng.chance(0.1) {
                req.headers_mut().append("x-tenant", value);
            }
            Some(req)
        }
        _ => Request::get(format!("/p/{}", percent_bytes(rng))).body(Body::empty()).ok(),
    }
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:").and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

pub(crate) async fn run(size: Size, seed: u64) -> Result<Report, String> {
    let mut r = Report::new("bad-input", "memory (LockLayer and #[lockable] via tower oneshot)", seed);
    r.expected_safe = true;
    r.processes = 1;
    r.fault_kind = "malformed requests".into();
    let cases = if size.short { 3000 } else { 50_000 };
    let app = app();
    let mut rng = Rng::new(seed);
    let rss_before = rss_kb();
    let (mut server_errors, mut panics, mut non_json, mut unbuildable) = (0u64, 0u64, 0u64, 0u64);
    let (mut macro_cases, mut extractor_rejections) = (0u64, 0u64);
    let mut statuses: HashMap<u16, u64> = HashMap::new();
    for _ in 0..cases {
        let Some(req) = request(&mut rng) else {
            unbuildable += 1;
            continue;
        };
        let app = app.clone();
        let what = format!("{} {}", req.method(), req.uri());
        let macro_route = req.uri().path().starts_with("/m");
        let answer = tokio::spawn(async move {
            let res = match app.oneshot(req).await {
                Ok(res) => res,
                Err(never) => match never {},
            };
            let status = res.status().as_u16();
            let is_json =
                res.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
            let body = res.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let parses = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v["error"].is_string());
            if status >= 500 && std::env::var_os("DLOCK_TORTURE_DEBUG").is_some() {
                eprintln!("{status} {what}: {}", String::from_utf8_lossy(&body));
            }
            Ok::<_, std::convert::Infallible>((status, is_json && parses, is_json))
        });
        match tokio::time::timeout(Duration::from_secs(5), answer).await {
            Ok(Ok(Ok((status, json_error, json_body)))) => {
                *statuses.entry(status).or_default() += 1;
                if status >= 500 {
                    server_errors += 1;
                }
                if macro_route {
                    macro_cases += 1;
                    // Before the lock, the handler's own `Query`/`Json`
                    // extractors answer with axum's plain-text rejections; a
                    // JSON answer is dlock's and must be its error shape.
                    if (400..500).contains(&status) {
                        if json_body && !json_error {
                            non_json += 1;
                        } else if !json_body {
                            extractor_rejections += 1;
                        }
                    }
                // 404 is the router's own answer to `/p/` (no segment), before
                // any lock layer runs; every other 4xx comes from the layer.
                } else if (400..500).contains(&status) && status != 404 && !json_error {
                    non_json += 1;
                }
            }
            Ok(Ok(Err(never))) => match never {},
            Ok(Err(join)) if join.is_panic() => panics += 1,
            Ok(Err(_)) | Err(_) => server_errors += 1,
        }
        r.operations += 1;
    }
    let rss_after = rss_kb();
    let collisions = key_collisions(&mut rng, if size.short { 20_000 } else { 1_000_000 })?;
    r.faults = r.operations;
    let mut codes: Vec<_> = statuses.into_iter().collect();
    codes.sort_unstable();
    r.note(format!(
        "statuses {codes:?}; 5xx {server_errors}; panics {panics}; 4xx without a JSON error {non_json}; \
         #[lockable] cases {macro_cases} (axum extractor rejections among them {extractor_rejections}); \
         requests the http crate refused to build {unbuildable}; key collisions {collisions}; RSS {rss_before} → {rss_after} kB"
    ));
    if server_errors > 0 || panics > 0 || non_json > 0 || collisions > 0 {
        r.fail("bad input produced a 5xx, a panic, a non-JSON error or a key collision");
    }
    match huge_and_slow_bodies(&app).await {
        Ok(note) => r.note(note),
        Err(e) => r.fail(e),
    }
    Ok(r)
}

fn infallible<T>(r: Result<T, std::convert::Infallible>) -> T {
    match r {
        Ok(t) => t,
        Err(never) => match never {},
    }
}

/// One megabyte of zeros, streamed over and over without allocating.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

/// A 100 MB body streamed without `Content-Length` and one that declares
/// 100 MB: both refused with 413 after reading at most the limit, with
/// memory bounded. A slow sender: while its body trickles in, no lock is
/// held for it (the layer reads the body before it acquires), so another
/// request on the same key is served at once.
async fn huge_and_slow_bodies(app: &Router) -> Result<String, String> {
    use futures_util::StreamExt;

    let rss_before = rss_kb();
    let chunks =
        futures_util::stream::iter(0..100).map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from_static(&ZEROS)));
    let streamed = Request::post("/j").header("content-type", "application/json").body(Body::from_stream(chunks));
    let declared = Request::post("/j")
        .header("content-type", "application/json")
        .header("content-length", (100u64 << 20).to_string())
        .body(Body::from("{}"));
    let mut statuses = Vec::new();
    for req in [streamed, declared] {
        let req = req.map_err(|e| format!("building a huge request: {e}"))?;
        let res = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(req))
            .await
            .map_err(|_| "a 100 MB body was not refused within 10 s".to_owned())
            .map(infallible)?;
        statuses.push(res.status().as_u16());
    }
    let grown_kb = rss_kb().saturating_sub(rss_before);
    if statuses != [413, 413] || grown_kb > 16 * 1024 {
        return Err(format!("100 MB bodies: statuses {statuses:?} (want 413, 413), RSS grew {grown_kb} kB"));
    }

    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
    let trickle = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let slow = Request::post("/j")
        .header("content-type", "application/json")
        .body(Body::from_stream(trickle))
        .map_err(|e| format!("building the slow request: {e}"))?;
    let slow = tokio::spawn(app.clone().oneshot(slow));
    let body = r#"{"order":{"id":"slow"},"items":[{"sku":1}]}"#;
    let (head, tail) = body.split_at(10);
    tx.send(Ok(axum::body::Bytes::from_static(head.as_bytes()))).await.map_err(|_| "the slow body was dropped")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Same key, sent whole while the slow body is still arriving.
    let fast = Request::post("/j")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .map_err(|e| e.to_string())?;
    let fast = tokio::time::timeout(Duration::from_secs(2), app.clone().oneshot(fast))
        .await
        .map_err(|_| "a request waited for a slow sender's body".to_owned())
        .map(infallible)?;
    tx.send(Ok(axum::body::Bytes::from_static(tail.as_bytes()))).await.map_err(|_| "the slow body was dropped")?;
    drop(tx);
    let slow = tokio::time::timeout(Duration::from_secs(5), slow)
        .await
        .map_err(|_| "the slow request did not finish".to_owned())?
        .map_err(|e| format!("the slow request's task: {e}"))
        .map(infallible)?;
    if (fast.status().as_u16(), slow.status().as_u16()) != (200, 200) {
        return Err(format!(
            "slow sender: same-key request {} while the body trickled, slow one {}",
            fast.status(),
            slow.status()
        ));
    }
    Ok(format!(
        "100 MB bodies (streamed, and declared): 413 and 413, RSS +{grown_kb} kB; a same-key request served while a slow \
         sender's body trickled in (no lock held during body reads)"
    ))
}

/// Builds keys from random tuples full of separators and escapes; two
/// different tuples must never give the same key.
fn key_collisions(rng: &mut Rng, n: u64) -> Result<u64, String> {
    let mut seen: HashMap<String, (String, String)> = HashMap::new();
    let mut collisions = 0;
    for _ in 0..n {
        let (a, b) = (nasty_string(rng), nasty_string(rng));
        let key = match LockKey::builder("fuzz", "k").part(a.as_str()).part(b.as_str()).build() {
            Ok(k) => k.as_str().to_owned(),
            // Too long or otherwise refused: a typed error, not a collision.
            Err(_) => continue,
        };
        if let Some(prev) = seen.insert(key, (a.clone(), b.clone()))
            && prev != (a, b)
        {
            collisions += 1;
        }
    }
    Ok(collisions)
}
