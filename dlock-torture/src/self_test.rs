//! `checker-self-test`: deliberately broken locks, which the checker must
//! catch, beside the real one under the same workload as a control.
//!
//! Two kinds: locks the harness wrote with one classic bug each
//! ([`crate::broken`]), and dlock's own mechanisms broken by a test-only
//! switch in dlock-core ([`crate::own_bugs`]). A variant that needs a
//! workload of its own runs the workload of the scenario whose real row is
//! its control (`flush-redis`, `release-retry`, `coalesced-burst`,
//! `redlock-skew`); the others share the plain-`DEL` workload below, with
//! the real lock beside them. [`variants`] lists them all, once:
//! `--list-broken` prints it, and `short_run` reads it from there.

use std::time::Duration;

use dlock_testing::{RedisServer, ZooKeeperServer};

use crate::broken::Bug;
use crate::harness::{Report, Run};
use crate::scenario::{config, describe, finish, resource_server, spawn_workers, Size};

/// The negative controls that are not broken locks: ZooKeeper's herd and
/// the storm without its idempotency layer.
const CONTROLS: [&str; 2] = ["broken-zk-herd", "broken-no-idempotency"];

/// Broken uses of dlock's PostgreSQL helpers, each under the workload of
/// the scenario whose real row is its control: the fence checked outside
/// the writing transaction (`pg-fence`), the route's effect written beside
/// its `Tx` (`pg-idempotency`).
const PG_TWINS: [&str; 2] = ["broken-fence-check-outside-tx", "broken-effect-outside-tx"];

/// Every broken variant the self-test runs, in run order.
pub(crate) fn variants() -> Vec<&'static str> {
    Bug::ALL.into_iter().chain(crate::own_bugs::ALL.iter().map(|b| b.name)).chain(PG_TWINS).chain(CONTROLS).collect()
}

/// The scenario whose workload `variant` runs instead of the shared one.
fn own_workload(variant: &str) -> Option<&'static str> {
    match variant {
        "broken-redlock-max-over-quorum" => Some("redlock-skew"),
        "broken-fence-check-outside-tx" => Some("pg-fence"),
        "broken-effect-outside-tx" => Some("pg-idempotency"),
        _ => crate::own_bugs::find(variant).map(|b| b.control),
    }
}

