//! `Store`: a store root, opened per call (so the object holds no engine threads, no catalog
//! and no lock, and survives a fork), with ingest and listing.
//!
//! Owns the Python `Store` (its ingests from arrays, files, Arrow streams and other formats,
//! listing, attach and push) and an ingest's progress report. Never: keeps the store open
//! between calls, or holds the GIL while the engine reads or writes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};

use granary::ingest::{self as sources, Progress};
use granary::{DatasetName, Dtype, FixedLayout, Granary, IngestMode, IngestOptions, Layout, StorePaths};

use crate::errors::{engine, invalid, os, to_py};

/// How often progress is reported at most.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// A granary store on local disk.
#[pyclass(module = "granary._native", frozen)]
pub(crate) struct Store {
    root: PathBuf,
}

#[pymethods]
impl Store {
    /// Opens the store at `path`; `create=True` makes it if it does not exist. Opening an
    /// existing store checks its files only: no lock is taken and the catalog is not opened
    /// (each write opens them), so a reader opens a store another process is writing to, and
    /// so does a child forked after its parent wrote (where the catalog cannot be opened).
    #[new]
    #[pyo3(signature = (path, *, create = false))]
    fn new(py: Python<'_>, path: PathBuf, create: bool) -> PyResult<Self> {
        let root = path.clone();
        py.detach(|| match StorePaths::new(&root).check() {
            Err(granary::Error::NotAStore { .. }) if create => Granary::create(&root).map(drop),
            checked => checked,
        })
        .map_err(to_py)?;
        Ok(Self { root: path })
    }

