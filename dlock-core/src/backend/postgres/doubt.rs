//! Whether a request may have run: once any try of it was sent and its
//! answer lost, every later failure of it says so.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

/// Whether any try of one request (an acquire's statements, each with its
/// resends) was sent and its answer lost, so that it may have been carried
/// out. Once set, every failure of the request carries the mark
/// ([`Error::may_have_run`]): a resend that cannot connect, or that the
/// server refuses, did nothing itself, but the try before it may have
/// committed a grant, and the engine undoes only an acquire whose error
/// says so. Without the mark, that grant (nobody holds or renews it) keeps
/// the key for a whole lease (review 2026-12-07, L1).
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
