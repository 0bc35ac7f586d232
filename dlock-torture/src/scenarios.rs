//! The registry: every scenario's name, in run order, and the function
//! that runs it, written once. `--scenario`, `--list`, the usage text and
//! the default run all read [`ALL`]; the short-run test asks the binary for
//! `--list`. A scenario's body lives in a module of its own and builds on
//! the kit in [`crate::scenario`], never on this registry.

use std::future::Future;
use std::pin::Pin;

use crate::harness::Report;
use crate::scenario::Size;
use crate::{
    badinput, baseline, burst, flush, kill_client, orphan_renewal, partition, pause, pg_fence, pg_idempotency,
    postgres, primitives, redlock, redlock_skew, release_retry, renewal, restart, self_test, slow, storm, zk_expire,
};

/// A running scenario: its report rows, or why it could not run.
type Rows = Pin<Box<dyn Future<Output = Result<Vec<Report>, String>>>>;

/// One scenario: the name `--scenario` takes, how to start it, and whether
/// it is meant to inject faults (every row of it must then count some).
#[derive(Debug)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    start: fn(Size, u64) -> Rows,
    faults: bool,
}

/// Every scenario, in run order.
pub(crate) const ALL: &[Scenario] = &[
    Scenario { name: "baseline", faults: false, start: |size, seed| Box::pin(baseline::run(size, seed)) },
    Scenario { name: "coalesced-burst", faults: false, start: |size, seed| Box::pin(burst::run(size, seed)) },
    Scenario { name: "pause", faults: true, start: |size, seed| Box::pin(pause::run(size, seed)) },
    Scenario { name: "kill-client", faults: true, start: |size, seed| Box::pin(kill_client::run(size, seed)) },
    Scenario { name: "restart-redis", faults: true, start: |size, seed| Box::pin(restart::run(size, seed)) },
    Scenario { name: "flush-redis", faults: true, start: |size, seed| Box::pin(flush::run(size, seed)) },
    Scenario { name: "release-retry", faults: true, start: |size, seed| Box::pin(release_retry::run(size, seed)) },
    Scenario {
        name: "redlock-minority",
        faults: true,
        start: |size, seed| Box::pin(redlock::outage(size, seed, false)),
    },
    Scenario {
        name: "redlock-majority",
        faults: true,
        start: |size, seed| Box::pin(redlock::outage(size, seed, true)),
    },
    Scenario { name: "redlock-restart", faults: true, start: |size, seed| Box::pin(redlock::restart(size, seed)) },
    Scenario { name: "redlock-slow", faults: true, start: |size, seed| Box::pin(one_row(slow::run(size, seed))) },
    Scenario { name: "redlock-skew", faults: true, start: |size, seed| Box::pin(redlock_skew::run(size, seed)) },
    Scenario { name: "zk-expire", faults: true, start: |size, seed| Box::pin(zk_expire::run(size, seed)) },
    Scenario { name: "partition", faults: true, start: |size, seed| Box::pin(partition::run(size, seed)) },
    Scenario { name: "renewal-failure", faults: true, start: |size, seed| Box::pin(one_row(renewal::run(size, seed))) },
    Scenario { name: "checker-self-test", faults: false, start: |size, seed| Box::pin(self_test::run(size, seed)) },
    Scenario { name: "orphan-renewal", faults: true, start: |size, seed| Box::pin(orphan_renewal::run(size, seed)) },
    Scenario { name: "bad-input", faults: true, start: |size, seed| Box::pin(one_row(badinput::run(size, seed))) },
    Scenario { name: "postgres", faults: true, start: |size, seed| Box::pin(postgres::run(size, seed)) },
    Scenario { name: "pg-fence", faults: true, start: |size, seed| Box::pin(pg_fence::run(size, seed)) },
    Scenario { name: "pg-idempotency", faults: true, start: |size, seed| Box::pin(pg_idempotency::run(size, seed)) },
    Scenario { name: "primitives", faults: true, start: |size, seed| Box::pin(primitives::run(size, seed)) },
    Scenario { name: "idempotency-storm", faults: true, start: |size, seed| Box::pin(storm::run(size, seed)) },
];

/// The scenario called `name`.
pub(crate) fn find(name: &str) -> Option<&'static Scenario> {
    ALL.iter().find(|s| s.name == name)
}

/// The names, space-separated, for the usage text.
pub(crate) fn names() -> String {
    ALL.iter().map(|s| s.name).collect::<Vec<_>>().join(" ")
}

async fn one_row(report: impl Future<Output = Result<Report, String>>) -> Result<Vec<Report>, String> {
    report.await.map(|r| vec![r])
}

/// Runs the scenario called `name`; one failed row when it could not run.
/// Every row fails when it did no work, or injected no fault in a scenario
/// meant to inject some: such a row would pass with nothing tested.
pub(crate) async fn run(name: &str, size: Size, seed: u64) -> Vec<Report> {
    let Some(scenario) = find(name) else {
        let mut r = Report::new(name, "-", seed);
        r.fail(format!("unknown scenario `{name}`"));
        return vec![r];
    };
    match (scenario.start)(size, seed).await {
        Ok(mut rows) => {
            if rows.is_empty() {
                let mut r = Report::new(name, "-", seed);
                r.fail("the scenario reported no row");
                rows.push(r);
            }
            for r in &mut rows {
                require_work(r, scenario.faults);
            }
            rows
        }
        Err(e) => {
            let mut r = Report::new(name, "-", seed);
            r.fail(format!("the scenario could not run: {e}"));
            vec![r]
        }
    }
}

/// Fails a row that did no operation, or (`faults`) injected no fault.
fn require_work(r: &mut Report, faults: bool) {
    if r.operations == 0 {
        r.fail("no operation was done (nothing was tested)");
    }
    if faults && r.faults == 0 {
        r.fail("no fault was injected (nothing was tested under the fault)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_that_did_nothing_fails() {
        let mut idle = Report::new("x", "y", 0);
        require_work(&mut idle, false);
        assert!(!idle.pass, "{}", idle.notes);

        let mut unfaulted = Report::new("x", "y", 0);
        unfaulted.operations = 10;
        require_work(&mut unfaulted, true);
        assert!(!unfaulted.pass, "{}", unfaulted.notes);

        let mut worked = Report::new("x", "y", 0);
        worked.operations = 10;
        worked.faults = 1;
        require_work(&mut worked, true);
        assert!(worked.pass, "{}", worked.notes);
    }

    #[test]
    fn only_baseline_the_burst_and_the_self_test_inject_no_fault() {
        for s in ALL {
            assert_eq!(s.faults, !matches!(s.name, "baseline" | "coalesced-burst" | "checker-self-test"), "{}", s.name);
        }
    }

    /// Every broken variant of dlock's own mechanisms runs the workload of
    /// a scenario of the registry, whose real row is its control.
    #[test]
    fn every_own_bug_has_its_control_in_the_registry() {
        for bug in crate::own_bugs::ALL {
            assert!(find(bug.control).is_some(), "{} names no scenario `{}`", bug.name, bug.control);
            assert!(crate::self_test::variants().contains(&bug.name), "{}", bug.name);
        }
    }
}