    /// The store's root directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.root.clone()
    }

    /// Every dataset: a list of dicts with `name`, `version` (the current one), `versions`,
    /// `records`, `shards`, `bytes` (of its shard files) and `layout`.
    fn datasets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let paths = StorePaths::new(&self.root);
        let summaries = engine(py, || granary::engine::datasets_from_files(&paths))?;
        let out = PyList::empty(py);
        for summary in summaries {
            let Some(current) = summary.versions.last() else { continue };
            let entry = PyDict::new(py);
            entry.set_item("name", summary.name.as_str())?;
            entry.set_item("version", current.number)?;
            entry.set_item("versions", summary.versions.iter().map(|v| v.number).collect::<Vec<_>>())?;
            entry.set_item("manifest", current.manifest.to_string())?;
            if let Some(object) = &current.entry {
                entry.set_item("records", object.n_records)?;
                entry.set_item("shards", object.n_shards)?;
                entry.set_item("bytes", object.file_bytes)?;
                entry.set_item("layout", object.layout.to_string())?;
            }
            out.append(entry)?;
        }
        Ok(out)
    }

    /// Makes dataset `name` (`"NAME"` or `"NAME@N"`) of the object store at `url` readable
    /// here: its manifest and every shard's metadata are fetched and checked now, record data
    /// as reads need it, into this store's cache of at most `cache_bytes` (kept for later
    /// attaches; 0: unbounded), run by the evictor plugin `evictor` (kept too; default
    /// `plan-aware`, which loaders tell each shard's next use). Credentials come from the
    /// environment (`AWS_*` and the like), never from `url`. Loaders over `name` then read through the cache. Returns `name`,
    /// `version`, `shards`, `bytes` and `cache_bytes`.
    #[pyo3(signature = (name, url, *, cache_bytes = None, evictor = None))]
    fn attach<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        url: &str,
        cache_bytes: Option<u64>,
        evictor: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let spec = granary::VersionSpec::parse(name).map_err(to_py)?;
        let report = py
            .detach(|| {
                let origin = granary::origin::Origin::open(url)?;
                let mut granary = Granary::open(&self.root)?;
                granary::origin::attach(&mut granary, &origin, &spec, cache_bytes, evictor)
            })
            .map_err(to_py)?;
        let out = PyDict::new(py);
        out.set_item("name", report.name.as_str())?;
        out.set_item("version", report.number)?;
        out.set_item("shards", report.shards)?;
        out.set_item("bytes", report.dataset_bytes)?;
        out.set_item("cache_bytes", report.cache_bytes)?;
        Ok(out)
    }

    /// Drops the attached dataset `name` and its cached shards (the origin keeps them).
    /// Returns the number of cached shards removed.
    fn detach(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        let name = DatasetName::new(name).map_err(to_py)?;
        py.detach(|| {
            let mut granary = Granary::open(&self.root)?;
            granary::origin::detach(&mut granary, &name)
        })
        .map(|report| report.shards_removed)
        .map_err(to_py)
    }

    /// Publishes version `name` (`"NAME"` or `"NAME@N"`) to the object store at `url`: the
    /// shards it lacks, then the manifest, then the ref (written only if nobody changed it
    /// meanwhile). Returns the number of shards uploaded.
    fn push(&self, py: Python<'_>, name: &str, url: &str) -> PyResult<usize> {
        let paths = StorePaths::new(&self.root);
        py.detach(|| {
            let origin = granary::origin::Origin::open(url)?;
            let spec = paths.parse_spec(name)?;
            granary::origin::push(&paths, &spec, &origin, &|_| {})
        })
        .map(|report| report.shards_uploaded)
        .map_err(to_py)
    }

    /// Ingests `records` (an iterable of bytes-like objects: `bytes`, `bytearray`, or anything
    /// with `tobytes()`, such as a NumPy array) as a new version of dataset `name`. With `dtype`
    /// and `shape` the records are fixed-size arrays (every record exactly that many bytes, and
    /// a batch is one dense array); without them, byte strings of any length. `replace=True`
    /// makes the version hold only these records (otherwise it appends to the current one).
    /// `progress`: `True` prints to stderr, a callable gets `(records, bytes)` every half
    /// second. Returns what was committed (see `ingest_files`).
    #[pyo3(signature = (name, records, *, dtype = None, shape = None, mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        records: &Bound<'py, PyAny>,
        dtype: Option<&str>,
        shape: Option<Vec<u64>>,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let layout = layout_of(dtype, shape)?;
        let options = options_of(mode, shard_bytes)?;
        let name = DatasetName::new(name).map_err(to_py)?;
        let report = Report::new(name.as_str(), progress)?;
        let mut granary = engine(py, || Granary::open(&self.root))?;
        let mut ingest = granary.ingest(name, layout, options).map_err(to_py)?;
        let mut n = 0u64;
        for record in records.try_iter()? {
            let record = record?;
            let len = if let Ok(data) = record.cast::<PyBytes>() {
                ingest.push(data.as_bytes()).map_err(to_py)?;
                data.as_bytes().len()
            } else if let Ok(data) = record.cast::<PyByteArray>() {
                let data = data.to_vec();
                ingest.push(&data).map_err(to_py)?;
                data.len()
            } else {
                let data = record.call_method0("tobytes").map_err(|_| {
                    invalid(format!(
                        "record {n}: a {} is not bytes-like (bytes, bytearray, or an object with tobytes())",
                        record.get_type().name().map(|t| t.to_string()).unwrap_or_default()
                    ))
                })?;
                let data = data
                    .cast::<PyBytes>()
                    .map_err(|_| invalid(format!("record {n}: tobytes() did not return bytes")))?;
                ingest.push(data.as_bytes()).map_err(to_py)?;
                data.as_bytes().len()
            };
            n += 1;
            report.records.store(n, Ordering::Relaxed);
            report.advance(len as u64);
            // A callable that raised ends the ingest before anything is committed.
            report.check()?;
        }
        report.finish();
        report.check()?;
        let committed = engine(py, || ingest.commit())?;
        committed_dict(py, &committed, &report)
    }

    /// Ingests files as a new version of dataset `name`. With `dtype` and `shape`: files of
    /// back-to-back fixed-size records (nanoGPT and Megatron `.bin` token files, for example;
    /// `drop_remainder=True` skips each file's incomplete last record). Without: every regular
    /// file under the directory `source` is one record, in byte order of their paths. `source`
    /// is a path or a list of paths (record files) or one directory. The GIL is released while
    /// it runs. Returns a dict: `name`, `version`, `manifest`, `records`, `shards`,
    /// `records_added`, `bytes_added`, `shards_published`, `shards_deduplicated`.
    #[pyo3(signature = (name, source, *, dtype = None, shape = None, drop_remainder = false, mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest_files<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        source: &Bound<'py, PyAny>,
        dtype: Option<&str>,
        shape: Option<Vec<u64>>,
        drop_remainder: bool,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let paths = paths_of(source)?;
        let fixed = dtype.is_some() || shape.is_some();
        let layout = if fixed { layout_of(dtype, shape)? } else { Layout::Bytes };
        if !fixed && paths.len() != 1 {
            return Err(invalid("without dtype and shape, source is one directory (each file under it a record)"));
        }
        self.ingest_detached(py, name, layout, options_of(mode, shard_bytes)?, progress, |ingest, report| {
            if fixed {
                sources::records_from_files(ingest, &paths, drop_remainder, report)
            } else {
                sources::files_from_dir(ingest, &paths[0], report).map(drop)
            }
        })
    }

    /// Ingests a Megatron-LM indexed dataset (`prefix.bin` + `prefix.idx`; `prefix` may name
    /// either file) as a new version of dataset `name`: one record per sequence, in order, each
    /// an array of the index's dtype (what Megatron's `IndexedDataset[i]` returns). The index is
    /// checked whole first. The GIL is released while it runs. Returns what was committed (see
    /// `ingest_files`).
    #[pyo3(signature = (name, prefix, *, mode = "new", shard_bytes = None, progress = None))]
    fn ingest_megatron<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        prefix: PathBuf,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let index = engine(py, || sources::MegatronIndex::open(&prefix))?;
        self.ingest_detached(py, name, index.layout(), options_of(mode, shard_bytes)?, progress, |ingest, report| {
            sources::records_from_megatron(ingest, &index, report)
        })
    }

    /// Ingests Parquet files as a new version of dataset `name`: one record per row, rows in
    /// file order. `source` is a path, a directory (its `.parquet` files, in path order), a glob
    /// pattern, or a list of them. `columns` names the columns (default: the files' only one),
    /// each found by its name in every file: one column of lists of numbers makes array records
    /// of their type (token ids); of numbers or bools, records of one number; of anything else,
    /// byte records; several columns make samples (dicts) of named parts: binary and strings as
    /// bytes, lists of numbers as `.npy`, numbers as decimal text, bools, structs and nested lists
    /// as JSON, `Image()`/`Audio()` structs as their files (see `granary.formats.decode`). A null
    /// in a chosen column is refused (`nulls="refuse"`) or its row left out (`nulls="skip"`,
    /// counted in the result's `skipped`). Every file's schema and footer are checked before
    /// anything is written. The GIL is released while it runs. Returns what was committed (see
    /// `ingest_files`) and `skipped`.
    #[pyo3(signature = (name, source, *, columns = None, nulls = "refuse", mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest_parquet<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        source: &Bound<'py, PyAny>,
        columns: Option<Vec<String>>,
        nulls: &str,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let inputs: Vec<String> = paths_of(source)?.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        let nulls = nulls_of(nulls)?;
        let columns = columns.unwrap_or_default();
        let input = engine(py, || sources::ParquetInput::open(&inputs, &columns, nulls))?;
        self.ingest_rows(py, name, input.layout(), options_of(mode, shard_bytes)?, progress, |ingest, report| {
            sources::records_from_parquet(ingest, &input, report)
        })
    }

    /// Ingests any Arrow stream as a new version of dataset `name`: `source` is anything that
    /// offers the Arrow PyCapsule stream interface (`__arrow_c_stream__`): a pyarrow Table or
    /// RecordBatchReader, a Polars DataFrame, a DuckDB relation, a Lance scanner's `to_reader()`,
    /// a Hugging Face `Dataset`'s `.data.table`. One record per row, by the rules of
    /// `ingest_parquet`; `columns` names the columns by name (default: every column, in the
    /// stream's order). Read batch by batch with the GIL released, so a stream larger than memory
    /// goes through; each batch's chosen columns are checked as Arrow data before a row is read.
    /// Returns what was committed (see `ingest_files`) and `skipped`.
    #[pyo3(signature = (name, source, *, columns = None, nulls = "refuse", mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest_arrow<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        source: &Bound<'py, PyAny>,
        columns: Option<Vec<String>>,
        nulls: &str,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let nulls = nulls_of(nulls)?;
        let options = options_of(mode, shard_bytes)?;
        let reader = crate::arrow::stream_of(source)?;
        let input = sources::ArrowInput::new(
            &arrow_array::RecordBatchReader::schema(&reader),
            &columns.unwrap_or_default(),
            nulls,
        )
        .map_err(to_py)?;
        self.ingest_rows(py, name, input.layout(), options, progress, |ingest, report| {
            sources::records_from_arrow(ingest, &input, reader, report)
        })
    }

    /// Ingests a Mosaic Streaming MDS directory (`index.json` and its shards, as `MDSWriter`
    /// writes them, compressed or not) as a new version of dataset `name`: one record per sample,
    /// in order. With one of `columns`: 1-D arrays become array records of their dtype; bytes,
    /// strings, JSON and images byte records; numbers records of one number. Otherwise (default:
    /// every column) samples of parts named `COLUMN.EXT` (arrays as `.npy`, numbers as decimal
    /// text, a `pil` image's raw pixels as `.npy`). An encoding that is not ingested (`pkl`,
    /// lists) is refused, naming it. The GIL is released while it runs. Returns what was
    /// committed (see `ingest_files`).
    #[pyo3(signature = (name, dir, *, columns = None, mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest_mds<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        dir: PathBuf,
        columns: Option<Vec<String>>,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let columns = columns.unwrap_or_default();
        let input = engine(py, || sources::MdsInput::open(&dir, &columns))?;
        self.ingest_detached(py, name, input.layout(), options_of(mode, shard_bytes)?, progress, |ingest, report| {
            sources::records_from_mds(ingest, &input, report).map(drop)
        })
    }

    /// Ingests a LitData optimized directory (`index.json` and its chunks, as `litdata.optimize`
    /// writes them with its default item loader or `TokensLoader`, zstd-compressed or not, with
    /// pyarrow's Arrow footer or without) as a new version of dataset `name`: one record per
    /// item, in order. With one of `columns` (a dict's key): 1-D arrays become array records of
    /// their dtype; `str`/`bytes` byte records; `int`/`float`/`bool` records of one number.
    /// Otherwise (default: every leaf) samples of parts named `LEAF.EXT`. A `TokensLoader`
    /// directory: its documents as array records, or with `block_size` blocks of that many
    /// tokens, as `TokensLoader(block_size)` yields them. A serializer that is not ingested
    /// (`pickle`, images, video) is refused, naming it. The GIL is released while it runs.
    /// Returns what was committed (see `ingest_files`).
    #[pyo3(signature = (name, dir, *, columns = None, block_size = None, mode = "new", shard_bytes = None, progress = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn ingest_litdata<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        dir: PathBuf,
        columns: Option<Vec<String>>,
        block_size: Option<u64>,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let columns = columns.unwrap_or_default();
        let input = engine(py, || sources::LitDataInput::open(&dir, &columns, block_size))?;
        self.ingest_detached(py, name, input.layout(), options_of(mode, shard_bytes)?, progress, |ingest, report| {
            sources::records_from_litdata(ingest, &input, report).map(drop)
        })
    }

    /// Ingests WebDataset tar files (a path or a list) as a new version of dataset `name`: the
    /// entries that share a key form one sample, stored as one record. The GIL is released while
    /// it runs. Returns what was committed (see `ingest_files`).
    #[pyo3(signature = (name, tars, *, mode = "new", shard_bytes = None, progress = None))]
    fn ingest_tars<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        tars: &Bound<'py, PyAny>,
        mode: &str,
        shard_bytes: Option<u64>,
        progress: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let inputs: Vec<String> = paths_of(tars)?.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        let paths = sources::expand_tar_inputs(&inputs).map_err(to_py)?;
        self.ingest_detached(py, name, Layout::Samples, options_of(mode, shard_bytes)?, progress, |ingest, report| {
            sources::samples_from_tars(ingest, &paths, report).map(drop)
        })
    }

    fn __repr__(&self) -> String {
        format!("granary.Store({:?})", self.root.display().to_string())
    }
}

