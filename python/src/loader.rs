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
//! Owns the Python `Loader` (its arguments, state, iteration, `state_dict` and metrics). The
//! batch it hands out is `batch.rs`'s, the ranks' exchange for rebalancing `exchange.rs`'s, the
//! epoch's cut the engine's (`plan::RankCut`). Never: holds the GIL while it waits for a batch,
//! or drops a forked parent's engine loader.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyDict;

use granary::loader::{MeasureExchange, Packer, Packing, RebalanceConfig};
use granary::plan::RankCut;
use granary::staging::cuda::Cuda;
use granary::{Dataset, LoaderConfig, LoaderStats, Order, PlanSource, Position, TierSetting, World};

use crate::batch::{NativeBatch, layout_name, widening};
use crate::errors::{engine, forked, invalid, to_py};
use crate::exchange::{PyExchange, rebalance_dict, rebalance_from_dict};
use crate::loader_args::{backend_of, plan_of, target_of, tier_of};
use crate::source::{Source, SourceArgs, packed_dict};
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
    state: Mutex<State>,
}

struct State {
    /// What it reads (one version or a mixture, records or packed windows), once opened.
    source: Source,
    /// The windows of the running loader's batches.
    packer: Option<Packer>,
    config: LoaderConfig,
    /// The CUDA device batches go to, when they go to one.
    device: Option<u32>,
    /// Stop each epoch before its short last step, so every rank reads as many batches.
    drop_last: bool,
    /// The plan is the default shuffle, not asked for by name: an attached dataset that its
    /// store's cache cannot hold reads the default partitioner's windowed plan instead
    /// (decided once, by `plan_options`).
    windowable: bool,
    /// After the last batch handed out; an epoch's end is the next epoch's start.
    position: Position,
    /// The epoch the current iteration covers.
    iterating: u64,
    /// Where the current (or next) iteration starts: `len()` counts the batches from here.
    len_from: Position,
    running: Option<Running>,
    /// Counters of engine loaders already stopped (a restart starts new ones).
    before: LoaderStats,
    /// The rank weights of the last batch handed out (rebalancing): the short last step of an
    /// epoch is split by them.
    weights: Option<Vec<u32>>,
}

/// An engine loader and the process that started its threads.
struct Running {
    loader: Option<granary::Loader>,
    pid: u32,
}

impl Running {
    fn loader(&mut self) -> &mut granary::Loader {
        self.loader.as_mut().expect("taken only in drop")
    }

    fn stats(&self) -> LoaderStats {
        self.loader.as_ref().map(granary::Loader::stats).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(loader) = self.loader.take()
            && self.pid != std::process::id()
        {
            // A fork's copy: its threads are the parent's, and joining them here would wait
            // forever. The copy is leaked.
            std::mem::forget(loader);
        }
    }
}

