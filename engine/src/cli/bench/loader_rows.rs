//! The rows of `granary bench loader`: each one's measurement (the bare reader, the loader from
//! disk, warm and from the tier, the gather from a memory map, the partial tier against Belady's
//! bound, the pinned copy), and the process's CPU time and page cache around them.
//!
//! Owns `Sample` and the `measure_*` functions. Never: chooses which rows run or reports them
//! (`loader.rs` does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use granary::io::MappedFile;
use granary::io::bare::{BareOp, BareReader};
use granary::loader::{Loader, LoaderConfig, PlanSource, StartStage, Target, TierSetting};
use granary::shard::DATA_OFFSET;
use granary::staging::cuda::Cuda;
use granary::staging::{Pinning, StagingConfig, StagingPool};
use granary::tier::{MemoryTier, TierConfig, TierKind};
use granary::{Dataset, IoConfig, Order, Position};

use crate::cli::show::bytes;

/// One measurement: bytes delivered, time, CPU seconds.
#[derive(Clone, Copy, Default)]
pub(super) struct Sample {
    pub(super) bytes: u64,
    pub(super) seconds: f64,
    pub(super) cpu: f64,
    /// Stall rows: the stall fraction after the first batch (whose wait is the pipeline filling).
    pub(super) steady: f64,
    /// Disk rows of the loader: seconds from building it to its first batch (not in `seconds`).
    pub(super) start: f64,
    /// Rows with a `start`: when each stage of it ended (`StartStage::ALL`'s order), in seconds
    /// from `Loader::new`; `None` for a stage not passed.
    pub(super) stages: [Option<f64>; StartStage::ALL.len()],
}