impl Store {
    pub(crate) fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// `ingest_detached` for a source of rows (Parquet, an Arrow stream): what was committed,
    /// and `skipped`, the rows left out for a null.
    fn ingest_rows<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        layout: Layout,
        options: IngestOptions,
        progress: Option<Bound<'py, PyAny>>,
        source: impl FnOnce(&mut granary::Ingest<'_>, &Report) -> granary::Result<sources::RowsIngested> + Send,
    ) -> PyResult<Bound<'py, PyDict>> {
        let skipped = AtomicU64::new(0);
        let committed = self.ingest_detached(py, name, layout, options, progress, |ingest, report| {
            skipped.store(source(ingest, report)?.skipped, Ordering::Relaxed);
            Ok(())
        })?;
        committed.set_item("skipped", skipped.load(Ordering::Relaxed))?;
        Ok(committed)
    }

    /// Runs `source` into a new version of `name` with the GIL released, then commits it,
    /// unless the progress callable raised (which ends the ingest with nothing committed).
    fn ingest_detached<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        layout: Layout,
        options: IngestOptions,
        progress: Option<Bound<'py, PyAny>>,
        source: impl FnOnce(&mut granary::Ingest<'_>, &Report) -> granary::Result<()> + Send,
    ) -> PyResult<Bound<'py, PyDict>> {
        let name = DatasetName::new(name).map_err(to_py)?;
        let report = Report::new(name.as_str(), progress)?;
        let mut granary = engine(py, || Granary::open(&self.root))?;
        let ingest = engine(py, || {
            let mut ingest = granary.ingest(name, layout, options)?;
            source(&mut ingest, &report)?;
            Ok(ingest)
        })?;
        report.finish();
        report.check()?;
        let committed = engine(py, || ingest.commit())?;
        committed_dict(py, &committed, &report)
    }
}

