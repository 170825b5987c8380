//! The loader: one rank's batches, verified, in staging memory and (with CUDA) on the GPU, ahead
//! of the trainer.
//!
//! Owns the stage threads and the queues between them:
//!
//! ```text
//! reader thread: epoch plan -> Reader (io_uring into pinned slots, CRC check, gather into a
//!                staging lease) -> queue of `prefetch` batches
//! device thread (CUDA only): lease -> device buffer on the loader's stream, event after it
//!                -> queue of 2 uploads
//! trainer: Loader::next -> LoadedBatch (host view, device pointer and event, indices, position)
//! ```
//!
//! The plan comes from the partitioner plugin (the built-in elastic one by default) or from the
//! native `EpochPlan`. A `Position` (epoch, global cursor) after each batch resumes exactly:
//! positions count steps of `world x batch_size` records, which is how both plans are cut.
//! With rebalancing (`rebalance`), a plugin's steps are split by rank weights that change at
//! deterministic steps from the ranks' measured speed; the batch carries the weights it was cut
//! with and a `RebalanceState` saved beside the position replays them.
//! Invariants: memory is bounded by configuration (a staging pool of fixed size; a consumer
//! that holds batches makes the reader wait, never allocate); every byte of a batch passed its
//! block checksum before the batch was queued; batches come in plan order; `next` never waits
//! forever (a consumer that holds `hold_max` batches gets an error instead of a deadlock).
//! Never: panics on bad input, or hands out a batch after an error (the error comes instead,
//! once, then the end).

mod metrics;
mod node_plan;
mod planner;
#[cfg(feature = "policy")]
mod rebalance;
mod schedule;
mod start;
mod tier_setting;

use metrics::{DatasetHeat, Live, LoaderMetrics};
use planner::{EpochBatches, EpochPlanner, planner_config, shards_by_step};
#[cfg(feature = "policy")]
use rebalance::Rebalancing;
#[cfg(feature = "policy")]
pub use rebalance::{
    LocalExchange, MeasureExchange, RebalanceConfig, RebalanceState, TIME_SPREAD_MIN, WeightsAt, tells_ranks_apart,
};
use schedule::{NextBatches, ScheduleRequest, Scheduler};
pub use start::{StartClock, StartStage};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
pub use tier_setting::TierSetting;

use crate::error::{Error, Result};
use crate::io::{Fault, FaultIo, Io, IoConfig, LazyIo, OwnedMemory};
use crate::plan::{Order, Position, World};
use crate::read::{Batch, Dataset, PublishedStats, ReadStats, Reader};
use crate::staging::cuda::{Cuda, DeviceBuffer, Fence, Stream, Upload};
use crate::staging::{Pinning, PoolStats, StagingConfig, StagingPool};
use crate::tier::{Coordinator, MemoryTier, TierConfig, TierReader, TierStats};

/// Where batches go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Target {
    /// To the GPU when CUDA is present, host memory otherwise.
    #[default]
    Auto,
    /// Host memory only, not page-locked (the pool is pinned only for copies to the GPU).
    Host,
    /// The GPU, or an error.
    Gpu,
}

/// Which plan orders an epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanSource {
    /// The native `EpochPlan`.
    Native(Order),
    /// A partitioner plugin (built-in name or file; `None`: the default) and its options. Its
    /// plan must be cut in steps as the built-in's `mode=global` is, so positions resume. The
    /// plan is explicit ranges, planned per epoch inside the plugin's memory cap (256 MiB by
    /// default): a record-level shuffle fits a few million records; beyond that, use a block
    /// shuffle (`chunk-records`) or `Native`, whose plan takes O(1) memory.
    #[cfg(feature = "policy")]
    Partitioner {
        /// Built-in name or file; `None` for the default.
        plugin: Option<String>,
        /// `key=value` options.
        options: Vec<(String, String)>,
    },
}

impl Default for PlanSource {
    fn default() -> Self {
        #[cfg(feature = "policy")]
        return PlanSource::Partitioner { plugin: None, options: Vec::new() };
        #[cfg(not(feature = "policy"))]
        PlanSource::Native(Order::Shuffled)
    }
}

/// How a loader runs.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// Records per batch (per rank).
    pub batch_size: u64,
    /// This rank and the world.
    pub world: World,
    /// The run's seed.
    pub seed: u64,
    /// The epoch order.
    pub plan: PlanSource,
    /// Epochs to run from the start position's epoch; `None` runs until dropped.
    pub epochs: Option<u64>,
    /// Batches the reader keeps in flight at once, at least: reading from disk (the memory tier
    /// off), more when batches are small, so that `io.queue_depth` ops of `io.op_bytes_max` can
    /// be in flight whatever the batch size and plan (a block-shuffled batch of 256 KiB chunks is
    /// a few ops; at most 64 batches, and no more than those bytes' worth; page-locked, at most
    /// 1 GiB of staging buffers).
    pub read_depth: usize,
    /// Verified batches queued ahead of the trainer.
    pub prefetch: usize,
    /// Batches the trainer may hold at once.
    pub hold_max: usize,
    /// The read backend.
    pub io: IoConfig,
    /// Threads that check long ops (64 KiB or more) and copy their records into the batch, so the
    /// reading thread only reaps;
    /// `None`: [`crate::read::default_verify_threads`] (`GRANARY_VERIFY_THREADS`, else none below
    /// 8 cores); 0: checks on the reading thread.
    pub verify_threads: Option<usize>,
    /// Where batches go.
    pub target: Target,
    /// Bytes per staging buffer (the largest batch); `None`: exact for fixed-size records,
    /// 64 MiB otherwise (the reader's depth then follows the batches' mean size from the
    /// manifest; with CUDA its buffers are page-locked whole, so the largest batch given here
    /// lets more of them be in flight).
    pub batch_bytes_max: Option<usize>,
    /// Faults injected into the reads and the tier's fills (tests and drills). A loader with
    /// faults on reads reads every record from disk (no memory tier), where they act; one whose
    /// faults are all `Fault::FailFill` keeps its tier, whose fills meet them.
    pub faults: Vec<Fault>,
    /// Where a damaged or missing shard gets replaced from (a replication node): the read is
    /// then retried and the batches come in the same order. `None`: such a read fails. For an
    /// attached dataset the store's origin cache fetches missing shards, asking this node for
    /// a peer's copy before the origin.
    pub repair: Option<Arc<dyn crate::read::ShardRepair>>,
    /// The node's memory tier: records are served from verified extents in memory, filled
    /// ahead of the reader in plan order.
    pub tier: TierSetting,
    /// Ranks per node, numbered node by node (node `n` holds ranks `n * L` to `n * L + L - 1`,
    /// as torchrun numbers them): the memory tier plans for every rank of this node, so they
    /// agree on what it holds and fill it together. `None`: `LOCAL_WORLD_SIZE` from the
    /// environment when set (torchrun sets it), else this rank alone.
    pub local_world_size: Option<u32>,
    /// Where the loader's metrics are registered (labelled by rank): by default the process's
    /// registry, which `metrics::serve` exposes.
    pub metrics: crate::metrics::Setting,
    /// Rebalance the ranks' shares of each step from their measured speed (the partitioner
    /// plugin's `rebalance`, `@0.2.0`); `None`: fixed equal shares.
    #[cfg(feature = "policy")]
    pub rebalance: Option<RebalanceConfig>,
    /// Whether the built-in default partitioner plans an epoch that the named partitioner
    /// plugin fails to plan (a trap, an invalid plan): the run goes on, and the loader says so
    /// once on stderr. `false` makes such a failure end the stream. A rebalancing loader never
    /// falls back (every rank must decide alike).
    pub partitioner_fallback: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self {
            batch_size: 256,
            world: World::single(),
            seed: 0,
            plan: PlanSource::default(),
            epochs: Some(1),
            read_depth: 2,
            prefetch: 4,
            hold_max: 2,
            io: IoConfig::default(),
            verify_threads: None,
            target: Target::Auto,
            batch_bytes_max: None,
            faults: Vec::new(),
            repair: None,
            tier: TierSetting::default(),
            local_world_size: None,
            metrics: crate::metrics::Setting::Process,
            #[cfg(feature = "policy")]
            rebalance: None,
            partitioner_fallback: true,
        }
    }
}

