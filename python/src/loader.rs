//! `Loader`: one rank's batches, one epoch per iteration, resumable at the exact position.
//!
//! The engine loader (threads, staging pool, CUDA stream) is started lazily by the first batch
//! asked for, in the process that asks: a `Loader` made before a fork and first iterated after
//! it works in the child (to host memory, or to a GPU if the parent had not initialised CUDA;
//! if it had, loading to the GPU in the child is an error that says so). Once started, it runs on across epoch ends (so the next epoch's first
//! batches are read while the trainer finishes this one) and is restarted only when the
//! position is moved (`load_state_dict`, `set_epoch`). Using a started loader in a forked child
//! is a `ForkError`; the child never drops the parent's engine loader (it leaks the copy).
//!
//! Owns the Python `Loader`: its arguments turned into the engine's `Session` (which owns what
//! is read, the position, epochs, `drop_last`, mixtures and packing), and the conversions of
//! what the session hands out. The batch it hands out is `batch.rs`'s, the ranks' exchange for
//! rebalancing `exchange.rs`'s. Never: decides what a batch holds or where a position is (the
//! session does), holds the GIL while it waits for a batch, or drops a forked parent's engine
//! loader.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyDict;

use granary::loader::{MeasureExchange, Packing, RebalanceConfig, Session, SessionConfig};
use granary::staging::cuda::Cuda;
use granary::{LoaderConfig, Position, StorePaths, World};
use pyo3::types::PyBytes;

use crate::batch::{NativeBatch, layout_name, widening};
use crate::errors::{engine, forked, invalid, to_py};
use crate::exchange::PyExchange;
use crate::loader_args::{backend_of, plan_of, target_of, tier_of};
use crate::metrics::metrics_dict;
use crate::source::{SourceArgs, mixture_dict, packed_dict, reads_of};
use crate::store::Store;

/// Whether this process can load to a GPU, and if not, why: `(True, "N CUDA devices")` or
/// `(False, reason)`.
#[pyfunction]
pub(crate) fn cuda_available(py: Python<'_>) -> (bool, String) {
    // Counting devices does not choose one: a loader may still ask for any.
    py.detach(|| match Cuda::device_count() {
        Ok(0) => (false, "the CUDA driver sees no device".to_owned()),
        Ok(n) => (true, format!("{n} CUDA device{}", if n == 1 { "" } else { "s" })),
        Err(reason) => (false, reason),
    })
}

/// The engine loader of one rank (see the module documentation).
#[pyclass(module = "granary._native")]
pub(crate) struct Loader {
    /// The process whose threads run the engine loader; 0 while none runs.
    started_in: AtomicU32,
    session: Mutex<Session>,
}

/// The `granary serve` beside the store at `root`, as the loader's repair hook (Rust's
/// `LoaderConfig::repair`): when `GRANARY_CLUSTER_KEY` is set and a node records where it
/// listens there (`replication/listen`). For an attached dataset the engine puts it behind the
/// origin cache, which asks it before the origin.
fn node_beside(root: &std::path::Path) -> granary::Result<Option<Arc<dyn granary::read::ShardSource>>> {
    // No node serving this store: reads go without a hook, as before.
    let client = granary::replication::NodeClient::beside(root)?;
    Ok(client.map(|client| Arc::new(client) as Arc<dyn granary::read::ShardSource>))
}

