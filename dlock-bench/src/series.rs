//! One benchmark's measurements over rounds, and the row they make.

use crate::measure::{median, Sample};
use crate::report::{Row, Target};

/// Measurements of one (implementation, backend, concurrency) over rounds.
#[derive(Debug)]
pub(crate) struct Series {
    pub(crate) bench: &'static str,
    pub(crate) imp: &'static str,
    pub(crate) backend: &'static str,
    pub(crate) concurrency: usize,
    pub(crate) samples: Vec<Sample>,
}

impl Series {
    pub(crate) fn new(bench: &'static str, imp: &'static str, backend: &'static str, concurrency: usize) -> Self {
        Series { bench, imp, backend, concurrency, samples: Vec::new() }
    }

    pub(crate) fn median_ops(&self) -> f64 {
        median(self.samples.iter().map(|s| s.ops_per_sec)).unwrap_or(0.0)
    }

    /// The row: the median of every figure over the rounds.
    pub(crate) fn row(&self) -> Row {
        let in_process = self.backend == "memory";
        let cmds = |pick: fn(&(f64, f64)) -> f64| {
            if in_process {
                Some(0.0)
            } else {
                median(self.samples.iter().filter_map(|s| s.cmds_per_op.as_ref().map(pick)))
            }
        };
        Row {
            bench: self.bench,
            imp: self.imp.to_owned(),
            backend: self.backend,
            concurrency: self.concurrency,
            ops_per_sec: self.median_ops(),
            p50_us: median(self.samples.iter().map(|s| s.p50_us)).unwrap_or(0.0),
            p99_us: median(self.samples.iter().map(|s| s.p99_us)).unwrap_or(0.0),
            cmds_per_acquisition: cmds(|c| c.0),
            server_cmds_per_acquisition: if in_process { None } else { cmds(|c| c.1) },
            server_cpu_us: median(self.samples.iter().filter_map(|s| s.server_cpu_us_per_op)),
            client_cpu_us: median(self.samples.iter().filter_map(|s| s.client_cpu_us_per_op)),
            ratio: None,
            vs_floor: None,
            vs_clock_floor: None,
            vs_peer: None,
            cpu_vs_floor: None,
            keys_left_per_lock: None,
            bytes_left_per_lock: None,
            targets: Vec::new(),
            rounds: self.samples.len(),
            samples: self.samples.iter().map(|s| s.ops).sum(),
        }
    }
}

/// A target on a figure: `value <= limit` or `value >= limit`.
pub(crate) fn target(name: &str, value: f64, at_most: bool, limit: f64, unit: &str) -> Target {
    let (op, met) = if at_most { ("<=", value <= limit) } else { (">=", value >= limit) };
    Target { goal: format!("{name} {op} {limit}{unit}"), value, met }
}
