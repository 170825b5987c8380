//! The process's metrics for Python: `/metrics` served over HTTP (`serve_metrics`), and the
//! exposition as text (`metrics_text`). The loaders of the process register themselves; this
//! only exposes them.
//!
//! Owns `MetricsEndpoint`, `serve_metrics`, `metrics_text` and the fork hooks of the endpoint's
//! thread. Never: joins the endpoint's thread in a process forked from the one that started it (that
//! thread is the parent's; the copy is leaked, as a loader's is).

use pyo3::prelude::*;

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