impl Sample {
    pub(super) fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

pub(super) fn measure_bare(reader: &mut BareReader, ops: &[BareOp], record_bytes: u64, cold: bool) -> Result<Sample> {
    if cold {
        drop_page_cache();
    }
    let cpu = cpu_seconds();
    let start = Instant::now();
    reader.run(ops)?;
    Ok(Sample {
        bytes: record_bytes,
        seconds: start.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - cpu,
        ..Sample::default()
    })
}

/// Runs a loader for `batches` batches against the disk, as the bare reader is measured: its rate
/// from the first batch on (the bare reader's setup is not timed either), and its start (built,
/// threads and buffers up, plugin compiled, first batch read) in `start`, reported on its own.
pub(super) fn measure_disk_loader(
    dataset: &Arc<Dataset>,
    config: LoaderConfig,
    batches: u64,
    cold: bool,
) -> Result<Sample> {
    if cold && config.io.direct {
        drop_page_cache();
    }
    let began = Instant::now();
    let mut loader = Loader::new(Arc::clone(dataset), config, Position::default())?;
    drop(loader.next().context("an empty epoch")??);
    let start = began.elapsed().as_secs_f64();
    let stages = stage_times(&loader);
    let cpu = cpu_seconds();
    let timed = Instant::now();
    let mut delivered = 0u64;
    for _ in 1..batches {
        let batch = loader.next().context("the epoch ended early")??;
        if let Some(device) = batch.device() {
            device.wait()?;
        }
        delivered += batch.data().len() as u64;
    }
    Ok(Sample {
        bytes: delivered,
        seconds: timed.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - cpu,
        steady: 0.0,
        start,
        stages,
    })
}

/// When each stage of `loader`'s start ended, in seconds, in `StartStage::ALL`'s order.
pub(super) fn stage_times(loader: &Loader) -> [Option<f64>; StartStage::ALL.len()] {
    let marks = loader.start_stages();
    StartStage::ALL.map(|stage| marks.iter().find(|&&(s, _)| s == stage).map(|&(_, at)| at.as_secs_f64()))
}

/// Runs a loader for `batches` batches; with `step_us`, the consumer busies itself that long
/// per batch and the sample's `cpu` carries the stall fraction instead.
pub(super) fn measure_loader(
    dataset: &Arc<Dataset>,
    config: LoaderConfig,
    batches: u64,
    step_us: u64,
    cold: bool,
) -> Result<Sample> {
    // Warm rows keep the page cache.
    if cold && config.io.direct {
        drop_page_cache();
    }
    let cpu = cpu_seconds();
    let start = Instant::now();
    let mut loader = Loader::new(Arc::clone(dataset), config, Position::default())?;
    let mut delivered = 0u64;
    let mut first_stall = Duration::ZERO;
    let mut first_batch = 0.0;
    let mut stages = Default::default();
    for i in 0..batches {
        let batch = loader.next().context("the epoch ended early")??;
        if i == 0 {
            first_stall = batch.stall();
            first_batch = start.elapsed().as_secs_f64();
            stages = stage_times(&loader);
        }
        if let Some(device) = batch.device() {
            device.wait()?;
        }
        delivered += batch.data().len() as u64;
        if step_us > 0 {
            let until = Instant::now() + Duration::from_micros(step_us);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    let stats = loader.stats();
    drop(loader);
    let steady = (stats.stall - first_stall).as_secs_f64() / seconds;
    Ok(Sample {
        bytes: delivered,
        seconds,
        cpu: if step_us > 0 { stats.stall_fraction() } else { cpu },
        steady,
        start: first_batch,
        stages,
    })
}

/// A warm epoch as a trainer sees it: the loader already running (its start, and its first
/// batch, not timed), then `batches` batches.
pub(super) fn measure_warm_loader(dataset: &Arc<Dataset>, config: LoaderConfig, batches: u64) -> Result<Sample> {
    let mut loader = Loader::new(Arc::clone(dataset), config, Position::default())?;
    drop(loader.next().context("an empty epoch")??);
    let cpu = cpu_seconds();
    let start = Instant::now();
    let mut delivered = 0u64;
    for _ in 0..batches {
        let batch = loader.next().context("the epoch ended early")??;
        delivered += batch.data().len() as u64;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Sample { bytes: delivered, seconds, cpu: cpu_seconds() - cpu, ..Sample::default() })
}

/// What the tier's memory alone costs: `bytes` of extent-sized files in the tier's directory,
/// allocated and mapped as a fill does (no disk, no checks), on two threads, then removed. On a
/// machine where page allocation is slower than the disk this is the cold epoch's real floor.
pub(super) fn measure_tier_memory(tier: &MemoryTier, bytes: u64) -> Result<Sample> {
    let extent = tier.extent_bytes();
    let dir = tier.dir().context("a memory tier's directory")?;
    let n = bytes.div_ceil(extent);
    let cpu = cpu_seconds();
    let start = Instant::now();
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n {
                            return Ok(());
                        }
                        let path = dir.join(format!(".bench-floor-{i}"));
                        let file = std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .open(&path)?;
                        let len = usize::try_from(extent.min(bytes - i * extent))?;
                        drop(granary::io::WritableMap::new(&file, len, &path)?);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().map_err(|_| anyhow::anyhow!("a floor worker panicked"))??;
        }
        Ok(())
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    for i in 0..n {
        let _ = std::fs::remove_file(dir.join(format!(".bench-floor-{i}")));
    }
    Ok(Sample { bytes, seconds, cpu, ..Sample::default() })
}

/// What `np.memmap` does: the records of `order`, batch by batch, gathered into one buffer from
/// read-only maps of the shard files (page cache dropped first when `cold`). No checks. The maps
/// are the caller's, kept across measurements as a trainer keeps its `np.memmap`, as the tier's
/// mappings are kept by the process.
pub(super) fn measure_gather(
    dataset: &Dataset,
    maps: &[MappedFile],
    order: &[u64],
    batch: u64,
    cold: bool,
) -> Result<Sample> {
    if cold {
        drop_page_cache();
    }
    let cpu = cpu_seconds();
    let start = Instant::now();
    let mut ranges = Vec::with_capacity(order.len());
    for &index in order {
        let (shard, local) = dataset.locate(index)?;
        let range = dataset.shard_meta(shard)?.record_range(local);
        let offset = usize::try_from(DATA_OFFSET + range.start)?;
        ranges.push((shard, offset, usize::try_from(range.end - range.start)?));
    }
    let batch = usize::try_from(batch)?;
    let mut out = vec![0u8; ranges.iter().take(batch).map(|r| r.2).sum::<usize>().max(1)];
    let mut delivered = 0u64;
    for chunk in ranges.chunks(batch) {
        let mut at = 0;
        for &(shard, offset, len) in chunk {
            if at + len > out.len() {
                out.resize(at + len, 0);
            }
            out[at..at + len].copy_from_slice(&maps[shard].as_slice()[offset..offset + len]);
            at += len;
        }
        std::hint::black_box(&out);
        delivered += at as u64;
    }
    Ok(Sample {
        bytes: delivered,
        seconds: start.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - cpu,
        ..Sample::default()
    })
}

/// The plans the tier-partial rows run: a record-level shuffle, and the elastic partitioner's
/// window of a quarter of the shards (chunks of 64 records).
pub(super) fn partial_plans(dataset: &Dataset) -> [(String, PlanSource); 2] {
    let window = (dataset.n_shards() / 4).max(1);
    let windowed = PlanSource::Partitioner {
        plugin: None,
        options: vec![("window-shards".into(), window.to_string()), ("chunk-records".into(), "64".into())],
    };
    [
        ("shuffled".to_owned(), PlanSource::Native(Order::Shuffled)),
        (format!("windowed ({window} shards, chunks of 64)"), windowed),
    ]
}

/// The tier at half the dataset's bytes over `--partial-epochs` epochs of `plan`: its hit ratio
/// (records served from memory) against Belady's on the same extent reads at the same capacity,
/// for a tier of `kind` read `epochs` times.
#[allow(clippy::too_many_arguments, reason = "one row's settings")]
pub(super) fn measure_partial(
    dataset: &Arc<Dataset>,
    base: &LoaderConfig,
    io: IoConfig,
    tier_config: &dyn Fn(TierKind, u64) -> TierConfig,
    data_bytes: u64,
    (kind, epochs): (TierKind, u64),
    label: &str,
    plan: PlanSource,
) -> Result<String> {
    let config = tier_config(kind, data_bytes / 2);
    let extent_bytes = config.extent_bytes;
    let tier = MemoryTier::open(&config)?.context("a tier of >0 bytes")?;
    tier.clear()?;
    let epochs = epochs.max(1);
    let loader_config = LoaderConfig {
        plan,
        seed: 1,
        io,
        read_depth: 4,
        target: Target::Host,
        epochs: Some(epochs),
        tier: TierSetting::Shared(Arc::clone(&tier)),
        ..base.clone()
    };
    let start = Instant::now();
    let mut loader = Loader::new(Arc::clone(dataset), loader_config, Position::default())?;
    let mut trace = Vec::new();
    while let Some(batch) = loader.next() {
        let batch = batch?;
        for &index in batch.indices() {
            let (shard, local) = dataset.locate(index)?;
            let range = dataset.shard_meta(shard)?.record_range(local);
            trace.push(((shard as u64) << 32) | (range.start / extent_bytes));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = loader.stats();
    drop(loader);
    let tier_stats = tier.stats();
    tier.clear()?;
    let capacity = usize::try_from(data_bytes / 2 / extent_bytes)?;
    let (belady_hits, belady_loads) = belady(&trace, capacity);
    let belady = belady_hits as f64 / trace.len() as f64;
    let hits = stats.read.tier_records as f64 / stats.read.records as f64;
    Ok(format!(
        "tier at half the dataset, {epochs} {label} epochs ({capacity} extents of {} fit): hit ratio {hits:.3} \
         with {} extents loaded ({}, {} evicted, {seconds:.1} s); Belady's {belady:.3} loads {belady_loads} ({}): \
         ratio {:.3}, target >= 0.98",
        bytes(extent_bytes),
        tier_stats.extents_loaded,
        bytes(tier_stats.bytes_loaded),
        tier_stats.extents_evicted,
        bytes(belady_loads * extent_bytes),
        hits / belady,
    ))
}

/// Hits and loads of Belady's MIN on `trace` at `capacity` items, an item used later than
/// every resident one read through (`policy::trace::min` with `bypass`, as the tier declines
/// such an admission).
pub(super) fn belady(trace: &[u64], capacity: usize) -> (u64, u64) {
    let accesses: Vec<granary::policy::trace::Access> = trace
        .iter()
        .enumerate()
        .map(|(i, &key)| granary::policy::trace::Access { key, bytes: 1, group: i as u64 })
        .collect();
    let outcome = granary::policy::trace::min(&accesses, capacity as u64, true);
    (outcome.hits, outcome.loads)
}

/// A page-locked buffer of `batch_bytes` copied to the GPU `batches` times.
pub(super) fn measure_pinned_copy(batch_bytes: u64, batches: u64) -> Result<Sample> {
    let cuda = Cuda::get().context("no CUDA")?;
    let len = usize::try_from(batch_bytes)?;
    let pool = StagingPool::new(StagingConfig { buffers: 1, buffer_bytes: len, pinning: Pinning::Required })?;
    let stream = cuda.stream()?;
    let (mut lease, mut buffer) = (pool.acquire(), cuda.alloc(len)?);
    lease.set_len(len)?;
    let cpu = cpu_seconds();
    let start = Instant::now();
    for _ in 0..batches {
        (lease, buffer) = stream.upload(lease, buffer)?.into_parts()?;
    }
    Ok(Sample {
        bytes: batch_bytes * batches,
        seconds: start.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - cpu,
        ..Sample::default()
    })
}

/// This process's user + system CPU seconds (from /proc, in the kernel's fixed 100 Hz units).
pub(super) fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the parenthesised command name: state is field 3; utime and stime are 14, 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// Asks the kernel to drop clean page-cache pages; returns whether it could (root only).
pub(super) fn drop_page_cache() -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}
