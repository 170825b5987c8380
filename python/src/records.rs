//! `RecordReader`: records of one dataset version read by index, for random-access users (the
//! Grain data source, `granary.grain.DataSource`), every byte verified as a loader's are.
//!
//! Owns the reader of one process and the version it was opened at (pinned: a later ingest does
//! not change what index i is). Never: plans an order or prefetches (a random-access source
//! reads what it is asked, when it is asked), or uses a reader a forked parent made (a child
//! opens its own on first use).

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyBytes, PyList};

use granary::read::Batch;
use granary::{Dataset, IoConfig, Layout, Reader, StorePaths};

use crate::batch::{decode_samples, layout_name, samples_to_py};
use crate::errors::{engine, invalid};

/// A reader and the process that made it.
struct Opened {
    pid: u32,
    reader: Reader,
    batch: Batch,
}

/// Reads records of one dataset version by index.
#[pyclass(module = "granary._native", frozen)]
pub(crate) struct RecordReader {
    dataset: Arc<Dataset>,
    spec: String,
    attached: bool,
    paths: StorePaths,
    opened: Mutex<Option<Opened>>,
}

#[pymethods]
impl RecordReader {
    /// The version `spec` (`name`, `name@N`) of the store at `root`; `name` alone is pinned to
    /// its current version now.
    #[new]
    fn new(py: Python<'_>, root: PathBuf, spec: &str) -> PyResult<Self> {
        let paths = StorePaths::new(&root);
        let (dataset, attached) = engine(py, || -> granary::Result<_> {
            let dataset = Dataset::open(&paths, &paths.parse_spec(spec)?)?;
            let attached = match dataset.version() {
                Some((name, _)) => granary::origin::attachment(&paths, name)?.is_some(),
                None => false,
            };
            Ok((dataset, attached))
        })?;
        let spec = match dataset.version() {
            Some((name, version)) => format!("{name}@{version}"),
            None => spec.to_owned(),
        };
        Ok(Self { dataset, spec, attached, paths, opened: Mutex::new(None) })
    }

    /// The version read, as `name@N`.
    #[getter]
    fn spec(&self) -> &str {
        &self.spec
    }

    /// `"fixed"`, `"arrays"`, `"bytes"` or `"samples"`.
    #[getter]
    fn layout(&self) -> &'static str {
        layout_name(self.dataset.layout())
    }

    /// The element type's name (`"u16"`, ...), for fixed records and arrays.
    #[getter]
    fn dtype(&self) -> Option<&'static str> {
        match self.dataset.layout() {
            Layout::Fixed(fixed) => Some(fixed.dtype().name()),
            Layout::Arrays(dtype) => Some(dtype.name()),
            _ => None,
        }
    }

    /// A fixed record's dimensions.
    #[getter]
    fn shape(&self) -> Option<Vec<u64>> {
        match self.dataset.layout() {
            Layout::Fixed(fixed) => Some(fixed.dims().to_vec()),
            _ => None,
        }
    }

    fn __len__(&self) -> usize {
        usize::try_from(self.dataset.n_records()).unwrap_or(usize::MAX)
    }

    /// The records `indices`, in that order, each verified: a list of `bytes` (or of dicts, for
    /// samples). An index past the end is an `IndexError`-like error naming it; a damaged
    /// record a `CorruptionError`. The GIL is released while the records are read.
    fn read<'py>(&self, py: Python<'py>, indices: Vec<u64>) -> PyResult<Bound<'py, PyList>> {
        let n = self.dataset.n_records();
        if let Some(&bad) = indices.iter().find(|&&i| i >= n) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "record {bad} of {} ({n} records)",
                self.spec
            )));
        }
        let pid = std::process::id();
        // Waits for another thread's read without holding the GIL (that read needs it to end).
        let mut guard = self.opened.lock_py_attached(py);
        if let Some(opened) = guard.as_ref()
            && opened.pid != pid
        {
            // A forked child: the parent's reader (its files and ring) stays the parent's,
            // leaked here rather than dropped; the child opens its own.
            std::mem::forget(guard.take());
        }
        if guard.is_none() {
            *guard = Some(engine(py, || self.open(pid))?);
        }
        let opened = guard.as_mut().ok_or_else(|| invalid("the reader is opened above"))?;
        let (reader, batch) = (&mut opened.reader, &mut opened.batch);
        engine(py, || reader.read_batch(&indices, batch))?;
        if matches!(self.dataset.layout(), Layout::Samples) {
            let decoded = decode_samples(&self.dataset, &indices, &|i| batch.record(i))?;
            return samples_to_py(py, decoded);
        }
        let out = PyList::empty(py);
        for record in batch.records() {
            out.append(PyBytes::new(py, record))?;
        }
        Ok(out)
    }
}

impl RecordReader {
    /// A reader of this process: an attached dataset's shards come through the store's origin
    /// cache, as `granary get` reads them.
    fn open(&self, pid: u32) -> granary::Result<Opened> {
        let mut reader = Reader::new(Arc::clone(&self.dataset), IoConfig::default().build()?);
        if self.attached
            && let Some(cache) = granary::origin::OriginCache::open(&self.paths, None, &[])?
        {
            reader.set_repair(cache);
        }
        Ok(Opened { pid, reader, batch: Batch::default() })
    }
}
