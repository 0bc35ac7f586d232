//! Runs the built `dlock-bench` with `--quick --json` (it starts its own
//! redis-server) and checks that every row parses and carries the documented
//! keys with plausible numbers. Speed targets live in the benchmark, not here.

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;

#[test]
fn quick_json_run_prints_rows_for_both_benches() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_dlock-bench")).args(["--quick", "--json"]).output().expect("run dlock-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "dlock-bench failed: {}\nstderr:\n{stderr}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");

    let rows: Vec<Value> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON row ({e}): {l}")))
        .collect();
    assert!(!rows.is_empty(), "no rows; stderr:\n{stderr}");

    let mut seen = BTreeSet::new();
    for row in &rows {
        for key in ["bench", "impl", "backend", "concurrency", "ops_per_sec", "p50_us", "p99_us"] {
            assert!(row.get(key).is_some(), "row without `{key}`: {row}");
        }
        let bench = row["bench"].as_str().expect("bench is a string");
        let imp = row["impl"].as_str().expect("impl is a string");
        let backend = row["backend"].as_str().expect("backend is a string");
        assert!(row["concurrency"].as_u64().is_some_and(|c| c >= 1), "concurrency: {row}");
        for key in ["ops_per_sec", "p50_us", "p99_us"] {
            let v = row[key].as_f64().unwrap_or(-1.0);
            assert!(v > 0.0, "`{key}` must be a positive number: {row}");
        }
        assert!(row["p99_us"].as_f64() >= row["p50_us"].as_f64(), "p99 below p50: {row}");
        // The metrics rows measure a recorder's cost, not the commands.
        if (bench == "handoff" || backend == "redis")
            && !bench.starts_with("backends")
            && bench != "http"
            && bench != "metrics"
        {
            let cmds = row["cmds_per_acquisition"].as_f64();
            assert!(cmds.is_some(), "row without cmds_per_acquisition: {row}");
            if backend == "redis" {
                assert!(cmds.unwrap_or(0.0) > 0.0, "a Redis lock needs commands: {row}");
            }
        }
        seen.insert((bench.to_owned(), imp.to_owned(), backend.to_owned(), row["concurrency"].as_u64()));
    }

    for (bench, concurrencies) in [("uncontended", [1, 16, 256]), ("handoff", [2, 8, 32])] {
        for c in concurrencies {
            for (imp, backend) in [
                ("dlock", "redis"),
                ("dlock", "memory"),
                (if bench == "uncontended" { "baseline" } else { "poll-1ms" }, "redis"),
            ] {
                assert!(
                    seen.contains(&(bench.to_owned(), imp.to_owned(), backend.to_owned(), Some(c))),
                    "no {bench} row for {imp}/{backend} at {c}; rows:\n{stdout}"
                );
            }
        }
    }
    let ratios: Vec<f64> = rows
        .iter()
        .filter(|r| r["bench"] == "uncontended" && r["impl"] == "dlock" && r["backend"] == "redis")
        .map(|r| r["ratio"].as_f64().unwrap_or(-1.0))
        .collect();
    assert_eq!(ratios.len(), 3);
    assert!(ratios.iter().all(|r| *r > 0.0), "ratios must be positive: {ratios:?}");
    // Every Redis implementation of the uncontended table, with its commands
    // per cycle and Redis CPU, and dlock's targets, each with a verdict.
    for c in [1u64, 16, 256] {
        for imp in ["dlock", "baseline", "fenced-floor", "redisson-peer", "clock-floor"] {
            let row = rows
                .iter()
                .find(|r| {
                    r["bench"] == "uncontended" && r["impl"] == imp && r["backend"] == "redis" && r["concurrency"] == c
                })
                .unwrap_or_else(|| panic!("no uncontended row for {imp}/redis at {c}; rows:\n{stdout}"));
            for key in ["server_cmds_per_acquisition", "server_cpu_us", "client_cpu_us"] {
                assert!(row[key].as_f64().is_some_and(|v| v > 0.0), "`{key}` missing or not positive: {row}");
            }
            if imp == "clock-floor" {
                // The fenced floor's two calls; the clock is read inside its script.
                let client = row["cmds_per_acquisition"].as_f64().unwrap_or(0.0);
                let bound = if c == 1 { 1.5..2.5 } else { 1.0..3.0 };
                assert!(bound.contains(&client), "the clock floor sends 2 commands per cycle: {row}");
            }
            if imp == "redisson-peer" {
                // Two EVALSHAs and the latch's DEL per cycle; the scripts'
                // calls on top. The window's edges blur it: up to `c`
                // cycles in flight at an edge have some of their 3 commands
                // counted, so the count may be off by 3c commands over the
                // window's cycles (at c = 256 a quick window on a loaded
                // machine holds only a few hundred).
                let client = row["cmds_per_acquisition"].as_f64().unwrap_or(0.0);
                let samples = row["samples"].as_f64().unwrap_or(0.0).max(1.0);
                let blur = (3.0 * c as f64 / samples).max(0.5);
                let bound = 3.0 - blur..3.0 + blur;
                assert!(bound.contains(&client), "the peer sends 3 commands per cycle: {row}");
                assert!(row["server_cmds_per_acquisition"].as_f64() > Some(client), "{row}");
            }
        }
        let dlock = rows
            .iter()
            .find(|r| {
                r["bench"] == "uncontended" && r["impl"] == "dlock" && r["backend"] == "redis" && r["concurrency"] == c
            })
            .unwrap_or_else(|| panic!("no uncontended dlock row at {c}"));
        let goals: Vec<&str> = dlock["target_results"]
            .as_array()
            .map(|a| a.iter().filter_map(|t| t["goal"].as_str()).collect())
            .unwrap_or_default();
        // The bare lock is a target only at c = 256 (the stretch).
        let expected = if c == 1 {
            1
        } else if c == 16 {
            3
        } else {
            4
        };
        assert_eq!(goals.len(), expected, "dlock's targets at {c}: {goals:?}");
        assert!(goals.iter().any(|g| g.starts_with("ops vs fenced-floor >= 0.95")), "{goals:?}");
        assert!(dlock["ratio_vs_fenced_clock_floor"].as_f64().is_some_and(|r| r > 0.0), "{dlock}");
        if c >= 16 {
            assert!(goals.iter().any(|g| g.starts_with("ops vs redisson-peer >= 1.3")), "{goals:?}");
            assert!(goals.iter().any(|g| g.starts_with("srv us vs fenced-floor <= 1.2")), "{goals:?}");
        }
    }
    // The distributed backends, measured in the same run. CI builds with
    // --all-features, so ZooKeeper is in; a build without the feature must
    // say that it left the ZooKeeper rows out.
    let zookeeper = cfg!(feature = "zookeeper");
    let backends: &[&str] = if zookeeper {
        &["redis", "redlock-3", "redlock-5", "zookeeper"]
    } else {
        &["redis", "redlock-3", "redlock-5"]
    };
    if !zookeeper {
        assert!(stderr.contains("ZooKeeper rows not measured"), "ZooKeeper rows left out silently; stderr:\n{stderr}");
    }
    for &backend in backends {
        for c in [1, 16] {
            assert!(
                seen.contains(&("backends".to_owned(), "dlock".to_owned(), backend.to_owned(), Some(c))),
                "no backends row for {backend} at {c}"
            );
        }
        assert!(
            seen.contains(&("backends-handoff".to_owned(), "dlock".to_owned(), backend.to_owned(), Some(8))),
            "no backends-handoff row for {backend}"
        );
    }
    let backend_ratios: Vec<f64> = rows
        .iter()
        .filter(|r| r["bench"] == "backends" && r["backend"] != "redis")
        .filter_map(|r| r["ratio"].as_f64())
        .collect();
    assert_eq!(backend_ratios.len(), 2 * (backends.len() - 1), "a ratio to single Redis on every backends row");
    // The HTTP layer against the route alone and the raw SET NX route.
    for (imp, backend) in [("no-layer", "memory"), ("layer", "memory"), ("layer", "redis"), ("raw-route", "redis")] {
        assert!(
            seen.contains(&("http".to_owned(), imp.to_owned(), backend.to_owned(), Some(16))),
            "no http row for {imp}/{backend}"
        );
    }
    // The same two routes in process, and the layer's ratio to the route alone.
    for imp in ["no-layer", "layer"] {
        assert!(
            seen.contains(&("http-in-process".to_owned(), imp.to_owned(), "memory".to_owned(), Some(1))),
            "no in-process {imp} row"
        );
    }
    let in_process_ratio = rows
        .iter()
        .find(|r| r["bench"] == "http-in-process" && r["impl"] == "layer")
        .and_then(|r| r["ratio"].as_f64())
        .expect("the in-process layer row has a ratio");
    assert!(in_process_ratio > 0.0 && in_process_ratio < 2.0, "implausible in-process ratio {in_process_ratio}");
    // Idempotency-Key mode: the route alone, first requests and replays.
    for (imp, backend) in [
        ("no-layer", "memory"),
        ("first-request", "redis"),
        ("replay", "redis"),
        ("first-request", "memory"),
        ("replay", "memory"),
    ] {
        assert!(
            seen.contains(&("idempotency".to_owned(), imp.to_owned(), backend.to_owned(), Some(8))),
            "no idempotency row for {imp}/{backend}"
        );
    }
}
