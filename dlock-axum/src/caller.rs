//! Who sent a request: one identity for the idempotency scope, bound
//! tokens and the lock quota.

use std::fmt;
use std::sync::Arc;

use axum::http::request::Parts;
use axum::http::{header, HeaderName};
use dlock_core::idempotency::fingerprint;

/// Who sent a request, read from the request the way the service
/// authenticates: by a header, a cookie or what its auth layer established.
///
/// One type names the caller everywhere dlock needs it:
///
/// * [`IdempotencyLayer::caller`](crate::idempotency::IdempotencyLayer::caller):
///   whom an `Idempotency-Key` belongs to (default: the `Authorization`
///   header). Keys of different callers never meet, so one caller is never
///   answered with another's stored response.
/// * [`TokenLayer::caller`](crate::idempotency::TokenLayer::caller) and
///   [`bound_token_handler`](crate::idempotency::bound_token_handler): whom a
///   one-time token is bound to.
/// * [`LockLayer::max_holds_per`](crate::LockLayer::max_holds_per): whose
///   holds a cap counts.
///
/// A request whose caller cannot be found (no such header, or an empty one;
/// no such cookie, or an empty one; the function says `None`) has none, and
/// is refused: `400 idempotency_scope_missing` by the idempotency layers,
/// `400 lock_caller_missing` by a capped [`LockLayer`](crate::LockLayer).
/// Requests without a caller are never pooled into a shared "anonymous" one
/// behind the service's back; [`Caller::shared`] is the one explicit way to
/// say that every request is the same caller.
///
/// Header and cookie values are credentials: they are hashed, and only the
/// hash is stored or counted. A header, a cookie, a function's answer and
/// [`Caller::shared`] never name the same caller, whatever their values.
///
/// # A caller comes from the app's authentication
///
/// Every caller has caps of its own: live idempotency records and bound
/// tokens per caller
/// ([`IdempotencyLimits`](dlock_core::idempotency::IdempotencyLimits)),
/// holds per caller ([`LockLayer::max_holds_per`](crate::LockLayer::max_holds_per)).
/// So name the caller by what the app *verified*: the user id of a JWT
/// whose signature it checked, the account of a session it looked up.
/// Never by a value a client can make up unchecked: each made-up value is
/// a new caller with fresh caps, and a script that sends a new one per
/// request is held back only by the store's total, which it then fills for
/// everyone (`503 idempotency_store_full`).
///
/// A header or a cookie ([`Caller::header`], [`Caller::cookie`], and the
/// idempotency layers' default, the `Authorization` header) is only as good
/// as what verified it: sound when the app's authentication runs *before*
/// the dlock layer and refuses a credential it did not verify (or a trusted
/// proxy sets the header and drops the client's own), a free pass when
/// nothing checks it. It also names a credential, not a user: a user whose
/// token is renewed becomes another caller, and a retry sent with the new
/// token is another scope than its first try. The verified user id, read
/// with [`Caller::from_fn`] from what the authentication put in the
/// request's extensions, has neither flaw:
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
/// Should the layers be put the other way round, the function finds no
/// user and every request with an `Idempotency-Key` is refused
/// (`400 idempotency_scope_missing`), never pooled or given a caller of the
/// client's choosing.
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
    /// The value of a request header (`Authorization`, `x-api-key`),
    /// hashed: the credential itself is never stored. A request without it,
    /// or with it empty or blank, has no caller.
    ///
    /// A client can only reach the records of a credential it holds, so
    /// one caller is never answered with another's response. But the caps
    /// count per value: unless the app's authentication refuses a value it
    /// did not verify before this caller is read (or a trusted proxy sets
    /// the header and drops the client's own), a client that makes up a
    /// value per request gets fresh caps (records, bound tokens, lock
    /// holds) for each. See [A caller comes from the app's
    /// authentication](Caller#a-caller-comes-from-the-apps-authentication).
    ///
    /// ```
    /// use dlock_axum::{idempotency::IdempotencyLayer, Caller};
    /// let layer = IdempotencyLayer::new().caller(Caller::header("x-api-key"));
    /// ```
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name: a programming error, found
    /// when the layer is built.
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

    /// Whatever the request says, read by `f`: typically the user id an
    /// auth layer put in the extensions, the caller this type is best
    /// named by (a value the app verified). `None` is no caller. The answer
    /// is kept as it is (not hashed): return an id, not a secret.
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

    /// One caller for every request. For idempotency: any client that sends
    /// a key another client used gets that client's stored response, so
    /// only for a service with one caller (called by one backend of its
    /// own). For a lock cap: one cap for all the requests of the layer.
    ///
    /// ```
    /// use dlock_axum::{Caller, LockLayer};
    /// // At most 8 reports built at once by this instance, whoever asks.
    /// let layer = LockLayer::new("report.build").json("report_id").max_holds_per(8, Caller::shared());
    /// ```
    pub fn shared() -> Self {
        Caller(Kind::Shared)
    }

    /// The `Authorization` header: the idempotency layers' default. As
    /// [`Caller::header`], only as good as what verified it.
    pub(crate) fn authorization() -> Self {
        Caller(Kind::Header(header::AUTHORIZATION))
    }

    /// The caller of a request, prefixed by its kind so that a header value
    /// and a function's answer can never be the same caller; `None` when
    /// the request has none.
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

    /// The requests of one caller, as a refusal may name them without
    /// naming the caller (its value may be a secret).
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

    /// Kinds never meet: a function that answers with what a header would
    /// hash to, or a cookie of a header's name and value, is another caller.
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

    /// The stored form is today's: records and bound tokens written by
    /// `Scope` are found again by `Caller`.
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
