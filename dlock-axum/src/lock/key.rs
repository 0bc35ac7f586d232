//! Turning a request into a lock key.

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use dlock_core::{escape_into, KeyPart, LockKey, Locker};
use serde_json::Value;

use super::json::Picked;
use super::spec::{KeySource, Spec};
use crate::pipeline::refusal::Refusal;
use crate::rejection::Rejection;

/// A JSON value as a key part: strings as their text, `null` as dlock's "no
/// value" part, anything else as its compact JSON text (object keys sorted).
struct JsonPart<'a>(&'a Value);

impl KeyPart for JsonPart<'_> {
    fn write_part(&self, out: &mut String) {
        match self.0 {
            Value::Null => None::<&str>.write_part(out),
            Value::String(s) => escape_into(s, out),
            // Integers as dlock's integer parts write them, without a temporary string.
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => u.write_part(out),
                (None, Some(i)) => i.write_part(out),
                (None, None) => {
                    use std::fmt::Write;
                    let _ = write!(out, "{n}");
                }
            },
            other => escape_into(&other.to_string(), out),
        }
    }
}

/// The keys a request takes: one (no allocation), or several.
#[derive(Debug)]
pub(crate) enum Keys {
    One([LockKey; 1]),
    Many(Vec<LockKey>),
}

impl Keys {
    pub(crate) fn as_slice(&self) -> &[LockKey] {
        match self {
            Keys::One(one) => one,
            Keys::Many(many) => many,
        }
    }
}

/// Builds the first key of `spec`, then those of [`LockLayer::also`](super::LockLayer::also).
pub(crate) async fn build_keys(
    spec: &Spec,
    locker: &Locker,
    parts: &mut Parts,
    json: Option<&Picked>,
) -> Result<Keys, Refusal> {
    let mut path_params: Option<RawPathParams> = None;
    let first = build_key(spec, spec.policy.name(), &spec.parts, locker, parts, json, &mut path_params).await?;
    if spec.also.is_empty() {
        return Ok(Keys::One([first]));
    }
    let mut keys = Vec::with_capacity(1 + spec.also.len());
    keys.push(first);
    for also in &spec.also {
        keys.push(build_key(spec, &also.name, &also.parts, locker, parts, json, &mut path_params).await?);
    }
    Ok(Keys::Many(keys))
}

/// Builds the key `name` from `sources`, in order. `path_params` are read
/// once per request, by the first key that needs them.
async fn build_key(
    spec: &Spec,
    name: &str,
    sources: &[KeySource],
    locker: &Locker,
    parts: &mut Parts,
    json: Option<&Picked>,
    path_params: &mut Option<RawPathParams>,
) -> Result<LockKey, Refusal> {
    let mut key = locker.key(name);
    for source in sources {
        match source {
            KeySource::Json { segments, .. } => {
                let value =
                    json.and_then(|picked| picked.lookup(&spec.json_want, segments)).ok_or_else(|| missing(source))?;
                key.push(JsonPart(value));
            }
            KeySource::Query(name) => {
                // Compared once percent-decoded: `%71` is `q` to every reader.
                let mut values = parts
                    .uri
                    .query()
                    .into_iter()
                    .flat_map(|q| form_urlencoded::parse(q.as_bytes()))
                    .filter(|(k, _)| k == name.as_str())
                    .map(|(_, v)| v);
                let value = values.next().ok_or_else(|| missing(source))?;
                if values.next().is_some() {
                    return Err(duplicated(source));
                }
                if is_blank(value.as_bytes()) {
                    return Err(empty(source));
                }
                key.push(value.as_ref());
            }
            KeySource::Path(name) => {
                if path_params.is_none() {
                    *path_params = Some(RawPathParams::from_request_parts(parts, &()).await.map_err(|e| {
                        match e {
                            // The client's fault (`/items/%FF`): a 400, not a 500.
                            RawPathParamsRejection::InvalidUtf8InPathParam(_) => Refusal::invalid(
                                Rejection::lock_key_invalid()
                                    .with_message(format!("{source} is not valid UTF-8 once percent-decoded")),
                            ),
                            _ => Refusal::invalid(
                                Rejection::misconfigured()
                                    .with_message("the lock layer cannot see the route's path parameters"),
                            )
                            .with_cause(format!(
                                "LockLayer::path(\"{name}\") found no path parameters: put the layer on the route \
                                 or the router (`post(handler).route_layer(..)`, `Router::route_layer`), not around the router"
                            )),
                        }
                    })?);
                }
                let value = path_params
                    .iter()
                    .flat_map(|p| p.iter())
                    .find(|(k, _)| *k == name.as_str())
                    .map(|(_, v)| v)
                    .ok_or_else(|| missing(source))?;
                key.push(value);
            }
            KeySource::Header(name) => {
                let value = crate::headers::sole(&parts.headers, name)
                    .map_err(|_| duplicated(source))?
                    .ok_or_else(|| missing(source))?;
                if is_blank(value.as_bytes()) {
                    return Err(empty(source));
                }
                let text = value.to_str().map_err(|_| {
                    Refusal::invalid(
                        Rejection::lock_key_invalid().with_message(format!("{source} is not visible ASCII")),
                    )
                })?;
                key.push(text);
            }
        }
    }
    key.build().map_err(|e| Refusal::from_error(e, &spec.policy, None, std::time::Duration::ZERO))
}

fn missing(source: &KeySource) -> Refusal {
    Refusal::invalid(Rejection::missing_field(source))
}

/// An empty or blank value is no value: as `""` it would put all such requests under one lock.
fn is_blank(value: &[u8]) -> bool {
    value.iter().all(u8::is_ascii_whitespace)
}

fn empty(source: &KeySource) -> Refusal {
    Refusal::invalid(Rejection::field_missing().with_message(format!("{source} is empty")))
}

/// A key field sent twice: the lock and the handler could read different values.
fn duplicated(source: &KeySource) -> Refusal {
    Refusal::invalid(
        Rejection::field_duplicated().with_message(format!("{source} is sent more than once; send it once")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn part(v: &Value) -> String {
        let mut s = String::new();
        JsonPart(v).write_part(&mut s);
        s
    }

    #[test]
    fn null_is_not_a_string() {
        for s in ["null", "None", "", "%N"] {
            assert_ne!(part(&Value::Null), part(&json!(s)), "{s}");
        }
    }

    #[test]
    fn values_are_escaped() {
        assert_eq!(part(&json!("a:b")), "a%3Ab");
        assert_eq!(part(&json!(12.5)), "12.5");
        for n in [json!(0), json!(-7), json!(u64::MAX), json!(i64::MIN), json!(1e300), json!(-0.5)] {
            assert_eq!(part(&n), n.to_string(), "numbers are their JSON text");
        }
        assert_eq!(part(&json!({"b": 1, "a": ":"})), "%7B\"a\"%3A\"%3A\",\"b\"%3A1%7D");
    }
}