/// `variant` under the workload of `scenario` (see [`own_workload`]).
async fn run_as(scenario: &str, variant: &str, size: Size, seed: u64) -> Result<Report, String> {
    let name = "checker-self-test";
    match scenario {
        "redlock-skew" => crate::redlock_skew::row(name, variant, size, seed).await,
        "flush-redis" => crate::flush::row(name, variant, size, seed).await,
        "release-retry" => crate::release_retry::row(name, variant, size, seed).await,
        "coalesced-burst" => crate::burst::row(name, variant, size, seed).await,
        "primitives" => {
            let mode = if variant.contains("permits") { "permits:2" } else { "rw" };
            crate::primitives::row(name, variant, mode, size, seed).await
        }
        "pg-fence" => crate::pg_fence::row(name, "pg-fence-check-outside-tx", size, seed).await,
        "pg-idempotency" => crate::pg_idempotency::row(name, "pg-idempotency-effect-outside-tx", size, seed).await,
        other => Err(format!("no workload `{other}` for {variant}")),
    }
}

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    let (res_server, resource) = resource_server().await?;
    let nodes: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let mut rows = Vec::new();
    // The correct lock first, under the workload that breaks the plain-DEL
    // variant: fixed 50 ms leases, sections up to 80 ms.
    let shared: Vec<&str> =
        std::iter::once("redis").chain(Bug::ALL.into_iter().filter(|v| own_workload(v).is_none())).collect();
    for (i, variant) in shared.into_iter().enumerate() {
        // Every variant starts from empty servers, so what C6 finds is its own.
        for server in std::iter::once(&res_server).chain(&nodes) {
            flush(server).await?;
        }
        let urls: Vec<String> = if variant == "broken-redlock-ignores-elapsed" {
            nodes.iter().map(RedisServer::url).collect()
        } else {
            vec![nodes[0].url()]
        };
        let mut cfg = config(variant, urls, &res_server, seed.wrapping_add(i as u64));
        cfg.keys = 1;
        cfg.tasks = if variant == "broken-redlock-ignores-elapsed" { 2 } else { 3 };
        cfg.watchdog = false;
        cfg.wait_ms = 1000;
        cfg.duration_ms =
            if variant == "broken-redlock-ignores-elapsed" { size.pick(4000, 15_000) } else { size.pick(2000, 10_000) };
        (cfg.lease_ms, cfg.cs_max_ms) = match variant {
            "broken-get-then-set" => (200, 2),
            "broken-renew-no-owner-check" => (60, 120),
            // Sections as long as the lease, so a holder is still inside
            // when its first keys expire.
            "broken-redlock-ignores-elapsed" => (100, 100),
            // Sections far inside the lease: nothing overlaps, so only the
            // fencing check can catch the falling tokens.
            "broken-token-regresses" => (1000, 5),
            // Leases that outlive the run: what release forgot is still
            // there when the run ends.
            "broken-release-forgets" => (5000, 5),
            _ => (50, 80),
        };
        let mut run = Run::new(&format!("self-test-{i}")).map_err(|e| e.to_string())?;
        let procs = 3;
        spawn_workers(&mut run, &cfg, procs)?;
        let mut r = Report::new("checker-self-test", variant, seed);
        describe(&mut r, procs, &cfg);
        r.fault_kind = "none (the bug is in the lock)".into();
        if variant == "redis" {
            r.expected_safe = true;
            r.note("control: the real dlock under the plain-DEL workload (fixed 50 ms lease, sections up to 80 ms)");
            finish(&mut run, &mut r, &resource, 1, Duration::from_secs(15)).await?;
        } else {
            r.expected_safe = false;
            r.tokens_promised = false;
            finish(&mut run, &mut r, &resource, 1, Duration::from_secs(15)).await?;
            // C6 on the broken lock's own keys (plain strings `broken:<k>`),
            // every worker gone: nothing may be left.
            let left = broken_residue(&nodes).await?;
            r.residual_keys = Some(left);
            judge(variant, &mut r);
        }
        rows.push(r);
    }
    for variant in variants() {
        let Some(scenario) = own_workload(variant) else { continue };
        let mut r = run_as(scenario, variant, size, seed).await?;
        r.note(format!("control: `{scenario}`'s row, the real dlock under this workload"));
        judge(variant, &mut r);
        rows.push(r);
    }
    let zk = tokio::task::spawn_blocking(ZooKeeperServer::start)
        .await
        .map_err(|e| format!("ZooKeeper did not start: {e}"))?;
    let (waiters, rounds) = (size.pick(8, 12), size.pick(4, 20));
    let (good_rel, good_wake) =
        crate::herd::wakeups_per_release(&zk.connect_string(), "/herd-good", waiters, rounds, false).await?;
    let (bad_rel, bad_wake) =
        crate::herd::wakeups_per_release(&zk.connect_string(), "/herd-bad", waiters, rounds, true).await?;
    let ratio = |w: u64, r: u64| if r == 0 { 0.0 } else { w as f64 / r as f64 };
    let (good, bad) = (ratio(good_wake, good_rel), ratio(bad_wake, bad_rel));
    let mut herd = Report::new("checker-self-test", "broken-zk-herd", seed);
    herd.expected_safe = false;
    herd.tokens_promised = false;
    herd.processes = 1;
    herd.tasks = u32::try_from(waiters).unwrap_or(0);
    herd.keys = 1;
    herd.operations = bad_rel;
    herd.fault_kind = "none (every waiter watches the lowest node)".into();
    // Herding costs wake-ups, not safety: caught when a release wakes
    // clearly more than the one waiter the predecessor recipe wakes.
    let caught = bad > 1.5 && bad > 2.0 * good.max(0.5);
    herd.caught = Some(caught);
    herd.note(format!("wake-ups per release {bad:.2} with {waiters} waiters; predecessor-watch control {good:.2}"));
    if !caught {
        herd.fail("the herd was not detected");
    }
    rows.push(herd);
    rows.push(crate::storm::run_unguarded(size, seed).await?);
    Ok(rows)
}

/// Empties `server`; an error is the self-test's, not swallowed.
async fn flush(server: &RedisServer) -> Result<(), String> {
    let client = redis::Client::open(server.url()).map_err(|e| e.to_string())?;
    let mut c = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    redis::cmd("FLUSHALL").query_async::<()>(&mut c).await.map_err(|e| format!("FLUSHALL: {e}"))
}

/// C6 for the broken locks: their lock keys (`broken:<k>`, not the
/// `…:fence` counters) still on any node once every worker has finished.
async fn broken_residue(nodes: &[RedisServer]) -> Result<u64, String> {
    let mut left = 0;
    for node in nodes {
        let client = redis::Client::open(node.url()).map_err(|e| e.to_string())?;
        let mut c = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
        let keys: Vec<String> =
            redis::cmd("KEYS").arg("broken:*").query_async(&mut c).await.map_err(|e| e.to_string())?;
        left += keys.iter().filter(|k| !k.ends_with(":fence")).count() as u64;
    }
    Ok(left)
}

