//! `granary bench cache`: a dataset several times the cache, read for a few epochs from a slow
//! origin through the cache, once per evictor, against Belady's minimum for the same plan.
//!
//! The origin is object_store's in-memory store behind its `ThrottledStore` (a wait per
//! request and per byte; a shard is fetched with 8 ranged reads in flight, so the per-request
//! rate is an eighth of the shard fetch rate asked for). The trainer is a sleep of fixed length
//! per batch. Reported per evictor: the hit ratio (shard accesses found here without the read
//! waiting), bytes from the origin and that as a multiple of Belady's minimum on the access
//! trace the run recorded, the wait for the first batch (the plan made, the first shards
//! fetched) and the data stall after it (the trainer's waits for batches, as a share of the run
//! from the first batch on).
//!
//! Owns: `CacheArgs` and `cache` (the command), the scratch stores it makes under the root
//! (`source/`, and a `here-<row>/` per row, removed after the row), the cache told no plan
//! (`Unplanned`), the traces of `--trace-out`, and Belady's minimum (`belady_bytes`). Never: talks
//! to a real origin or the network (the origin is object_store's in-memory store), or touches
//! anything under the root but its own directories.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use granary::loader::{Loader, LoaderConfig, PlanSource, Target};
use granary::origin::{self, Origin, OriginCache};
use granary::{Granary, Position, ShardId, StorePaths, VersionSpec};

use crate::cli::parse_size;
use crate::cli::show::bytes;

#[derive(Args)]
pub(crate) struct CacheArgs {
    /// The dataset's size (random 4 KiB records).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    generate: u64,
    /// Bytes of record data per shard.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    shard_bytes: u64,
    /// The cache as a share of the dataset.
    #[arg(long, default_value_t = 0.25)]
    cache_fraction: f64,
    /// How fast one shard comes from the origin, bytes per second.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    bandwidth: u64,
    /// The origin's latency per request, in milliseconds.
    #[arg(long, default_value_t = 20)]
    latency_ms: u64,
    /// Records (4 KiB) per batch.
    #[arg(long, default_value_t = 64)]
    batch: u64,
    /// The training step per batch, in milliseconds.
    #[arg(long, default_value_t = 10)]
    step_ms: u64,
    /// Epochs read.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Shards in the elastic partitioner's window (0: the loader's default, one less than the
    /// shards the cache holds).
    #[arg(long, default_value_t = 0)]
    window_shards: u64,
    /// The evictors compared.
    #[arg(long, value_delimiter = ',', default_value = "plan-aware,lru,s3-fifo")]
    evictors: Vec<String>,
    /// One more row: this evictor with the cache not told the plan (no prefetch, no next use:
    /// a shard fetched when a read misses it, as Mosaic Streaming's LRU cache does); `none`
    /// for no such row.
    #[arg(long, default_value = "lru")]
    baseline: String,
    /// Writes each run's shard access trace to DIR/EVICTOR.oracleGeneral.bin (libCacheSim's
    /// format; a shard is an object), for `plugin sim` and libCacheSim to replay.
    #[arg(long, value_name = "DIR")]
    trace_out: Option<std::path::PathBuf>,
}

const RECORD_BYTES: u64 = 4096;