/// Batches ready on the device: where, and the event after the copy.
pub struct DeviceBatch<'a> {
    upload: &'a Upload,
}

impl DeviceBatch<'_> {
    /// The device address of the batch's bytes.
    pub fn ptr(&self) -> u64 {
        self.upload.device().device_ptr()
    }

    /// Bytes on the device.
    pub fn len(&self) -> usize {
        self.upload.host().len()
    }

    /// Whether the batch holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the copy has completed.
    pub fn is_ready(&self) -> Result<bool> {
        self.upload.is_ready()
    }

    /// Waits for the copy.
    pub fn wait(&self) -> Result<()> {
        self.upload.wait()
    }

    /// Makes later work on `stream` (a raw `CUstream` of the loader's device; 1 and 2 name the
    /// legacy and the per-thread default streams, as in DLPack) wait for the copy, without
    /// blocking the calling thread.
    pub fn order_before(&self, stream: u64) -> Result<()> {
        self.upload.order_before(stream)
    }

    /// The raw `CUevent` recorded after the copy: make the trainer's stream wait on it.
    #[cfg(feature = "cuda")]
    pub fn event(&self) -> cudarc::driver::sys::CUevent {
        self.upload.event_raw()
    }

    /// Copies the device bytes back (for checks, not the hot path).
    pub fn download(&self, out: &mut [u8]) -> Result<()> {
        self.upload.wait()?;
        self.upload.device().download(out)
    }
}

/// One batch handed to the trainer. Dropping it returns its staging buffer (and device buffer)
/// to the loader: drop it only after the work that reads it has finished.
pub struct LoadedBatch {
    batch: Batch,
    upload: Option<Upload>,
    /// The rank weights the batch's step was cut with (rebalancing only).
    #[cfg(feature = "policy")]
    weights: Option<Arc<WeightsAt>>,
    position: Position,
    stall: Duration,
    returns: Option<Sender<Returned>>,
    /// Points in the trainer's streams after which the device buffer is free again.
    fences: Vec<Fence>,
    /// The trainer's streams are unknown: the buffer is free once the whole device has run
    /// the work queued before it is reused.
    after_all_work: bool,
    held: Arc<AtomicUsize>,
}

/// A device buffer back from the trainer, free once its fences have passed (or, with
/// `after_all_work`, once the device has run everything queued before the reuse). Dropped
/// unused (the loader is gone, or stops), it waits for them before the buffer is freed.
struct Returned {
    buffer: Option<DeviceBuffer>,
    fences: Vec<Fence>,
    after_all_work: bool,
}

impl Returned {
    /// The buffer, once `stream`'s later work is ordered after the fences.
    fn after_fences_on(mut self, stream: &Stream) -> Result<DeviceBuffer> {
        for fence in &self.fences {
            stream.wait_for(fence)?;
        }
        self.fences.clear();
        if self.after_all_work {
            Cuda::get().ok_or_else(|| Error::invalid_input("a device buffer without CUDA"))?.synchronize()?;
            self.after_all_work = false;
        }
        Ok(self.buffer.take().expect("taken once"))
    }
}

impl Drop for Returned {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            // Freeing memory a consumer's queued kernels may still read is not allowed: wait.
            // If waiting fails the context is broken; leak the buffer rather than free it.
            let idle = || Cuda::get().is_some_and(|cuda| cuda.synchronize().is_ok());
            if self.fences.iter().all(|fence| fence.wait().is_ok()) && (!self.after_all_work || idle()) {
                drop(buffer);
            } else {
                std::mem::forget(buffer);
            }
        }
    }
}

impl LoadedBatch {
    /// The dataset indices of the records, in batch order.
    pub fn indices(&self) -> &[u64] {
        self.batch.indices()
    }

    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// Whether the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Where each record ends in `data`.
    pub fn ends(&self) -> &[u64] {
        self.batch.ends()
    }

    /// The verified bytes in host (staging) memory: for fixed-size records one dense
    /// `len x shape` array, otherwise records back to back (see `ends`).
    pub fn data(&self) -> &[u8] {
        match &self.upload {
            Some(upload) => upload.host().as_slice(),
            None => self.batch.data(),
        }
    }

    /// The bytes of record `i` of the batch.
    pub fn record(&self, i: usize) -> &[u8] {
        let ends = self.ends();
        let start = if i == 0 { 0 } else { ends[i - 1] as usize };
        &self.data()[start..ends[i] as usize]
    }

    /// The batch on the GPU, when the loader copies to one.
    pub fn device(&self) -> Option<DeviceBatch<'_>> {
        self.upload.as_ref().map(|upload| DeviceBatch { upload })
    }

    /// Where the run is after this batch: resume from here to read the next one.
    pub fn position(&self) -> Position {
        self.position
    }

    /// The rank weights this batch's step was cut with, when the loader rebalances.
    #[cfg(feature = "policy")]
    pub fn weights(&self) -> Option<&WeightsAt> {
        self.weights.as_deref()
    }

    /// How long `next` waited for this batch.
    pub fn stall(&self) -> Duration {
        self.stall
    }

    /// Keeps the device buffer from being reused until the work enqueued so far on `stream` (a
    /// raw `CUstream` of the loader's device, as in `DeviceBatch::order_before`) has run: for a
    /// consumer that drops the batch while kernels reading it are still queued. Nothing to do for
    /// a host batch (host reads are done when they return).
    pub fn release_after(&mut self, stream: u64) -> Result<()> {
        if self.upload.is_some() {
            let cuda = Cuda::get().ok_or_else(|| Error::invalid_input("a device batch without CUDA"))?;
            self.fences.push(Fence::record(cuda, stream)?);
        }
        Ok(())
    }

    /// Keeps the device buffer from being reused until the device has run all the work queued
    /// on it before the reuse, on any stream: for a consumer that cannot name its streams
    /// (DLPack's stream -1), or whose `release_after` failed. It costs a device-wide
    /// synchronisation on the loader's copy thread at each such reuse; name the stream where
    /// you can.
    pub fn release_after_all_device_work(&mut self) {
        self.after_all_work = self.upload.is_some();
    }

    /// Whether the bytes are in page-locked memory.
    pub fn pinned(&self) -> bool {
        match &self.upload {
            Some(upload) => upload.host().pinned(),
            None => self.batch.lease().is_some_and(|lease| lease.pinned()),
        }
    }
}

