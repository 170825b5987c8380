//! `granary._native`: the engine for Python. The `granary` package (`python/granary/`) wraps it:
//! a `Store` (open, ingest, list), a `Loader` whose batches are exported through DLPack without
//! a copy, the process's metrics endpoint, and the exceptions.
//!
//! Invariants: every engine call that can wait (ingest from files, a loader's next batch) runs
//! with the GIL released; an object whose engine threads belong to another process (a fork
//! copied it) refuses to be used and is never dropped in the child (its threads do not exist
//! there); an exported batch keeps its staging buffer, and its device buffer, until the last
//! consumer's deleter runs.
//!
//! Owns the module's registration (its classes, functions and exceptions). Never: holds engine
//! state of its own (each class's file does).

mod arrow;
mod batch;
mod dlpack;
mod errors;
mod exchange;
mod loader;
mod loader_args;
mod source;
mod state;
mod metrics;
mod records;
mod store;

use pyo3::prelude::*;

/// Runs the `granary` command line on `args` (the program's name first), with the GIL
/// released, and returns its exit status: the package's `granary` console script.
#[pyfunction]
fn cli(py: Python<'_>, args: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| granary::cli::main_with(args))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<store::Store>()?;
    m.add_class::<loader::Loader>()?;
    m.add_class::<batch::NativeBatch>()?;
    m.add_class::<dlpack::Exported>()?;
    m.add_class::<metrics::MetricsEndpoint>()?;
    m.add_class::<records::RecordReader>()?;
    m.add("Error", py.get_type::<errors::Error>())?;
    m.add("CorruptionError", py.get_type::<errors::CorruptionError>())?;
    m.add("NotFoundError", py.get_type::<errors::NotFoundError>())?;
    m.add("PluginError", py.get_type::<errors::PluginError>())?;
    m.add("ForkError", py.get_type::<errors::ForkError>())?;
    m.add("DeviceError", py.get_type::<errors::DeviceError>())?;
    m.add("IngestIntentError", py.get_type::<errors::IngestIntentError>())?;
    m.add_function(wrap_pyfunction!(loader::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::serve_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metrics_text, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::_metrics_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::_metrics_after_fork_in_parent, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::_metrics_after_fork_in_child, m)?)?;
    Ok(())
}