pub(crate) fn cache(root: &Path, args: &CacheArgs) -> Result<()> {
    if !(args.cache_fraction > 0.0 && args.cache_fraction < 1.0) {
        bail!("--cache-fraction {}: between 0 and 1", args.cache_fraction);
    }
    if args.bandwidth == 0 || args.batch == 0 || args.epochs == 0 {
        bail!("--bandwidth, --batch and --epochs must be above zero");
    }
    std::fs::create_dir_all(root).with_context(|| format!("create {}", root.display()))?;
    let source = root.join("source");
    if source.exists() {
        std::fs::remove_dir_all(&source).with_context(|| format!("remove {}", source.display()))?;
    }
    super::replication::make_dataset(&source, "bench-cache", args.generate, args.shard_bytes, 7)?;
    let source_paths = StorePaths::new(&source);
    let spec = VersionSpec::parse("bench-cache")?;
    let manifest = source_paths.read_manifest(source_paths.resolve(&spec)?.0)?;
    let dataset_bytes: u64 = manifest.entries().iter().map(|e| e.file_bytes).sum();
    let shard_max = manifest.entries().iter().map(|e| e.file_bytes).max().unwrap_or(0);
    let bound = ((dataset_bytes as f64 * args.cache_fraction) as u64).max(shard_max);
    let cache_shards = (bound / shard_max.max(1)).max(1);
    let window =
        if args.window_shards > 0 { args.window_shards } else { granary::loader::window_for_cache(bound, shard_max) };
    let slow = throttled_origin(args)?;
    origin::push(&source_paths, &spec, &slow, &|_| {})?;
    let batch_bytes = args.batch * RECORD_BYTES;
    let consumed = batch_bytes as f64 / (args.step_ms.max(1) as f64 / 1000.0);
    outln!(
        "bench cache: {} in {} shards, cache {} ({:.0}%, {cache_shards} shards), window {window} shards, \
         {} epochs; origin {}/s per shard fetch, {} ms per request; training consumes {}/s ({} per {} ms step)",
        bytes(dataset_bytes),
        manifest.entries().len(),
        bytes(bound),
        100.0 * bound as f64 / dataset_bytes as f64,
        args.epochs,
        bytes(args.bandwidth),
        args.latency_ms,
        bytes(consumed as u64),
        bytes(batch_bytes),
        args.step_ms
    )?;
    outln!(
        "{:<12} {:>9} {:>14} {:>10} {:>7} {:>8} {:>9} {:>8} {:>8} {:>12}",
        "EVICTOR",
        "HIT RATIO",
        "FROM ORIGIN",
        "x BELADY",
        "FIRST",
        "STALL",
        "RUN",
        "FETCHES",
        "AHEAD",
        "READS WAITED"
    )?;
    // The floor: the same plan read from a local copy of the dataset, no origin, no cache.
    let local = read_epochs(granary::Dataset::open(&source_paths, &spec)?, None, args, window)?;
    outln!(
        "{:<12} {:>9} {:>14} {:>10} {:>6.2}s {:>7.1}% {:>8.1}s {:>8} {:>8} {:>12}",
        "(local)",
        "-",
        "-",
        "-",
        local.first.as_secs_f64(),
        100.0 * local.stall_fraction,
        local.elapsed.as_secs_f64(),
        "-",
        "-",
        "-"
    )?;
    let mut rows: Vec<(String, &str, bool)> = args.evictors.iter().map(|e| (e.clone(), e.as_str(), true)).collect();
    if args.baseline != "none" {
        rows.push((format!("{} no plan", args.baseline), args.baseline.as_str(), false));
    }
    for (label, evictor, planned) in rows {
        let attached = Attached { root, slow: &slow, spec: &spec, bound, window };
        attached.run(&label, evictor, planned, args)?;
    }
    outln!(
        "(x BELADY: bytes from the origin over Belady's for the same access trace and cache, evicting the shard \
         next used farthest ahead; the dataset once is {})",
        bytes(dataset_bytes)
    )?;
    Ok(())
}

/// An evictor's run: a store that attaches the dataset pushed to the slow origin, with a cache
/// of `bound` bytes, read through a window of `window` shards.
struct Attached<'a> {
    root: &'a Path,
    slow: &'a Arc<Origin>,
    spec: &'a VersionSpec,
    bound: u64,
    window: u64,
}

impl Attached<'_> {
    /// Reads the epochs through a cache run by `evictor` (told the plan, or not) and prints its
    /// row.
    fn run(&self, label: &str, evictor: &str, planned: bool, args: &CacheArgs) -> Result<()> {
        let here = self.root.join(format!("here-{}", label.replace(' ', "-")));
        if here.exists() {
            std::fs::remove_dir_all(&here)?;
        }
        {
            let mut granary = Granary::create(&here)?;
            origin::attach(&mut granary, self.slow, self.spec, Some(self.bound), Some(evictor))?;
        }
        let paths = StorePaths::new(&here);
        let cache = OriginCache::open_with(&paths, Some(evictor), &[], &[Arc::clone(self.slow)])?
            .context("the dataset was just attached")?;
        cache.record_trace();
        let dataset = granary::Dataset::open(&paths, self.spec)?;
        let hook: Arc<dyn granary::ShardSource> =
            if planned { Arc::clone(&cache) as _ } else { Arc::new(Unplanned(Arc::clone(&cache))) };
        let run = read_epochs(dataset, Some(hook), args, self.window)?;
        let stats = cache.stats();
        let hit_ratio = stats.hit_ratio();
        let trace = cache.trace();
        let minimum = belady_bytes(&trace, self.bound, &|id| cache.shard_bytes(id).unwrap_or(0));
        if let Some(dir) = &args.trace_out {
            write_trace(&dir.join(format!("{}.oracleGeneral.bin", label.replace(' ', "-"))), &trace, &|id| {
                cache.shard_bytes(id).unwrap_or(0)
            })?;
        }
        outln!(
            "{label:<12} {hit_ratio:>9.3} {:>14} {:>8.2} x {:>6.2}s {:>7.1}% {:>8.1}s {:>8} {:>8} {:>11.1}s",
            bytes(stats.bytes_from_origin),
            stats.bytes_from_origin as f64 / minimum.max(1) as f64,
            run.first.as_secs_f64(),
            100.0 * run.stall_fraction,
            run.elapsed.as_secs_f64(),
            stats.shards_fetched,
            stats.prefetched,
            stats.fetch_wait.as_secs_f64()
        )?;
        drop(cache);
        std::fs::remove_dir_all(&here)?;
        Ok(())
    }
}