impl Drop for LoadedBatch {
    fn drop(&mut self) {
        if let Some(upload) = self.upload.take()
            && let Ok((lease, buffer)) = upload.into_parts()
        {
            drop(lease);
            let returned = Returned {
                buffer: Some(buffer),
                fences: std::mem::take(&mut self.fences),
                after_all_work: self.after_all_work,
            };
            if let Some(returns) = &self.returns {
                // A closed queue hands the buffer back, to be dropped after its fences.
                let _ = returns.send(returned);
            }
        }
        self.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counters of a loader.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoaderStats {
    /// Batches handed out.
    pub batches: u64,
    /// Records handed out.
    pub records: u64,
    /// Bytes handed out.
    pub bytes: u64,
    /// Batches that were already in the queue when `next` asked for them (no wait at all).
    pub ready: u64,
    /// Time `next` spent waiting for data, in total.
    pub stall: Duration,
    /// The longest wait for one batch.
    pub stall_max: Duration,
    /// From the first `next` to the last.
    pub elapsed: Duration,
    /// The reader's counters.
    pub read: ReadStats,
    /// The staging pool's counters.
    pub pool: PoolStats,
    /// The memory tier's counters, when the loader uses one.
    pub tier: Option<TierStats>,
    /// The counters of the cache an attached dataset is read through (this loader's), if any.
    pub cache: Option<crate::read::CacheStats>,
}

impl LoaderStats {
    /// Fraction of the time between the first and last `next` spent waiting for data.
    pub fn stall_fraction(&self) -> f64 {
        if self.elapsed.is_zero() { 0.0 } else { self.stall.as_secs_f64() / self.elapsed.as_secs_f64() }
    }
}

enum Message {
    Batch(Box<Batch>, Tag),
    Uploaded(Box<Batch>, Upload, Tag),
    Failed(Error),
    /// The last epoch is done: a queue that closes without it means a stage died.
    End,
}

/// What travels with a batch: the position after it, and the weights its step was cut with.
#[derive(Clone, Debug)]
struct Tag {
    after: Position,
    #[cfg(feature = "policy")]
    weights: Option<Arc<WeightsAt>>,
}

/// One rank's batch stream. See the module documentation.
pub struct Loader {
    receiver: Option<Receiver<Message>>,
    /// When each stage of the start ended.
    clock: Arc<StartClock>,
    threads: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    returns: Option<Sender<Returned>>,
    held: Arc<AtomicUsize>,
    hold_max: usize,
    pool: StagingPool,
    read_stats: Arc<PublishedStats>,
    position: Position,
    stats: LoaderStats,
    first_next: Option<Instant>,
    finished: bool,
    device: Option<String>,
    coordinator: Option<Arc<Coordinator>>,
    /// The repair hook, for its cache's counters.
    repair: Option<Arc<dyn crate::read::ShardRepair>>,
    /// `None` with the metrics off.
    metrics: Option<Arc<LoaderMetrics>>,
    /// Measures the trainer's time per batch for rebalancing.
    #[cfg(feature = "policy")]
    meter: Option<rebalance::Meter>,
    /// The weights of the last batch handed out (or those resumed with).
    #[cfg(feature = "policy")]
    weights: Option<Arc<WeightsAt>>,
    #[cfg(feature = "policy")]
    world: World,
    #[cfg(feature = "policy")]
    batch_size: u64,
}

impl Loader {
    /// Starts loading `dataset` from `start` (`Position::default()` for the beginning).
    pub fn new(dataset: Arc<Dataset>, config: LoaderConfig, start: Position) -> Result<Self> {
        let clock = Arc::new(StartClock::new());
        check(&config)?;
        let mut config = config;
        config.repair = origin_hook(&dataset, config.repair.take())?;
        config.plan = plan_for_store(&dataset, config.plan)?;
        let repair = config.repair.clone();
        let cuda = match config.target {
            Target::Host => None,
            Target::Auto => Cuda::get(),
            Target::Gpu => Some(Cuda::get().ok_or_else(|| Error::NoGpu {
                detail: format!(
                    "loading to the GPU needs CUDA: {}",
                    Cuda::unavailable_reason().unwrap_or_else(|| "not available".to_owned())
                ),
            })?),
        };
        // Rebalancing gives a rank up to `SHARE_MAX_BATCHES` batch sizes of a step.
        #[cfg(feature = "policy")]
        let batch_records = match config.rebalance {
            Some(_) => config.batch_size.saturating_mul(crate::plan::SHARE_MAX_BATCHES),
            None => config.batch_size,
        };
        #[cfg(not(feature = "policy"))]
        let batch_records = config.batch_size;
        let batch_bytes = match (config.batch_bytes_max, dataset.layout().record_bytes()) {
            (Some(bytes), _) => bytes,
            (None, Some(record)) => usize::try_from(record.saturating_mul(batch_records))
                .map_err(|_| Error::invalid_input("a batch larger than memory"))?,
            (None, None) => BATCH_BYTES_VARIABLE
                .saturating_mul(usize::try_from(batch_records / config.batch_size.max(1)).unwrap_or(1)),
        };
        // What a batch is expected to take, for the depth: exact for fixed-size records; for
        // variable-length ones the manifest's mean record (shard file bytes over records, a
        // slight over-estimate) times the batch, not the buffer's bound, so that a corpus of
        // documents in 1 MiB batches keeps as many bytes in flight as one of fixed records.
        let expected_batch_bytes = match dataset.layout().record_bytes() {
            Some(record) => record.saturating_mul(config.batch_size),
            None => {
                dataset.manifest().file_bytes().div_ceil(dataset.n_records().max(1)).saturating_mul(config.batch_size)
            }
        };
        let expected_batch_bytes =
            usize::try_from(expected_batch_bytes).unwrap_or(usize::MAX).clamp(1, batch_bytes.max(1));
        // Injected faults on reads act on disk reads, which the tier would bypass: those drills
        // read from disk. Faults on fills need the tier.
        let mut coordinator = if config.faults.iter().any(Fault::on_reads) {
            None
        } else {
            config.tier.open()?.map(|tier| Coordinator::with_faults(tier, config.faults.clone()))
        };
        // A dataset read through an origin cache: its shard files come and go within the cache's
        // bound on disk, and a mapping of the page cache tier would hold an evicted one's disk
        // space. It is read through a memory tier of the same budget instead (its extents are
        // copies, so a shard the cache evicted is still served from memory), or from disk when
        // the node has none.
        if let Some(page_cache) = coordinator.as_ref().map(|c| Arc::clone(c.tier()))
            && page_cache.kind() == crate::tier::TierKind::PageCache
            && config.repair.as_ref().is_some_and(|hook| hook.cache_stats().is_some())
        {
            let (evictor, evictor_options) = page_cache.evictor();
            let memory = TierConfig {
                kind: crate::tier::TierKind::Memory,
                budget_bytes: Some(page_cache.budget_bytes().min(crate::tier::EXTENTS_MAX * page_cache.extent_bytes())),
                extent_bytes: page_cache.extent_bytes(),
                fill_threads: page_cache.fill_threads(),
                evictor: evictor.map(str::to_owned),
                evictor_options: evictor_options.to_vec(),
                ..TierConfig::default()
            };
            coordinator = MemoryTier::open(&memory)
                .ok()
                .flatten()
                .map(|tier| Coordinator::with_faults(tier, config.faults.clone()));
        }
        if let Some(coordinator) = &coordinator {
            coordinator.tier().warn_if_not_in_memory();
        }
        clock.mark(StartStage::TierOpened);
        // Reading from disk, enough batches in flight to keep the queue of large ops full; a
        // loader served from the tier copies from memory and keeps the depth asked for (each
        // batch in flight is a staging buffer).
        if coordinator.is_none() {
            config.read_depth = reader_depth(&config, expected_batch_bytes, batch_bytes, cuda.is_some());
        }
        // Buffers: the reader's batches in flight, the queue to the trainer, what the device
        // stage holds (one being copied, two queued), what the trainer holds, and one spare.
        let device_held = if cuda.is_some() { 3 } else { 0 };
        let buffers = config.read_depth + config.prefetch + device_held + config.hold_max + 1;
        let pinning = if cuda.is_some() { Pinning::Auto } else { Pinning::Off };
        let pool = StagingPool::new(StagingConfig { buffers, buffer_bytes: batch_bytes.max(1), pinning })?;
        clock.mark(StartStage::StagingReady);

        #[cfg(feature = "policy")]
        let (meter, from_meter) = match &mut config.rebalance {
            Some(rebalancing) => {
                rebalancing.check(config.world.size())?;
                let grid = rebalance::Grid::new(
                    u64::from(config.world.size()).saturating_mul(config.batch_size),
                    dataset.n_records(),
                    rebalancing.every,
                    normalized(start, dataset.n_records()),
                );
                rebalancing.fit_resume(config.world.size(), &grid);
                let (to_reader, from_meter) = std::sync::mpsc::channel();
                let meter = rebalance::Meter::new(config.world.rank(), rebalancing, grid, to_reader);
                (Some(meter), Some(from_meter))
            }
            None => (None, None),
        };
        #[cfg(feature = "policy")]
        let resumed_weights =
            config.rebalance.as_ref().and_then(|r| r.resume.as_ref()).map(|r| Arc::new(r.weights.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let read_stats = Arc::new(PublishedStats::default());
        let held = Arc::new(AtomicUsize::new(0));
        let registry = config.metrics.registry();
        let metrics = registry.as_ref().map(|_| {
            Arc::new(LoaderMetrics::new(
                config.world.rank(),
                &dataset,
                Arc::clone(&held),
                Arc::clone(&read_stats),
                Live {
                    pool: pool.clone(),
                    tier: coordinator.as_ref().map(|c| Arc::clone(c.tier())),
                    repair: repair.clone(),
                },
            ))
        });
        let (to_next, from_reader) = std::sync::mpsc::sync_channel(config.prefetch);
        // The tier's schedule and an origin cache's plan cover every rank of this node.
        let wants_plan = config.repair.as_ref().is_some_and(|hook| hook.wants_plan());
        let peers = if coordinator.is_some() || wants_plan { schedule::node_peers(&config)? } else { Vec::new() };
        // With the tier, the default disk backend (its read slots are as large as all of the
        // loader's batches) starts at the first record not served from memory, if one comes; a
        // backend asked for by name is started here, so that one this machine refuses fails
        // the construction.
        let io: Box<dyn Io> = if coordinator.is_some() && config.io.backend == crate::io::Backend::Auto {
            let (for_io, clock) = (config.clone(), Arc::clone(&clock));
            Box::new(LazyIo::new(
                config.io,
                Box::new(move || {
                    let io = build_io(&for_io, pinning)?;
                    clock.mark(StartStage::IoReady);
                    Ok(io)
                }),
            ))
        } else {
            let io = build_io(&config, pinning)?;
            clock.mark(StartStage::IoReady);
            io
        };
        // Should a step below fail, the threads started so far end with it.
        let mut threads = Started { threads: Vec::new(), stop: Arc::clone(&stop), coordinator: coordinator.clone() };
        if let Some(coordinator) = &coordinator {
            for i in 0..coordinator.tier().fill_threads() {
                let coordinator = Arc::clone(coordinator);
                // A filler that cannot start leaves its work to the others, or to the disk reads.
                threads.push(spawn(&format!("granary-fill-{i}"), move || {
                    let _ = crate::tier::run_filler(&coordinator);
                })?);
            }
        }
        let heat = (DatasetHeat::key(&dataset), registry.is_some().then(|| DatasetHeat::new(&dataset)));
        let reader = ReaderStage {
            coordinator: coordinator.clone(),
            dataset,
            io,
            pool: pool.clone(),
            config: config.clone(),
            peers,
            start,
            clock: Arc::clone(&clock),
            #[cfg(feature = "policy")]
            from_meter,
            out: to_next,
            stop: Arc::clone(&stop),
            stats: Arc::clone(&read_stats),
            metrics: metrics.clone(),
        };
        threads.push(spawn("granary-reader", move || reader.run())?);
        let (receiver, returns) = match cuda {
            None => (from_reader, None),
            Some(cuda) => {
                let (to_trainer, receiver) = std::sync::mpsc::sync_channel(2);
                let (returns, returned) = std::sync::mpsc::channel();
                let stream = cuda.stream()?;
                let buffers =
                    (0..config.hold_max + 3).map(|_| cuda.alloc(pool.buffer_bytes())).collect::<Result<Vec<_>>>()?;
                let device = DeviceStage {
                    stream,
                    free: buffers
                        .into_iter()
                        .map(|buffer| Returned { buffer: Some(buffer), fences: Vec::new(), after_all_work: false })
                        .collect(),
                    returned,
                    input: from_reader,
                    out: to_trainer,
                    stop: Arc::clone(&stop),
                };
                threads.push(spawn("granary-device", move || device.run())?);
                (receiver, Some(returns))
            }
        };
        if let (Some(registry), Some(source)) = (&registry, &metrics) {
            crate::metrics::on_fork_in_child(crate::read::forget_shard_reads);
            registry.register(Arc::clone(source) as Arc<dyn crate::metrics::Source>);
            registry.derive("skew", metrics::derive_skew);
            if let (key, Some(heat)) = heat {
                registry.register_once(&key, || Arc::new(heat));
            }
        }
        clock.mark(StartStage::Built);
        Ok(Self {
            receiver: Some(receiver),
            clock,
            threads: std::mem::take(&mut threads.threads),
            stop,
            returns,
            held,
            metrics,
            hold_max: config.hold_max,
            pool,
            read_stats,
            position: start,
            stats: LoaderStats::default(),
            first_next: None,
            finished: false,
            device: cuda.map(|cuda| cuda.name().to_owned()),
            coordinator,
            repair,
            #[cfg(feature = "policy")]
            meter,
            #[cfg(feature = "policy")]
            weights: resumed_weights,
            #[cfg(feature = "policy")]
            world: config.world,
            #[cfg(feature = "policy")]
            batch_size: config.batch_size,
        })
    }

    /// The next batch in plan order; `None` after the last epoch (or after an error was
    /// returned). Waits for the batch if it is not ready; the wait is counted as stall.
    #[allow(clippy::should_implement_trait, reason = "a fallible stream, not an iterator of values")]
    pub fn next(&mut self) -> Option<Result<LoadedBatch>> {
        if self.finished {
            return None;
        }
        let held = self.held.load(Ordering::Acquire);
        if held >= self.hold_max {
            return Some(Err(Error::HoldLimit { held }));
        }
        let receiver = self.receiver.as_ref()?;
        let now = Instant::now();
        let first = *self.first_next.get_or_insert(now);
        let (message, ready) = match receiver.try_recv() {
            Ok(message) => (message, true),
            Err(TryRecvError::Empty) => (receiver.recv().unwrap_or_else(|_| died()), false),
            Err(TryRecvError::Disconnected) => (died(), false),
        };
        let stall = now.elapsed();
        self.stats.stall += stall;
        self.stats.stall_max = self.stats.stall_max.max(stall);
        self.stats.elapsed = first.elapsed();
        let (batch, upload, tag) = match message {
            Message::Batch(batch, tag) => (batch, None, tag),
            Message::Uploaded(batch, upload, tag) => (batch, Some(upload), tag),
            Message::Failed(error) => {
                self.finished = true;
                return Some(Err(error));
            }
            Message::End => {
                self.finished = true;
                return None;
            }
        };
        let position = tag.after;
        self.clock.mark(StartStage::FirstBatchTaken);
        if let Some(coordinator) = &self.coordinator {
            coordinator.consumed();
        }
        #[cfg(feature = "policy")]
        if let Some(meter) = &mut self.meter
            && let Err(error) = meter.handing_out(position, batch.len() as u64, now)
        {
            // The ranks could not agree on their measures: the stream ends with the error.
            self.finished = true;
            self.stop.store(true, Ordering::Release);
            return Some(Err(error));
        }
        #[cfg(feature = "policy")]
        if let Some(meter) = &mut self.meter {
            let held = meter.take_held();
            if held > 0
                && let Some(metrics) = &self.metrics
            {
                metrics.rebalances_held(held);
            }
        }
        #[cfg(feature = "policy")]
        if let Some(weights) = &tag.weights
            && self.weights.as_ref().is_none_or(|w| !Arc::ptr_eq(w, weights))
        {
            if let Some(metrics) = &self.metrics {
                let step_len = u64::from(self.world.size()).saturating_mul(self.batch_size);
                let rank = self.world.rank() as usize;
                let share =
                    |w: &WeightsAt| crate::plan::step_shares(step_len, &w.weights).get(rank).copied().unwrap_or(0);
                let now = share(weights);
                let before = self.weights.as_deref().map_or(now, share);
                let weight = weights.weights.get(rank).copied().unwrap_or(0);
                let point = weights.step > 0
                    && self.weights.as_ref().is_none_or(|w| (w.epoch, w.step) != (weights.epoch, weights.step));
                metrics.weights_changed(weight, now, point, now.abs_diff(before));
            }
            self.weights = Some(Arc::clone(weights));
        }
        self.held.fetch_add(1, Ordering::AcqRel);
        let loaded = LoadedBatch {
            batch: *batch,
            upload,
            #[cfg(feature = "policy")]
            weights: tag.weights,
            position,
            stall,
            returns: self.returns.clone(),
            fences: Vec::new(),
            after_all_work: false,
            held: Arc::clone(&self.held),
        };
        self.position = position;
        self.stats.batches += 1;
        self.stats.ready += u64::from(ready);
        self.stats.records += loaded.len() as u64;
        self.stats.bytes += loaded.data().len() as u64;
        if let Some(metrics) = &self.metrics {
            // The position is the one after the batch: the last batch of an epoch is followed by
            // the next epoch's start.
            let epoch = if position.cursor == 0 { position.epoch.saturating_sub(1) } else { position.epoch };
            metrics.handed_out(epoch, loaded.len() as u64, loaded.data().len() as u64, stall, ready);
        }
        Some(Ok(loaded))
    }

    /// Whether the stream has ended: the last epoch was handed out, or an error was (a refusal
    /// to hand out more than `hold_max` batches does not end it).
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Where the run is: after the last batch handed out (the start, before the first).
    pub fn position(&self) -> Position {
        self.position
    }

    /// The trainer's own time on the last batch handed out (its forward and backward, say,
    /// without the all-reduce's wait for other ranks), for rebalancing: without it, the time
    /// from one `next` to the next is taken, which a synchronous step makes equal on every rank.
    /// Ignored when the loader does not rebalance.
    #[cfg(feature = "policy")]
    pub fn report_busy(&mut self, busy: Duration) {
        if let Some(meter) = &mut self.meter {
            meter.report_busy(busy);
        }
    }

    /// What to save beside the position to resume the rebalancing exactly: the weights in force
    /// and the measures already exchanged for the next point. `None` without rebalancing.
    #[cfg(feature = "policy")]
    pub fn rebalance_state(&self) -> Option<RebalanceState> {
        let meter = self.meter.as_ref()?;
        let weights = match &self.weights {
            Some(weights) => (**weights).clone(),
            None => WeightsAt { epoch: self.position.epoch, step: 0, weights: Vec::new() },
        };
        Some(RebalanceState { weights, pending: meter.pending(self.position) })
    }

    /// Counters so far.
    pub fn stats(&self) -> LoaderStats {
        let mut stats = self.stats;
        stats.read = self.read_stats.get();
        stats.pool = self.pool.stats();
        stats.tier = self.coordinator.as_ref().map(|c| c.tier().stats());
        stats.cache = self.repair.as_ref().and_then(|hook| hook.cache_stats());
        stats
    }

    /// When each stage of this loader's start ended, from the call to `Loader::new`, in the
    /// order they ended (the stages passed so far; a loader served from memory may never build
    /// its disk backend).
    pub fn start_stages(&self) -> Vec<(StartStage, Duration)> {
        self.clock.marks()
    }

    /// The memory tier this loader reads through, if any.
    pub fn tier(&self) -> Option<&Arc<MemoryTier>> {
        self.coordinator.as_ref().map(|c| c.tier())
    }

    /// The GPU batches are copied to, if any.
    pub fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(coordinator) = &self.coordinator {
            coordinator.stop();
        }
        // Dropping the queue frees the batches in it, so a stage waiting for a buffer or for
        // room in the queue wakes up, sees the stop or a closed queue, and ends.
        self.receiver = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        if let Some(metrics) = &self.metrics {
            metrics.end();
        }
    }
}

/// The threads `Loader::new` has started: if it fails before the loader owns them, they are
/// told to stop (the stages end on the stop flag or their closed queues, the fillers on the
/// coordinator's stop).
struct Started {
    threads: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    coordinator: Option<Arc<Coordinator>>,
}

impl Started {
    fn push(&mut self, thread: JoinHandle<()>) {
        self.threads.push(thread);
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop.store(true, Ordering::Release);
            if let Some(coordinator) = &self.coordinator {
                coordinator.stop();
            }
        }
    }
}

/// What the trainer gets when a stage's queue closes without `End` or an error: a stage thread
/// ended unexpectedly (a panic), and the data stops short of the plan.
fn died() -> Message {
    Message::Failed(Error::invalid_input("a loader thread ended unexpectedly; the epoch is incomplete"))
}

fn check(config: &LoaderConfig) -> Result<()> {
    if config.batch_size == 0 {
        return Err(Error::invalid_input("batch size must be at least 1"));
    }
    if config.read_depth == 0 || config.prefetch == 0 || config.hold_max == 0 {
        return Err(Error::invalid_input("read depth, prefetch and hold_max must each be at least 1"));
    }
    if config.local_world_size == Some(0) {
        return Err(Error::invalid_input("local_world_size is 0; a node runs at least one rank"));
    }
    if let Some(threads) = config.verify_threads.filter(|&t| t > crate::read::VERIFY_THREADS_MAX) {
        return Err(Error::invalid_input(format!(
            "verify_threads is {threads}, more than {}",
            crate::read::VERIFY_THREADS_MAX
        )));
    }
    config.io.validate()
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.to_owned()).spawn(f).map_err(|e| Error::io("spawn", name, e))
}

/// Batches of `expected_bytes` in flight enough for the backend's queue of large ops
/// (`queue_depth` x `op_bytes_max` bytes: a sequential or block-shuffled plan reads a batch in a
/// few such ops), at least `read_depth` and at most `READ_DEPTH_MAX`. Each batch in flight is a
/// staging buffer of `buffer_bytes`; page-locked (`pinned`), the reader's buffers take at most
/// `PINNED_READ_BYTES` unless `read_depth` asks for more.
fn reader_depth(config: &LoaderConfig, expected_bytes: usize, buffer_bytes: usize, pinned: bool) -> usize {
    let queue_bytes = (config.io.queue_depth as usize).saturating_mul(config.io.op_bytes_max);
    let most = if pinned { READ_DEPTH_MAX.min(PINNED_READ_BYTES / buffer_bytes.max(1)) } else { READ_DEPTH_MAX };
    queue_bytes.div_ceil(expected_bytes.max(1)).clamp(config.read_depth, most.max(config.read_depth))
}

/// The most batches `reader_depth` keeps in flight unless asked for more.
const READ_DEPTH_MAX: usize = 64;

/// The most page-locked memory the reader's staging buffers take unless asked for more: with
/// variable-length records and no `batch_bytes_max`, 16 buffers of `BATCH_BYTES_VARIABLE`.
const PINNED_READ_BYTES: usize = 1 << 30;

/// A staging buffer's bytes for variable-length records when `batch_bytes_max` is not given:
/// the largest batch such a loader takes. Host memory is touched only as far as batches fill it;
/// page-locked memory is locked whole.
const BATCH_BYTES_VARIABLE: usize = 64 << 20;

/// The read backend: io_uring reading into slots from a staging pool (page-locked with CUDA,
/// registered as fixed buffers), or what `config.io` builds.
fn build_io(config: &LoaderConfig, pinning: Pinning) -> Result<Box<dyn Io>> {
    let io: Box<dyn Io> = match config.io.backend {
        crate::io::Backend::Pread => config.io.build()?,
        #[cfg(target_os = "linux")]
        backend => {
            let slots = 2 * config.io.queue_depth as usize;
            let staged =
                StagingPool::new(StagingConfig { buffers: slots, buffer_bytes: config.io.op_bytes_max, pinning })
                    .and_then(|pool| {
                        let leases: Vec<Box<dyn OwnedMemory>> =
                            (0..slots).map(|_| Box::new(pool.acquire()) as Box<dyn OwnedMemory>).collect();
                        crate::io::UringIo::with_slots(&config.io, leases)
                    });
            match (staged, backend) {
                (Ok(uring), _) => Box::new(uring),
                (Err(e), crate::io::Backend::Uring) => return Err(e),
                (Err(_), _) => config.io.build()?,
            }
        }
        #[cfg(not(target_os = "linux"))]
        _ => config.io.build()?,
    };
    Ok(if config.faults.iter().any(Fault::on_reads) { Box::new(FaultIo::new(io, config.faults.clone())) } else { io })
}

struct ReaderStage {
    coordinator: Option<Arc<Coordinator>>,
    dataset: Arc<Dataset>,
    io: Box<dyn Io>,
    pool: StagingPool,
    config: LoaderConfig,
    /// The other ranks of this node, whose reads the tier's schedule includes.
    peers: Vec<World>,
    start: Position,
    clock: Arc<StartClock>,
    /// The measures of each rebalance point, from the trainer side.
    #[cfg(feature = "policy")]
    from_meter: Option<Receiver<rebalance::PointMeasures>>,
    out: SyncSender<Message>,
    stop: Arc<AtomicBool>,
    stats: Arc<PublishedStats>,
    metrics: Option<Arc<LoaderMetrics>>,
}

/// The repair hook of a loader of `dataset` given `given`: for an attached dataset, the store's
/// origin cache, through which its missing shards are fetched (asking `given`, a replication
/// node, before the origin); otherwise, or when `given` is a cache itself, `given`.
#[cfg(feature = "origin")]
fn origin_hook(
    dataset: &Dataset,
    given: Option<Arc<dyn crate::read::ShardRepair>>,
) -> Result<Option<Arc<dyn crate::read::ShardRepair>>> {
    let Some((name, _)) = dataset.version() else { return Ok(given) };
    // A hook that is a cache of its own (an origin cache the caller opened) is used as given:
    // wrapped, its fetches would wait on the claims of the wrapping cache's.
    if given.as_ref().is_some_and(|hook| hook.cache_stats().is_some())
        || crate::origin::attachment(dataset.paths(), name)?.is_none()
    {
        return Ok(given);
    }
    let Some(cache) = crate::origin::OriginCache::open(dataset.paths(), None, &[])? else { return Ok(given) };
    if let Some(node) = given {
        cache.set_peers(node);
    }
    Ok(Some(cache))
}

#[cfg(not(feature = "origin"))]
fn origin_hook(
    _: &Dataset,
    given: Option<Arc<dyn crate::read::ShardRepair>>,
) -> Result<Option<Arc<dyn crate::read::ShardRepair>>> {
    Ok(given)
}

/// The plan a loader of `dataset` reads with when asked for `plan` (`Loader::new` applies it;
/// callers that record the plan, to resume under the same order, ask here): `plan` itself,
/// windowed to the cache when `dataset` is an attached one that its store's cache cannot hold
/// whole and `plan` is the default partitioner's global order without a window:
/// `window-shards` is then about as many shards as the cache holds (`window_for_cache`), so
/// the reader works through a few shards at a time, each batch drawn from as many as the cache
/// allows, instead of needing most of the dataset every few steps.
/// The window follows from the cache bound: nodes of one job give the same `--cache-bytes`
/// (or pass `window-shards` themselves), or their ranks would read different plans. Any other
/// plan (a native order, another plugin, a window or mode given) is left as chosen.
#[cfg(feature = "origin")]
pub fn plan_for_store(dataset: &Dataset, plan: PlanSource) -> Result<PlanSource> {
    let PlanSource::Partitioner { plugin, mut options } = plan else { return Ok(plan) };
    let chosen = options.iter().any(|(key, value)| key == "window-shards" || (key == "mode" && value != "global"));
    let attached = match dataset.version() {
        Some((name, _)) if !chosen && matches!(plugin.as_deref(), None | Some("elastic")) => {
            crate::origin::attachment(dataset.paths(), name)?.is_some()
        }
        _ => false,
    };
    if attached {
        let bound = crate::origin::cache_bound(dataset.paths())?;
        let entries = dataset.manifest().entries();
        let total: u64 = entries.iter().map(|e| e.file_bytes).sum();
        let largest = entries.iter().map(|e| e.file_bytes).max().unwrap_or(1).max(1);
        if bound > 0 && total > bound {
            options.push(("window-shards".to_owned(), window_for_cache(bound, largest).to_string()));
        }
    }
    Ok(PlanSource::Partitioner { plugin, options })
}

/// The window of shards a cache of `bound` bytes reads a dataset of shards up to `largest`
/// bytes through: one less than the C shards it holds, less an eighth of C, at least 1. A window
/// of W has at most W + 1 shards begun and not finished at any point, which the cache then
/// holds; the shard that enters next is fetched as one read to its end leaves, and the eighth
/// lets the prefetch fetch ahead. Measured with a quarter-size cache (issue 40): 16 shards
/// (C = 4), a window of 1 drew every batch from one shard and fetched 1.19 x the data, 3 drew
/// 3.0-3.2 shards a batch and fetched 1.00-1.06 x; 64 shards (C = 16), a window of 15 fetched
/// 1.23 x, 13 fetched 1.03 x with 12 shards a batch.
pub fn window_for_cache(bound: u64, largest: u64) -> u64 {
    let shards = bound / largest.max(1);
    shards.saturating_sub(1).saturating_sub(shards / 8).max(1)
}

/// The plan a loader of a dataset reads with when asked for `plan`: `plan` (without origins,
/// nothing windows it).
#[cfg(not(feature = "origin"))]
pub fn plan_for_store(_: &Dataset, plan: PlanSource) -> Result<PlanSource> {
    Ok(plan)
}

impl ReaderStage {
    fn run(self) {
        #[cfg(feature = "policy")]
        let ReaderStage {
            coordinator,
            dataset,
            io,
            pool,
            config,
            peers,
            start,
            clock,
            from_meter,
            out,
            stop,
            stats,
            metrics,
        } = self;
        #[cfg(not(feature = "policy"))]
        let ReaderStage { coordinator, dataset, io, pool, config, peers, start, clock, out, stop, stats, metrics } =
            self;
        let mut reader = Reader::new(Arc::clone(&dataset), io);
        if let Some(threads) = config.verify_threads {
            reader.set_verify_threads(threads);
        }
        reader.set_staging(pool);
        if let Some(coordinator) = &coordinator {
            reader.set_tier(TierReader::new(Arc::clone(coordinator.tier()), Some(Arc::clone(coordinator))));
        }
        reader.publish_stats(Arc::clone(&stats));
        if let Some(hook) = &config.repair {
            reader.set_repair(Arc::clone(hook));
        }
        let node = Node {
            coordinator: coordinator.as_ref(),
            peers,
            #[cfg(feature = "policy")]
            from_meter: from_meter.as_ref(),
        };
        reader.set_count_shard_reads(metrics.is_some());
        let queue = Queue { sender: &out, queued: metrics.as_ref().map(|m| &m.queued), clock: &clock };
        let outcome = run_epochs(&mut reader, &dataset, &config, start, queue, &stop, node);
        if let Some(coordinator) = &coordinator {
            coordinator.stop();
        }
        let _ = match outcome {
            Ok(()) => out.send(Message::End),
            Err(Some(error)) => out.send(Message::Failed(error)),
            Err(None) => Ok(()),
        };
    }
}

/// Where the reader stage puts batches, its count of them (for the queue's depth), and the
/// start's clock (the reader marks its stages up to the first batch queued).
struct Queue<'a> {
    sender: &'a SyncSender<Message>,
    queued: Option<&'a AtomicU64>,
    clock: &'a StartClock,
}

