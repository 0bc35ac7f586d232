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
    badinput, baseline, kill_client, orphan_renewal, partition, pause, redlock, renewal, restart, self_test, slow,
    storm, zk_expire,
};

/// A running scenario: its report rows, or why it could not run.
type Rows = Pin<Box<dyn Future<Output = Result<Vec<Report>, String>>>>;

/// One scenario: the name `--scenario` takes and how to start it.
#[derive(Debug)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    start: fn(Size, u64) -> Rows,
}

/// Every scenario, in run order.
pub(crate) const ALL: &[Scenario] = &[
    Scenario { name: "baseline", start: |size, seed| Box::pin(baseline::run(size, seed)) },
    Scenario { name: "pause", start: |size, seed| Box::pin(pause::run(size, seed)) },
    Scenario { name: "kill-client", start: |size, seed| Box::pin(kill_client::run(size, seed)) },
    Scenario { name: "restart-redis", start: |size, seed| Box::pin(restart::run(size, seed)) },
    Scenario { name: "redlock-minority", start: |size, seed| Box::pin(redlock::outage(size, seed, false)) },
    Scenario { name: "redlock-majority", start: |size, seed| Box::pin(redlock::outage(size, seed, true)) },
    Scenario { name: "redlock-restart", start: |size, seed| Box::pin(redlock::restart(size, seed)) },
    Scenario { name: "redlock-slow", start: |size, seed| Box::pin(one_row(slow::run(size, seed))) },
    Scenario { name: "zk-expire", start: |size, seed| Box::pin(zk_expire::run(size, seed)) },
    Scenario { name: "partition", start: |size, seed| Box::pin(partition::run(size, seed)) },
    Scenario { name: "renewal-failure", start: |size, seed| Box::pin(one_row(renewal::run(size, seed))) },
    Scenario { name: "checker-self-test", start: |size, seed| Box::pin(self_test::run(size, seed)) },
    Scenario { name: "orphan-renewal", start: |size, seed| Box::pin(orphan_renewal::run(size, seed)) },
    Scenario { name: "bad-input", start: |size, seed| Box::pin(one_row(badinput::run(size, seed))) },
    Scenario { name: "idempotency-storm", start: |size, seed| Box::pin(one_row(storm::run(size, seed))) },
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
pub(crate) async fn run(name: &str, size: Size, seed: u64) -> Vec<Report> {
    let result = match find(name) {
        Some(scenario) => (scenario.start)(size, seed).await,
        None => Err(format!("unknown scenario `{name}`")),
    };
    match result {
        Ok(rows) => rows,
        Err(e) => {
            let mut r = Report::new(name, "-", seed);
            r.fail(format!("the scenario could not run: {e}"));
            vec![r]
        }
    }
}
