//! Argument parsing and the commands. Every failure is one line on stderr and a non-zero exit;
//! output goes through `output`'s macros, never `println!`, so a full or closed stdout is an
//! error or a quiet end, never a panic.
//!
//! Owns: the `Cli` parser and its subcommands, `main` and `main_with` (the exit status), the
//! commands with no file of their own (`ingest`, `get`, `rm`), how long a command that writes waits
//! for another writer (`--wait`, `--no-wait`: `open_writer`, `open_and_repair`), `parse_size` and
//! the ingest progress bar. Never: prints with `println!` or `eprintln!`, or asks for a store
//! before a command needs one (`plugin`, `cluster-key`, `tier` and `top` run without `--root`).

#[macro_use]
mod output;

mod bench;
mod cluster;
mod mix;
mod origin;
mod plugin;
mod show;
mod tier;
mod top;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use granary::ingest::{self, Progress};
use granary::{
    DatasetName, Dtype, FixedLayout, Granary, IngestMode, IngestOptions, IoConfig, Layout, Reader, StorePaths,
    VersionSpec,
};

/// granary: content-addressed, checksummed shards of training data, read through io_uring.
#[derive(Parser)]
#[command(version, about, propagate_version = true)]
struct Cli {
    /// The store's root directory (or set GRANARY_ROOT).
    #[arg(long, global = true, env = "GRANARY_ROOT", value_name = "DIR")]
    root: Option<PathBuf>,
    /// How long a command that writes waits for another process's write lock on the store.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 60)]
    wait: u64,
    /// A command that writes fails at once when another process holds the store's write lock.
    #[arg(long, global = true, conflicts_with = "wait")]
    no_wait: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Ingest records into a dataset: a new dataset, or with --append/--replace a new version.
    #[command(subcommand)]
    Ingest(IngestCommand),
    /// List datasets, versions, shards and sizes.
    Ls,
    /// Show a shard (by id) or a dataset version (NAME, NAME@N or manifest id): header, layout,
    /// records.
    Inspect {
        /// Shard id, manifest id, NAME or NAME@N.
        target: String,
        /// Records to list.
        #[arg(long, default_value_t = 8)]
        records: u64,
    },
    /// What a mixture of datasets reads: each source's version, records, weight, draws per
    /// epoch and passes over it (NAME=WEIGHT ...).
    Mix(mix::MixArgs),
    /// Write the raw bytes of one record to stdout (every block it touches is checked first).
    /// With a cluster key, a damaged or missing shard is repaired through the node serving the
    /// store before the read is retried.
    Get {
        /// NAME, NAME@N or manifest id.
        dataset: String,
        /// The record's index in the dataset version.
        index: u64,
        /// Write the record to this file instead of stdout (stdout must not be a terminal).
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
        #[command(flatten)]
        key: cluster::KeyArgs,
    },
    /// Full scrub: BLAKE3 of every file, CRC32C of every block and, for the whole store, that
    /// every record of every live version can be read; exits 1 on any failure.
    Verify {
        /// Only this version (NAME, NAME@N or manifest id); default: the whole store.
        dataset: Option<String>,
    },
    /// Rebuild the catalog from the files whatever its state, quarantining files that fail
    /// verification and rebuilding damaged or lost refs from their histories.
    Repair,
    /// Remove a dataset (NAME) or one version (NAME@N); files stay until `gc`.
    Rm {
        /// NAME or NAME@N.
        dataset: String,
    },
    /// Delete shard and manifest files that no live version references, keeping for a grace
    /// period (14 days) what refs pointed at recently and objects written recently.
    Gc {
        /// No grace period: delete everything no live version references now.
        #[arg(long)]
        prune_now: bool,
    },
    /// Publish a dataset version to an object store (s3://bucket/prefix, gs://, az://,
    /// file:///path): the shards it lacks, each checked here first, then the manifest, then
    /// the ref, written only if nobody changed it meanwhile. Credentials come from the
    /// environment (AWS_*, GOOGLE_*, AZURE_*), never from the URL.
    Push {
        /// NAME or NAME@N.
        dataset: String,
        /// The origin.
        url: String,
    },
    /// Make a dataset of an object store readable here: its manifest and every shard's
    /// metadata are fetched and checked now; record data is fetched as reads need it, into a
    /// cache of shards this store keeps within --cache-bytes.
    Attach {
        /// NAME or NAME@N (default: the origin's latest version).
        dataset: String,
        /// The origin.
        url: String,
        /// The store's cache bound (suffixes K, M, G, KiB, MiB, GiB); 0 for none. Kept for
        /// later attaches; default: the bound set before, or none.
        #[arg(long, value_parser = parse_size)]
        cache_bytes: Option<u64>,
        /// The cache's evictor plugin: a built-in (plan-aware, lru, fifo, sieve, s3-fifo) or a
        /// .wasm file. Kept for later attaches; default: the one set before, or plan-aware,
        /// which the loaders tell when each shard is needed next.
        #[arg(long)]
        evictor: Option<String>,
    },
    /// Drop an attached dataset and its cached shards (the origin keeps everything).
    Detach {
        /// NAME.
        dataset: String,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The policy plugin kit: check, simulate, make traces.
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
    /// Run this store's node of a training job: serve shards to peers, keep the replication
    /// goals, repair from peers. Runs until SIGINT or SIGTERM.
    Serve(cluster::ServeArgs),
    /// Replicate a dataset version to the job's nodes, as the replicator plugin places it.
    Replicate(cluster::ReplicateArgs),
    /// A node's view: peers, replication lag, under-replicated shards, transfers, cache.
    Status(cluster::StatusArgs),
    /// Make a new cluster secret file (give the same one to every node of the job).
    ClusterKey(cluster::ClusterKeyArgs),
    /// The node's memory tier (verified extents in shared memory that loaders fill and read).
    #[command(subcommand)]
    Tier(tier::TierCommand),
    /// A live view of a job's metrics endpoints (nodes, ranks): throughput, stall, cache hits,
    /// hot shards, skew, replication. `q` quits.
    Top(top::TopArgs),
}

#[derive(Subcommand)]
enum IngestCommand {
    /// Files of back-to-back fixed-size records (nanoGPT/Megatron .bin token files, ...).
    Records {
        #[command(flatten)]
        common: IngestArgs,
        /// Bytes per record (suffixes K, M, G, KiB, MiB, GiB).
        #[arg(long, value_parser = parse_size)]
        record_bytes: u64,
        /// Element type: u8 i8 u16 i16 u32 i32 u64 i64 f16 bf16 f32 f64, or NumPy's and
        /// PyTorch's names (uint16, float32, ...) (default u8).
        #[arg(long)]
        dtype: Option<String>,
        /// Record shape, comma-separated (default: record bytes / dtype size).
        #[arg(long, value_delimiter = ',')]
        shape: Option<Vec<u64>>,
        /// Skip each file's incomplete last record instead of refusing the file.
        #[arg(long)]
        drop_remainder: bool,
        /// The input files, in order.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// A directory tree: each regular file is one record, in path order.
    Files {
        #[command(flatten)]
        common: IngestArgs,
        /// The directory.
        dir: PathBuf,
    },
    /// WebDataset tar files (plain or gzip): each sample (entries sharing a key) is one
    /// record, grouped as webdataset groups them.
    Tar {
        #[command(flatten)]
        common: IngestArgs,
        /// The tar files, in order: paths, brace patterns (shard-{000..009}.tar), a::b,
        /// file: URLs, or directories of tars.
        #[arg(required = true)]
        tars: Vec<PathBuf>,
    },
    /// A Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx): each sequence is one record,
    /// an array of the index's dtype, in order (record i is Megatron's IndexedDataset[i]).
    Megatron {
        #[command(flatten)]
        common: IngestArgs,
        /// The dataset's path without .bin/.idx (or either file).
        prefix: PathBuf,
    },
    /// Parquet files: one record per row. One column of lists of numbers (token ids) makes
    /// array records of their type; one of binary or strings, byte records; one of numbers,
    /// records of one number; several columns, samples of named parts (binary and strings as
    /// bytes, lists as little-endian arrays, numbers as decimal text), as WebDataset samples.
    Parquet {
        #[command(flatten)]
        common: IngestArgs,
        /// A column to ingest (repeat for several; default: the files' only column).
        #[arg(long = "column")]
        columns: Vec<String>,
        /// Leave out rows that hold a null in a chosen column (default: refuse them).
        #[arg(long)]
        skip_nulls: bool,
        /// The Parquet files, in order: paths, directories (their .parquet files) or glob
        /// patterns ('data/train-*.parquet', quoted).
        #[arg(required = true)]
        inputs: Vec<String>,
    },
    /// A Mosaic Streaming MDS directory (index.json + shard.NNNNN.mds[.zstd]): one record per
    /// sample, in order. One column (--column) of 1-D arrays makes array records of their dtype;
    /// of bytes, strings, JSON or images, byte records; of numbers, records of one number.
    /// Otherwise samples of parts named COLUMN.EXT (arrays and `pil` images' raw pixels as .npy,
    /// numbers as decimal text).
    Mds {
        #[command(flatten)]
        common: IngestArgs,
        /// A column to ingest (repeat for several; default: every column, as samples).
        #[arg(long = "column")]
        columns: Vec<String>,
        /// The directory holding index.json.
        dir: PathBuf,
    },
    /// A LitData optimized directory (index.json + chunk-*.bin, as litdata.optimize writes it
    /// with its default item loader or TokensLoader): one record per item, in order. One leaf
    /// (--column, a dict's key) of 1-D arrays makes array records of their dtype; of str or
    /// bytes, byte records; of int, float or bool, records of one number. Otherwise samples of
    /// parts named LEAF.EXT (arrays as .npy, numbers as decimal text, bools as JSON). A
    /// TokensLoader directory: its documents as array records, or with --block-size its tokens
    /// cut in blocks as LitData's StreamingDataset yields them.
    Litdata {
        #[command(flatten)]
        common: IngestArgs,
        /// A leaf to ingest (repeat for several; default: every leaf, as samples).
        #[arg(long = "column")]
        columns: Vec<String>,
        /// A TokensLoader directory's block size: records of this many tokens, as
        /// `TokensLoader(block_size=N)` reads them (default: the documents the writer wrote).
        #[arg(long)]
        block_size: Option<u64>,
        /// The directory holding index.json.
        dir: PathBuf,
    },
}

#[derive(Args)]
struct IngestArgs {
    /// The dataset's name.
    #[arg(long)]
    name: String,
    /// Into a dataset that exists: add these records to its current version's.
    #[arg(long, conflicts_with = "replace")]
    append: bool,
    /// Into a dataset that exists: make these records the new version. Without --append or
    /// --replace, a dataset that exists takes only exactly the records it holds (nothing
    /// changes: the same ingest twice is harmless) and anything else is refused.
    #[arg(long)]
    replace: bool,
    /// Close a shard once it holds this much record data (suffixes K, M, G, KiB, MiB, GiB).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    shard_bytes: u64,
    /// Then replicate the new version with this many copies of each shard, through the node
    /// serving this store; in synchronous mode the command returns once every copy is verified
    /// on its node.
    #[arg(long)]
    replicas: Option<u32>,
    #[command(flatten)]
    key: cluster::KeyArgs,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Random and sequential reads through the engine against a bare io_uring O_DIRECT reader on
    /// the same files, plus checksum and hash speed.
    Read(bench::read::ReadArgs),
    /// The loader against the disk's and the bus's limits: a bare io_uring reader, the engine to
    /// host memory and to the GPU, a pinned copy; cold, warm, and under a simulated training step.
    Loader(bench::loader::LoaderArgs),
    /// One shard's transfer between two nodes (encrypted, verified) against a plain TCP copy of
    /// the same file, and the time to restore the replication factor after a node loss. The
    /// root is a scratch directory.
    Replication(bench::replication::ReplicationArgs),
    /// A dataset several times the cache, read from a throttled origin through the cache for a
    /// few epochs with each evictor (plan-aware, LRU, S3-FIFO): hit ratio, bytes from the
    /// origin against Belady's minimum for the same plan, data stall. The root is a scratch
    /// directory.
    Cache(bench::cache::CacheArgs),
}

/// How long a command that writes waits for another writer (an ingest, or `granary serve`
/// publishing what arrived from a peer) to release the store: `--wait`, `--no-wait`.
static LOCK_WAIT: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();

fn lock_wait() -> std::time::Duration {
    *LOCK_WAIT.get().unwrap_or(&std::time::Duration::from_secs(60))
}

/// Says once, at once, that a command waits for another process's write lock, and on whom.
fn tell_waiting(error: &granary::Error) {
    errln!(
        "granary: {error}; waiting up to {} s for it (--wait SECONDS to wait longer, --no-wait not at all)",
        lock_wait().as_secs()
    );
}

/// Opens the store for writing, waiting for another writer as `--wait` says and saying so.
pub(crate) fn open_writer(root: &std::path::Path, create: bool) -> granary::Result<Granary> {
    Granary::open_waiting_telling(root, create, lock_wait(), &mut tell_waiting)
}

/// Opens the store for writing and repairs it, waiting for another writer as `open_writer`.
pub(crate) fn open_and_repair(root: &std::path::Path) -> granary::Result<(Granary, granary::engine::RepairReport)> {
    Granary::open_and_repair_telling(root, lock_wait(), &mut tell_waiting)
}

/// Runs the command line on this process's arguments; prints errors as one line.
pub fn main() -> ExitCode {
    ExitCode::from(main_with(std::env::args_os().collect()))
}

/// Runs the command line on `args` (the program's name first) and returns its exit status (0
/// for success, 1 for a failure, 2 for a usage error): the `granary` console script of the
/// Python package runs this, in the Python process.
pub fn main_with(args: Vec<std::ffi::OsString>) -> u8 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(usage) => {
            // --help and --version print to stdout and succeed; a usage error is status 2.
            let _ = usage.print();
            return u8::try_from(usage.exit_code()).unwrap_or(2);
        }
    };
    // A panic anywhere in the command is its one-line error, exit 1, never a trace and 101.
    let outcome = crate::error::catch_panic(|| "the command".to_owned(), || Ok(run(cli)))
        .unwrap_or_else(|panicked| Err(panicked.into()));
    match outcome {
        Ok(code) if code == ExitCode::SUCCESS => 0,
        Ok(_) => 1,
        // The reader of our output has all it wanted (`| head`): not a failure.
        Err(error) if output::is_closed_pipe(&error) => 0,
        Err(error) => {
            let message = one_line(&error);
            let _ = writeln!(std::io::stderr(), "granary: error: {message}");
            1
        }
    }
}

