//! `granary bench loader`: the loader against the limits of the disk and of the bus, in one run.
//!
//! Rows, each measured cold (page cache dropped before each measurement where the process may):
//! the bare io_uring O_DIRECT reader on the same blocks at the same queue depth (the disk's
//! limit), the engine to host memory, the engine to the GPU, and a pinned host-to-device copy of
//! the same bytes (the bus's limit); then warm (data in the page cache) to the GPU, and a
//! simulated training step. Ratios are taken within each run, medians over runs. CPU is the
//! process's user + system time over the loader's run, per GB/s delivered.
//!
//! Owns: `LoaderArgs` and `loader` (the command), the dataset of `--generate` (raw `.bin` files
//! beside the store, ingested), each row's measurement (`measure_*`, and Belady's for the partial
//! tier row), and a memory tier directory of its own in /dev/shm (`BenchDir`, removed when the
//! bench ends). Never: empties a tier it was not given (the tier rows use their own directory
//! unless `--tier-dir` names one), or writes to the store but with `--generate`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use granary::io::MappedFile;
use granary::io::bare::BareReader;
use granary::loader::{LoaderConfig, PlanSource, StartStage, Target, TierSetting};
use granary::staging::cuda::Cuda;
use granary::tier::{MemoryTier, TierConfig, TierKind};
use granary::{
    Backend, Dataset, DatasetName, EpochPlan, FixedLayout, Granary, IngestOptions, IoConfig, Layout, Order, StorePaths,
    VersionSpec,
};

use super::loader_rows::*;
use super::measure::bare_ops;
use crate::cli::parse_size;
use crate::cli::show::bytes;

#[derive(Args)]
pub(crate) struct LoaderArgs {
    /// The dataset version (NAME, NAME@N or manifest id); with --generate, the name to create.
    #[arg(default_value = "bench-loader")]
    dataset: String,
    /// Make the dataset first: this many bytes of random fixed-size records, written as raw
    /// `.bin` files (for the PyTorch baseline) and ingested.
    #[arg(long, value_parser = parse_size)]
    generate: Option<u64>,
    /// Where --generate writes the raw files (default: the store root with `.raw` added).
    #[arg(long)]
    raw_dir: Option<PathBuf>,
    /// Bytes per record, for --generate.
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    record_bytes: u64,
    /// Records per batch.
    #[arg(long, default_value_t = 256)]
    batch: u64,
    /// Batches per measurement.
    #[arg(long, default_value_t = 600)]
    batches: u64,
    /// Queue depth of the random workload.
    #[arg(long, default_value_t = 256)]
    qd: u32,
    /// Queue depth of the sequential workload.
    #[arg(long, default_value_t = 32)]
    seq_qd: u32,
    /// Largest read op in the sequential workload.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    op_bytes: u64,
    /// Simulated training step per batch, in microseconds (the last row, random order: pick one
    /// the disk can feed, or the row measures the disk instead of the loader).
    #[arg(long, default_value_t = 5000)]
    step_us: u64,
    /// Runs; the table reports medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Leave the page cache alone (cold rows then read through O_DIRECT only; on a shared
    /// machine, or in tests, dropping the whole machine's cache is not this process's call).
    #[arg(long)]
    keep_cache: bool,
    /// The workloads to measure (all by default): random, sequential, block, warm, step, tier,
    /// tier-partial, metrics.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "random,sequential,block,warm,step,tier,tier-partial,metrics"
    )]
    rows: Vec<Workload>,
    /// The memory tier's directory for the tier rows (default: a directory of the bench's own
    /// in /dev/shm, removed at the end, so that a job's shared tier is never emptied under it).
    /// The tier rows empty it before each cold measurement.
    #[arg(long)]
    tier_dir: Option<PathBuf>,
    /// Shuffled epochs of the tier-partial row (a dataset twice the tier's budget).
    #[arg(long, default_value_t = 3)]
    partial_epochs: u64,
    /// The tiers the tier rows measure (both by default): page-cache, memory.
    #[arg(long, value_delimiter = ',', default_value = "page-cache,memory",
          value_parser = |s: &str| TierKind::parse(s).ok_or("page-cache or memory"))]
    tier_kinds: Vec<TierKind>,
    /// The tier the tier-partial row measures: page-cache or memory.
    #[arg(long, default_value = "page-cache", value_parser = |s: &str| TierKind::parse(s).ok_or("page-cache or memory"))]
    partial_kind: TierKind,
}

