//! `granary bench read`: the engine's read path against a bare io_uring reader, in one run.
//!
//! Both readers read the same blocks of the same files with the same op size and queue depth,
//! alternating which goes first in each run so that drift on a noisy disk hits both. The figure
//! that matters is the ratio per run (bare time / engine time for the same work); the table shows
//! its median over the runs, beside the medians of each side's throughput.
//!
//! Owns: `ReadArgs` and `read` (the command), the bare reader's ops for the same records
//! (`bare_ops`), the medians and the table. Never: writes to the store: it opens the dataset from its files, without the write lock,
//! and only reads.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use granary::io::bare::BareReader;
use granary::shard::{block_crc, blocks_match};
use granary::{Backend, Dataset, EpochPlan, IoConfig, Order, Reader, StorePaths, VersionSpec};

use super::measure::bare_ops;
use crate::cli::parse_size;
use crate::cli::show::bytes;

#[derive(Args)]
pub(crate) struct ReadArgs {
    /// The dataset version: NAME, NAME@N or manifest id.
    dataset: String,
    /// Queue depth of the random-read workload.
    #[arg(long, default_value_t = 32)]
    qd: u32,
    /// Queue depth of the sequential workload.
    #[arg(long, default_value_t = 8)]
    seq_qd: u32,
    /// Largest read op (sequential reads coalesce up to it).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    op_bytes: u64,
    /// Records read at random per run.
    #[arg(long, default_value_t = 65536)]
    random_reads: u64,
    /// Records per engine batch in the random workload.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Bytes scanned per run in the sequential workload (0: the whole dataset).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    seq_bytes: u64,
    /// Record bytes per engine batch in the sequential workload.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    seq_batch_bytes: u64,
    /// Runs; the table reports medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seed of the random order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// One workload's measurements, per run.
#[derive(Default)]
struct Measured {
    bare: Vec<Duration>,
    engine: Vec<Duration>,
}

impl Measured {
    fn ratios(&self) -> Vec<f64> {
        self.bare.iter().zip(&self.engine).map(|(b, e)| b.as_secs_f64() / e.as_secs_f64()).collect()
    }
}

pub(crate) fn read(paths: &StorePaths, args: &ReadArgs) -> Result<()> {
    if args.runs == 0 || args.batch == 0 || args.random_reads == 0 {
        bail!("--runs, --batch and --random-reads must be positive");
    }
    let op_bytes = usize::try_from(args.op_bytes).context("--op-bytes")?;
    let dataset = Dataset::open(paths, &VersionSpec::parse(&args.dataset)?)?;
    let n = dataset.n_records();
    if n == 0 {
        bail!("dataset {} has no records", args.dataset);
    }
    let shard_paths: Vec<PathBuf> = (0..dataset.n_shards()).map(|s| dataset.shard_path(s)).collect();
    let shard_refs: Vec<&std::path::Path> = shard_paths.iter().map(PathBuf::as_path).collect();

    // The random workload: the first `random_reads` positions of a shuffled epoch.
    let plan = EpochPlan::new(n, args.seed, 0, Order::Shuffled);
    let random: Vec<u64> = (0..args.random_reads).map(|p| plan.record_at(p % n)).collect();
    let random_ops = bare_ops(&dataset, &random, op_bytes, false)?;

    // The sequential workload: a prefix of the dataset in order.
    let mut seq_records = 0;
    let mut seq_record_bytes = 0;
    while seq_records < n && (args.seq_bytes == 0 || seq_record_bytes < args.seq_bytes) {
        let (shard, local) = dataset.locate(seq_records)?;
        let range = dataset.shard_meta(shard)?.record_range(local);
        seq_record_bytes += range.end - range.start;
        seq_records += 1;
    }
    let sequential: Vec<u64> = (0..seq_records).collect();
    let seq_ops = bare_ops(&dataset, &sequential, op_bytes, true)?;
    let per_batch = (args.seq_batch_bytes / (seq_record_bytes / seq_records).max(1)).max(1) as usize;

    let config = |qd| IoConfig { backend: Backend::Uring, queue_depth: qd, op_bytes_max: op_bytes, direct: true };
    let mut random_engine = Reader::new(dataset.clone(), config(args.qd).build()?);
    let mut seq_engine = Reader::new(dataset.clone(), config(args.seq_qd).build()?);
    let mut random_bare = BareReader::new(args.qd, op_bytes)?;
    random_bare.open_all(&shard_refs)?;
    let mut seq_bare = BareReader::new(args.seq_qd, op_bytes)?;
    seq_bare.open_all(&shard_refs)?;

    // One untimed pass over the first batches: buffers are allocated (and huge pages faulted in)
    // once per reader, which a trainer pays once per run, not per epoch.
    read_all(&mut random_engine, &random[..args.batch.min(random.len())], args.batch)?;
    read_all(&mut seq_engine, &sequential[..(2 * per_batch).min(sequential.len())], per_batch)?;
    random_bare.run(&random_ops[..args.batch.min(random_ops.len())])?;
    seq_bare.run(&seq_ops[..seq_ops.len().min(64)])?;

    let dropped = drop_page_cache();
    let (mut random_runs, mut seq_runs) = (Measured::default(), Measured::default());
    let mut random_bytes = 0;
    for run in 0..args.runs {
        let bare_first = run % 2 == 0;
        for bare in [bare_first, !bare_first] {
            drop_page_cache();
            if bare {
                let (elapsed, _) = timed(|| random_bare.run(&random_ops))?;
                random_runs.bare.push(elapsed);
            } else {
                let (elapsed, delivered) = timed(|| read_all(&mut random_engine, &random, args.batch))?;
                random_runs.engine.push(elapsed);
                random_bytes = delivered;
            }
        }
        for bare in [bare_first, !bare_first] {
            drop_page_cache();
            if bare {
                seq_runs.bare.push(timed(|| seq_bare.run(&seq_ops))?.0);
            } else {
                seq_runs.engine.push(timed(|| read_all(&mut seq_engine, &sequential, per_batch))?.0);
            }
        }
    }
    let (crc_gbps, blake3_gbps) = hash_speeds();

    let name = match dataset.version() {
        Some((name, number)) => format!("{name}@{number}"),
        None => dataset.manifest_id().to_string(),
    };
    outln!(
        "granary bench read {name}: {n} records in {} shards ({}), layout {}",
        dataset.n_shards(),
        bytes(dataset.manifest().file_bytes()),
        dataset.layout()
    )?;
    outln!(
        "io_uring, O_DIRECT, registered buffers; {} runs, medians; page cache {}",
        args.runs,
        if dropped { "dropped before each measurement" } else { "not dropped (needs root; O_DIRECT bypasses it)" }
    )?;
    outln!()?;
    outln!(
        "{:<36} {:>22} {:>22} {:>12} {:>8} {:>8}",
        "workload",
        "bare io_uring",
        "engine (verified)",
        "engine/bare",
        "target",
        "verdict"
    )?;
    let verdict = |ratio: f64, target: f64| if ratio >= target { "met" } else { "missed" };
    let random_label = format!("random records, QD {}, {} reads", args.qd, args.random_reads);
    let per_s = |count: u64, d: Duration| count as f64 / d.as_secs_f64();
    let random_ratio = median_f64(random_runs.ratios());
    outln!(
        "{:<36} {:>22} {:>22} {:>12.3} {:>8} {:>8}",
        random_label,
        format!("{:.1} k reads/s", per_s(random_ops.len() as u64, median_time(&random_runs.bare)) / 1e3),
        format!("{:.1} k records/s", per_s(args.random_reads, median_time(&random_runs.engine)) / 1e3),
        random_ratio,
        ">= 0.90",
        verdict(random_ratio, 0.90)
    )?;
    let seq_label = format!("sequential, QD {}, {} ops", args.seq_qd, bytes(args.op_bytes));
    let seq_block_bytes: u64 = seq_ops.iter().map(|op| u64::from(op.len)).sum();
    let seq_ratio = median_f64(seq_runs.ratios());
    outln!(
        "{:<36} {:>22} {:>22} {:>12.3} {:>8} {:>8}",
        seq_label,
        format!("{:.2} GB/s", per_s(seq_block_bytes, median_time(&seq_runs.bare)) / 1e9),
        format!("{:.2} GB/s", per_s(seq_record_bytes, median_time(&seq_runs.engine)) / 1e9),
        seq_ratio,
        ">= 0.95",
        verdict(seq_ratio, 0.95)
    )?;
    outln!(
        "(the ratios are the engine against a bare reader on the same blocks in the same run: 1.0 is the \
         disk's own speed; a noisy shared disk moves single runs by +-0.2)"
    )?;
    outln!()?;
    outln!(
        "random: {} delivered per run ({} of blocks); sequential: {} per run",
        bytes(random_bytes),
        bytes(random_ops.iter().map(|op| u64::from(op.len)).sum()),
        bytes(seq_record_bytes)
    )?;
    outln!("per-run ratios: random {}; sequential {}", list(&random_runs.ratios()), list(&seq_runs.ratios()))?;
    outln!("verification, one core: CRC32C {crc_gbps:.1} GB/s, BLAKE3 {blake3_gbps:.1} GB/s")?;
    Ok(())
}

/// Reads `records` through the engine in batches, two in flight; returns the bytes delivered.
fn read_all(reader: &mut Reader, records: &[u64], batch_size: usize) -> Result<u64> {
    let mut delivered = 0;
    reader.read_batches(records.chunks(batch_size), 2, &mut |batch| {
        delivered += batch.data().len() as u64;
        Ok(())
    })?;
    Ok(delivered)
}

fn timed<T, E: Into<anyhow::Error>>(f: impl FnOnce() -> Result<T, E>) -> Result<(Duration, T)> {
    let start = Instant::now();
    let out = f().map_err(Into::into)?;
    Ok((start.elapsed(), out))
}

/// Asks the kernel to drop clean page-cache pages; returns whether it could (root only).
fn drop_page_cache() -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// CRC32C (4 KiB blocks checked against their stored checksums, as the read path does:
/// `blocks_match`) and BLAKE3 speed on one core, in GB/s.
fn hash_speeds() -> (f64, f64) {
    let mut buf = vec![0u8; 64 << 20];
    super::measure::Xorshift::new(0x1234_5678_9abc_def0).fill(&mut buf);
    let speed = |f: &dyn Fn() -> u64| {
        let start = Instant::now();
        let mut rounds = 0u64;
        let mut sink = 0u64;
        while rounds < 3 || start.elapsed() < Duration::from_millis(500) {
            sink = sink.wrapping_add(f());
            rounds += 1;
        }
        std::hint::black_box(sink);
        (rounds * buf.len() as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let expected: Vec<u32> = buf.chunks_exact(4096).enumerate().map(|(i, b)| block_crc(i as u64, b)).collect();
    let crc = speed(&|| u64::from(blocks_match(0, &buf, &expected)));
    let blake = speed(&|| u64::from(blake3::hash(&buf).as_bytes()[0]));
    (crc, blake)
}

/// The median of a run's times (a run has at least one).
fn median_time(values: &[Duration]) -> Duration {
    super::measure::median(values).unwrap_or_default()
}

/// The median of ratios or rates; NaN when there are none (printed as such, never a panic).
fn median_f64(values: Vec<f64>) -> f64 {
    super::measure::median(&values).unwrap_or(f64::NAN)
}

fn list(values: &[f64]) -> String {
    values.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(" ")
}
