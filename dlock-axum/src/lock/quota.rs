//! A cap on the locks one caller holds at once through a layer
//! ([`LockLayer::max_holds_per`](super::LockLayer::max_holds_per); `docs/axum-design.md`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::http::request::Parts;

use crate::caller::Caller;
use crate::rejection::Rejection;

/// The holds of each caller, counted by one layer in this process.
#[derive(Debug)]
pub(crate) struct Quota {
    caller: Caller,
    max: usize,
    held: Mutex<HashMap<String, usize>>,
}

impl Quota {
    pub(crate) fn new(caller: Caller, max: usize) -> Self {
        Quota { caller, max, held: Mutex::new(HashMap::new()) }
    }

    fn held(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one of the caller's holds, or says why not.
    pub(crate) fn take(self: &Arc<Self>, parts: &Parts) -> Result<Permit, NoPermit> {
        let caller = self.caller.of(parts).ok_or(NoPermit::NoCaller)?;
        let mut held = self.held();
        let count = held.entry(caller.clone()).or_insert(0);
        if *count >= self.max {
            return Err(NoPermit::OverQuota(OverQuota { max: self.max, who: self.caller.requests() }));
        }
        *count += 1;
        Ok(Permit { quota: self.clone(), caller })
    }

    /// How many holds are counted now, over every caller (for tests).
    #[cfg(test)]
    pub(crate) fn holding(&self) -> usize {
        self.held().values().sum()
    }
}

/// One hold counted against a caller, given back on drop (however the request ends).
#[derive(Debug)]
pub(crate) struct Permit {
    quota: Arc<Quota>,
    caller: String,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = self.quota.held();
        if let Some(count) = held.get_mut(&self.caller) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.caller);
            }
        }
    }
}

/// Why a request got no permit.
#[derive(Debug)]
pub(crate) enum NoPermit {
    /// The request names no caller.
    NoCaller,
    /// Its caller already holds the most locks allowed.
    OverQuota(OverQuota),
}

/// A caller already holds the most locks allowed.
#[derive(Debug)]
pub(crate) struct OverQuota {
    max: usize,
    /// The caller's requests, named without the caller (it may be a secret).
    who: String,
}

impl OverQuota {
    /// The `429 too_many_locks` refusal, naming no caller.
    pub(crate) fn rejection(&self) -> Rejection {
        Rejection::too_many_locks()
            .with_message(format!("{} already hold {} locks here; retry when one has finished", self.who, self.max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn as_user(user: Option<&'static str>) -> Parts {
        let mut req = Request::builder();
        if let Some(u) = user {
            req = req.header("x-user-id", u);
        }
        req.body(()).expect("request").into_parts().0
    }

    fn by_header(max: usize) -> Arc<Quota> {
        Arc::new(Quota::new(Caller::header("x-user-id"), max))
    }

    #[test]
    fn each_caller_has_its_own_cap_and_gets_it_back() {
        let q = by_header(2);
        let a1 = q.take(&as_user(Some("a"))).expect("1st");
        let _a2 = q.take(&as_user(Some("a"))).expect("2nd");
        assert!(matches!(q.take(&as_user(Some("a"))), Err(NoPermit::OverQuota(_))), "3rd over the cap");
        let _b = q.take(&as_user(Some("b"))).expect("another caller");
        drop(a1);
        assert_eq!(q.holding(), 2);
        let _a3 = q.take(&as_user(Some("a"))).expect("freed by the drop");
    }

    #[test]
    fn requests_without_a_caller_are_refused_and_counted_nowhere() {
        let q = by_header(1);
        for user in [None, Some(""), Some("  ")] {
            assert!(matches!(q.take(&as_user(user)), Err(NoPermit::NoCaller)), "{user:?}");
        }
        assert!(q.held().is_empty(), "nothing counted for a request without a caller");
        let p = q.take(&as_user(Some("a"))).expect("a caller's first");
        drop(p);
        assert!(q.held().is_empty(), "no entry left for a caller holding nothing");
    }

    #[test]
    fn a_shared_caller_is_one_cap_for_all() {
        let q = Arc::new(Quota::new(Caller::shared(), 1));
        let _p = q.take(&as_user(Some("a"))).expect("1st");
        assert!(matches!(q.take(&as_user(Some("b"))), Err(NoPermit::OverQuota(_))));
        assert!(matches!(q.take(&as_user(None)), Err(NoPermit::OverQuota(_))));
    }

    #[test]
    fn the_refusal_names_the_kind_not_the_caller() {
        let q = by_header(1);
        let _p = q.take(&as_user(Some("secret-user"))).expect("1st");
        let Err(NoPermit::OverQuota(over)) = q.take(&as_user(Some("secret-user"))) else { panic!("over the cap") };
        let r = over.rejection();
        assert_eq!((r.status().as_u16(), r.error()), (429, "too_many_locks"));
        assert!(r.message().contains("x-user-id header") && !r.message().contains("secret-user"), "{}", r.message());
    }
}
