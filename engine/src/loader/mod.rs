//! The loader: one rank's batches, verified, in staging memory and (with CUDA) on the GPU, ahead
//! of the trainer.
//!
//! Owns `Loader` (construction, sizing, `next`), the stage threads and the queues between them
//! (the stages themselves are `reader_stage.rs` and `device.rs`; what a loader is asked for is
//! `config.rs`, what it hands out `batch.rs`):
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

mod batch;
mod config;
mod device;
mod metrics;
mod node_plan;
mod packed;
mod planner;
#[cfg(feature = "policy")]
mod rebalance;
mod reader_stage;
mod schedule;
mod session;
mod start;
mod state;
mod store_plan;
mod tier_setting;

use batch::Returned;
pub use batch::{DeviceBatch, LoadedBatch, LoaderStats};
use config::check;
pub use config::{LoaderConfig, PlanSource, Target};
use device::DeviceStage;
pub use packed::{PackedBatch, Packer, Packing, pack_mixture, pack_plan};
use reader_stage::ReaderStage;
#[cfg(feature = "policy")]
use reader_stage::normalized;
use store_plan::origin_hook;
pub use store_plan::{plan_for_store, window_for_cache};

use metrics::{DatasetHeat, Live, LoaderMetrics};
use planner::{EpochBatches, EpochPlanner, PlanConfig, check_plan_memory, shards_by_step};
#[cfg(feature = "policy")]
pub use rebalance::{
    LocalExchange, MeasureExchange, RebalanceConfig, RebalanceState, TIME_SPREAD_MIN, WeightsAt, tells_ranks_apart,
};
pub use session::{PackedStep, Reads, Session, SessionConfig};
pub use start::{StartClock, StartStage};
pub use state::{OrderPairs, SavedMixture, SavedState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
pub use tier_setting::TierSetting;

use crate::error::{Error, Result};
use crate::io::{Fault, FaultIo, Io, LazyIo, OwnedMemory};
use crate::plan::Position;
#[cfg(feature = "policy")]
use crate::plan::World;
use crate::read::{Batch, Dataset, PublishedStats};
use crate::staging::cuda::{Cuda, Upload};
use crate::staging::{Pinning, StagingConfig, StagingPool};
use crate::tier::{Coordinator, MemoryTier, TierConfig};

enum Message {
    Batch(Box<Batch>, Tag),
    Uploaded(Box<Batch>, Upload, Tag),
    Failed(Error),
    /// The last epoch is done: a queue that closes without it means a stage died.
    End,
}

/// A batch as `Loader::receive` takes it from the queue: the batch, its upload, its tag, and
/// whether it was queued before the trainer asked.
type Received = (Box<Batch>, Option<Upload>, Tag, bool);

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
    repair: Option<Arc<dyn crate::read::ShardSource>>,
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
        check_plan_memory(config.plan.epoch_len(&dataset), config.world, config.batch_size)?;
        let repair = config.repair.clone();
        let cuda = cuda_for(config.target)?;
        let (batch_bytes, expected_batch_bytes) = batch_sizes(&config, &dataset)?;
        let coordinator = tier_coordinator(&config)?;
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
        let (meter, from_meter) = meter_of(&mut config, &dataset, start)?;
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
        let io = reader_io(&config, coordinator.is_some(), pinning, &clock)?;
        // Should a step below fail, the threads started so far end with it.
        let mut threads = Started { threads: Vec::new(), stop: Arc::clone(&stop), coordinator: coordinator.clone() };
        if let Some(coordinator) = &coordinator {
            threads.start_fillers(coordinator)?;
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
            Some(cuda) => threads.start_device(cuda, config.hold_max + 3, &pool, from_reader)?,
        };
        if let (Some(registry), Some(source)) = (&registry, &metrics) {
            register_metrics(registry, source, heat);
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
        self.receiver.as_ref()?;
        let now = Instant::now();
        let first = *self.first_next.get_or_insert(now);
        let (batch, upload, tag, ready) = match self.receive(now)? {
            Ok(received) => received,
            Err(error) => return Some(Err(error)),
        };
        let stall = now.elapsed();
        self.stats.stall += stall;
        self.stats.stall_max = self.stats.stall_max.max(stall);
        self.stats.elapsed = first.elapsed();
        let position = tag.after;
        debug_assert!(
            (position.epoch, position.cursor) > (self.position.epoch, self.position.cursor),
            "batches come in plan order: {position:?} after {:?}",
            self.position
        );
        self.clock.mark(StartStage::FirstBatchTaken);
        if let Some(coordinator) = &self.coordinator {
            coordinator.consumed();
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

    /// The next message for the trainer, `now` being when it asked: a batch (with its upload,
    /// its tag and whether it was queued already), the stream's error, or its end (`None`). A
    /// batch the reader cut past a rebalance point before it knew the point's weights, which
    /// then told the ranks apart, is dropped here: the reader reads that step again.
    fn receive(
        &mut self,
        #[cfg_attr(not(feature = "policy"), allow(unused_variables, reason = "only rebalancing times the step"))]
        now: Instant,
    ) -> Option<Result<Received>> {
        let mut ready = true;
        #[cfg_attr(
            not(feature = "policy"),
            allow(clippy::never_loop, reason = "only a rebalancing loader drops a batch and takes another")
        )]
        loop {
            let receiver = self.receiver.as_ref()?;
            let message = match receiver.try_recv() {
                Ok(message) => message,
                Err(TryRecvError::Empty) => {
                    ready = false;
                    receiver.recv().unwrap_or_else(|_| died())
                }
                Err(TryRecvError::Disconnected) => died(),
            };
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
            #[cfg(feature = "policy")]
            if let Some(meter) = &mut self.meter {
                match meter.handing_out(tag.after, tag.weights.as_deref(), now) {
                    Ok(true) => {}
                    Ok(false) => {
                        // Not the trainer's: its staging lease and device buffer go back at once
                        // (no work was queued on them), and the tier's pace is not sampled.
                        if let Some(upload) = upload {
                            batch::give_back(upload, Vec::new(), false, self.returns.as_ref());
                        }
                        drop(batch);
                        self.stats.recut += 1;
                        if let Some(metrics) = &self.metrics {
                            metrics.recut();
                        }
                        continue;
                    }
                    Err(error) => {
                        // The ranks could not agree on their measures: the stream ends with the error.
                        self.finished = true;
                        self.stop.store(true, Ordering::Release);
                        return Some(Err(error));
                    }
                }
            }
            return Some(Ok((batch, upload, tag, ready)));
        }
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
    /// The tier's fill threads; one that cannot start leaves its work to the others, or to the
    /// disk reads.
    fn start_fillers(&mut self, coordinator: &Arc<Coordinator>) -> Result<()> {
        for i in 0..coordinator.tier().fill_threads() {
            let coordinator = Arc::clone(coordinator);
            self.push(spawn(&format!("granary-fill-{i}"), move || {
                let _ = crate::tier::run_filler(&coordinator);
            })?);
        }
        Ok(())
    }

    /// The device stage: `buffers` device buffers of the pool's size, copies of what comes
    /// `from_reader`; returns the queue to the trainer and the way buffers come back.
    fn start_device(
        &mut self,
        cuda: &'static Cuda,
        buffers: usize,
        pool: &StagingPool,
        from_reader: Receiver<Message>,
    ) -> Result<(Receiver<Message>, Option<Sender<Returned>>)> {
        let (to_trainer, receiver) = std::sync::mpsc::sync_channel(2);
        let (returns, returned) = std::sync::mpsc::channel();
        let stream = cuda.stream()?;
        let free = (0..buffers)
            .map(|_| {
                let buffer = cuda.alloc(pool.buffer_bytes())?;
                Ok(Returned { buffer: Some(buffer), fences: Vec::new(), after_all_work: false })
            })
            .collect::<Result<_>>()?;
        let device =
            DeviceStage { stream, free, returned, input: from_reader, out: to_trainer, stop: Arc::clone(&self.stop) };
        self.push(spawn("granary-device", move || device.run())?);
        Ok((receiver, Some(returns)))
    }

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

/// A batch's staging buffer (`batch_bytes`: room for the most records a rank reads of a step)
/// and what a batch is expected to take, for the reader's depth.
/// The CUDA device `target` loads to: none for the host, the process's if it has one for
/// `Auto`, and for `Gpu` the process's or an error saying why there is none.
fn cuda_for(target: Target) -> Result<Option<&'static Cuda>> {
    Ok(match target {
        Target::Host => None,
        Target::Auto => Cuda::get(),
        Target::Gpu => Some(Cuda::get().ok_or_else(|| Error::NoGpu {
            detail: format!(
                "loading to the GPU needs CUDA: {}",
                Cuda::unavailable_reason().unwrap_or_else(|| "not available".to_owned())
            ),
        })?),
    })
}

/// The rebalancing meter of `config` (none without rebalancing) and the reader's end of its
/// measures; a resumed state is fitted to the grid of points from `start`.
#[cfg(feature = "policy")]
type MeterEnds = (Option<rebalance::Meter>, Option<Receiver<rebalance::PointMeasures>>);

#[cfg(feature = "policy")]
fn meter_of(config: &mut LoaderConfig, dataset: &Dataset, start: Position) -> Result<MeterEnds> {
    let (world, epoch_len) = (config.world, config.plan.epoch_len(dataset));
    let step_len = u64::from(world.size()).saturating_mul(config.batch_size);
    let Some(rebalancing) = &mut config.rebalance else { return Ok((None, None)) };
    rebalancing.check(world.size())?;
    let grid = rebalance::Grid::new(step_len, epoch_len, rebalancing.every, normalized(start, epoch_len));
    rebalancing.fit_resume(world.size(), &grid);
    let (to_reader, from_meter) = std::sync::mpsc::channel();
    let meter = rebalance::Meter::new(world, rebalancing, grid, to_reader);
    Ok((Some(meter), Some(from_meter)))
}

/// Puts a loader's metrics in `registry`, with the skew across ranks and its dataset's heat
/// (once per dataset).
fn register_metrics(
    registry: &crate::metrics::Registry,
    source: &Arc<LoaderMetrics>,
    (key, heat): (String, Option<DatasetHeat>),
) {
    crate::metrics::on_fork_in_child(crate::read::forget_shard_reads);
    registry.register(Arc::clone(source) as Arc<dyn crate::metrics::Source>);
    registry.derive("skew", metrics::derive_skew);
    if let Some(heat) = heat {
        registry.register_once(&key, || Arc::new(heat));
    }
}

fn batch_sizes(config: &LoaderConfig, dataset: &Dataset) -> Result<(usize, usize)> {
    let batch_records = config.batch_positions_max();
    let batch_bytes = match (config.batch_bytes_max, dataset.layout().record_bytes()) {
        (Some(bytes), _) => bytes,
        (None, Some(record)) => usize::try_from(record.saturating_mul(batch_records))
            .map_err(|_| Error::invalid_input("a batch larger than memory"))?,
        (None, None) => {
            BATCH_BYTES_VARIABLE.saturating_mul(usize::try_from(batch_records / config.batch_size.max(1)).unwrap_or(1))
        }
    };
    // What a batch is expected to take, for the depth: exact for fixed-size records; for
    // variable-length ones the manifest's mean record (shard file bytes over records, a
    // slight over-estimate) times the batch, not the buffer's bound, so that a corpus of
    // documents in 1 MiB batches keeps as many bytes in flight as one of fixed records.
    let expected_batch_bytes = match dataset.layout().record_bytes() {
        Some(record) => record.saturating_mul(config.batch_size),
        None => dataset.manifest().file_bytes().div_ceil(dataset.n_records().max(1)).saturating_mul(config.batch_size),
    };
    let expected_batch_bytes = usize::try_from(expected_batch_bytes).unwrap_or(usize::MAX).clamp(1, batch_bytes.max(1));
    Ok((batch_bytes, expected_batch_bytes))
}

/// The memory tier's coordinator the loader reads through, if any (`config.tier`).
fn tier_coordinator(config: &LoaderConfig) -> Result<Option<Arc<Coordinator>>> {
    // Injected faults on reads act on disk reads, which the tier would bypass: those drills
    // read from disk. Faults on fills need the tier.
    let mut coordinator = if config.faults.iter().any(Fault::on_reads) {
        None
    } else {
        config.tier.open()?.map(|tier| Coordinator::with_faults(tier, config.faults.clone(), &config.io))
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
            .map(|tier| Coordinator::with_faults(tier, config.faults.clone(), &config.io));
    }
    Ok(coordinator)
}

/// The reader's disk backend. With the tier (`tiered`), the default one (its read slots are as
/// large as all of the loader's batches) starts at the first record not served from memory, if
/// one comes; a backend asked for by name is started here, so that one this machine refuses
/// fails the construction.
fn reader_io(config: &LoaderConfig, tiered: bool, pinning: Pinning, clock: &Arc<StartClock>) -> Result<Box<dyn Io>> {
    if tiered && config.io.backend == crate::io::Backend::Auto {
        let (for_io, clock) = (config.clone(), Arc::clone(clock));
        return Ok(Box::new(LazyIo::new(
            config.io,
            Box::new(move || {
                let io = build_io(&for_io, pinning)?;
                clock.mark(StartStage::IoReady);
                Ok(io)
            }),
        )));
    }
    let io = build_io(config, pinning)?;
    clock.mark(StartStage::IoReady);
    Ok(io)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::IoConfig;

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
