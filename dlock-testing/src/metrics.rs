//! Recorders for tests of dlock's metrics: [`Recorded`] keeps what it was
//! told and reads it back without resetting it (a series is
//! `name{label=value,...}`, labels sorted), and [`Panicking`] panics in
//! every handle, for the rule that a recorder's fault never breaks a lock.
//! [`recording`] runs a workload with one installed on its own runtime.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// What a recorder was told, read without resetting it: per metric name and
/// sorted labels, a counter's total, a gauge's value, a histogram's values.
#[derive(Default, Debug)]
struct Recording {
    counters: BTreeMap<String, u64>,
    gauges: BTreeMap<String, f64>,
    histograms: BTreeMap<String, Vec<f64>>,
    described: BTreeMap<String, Option<Unit>>,
}

/// A recorder that keeps every figure; clones share them.
#[derive(Clone, Default, Debug)]
pub struct Recorded(Arc<Mutex<Recording>>);

/// `name{label=value,...}`, labels sorted.
fn id(key: &Key) -> String {
    let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

struct Handle(Recorded, String);

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        *self.0 .0.lock().expect("recording").counters.entry(self.1.clone()).or_default() += value;
    }
    fn absolute(&self, value: u64) {
        self.0 .0.lock().expect("recording").counters.insert(self.1.clone(), value);
    }
}

impl GaugeFn for Handle {
    fn increment(&self, value: f64) {
        *self.0 .0.lock().expect("recording").gauges.entry(self.1.clone()).or_default() += value;
    }
    fn decrement(&self, value: f64) {
        *self.0 .0.lock().expect("recording").gauges.entry(self.1.clone()).or_default() -= value;
    }
    fn set(&self, value: f64) {
        self.0 .0.lock().expect("recording").gauges.insert(self.1.clone(), value);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        self.0 .0.lock().expect("recording").histograms.entry(self.1.clone()).or_default().push(value);
    }
}

impl Recorder for Recorded {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.0.lock().expect("recording").described.insert(key.as_str().to_owned(), unit);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.0.lock().expect("recording").described.insert(key.as_str().to_owned(), unit);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        self.0.lock().expect("recording").described.insert(key.as_str().to_owned(), unit);
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Handle(self.clone(), id(key))))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(Arc::new(Handle(self.clone(), id(key))))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Handle(self.clone(), id(key))))
    }
}

impl Recorded {
    /// The units described, by metric name.
    pub fn described(&self) -> BTreeMap<String, Option<Unit>> {
        self.0.lock().expect("recording").described.clone()
    }

    /// A counter's total (0 if never counted).
    pub fn counter(&self, id: &str) -> u64 {
        self.0.lock().expect("recording").counters.get(id).copied().unwrap_or(0)
    }
    /// A gauge's value (0 if never set).
    pub fn gauge(&self, id: &str) -> f64 {
        self.0.lock().expect("recording").gauges.get(id).copied().unwrap_or(0.0)
    }
    /// How many values a histogram got.
    pub fn count(&self, id: &str) -> usize {
        self.0.lock().expect("recording").histograms.get(id).map_or(0, Vec::len)
    }
    /// A histogram's values.
    pub fn values(&self, id: &str) -> Vec<f64> {
        self.0.lock().expect("recording").histograms.get(id).cloned().unwrap_or_default()
    }
    /// Every series name with its labels, for the checks on labels.
    pub fn series(&self) -> Vec<String> {
        let r = self.0.lock().expect("recording");
        r.counters.keys().chain(r.gauges.keys()).chain(r.histograms.keys()).cloned().collect()
    }
}

/// Runs `workload` on a runtime of this thread with `recorder` installed
/// for it: every task the runtime runs records there, and tests of one
/// binary keep their figures apart.
pub fn recording<R: Recorder + 'static>(recorder: &R, workload: impl std::future::Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    metrics::with_local_recorder(recorder, || runtime.block_on(workload));
}

/// A recorder whose every handle panics (and two of whose registrations do).
#[derive(Debug)]
pub struct Panicking;

struct Bomb;

impl CounterFn for Bomb {
    fn increment(&self, _: u64) {
        panic!("recorder bug");
    }
    fn absolute(&self, _: u64) {
        panic!("recorder bug");
    }
}

impl GaugeFn for Bomb {
    fn increment(&self, _: f64) {
        panic!("recorder bug");
    }
    fn decrement(&self, _: f64) {
        panic!("recorder bug");
    }
    fn set(&self, _: f64) {
        panic!("recorder bug");
    }
}

impl HistogramFn for Bomb {
    fn record(&self, _: f64) {
        panic!("recorder bug");
    }
}

impl Recorder for Panicking {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("recorder bug");
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("recorder bug");
    }
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("recorder bug");
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Bomb))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(Arc::new(Bomb))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        if key.name().contains("backend") {
            panic!("recorder bug at registration");
        }
        Histogram::from_arc(Arc::new(Bomb))
    }
}