/// What a reader shares with the other ranks of its node.
struct Node<'a> {
    /// The memory tier's coordinator, when the loader uses the tier.
    coordinator: Option<&'a Arc<Coordinator>>,
    /// The node's other ranks (whose reads the tier's schedule and an origin cache's plan
    /// include); empty when this rank is alone or the node is not known.
    peers: Vec<World>,
    /// The trainer side's measures of each rebalance point, when the loader rebalances.
    #[cfg(feature = "policy")]
    from_meter: Option<&'a Receiver<rebalance::PointMeasures>>,
}

/// Reads epochs from `start`; `Err(None)` when stopped, `Err(Some(e))` on a failure.
fn run_epochs(
    reader: &mut Reader,
    dataset: &Arc<Dataset>,
    config: &LoaderConfig,
    start: Position,
    out: Queue<'_>,
    stop: &AtomicBool,
    node: Node<'_>,
) -> std::result::Result<(), Option<Error>> {
    #[cfg(feature = "policy")]
    let Node { coordinator, peers: node_peers, from_meter } = node;
    #[cfg(not(feature = "policy"))]
    let Node { coordinator, peers: node_peers } = node;
    let n_records = dataset.n_records();
    let mut planner = EpochPlanner::new(config, dataset).map_err(Some)?;
    out.clock.mark(StartStage::PlannerReady);
    let mut position = normalized(start, n_records);
    #[cfg(feature = "policy")]
    let mut rebalancing = match (&config.rebalance, from_meter) {
        (Some(rebalance), Some(from_meter)) => {
            Some(Rebalancing::start(rebalance, from_meter, &mut planner, config, position))
        }
        _ => None,
    };
    let end_epoch = config.epochs.map(|epochs| start.epoch.saturating_add(epochs));
    // Steps count this loader's batches across epochs: the tier's schedule is in them.
    let mut step = 0u64;
    let mut next_epoch: Option<Arc<EpochBatches>> = None;
    // The next epoch as the schedule's thread planned it, when the reader left it to that thread.
    let mut next_slot: Option<Arc<std::sync::OnceLock<Arc<EpochBatches>>>> = None;
    // The tier's schedule is computed on a thread of its own, off the path to the first batch.
    let scheduler =
        coordinator.map(|c| Scheduler::start(dataset, c, config, node_peers.clone())).transpose().map_err(Some)?;
    // An origin cache hears this rank's plan from here and the node's other ranks' from a thread.
    let node_plan = match config.repair.as_ref().filter(|hook| hook.wants_plan()) {
        Some(hook) => node_plan::NodePlan::start(dataset, config, Arc::clone(hook), node_peers).map_err(Some)?,
        None => None,
    };
    while end_epoch.is_none_or(|end| position.epoch < end) {
        if n_records == 0 {
            return Ok(());
        }
        #[cfg(feature = "policy")]
        let fresh = rebalancing.is_some();
        #[cfg(not(feature = "policy"))]
        let fresh = false;
        let planned_ahead = next_epoch.take().or_else(|| next_slot.take().and_then(|slot| slot.get().cloned()));
        let batches = match planned_ahead {
            // With rebalancing the next epoch was planned before this one's points changed the
            // weights: it is planned again with the weights now in force.
            Some(batches) if !fresh => batches,
            _ => Arc::new(planner.epoch(position).map_err(Some)?),
        };
        out.clock.mark(StartStage::EpochPlanned);
        let hook = config.repair.as_ref().filter(|hook| hook.wants_plan());
        let following = Position { epoch: position.epoch + 1, cursor: 0 };
        // The fillers (and an origin cache's prefetch) see this epoch's reads and the next
        // one's, so they keep (and load ahead) what the epoch after this needs first. The tier's
        // alone can wait: its schedule's thread plans it after the first batch (issue 44), unless
        // the plan changes with rebalancing (planned here, with the weights in force).
        let has_next = end_epoch.is_none_or(|end| following.epoch < end);
        if has_next && (hook.is_some() || (scheduler.is_some() && fresh)) {
            next_epoch = Some(Arc::new(planner.epoch(following).map_err(Some)?));
            out.clock.mark(StartStage::NextEpochPlanned);
        }
        if let Some(hook) = hook {
            // The first epoch's plan, then each following one's a whole epoch ahead.
            if step == 0 {
                hook.plan(step, &shards_by_step(dataset, &batches));
                if let Some(node_plan) = &node_plan {
                    node_plan.request(step, position);
                }
            }
            if let Some(next) = &next_epoch {
                hook.plan(step + batches.len() as u64, &shards_by_step(dataset, next));
                if let Some(node_plan) = &node_plan {
                    node_plan.request(step + batches.len() as u64, following);
                }
            }
        }
        if let Some(scheduler) = &scheduler {
            let next = match &next_epoch {
                Some(next) => Some((following, NextBatches::Planned(Arc::clone(next)))),
                None if has_next => {
                    let slot = Arc::new(std::sync::OnceLock::new());
                    next_slot = Some(Arc::clone(&slot));
                    Some((following, NextBatches::ToPlan(slot)))
                }
                None => None,
            };
            scheduler.request(ScheduleRequest { step, from: position, batches: Arc::clone(&batches), next });
        }
        #[cfg_attr(not(feature = "policy"), allow(unused_mut, reason = "moved only by rebalance points"))]
        let mut segment = batches;
        // Where in `segment` the batches still to read begin (a point that kept the weights
        // goes on in the same plan).
        #[cfg_attr(not(feature = "policy"), allow(unused_mut, reason = "moved only by rebalance points"))]
        let mut offset = 0usize;
        #[cfg_attr(
            not(feature = "policy"),
            allow(unused_mut, unused_variables, reason = "moved and read only at rebalance points")
        )]
        let mut from = position;
        #[cfg(feature = "policy")]
        if let Some(rebalancing) = &mut rebalancing {
            rebalancing.new_epoch(position.epoch);
            // A run resumed right at a point whose measures were saved applies them first.
            if rebalancing.apply_resumed_at(&mut planner, from, stop)? {
                segment = Arc::new(planner.epoch(from).map_err(Some)?);
            }
        }
        loop {
            // With rebalancing, the batches up to the next point; then the point's new weights
            // and the rest of the epoch planned with them.
            #[cfg(feature = "policy")]
            let point = rebalancing.as_ref().and_then(|r| r.next_point(from));
            #[cfg(not(feature = "policy"))]
            let point: Option<u64> = None;
            #[cfg(feature = "policy")]
            let take = match (point, &rebalancing) {
                (Some(point), Some(r)) => r.before_point(&segment[offset..], from.epoch, point),
                _ => segment.len() - offset,
            };
            #[cfg(not(feature = "policy"))]
            let take = segment.len() - offset;
            #[cfg(feature = "policy")]
            let weights = rebalancing.as_ref().map(|r| Arc::clone(&r.current));
            let tag = |after: Position| Tag {
                after,
                #[cfg(feature = "policy")]
                weights: weights.clone(),
            };
            read_segment(reader, &segment[offset..offset + take], config, &out, stop, coordinator, &mut step, &tag)?;
            #[cfg_attr(not(feature = "policy"), allow(unused_variables, reason = "no points without policies"))]
            let Some(point) = point else { break };
            #[cfg(feature = "policy")]
            if let Some(rebalancing) = &mut rebalancing {
                let moved = rebalancing.apply(&mut planner, from.epoch, point, stop)?;
                from = Position { epoch: from.epoch, cursor: rebalancing.grid.cursor_of(from.epoch, point) };
                if moved {
                    segment = Arc::new(planner.epoch(from).map_err(Some)?);
                    offset = 0;
                } else {
                    // The same weights plan the same batches: no plugin call, no wait.
                    offset += take;
                }
            }
        }
        position = Position { epoch: position.epoch + 1, cursor: 0 };
    }
    Ok(())
}