#[pymethods]
impl Loader {
    /// See `granary.Loader` for the arguments.
    #[new]
    #[pyo3(signature = (
        store, dataset, batch_size, *, mixture_samples = None, mixture_pass_of = None, mixture_changes = None, seq_len = None, eod = None, pad = 0,
        within_documents = false, seed = 0, epoch = 0, rank = 0, world_size = 1, device = None,
        prefetch = 4, read_depth = 2, hold = 4, order = None, partitioner = None,
        partitioner_options = None, io = None, drop_last = false, tier = None, tier_bytes = None,
        tier_evictor = None, tier_evictor_options = None, local_world_size = None, verify_threads = None,
        rebalance_every = None, rebalance_exchange = None, partitioner_fallback = true,
    ))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn new(
        store: &Bound<'_, PyAny>,
        dataset: &Bound<'_, PyAny>,
        batch_size: u64,
        mixture_samples: Option<u64>,
        mixture_pass_of: Option<usize>,
        mixture_changes: Option<Vec<(u64, u64, Vec<f64>)>>,
        seq_len: Option<u64>,
        eod: Option<u64>,
        pad: u64,
        within_documents: bool,
        seed: u64,
        epoch: u64,
        rank: u32,
        world_size: u32,
        device: Option<&str>,
        prefetch: usize,
        read_depth: usize,
        hold: usize,
        order: Option<&str>,
        partitioner: Option<String>,
        partitioner_options: Option<Vec<(String, String)>>,
        io: Option<&str>,
        drop_last: bool,
        tier: Option<&str>,
        tier_bytes: Option<u64>,
        tier_evictor: Option<String>,
        tier_evictor_options: Option<Vec<(String, String)>>,
        local_world_size: Option<u32>,
        verify_threads: Option<usize>,
        rebalance_every: Option<u64>,
        rebalance_exchange: Option<Py<PyAny>>,
        partitioner_fallback: bool,
    ) -> PyResult<Self> {
        let root = match store.cast::<Store>() {
            Ok(store) => store.get().root().to_path_buf(),
            Err(_) => store.extract::<PathBuf>().map_err(|_| invalid("store is a granary.Store or a path"))?,
        };
        let args =
            SourceArgs { mixture_samples, mixture_pass_of, mixture_changes, seq_len, eod, pad, within_documents };
        let (reads, pack) = reads_of(&StorePaths::new(&root), dataset, args)?;
        let world = World::new(rank, world_size)
            .ok_or_else(|| invalid(format!("rank {rank} is not in a world of {world_size}")))?;
        let (target, device) = target_of(device)?;
        let mut loader = LoaderConfig {
            batch_size,
            world,
            seed,
            partitioner_fallback,
            read_depth,
            prefetch,
            hold_max: hold,
            target,
            tier: tier_of(tier, tier_bytes, tier_evictor, tier_evictor_options)?,
            local_world_size,
            verify_threads,
            // A damaged or missing shard is fetched from a peer (or rebuilt from fragments) by
            // the node serving this store, as `granary get --cluster-key` does.
            repair: node_beside(&root).map_err(to_py)?,
            rebalance: rebalance_every.map(|every| {
                let exchange =
                    rebalance_exchange.map(|callable| Arc::new(PyExchange { callable }) as Arc<dyn MeasureExchange>);
                RebalanceConfig::every(every, exchange)
            }),
            ..LoaderConfig::default()
        };
        loader.io.backend = backend_of(io)?;
        let plan = plan_of(order, partitioner, partitioner_options)?;
        let config = SessionConfig { reads, plan, pack, drop_last, device, epoch, loader };
        let session = Session::new(root, config).map_err(refused)?;
        Ok(Self { started_in: AtomicU32::new(0), session: Mutex::new(session) })
    }

    /// Starts an iteration over the rest of the current epoch (the next one if the current one
    /// was read to its end).
    fn begin_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.lock(py)?.begin_epoch())
    }

    /// The next batch of the epoch being iterated, or `None` at its end. Waits with the GIL
    /// released.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Option<NativeBatch>> {
        let mut session = self.lock(py)?;
        let running = &mut *session;
        let next = engine(py, || running.next_records());
        self.after(&session);
        let Some(batch) = next? else { return Ok(None) };
        let dataset = session.dataset().map_err(to_py)?;
        NativeBatch::new(batch, &dataset, session.device()).map(Some)
    }

    /// The next batch of packed windows of the epoch being iterated, or `None` at its end: a
    /// dict of `tokens` (bytes of `windows x width` tokens of `dtype`), `cu_seqlens` and
    /// `position_ids` (bytes of little-endian int32), `real_tokens` (a list), `windows` (the
    /// count), `width` (seq_len + 1), `dtype` (NumPy's type string), `first_window`.
    fn next_packed<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut session = self.lock(py)?;
        let packed = packed_next(py, &mut session);
        self.after(&session);
        packed
    }

    /// The windows of an epoch, when packing: `None` otherwise.
    #[getter]
    fn pack_windows(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(self.lock(py)?.packing().map_err(to_py)?.map(Packing::n_windows))
    }

    /// Makes `epoch` the one the next iteration reads (as `DistributedSampler.set_epoch`):
    /// from its start, unless the loader is already inside it (resumed there, say), in which
    /// case it goes on from where it is.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        let mut session = self.lock(py)?;
        session.set_epoch(epoch);
        self.after(&session);
        Ok(())
    }

    /// The trainer's own time on the last batch (seconds), for rebalancing: see
    /// `granary.Loader.report_busy`.
    fn report_busy(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(invalid(format!("report_busy takes seconds of 0 or more, not {seconds}")));
        }
        self.lock(py)?.report_busy(std::time::Duration::from_secs_f64(seconds));
        Ok(())
    }

    /// Moves to `(epoch, cursor)`: the next batch is the one after that position.
    fn seek(&self, py: Python<'_>, epoch: u64, cursor: u64) -> PyResult<()> {
        let mut session = self.lock(py)?;
        let moved = session.seek(Position { epoch, cursor }).map_err(refused);
        self.after(&session);
        moved
    }

    /// `(epoch, cursor)` after the last batch handed out: the cursor counts the epoch's
    /// records consumed by all ranks together.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let position = self.lock(py)?.position();
        Ok((position.epoch, position.cursor))
    }

    /// The partitioner options this loader reads with (`Session::plan_options`): `None` for a
    /// native order.
    #[getter]
    fn plan_options(&self, py: Python<'_>) -> PyResult<Option<Vec<(String, String)>>> {
        self.lock(py)?.plan_options().map_err(to_py)
    }

    /// The largest shard file of the dataset version, in bytes (what a cache must hold per
    /// shard of a window).
    #[getter]
    fn shard_bytes_max(&self, py: Python<'_>) -> PyResult<u64> {
        let dataset = self.lock(py)?.dataset().map_err(to_py)?;
        Ok(dataset.manifest().entries().iter().map(|e| e.file_bytes).max().unwrap_or(0))
    }

    /// The mixture read (`None` for one dataset): `id` (its identity: the versions, weights and
    /// changes, the epoch's length), `sources` (each `label`, `manifest`, `records`, `weight`),
    /// `epoch_samples`, `changes` (`(epoch, cursor, weights)` each, the first at (0, 0)).
    #[getter]
    fn mixture<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut session = self.lock(py)?;
        session.mixture().map_err(to_py)?.map(|mixture| mixture_dict(py, mixture)).transpose()
    }

    /// The state to resume from (`granary.Loader.state_dict`): the engine's `SavedState` as a
    /// dict, with its digest.
    fn saved_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut session = self.lock(py)?;
        let saved = session.save().map_err(to_py)?;
        let mixture = session.mixture().map_err(to_py)?.map(|mixture| mixture_dict(py, mixture)).transpose()?;
        crate::state::state_dict(py, &saved, mixture)
    }

    /// Resumes at a saved state (`granary.Loader.load_state_dict`); refused whole (`ValueError`,
    /// the loader unchanged) when the engine finds it altered or of another order.
    fn resume(&self, py: Python<'_>, state: Bound<'_, PyDict>) -> PyResult<()> {
        let saved = crate::state::state_from_dict(&state)?;
        let mut session = self.lock(py)?;
        let resumed = session.resume(&saved).map_err(refused);
        self.after(&session);
        resumed
    }

    /// Changes the mixture's weights from the current position on (a curriculum's step): the
    /// change is recorded in the state, so a resume repeats it.
    fn change_weights(&self, py: Python<'_>, weights: Vec<f64>) -> PyResult<()> {
        let mut session = self.lock(py)?;
        let changed = session.change_weights(weights).map_err(to_py);
        self.after(&session);
        changed
    }

    /// Records in the dataset version.
    #[getter]
    fn records(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.lock(py)?.dataset().map_err(to_py)?.n_records())
    }

    /// How the dataset's records are laid out: `"fixed"` (arrays of one dtype and shape),
    /// `"bytes"` (byte strings), `"arrays"` (arrays of one dtype, of any length) or `"samples"`
    /// (WebDataset samples).
    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(layout_name(self.lock(py)?.dataset().map_err(to_py)?.layout()))
    }

    /// Loads to host memory instead of the GPU chosen by default (WebDataset samples are
    /// decoded on the host), before the first batch.
    fn load_to_host(&self, py: Python<'_>) -> PyResult<()> {
        self.lock(py)?.load_to_host().map_err(refused)
    }

    /// Refuses, now rather than at the first batch, a GPU this process cannot use.
    fn check_device(&self, py: Python<'_>) -> PyResult<()> {
        let Some(ordinal) = self.lock(py)?.device() else { return Ok(()) };
        let count = py.detach(Cuda::device_count).map_err(|reason| to_py(granary::Error::NoGpu { detail: reason }))?;
        if ordinal >= count {
            return Err(to_py(granary::Error::NoGpu {
                detail: format!(
                    "device cuda:{ordinal} does not exist: the CUDA driver sees {count} device{}",
                    if count == 1 { "" } else { "s" }
                ),
            }));
        }
        Ok(())
    }

    /// Refuses a `dtype=` the dataset's records cannot be widened to without loss.
    fn check_dtype(&self, py: Python<'_>, dtype: &str) -> PyResult<()> {
        widening(self.lock(py)?.dataset().map_err(to_py)?.layout(), dtype).map(|_| ())
    }

    /// Batches the current iteration yields from its start (the next iteration's, between
    /// two): a whole epoch, or after a resume mid-epoch what is left of it.
    fn batches_in_iteration(&self, py: Python<'_>) -> PyResult<u64> {
        self.lock(py)?.batches_in_iteration().map_err(to_py)
    }

    /// Batches this rank reads per epoch.
    fn batches_per_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        self.lock(py)?.batches_per_epoch().map_err(to_py)
    }

    /// The loader's counters since it was made (see `granary.Loader.metrics`).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let session = self.lock(py)?;
        metrics_dict(py, &session.stats(), &session.start_stages(), session.tier_stats())
    }

    /// Where batches go: `"cpu"` or `"cuda:N"` (known once the first batch was asked for).
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let session = self.lock(py)?;
        Ok(match (session.loader(), session.device()) {
            (Some(loader), _) => Some(match loader.device() {
                Some(_) => format!("cuda:{}", Cuda::get().map_or(0, Cuda::ordinal)),
                None => "cpu".to_owned(),
            }),
            (None, Some(ordinal)) => Some(format!("cuda:{ordinal}")),
            (None, None) => None,
        })
    }

    /// Reads up to `batches` batches of the epoch being iterated entirely in Rust, dropping
    /// each at once, with the GIL released: the engine loader's own rate, which benchmarks
    /// compare the Python iteration with (same build, same data). Returns `(batches, records,
    /// bytes, seconds)`.
    fn drain(&self, py: Python<'_>, batches: u64) -> PyResult<(u64, u64, u64, f64)> {
        let mut session = self.lock(py)?;
        let running = &mut *session;
        let drained = engine(py, || running.drain(batches));
        self.after(&session);
        drained
    }

    /// Stops the engine loader's threads now (the next batch asked for starts them again).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut session = self.lock(py)?;
        session.stop();
        self.after(&session);
        Ok(())
    }
}