/// A group of rows of the table.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Workload {
    /// Random 4 KiB records: bare reader, engine to host, engine to GPU.
    Random,
    /// Sequential: bare reader, engine to host, engine to GPU, pinned copy.
    Sequential,
    /// Block-shuffled (the elastic partitioner's chunks of 64 records), engine to host, against
    /// the sequential bare reader.
    Block,
    /// The data in the page cache, engine to the target.
    Warm,
    /// Random with a simulated training step: the stall.
    Step,
    /// The memory tier: warm random against a gather from a memory map of the same files, a
    /// cold epoch against the same and against one sequential read of the dataset.
    Tier,
    /// The memory tier at half the dataset: hit ratio over shuffled and windowed epochs against
    /// Belady's.
    TierPartial,
    /// The cost of the loader's metrics: warm random (the page cache; the most batches and
    /// per-shard counts per byte), with the metrics on and off, alternating.
    Metrics,
}

pub(crate) fn loader(root: &Path, paths: &StorePaths, args: &LoaderArgs) -> Result<()> {
    if args.runs == 0 || args.batch == 0 || args.batches == 0 {
        bail!("--runs, --batch and --batches must be positive");
    }
    let raw_dir = args.raw_dir.clone().unwrap_or_else(|| root.with_extension("raw"));
    if let Some(total) = args.generate {
        generate(root, &raw_dir, &args.dataset, total, args.record_bytes)?;
    }
    let dataset = Dataset::open(paths, &VersionSpec::parse(&args.dataset)?)?;
    let record_bytes = dataset.layout().record_bytes().context("the loader benchmark needs fixed-size records")?;
    let n = dataset.n_records();
    let wanted = args.batch * args.batches;
    if n < wanted {
        bail!("{} has {n} records; --batch x --batches needs {wanted}", args.dataset);
    }
    let cuda = Cuda::get();
    let gpu_note = Cuda::unavailable_reason().unwrap_or_default();
    let cold = !args.keep_cache;
    let dropped = cold && drop_page_cache();

    let shard_paths: Vec<PathBuf> = (0..dataset.n_shards()).map(|s| dataset.shard_path(s)).collect();
    let shard_refs: Vec<&Path> = shard_paths.iter().map(PathBuf::as_path).collect();
    let random_plan = EpochPlan::new(n, 1, 0, Order::Shuffled);
    let random: Vec<u64> = (0..wanted).map(|p| random_plan.record_at(p)).collect();
    let sequential: Vec<u64> = (0..wanted).collect();
    let op_bytes = usize::try_from(args.op_bytes).context("--op-bytes")?;
    let random_ops = bare_ops(&dataset, &random, op_bytes, false)?;
    // One whole shuffled epoch (the tier rows), and one sequential read of every record.
    let epoch_random: Vec<u64> = (0..n - n % args.batch).map(|p| random_plan.record_at(p)).collect();
    let all_seq_ops = bare_ops(&dataset, &(0..n).collect::<Vec<u64>>(), op_bytes, true)?;
    let seq_ops = bare_ops(&dataset, &sequential, op_bytes, true)?;
    let mut random_bare = BareReader::new(args.qd, 64 << 10)?;
    random_bare.open_all(&shard_refs)?;
    let mut seq_bare = BareReader::new(args.seq_qd, op_bytes)?;
    seq_bare.open_all(&shard_refs)?;

    let batch_bytes = args.batch * record_bytes;
    let random_io = IoConfig { backend: Backend::Uring, queue_depth: args.qd, op_bytes_max: 64 << 10, direct: true };
    let seq_io = IoConfig { backend: Backend::Uring, queue_depth: args.seq_qd, op_bytes_max: op_bytes, direct: true };
    // Enough batches in flight to keep the sequential queue full.
    let seq_depth = (u64::from(args.seq_qd) * args.op_bytes).div_ceil(batch_bytes).clamp(2, 64) as usize;
    // The disk rows measure the disk: no memory tier.
    let base =
        LoaderConfig { batch_size: args.batch, epochs: Some(1), tier: TierSetting::Off, ..LoaderConfig::default() };
    let random_config = |target| LoaderConfig {
        plan: PlanSource::Native(Order::Shuffled),
        seed: 1,
        io: random_io,
        // Two batches of 256 single-block ops keep a queue of 256 only just full.
        read_depth: 4,
        target,
        ..base.clone()
    };
    // The loader's own depth (sized from its queue's bytes), as a trainer gets it.
    let block_config = |target| LoaderConfig {
        plan: PlanSource::Partitioner { plugin: None, options: vec![("chunk-records".into(), "64".into())] },
        seed: 1,
        io: seq_io,
        target,
        ..base.clone()
    };
    let seq_config = |target| LoaderConfig {
        plan: PlanSource::Native(Order::Sequential),
        io: seq_io,
        read_depth: seq_depth,
        target,
        ..base.clone()
    };

    let mut rows: Vec<(String, Vec<Sample>)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    // The tier rows empty their tier before each cold run: never the node's shared one.
    let own_dir = BenchDir(match &args.tier_dir {
        Some(_) => None,
        None => Some(PathBuf::from(format!("/dev/shm/granary-bench-{}", std::process::id()))),
    });
    let tier_dir = args.tier_dir.clone().or_else(|| own_dir.0.clone());
    let tier_config = |kind: TierKind, budget: u64| match kind {
        TierKind::Memory => {
            TierConfig { kind, budget_bytes: Some(budget), dir: tier_dir.clone(), ..TierConfig::default() }
        }
        TierKind::PageCache => TierConfig { kind, budget_bytes: Some(budget), ..TierConfig::default() },
    };
    let data_bytes: u64 =
        (0..dataset.n_shards()).map(|s| dataset.shard_meta(s).map(|m| m.data_bytes())).sum::<granary::Result<u64>>()?;
    let mut record = |label: &str, sample: Sample| match rows.iter_mut().find(|(l, _)| l == label) {
        Some((_, samples)) => samples.push(sample),
        None => rows.push((label.to_owned(), vec![sample])),
    };
    for run in 0..args.runs {
        errln!("run {} of {}", run + 1, args.runs);
        let wants = |workload| args.rows.contains(&workload);
        type Config<'a> = &'a dyn Fn(Target) -> LoaderConfig;
        let cold_workloads = [
            (Workload::Random, "random", &mut random_bare, &random_ops, &random_config as Config<'_>),
            (Workload::Sequential, "sequential", &mut seq_bare, &seq_ops, &seq_config),
        ];
        for (workload, name, bare, ops, config) in cold_workloads {
            if !wants(workload) {
                continue;
            }
            record(&format!("{name}: bare io_uring"), measure_bare(bare, ops, wanted * record_bytes, cold)?);
            let engine = |target| measure_disk_loader(&dataset, config(target), args.batches, cold);
            record(&format!("{name}: engine -> host"), engine(Target::Host)?);
            if cuda.is_some() {
                record(&format!("{name}: engine -> GPU"), engine(Target::Gpu)?);
                if workload == Workload::Sequential {
                    record("pinned copy to GPU", measure_pinned_copy(batch_bytes, args.batches)?);
                }
            }
        }
        if wants(Workload::Block) {
            if !wants(Workload::Sequential) {
                record(
                    "sequential: bare io_uring",
                    measure_bare(&mut seq_bare, &seq_ops, wanted * record_bytes, cold)?,
                );
            }
            record(
                "block: engine -> host",
                measure_disk_loader(&dataset, block_config(Target::Host), args.batches, cold)?,
            );
        }
        let warm_target = if cuda.is_some() { Target::Gpu } else { Target::Host };
        if wants(Workload::Warm) {
            // Read through the page cache once, then measure with the data in memory.
            let mut warm = seq_config(warm_target);
            warm.io.direct = false;
            measure_loader(&dataset, warm.clone(), args.batches, 0, cold)?;
            record("warm: engine -> target", measure_loader(&dataset, warm, args.batches, 0, cold)?);
        }
        if wants(Workload::Tier) {
            let epoch_batches = n / args.batch;
            let tiered = |epochs, tier: TierSetting| LoaderConfig {
                plan: PlanSource::Native(Order::Shuffled),
                seed: 1,
                io: random_io,
                read_depth: 4,
                target: Target::Host,
                epochs: Some(epochs),
                tier,
                ..base.clone()
            };
            record("cold epoch: sequential read (limit)", measure_bare(&mut seq_bare, &all_seq_ops, data_bytes, cold)?);
            // Mapped without MAP_POPULATE: `np.memmap` maps lazily (populating would read the
            // whole dataset before the first record).
            let open_maps = || -> Result<Vec<MappedFile>> {
                Ok((0..dataset.n_shards())
                    .map(|s| MappedFile::open_lazy(&dataset.shard_path(s)))
                    .collect::<granary::Result<_>>()?)
            };
            let maps = open_maps()?;
            let first = &epoch_random[..usize::try_from(args.batch.min(n))?];
            record("first batch, cold: mmap gather", measure_gather(&dataset, &maps, first, args.batch, cold)?);
            record("cold epoch random: mmap gather", measure_gather(&dataset, &maps, &epoch_random, args.batch, cold)?);
            record("warm random: mmap gather", measure_gather(&dataset, &maps, &random, args.batch, false)?);
            // A trainer that makes its loader anew maps the files anew: every page faults into
            // the new mapping once.
            drop(maps);
            record(
                "new loader, warm epoch: mmap gather",
                measure_gather(&dataset, &open_maps()?, &epoch_random, args.batch, false)?,
            );
            record(
                "cold epoch random: tier off",
                measure_loader(&dataset, tiered(1, TierSetting::Off), epoch_batches, 0, cold)?,
            );
            for &kind in &args.tier_kinds {
                let name = kind.name();
                // Budget: the whole dataset and a little (the tier's reserve for the trainer aside).
                let config = tier_config(kind, data_bytes + (64 << 20));
                let tier = MemoryTier::open(&config)?.context("a tier of >0 bytes")?;
                if kind == TierKind::Memory {
                    tier.clear()?;
                    record("cold epoch: memory tier's memory only (floor)", measure_tier_memory(&tier, data_bytes)?);
                }
                // Cold: page cache dropped, tier empty, one whole epoch.
                tier.clear()?;
                let shared = TierSetting::Shared(Arc::clone(&tier));
                record(
                    &format!("cold epoch random: {name} tier"),
                    measure_loader(&dataset, tiered(1, shared.clone()), epoch_batches, 0, cold)?,
                );
                record(
                    &format!("warm random: {name} tier"),
                    measure_warm_loader(&dataset, tiered(2, shared), args.batches)?,
                );
                tier.clear()?;
                drop(tier);
                // A new loader for each epoch, each opening the tier itself (as a trainer that
                // rebuilds its loaders does): the first fills it, the second is measured.
                let own = TierSetting::Config(config);
                measure_loader(&dataset, tiered(1, own.clone()), epoch_batches, 0, false)?;
                record(
                    &format!("new loader, warm epoch: {name} tier"),
                    measure_loader(&dataset, tiered(1, own), epoch_batches, 0, false)?,
                );
            }
        }
        if wants(Workload::TierPartial) && run == 0 {
            for (label, plan) in partial_plans(&dataset) {
                let note = measure_partial(
                    &dataset,
                    &base,
                    random_io,
                    &tier_config,
                    data_bytes,
                    (args.partial_kind, args.partial_epochs),
                    &label,
                    plan,
                )?;
                notes.push(note);
            }
        }
        if wants(Workload::Metrics) {
            let mut warm = random_config(Target::Host);
            warm.io.direct = false;
            measure_loader(&dataset, warm.clone(), args.batches, 0, false)?;
            let registry = granary::metrics::Registry::default();
            let on = LoaderConfig { metrics: granary::metrics::Setting::Registry(registry.clone()), ..warm.clone() };
            let off = LoaderConfig { metrics: granary::metrics::Setting::Off, ..warm };
            // On, off, off, on: a drift of the machine's speed within the run cancels out.
            for metrics_on in [true, false, false, true] {
                let (label, config) =
                    if metrics_on { ("metrics on: warm random", &on) } else { ("metrics off: warm random", &off) };
                record(label, measure_loader(&dataset, config.clone(), args.batches, 0, false)?);
            }
            // The scrape works on what was measured (not timed).
            let scraped = registry.encode(granary::metrics::Format::Prometheus);
            anyhow::ensure!(scraped.contains("granary_loader_batches_total"), "the metrics row registered nothing");
        }
        if wants(Workload::Step) {
            let mut step = random_config(warm_target);
            step.prefetch = 8;
            record(
                "random + training step: stall",
                measure_loader(&dataset, step, args.batches.min(300), args.step_us, cold)?,
            );
        }
    }

    let page_cache = match (cold, dropped) {
        (false, _) => "kept (--keep-cache; O_DIRECT bypasses it)",
        (true, true) => "dropped before each cold row",
        (true, false) => "not dropped (needs root; O_DIRECT bypasses it)",
    };
    let gpu = cuda.map_or_else(|| format!("none ({gpu_note}): GPU rows skipped"), |c| c.name().to_owned());
    report(args, &dataset, &raw_dir, &gpu, cuda.is_some(), page_cache, &rows, &notes)
}

/// Prints what a run of the benchmark measured: the rows (rates, cores, cores per GB/s), each
/// ratio against its baseline from the same run with its target, and where a loader's start
/// went.
#[allow(clippy::too_many_arguments, reason = "the run's facts, each printed")]
fn report(
    args: &LoaderArgs,
    dataset: &Dataset,
    raw_dir: &Path,
    gpu: &str,
    has_gpu: bool,
    page_cache: &str,
    rows: &[(String, Vec<Sample>)],
    notes: &[String],
) -> Result<()> {
    let n = dataset.n_records();
    let record_bytes = dataset.layout().record_bytes().context("the loader benchmark needs fixed-size records")?;
    let batch_bytes = args.batch * record_bytes;
    outln!(
        "granary bench loader {}: {n} records of {} in {} shards; batch {} records ({}); {} batches per row; {} runs, medians",
        args.dataset,
        bytes(record_bytes),
        dataset.n_shards(),
        args.batch,
        bytes(batch_bytes),
        args.batches,
        args.runs
    )?;
    outln!("GPU: {gpu}; page cache {page_cache}")?;
    outln!()?;
    outln!("{:<44} {:>8} {:>14} {:>8} {:>16}", "row", "GB/s", "records/s", "cores", "cores per GB/s")?;
    let median_of = |samples: &[Sample], f: &dyn Fn(&Sample) -> f64| median(samples.iter().map(f).collect());
    for (label, samples) in rows {
        let gbps = median_of(samples, &|s| s.gbps());
        let cores = median_of(samples, &|s| s.cpu / s.seconds);
        if label.ends_with("stall") {
            let stall = median_of(samples, &|s| s.cpu);
            let steady = median_of(samples, &|s| s.steady);
            outln!(
                "{label:<44} {:>8} {:>14} {:>8} {:>16}   ({:.2}% after the first batch; target < 1%)",
                "",
                "",
                "",
                format!("{:.2}%", stall * 100.0),
                steady * 100.0
            )?;
            continue;
        }
        outln!(
            "{label:<44} {gbps:>8.3} {:>14.0} {cores:>8.2} {:>16.3}",
            gbps * 1e9 / record_bytes as f64,
            cores / gbps
        )?;
    }
    outln!()?;
    let ratio = |a: &str, b: &str| -> Option<f64> {
        let (a, b) = (rows.iter().find(|(l, _)| l == a)?, rows.iter().find(|(l, _)| l == b)?);
        Some(median(a.1.iter().zip(&b.1).map(|(x, y)| x.gbps() / y.gbps()).collect()))
    };
    let show = |label: &str, value: Option<f64>, target: &str| {
        let limit = target.strip_prefix(">= ").and_then(|t| t.parse::<f64>().ok());
        match (value, limit) {
            (Some(value), Some(limit)) => {
                let verdict = if value >= limit { "met" } else { "missed" };
                outln!("{label:<48} {value:>8.3}   target {target}: {verdict}")
            }
            (Some(value), None) => outln!("{label:<48} {value:>8.3}   {target}"),
            (None, _) => outln!("{label:<48} {:>8}   target {target}: not measured here", "n/a"),
        }
    };
    show("random, engine -> host / bare", ratio("random: engine -> host", "random: bare io_uring"), ">= 0.90")?;
    show("random, engine -> GPU / bare", ratio("random: engine -> GPU", "random: bare io_uring"), ">= 0.90")?;
    show(
        "sequential, engine -> host / bare",
        ratio("sequential: engine -> host", "sequential: bare io_uring"),
        ">= 0.95",
    )?;
    show(
        "sequential, engine -> GPU / bare",
        ratio("sequential: engine -> GPU", "sequential: bare io_uring"),
        ">= 0.95",
    )?;
    show(
        "block, engine -> host / sequential bare",
        ratio("block: engine -> host", "sequential: bare io_uring"),
        ">= 0.90",
    )?;
    show(
        "metrics on / off (warm random; cost < 1%)",
        ratio("metrics on: warm random", "metrics off: warm random"),
        ">= 0.99",
    )?;
    // The cold epoch's time against one sequential read of the dataset's bytes, and against the
    // memory tier's memory alone.
    let time_ratio = |engine: &str, limit: &str| -> Option<f64> {
        let (engine, limit) = (rows.iter().find(|(l, _)| l == engine)?, rows.iter().find(|(l, _)| l == limit)?);
        Some(median(engine.1.iter().zip(&limit.1).map(|(e, l)| l.seconds / e.seconds).collect()))
    };
    // CPU per byte delivered, the tier's over the map's.
    let cpu_ratio = |a: &str, b: &str| -> Option<f64> {
        let (a, b) = (rows.iter().find(|(l, _)| l == a)?, rows.iter().find(|(l, _)| l == b)?);
        let per_byte = |s: &Sample| s.cpu / s.bytes.max(1) as f64;
        Some(median(a.1.iter().zip(&b.1).map(|(x, y)| per_byte(x) / per_byte(y)).collect()))
    };
    for kind in [TierKind::PageCache, TierKind::Memory] {
        let tier = format!("{} tier", kind.name());
        for pattern in ["warm random", "cold epoch random", "new loader, warm epoch"] {
            show(
                &format!("{pattern}: {tier} / mmap gather"),
                ratio(&format!("{pattern}: {tier}"), &format!("{pattern}: mmap gather")),
                ">= 1.0",
            )?;
        }
        show(
            &format!("warm random: {tier} CPU per byte / mmap's"),
            cpu_ratio(&format!("warm random: {tier}"), "warm random: mmap gather"),
            "(target <= 1.2)",
        )?;
        show(
            &format!("cold epoch random: sequential read time / {tier} time"),
            time_ratio(&format!("cold epoch random: {tier}"), "cold epoch: sequential read (limit)"),
            ">= 0.5",
        )?;
    }
    show(
        "cold epoch random: memory tier's memory time / its time",
        time_ratio("cold epoch random: memory tier", "cold epoch: memory tier's memory only (floor)"),
        "(how close to this machine's floor)",
    )?;
    for note in notes {
        outln!("{note}")?;
    }
    // The time from building a loader to its first batch (the disk rows time the loader from
    // its first batch, as the bare reader's setup is not timed; the tier rows include it).
    for (label, samples) in rows.iter().filter(|(_, samples)| samples.iter().any(|s| s.start > 0.0)) {
        let start = median_of(samples, &|s| s.start);
        outln!("{:<48} {:>8.1}   ms: built, first batch delivered", format!("{label}: start"), start * 1e3)?;
        // Where that time went: each stage's end, in ms from `Loader::new` (medians).
        let ends: Vec<String> = StartStage::ALL
            .iter()
            .enumerate()
            .filter_map(|(i, stage)| {
                let ends: Vec<f64> = samples.iter().filter_map(|s| s.stages[i]).collect();
                (!ends.is_empty()).then(|| format!("{} {:.1}", stage.name(), median(ends) * 1e3))
            })
            .collect();
        outln!("{:<48} ms: {}", format!("{label}: start stages"), ends.join(", "))?;
    }
    // The first batch of a cold epoch, with the tier against without, and against the memory
    // map's gather of the same records (issue 44).
    let first = |label: &str| rows.iter().find(|(l, _)| l == label).map(|(_, s)| median_of(s, &|s| s.start));
    let mmap_first =
        rows.iter().find(|(l, _)| l == "first batch, cold: mmap gather").map(|(_, s)| median_of(s, &|s| s.seconds));
    for &kind in &[TierKind::PageCache, TierKind::Memory] {
        let tier = first(&format!("cold epoch random: {} tier", kind.name()));
        let off = first("cold epoch random: tier off");
        let over = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
        show(&format!("first batch, cold: {} tier / tier off", kind.name()), over(tier, off), "(target <= 1.1)")?;
        show(
            &format!("first batch, cold: {} tier / mmap gather", kind.name()),
            over(tier, mmap_first),
            "(target <= 0.5)",
        )?;
    }
    show(
        "cold epoch random: page-cache tier / tier off",
        ratio("cold epoch random: page-cache tier", "cold epoch random: tier off"),
        ">= 1.0",
    )?;
    show(
        "warm, engine -> GPU / pinned copy",
        ratio("warm: engine -> target", "pinned copy to GPU").filter(|_| has_gpu),
        ">= 0.80",
    )?;
    outln!()?;
    outln!(
        "PyTorch baseline on the same files: python3 ../shared/bench/dataloader_baseline.py --dir {} \
         --record-bytes {record_bytes} --batch {} --batches {} --order random --workers 15",
        raw_dir.display(),
        args.batch,
        args.batches
    )?;
    Ok(())
}
/// Writes `total` bytes of random records into raw files and ingests them as `name`.
fn generate(root: &Path, raw_dir: &Path, name: &str, total: u64, record_bytes: u64) -> Result<()> {
    if record_bytes == 0 || total < record_bytes {
        bail!("--generate needs at least one record of --record-bytes");
    }
    std::fs::create_dir_all(raw_dir).with_context(|| format!("create {}", raw_dir.display()))?;
    let mut granary = Granary::create(root)?;
    let layout = Layout::Fixed(FixedLayout::new(granary::Dtype::U8, &[record_bytes])?);
    let options = IngestOptions { mode: granary::IngestMode::Replace, ..IngestOptions::default() };
    let mut ingest = granary.ingest(DatasetName::new(name)?, layout, options)?;
    let records = total / record_bytes;
    let per_file = ((256u64 << 20) / record_bytes).max(1);
    let mut random = super::measure::Xorshift::new(0x2545_f491_4f6c_dd1d);
    let mut record = vec![0u8; record_bytes as usize];
    let mut file = None;
    for i in 0..records {
        if i % per_file == 0 {
            let path = raw_dir.join(format!("part-{:05}.bin", i / per_file));
            file = Some(std::io::BufWriter::new(
                std::fs::File::create(&path).with_context(|| path.display().to_string())?,
            ));
        }
        random.fill(&mut record);
        use std::io::Write;
        file.as_mut().expect("opened at the first record").write_all(&record)?;
        ingest.push(&record)?;
    }
    if let Some(mut file) = file {
        use std::io::Write;
        file.flush()?;
    }
    ingest.commit()?;
    errln!("generated {records} records of {} in {} and the store", bytes(record_bytes), raw_dir.display());
    Ok(())
}

/// The median of rates or ratios; NaN when there are none.
fn median(values: Vec<f64>) -> f64 {
    super::measure::median(&values).unwrap_or(f64::NAN)
}

/// A tier directory the bench made for itself: removed, whole, when the bench ends.
struct BenchDir(Option<PathBuf>);

impl Drop for BenchDir {
    fn drop(&mut self) {
        if let Some(dir) = &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
