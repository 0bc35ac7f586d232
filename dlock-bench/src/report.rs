//! One row type for every benchmark, printed as tables or JSON lines.

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

/// A stated goal and whether the measurement met it.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// E.g. `p50 <= 250 us`.
    pub(crate) goal: String,
    /// The figure measured against the goal.
    pub(crate) value: f64,
    pub(crate) met: bool,
}

impl Target {
    /// `PASS` or `MISS`, as the tables print it.
    pub(crate) fn verdict(&self) -> &'static str {
        if self.met {
            "PASS"
        } else {
            "MISS"
        }
    }
}

/// One line of results: an implementation on a backend at one concurrency.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// `uncontended`, `handoff`, …
    pub(crate) bench: &'static str,
    /// `dlock`, `baseline`, `poll-1ms`, …
    pub(crate) imp: String,
    /// `redis`, `memory`, …
    pub(crate) backend: &'static str,
    /// Tasks (uncontended) or contenders K (handoff).
    pub(crate) concurrency: usize,
    pub(crate) ops_per_sec: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    /// Client commands per acquisition (0 for in-process backends).
    pub(crate) cmds_per_acquisition: Option<f64>,
    /// Every server call per acquisition, Lua scripts' calls included.
    pub(crate) server_cmds_per_acquisition: Option<f64>,
    /// Server main-thread CPU µs per operation.
    pub(crate) server_cpu_us: Option<f64>,
    /// The benchmark process's CPU µs per operation (client side).
    pub(crate) client_cpu_us: Option<f64>,
    /// dlock / baseline throughput, on rows that have a baseline.
    pub(crate) ratio: Option<f64>,
    /// dlock / the fenced floor (uncontended rows on Redis).
    pub(crate) vs_floor: Option<f64>,
    /// dlock / the fenced floor with the server clock read (uncontended).
    pub(crate) vs_clock_floor: Option<f64>,
    /// dlock / the Redisson-semantics peer, throughput (uncontended rows).
    pub(crate) vs_peer: Option<f64>,
    /// Redis CPU per cycle, dlock / the fenced floor (uncontended rows).
    pub(crate) cpu_vs_floor: Option<f64>,
    /// Keys Redis holds more after the run, per lock (`memory` rows).
    pub(crate) keys_left_per_lock: Option<f64>,
    /// `used_memory` bytes more after the run, per lock (`memory` rows).
    pub(crate) bytes_left_per_lock: Option<f64>,
    pub(crate) targets: Vec<Target>,
    /// Measurements the medians were taken over.
    pub(crate) rounds: usize,
    /// Operations measured, all rounds together.
    pub(crate) samples: u64,
}

