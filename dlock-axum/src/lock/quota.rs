//! A cap on the locks one principal holds at once through a layer.
//!
//! A lock held in watchdog mode costs the lock service a key and a renewal
//! every lease/3 for as long as its request runs. Without a cap, one client
//! that opens thousands of slow requests with distinct keys holds thousands
//! of locks; with it, the requests beyond the cap are refused with `429`
//! before any lock is asked for, and other principals are not affected.
//! (`max_hold` bounds how long each of the capped holds can last.)

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::http::request::Parts;
use axum::http::HeaderName;

/// Names the principal of a request from what the application established
/// (an extension set by its authentication layer, …).
pub(crate) type PrincipalFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;

/// Where the principal of a request comes from.
#[derive(Clone)]
pub(crate) enum Principal {
    /// A request header, which must be set by a trusted upstream (see
    /// [`LockLayer::max_holds_per_principal`](crate::LockLayer::max_holds_per_principal)).
    Header(HeaderName),
    /// The application's own function.
    Fn(PrincipalFn),
}

impl Principal {
    fn of(&self, parts: &Parts) -> Vec<u8> {
        match self {
            Principal::Header(name) => parts.headers.get(name).map(|v| v.as_bytes().to_vec()).unwrap_or_default(),
            Principal::Fn(f) => f(parts).into_bytes(),
        }
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Header(name) => write!(f, "header `{name}`"),
            Principal::Fn(_) => f.write_str("the application's function"),
        }
    }
}

/// The holds of each principal, counted by one layer in this process.
#[derive(Debug)]
pub(crate) struct Quota {
    principal: Principal,
    max: usize,
    held: Mutex<HashMap<Vec<u8>, usize>>,
}

impl Quota {
    pub(crate) fn new(principal: Principal, max: usize) -> Self {
        Quota { principal, max, held: Mutex::new(HashMap::new()) }
    }

    fn held(&self) -> MutexGuard<'_, HashMap<Vec<u8>, usize>> {
        // Counts are updated by single statements; a poisoned map is intact.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one of the principal's holds, or says who is over the cap.
    /// Requests without the header share one anonymous principal, so leaving
    /// the header out is no way around the cap.
    pub(crate) fn take(self: &Arc<Self>, parts: &Parts) -> Result<Permit, OverQuota> {
        let principal = self.principal.of(parts);
        let mut held = self.held();
        let count = held.entry(principal.clone()).or_insert(0);
        if *count >= self.max {
            return Err(OverQuota { principal: self.principal.clone(), max: self.max });
        }
        *count += 1;
        Ok(Permit { quota: self.clone(), principal })
    }

    /// How many holds the principal has now (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn holding(&self, principal: &[u8]) -> usize {
        self.held().get(principal).copied().unwrap_or(0)
    }
}

/// One hold counted against a principal; gives it back when dropped, which
/// covers every way a request ends (answered, refused later, dropped).
#[derive(Debug)]
pub(crate) struct Permit {
    quota: Arc<Quota>,
    principal: Vec<u8>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = self.quota.held();
        if let Some(count) = held.get_mut(&self.principal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                // No entry per principal that holds nothing: the map stays as
                // small as the set of principals holding locks right now.
                held.remove(&self.principal);
            }
        }
    }
}

/// A principal already holds the most locks allowed.
#[derive(Debug)]
pub(crate) struct OverQuota {
    principal: Principal,
    max: usize,
}

impl OverQuota {
    /// The `message` of the `429` (naming no principal: it may be a secret).
    pub(crate) fn message(&self) -> String {
        let who = match &self.principal {
            Principal::Header(name) => format!("the requests with this {name} header"),
            Principal::Fn(_) => "your requests".to_owned(),
        };
        format!("{who} already hold {} locks here; retry when one has finished", self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn headers(user: Option<&'static str>) -> Parts {
        let mut req = Request::builder();
        if let Some(u) = user {
            req = req.header("x-user-id", u);
        }
        req.body(()).expect("request").into_parts().0
    }

    fn by_header(max: usize) -> Arc<Quota> {
        Arc::new(Quota::new(Principal::Header(HeaderName::from_static("x-user-id")), max))
    }

    #[test]
    fn each_principal_has_its_own_cap_and_gets_it_back() {
        let q = by_header(2);
        let a1 = q.take(&headers(Some("a"))).expect("1st");
        let _a2 = q.take(&headers(Some("a"))).expect("2nd");
        assert!(q.take(&headers(Some("a"))).is_err(), "3rd over the cap");
        let _b = q.take(&headers(Some("b"))).expect("another principal");
        drop(a1);
        assert_eq!(q.holding(b"a"), 1);
        let _a3 = q.take(&headers(Some("a"))).expect("freed by the drop");
    }

    #[test]
    fn requests_without_the_header_share_one_cap() {
        let q = by_header(1);
        let p = q.take(&headers(None)).expect("1st anonymous");
        assert!(q.take(&headers(None)).is_err());
        drop(p);
        assert_eq!(q.holding(b""), 0);
        assert!(q.held().is_empty(), "no entry left for a principal holding nothing");
    }
}
