//! `LockLayer`'s key derivation against an oracle built from the documented
//! rules (reliability.md T10): for any body and query string, the layer
//!
//! * answers 413 above its body limit, 400 `invalid_json` exactly when
//!   `serde_json` refuses the body, 400 `lock_key_field_missing` exactly when
//!   the field or the query parameter is absent, 400 `lock_key_invalid`
//!   exactly when the key would pass its length cap, and otherwise calls the
//!   route — never a 5xx, never a panic;
//! * passes the body on unchanged;
//! * holds the lock on exactly the key the rules give (checked from inside
//!   the route by trying that key as another owner).
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use dlock_axum::{LockLayer, DlockExt};
use dlock_core::{escape_into, Error, KeyPart, LockKey, Locker, MemoryBackend, MAX_KEY_LEN};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tower::ServiceExt;

const LIMIT: usize = 4096;
const FIELD: [&str; 2] = ["a", "b"];

struct Fixture {
    rt: tokio::runtime::Runtime,
    app: Router,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let locker = Locker::new(MemoryBackend::new());
        let layer = LockLayer::new("fuzz").json("a.b").query("t").max_body_bytes(LIMIT);
        let app = Router::new().route("/r", post(route).layer(layer)).with_dlock(locker);
        Fixture { rt, app }
    })
}

/// The key the rules give, in the layer's JSON-part encoding.
#[derive(Clone)]
struct Expected(LockKey);

/// Echoes the body; proves the expected key is the one held.
async fn route(
    Extension(locker): Extension<Locker>,
    expected: Option<Extension<Expected>>,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let Some(Extension(Expected(key))) = expected else {
        return (StatusCode::IM_A_TEAPOT, Bytes::from_static(b"the route ran although the oracle refuses the request"));
    };
    match locker.try_acquire(&key).await {
        Err(Error::Busy { .. }) => (StatusCode::OK, body),
        Ok(_) => (StatusCode::IM_A_TEAPOT, Bytes::from(format!("{key} was free inside the locked route"))),
        Err(e) => (StatusCode::IM_A_TEAPOT, Bytes::from(format!("probe failed: {e}"))),
    }
}

fn lookup<'a>(root: &'a Value, segments: &[&str]) -> Option<&'a Value> {
    segments.iter().try_fold(root, |cur, seg| match cur {
        Value::Object(map) => map.get(*seg),
        Value::Array(items) => seg.parse::<usize>().ok().and_then(|i| items.get(i)),
        _ => None,
    })
}

struct Json<'a>(&'a Value);

impl KeyPart for Json<'_> {
    fn write_part(&self, out: &mut String) {
        match self.0 {
            Value::Null => None::<&str>.write_part(out),
            Value::String(s) => escape_into(s, out),
            Value::Number(n) => out.push_str(&n.to_string()),
            other => escape_into(&other.to_string(), out),
        }
    }
}

enum Verdict {
    TooLarge,
    InvalidJson,
    Missing,
    KeyTooLong,
    Locked(LockKey),
}

fn oracle(body: &[u8], query: &str) -> Verdict {
    if body.len() > LIMIT {
        return Verdict::TooLarge;
    }
    let Ok(json) = serde_json::from_slice::<Value>(body) else { return Verdict::InvalidJson };
    let Some(field) = lookup(&json, &FIELD) else { return Verdict::Missing };
    let Some(t) = query_param(query, "t") else { return Verdict::Missing };
    match LockKey::builder("dlock", "fuzz").part(Json(field)).part(t.as_str()).build() {
        Ok(key) => Verdict::Locked(key),
        Err(_) => Verdict::KeyTooLong,
    }
}

/// The first `name=` pair, percent- and `+`-decoded as
/// `application/x-www-form-urlencoded` (written out here rather than taken
/// from the crate the layer uses, so the oracle is independent of it).
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() && hex(bytes[i + 1]).is_some() && hex(bytes[i + 2]).is_some() => {
                out.push(hex(bytes[i + 1]).unwrap_or(0) * 16 + hex(bytes[i + 2]).unwrap_or(0));
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// A JSON document written as given: objects keep duplicate keys and
/// order, so the layer's "last duplicate wins" is compared with `serde_json`.
#[derive(Debug, Clone, Arbitrary)]
enum Doc {
    Null,
    Bool(bool),
    Int(i64),
    Big(u64),
    Float(f64),
    Str(String),
    Arr(Vec<Doc>),
    Obj(Vec<(String, Doc)>),
}

impl Doc {
    fn write(&self, out: &mut String) {
        match self {
            Doc::Null => out.push_str("null"),
            Doc::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Doc::Int(n) => out.push_str(&n.to_string()),
            Doc::Big(n) => out.push_str(&format!("{n}00000000000000000000")),
            Doc::Float(x) => out.push_str(&serde_json::to_string(x).unwrap_or_else(|_| "null".into())),
            Doc::Str(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
            Doc::Arr(items) => {
                out.push('[');
                for (i, d) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    d.write(out);
                }
                out.push(']');
            }
            Doc::Obj(members) => {
                out.push('{');
                for (i, (k, d)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(k).unwrap_or_default());
                    out.push(':');
                    d.write(out);
                }
                out.push('}');
            }
        }
    }
}

