//! `GET /metrics`: dlock's metrics (`dlock_core::metrics`) in the Prometheus
//! text format, through the `metrics` ecosystem's exporter. Installed before
//! the first lock is taken, so every lock name registers with it.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{get, MethodRouter};
use dlock_core::idempotency::IdempotencyStore;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Buckets for every histogram, in seconds: the acquire waits dlock sees
/// (0.5 ms to 30 s) and the holds (up to 5 min).
const BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// Installs the Prometheus recorder for this process, with the task that
/// keeps its histograms drained.
pub(crate) fn install() -> Result<PrometheusHandle, Box<dyn std::error::Error>> {
    let handle = PrometheusBuilder::new().set_buckets(BUCKETS)?.install_recorder()?;
    dlock_core::metrics::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// The scrape route; each scrape reads the idempotency store's usage
/// first, for its gauges.
pub(crate) fn route<S: Clone + Send + Sync + 'static>(
    handle: PrometheusHandle,
    store: Arc<dyn IdempotencyStore>,
) -> MethodRouter<S> {
    get(move || {
        let (handle, store) = (handle.clone(), store.clone());
        async move {
            if let Err(e) = dlock_core::metrics::record_store_usage(store.as_ref()).await {
                tracing::warn!(error = %e, "the idempotency store's usage could not be read for /metrics");
            }
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response()
        }
    })
}