/// `start`, or the next epoch's start when `start` is at the end of its epoch.
fn normalized(start: Position, n_records: u64) -> Position {
    if start.cursor >= n_records { Position { epoch: start.epoch + 1, cursor: 0 } } else { start }
}

/// Reads `batches` and queues them, each tagged by `tag` with the position after it; `step`
/// counts this loader's batches (the tier's schedule is in them).
#[allow(clippy::too_many_arguments, reason = "the reader's state, lent for one segment")]
fn read_segment(
    reader: &mut Reader,
    batches: &[(Vec<u64>, Position)],
    config: &LoaderConfig,
    out: &Queue<'_>,
    stop: &AtomicBool,
    coordinator: Option<&Arc<Coordinator>>,
    step: &mut u64,
    tag: &dyn Fn(Position) -> Tag,
) -> std::result::Result<(), Option<Error>> {
    let positions = std::cell::RefCell::new(std::collections::VecDeque::new());
    let mut stopped = false;
    let planned = batches.iter().inspect(|(_, after)| {
        positions.borrow_mut().push_back(*after);
        if let Some(coordinator) = coordinator {
            coordinator.advance(*step);
        }
        *step += 1;
    });
    let outcome = reader.read_batches(planned.map(|(records, _)| records), config.read_depth, &mut |batch| {
        let Some(after) = positions.borrow_mut().pop_front() else {
            return Err(Error::invalid_input("a batch read that was not planned"));
        };
        if stop.load(Ordering::Acquire) {
            stopped = true;
            return Err(Error::invalid_input("stopped"));
        }
        if let Some(coordinator) = coordinator {
            coordinator.delivered();
        }
        let batch = Box::new(std::mem::take(batch));
        // Before it is sent: the trainer may take it at once.
        out.clock.mark(StartStage::FirstBatchRead);
        if out.sender.send(Message::Batch(batch, tag(after))).is_err() {
            stopped = true;
            return Err(Error::invalid_input("stopped"));
        }
        if let Some(queued) = out.queued {
            queued.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    if stopped {
        return Err(None);
    }
    outcome.map_err(Some)
}

/// Copies each verified batch to a device buffer on the loader's stream.
struct DeviceStage {
    stream: Stream,
    /// Oldest returned first: its consumer's work is the likeliest to be done.
    free: std::collections::VecDeque<Returned>,
    returned: Receiver<Returned>,
    input: Receiver<Message>,
    out: SyncSender<Message>,
    stop: Arc<AtomicBool>,
}

impl DeviceStage {
    fn run(mut self) {
        while let Ok(message) = self.input.recv() {
            let message = match message {
                Message::Batch(mut batch, tag) => match self.upload(&mut batch) {
                    Ok(upload) => Message::Uploaded(batch, upload, tag),
                    Err(error) => Message::Failed(error),
                },
                other => other,
            };
            let failed = matches!(message, Message::Failed(_));
            if self.out.send(message).is_err() || failed {
                return;
            }
        }
    }

    fn upload(&mut self, batch: &mut Batch) -> Result<Upload> {
        self.free.extend(self.returned.try_iter());
        // The trainer holds at most `hold_max` and the queue two, so one comes back, unless the
        // loader is being dropped while the trainer keeps its batches: then stop.
        let free = loop {
            if let Some(free) = self.free.pop_front() {
                break free;
            }
            match self.returned.recv_timeout(Duration::from_millis(10)) {
                Ok(free) => break free,
                Err(RecvTimeoutError::Timeout) if !self.stop.load(Ordering::Acquire) => {}
                Err(_) => return Err(Error::invalid_input("stopped")),
            }
        };
        let lease = batch.take_lease().ok_or_else(|| Error::invalid_input("a batch without a staging buffer"))?;
        // The trainer's kernels that read the buffer's last batch run before the copy into it
        // (and should the upload fail, it waits for them before the buffer goes).
        let buffer = free.after_fences_on(&self.stream)?;
        self.stream.upload(lease, buffer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_depth_fills_the_queue_within_the_page_locked_bound_unless_asked_for_more() {
        let io = IoConfig { queue_depth: 32, op_bytes_max: 1 << 20, ..IoConfig::default() };
        let config = LoaderConfig { io, ..LoaderConfig::default() };
        // 1 MiB batches in 64 MiB buffers (variable-length records): 32 fill the queue; locked,
        // 16 buffers are the 1 GiB bound.
        assert_eq!(reader_depth(&config, 1 << 20, 64 << 20, false), 32);
        assert_eq!(reader_depth(&config, 1 << 20, 64 << 20, true), 16);
        // Buffers the batches' size: no bound reached.
        assert_eq!(reader_depth(&config, 1 << 20, 1 << 20, true), 32);
        // Small batches: at most 64; large ones: at least the depth asked for.
        assert_eq!(reader_depth(&config, 4 << 10, 4 << 10, false), READ_DEPTH_MAX);
        assert_eq!(reader_depth(&config, 64 << 20, 64 << 20, false), 2);
        let asked = LoaderConfig { read_depth: 40, ..config };
        assert_eq!(reader_depth(&asked, 1 << 20, 64 << 20, true), 40);
    }
}