impl Row {
    /// The row as one JSON object.
    pub(crate) fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("bench".into(), json!(self.bench));
        m.insert("impl".into(), json!(self.imp));
        m.insert("backend".into(), json!(self.backend));
        m.insert("concurrency".into(), json!(self.concurrency));
        m.insert("ops_per_sec".into(), json!(round(self.ops_per_sec, 1)));
        m.insert("p50_us".into(), json!(round(self.p50_us, 1)));
        m.insert("p99_us".into(), json!(round(self.p99_us, 1)));
        if let Some(c) = self.cmds_per_acquisition {
            m.insert("cmds_per_acquisition".into(), json!(round(c, 2)));
        }
        if let Some(c) = self.server_cmds_per_acquisition {
            m.insert("server_cmds_per_acquisition".into(), json!(round(c, 2)));
        }
        if let Some(c) = self.server_cpu_us {
            m.insert("server_cpu_us".into(), json!(round(c, 2)));
        }
        if let Some(c) = self.client_cpu_us {
            m.insert("client_cpu_us".into(), json!(round(c, 2)));
        }
        if let Some(r) = self.ratio {
            m.insert("ratio".into(), json!(round(r, 3)));
        }
        if let Some(r) = self.vs_floor {
            m.insert("ratio_vs_fenced_floor".into(), json!(round(r, 3)));
        }
        if let Some(r) = self.vs_clock_floor {
            m.insert("ratio_vs_fenced_clock_floor".into(), json!(round(r, 3)));
        }
        if let Some(r) = self.vs_peer {
            m.insert("ratio_vs_redisson_peer".into(), json!(round(r, 3)));
        }
        if let Some(r) = self.cpu_vs_floor {
            m.insert("server_cpu_vs_fenced_floor".into(), json!(round(r, 3)));
        }
        if let Some(k) = self.keys_left_per_lock {
            m.insert("keys_left_per_lock".into(), json!(round(k, 5)));
        }
        if let Some(b) = self.bytes_left_per_lock {
            m.insert("bytes_left_per_lock".into(), json!(round(b, 2)));
        }
        if !self.targets.is_empty() {
            m.insert("targets".into(), json!(self.targets.iter().map(|t| t.goal.as_str()).collect::<Vec<_>>()));
            m.insert("meets_targets".into(), json!(self.targets.iter().all(|t| t.met)));
            m.insert(
                "target_results".into(),
                json!(self
                    .targets
                    .iter()
                    .map(|t| json!({"goal": t.goal, "value": round(t.value, 3), "met": t.met}))
                    .collect::<Vec<_>>()),
            );
        }
        m.insert("rounds".into(), json!(self.rounds));
        m.insert("samples".into(), json!(self.samples));
        Value::Object(m)
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// One JSON object per line.
pub(crate) fn json_lines(rows: &[Row]) -> String {
    rows.iter().map(|r| format!("{}\n", r.to_json())).collect()
}

/// A table per benchmark, with a title line for each.
pub(crate) fn tables(rows: &[Row], titles: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut benches: Vec<&str> = Vec::new();
    for r in rows {
        if !benches.contains(&r.bench) {
            benches.push(r.bench);
        }
    }
    for bench in benches {
        let title = titles.iter().find(|(b, _)| *b == bench).map_or(bench, |(_, t)| t);
        let _ = writeln!(out, "\n{title}");
        let conc = if bench == "handoff" { "K" } else { "conc" };
        let _ = writeln!(
            out,
            "{:<16} {:<7} {:>5} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6}  targets",
            "impl", "backend", conc, "ops/s", "p50 us", "p99 us", "cmds/acq", "srv/acq", "srv us", "cli us", "ratio"
        );
        for r in rows.iter().filter(|r| r.bench == bench) {
            let opt = |v: Option<f64>, d: usize| v.map_or("-".to_owned(), |v| format!("{v:.d$}"));
            let mut targets =
                r.targets.iter().map(|t| format!("{} {}", t.goal, t.verdict())).collect::<Vec<_>>().join("; ");
            for (v, what) in [
                (r.vs_floor, "of the fenced floor"),
                (r.vs_clock_floor, "of the clock floor"),
                (r.cpu_vs_floor, "of the floor's srv us"),
                (r.vs_peer, "of the redisson-peer"),
            ] {
                if let Some(v) = v {
                    let sep = if targets.is_empty() { "" } else { "; " };
                    targets.push_str(&format!("{sep}{v:.3} {what}"));
                }
            }
            if let (Some(k), Some(b)) = (r.keys_left_per_lock, r.bytes_left_per_lock) {
                let sep = if targets.is_empty() { "" } else { "; " };
                targets.push_str(&format!("{sep}left per lock: {k:.5} keys, {b:.1} bytes"));
            }
            let _ = writeln!(
                out,
                "{:<16} {:<7} {:>5} {:>10.0} {:>9.1} {:>9.1} {:>9} {:>9} {:>7} {:>7} {:>6}  {}",
                r.imp,
                r.backend,
                r.concurrency,
                r.ops_per_sec,
                r.p50_us,
                r.p99_us,
                opt(r.cmds_per_acquisition, 2),
                opt(r.server_cmds_per_acquisition, 1),
                opt(r.server_cpu_us, 1),
                opt(r.client_cpu_us, 2),
                opt(r.ratio, 3),
                targets
            );
        }
    }
    let summary = target_lines(rows);
    if !summary.is_empty() {
        let _ = writeln!(out, "\ntargets (PASS = met; MISS = missed)\n{summary}");
    }
    out
}

/// One line per target of every row: the verdict first, then where and what.
pub(crate) fn target_lines(rows: &[Row]) -> String {
    let mut out = String::new();
    for r in rows {
        for t in &r.targets {
            let _ = writeln!(
                out,
                "{}  {} {}/{} c={}: {} (measured {:.3})",
                t.verdict(),
                r.bench,
                r.imp,
                r.backend,
                r.concurrency,
                t.goal,
                t.value
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            bench: "handoff",
            imp: "dlock".into(),
            backend: "redis",
            concurrency: 8,
            ops_per_sec: 512.345,
            p50_us: 180.04,
            p99_us: 410.0,
            cmds_per_acquisition: Some(4.0),
            server_cmds_per_acquisition: Some(20.5),
            server_cpu_us: Some(12.5),
            client_cpu_us: Some(3.25),
            ratio: None,
            vs_floor: None,
            vs_clock_floor: None,
            vs_peer: None,
            cpu_vs_floor: None,
            keys_left_per_lock: None,
            bytes_left_per_lock: None,
            targets: vec![
                Target { goal: "p50 <= 250 us".into(), value: 180.04, met: true },
                Target { goal: "cmds/acq <= 4".into(), value: 4.5, met: false },
            ],
            rounds: 3,
            samples: 900,
        }
    }

    #[test]
    fn json_has_the_documented_keys() {
        let v = row().to_json();
        for key in
            ["bench", "impl", "backend", "concurrency", "ops_per_sec", "p50_us", "p99_us", "cmds_per_acquisition"]
        {
            assert!(v.get(key).is_some(), "missing {key} in {v}");
        }
        assert_eq!(v["impl"], "dlock");
        assert_eq!(v["ops_per_sec"], 512.3);
        assert_eq!(v["meets_targets"], false);
        assert_eq!(v["target_results"][1]["value"], 4.5);
        assert_eq!(v["target_results"][1]["met"], false);
        assert!(v.get("ratio").is_none());
    }

    #[test]
    fn tables_show_every_row_under_its_title() {
        let t = tables(&[row()], &[("handoff", "HANDOFF TITLE")]);
        assert!(t.contains("HANDOFF TITLE"));
        assert!(t.contains("p50 <= 250 us PASS"));
        assert!(t.contains("PASS  handoff dlock/redis c=8: p50 <= 250 us (measured 180.040)"), "{t}");
        assert!(t.contains("MISS  handoff dlock/redis c=8: cmds/acq <= 4 (measured 4.500)"), "{t}");
        assert!(t.lines().any(|l| l.starts_with("dlock") && l.contains("redis")));
    }
}
