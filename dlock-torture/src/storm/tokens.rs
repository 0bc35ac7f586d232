//! Token requests whose clients hang up, and their one retry.
//!
//! `orders` claims an order's token in its handler (`payments::claim_token`),
//! not on `TokenLayer`'s detached task, so a hang-up while that claim is in
//! flight, or during the order, leaves the token claimed for its lease (30 s)
//! and then answering "outcome unknown": spent, never run twice, as the
//! example documents. What the storm can hold it to is that: a token is
//! never spent twice, however its clients hang up. The retry, sent a moment
//! after the hang-up while the storm goes on, is one more chance for a
//! double spend, and counts the tokens left claimed.

use std::time::Duration;

use super::{request, Reply, ORDER_BODY};

/// How long after its hang-up a token is asked once more: past the
/// claim's late answer and a short order.
pub(super) const RETRY_AFTER: Duration = Duration::from_millis(500);

/// What the retries of hung-up tokens were answered.
#[derive(Debug, Default)]
pub(super) struct Retried {
    /// Tokens a retry spent (`201`): never claimed before.
    pub(super) fresh: Vec<u32>,
    /// Already spent (`409 idempotency_token_unknown`).
    pub(super) spent: u64,
    /// Still claimed by a request whose client hung up, or by a running
    /// one (`409` in progress, outcome unknown, or the order's lock held).
    pub(super) claimed: u64,
    /// `5xx` from B, which is alive.
    pub(super) fives: u64,
    /// Anything else (the order's stock lock still held by the killed A,
    /// say), or a failed exchange.
    pub(super) other: Vec<String>,
}

impl Retried {
    /// Files the answer to token `k`'s retry.
    pub(super) fn file(&mut self, k: u32, answer: Result<Reply, String>) {
        match answer {
            Ok(rep) if rep.status == 201 => self.fresh.push(k),
            Ok(rep) if rep.status == 409 && rep.body.contains("idempotency_token_unknown") => self.spent += 1,
            Ok(rep)
                if rep.status == 409
                    && ["idempotency_request_in_progress", "idempotency_outcome_unknown", "duplicate_submission"]
                        .iter()
                        .any(|code| rep.body.contains(code)) =>
            {
                self.claimed += 1
            }
            Ok(rep) => {
                self.fives += u64::from(rep.status >= 500);
                self.other.push(format!("{} {}", rep.status, rep.body.trim()));
            }
            Err(e) => self.other.push(e),
        }
    }
}

/// Token `token`'s retry on B (`b`).
pub(super) async fn ask(b: &str, token: &str) -> Result<Reply, String> {
    request(b, "POST", &format!("/orders?token={token}"), None, ORDER_BODY).await
}