/// The origin: object_store's in-memory store behind its throttle (reads wait, writes do not),
/// so the push is quick and every fetch pays the latency and the bandwidth.
fn throttled_origin(args: &CacheArgs) -> Result<Arc<Origin>> {
    let throttle = object_store::throttle::ThrottleConfig {
        wait_get_per_call: Duration::from_millis(args.latency_ms),
        wait_get_per_byte: Duration::from_secs_f64(8.0 / args.bandwidth as f64),
        ..Default::default()
    };
    granary::origin::install_tls_provider();
    let memory = object_store::memory::InMemory::new();
    let url = "memory://bench-cache".to_owned();
    Ok(Arc::new(Origin::with_store(
        Arc::new(object_store::throttle::ThrottledStore::new(memory, throttle)),
        object_store::path::Path::default(),
        url,
    )?))
}

/// The cache as a hook that is not told the plan: it fetches what a read misses and hears the
/// accesses, with no next use and nothing fetched ahead.
#[derive(Debug)]
struct Unplanned(Arc<OriginCache>);

impl granary::ShardSource for Unplanned {
    fn repair(&self, shard: ShardId, cause: &granary::Error) -> granary::Result<()> {
        self.0.repair(shard, cause)
    }

    fn accessed(&self, shards: &[ShardId]) {
        self.0.accessed(shards);
    }

    fn in_flight(&self, batches: u64) {
        self.0.in_flight(batches);
    }

    fn cache_stats(&self) -> Option<granary::CacheStats> {
        self.0.cache_stats()
    }
}

/// How one read of the epochs went.
struct Run {
    /// The wait for the first batch (the plan made, the first shards read or fetched).
    first: Duration,
    /// The trainer's waits for the later batches, as a share of the run from the first on.
    stall_fraction: f64,
    /// The whole run.
    elapsed: Duration,
}

/// Reads `args.epochs` epochs of `dataset` under the windowed plan, a sleep of `args.step_ms`
/// per batch standing for the training step, through `repair` (the cache) when given.
fn read_epochs(
    dataset: Arc<granary::Dataset>,
    repair: Option<Arc<dyn granary::ShardSource>>,
    args: &CacheArgs,
    window: u64,
) -> Result<Run> {
    let config = LoaderConfig {
        batch_size: args.batch,
        seed: 11,
        plan: PlanSource::Partitioner {
            plugin: Some("elastic".to_owned()),
            options: vec![("window-shards".to_owned(), window.to_string())],
        },
        epochs: Some(args.epochs),
        target: Target::Host,
        // The disk cache alone: the memory tier would serve later epochs from memory.
        tier: granary::TierSetting::Off,
        repair,
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(dataset, config, Position::default())?;
    let started = Instant::now();
    let first = loader.next().transpose()?.map(drop).map(|()| started.elapsed()).unwrap_or_default();
    std::thread::sleep(Duration::from_millis(args.step_ms));
    let steady = Instant::now();
    let mut stall = Duration::ZERO;
    loop {
        let asked = Instant::now();
        let Some(batch) = loader.next() else { break };
        stall += asked.elapsed();
        drop(batch?);
        std::thread::sleep(Duration::from_millis(args.step_ms));
    }
    let stall_fraction = stall.as_secs_f64() / steady.elapsed().as_secs_f64().max(1e-9);
    Ok(Run { first, stall_fraction, elapsed: started.elapsed() })
}

/// Writes `trace` (the shards of each batch, in order) as an oracleGeneral trace: one request per
/// shard access, the object a shard (its key, as the evictors see it), its size, its next access.
fn write_trace(path: &Path, trace: &[Vec<ShardId>], size: &dyn Fn(ShardId) -> u64) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let mut requests: Vec<granary::policy::trace::Request> = trace
        .iter()
        .enumerate()
        .flat_map(|(step, shards)| {
            shards.iter().map(move |&shard| granary::policy::trace::Request {
                time: u32::try_from(step).unwrap_or(u32::MAX),
                key: granary::policy::shard_key(shard.0.as_bytes()),
                size: u32::try_from(size(shard)).unwrap_or(u32::MAX),
                next_use: u64::MAX,
            })
        })
        .collect();
    granary::policy::trace::annotate_next_use(&mut requests);
    granary::policy::trace::write(path, &requests)?;
    Ok(())
}

/// The bytes a cache of `capacity` bytes fetches on `trace` (the shards of each batch) when it
/// evicts the shard next used farthest ahead, the shards of the batch being read kept:
/// `policy::trace::min`, with each shard keyed by its position in the trace's first sighting.
fn belady_bytes(trace: &[Vec<ShardId>], capacity: u64, size: &dyn Fn(ShardId) -> u64) -> u64 {
    let mut keys: HashMap<ShardId, u64> = HashMap::new();
    let accesses: Vec<granary::policy::trace::Access> = trace
        .iter()
        .enumerate()
        .flat_map(|(step, shards)| shards.iter().map(move |&shard| (step, shard)))
        .map(|(step, shard)| {
            let next = keys.len() as u64;
            let key = *keys.entry(shard).or_insert(next);
            granary::policy::trace::Access { key, bytes: size(shard), group: step as u64 }
        })
        .collect();
    granary::policy::trace::min(&accesses, capacity, false).bytes_loaded
}
