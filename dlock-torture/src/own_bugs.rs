//! Broken variants of dlock's *own* mechanisms, not of a lock the harness
//! wrote: the real backend, with one of dlock-core's test-only switches
//! (feature `broken-variants`, `dlock_core::broken_variants`) turned on in
//! the worker processes. Each runs the workload of the scenario whose real
//! row is its control, and the checkers must catch it there.

use dlock_core::broken_variants::Switch;

/// One broken mechanism: the variant's name (the row's backend), the
/// switch its workers turn on, the backend it runs on, and the scenario
/// whose workload it runs (the real lock's row there is the control).
#[derive(Debug)]
pub(crate) struct OwnBug {
    pub(crate) name: &'static str,
    pub(crate) switch: Switch,
    pub(crate) backend: &'static str,
    pub(crate) control: &'static str,
}

/// Every broken variant of dlock's own mechanisms.
pub(crate) const ALL: &[OwnBug] = &[
    OwnBug {
        name: "broken-quarantine-opens-early",
        switch: Switch::QuarantineOpensEarly,
        backend: "redis",
        control: "flush-redis",
    },
    OwnBug {
        name: "broken-retry-ignores-turn",
        switch: Switch::RetryIgnoresTurn,
        backend: "redis",
        control: "release-retry",
    },
    OwnBug {
        name: "broken-batch-repeats-token",
        switch: Switch::BatchRepeatsToken,
        backend: "redis",
        control: "coalesced-burst",
    },
    OwnBug {
        name: "broken-permits-over-limit",
        switch: Switch::PermitsOverLimit,
        backend: "zookeeper",
        control: "primitives",
    },
    OwnBug {
        name: "broken-readers-pass-writers",
        switch: Switch::ReadersPassWriters,
        backend: "zookeeper",
        control: "primitives",
    },
    OwnBug {
        name: "broken-redis-permits-over-limit",
        switch: Switch::PermitsOverLimit,
        backend: "redis",
        control: "primitives",
    },
    OwnBug {
        name: "broken-redis-readers-pass-writers",
        switch: Switch::ReadersPassWriters,
        backend: "redis",
        control: "primitives",
    },
    OwnBug {
        name: "broken-redis-intent-never-withdrawn",
        switch: Switch::IntentNeverWithdrawn,
        backend: "redis",
        control: "primitives",
    },
    OwnBug {
        name: "broken-postgres-permits-over-limit",
        switch: Switch::PermitsOverLimit,
        backend: "postgres",
        control: "primitives",
    },
    OwnBug {
        name: "broken-postgres-readers-pass-writers",
        switch: Switch::ReadersPassWriters,
        backend: "postgres",
        control: "primitives",
    },
    OwnBug {
        name: "broken-postgres-intent-never-withdrawn",
        switch: Switch::IntentNeverWithdrawn,
        backend: "postgres",
        control: "primitives",
    },
];

/// The broken mechanism called `name`.
pub(crate) fn find(name: &str) -> Option<&'static OwnBug> {
    ALL.iter().find(|b| b.name == name)
}
