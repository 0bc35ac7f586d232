//! Whether a request may have run: once any try of it was sent and its
//! answer lost, every later failure of it says so.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

/// Whether any try of one request was sent and its answer lost. Once set,
/// every failure of the request carries the mark
/// ([`Error::may_have_run`]), even a resend's that did nothing itself: the
/// engine undoes only an acquire whose error says so, and an unmarked
/// grant would keep the key for a whole lease.
#[derive(Debug, Default)]
pub(crate) struct Doubt(AtomicBool);

impl Doubt {
    /// A try of the request was sent and its answer lost.
    pub(crate) fn answer_lost(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// `e`, marked when a try of the request may have run.
    pub(crate) fn mark(&self, e: Error) -> Error {
        match self.0.load(Ordering::Relaxed) {
            true => e.may_have_run(),
            false => e,
        }
    }
}
