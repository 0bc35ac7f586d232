//! CI runs the whole torture harness in its short form and checks the JSON
//! it prints: every scenario reported, nothing lost where the backend
//! promises safety, no token regression where tokens are promised, every
//! broken lock and every broken mechanism of dlock's own caught by the
//! checker, and the checker's own timelines drawn.
//!
//! Two tests, which the test runner runs at once: the checker's self-test
//! with its timelines and the heaviest scenarios, and every other
//! scenario. Each runs its own `dlock-torture` process; the scenarios
//! spend most of their time waiting for leases, sessions and restarts, so
//! two at a time take about half as long as one after the other.

use std::collections::HashSet;
use std::process::Command;

use serde_json::Value;

/// A row's counter, 0 when absent.
fn n(row: &Value, field: &str) -> u64 {
    row[field].as_u64().unwrap_or(0)
}

/// The registry's scenario names (`--list`) or broken variants
/// (`--list-broken`), from the binary itself, so that each list is written
/// once, in the harness.
fn listed(flag: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_dlock-torture"))
        .arg(flag)
        .output()
        .unwrap_or_else(|e| panic!("run dlock-torture {flag}: {e}"));
    assert!(out.status.success(), "dlock-torture {flag} failed: {:?}", out.status);
    let names: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
    assert!(!names.is_empty(), "dlock-torture {flag} named nothing");
    names
}

/// The scenarios of the first test: the checker's self-test and the
/// longest of the others, about half of the short run's time.
const FIRST: [&str; 4] = ["checker-self-test", "primitives", "redlock-slow", "restart-redis"];

/// Runs `dlock-torture --short --json` on `scenarios` with `extra`
/// arguments and returns its rows, each scenario reported.
fn short(scenarios: &[String], extra: &[&std::ffi::OsStr]) -> Vec<Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock-torture"));
    cmd.args(["--short", "--json", "--seed", "20261123"]);
    for s in scenarios {
        cmd.args(["--scenario", s]);
    }
    let out = cmd.args(extra).output().expect("run dlock-torture");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}\nstderr:\n{stderr}")))
        .collect();
    assert!(out.status.success(), "dlock-torture failed ({:?}):\n{stdout}\nstderr:\n{stderr}", out.status);
    let seen: HashSet<&str> = rows.iter().filter_map(|r| r["scenario"].as_str()).collect();
    for s in scenarios {
        assert!(seen.contains(s.as_str()), "scenario {s} missing from:\n{stdout}");
    }
    for r in &rows {
        for field in [
            "scenario",
            "backend",
            "operations",
            "faults",
            "overlaps",
            "lost_updates",
            "stale_writes_refused",
            "expected_safe",
        ] {
            assert!(!r[field].is_null(), "{field} missing in {r}");
        }
        if r["expected_safe"] == true {
            assert_eq!(r["lost_updates"], 0, "lost update where the backend promises safety: {r}");
            assert_eq!(r["stale_accepted"], 0, "stale write accepted: {r}");
            assert_eq!(r["token_regressions"], 0, "C4: a grant's token not above an earlier grant's: {r}");
            if !r["set_missing"].is_null() {
                assert_eq!(r["set_missing"], 0, "C3: acknowledged op id missing from the fenced set: {r}");
            }
            assert_eq!(r["pass"], true, "{r}");
        }
        // C4 wherever tokens are promised, unsafe arms included.
        if r["tokens_promised"] == true {
            assert_eq!(r["token_regressions"], 0, "C4 where tokens are promised: {r}");
        }
    }
    rows
}

/// The scenarios of the second test: every one `--list` names but `FIRST`.
fn second() -> Vec<String> {
    listed("--list").into_iter().filter(|s| !FIRST.contains(&s.as_str())).collect()
}

#[test]
fn the_two_halves_cover_every_scenario() {
    let all = listed("--list");
    for s in FIRST {
        assert!(all.iter().any(|a| a == s), "{s} is no scenario: {all:?}");
    }
    assert_eq!(second().len() + FIRST.len(), all.len());
}

