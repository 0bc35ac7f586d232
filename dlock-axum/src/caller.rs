//! Who sent a request: one identity for the idempotency scope, bound
//! tokens and the lock quota.

use std::fmt;
use std::sync::Arc;

use axum::http::request::Parts;
use axum::http::{header, HeaderName};
use dlock_core::idempotency::fingerprint;

/// Who sent a request (a header, a cookie, or what the auth layer
/// established): whom a key belongs to
/// ([`IdempotencyLayer::caller`](crate::idempotency::IdempotencyLayer::caller)),
/// a token is bound to ([`TokenLayer::caller`](crate::idempotency::TokenLayer::caller)),
/// a lock cap counts ([`LockLayer::max_holds_per`](crate::LockLayer::max_holds_per)).
///
/// A request without one (no such header or cookie, an empty one, `None`)
/// is refused, never pooled: [`Caller::shared`] is the explicit way. Header
/// and cookie values are hashed; different kinds never name the same caller.
///
/// # A caller comes from the app's authentication
///
/// Each caller has caps of its own, so name it by what the app *verified*
/// (a checked JWT's subject), with [`Caller::from_fn`]: a value a client
/// makes up is a fresh caller with fresh caps. See `docs/idempotency.md`.
///
/// ```
/// use axum::{extract::Request, http::StatusCode, middleware::{self, Next}, response::Response};
/// use axum::{routing::post, Router};
/// use dlock_axum::{idempotency::IdempotencyLayer, Caller};
///
/// /// The subject of a token the app verified.
/// #[derive(Clone)]
/// struct UserId(String);
///
/// /// The app's authentication: a request whose token does not verify
/// /// never reaches the routes, so it never makes a record.
/// async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
///     let token = req.headers().get("authorization").and_then(|v| v.to_str().ok());
///     let user = token.and_then(verify_jwt).ok_or(StatusCode::UNAUTHORIZED)?;
///     req.extensions_mut().insert(user);
///     Ok(next.run(req).await)
/// }
/// # fn verify_jwt(token: &str) -> Option<UserId> { token.strip_prefix("Bearer ").map(|s| UserId(s.to_owned())) }
///
/// let by_user = Caller::from_fn(|parts| parts.extensions.get::<UserId>().map(|u| u.0.clone()));
/// let app: Router = Router::new()
///     .route("/pay", post(|| async { "paid" }))
///     .layer(IdempotencyLayer::new().caller(by_user))
///     // The outer layer runs first: authentication, then the records.
///     .layer(middleware::from_fn(authenticate));
/// ```
///
/// With the layers the other way round, the function finds no user and every
/// keyed request is `400 idempotency_scope_missing`, never pooled.
///
/// ```
/// use dlock_axum::Caller;
///
/// #[derive(Clone)]
/// struct UserId(u64); // put in the extensions by the app's auth layer
///
/// // Sound behind an auth layer (or proxy) that checks these values first.
/// let by_api_key = Caller::header("x-api-key");
/// let by_session = Caller::cookie("session");
/// // Sound by construction: what the auth layer verified.
/// let by_user = Caller::from_fn(|parts| parts.extensions.get::<UserId>().map(|u| u.0.to_string()));
/// ```
#[derive(Clone)]
pub struct Caller(Kind);

/// A caller named by the application's function.
type CallerFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

#[derive(Clone)]
enum Kind {
    Header(HeaderName),
    Cookie(Arc<str>),
    Fn(CallerFn),
    Shared,
}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Header(name) => write!(f, "Caller::header({name:?})"),
            Kind::Cookie(name) => write!(f, "Caller::cookie({name:?})"),
            Kind::Fn(_) => f.write_str("Caller::from_fn(..)"),
            Kind::Shared => f.write_str("Caller::shared()"),
        }
    }
}