impl Loader {
    /// The session, waited for with the GIL released: another thread may hold it while it
    /// waits for a batch without the GIL, and needs the GIL back to let go of it.
    fn lock(&self, py: Python<'_>) -> PyResult<parking_lot::MutexGuard<'_, Session>> {
        let started_in = self.started_in.load(Ordering::Acquire);
        if started_in != 0 && started_in != std::process::id() {
            return Err(forked("granary.Loader", started_in));
        }
        Ok(self.session.lock_py_attached(py))
    }

    /// Records which process runs the session's loader (none: 0), after a call that may have
    /// started or stopped it.
    fn after(&self, session: &Session) {
        self.started_in.store(session.started_in().unwrap_or(0), Ordering::Release);
    }
}

/// The session's next packed batch as `Loader.next_packed` hands it out: the windows cut
/// straight into the bytes Python gets (no second copy).
fn packed_next<'py>(py: Python<'py>, session: &mut Session) -> PyResult<Option<Bound<'py, PyDict>>> {
    let layout = session.dataset().map_err(to_py)?.layout().clone();
    let Some(step) = engine(py, || session.next_packed())? else { return Ok(None) };
    let len = step.tokens_bytes();
    let mut step = Some(step);
    let mut packed = None;
    let tokens = PyBytes::new_with(py, len, |buf| {
        if let Some(step) = step.take() {
            packed = Some(step.pack_into(buf).map_err(to_py)?);
        }
        Ok(())
    })?;
    let packed = packed.ok_or_else(|| invalid("no windows packed"))?;
    let packing = session.packing().map_err(to_py)?.ok_or_else(|| invalid("no packing"))?;
    packed_dict(py, &packed, tokens, packing, &layout).map(Some)
}

/// A refusal of what the caller gave (the engine's `InvalidInput`) as Python's `ValueError`;
/// any other error as the engine's.
fn refused(error: granary::Error) -> PyErr {
    match error {
        granary::Error::InvalidInput { .. } => invalid(error.to_string()),
        other => to_py(other),
    }
}