/// The checks a broken variant must set off: (name, figure it reports).
fn must_fire(variant: &str, r: &Report) -> Vec<(&'static str, u64)> {
    let c1 = ("C1 overlap", r.overlaps);
    match variant {
        // C3 must name the ids these two bugs lose: they overlap often
        // enough to lose ids in every short run. Their tokens grow, so the
        // fenced set loses nothing; the loss shows on the unfenced set,
        // which the same C3 code checks.
        "broken-plain-del" | "broken-get-then-set" => vec![c1, ("C3 set-full (unfenced set)", r.unfenced_set_missing)],
        // Nothing overlaps: only the fencing check sees the falling tokens.
        "broken-token-regresses" | "broken-redlock-max-over-quorum" => vec![("C4 token order", r.token_regressions)],
        // Nothing overlaps (each waiter gets the key only when a lease
        // ends): only the residue check sees the keys left behind.
        "broken-release-forgets" => vec![("C6 residue", r.residual_keys.unwrap_or(0))],
        // Overlaps with one token for all: the fence cannot help, so the
        // fenced counter (C2) and the fenced set (C3) lose what they clobber.
        "broken-duplicate-token" => vec![
            c1,
            ("C2 lost update (fenced counter)", r.lost_updates),
            ("C3 set-full (fenced set)", r.set_missing),
            ("C4 token order", r.token_regressions),
        ],
        // The same owner's acquire joins the server hold the retry then
        // deletes: that join hands its token out a second time (C4), and
        // another owner granted under the live guard overlaps it (C1).
        // Which of the two a short run sees depends on timing; either is
        // the bug.
        "broken-retry-ignores-turn" => vec![("C1 overlap + C4 token order", r.overlaps + r.token_regressions)],
        // A holder paused inside its transaction overwrites the next
        // holder's increment: the fenced counters lose updates.
        "broken-fence-check-outside-tx" => vec![("lost update (PostgreSQL fenced counter)", r.lost_updates)],
        // A kill between the effect and the commit: an effect without its
        // record, then a second run of the key by the recovery.
        "broken-effect-outside-tx" => vec![
            ("torn (effect without its record)", r.torn.unwrap_or(0)),
            ("run twice (two effect rows of a key)", r.overlaps),
        ],
        // The reader never overlaps a writer (the writer waits for it):
        // only the preference check sees it pass the waiting writer.
        "broken-redis-readers-pass-writers" | "broken-postgres-readers-pass-writers" => {
            vec![("writer preference (readers passed)", r.readers_passed.unwrap_or(0))]
        }
        // The intent outlives its writer until its wait would have ended:
        // the readers it kept out wait that long.
        "broken-redis-intent-never-withdrawn" | "broken-postgres-intent-never-withdrawn" => {
            vec![("withdrawn intent (readers kept out)", r.readers_kept_out.unwrap_or(0))]
        }
        _ => vec![c1],
    }
}

/// Files whether the checks `variant` must set off fired; a check that
/// stayed silent fails the row.
fn judge(variant: &str, r: &mut Report) {
    let checks = must_fire(variant, r);
    let fired: Vec<String> = checks.iter().map(|(name, n)| format!("{name} {n}")).collect();
    r.note(format!("must fire: {}", fired.join(", ")));
    let silent: Vec<&str> = checks.iter().filter(|(_, n)| *n == 0).map(|(name, _)| *name).collect();
    r.caught = Some(silent.is_empty());
    if !silent.is_empty() {
        r.fail(format!("the checker did not catch this broken lock: {} stayed at 0", silent.join(", ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broken variant whose required checks stay at zero fails, and
    /// one where they all fire is caught.
    #[test]
    fn a_silent_check_fails_its_variant() {
        let mut r = Report::new("checker-self-test", "broken-duplicate-token", 0);
        r.overlaps = 3;
        r.lost_updates = 2;
        r.token_regressions = 9;
        judge("broken-duplicate-token", &mut r);
        assert_eq!(r.caught, Some(false));
        assert!(!r.pass && r.notes.contains("C3 set-full (fenced set)"), "{}", r.notes);

        let mut r = Report::new("checker-self-test", "broken-token-regresses", 0);
        r.token_regressions = 1;
        judge("broken-token-regresses", &mut r);
        assert_eq!(r.caught, Some(true));
        assert!(r.pass, "{}", r.notes);
    }
}
