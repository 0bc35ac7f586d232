//! The engine's meters without the `metrics` feature: the same calls, each
//! doing nothing and reading no clock.

use super::Op;
use crate::{LockKey, LockMode, LostReason};

/// Describes dlock's metrics to the installed recorder; without the
/// `metrics` feature there are none, and this does nothing.
pub fn describe() {}

pub(crate) struct Meters;

impl Meters {
    pub(crate) fn new(_backend: &'static str) -> Self {
        Meters
    }

    #[inline(always)]
    pub(crate) fn lock(&self, _key: &LockKey, _mode: LockMode) -> LockMeter {
        LockMeter
    }

    #[inline(always)]
    pub(crate) fn op(&self, _op: Op, _started: Stopwatch) {}

    #[inline(always)]
    pub(crate) fn renewals(&self, _renewed: u64, _failed: u64, _lost: u64) {}
}

#[derive(Clone, Copy)]
pub(crate) struct Stopwatch;

impl Stopwatch {
    #[inline(always)]
    pub(crate) fn start() -> Self {
        Stopwatch
    }

    #[inline(always)]
    pub(crate) fn at(_at: tokio::time::Instant) -> Self {
        Stopwatch
    }
}

#[derive(Clone, Default)]
pub(crate) struct LockMeter;

impl LockMeter {
    #[inline(always)]
    pub(crate) fn acquire(self) -> AcquireMeter {
        AcquireMeter
    }

    #[inline(always)]
    pub(crate) fn held(&self) -> HoldMeter {
        HoldMeter
    }
}

pub(crate) struct AcquireMeter;

impl AcquireMeter {
    #[inline(always)]
    pub(crate) fn lock(&self) -> &LockMeter {
        &LockMeter
    }

    #[inline(always)]
    pub(crate) fn started(&mut self, _at: tokio::time::Instant) {}

    #[inline(always)]
    pub(crate) fn waiting(&mut self) {}

    #[inline(always)]
    pub(crate) fn finish<T>(self, _result: &crate::Result<T>) {}
}

pub(crate) struct HoldMeter;

impl HoldMeter {
    #[inline(always)]
    pub(crate) fn none() -> Self {
        HoldMeter
    }

    #[inline(always)]
    pub(crate) fn end(&mut self, _lost: impl FnOnce() -> Option<LostReason>) {}
}