impl Caller {
    /// A request header (`x-api-key`), hashed; missing, empty or blank is no
    /// caller. Sound only behind authentication that checks it: see [A caller
    /// comes from the app's authentication](Caller#a-caller-comes-from-the-apps-authentication).
    ///
    /// ```
    /// use dlock_axum::{idempotency::IdempotencyLayer, Caller};
    /// let layer = IdempotencyLayer::new().caller(Caller::header("x-api-key"));
    /// ```
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn header(name: &str) -> Self {
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => Caller(Kind::Header(name)),
            Err(_) => panic!("Caller::header: `{name}` is not a valid header name"),
        }
    }

    /// The value of a cookie (a session id), hashed. A request without it,
    /// or with it empty, has no caller.
    ///
    /// ```
    /// use dlock_axum::{idempotency::IdempotencyLayer, Caller};
    /// let layer = IdempotencyLayer::new().caller(Caller::cookie("session"));
    /// ```
    pub fn cookie(name: &str) -> Self {
        Caller(Kind::Cookie(name.into()))
    }

    /// The caller `f` reads, typically a user id the auth layer put in the
    /// extensions; `None` is no caller. Not hashed: return an id, not a secret.
    ///
    /// ```
    /// use dlock_axum::{Caller, LockLayer};
    ///
    /// #[derive(Clone)]
    /// struct User(String); // set by the service's authentication middleware
    ///
    /// let by_user = Caller::from_fn(|parts| parts.extensions.get::<User>().map(|u| u.0.clone()));
    /// let layer = LockLayer::new("report.build").json("report_id").max_holds_per(20, by_user);
    /// ```
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Caller(Kind::Fn(Arc::new(f)))
    }

    /// One caller for every request: clients then share stored responses, so
    /// only for a service with one caller; for a lock cap, one cap for all.
    ///
    /// ```
    /// use dlock_axum::{Caller, LockLayer};
    /// // At most 8 reports built at once by this instance, whoever asks.
    /// let layer = LockLayer::new("report.build").json("report_id").max_holds_per(8, Caller::shared());
    /// ```
    pub fn shared() -> Self {
        Caller(Kind::Shared)
    }

    /// The `Authorization` header: the idempotency layers' default.
    pub(crate) fn authorization() -> Self {
        Caller(Kind::Header(header::AUTHORIZATION))
    }

    /// The caller of a request, prefixed by its kind so that kinds never meet.
    pub(crate) fn of(&self, parts: &Parts) -> Option<String> {
        let hashed = |kind: &str, name: &str, value: &[u8]| format!("{kind}:{name}:{}", fingerprint(&[value]));
        match &self.0 {
            Kind::Header(name) => parts
                .headers
                .get(name)
                .filter(|v| !v.as_bytes().iter().all(u8::is_ascii_whitespace))
                .map(|v| hashed("h", name.as_str(), v.as_bytes())),
            Kind::Cookie(name) => parts
                .headers
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .filter_map(|pair| pair.trim().split_once('='))
                .find(|(n, v)| *n == &**name && !v.is_empty())
                .map(|(_, v)| hashed("c", name, v.as_bytes())),
            Kind::Fn(f) => f(parts).map(|v| format!("f:{v}")),
            Kind::Shared => Some("shared".to_owned()),
        }
    }

    /// The requests of one caller, as a refusal names them (its value may be a secret).
    pub(crate) fn requests(&self) -> String {
        match &self.0 {
            Kind::Header(name) => format!("the requests with this {name} header"),
            Kind::Cookie(name) => format!("the requests with this {name} cookie"),
            Kind::Fn(_) => "your requests".to_owned(),
            Kind::Shared => "the requests here".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut req = Request::builder();
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).expect("request").into_parts().0
    }

    #[test]
    fn a_header_is_hashed_and_an_empty_or_blank_one_is_no_caller() {
        let caller = Caller::header("x-api-key");
        let alice = caller.of(&parts(&[("x-api-key", "k-alice")])).expect("a caller");
        assert!(!alice.contains("k-alice"), "the credential is not kept: {alice}");
        assert_eq!(caller.of(&parts(&[("x-api-key", "k-alice")])).as_ref(), Some(&alice), "stable");
        assert_ne!(caller.of(&parts(&[("x-api-key", "k-bob")])).as_ref(), Some(&alice));
        for blank in ["", " ", "\t "] {
            assert_eq!(caller.of(&parts(&[("x-api-key", blank)])), None, "{blank:?}");
        }
        assert_eq!(caller.of(&parts(&[])), None);
    }

    #[test]
    fn a_cookie_is_found_among_others_and_an_empty_one_is_no_caller() {
        let caller = Caller::cookie("session");
        let s1 = caller.of(&parts(&[("cookie", "theme=dark; session=s1")])).expect("a caller");
        assert!(!s1.contains("s1"), "the session id is not kept: {s1}");
        assert_eq!(caller.of(&parts(&[("cookie", "theme=dark"), ("cookie", "session=s1")])), Some(s1.clone()));
        assert_ne!(caller.of(&parts(&[("cookie", "session=s2")])), Some(s1));
        assert_eq!(caller.of(&parts(&[("cookie", "session=")])), None);
        assert_eq!(caller.of(&parts(&[("cookie", "sessionx=s1")])), None, "another cookie's name");
        assert_eq!(caller.of(&parts(&[])), None);
    }

    /// Kinds never meet, whatever a function answers or a cookie is named.
    #[test]
    fn kinds_never_name_the_same_caller() {
        let req = parts(&[("session", "v"), ("cookie", "session=v")]);
        let by_header = Caller::header("session").of(&req).expect("header");
        let by_cookie = Caller::cookie("session").of(&req).expect("cookie");
        let echo = by_header.clone();
        let by_fn = Caller::from_fn(move |_| Some(echo.clone())).of(&req).expect("fn");
        let shared = Caller::shared().of(&req).expect("shared");
        let by_fn_shared = Caller::from_fn(|_| Some("shared".to_owned())).of(&req).expect("fn");
        let all = [&by_header, &by_cookie, &by_fn, &shared, &by_fn_shared];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(Caller::from_fn(|_| None).of(&req), None);
    }

    /// The stored form is unchanged: records written by `Scope` are found by `Caller`.
    #[test]
    fn the_stored_form_is_unchanged() {
        let req = parts(&[("authorization", "Bearer a"), ("cookie", "session=s")]);
        let h = format!("h:authorization:{}", fingerprint(&[b"Bearer a"]));
        let c = format!("c:session:{}", fingerprint(&[b"s"]));
        assert_eq!(Caller::authorization().of(&req), Some(h));
        assert_eq!(Caller::cookie("session").of(&req), Some(c));
        assert_eq!(Caller::from_fn(|_| Some("u1".to_owned())).of(&req).as_deref(), Some("f:u1"));
        assert_eq!(Caller::shared().of(&req).as_deref(), Some("shared"));
    }

    #[test]
    #[should_panic(expected = "not a valid header name")]
    fn an_invalid_header_name_panics_when_built() {
        let _ = Caller::header("bad header");
    }
}