/// What to do with a row holding a null: `"refuse"` or `"skip"`.
fn nulls_of(nulls: &str) -> PyResult<sources::Nulls> {
    match nulls {
        "refuse" => Ok(sources::Nulls::Refuse),
        "skip" => Ok(sources::Nulls::Skip),
        other => Err(invalid(format!("nulls={other:?}: expected 'refuse' or 'skip'"))),
    }
}

/// The layout for `dtype` and `shape`: both or neither.
fn layout_of(dtype: Option<&str>, shape: Option<Vec<u64>>) -> PyResult<Layout> {
    match (dtype, shape) {
        (None, None) => Ok(Layout::Bytes),
        (Some(dtype), shape) => {
            let parsed = Dtype::from_name(dtype)
                .ok_or_else(|| invalid(format!("unknown dtype {dtype:?} (u8, i8, u16, ..., f16, bf16, f32, f64)")))?;
            let shape = shape.ok_or_else(|| invalid("dtype needs shape (the dimensions of one record)"))?;
            FixedLayout::new(parsed, &shape).map(Layout::Fixed).map_err(|e| invalid(e.to_string()))
        }
        (None, Some(_)) => Err(invalid("shape needs dtype")),
    }
}

/// Ingest options from Python's `mode` (`"new"`, `"append"` or `"replace"`) and `shard_bytes`.
fn options_of(mode: &str, shard_bytes: Option<u64>) -> PyResult<IngestOptions> {
    let mode = match mode {
        "new" => IngestMode::New,
        "append" => IngestMode::Append,
        "replace" => IngestMode::Replace,
        other => return Err(invalid(format!("mode='{other}': expected 'new', 'append' or 'replace'"))),
    };
    let mut options = IngestOptions { mode, ..IngestOptions::default() };
    if let Some(bytes) = shard_bytes {
        options.shard_bytes_target = bytes;
    }
    Ok(options)
}