/// The error and its causes on one line, each cause once: the engine's errors already print
/// their source (the OS text of an I/O error) in their own message.
fn one_line(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if !message.contains(&text) {
            if !message.is_empty() {
                message.push_str(": ");
            }
            message.push_str(&text);
        }
    }
    message.replace('\n', " ")
}

fn run(cli: Cli) -> Result<ExitCode> {
    let _ =
        LOCK_WAIT.set(if cli.no_wait { std::time::Duration::ZERO } else { std::time::Duration::from_secs(cli.wait) });
    if let Command::Plugin(command) = cli.command {
        return plugin::run(command).map(|ok| if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }
    if let Command::ClusterKey(args) = &cli.command {
        return cluster::cluster_key(args).map(|()| ExitCode::SUCCESS);
    }
    if let Command::Tier(command) = cli.command {
        return tier::run(command, cli.root.as_deref()).map(|()| ExitCode::SUCCESS);
    }
    if let Command::Top(args) = &cli.command {
        return top::run(cli.root.as_deref(), args).map(|()| ExitCode::SUCCESS);
    }
    let root = cli.root.context("no store given: pass --root DIR or set GRANARY_ROOT")?;
    let paths = StorePaths::new(&root);
    match cli.command {
        Command::Ingest(command) => ingest(root, command).map(|()| ExitCode::SUCCESS),
        Command::Ls => show::ls(&paths).map(|()| ExitCode::SUCCESS),
        Command::Inspect { target, records } => show::inspect(&paths, &target, records).map(|()| ExitCode::SUCCESS),
        Command::Get { dataset, index, output, key } => {
            get(&paths, &dataset, index, output.as_deref(), &key).map(|()| ExitCode::SUCCESS)
        }
        Command::Mix(args) => mix::mix(&paths, &args).map(|()| ExitCode::SUCCESS),
        Command::Verify { dataset } => show::verify(&paths, dataset.as_deref()),
        Command::Repair => show::repair(root).map(|()| ExitCode::SUCCESS),
        Command::Rm { dataset } => remove(root, &dataset).map(|()| ExitCode::SUCCESS),
        Command::Gc { prune_now } => show::gc(root, prune_now).map(|()| ExitCode::SUCCESS),
        Command::Push { dataset, url } => origin::push(&paths, &dataset, &url).map(|()| ExitCode::SUCCESS),
        Command::Attach { dataset, url, cache_bytes, evictor } => {
            origin::attach(&root, &dataset, &url, cache_bytes, evictor.as_deref()).map(|()| ExitCode::SUCCESS)
        }
        Command::Detach { dataset } => origin::detach(&root, &dataset).map(|()| ExitCode::SUCCESS),
        Command::Bench(BenchCommand::Read(args)) => bench::read::read(&paths, &args).map(|()| ExitCode::SUCCESS),
        Command::Bench(BenchCommand::Replication(args)) => {
            bench::replication::replication(&root, &args).map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Cache(args)) => bench::cache::cache(&root, &args).map(|()| ExitCode::SUCCESS),
        Command::Bench(BenchCommand::Loader(args)) => {
            bench::loader::loader(&root, &paths, &args).map(|()| ExitCode::SUCCESS)
        }
        Command::Serve(args) => cluster::serve(&root, &args).map(|()| ExitCode::SUCCESS),
        Command::Replicate(args) => cluster::replicate(&root, &args).map(|()| ExitCode::SUCCESS),
        Command::Status(args) => cluster::status(&root, &args).map(|()| ExitCode::SUCCESS),
        Command::Plugin(_) | Command::ClusterKey(_) | Command::Tier(_) | Command::Top(_) => {
            unreachable!("handled above, before a store is needed")
        }
    }
}

/// An ingest's input, read and checked before the store is touched (a Megatron index decides
/// the layout by its dtype; tar arguments, patterns and directories, are expanded once).
enum Input {
    Records,
    Files,
    Tar(Vec<PathBuf>),
    Megatron(ingest::MegatronIndex),
    Parquet(ingest::ParquetInput),
    Mds(ingest::MdsInput),
    Litdata(ingest::LitDataInput),
}

impl Input {
    /// The input `command` names, opened, and the layout of its records.
    fn open(command: &IngestCommand) -> Result<(Self, Layout)> {
        Ok(match command {
            IngestCommand::Records { record_bytes, dtype, shape, .. } => {
                (Input::Records, Layout::Fixed(fixed_layout(*record_bytes, dtype.as_deref(), shape.as_deref())?))
            }
            IngestCommand::Files { .. } => (Input::Files, Layout::Bytes),
            IngestCommand::Tar { tars, .. } => (Input::Tar(expand_tars(tars)?), Layout::Samples),
            IngestCommand::Megatron { prefix, .. } => {
                let index = ingest::MegatronIndex::open(prefix)?;
                let layout = index.layout();
                (Input::Megatron(index), layout)
            }
            IngestCommand::Parquet { columns, skip_nulls, inputs, .. } => {
                let nulls = if *skip_nulls { ingest::Nulls::Skip } else { ingest::Nulls::Refuse };
                let input = ingest::ParquetInput::open(inputs, columns, nulls)?;
                let layout = input.layout();
                (Input::Parquet(input), layout)
            }
            IngestCommand::Mds { columns, dir, .. } => {
                let input = ingest::MdsInput::open(dir, columns)?;
                let layout = input.layout();
                (Input::Mds(input), layout)
            }
            IngestCommand::Litdata { columns, block_size, dir, .. } => {
                let input = ingest::LitDataInput::open(dir, columns, *block_size)?;
                let layout = input.layout();
                (Input::Litdata(input), layout)
            }
        })
    }

    /// Refuses an input that is not a regular file (a FIFO would block with the store locked),
    /// before the lock is taken.
    fn check_files(&self, command: &IngestCommand) -> Result<()> {
        match (self, command) {
            (_, IngestCommand::Records { files, .. }) => _ = ingest::check_regular_files(files)?,
            (Input::Tar(paths), _) => _ = ingest::check_regular_files(paths)?,
            _ => {}
        }
        Ok(())
    }

    /// Its records, into `session`.
    fn feed(&self, command: &IngestCommand, session: &mut granary::ingest::Ingest<'_>, bar: &Bar) -> Result<()> {
        match (self, command) {
            (Input::Records, IngestCommand::Records { files, drop_remainder, .. }) => {
                ingest::records_from_files(session, files, *drop_remainder, bar)?;
            }
            (Input::Files, IngestCommand::Files { dir, .. }) => _ = ingest::files_from_dir(session, dir, bar)?,
            (Input::Tar(paths), _) => _ = ingest::samples_from_tars(session, paths, bar)?,
            (Input::Megatron(index), _) => ingest::records_from_megatron(session, index, bar)?,
            (Input::Parquet(input), _) => {
                let done = ingest::records_from_parquet(session, input, bar)?;
                if done.skipped > 0 {
                    errln!("skipped {} rows with a null in a chosen column", done.skipped);
                }
            }
            (Input::Mds(input), _) => _ = ingest::records_from_mds(session, input, bar)?,
            (Input::Litdata(input), _) => _ = ingest::records_from_litdata(session, input, bar)?,
            (Input::Records | Input::Files, _) => bail!("the input was opened for another command"),
        }
        Ok(())
    }
}

fn ingest(root: PathBuf, command: IngestCommand) -> Result<()> {
    let common = match &command {
        IngestCommand::Records { common, .. }
        | IngestCommand::Files { common, .. }
        | IngestCommand::Tar { common, .. }
        | IngestCommand::Megatron { common, .. }
        | IngestCommand::Parquet { common, .. }
        | IngestCommand::Mds { common, .. }
        | IngestCommand::Litdata { common, .. } => common,
    };
    let (input, layout) = Input::open(&command)?;
    let name = DatasetName::new(&common.name)?;
    // What replicating afterwards needs is checked before anything is ingested: a failure
    // after the commit would invite a second ingest of the same records.
    let replicate_with = match common.replicas {
        Some(0) => bail!("--replicas must be at least 1"),
        Some(replicas) => Some((replicas, granary::replication::NodeClient::for_store(&root, common.key.key()?)?)),
        None => None,
    };
    let options = IngestOptions {
        shard_bytes_target: common.shard_bytes,
        mode: match (common.append, common.replace) {
            (true, _) => IngestMode::Append,
            (_, true) => IngestMode::Replace,
            _ => IngestMode::New,
        },
        ..IngestOptions::default()
    };
    input.check_files(&command)?;
    // A typo in --root would otherwise make a new empty store without a word.
    let created = StorePaths::new(&root).check().is_err();
    let mut granary = open_writer(&root, true)?;
    let mut session = granary.ingest(name, layout, options)?;
    let bar = Bar::new();
    input.feed(&command, &mut session, &bar)?;
    let committed = session.commit().map_err(|e| match e {
        // In the command line's terms.
        granary::Error::IngestIntent { name, version, records, incoming, same_count_shard_bytes } => anyhow::anyhow!(
            "dataset {name} exists ({name}@{version}{}) and this input differs ({incoming} records): --append adds \
             them to the current version's records, --replace makes them the new version{}",
            records.map(|n| format!(": {n} records")).unwrap_or_default(),
            granary::error::same_count_hint(same_count_shard_bytes)
        ),
        other => other.into(),
    })?;
    if created {
        errln!("created a new store at {}", root.display());
    }
    drop(granary);
    bar.finish();
    report_ingest(&committed, &bar)?;
    if let Some((replicas, client)) = replicate_with {
        let spec = format!("{}@{}", committed.name, committed.version);
        let goal = granary::replication::frame::Goal::Replicas(replicas);
        let report = client.replicate(&spec, goal, granary::replication::frame::ReplicateMode::Node, |_, _| {}).with_context(|| {
            format!(
                "{spec} is committed here, but not replicated: `granary replicate {spec} --replicas {replicas}` retries"
            )
        })?;
        outln!("{report}")?;
    }
    Ok(())
}

/// What an ingest committed, on stdout.
fn report_ingest(committed: &granary::ingest::Committed, bar: &Bar) -> Result<()> {
    let stats = &committed.stats;
    if committed.unchanged {
        // What was missing of it on disk was written again all the same.
        let rewritten = if stats.shards_published > 0 {
            format!("; {} missing shards written again", stats.shards_published)
        } else {
            String::new()
        };
        outln!(
            "unchanged: {}@{} already holds exactly these {} records (manifest {}){rewritten}",
            committed.name,
            committed.version,
            committed.n_records,
            committed.manifest.0.short(12)
        )?;
    } else {
        outln!(
            "{}@{}: {} records in {} shards (manifest {}); this ingest: {} records, {}, {} new shards, {} already stored",
            committed.name,
            committed.version,
            committed.n_records,
            committed.n_shards,
            committed.manifest.0.short(12),
            stats.records,
            show::bytes(stats.bytes),
            stats.shards_published,
            stats.shards_deduplicated
        )?;
    }
    if bar.n_skipped() > 0 {
        outln!("{} input members skipped (listed on stderr)", bar.n_skipped())?;
    }
    Ok(())
}

fn fixed_layout(record_bytes: u64, dtype: Option<&str>, shape: Option<&[u64]>) -> Result<FixedLayout> {
    let dtype = match dtype {
        None => Dtype::U8,
        Some(name) => Dtype::from_name(name).with_context(|| {
            let names: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
            format!("unknown dtype {name:?} (one of {})", names.join(", "))
        })?,
    };
    let dims = match shape {
        Some(dims) => dims.to_vec(),
        None => {
            if record_bytes == 0 || !record_bytes.is_multiple_of(dtype.size_bytes()) {
                bail!("a record of {record_bytes} bytes is not a whole number of {} elements", dtype.name());
            }
            vec![record_bytes / dtype.size_bytes()]
        }
    };
    let layout = FixedLayout::new(dtype, &dims)?;
    if layout.record_bytes() != record_bytes {
        bail!(
            "--record-bytes {record_bytes} does not match {} x {:?} = {} bytes",
            dtype.name(),
            dims,
            layout.record_bytes()
        );
    }
    Ok(layout)
}

fn get(
    paths: &StorePaths,
    spec: &str,
    index: u64,
    output: Option<&std::path::Path>,
    key: &cluster::KeyArgs,
) -> Result<()> {
    use std::io::IsTerminal;
    // A record is raw bytes: written to a terminal they garble it (curl refuses too).
    if output.is_none() && std::io::stdout().is_terminal() {
        bail!("a record is binary: redirect stdout (get NAME INDEX > record.bin) or pass -o FILE");
    }
    let dataset = granary::Dataset::open(paths, &paths.parse_spec(spec)?)?;
    let attached = match dataset.version() {
        Some((name, _)) => granary::origin::attachment(paths, name)?.is_some(),
        None => false,
    };
    let mut reader = Reader::new(dataset, IoConfig::default().build()?);
    // A node serving this store repairs what the read finds damaged (none serving: no hook).
    let node = match key.key_if_given()? {
        // An unreadable address is no reason to refuse what the disk holds: read without it.
        Some(key) => granary::replication::NodeClient::serving(paths.root(), key).ok().flatten(),
        None => None,
    };
    if attached {
        // Its shards come from a peer through that node, else from its origin, through the
        // store's cache.
        if let Some(cache) = granary::origin::OriginCache::open(paths, None, &[])? {
            if let Some(client) = node {
                cache.set_peers(std::sync::Arc::new(client));
            }
            reader.set_repair(cache);
        }
    } else if let Some(client) = node {
        reader.set_repair(std::sync::Arc::new(client));
    }
    let record = reader.get(index)?;
    match output {
        Some(path) => std::fs::write(path, &record).with_context(|| format!("write {}", path.display()))?,
        None => output::write_bytes(&record)?,
    }
    Ok(())
}

fn remove(root: PathBuf, spec: &str) -> Result<()> {
    let mut granary = open_writer(&root, false)?;
    match VersionSpec::parse(spec)? {
        VersionSpec::Latest(name) => match granary.remove(&name, None) {
            Ok(()) => outln!("removed dataset {name}; `granary gc` deletes files no version uses")?,
            // No ref: a dataset whose ref `repair` quarantined is forgotten by name.
            Err(granary::Error::NotFound { .. }) if granary.forget_quarantined(&name)? > 0 => outln!(
                "forgot dataset {name}: its quarantined ref is kept in quarantine/ as forgotten-*, and \
                 `granary gc` may now delete its files"
            )?,
            Err(e) => return Err(e.into()),
        },
        VersionSpec::Numbered(name, number) => {
            granary.remove(&name, Some(number))?;
            outln!("removed {name}@{number}; `granary gc` deletes files no version uses")?;
        }
        VersionSpec::Manifest(_) => bail!("remove takes NAME or NAME@N, not a manifest id"),
    }
    Ok(())
}

/// The tars that `ingest tar`'s arguments name: brace patterns, `a::b`, `file:` URLs and
/// directories as webdataset's users write them (`ingest::expand_tar_inputs`).
fn expand_tars(tars: &[PathBuf]) -> granary::Result<Vec<PathBuf>> {
    let inputs: Vec<String> = tars.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    ingest::expand_tar_inputs(&inputs)
}

/// Sizes on the command line: `crate::size`'s grammar (`4096`, `64KiB`, `1.5GiB`, ...).
pub(crate) use granary::size::parse_bytes as parse_size;

/// A progress bar on stderr; draws nothing when stderr is not a terminal. What an ingest skips
/// is listed on stderr and counted.
struct Bar(indicatif::ProgressBar, std::sync::atomic::AtomicU64);

impl Bar {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
        let style = indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("the template is valid");
        bar.set_style(style);
        Self(bar, std::sync::atomic::AtomicU64::new(0))
    }

    fn n_skipped(&self) -> u64 {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress for Bar {
    fn start(&self, total_bytes: u64) {
        self.0.set_length(total_bytes);
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }

    fn skipped(&self, source: &std::path::Path, member: &str, reason: &str) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.suspend(|| {
            let _ = writeln!(std::io::stderr(), "granary: skipped {}: {member}: {reason}", source.display());
        });
    }
}