/// Bodies: mostly near the key field, so the fuzzer spends its time where
/// the layer decides, plus raw and damaged bytes.
#[derive(Debug, Arbitrary)]
enum BodyShape {
    /// `{..before, "a": {..inner, "b": field, ..after}, ..rest}`
    Keyed {
        before: Vec<(String, Doc)>,
        inner: Vec<(String, Doc)>,
        field: Option<Doc>,
        after: Vec<(String, Doc)>,
        rest: Vec<(String, Doc)>,
    },
    Any(Doc),
    /// A keyed body cut at `cut` bytes or with `byte` put at `at`.
    Damaged {
        doc: Box<BodyShape>,
        cut: Option<u16>,
        at: u16,
        byte: Option<u8>,
    },
    Raw(Vec<u8>),
}

impl BodyShape {
    fn bytes(&self) -> Vec<u8> {
        match self {
            BodyShape::Keyed { before, inner, field, after, rest } => {
                let mut a = inner.clone();
                if let Some(f) = field {
                    a.push(("b".to_owned(), f.clone()));
                }
                a.extend(after.clone());
                let mut root = before.clone();
                root.push(("a".to_owned(), Doc::Obj(a)));
                root.extend(rest.clone());
                let mut out = String::new();
                Doc::Obj(root).write(&mut out);
                out.into_bytes()
            }
            BodyShape::Any(d) => {
                let mut out = String::new();
                d.write(&mut out);
                out.into_bytes()
            }
            BodyShape::Damaged { doc, cut, at, byte } => {
                let mut b = doc.bytes();
                if let Some(cut) = cut {
                    b.truncate(usize::from(*cut));
                }
                if let Some(byte) = byte {
                    let at = usize::from(*at).min(b.len());
                    b.insert(at, *byte);
                }
                b
            }
            BodyShape::Raw(b) => b.clone(),
        }
    }
}

/// Query strings: mostly with a `t` parameter, percent-encoded or not.
#[derive(Debug, Arbitrary)]
enum QueryShape {
    T { before: String, value: String, encode: bool, dup: Option<String> },
    Raw(String),
}

impl QueryShape {
    fn text(&self) -> String {
        match self {
            QueryShape::T { before, value, encode, dup } => {
                let v = if *encode { percent(value) } else { value.clone() };
                let mut q = format!("{}&t={v}", percent(before));
                if let Some(d) = dup {
                    q.push_str(&format!("&t={}", percent(d)));
                }
                q
            }
            QueryShape::Raw(s) => s.clone(),
        }
    }
}

fn percent(s: &str) -> String {
    s.bytes().map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}

fuzz_target!(|input: (BodyShape, QueryShape)| {
    let (body, query) = (input.0.bytes(), input.1.text());
    let f = fixture();
    let Ok(req) =
        Request::post(format!("/r?{query}")).header("content-type", "application/json").body(Body::from(body.clone()))
    else {
        return; // not a URI a client can send
    };
    // The URI parser may normalise; the oracle reads what the server will see.
    let seen_query = req.uri().query().unwrap_or("").to_owned();
    let verdict = oracle(&body, &seen_query);
    let mut req = req;
    if let Verdict::Locked(key) = &verdict {
        req.extensions_mut().insert(Expected(key.clone()));
    }
    let (status, out) = f.rt.block_on(async {
        let res = f.app.clone().oneshot(req).await.expect("infallible");
        let status = res.status();
        let out = res.into_body().collect().await.expect("an in-memory body").to_bytes();
        (status, out)
    });
    let error = || -> String {
        let v: Value =
            serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{status} without a JSON body: {e}: {out:?}"));
        assert!(v["code"].is_u64() && v["message"].is_string(), "{status}: {v}");
        v["error"].as_str().unwrap_or_else(|| panic!("{status}: {v}")).to_owned()
    };
    match verdict {
        Verdict::TooLarge => {
            assert_eq!((status, error().as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"))
        }
        Verdict::InvalidJson => assert_eq!((status, error().as_str()), (StatusCode::BAD_REQUEST, "invalid_json")),
        Verdict::Missing => assert_eq!((status, error().as_str()), (StatusCode::BAD_REQUEST, "lock_key_field_missing")),
        Verdict::KeyTooLong => assert_eq!((status, error().as_str()), (StatusCode::BAD_REQUEST, "lock_key_invalid")),
        Verdict::Locked(key) => {
            assert_eq!(status, StatusCode::OK, "{key}: {}", String::from_utf8_lossy(&out));
            assert_eq!(out.as_ref(), body.as_slice(), "the body reached the route changed");
            assert!(key.as_str().len() <= MAX_KEY_LEN);
        }
    }
});