#[test]
fn the_checker_catches_every_broken_lock_and_draws_it() {
    let broken = listed("--list-broken");
    // dlock's own mechanisms broken by a dlock-core switch, not only locks
    // the harness wrote.
    for own in [
        "broken-quarantine-opens-early",
        "broken-retry-ignores-turn",
        "broken-batch-repeats-token",
        "broken-redis-permits-over-limit",
        "broken-redis-readers-pass-writers",
        "broken-redis-intent-never-withdrawn",
        "broken-postgres-permits-over-limit",
        "broken-postgres-readers-pass-writers",
        "broken-postgres-intent-never-withdrawn",
    ] {
        assert!(broken.iter().any(|b| b == own), "{own} missing from --list-broken: {broken:?}");
    }
    let dir = std::env::temp_dir().join(format!("dlock-torture-short-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let md = dir.join("block.md");
    let first: Vec<String> = FIRST.iter().map(|s| (*s).to_owned()).collect();
    let extra =
        [std::ffi::OsStr::new("--timelines"), dir.as_os_str(), std::ffi::OsStr::new("--markdown"), md.as_os_str()];
    let rows = short(&first, &extra);
    // The real read-write locks: no reader passed a writer waiting behind
    // readers, none was kept out once such a writer gave up (each row
    // fails itself when it saw neither happen).
    for backend in ["zookeeper (rw)", "redis (rw)", "postgres (rw)"] {
        let row = rows
            .iter()
            .find(|r| r["scenario"] == "primitives" && r["backend"] == backend)
            .unwrap_or_else(|| panic!("primitives {backend} missing"));
        assert!(row["readers_passed"].is_u64() && row["readers_kept_out"].is_u64(), "not judged: {row}");
        assert_eq!((n(row, "readers_passed"), n(row, "readers_kept_out")), (0, 0), "{row}");
    }
    for variant in broken.iter().map(String::as_str) {
        let row = rows
            .iter()
            .find(|r| r["scenario"] == "checker-self-test" && r["backend"] == variant)
            .unwrap_or_else(|| panic!("self-test of {variant} missing"));
        assert_eq!(row["caught"], true, "the checker missed {variant}: {row}");
        // Redis's or PostgreSQL's own read-write lock broken: no overlap,
        // only the preference checks see it (`preference.rs`).
        if variant.ends_with("readers-pass-writers") && variant != "broken-readers-pass-writers" {
            assert!(n(row, "readers_passed") > 0, "{row}");
        }
        if variant.ends_with("intent-never-withdrawn") {
            assert!(n(row, "readers_kept_out") > 0, "{row}");
        }
        if variant == "broken-retry-ignores-turn" {
            // Its bug shows as an overlap or as a token handed out twice,
            // whichever the run's timing gives (see `self_test::must_fire`).
            assert!(n(row, "overlaps") + n(row, "token_regressions") > 0, "{row}");
        } else if !matches!(
            variant,
            "broken-zk-herd"
                | "broken-token-regresses"
                | "broken-release-forgets"
                | "broken-redlock-max-over-quorum"
                | "broken-fence-check-outside-tx"
                | "broken-redis-readers-pass-writers"
                | "broken-redis-intent-never-withdrawn"
                | "broken-postgres-readers-pass-writers"
                | "broken-postgres-intent-never-withdrawn"
        ) {
            assert!(row["overlaps"].as_u64().unwrap_or(0) > 0, "{row}");
        }
        if variant == "broken-plain-del" || variant == "broken-get-then-set" {
            assert!(row["unfenced_set_missing"].as_u64().unwrap_or(0) > 0, "C3 missed the ids {variant} lost: {row}");
        }
        // C4 on falling tokens, with nothing else to give the bug away.
        if variant == "broken-token-regresses" || variant == "broken-redlock-max-over-quorum" {
            assert!(n(row, "token_regressions") > 0, "C4 missed tokens counting down: {row}");
        }
        // C6 on the keys a release forgot.
        if variant == "broken-release-forgets" {
            assert!(n(row, "residual_keys") > 0, "C6 missed the keys left behind: {row}");
        }
        // The fence checked outside the writing transaction: the fenced
        // PostgreSQL counters lose updates.
        if variant == "broken-fence-check-outside-tx" {
            assert!(n(row, "lost_updates") > 0, "the lost updates on the fenced counters were missed: {row}");
        }
        // The effect beside the route's transaction: torn, then run twice.
        if variant == "broken-effect-outside-tx" {
            assert!(n(row, "torn") > 0 && n(row, "overlaps") > 0, "{row}");
        }
        // One token for all: C4, the fenced counter (C2) and the fenced set (C3).
        if variant == "broken-duplicate-token" {
            assert!(n(row, "token_regressions") > 0, "C4 missed a repeated token: {row}");
            assert!(n(row, "lost_updates") > 0, "C2 (fenced) missed the lost updates: {row}");
            assert!(n(row, "set_missing") > 0, "C3 (fenced set) missed the lost ids: {row}");
        }
    }
    // `--timelines`: the broken plain-`DEL` lock's picture shows its
    // overlaps in red, the real dlock's control row (same workload) none,
    // and the markdown block links both.
    let broken = std::fs::read_to_string(dir.join("checker-self-test-broken-plain-del.svg")).expect("broken svg");
    assert!(broken.contains(r#"class="overlap""#) && broken.contains(">overlap</text>"), "no red overlap drawn");
    let control = std::fs::read_to_string(dir.join("checker-self-test-redis.svg")).expect("control svg");
    assert!(!control.contains(r#"class="overlap""#), "the real lock drawn with an overlap");
    // Its fixed 50 ms leases run out inside sections: stale writes are
    // refused (red marks), but no two owners hold at once.
    assert!(
        control.contains("no overlap") || control.contains(" 0 overlap(s)"),
        "the control's picture does not say it has no overlap"
    );
    for svg in [&broken, &control] {
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.len() < 200_000, "{} bytes", svg.len());
    }
    let block = std::fs::read_to_string(&md).expect("markdown block");
    assert!(block.contains("checker-self-test-broken-plain-del.svg)"), "{block}");
    let _ = std::fs::remove_dir_all(&dir);
    let slow = rows.iter().find(|r| r["scenario"] == "redlock-slow").expect("redlock-slow row");
    assert_eq!(slow["expired_on_return"], 0, "{slow}");
    assert_eq!(slow["residual_keys"], 0, "{slow}");
    let unsafe_restart = rows
        .iter()
        .find(|r| r["scenario"] == "restart-redis" && r["expected_safe"] == false)
        .expect("restart-redis without persistence");
    assert!(unsafe_restart["overlaps"].as_u64().unwrap_or(0) > 0, "{unsafe_restart}");
    every_row_did_work(&rows);
    tokens_promised_but_where_redlock_masters_lose_their_data(&rows);
}

#[test]
fn every_other_scenario_holds_its_promises() {
    let rows = short(&second(), &[]);
    // T3 (pause): fencing refused the resumed holders, the pauses really
    // broke mutual exclusion, and the holders had been told.
    let pause = rows.iter().find(|r| r["scenario"] == "pause").expect("pause row");
    assert!(n(pause, "faults") > 0, "{pause}");
    assert!(n(pause, "stale_writes_refused") * 10 >= n(pause, "faults") * 9, "T3: refused < 0.9 x pauses: {pause}");
    assert!(n(pause, "unfenced_lost") > 0, "T3: the unfenced control lost nothing: {pause}");
    assert!(n(pause, "stale_holds") > 0, "{pause}");
    assert!(
        n(pause, "stale_holds_seen_lost") * 100 >= n(pause, "stale_holds") * 95,
        "T3: lost signal seen by < 95 % of refused holds: {pause}"
    );
    // T14/T15 (issue 27): the unfenced control lost updates while the
    // fenced PostgreSQL counters lost none; effects and records committed
    // together under kill -9.
    let fence = rows.iter().find(|r| r["scenario"] == "pg-fence").expect("pg-fence row");
    assert!(n(fence, "unfenced_lost") > 0, "{fence}");
    let idem = rows.iter().find(|r| r["scenario"] == "pg-idempotency").expect("pg-idempotency row");
    assert_eq!(idem["torn"], 0, "{idem}");
    // T1: a baseline row per backend, each with work done and nothing left.
    for backend in ["redis", "redlock", "zookeeper", "postgres", "memory"] {
        let row = rows
            .iter()
            .find(|r| r["scenario"] == "baseline" && r["backend"] == backend)
            .unwrap_or_else(|| panic!("baseline of {backend} missing"));
        assert!(row["operations"].as_u64().unwrap_or(0) > 0, "{row}");
        assert!(row["set_acked"].as_u64().unwrap_or(0) > 0, "C3 checked nothing: {row}");
        assert_eq!(row["residual_keys"], 0, "{row}");
    }
    // The unmitigated restarts must show the violation the docs describe
    // (each such row also fails itself when it does not).
    let unsafe_redlock = rows
        .iter()
        .find(|r| r["scenario"] == "redlock-restart" && r["expected_safe"] == false)
        .expect("redlock-restart without quarantine");
    assert!(n(unsafe_redlock, "overlaps") > 0, "{unsafe_redlock}");
    // T9 with hang-ups (issue 38 item 7): no hung-up key left claimed, and
    // some hung up while their claim was in flight (the kill is one fault,
    // each such hang-up another; the row fails itself without one); the
    // twin whose claim is awaited in the request's future stranded keys.
    let storm = rows
        .iter()
        .find(|r| r["scenario"] == "idempotency-storm" && r["expected_safe"] == true)
        .expect("idempotency-storm row");
    assert_eq!(storm["residual_keys"], 0, "a hung-up key was left claimed: {storm}");
    assert!(storm["notes"].as_str().is_some_and(|n| n.contains("while it was in flight")), "{storm}");
    let twin = rows
        .iter()
        .find(|r| r["scenario"] == "idempotency-storm" && r["expected_safe"] == false)
        .expect("idempotency-storm twin row");
    assert_eq!(twin["caught"], true, "the stranded-claim check missed the twin: {twin}");
    assert!(n(twin, "residual_keys") > 0 && n(twin, "faults") > 0, "{twin}");
    // T5e and T6a: their own figures, not only the shared columns.
    let renewal = rows.iter().find(|r| r["scenario"] == "renewal-failure").expect("renewal-failure row");
    assert_eq!(renewal["silent_losses"], 0, "{renewal}");
    assert_eq!(renewal["resurrections"], 0, "{renewal}");
    assert!(!renewal["lost_latency_p99_ms"].is_null(), "{renewal}");
    every_row_did_work(&rows);
    tokens_promised_but_where_redlock_masters_lose_their_data(&rows);
}

/// Work really happened, and every fault scenario injected its fault, in
/// every row (the harness fails such rows itself; this checks it did).
fn every_row_did_work(rows: &[Value]) {
    for r in rows {
        assert!(r["operations"].as_u64().unwrap_or(0) > 0, "a row did no operations: {r}");
        let faultless = ["baseline", "coalesced-burst", "checker-self-test"].iter().any(|s| r["scenario"] == *s);
        if !faultless {
            assert!(r["faults"].as_u64().unwrap_or(0) > 0, "a row injected no fault: {r}");
        }
    }
}

/// Tokens are not promised only where RedLock masters lose their data.
fn tokens_promised_but_where_redlock_masters_lose_their_data(rows: &[Value]) {
    for r in rows {
        if r["tokens_promised"] == false && r["scenario"] != "checker-self-test" {
            assert_eq!(r["scenario"], "redlock-restart", "tokens not promised: {r}");
        }
    }
}
