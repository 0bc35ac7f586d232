//! A rate per client address on `GET /idempotency/token`.
//!
//! The token endpoint answers anyone: without a rate, one client could drain
//! the store's pool of unbound tokens (`DLOCK_IDEMPOTENCY_MAX_UNBOUND_TOKENS`)
//! and every anonymous caller would be refused until its tokens expire. A
//! token bucket per address keeps one address to its share; the pool still
//! bounds what many addresses together can take.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dlock_axum::Rejection;

/// Addresses tracked at most; beyond, the ones whose bucket is full again
/// (idle long enough) are forgotten.
const MAX_ADDRESSES: usize = 100_000;

/// Tokens per second per address, with a burst of `burst`.
#[derive(Clone, Debug)]
pub(crate) struct TokenRate {
    per_sec: f64,
    burst: f64,
    buckets: Arc<Mutex<HashMap<IpAddr, (f64, Instant)>>>,
}

impl TokenRate {
    pub(crate) fn new(per_sec: u32, burst: u32) -> Self {
        TokenRate { per_sec: f64::from(per_sec), burst: f64::from(burst.max(1)), buckets: Arc::default() }
    }

    /// Takes one from `ip`'s bucket: `Ok`, or the seconds until one is there.
    fn take(&self, ip: IpAddr) -> Result<(), u32> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if buckets.len() >= MAX_ADDRESSES {
            let (per_sec, burst) = (self.per_sec, self.burst);
            buckets.retain(|_, (level, at)| *level + now.duration_since(*at).as_secs_f64() * per_sec < burst);
        }
        let (level, at) = buckets.entry(ip).or_insert((self.burst, now));
        *level = (*level + now.duration_since(*at).as_secs_f64() * self.per_sec).min(self.burst);
        *at = now;
        if *level >= 1.0 {
            *level -= 1.0;
            Ok(())
        } else if self.per_sec > 0.0 {
            Err(((1.0 - *level) / self.per_sec).ceil().clamp(1.0, 3600.0) as u32)
        } else {
            Err(3600)
        }
    }
}

/// The middleware: `429 token_rate_limited` (with `Retry-After`) for an
/// address over its rate.
pub(crate) async fn limit(
    State(rate): State<TokenRate>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    match rate.take(peer.ip()) {
        Ok(()) => next.run(req).await,
        Err(seconds) => Rejection::new(
            StatusCode::TOO_MANY_REQUESTS,
            "token_rate_limited",
            3011,
            "too many tokens requested from this address, please retry later",
        )
        .with_retry_after(Some(seconds))
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_gets_its_burst_then_its_rate() {
        let rate = TokenRate::new(1, 3);
        let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        assert_eq!((rate.take(a), rate.take(a), rate.take(a)), (Ok(()), Ok(()), Ok(())));
        assert_eq!(rate.take(a), Err(1), "the burst is spent");
        assert_eq!(rate.take(b), Ok(()), "another address has its own bucket");
    }
}
