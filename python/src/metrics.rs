//! The process's metrics for Python: `/metrics` served over HTTP (`serve_metrics`), the
//! exposition as text (`metrics_text`), and one loader's counters as `Loader.metrics()`'s dict
//! (`metrics_dict`). The loaders of the process register themselves; this only exposes them.
//!
//! Owns `MetricsEndpoint`, `serve_metrics`, `metrics_text`, `metrics_dict` and the fork hooks of
//! the endpoint's thread. Never: joins the endpoint's thread in a process forked from the one that started it (that
//! thread is the parent's; the copy is leaked, as a loader's is).

use std::time::Duration;

use granary::loader::StartStage;
use granary::{LoaderStats, TierStats};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{engine, forked};

/// A running `/metrics` endpoint; `close()` (or dropping it) stops it.
#[pyclass(module = "granary._native")]
pub(crate) struct MetricsEndpoint {
    endpoint: Option<granary::metrics::Endpoint>,
    addr: std::net::SocketAddr,
    pid: u32,
}

#[pymethods]
impl MetricsEndpoint {
    /// The host it listens on.
    #[getter]
    fn host(&self) -> String {
        self.addr.ip().to_string()
    }

    /// The port it listens on (the one picked, when 0 was asked for).
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Stops serving.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.pid != std::process::id() {
            return Err(forked("metrics endpoint", self.pid));
        }
        if let Some(endpoint) = self.endpoint.take() {
            py.detach(move || drop(endpoint));
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("MetricsEndpoint(http://{}/metrics)", self.addr)
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        let Some(endpoint) = self.endpoint.take() else { return };
        if self.pid != std::process::id() {
            std::mem::forget(endpoint);
            return;
        }
        // Dropped by the garbage collector, with the GIL held: stopping joins the endpoint's
        // thread, which may be finishing a scrape, so it happens on a thread of its own.
        // (If no thread can be started, the closure, endpoint and all, is dropped here.)
        let _ = std::thread::Builder::new().name("granary-metrics-stop".into()).spawn(move || drop(endpoint));
    }
}

/// Serves the process's metrics at `http://HOST:PORT/metrics` on a thread of its own.
#[pyfunction]
pub(crate) fn serve_metrics(py: Python<'_>, host: String, port: u16) -> PyResult<MetricsEndpoint> {
    let endpoint = engine(py, || granary::metrics::serve((host.as_str(), port)))?;
    Ok(MetricsEndpoint { addr: endpoint.addr(), endpoint: Some(endpoint), pid: std::process::id() })
}

/// Before a `fork` (registered with `os.register_at_fork`): holds the registry across it.
#[pyfunction]
pub(crate) fn _metrics_before_fork(py: Python<'_>) {
    py.detach(granary::metrics::before_fork);
}

/// After a `fork`, in the parent.
#[pyfunction]
pub(crate) fn _metrics_after_fork_in_parent() {
    granary::metrics::after_fork_in_parent();
}

/// After a `fork`, in the child: the parent's loaders and nodes are not the child's.
#[pyfunction]
pub(crate) fn _metrics_after_fork_in_child() {
    granary::metrics::after_fork_in_child();
}

/// The process's metrics in the Prometheus text format (what a scrape without OpenMetrics
/// gets).
#[pyfunction]
pub(crate) fn metrics_text(py: Python<'_>) -> String {
    py.detach(|| granary::metrics::global().encode(granary::metrics::Format::Prometheus))
}

/// A loader's counters since it was made, as `granary.Loader.metrics` describes them: `stats`
/// of every engine loader it ran, the running one's `start`, its memory tier's counters.
pub(crate) fn metrics_dict<'py>(
    py: Python<'py>,
    stats: &LoaderStats,
    start: &[(StartStage, Duration)],
    tier: Option<TierStats>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("batches", stats.batches)?;
    out.set_item("records", stats.records)?;
    out.set_item("bytes", stats.bytes)?;
    out.set_item("stall_seconds", stats.stall.as_secs_f64())?;
    out.set_item("stall_max_seconds", stats.stall_max.as_secs_f64())?;
    out.set_item("elapsed_seconds", stats.elapsed.as_secs_f64())?;
    out.set_item("stall_fraction", stats.stall_fraction())?;
    out.set_item("rebalance_recut_batches", stats.recut)?;
    // The running loader's start: when each stage ended, in seconds from its construction.
    let stages = PyDict::new(py);
    for (stage, at) in start {
        stages.set_item(stage.name(), at.as_secs_f64())?;
    }
    out.set_item("start", stages)?;
    let hit = if stats.batches == 0 { 0.0 } else { stats.ready as f64 / stats.batches as f64 };
    out.set_item("cache_hit_ratio", hit)?;
    out.set_item("bytes_read", stats.read.bytes_read)?;
    // Blocks checked by the reads from disk and by the fills of this loader's memory tier.
    let filled = tier.as_ref().map_or(0, |t| t.bytes_loaded / 4096);
    out.set_item("blocks_verified", stats.read.blocks_verified + filled)?;
    out.set_item("verify_failures", stats.read.verify_failures)?;
    out.set_item("ops", stats.read.ops)?;
    out.set_item("ops_direct", stats.read.ops_direct)?;
    out.set_item("ops_offloaded", stats.read.ops_offloaded)?;
    out.set_item("shards_repaired", stats.read.shards_repaired)?;
    out.set_item("pinned", stats.pool.pinned)?;
    // How well the plan mixes: the shards a batch drew from, on average.
    out.set_item("shards_per_batch", stats.read.shards_per_batch())?;
    out.set_item("tier_records", stats.read.tier_records)?;
    out.set_item("tier_bytes", stats.read.tier_bytes)?;
    let tier_hit =
        if stats.read.records == 0 { 0.0 } else { stats.read.tier_records as f64 / stats.read.records as f64 };
    out.set_item("tier_hit_ratio", tier_hit)?;
    if let Some(held) = tier {
        out.set_item("tier_bytes_held", held.bytes_held)?;
        out.set_item("tier_budget_bytes", held.budget_bytes)?;
        out.set_item("tier_extents_loaded", held.extents_loaded)?;
        out.set_item("tier_extents_evicted", held.extents_evicted)?;
        out.set_item("tier_evictor_chosen", held.evictor_chosen)?;
        out.set_item("tier_evictor_refused", held.evictor_refused)?;
        out.set_item("tier_evictor_failures", held.evictor_failures)?;
    }
    // Reading an attached dataset: its shards come from the origin through the cache.
    if let Some(cache) = &stats.cache {
        out.set_item("origin_bytes", cache.bytes_from_origin)?;
        out.set_item("origin_peer_bytes", cache.bytes_from_peers)?;
        out.set_item("origin_peer_failures", cache.peer_failures)?;
        out.set_item("origin_shards_fetched", cache.shards_fetched)?;
        out.set_item("origin_prefetched", cache.prefetched)?;
        out.set_item("origin_refetches", cache.refetches)?;
        out.set_item("origin_cache_hit_ratio", cache.hit_ratio())?;
        out.set_item("origin_wait_seconds", cache.fetch_wait.as_secs_f64())?;
        out.set_item("origin_evictions", cache.evictions)?;
    }
    Ok(out)
}