impl State {
    /// Stops the engine loader, keeping its counters and, when it rebalances, its weights (the
    /// next engine loader resumes with them).
    fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            self.before += &running.stats();
            let resumed = running.loader.as_ref().and_then(granary::Loader::rebalance_state);
            if let (Some(rebalance), Some(resumed)) = (&mut self.config.rebalance, resumed) {
                rebalance.resume = Some(resumed);
            }
        }
    }

    fn dataset(&mut self) -> granary::Result<Arc<Dataset>> {
        self.source.open(&mut self.config)
    }

    /// Replaces the mixture's changes of weights.
    fn set_changes(&mut self, new: Vec<(Position, Vec<f64>)>) -> granary::Result<()> {
        self.source.set_changes(&mut self.config, new)
    }

    /// How this rank's epochs are cut.
    fn cut(&mut self) -> granary::Result<RankCut> {
        Ok(RankCut {
            n_records: {
                let dataset = self.dataset()?;
                self.config.plan.epoch_len(&dataset)
            },
            world: self.config.world,
            batch_size: self.config.batch_size,
            drop_last: self.drop_last,
            weights: self.weights.clone(),
        })
    }

    fn normalized(&mut self, position: Position) -> granary::Result<Position> {
        Ok(self.cut()?.normalized(position))
    }
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
        let source = Source::parse(
            root.clone(),
            dataset,
            SourceArgs {
                mixture_samples,
                mixture_pass_of,
                mixture_changes,
                seq_len,
                eod,
                pad,
                within_documents,
                order,
                partitioner_given: partitioner.is_some() || partitioner_options.is_some(),
                rebalance_given: rebalance_every.is_some(),
                device,
            },
        )?;
        let is_mixture = source.is_mixture();
        if batch_size == 0 {
            return Err(invalid("batch_size must be at least 1"));
        }
        let world = World::new(rank, world_size)
            .ok_or_else(|| invalid(format!("rank {rank} is not in a world of {world_size}")))?;
        let (target, device) = target_of(device)?;
        let plan = plan_of(order, partitioner, partitioner_options)?;
        // No order and no partitioner: shuffled, windowed to the cache for an attached
        // dataset it cannot hold (see `plan_options`).
        let windowable = !is_mixture
            && !source.is_packed()
            && order.is_none()
            && matches!(plan, PlanSource::Native(Order::Shuffled));
        let mut config = LoaderConfig {
            batch_size,
            world,
            seed,
            plan,
            partitioner_fallback,
            epochs: None,
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
        if let Some(rebalance) = &config.rebalance {
            // Refused here rather than at the first batch.
            rebalance.check(world.size()).map_err(to_py)?;
        }
        config.io.backend = backend_of(io)?;
        Ok(Self {
            started_in: AtomicU32::new(0),
            state: Mutex::new(State {
                source,
                packer: None,
                config,
                device,
                drop_last,
                windowable,
                position: Position { epoch, cursor: 0 },
                iterating: epoch,
                len_from: Position { epoch, cursor: 0 },
                running: None,
                before: LoaderStats::default(),
                weights: None,
            }),
        })
    }

    /// Starts an iteration over the rest of the current epoch (the next one if the current one
    /// was read to its end).
    fn begin_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        let mut state = self.lock(py)?;
        let position = state.position;
        state.iterating = position.epoch;
        state.len_from = position;
        Ok(position.epoch)
    }

    /// The next batch of the epoch being iterated, or `None` at its end. Waits with the GIL
    /// released.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Option<NativeBatch>> {
        let mut state = self.lock(py)?;
        if state.source.is_packed() {
            return Err(invalid("a loader of packed windows hands them out through next_packed"));
        }
        let Some(batch) = self.next_loaded(py, &mut state)? else { return Ok(None) };
        let dataset = state.dataset().map_err(to_py)?;
        NativeBatch::new(batch, &dataset, state.device).map(Some)
    }

    /// The next batch of packed windows of the epoch being iterated, or `None` at its end: a
    /// dict of `tokens` (bytes of `windows x width` tokens of `dtype`), `cu_seqlens` and
    /// `position_ids` (bytes of little-endian int32), `real_tokens` (a list), `windows` (the
    /// count), `width` (seq_len + 1), `dtype` (NumPy's type string), `first_window`.
    fn next_packed<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut state = self.lock(py)?;
        if !state.source.is_packed() {
            return Err(invalid("this loader does not pack: give seq_len"));
        }
        let Some(batch) = self.next_loaded(py, &mut state)? else { return Ok(None) };
        let packer = state.packer.as_mut().ok_or_else(|| invalid("the packer starts with the loader"))?;
        let windows = packer.step(&batch);
        let len = packer.packing().tokens_bytes(windows.end - windows.start);
        // The windows are cut straight into the bytes Python gets: no second copy.
        let mut packed = None;
        let tokens = pyo3::types::PyBytes::new_with(py, len, |buf| {
            packed = Some(packer.pack_into(&batch, buf).map_err(to_py)?);
            Ok(())
        })?;
        let packed = packed.ok_or_else(|| invalid("no windows packed"))?;
        drop(batch);
        let layout = state.dataset().map_err(to_py)?.layout().clone();
        let packing = state.source.packing().ok_or_else(|| invalid("no packing"))?;
        packed_dict(py, &packed, tokens, packing, &layout).map(Some)
    }

    /// The windows of an epoch, when packing: `None` otherwise.
    #[getter]
    fn pack_windows(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let mut state = self.lock(py)?;
        state.dataset().map_err(to_py)?;
        Ok(state.source.packing().map(Packing::n_windows))
    }

    /// Makes `epoch` the one the next iteration reads (as `DistributedSampler.set_epoch`):
    /// from its start, unless the loader is already inside it (resumed there, say), in which
    /// case it goes on from where it is.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        let mut state = self.lock(py)?;
        if state.position.epoch != epoch {
            self.move_to(&mut state, Position { epoch, cursor: 0 });
        }
        state.iterating = epoch;
        state.len_from = state.position;
        Ok(())
    }

    /// The trainer's own time on the last batch (seconds), for rebalancing: see
    /// `granary.Loader.report_busy`.
    fn report_busy(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(invalid(format!("report_busy takes seconds of 0 or more, not {seconds}")));
        }
        let mut state = self.lock(py)?;
        if let Some(running) = &mut state.running {
            running.loader().report_busy(std::time::Duration::from_secs_f64(seconds));
        }
        Ok(())
    }

    /// The rebalancing state to save with the position (see `granary.Loader.state_dict`):
    /// `None` without rebalancing.
    fn rebalance_state<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let state = self.lock(py)?;
        let from_loader =
            state.running.as_ref().and_then(|r| r.loader.as_ref()).and_then(granary::Loader::rebalance_state);
        let Some(saved) = from_loader.or_else(|| state.config.rebalance.as_ref().and_then(|r| r.resume.clone())) else {
            return Ok(None);
        };
        rebalance_dict(py, &saved).map(Some)
    }

    /// Resumes the rebalancing from a saved state (`rebalance_state`'s dict, or `None` for
    /// equal weights); applies from the next batch (the engine loader restarts).
    fn set_rebalance_state(&self, py: Python<'_>, saved: Option<Bound<'_, PyDict>>) -> PyResult<()> {
        let mut state = self.lock(py)?;
        if state.config.rebalance.is_none() {
            return Ok(());
        }
        let resume = match saved {
            None => None,
            Some(saved) => Some(rebalance_from_dict(&saved)?),
        };
        state.stop();
        self.started_in.store(0, Ordering::Release);
        // The split the engine will cut the steps with (its bounds applied), so that the short
        // last step is placed as the engine places it.
        let (world, batch) = (state.config.world.size(), state.config.batch_size);
        state.weights = resume
            .as_ref()
            .and_then(|r| granary::plan::rebalanced_step(&r.weights.weights, world, batch))
            .or_else(|| granary::plan::rebalanced_step(&vec![1; world as usize], world, batch));
        if let Some(rebalance) = &mut state.config.rebalance {
            rebalance.resume = resume;
        }
        Ok(())
    }

    /// Moves to `(epoch, cursor)`: the next batch is the one after that position.
    fn seek(&self, py: Python<'_>, epoch: u64, cursor: u64) -> PyResult<()> {
        let mut state = self.lock(py)?;
        let cut = state.cut().map_err(to_py)?;
        let position = cut.normalized(cut.check(Position { epoch, cursor }).map_err(invalid)?);
        self.move_to(&mut state, position);
        state.iterating = position.epoch;
        state.len_from = position;
        Ok(())
    }

    /// `(epoch, cursor)` after the last batch handed out: the cursor counts the epoch's
    /// records consumed by all ranks together.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let state = self.lock(py)?;
        Ok((state.position.epoch, state.position.cursor))
    }

    /// The partitioner options this loader reads with: the ones given, and the window an
    /// attached dataset's cache asks for (fixed from now on, so a state saved here names the
    /// order it follows); `None` for a native order. Without an order or a partitioner given,
    /// an attached dataset the cache cannot hold reads the default partitioner's windowed plan
    /// (decided here, once) instead of the native shuffle.
    #[getter]
    fn plan_options(&self, py: Python<'_>) -> PyResult<Option<Vec<(String, String)>>> {
        let mut state = self.lock(py)?;
        let dataset = state.dataset().map_err(to_py)?;
        if std::mem::take(&mut state.windowable) {
            let default = PlanSource::Partitioner { plugin: None, options: Vec::new() };
            let windowed = granary::loader::plan_for_store(&dataset, default).map_err(to_py)?;
            if matches!(&windowed, PlanSource::Partitioner { options, .. } if !options.is_empty()) {
                state.config.plan = windowed;
            }
        }
        let plan = granary::loader::plan_for_store(&dataset, state.config.plan.clone()).map_err(to_py)?;
        state.config.plan = plan.clone();
        Ok(match plan {
            PlanSource::Partitioner { options, .. } => Some(options),
            PlanSource::Native(_) | PlanSource::Mixture(_) | PlanSource::Packed(..) | PlanSource::PackedMixture(_) => {
                None
            }
        })
    }

    /// The largest shard file of the dataset version, in bytes (what a cache must hold per
    /// shard of a window).
    #[getter]
    fn shard_bytes_max(&self, py: Python<'_>) -> PyResult<u64> {
        let mut state = self.lock(py)?;
        Ok(state.dataset().map_err(to_py)?.manifest().entries().iter().map(|e| e.file_bytes).max().unwrap_or(0))
    }

    /// The manifest id of the dataset version being read.
    #[getter]
    fn manifest(&self, py: Python<'_>) -> PyResult<String> {
        let mut state = self.lock(py)?;
        Ok(state.dataset().map_err(to_py)?.manifest_id().to_string())
    }

    /// The mixture read (`None` for one dataset): `id` (its identity: the versions, weights and
    /// changes, the epoch's length), `sources` (each `label`, `manifest`, `records`, `weight`),
    /// `epoch_samples`, `changes` (`(epoch, cursor, weights)` each, the first at (0, 0)).
    #[getter]
    fn mixture<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut state = self.lock(py)?;
        state.dataset().map_err(to_py)?;
        state.source.mixture_dict(py)
    }

    /// Puts the mixture's changes of weights (`(epoch, cursor, weights)` each) in force, as a
    /// saved state records them; applies from the next batch (the engine loader restarts).
    fn set_mixture_changes(&self, py: Python<'_>, changes: Vec<(u64, u64, Vec<f64>)>) -> PyResult<()> {
        let mut state = self.lock(py)?;
        let changes =
            changes.into_iter().map(|(epoch, cursor, weights)| (Position { epoch, cursor }, weights)).collect();
        state.stop();
        self.started_in.store(0, Ordering::Release);
        state.set_changes(changes).map_err(to_py)
    }

    /// Changes the mixture's weights from the current position on (a curriculum's step): the
    /// change is recorded in the state, so a resume repeats it.
    fn change_weights(&self, py: Python<'_>, weights: Vec<f64>) -> PyResult<()> {
        let mut state = self.lock(py)?;
        let position = state.position;
        let at = state.normalized(position).map_err(to_py)?;
        let mut changes = state
            .source
            .changes()
            .ok_or_else(|| invalid("weights change in a mixture; this loader reads one dataset"))?;
        changes.retain(|(when, _)| (when.epoch, when.cursor) < (at.epoch, at.cursor));
        changes.push((at, weights));
        state.stop();
        self.started_in.store(0, Ordering::Release);
        state.set_changes(changes).map_err(to_py)?;
        state.position = at;
        Ok(())
    }

    /// Records in the dataset version.
    #[getter]
    fn records(&self, py: Python<'_>) -> PyResult<u64> {
        let mut state = self.lock(py)?;
        Ok(state.dataset().map_err(to_py)?.n_records())
    }

    /// How the dataset's records are laid out: `"fixed"` (arrays of one dtype and shape),
    /// `"bytes"` (byte strings), `"arrays"` (arrays of one dtype, of any length) or `"samples"`
    /// (WebDataset samples).
    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<&'static str> {
        let mut state = self.lock(py)?;
        Ok(layout_name(state.dataset().map_err(to_py)?.layout()))
    }

    /// Refuses, now rather than at the first batch, a GPU this process cannot use.
    fn check_device(&self, py: Python<'_>) -> PyResult<()> {
        let Some(ordinal) = self.lock(py)?.device else { return Ok(()) };
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
        let mut state = self.lock(py)?;
        widening(state.dataset().map_err(to_py)?.layout(), dtype).map(|_| ())
    }

    /// Batches the current iteration yields from its start (the next iteration's, between
    /// two): a whole epoch, or after a resume mid-epoch what is left of it.
    fn batches_in_iteration(&self, py: Python<'_>) -> PyResult<u64> {
        let mut state = self.lock(py)?;
        let cut = state.cut().map_err(to_py)?;
        let from = cut.normalized(state.len_from);
        Ok(cut.batches_from(from.cursor))
    }

    /// Batches this rank reads per epoch.
    fn batches_per_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.lock(py)?.cut().map_err(to_py)?.batches_per_epoch())
    }

    /// The loader's counters since it was made (see `granary.Loader.metrics`).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = self.lock(py)?;
        let mut stats = state.before;
        if let Some(running) = &state.running {
            stats += &running.stats();
        }
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
        let start = PyDict::new(py);
        if let Some(loader) = state.running.as_ref().and_then(|running| running.loader.as_ref()) {
            for (stage, at) in loader.start_stages() {
                start.set_item(stage.name(), at.as_secs_f64())?;
            }
        }
        out.set_item("start", start)?;
        let hit = if stats.batches == 0 { 0.0 } else { stats.ready as f64 / stats.batches as f64 };
        out.set_item("cache_hit_ratio", hit)?;
        out.set_item("bytes_read", stats.read.bytes_read)?;
        // Blocks checked by the reads from disk and by the fills of this loader's memory tier.
        let tier = state.config.tier.clone();
        let tier_stats = match &tier {
            TierSetting::Shared(tier) => Some(tier.stats()),
            _ => None,
        };
        let filled = tier_stats.map_or(0, |t| t.bytes_loaded / 4096);
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
        if let Some(held) = tier_stats {
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

    /// Where batches go: `"cpu"` or `"cuda:N"` (known once the first batch was asked for).
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let state = self.lock(py)?;
        Ok(match (&state.running, state.device) {
            (Some(running), _) => Some(match running.loader.as_ref().and_then(granary::Loader::device) {
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
        let mut state = self.lock(py)?;
        let mut cut = state.cut().map_err(to_py)?;
        let iterating = state.iterating;
        if cut.batches_per_epoch() == 0 {
            state.position = Position { epoch: iterating + 1, cursor: 0 };
            return Ok((0, 0, 0, 0.0));
        }
        if state.running.is_none() {
            self.start(py, &mut state)?;
        }
        let mut position = state.position;
        let loader = state.running.as_mut().expect("started above").loader();
        let (n, records, bytes, seconds, failed) = py.detach(|| {
            let start = std::time::Instant::now();
            let (mut n, mut records, mut bytes) = (0, 0, 0);
            let mut failed = None;
            while n < batches && position.epoch <= iterating {
                match loader.next() {
                    None => break,
                    Some(Err(e)) => {
                        failed = Some(e);
                        break;
                    }
                    Some(Ok(batch)) => {
                        let after = batch.position();
                        if epoch_of(after) < position.epoch || cut.dropped(after) {
                            continue;
                        }
                        n += 1;
                        records += batch.len() as u64;
                        bytes += batch.data().len() as u64;
                        if let Some(weights) = batch.weights() {
                            cut.weights = Some(weights.weights.clone());
                        }
                        position = cut.normalized(after);
                    }
                }
            }
            (n, records, bytes, start.elapsed().as_secs_f64(), failed)
        });
        let finished = loader.is_finished();
        state.position = position;
        state.weights = cut.weights;
        match failed {
            None => Ok((n, records, bytes, seconds)),
            Some(e) => {
                if finished {
                    state.stop();
                    self.started_in.store(0, Ordering::Release);
                }
                Err(to_py(e))
            }
        }
    }

    /// Stops the engine loader's threads now (the next batch asked for starts them again).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = self.lock(py)?;
        state.stop();
        self.started_in.store(0, Ordering::Release);
        Ok(())
    }
}

impl Loader {
    /// The state, waited for with the GIL released: another thread may hold it while it waits
    /// for a batch without the GIL, and needs the GIL back to let go of it.
    fn lock(&self, py: Python<'_>) -> PyResult<parking_lot::MutexGuard<'_, State>> {
        let started_in = self.started_in.load(Ordering::Acquire);
        if started_in != 0 && started_in != std::process::id() {
            return Err(forked("granary.Loader", started_in));
        }
        Ok(self.state.lock_py_attached(py))
    }

    /// The engine's next batch of the epoch being iterated (`drop_last`'s short step skipped),
    /// the position moved past it; `None` at the epoch's end.
    fn next_loaded(&self, py: Python<'_>, state: &mut State) -> PyResult<Option<granary::LoadedBatch>> {
        if state.position.epoch > state.iterating {
            state.len_from = state.position;
            return Ok(None);
        }
        let mut cut = state.cut().map_err(to_py)?;
        if cut.batches_per_epoch() == 0 {
            // Nothing for this rank in any epoch (fewer records than ranks, or with
            // `drop_last` fewer than one step): each epoch ends at once.
            state.position = Position { epoch: state.iterating + 1, cursor: 0 };
            return Ok(None);
        }
        if state.running.is_none() {
            self.start(py, state)?;
        }
        loop {
            let State { running, .. } = &mut *state;
            let loader = running.as_mut().expect("started above").loader();
            // A panic inside the engine's loader is a `granary.Error`, not `PanicException`.
            let next = engine(py, || Ok(loader.next()))?;
            let batch = match next {
                None => {
                    // The engine loader ran out: the dataset is empty (it runs epochs without end).
                    return Ok(None);
                }
                Some(Err(e)) => {
                    if loader.is_finished() {
                        state.stop();
                        self.started_in.store(0, Ordering::Release);
                    }
                    return Err(to_py(e));
                }
                Some(Ok(batch)) => batch,
            };
            let after = batch.position();
            if epoch_of(after) < state.position.epoch || cut.dropped(after) {
                // The short last step of an epoch (`drop_last`).
                continue;
            }
            if let Some(weights) = batch.weights()
                && state.weights.as_deref() != Some(weights.weights.as_slice())
            {
                // The weights change at rebalance points only: copied then, not per batch.
                state.weights = Some(weights.weights.clone());
                cut.weights.clone_from(&state.weights);
            }
            state.position = cut.normalized(after);
            return Ok(Some(batch));
        }
    }

    fn start(&self, py: Python<'_>, state: &mut State) -> PyResult<()> {
        if let Some(ordinal) = state.device {
            engine(py, || Cuda::select(ordinal))?;
        }
        let dataset = state.dataset().map_err(to_py)?;
        // The tier is opened once, by the first start, and kept across restarts (a `close`, a
        // seek), so they find it full: only the last user's close empties it.
        if !matches!(state.config.tier, TierSetting::Shared(_) | TierSetting::Off) {
            let setting = state.config.tier.clone();
            state.config.tier = match engine(py, || setting.open())? {
                Some(tier) => TierSetting::Shared(tier),
                None => TierSetting::Off,
            };
        }
        let config = state.config.clone();
        let position = state.position;
        if let Some(packing) = state.source.packing() {
            state.packer = Some(Packer::new(packing.clone(), &config, position));
        }
        let loader = engine(py, || granary::Loader::new(dataset, config, position))?;
        state.running = Some(Running { loader: Some(loader), pid: std::process::id() });
        self.started_in.store(std::process::id(), Ordering::Release);
        Ok(())
    }

    fn move_to(&self, state: &mut State, position: Position) {
        if state.position != position || state.running.is_none() {
            state.stop();
            self.started_in.store(0, Ordering::Release);
        }
        state.position = position;
    }
}

/// The epoch of a batch, from the position after it (the last batch of epoch `e` reports the
/// start of `e + 1`; no other batch ends at a cursor of 0).
fn epoch_of(after: Position) -> u64 {
    if after.cursor == 0 { after.epoch.saturating_sub(1) } else { after.epoch }
}
