//! A training loop fed by the loader: batches arrive on the GPU (host memory where there is no
//! GPU), a fixed "step" per batch stands in for the model, and the loop prints throughput and how
//! long it waited for data.
//!
//!     cargo run --release --example trainer -- [STORE DATASET] [--epochs N] [--batch N] [--step-us N] [--block 0|1]
//!
//! Without STORE and DATASET it makes a token corpus of its own (64 MiB of 2048-token u16
//! sequences) in a temporary directory. It also stops and resumes once mid-epoch from the saved
//! position, as a trainer restarting from a checkpoint would, and checks that no batch is lost
//! or repeated. Then (unless `--block 0`) it reads one more epoch block-shuffled (the elastic
//! partitioner's chunks of 64 consecutive records, the memory tier off): the same disk, read in
//! runs instead of one random 4 KiB read per record, beside the record-level shuffle's stall.

use std::sync::Arc;
use std::time::{Duration, Instant};

use granary::loader::{Loader, LoaderConfig, PlanSource, Target, TierSetting};
use granary::{DatasetName, Dtype, FixedLayout, Granary, IngestOptions, Layout, Position, VersionSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: u64| -> Result<u64, Box<dyn std::error::Error>> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).ok_or(format!("{name} needs a value"))?.parse()?),
            None => Ok(default),
        }
    };
    let (epochs, batch_size, step_us) = (flag("--epochs", 2)?, flag("--batch", 64)?, flag("--step-us", 500)?);
    let block = flag("--block", 1)? != 0;
    let positional: Vec<&String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| !a.starts_with("--") && (*i == 0 || !args[i - 1].starts_with("--")))
        .map(|(_, a)| a)
        .collect();

    let scratch = tempfile::Builder::new().prefix("granary-trainer-").tempdir()?;
    let (store, dataset_name) = match positional.as_slice() {
        [store, dataset] => (std::path::PathBuf::from(store), dataset.to_string()),
        [] => (make_corpus(scratch.path())?, "tokens".to_owned()),
        _ => return Err("usage: trainer [STORE DATASET] [--epochs N] [--batch N] [--step-us N] [--block 0|1]".into()),
    };
    let dataset = granary::Dataset::open(&granary::StorePaths::new(&store), &VersionSpec::parse(&dataset_name)?)?;
    let config = LoaderConfig { batch_size, epochs: Some(epochs), target: Target::Auto, ..LoaderConfig::default() };

    let mut loader = Loader::new(Arc::clone(&dataset), config.clone(), Position::default())?;
    println!(
        "training on {} ({} records, {}): batches of {batch_size} to {}, a {step_us} us step each",
        dataset_name,
        dataset.n_records(),
        dataset.layout(),
        loader.device().map_or_else(|| "host memory (no GPU)".to_owned(), |gpu| format!("the GPU ({gpu})"))
    );

    let start = Instant::now();
    // "Crash" halfway through the first epoch.
    let (mut seen, mut bytes, checkpoint) = train(&mut loader, step_us, Some(dataset.n_records() / 2))?;
    let (position, before) = (checkpoint.ok_or("the run ended before the checkpoint")?, seen);
    let stats_before = loader.stats();
    drop(loader);
    println!("stopped at {position:?} after {before} records; resuming from the checkpoint");

    let mut loader = Loader::new(
        Arc::clone(&dataset),
        LoaderConfig { epochs: Some(epochs - position.epoch), ..config.clone() },
        position,
    )?;
    let (records, read_bytes, _) = train(&mut loader, step_us, None)?;
    (seen, bytes) = (seen + records, bytes + read_bytes);
    let elapsed = start.elapsed().as_secs_f64();
    let stats = loader.stats();
    let stall = stats_before.stall + stats.stall;
    println!(
        "{seen} records ({:.1} MB) in {elapsed:.2} s: {:.0} records/s, {:.2} GB/s; stalled {:.3} s ({:.2}% of the run)",
        bytes as f64 / 1e6,
        seen as f64 / elapsed,
        bytes as f64 / elapsed / 1e9,
        stall.as_secs_f64(),
        100.0 * stall.as_secs_f64() / elapsed
    );
    let expected = dataset.n_records() * epochs;
    if seen != expected {
        return Err(format!("read {seen} records over the resume, expected {expected}").into());
    }
    println!("every record read exactly once per epoch across the resume, every block CRC-checked");
    let read = stats.read;
    if read.records > 0 {
        let from_memory = read.tier_records as f64 / read.records as f64;
        println!(
            "after the resume: {:.0}% of records from the memory tier, the rest read from disk; a stall is \
             the time the step waited for them (disk-bound on the first epoch: random 4 KiB reads run at \
             the disk's IOPS, and the tier fills at the speed the machine allocates memory)",
            100.0 * from_memory
        );
    }
    if block {
        // One epoch block-shuffled, from disk: every record once, in chunks of 64 consecutive
        // records from anywhere in the dataset.
        let block_config = LoaderConfig {
            plan: PlanSource::Partitioner { plugin: None, options: vec![("chunk-records".into(), "64".into())] },
            epochs: Some(1),
            tier: TierSetting::Off,
            ..config
        };
        let mut loader = Loader::new(Arc::clone(&dataset), block_config, Position::default())?;
        let start = Instant::now();
        let (read, ..) = train(&mut loader, step_us, None)?;
        let elapsed = start.elapsed().as_secs_f64();
        let stall = loader.stats().stall.as_secs_f64();
        if read != dataset.n_records() {
            return Err(format!("the block-shuffled epoch read {read} records of {}", dataset.n_records()).into());
        }
        println!(
            "one epoch block-shuffled (chunks of 64 records, memory tier off): {:.0} records/s, stalled {stall:.3} s \
             ({:.2}% of the epoch): the same disk as the record-level shuffle's, read in runs of 64 records",
            read as f64 / elapsed,
            100.0 * stall / elapsed
        );
    }
    Ok(())
}

/// Runs the training step on the batches `loader` has left, or until `stop_at` records: the
/// records and bytes it got, and the position after the batch it stopped at (with `stop_at`).
fn train(
    loader: &mut Loader,
    step_us: u64,
    stop_at: Option<u64>,
) -> Result<(u64, u64, Option<Position>), Box<dyn std::error::Error>> {
    let (mut records, mut bytes) = (0u64, 0u64);
    while let Some(batch) = loader.next() {
        let batch = batch?;
        if let Some(device) = batch.device() {
            device.wait()?; // the model's stream would wait on device.event() instead
        }
        spin(Duration::from_micros(step_us)); // the model
        records += batch.len() as u64;
        bytes += batch.data().len() as u64;
        if stop_at.is_some_and(|stop| records >= stop) {
            return Ok((records, bytes, Some(batch.position())));
        }
    }
    Ok((records, bytes, None))
}

/// 64 MiB of pseudo-random 2048-token u16 sequences as dataset `tokens` under `dir/store`.
fn make_corpus(dir: &std::path::Path) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    let store = dir.join("store");
    let mut granary = Granary::create(&store)?;
    let layout = Layout::Fixed(FixedLayout::new(Dtype::U16, &[2048])?);
    let options = IngestOptions { shard_bytes_target: 8 << 20, ..IngestOptions::default() };
    let mut ingest = granary.ingest(DatasetName::new("tokens")?, layout, options)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut record = vec![0u8; 4096];
    for _ in 0..(64 << 20) / 4096 {
        for chunk in record.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        ingest.push(&record)?;
    }
    ingest.commit()?;
    Ok(store)
}

fn spin(duration: Duration) {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}