/// One path or a list of paths (`str` or `os.PathLike`).
fn paths_of(source: &Bound<'_, PyAny>) -> PyResult<Vec<PathBuf>> {
    if let Ok(path) = source.extract::<PathBuf>() {
        return Ok(vec![path]);
    }
    let mut paths = Vec::new();
    for item in source.try_iter().map_err(|_| invalid("expected a path or an iterable of paths"))? {
        paths.push(item?.extract::<PathBuf>().map_err(|_| os("expected a path (str or os.PathLike)"))?);
    }
    Ok(paths)
}

/// What an ingest returns: what was committed, and the input members it skipped (`source`,
/// `member`, `reason` each).
fn committed_dict<'py>(
    py: Python<'py>,
    committed: &granary::ingest::Committed,
    report: &Report,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("name", committed.name.as_str())?;
    out.set_item("version", committed.version)?;
    out.set_item("manifest", committed.manifest.to_string())?;
    out.set_item("records", committed.n_records)?;
    out.set_item("shards", committed.n_shards)?;
    // An unchanged ingest read its records but added none: the version is the current one.
    let (records_added, bytes_added) =
        if committed.unchanged { (0, 0) } else { (committed.stats.records, committed.stats.bytes) };
    out.set_item("records_added", records_added)?;
    out.set_item("bytes_added", bytes_added)?;
    out.set_item("shards_published", committed.stats.shards_published)?;
    out.set_item("shards_deduplicated", committed.stats.shards_deduplicated)?;
    out.set_item("unchanged", committed.unchanged)?;
    let skipped = PyList::empty(py);
    for (source, member, reason) in report.skipped.lock().iter() {
        let entry = PyDict::new(py);
        entry.set_item("source", source)?;
        entry.set_item("member", member)?;
        entry.set_item("reason", reason)?;
        skipped.append(entry)?;
    }
    out.set_item("skipped", skipped)?;
    Ok(out)
}

/// Progress of an ingest, reported to stderr or to a Python callable at most every half second.
struct Report {
    name: String,
    sink: Sink,
    total: AtomicU64,
    done: AtomicU64,
    records: AtomicU64,
    last: Mutex<Option<Instant>>,
    /// The first exception the callable raised; the ingest fails with it.
    failed: Mutex<Option<PyErr>>,
    /// Input members not ingested (links, devices in a tar): source, member, why.
    skipped: Mutex<Vec<(String, String, String)>>,
}

enum Sink {
    None,
    Stderr,
    Call(Py<PyAny>),
}

impl Report {
    fn new(name: &str, progress: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        let sink = match progress {
            None => Sink::None,
            Some(p) if p.is_none() => Sink::None,
            Some(p) if p.is_callable() => Sink::Call(p.unbind()),
            Some(p) => {
                if p.is_truthy()? {
                    Sink::Stderr
                } else {
                    Sink::None
                }
            }
        };
        Ok(Self {
            name: name.to_owned(),
            sink,
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            records: AtomicU64::new(0),
            last: Mutex::new(None),
            failed: Mutex::new(None),
            skipped: Mutex::new(Vec::new()),
        })
    }

    fn report(&self, last: bool) {
        let (done, total) = (self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed));
        match &self.sink {
            Sink::None => {}
            Sink::Stderr => {
                let share =
                    if total > 0 { format!(" {:.0}%", 100.0 * done as f64 / total as f64) } else { String::new() };
                let records = self.records.load(Ordering::Relaxed);
                let records = if records > 0 { format!(", {records} records") } else { String::new() };
                eprint!(
                    "\ringest {}:{share} {:.1} MB{records}{}",
                    self.name,
                    done as f64 / 1e6,
                    if last { "\n" } else { "" }
                );
            }
            Sink::Call(callable) => Python::attach(|py| {
                let mut failed = self.failed.lock();
                if failed.is_none()
                    && let Err(e) = callable.call1(py, (self.records.load(Ordering::Relaxed), done))
                {
                    *failed = Some(e);
                }
            }),
        }
    }

    fn finish(&self) {
        if self.done.load(Ordering::Relaxed) > 0 || self.records.load(Ordering::Relaxed) > 0 {
            self.report(true);
        }
    }

    /// Raises what the callable raised, if it did.
    fn check(&self) -> PyResult<()> {
        match self.failed.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Progress for Report {
    fn skipped(&self, source: &std::path::Path, member: &str, reason: &str) {
        self.skipped.lock().push((source.display().to_string(), member.to_owned(), reason.to_owned()));
    }

    fn start(&self, total_bytes: u64) {
        self.total.store(total_bytes, Ordering::Relaxed);
    }

    fn advance(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
        let mut last = self.last.lock();
        let now = Instant::now();
        if last.is_none_or(|at| now.duration_since(at) >= PROGRESS_EVERY) {
            *last = Some(now);
            drop(last);
            self.report(false);
        }
    }
}
