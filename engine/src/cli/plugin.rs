//! `granary plugin`: the kit a policy author runs: check a plugin, simulate it, make traces.
//!
//! Owns: the `plugin` subcommands and their arguments (`PluginCommand`, `SimCommand`,
//! `TraceCommand`), where the kit caches compiled plugins (`GRANARY_PLUGIN_CACHE`, else
//! `$XDG_CACHE_HOME/granary/plugins`, else `~/.cache/granary/plugins`), and the reports printed.
//! Never: opens a store (it runs without `--root`), or checks, simulates or makes a trace itself
//! (`policy::conformance`, `policy::sim` and `policy::trace` do).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use granary::policy::{self, PolicyHost, conformance, sim, trace};

#[derive(Subcommand)]
pub(crate) enum PluginCommand {
    /// Load a plugin (a built-in name or a .wasm component) and run the conformance suite:
    /// determinism, totality on random inputs, valid outputs.
    Check {
        /// Built-in name (lru, sieve, elastic, ...) or path to a .wasm component.
        plugin: String,
        /// Random cases per property.
        #[arg(long, default_value_t = 64)]
        cases: u32,
        /// Seed of the random cases.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Plugin options for every case, comma-separated `key=value` pairs.
        #[arg(long, value_delimiter = ',', value_parser = parse_option)]
        options: Vec<(String, String)>,
    },
    /// Simulate a plugin.
    #[command(subcommand)]
    Sim(SimCommand),
    /// Write a cache trace in libCacheSim's oracleGeneral format.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// List the built-in plugins.
    List,
}

#[derive(Args)]
pub(crate) struct PluginArgs {
    /// Built-in name or path to a .wasm component.
    #[arg(long)]
    plugin: String,
    /// Plugin options, comma-separated `key=value` pairs.
    #[arg(long, value_delimiter = ',', value_parser = parse_option)]
    options: Vec<(String, String)>,
}

#[derive(Subcommand)]
pub(crate) enum SimCommand {
    /// Replay a trace through an evictor and print its miss ratio (and the optimum).
    Evict {
        #[command(flatten)]
        plugin: PluginArgs,
        /// An oracleGeneral trace.
        #[arg(long)]
        trace: PathBuf,
        /// Cache size in objects (every object counts as size 1, like libCacheSim's
        /// --ignore-obj-size).
        #[arg(long, conflicts_with = "cache_bytes")]
        cache_objects: Option<u64>,
        /// Cache size in bytes, using the trace's object sizes.
        #[arg(long)]
        cache_bytes: Option<u64>,
    },
    /// Plan an epoch for each world size and print balance and the records that change rank.
    Partition {
        #[command(flatten)]
        plugin: PluginArgs,
        /// Shards in the synthetic dataset.
        #[arg(long)]
        shards: u64,
        /// World sizes, in order (movement is measured between consecutive ones).
        #[arg(long, value_delimiter = ',', required = true)]
        ranks: Vec<u32>,
        /// Records per shard.
        #[arg(long, default_value_t = 1000)]
        records_per_shard: u64,
        /// Records per rank per step.
        #[arg(long, default_value_t = 256)]
        batch: u64,
        /// Rank weights, cycled over the rank ids.
        #[arg(long, value_delimiter = ',')]
        weights: Vec<u32>,
    },
    /// Simulate one epoch of a synchronous job with a slow rank, rebalanced every N steps by the
    /// partitioner, and print its time against the ideal proportional split.
    Rebalance {
        #[command(flatten)]
        plugin: PluginArgs,
        /// Shards in the synthetic dataset.
        #[arg(long)]
        shards: u64,
        /// Records per shard.
        #[arg(long, default_value_t = 1000)]
        records_per_shard: u64,
        /// Ranks of the job.
        #[arg(long)]
        ranks: u32,
        /// Records per rank per step.
        #[arg(long, default_value_t = 32)]
        batch: u64,
        /// Steps between rebalance points (0: never rebalance).
        #[arg(long, default_value_t = 50)]
        every: u64,
        /// A slow rank: RANK:FACTOR@STEP (rank 3 reads 3 times slower from step 100: 3:3@100).
        #[arg(long, value_parser = parse_straggler)]
        straggler: Option<sim::Straggler>,
        /// Also save at this step and resume, and check the resumed run reads the same order.
        #[arg(long)]
        resume_at: Option<u64>,
        /// The resumed run's ranks (default: the same).
        #[arg(long, requires = "resume_at")]
        resume_ranks: Option<u32>,
    },
    /// Place copies on N nodes, then on N+1 and N-1, and print balance and movement.
    Replicate {
        #[command(flatten)]
        plugin: PluginArgs,
        /// Nodes.
        #[arg(long)]
        nodes: u32,
        /// Copies of each shard.
        #[arg(long)]
        replicas: u32,
        /// Node weights, cycled over the node ids.
        #[arg(long, value_delimiter = ',')]
        weights: Vec<u32>,
        /// Failure domains (node i is in domain i mod D).
        #[arg(long, default_value_t = 1)]
        domains: u32,
    },
}

#[derive(Subcommand)]
pub(crate) enum TraceCommand {
    /// Requests with Zipf popularity.
    Zipf {
        /// Distinct objects.
        #[arg(long)]
        objects: u64,
        /// Requests.
        #[arg(long)]
        requests: u64,
        /// Skew.
        #[arg(long, default_value_t = 1.0)]
        alpha: f64,
        /// Seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Epochs over all objects, each in a fresh shuffled order (a training loop).
    Shuffled {
        /// Objects (records).
        #[arg(long)]
        objects: u64,
        /// Epochs.
        #[arg(long)]
        epochs: u64,
        /// Seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
}

fn parse_option(text: &str) -> Result<(String, String), String> {
    let (key, value) = text.split_once('=').ok_or_else(|| format!("option {text:?} is not key=value"))?;
    Ok((key.to_owned(), value.to_owned()))
}

fn parse_straggler(text: &str) -> Result<sim::Straggler, String> {
    let bad = || format!("straggler {text:?} is not RANK:FACTOR@STEP (such as 3:3@100)");
    let (rank, rest) = text.split_once(':').ok_or_else(bad)?;
    let (factor, step) = rest.split_once('@').ok_or_else(bad)?;
    let straggler = sim::Straggler {
        rank: rank.trim().parse().map_err(|_| bad())?,
        factor: factor.trim().parse().map_err(|_| bad())?,
        from_step: step.trim().parse().map_err(|_| bad())?,
    };
    if !(straggler.factor >= 1.0 && straggler.factor.is_finite()) {
        return Err(format!("straggler {text:?}: the factor must be 1 or more"));
    }
    Ok(straggler)
}

fn host() -> Result<PolicyHost> {
    let cache = std::env::var_os("GRANARY_PLUGIN_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|dir| PathBuf::from(dir).join("granary/plugins")))
        .or_else(|| std::env::var_os("HOME").map(|dir| PathBuf::from(dir).join(".cache/granary/plugins")));
    Ok(PolicyHost::new(policy::Limits::default(), cache)?)
}

pub(crate) fn run(command: PluginCommand) -> Result<bool> {
    match command {
        PluginCommand::List => {
            for name in policy::builtin::NAMES {
                outln!("{name}")?;
            }
            Ok(true)
        }
        PluginCommand::Check { plugin, cases, seed, options } => check(&plugin, &options, cases, seed),
        PluginCommand::Trace(TraceCommand::Zipf { objects, requests, alpha, seed, out }) => {
            let requests = trace::zipf(objects, requests, alpha, seed)?;
            trace::write(&out, &requests)?;
            outln!("wrote {} requests to {} objects (Zipf {alpha}) to {}", requests.len(), objects, out.display())?;
            Ok(true)
        }
        PluginCommand::Trace(TraceCommand::Shuffled { objects, epochs, seed, out }) => {
            let requests = trace::epoch_shuffled(objects, epochs, seed)?;
            trace::write(&out, &requests)?;
            outln!(
                "wrote {} requests ({epochs} shuffled epochs over {objects} objects) to {}",
                requests.len(),
                out.display()
            )?;
            Ok(true)
        }
        PluginCommand::Sim(SimCommand::Evict { plugin, trace: path, cache_objects, cache_bytes }) => {
            let host = host()?;
            let loaded = host.load(&plugin.plugin)?;
            let requests = trace::read(&path)?;
            let (capacity, ignore_sizes) = match (cache_objects, cache_bytes) {
                (Some(objects), _) => (objects, true),
                (None, Some(bytes)) => (bytes, false),
                (None, None) => bail!("give --cache-objects or --cache-bytes"),
            };
            let result = sim::evict(&loaded, &plugin.options, &requests, capacity, ignore_sizes)?;
            outln!(
                "plugin {} on {} ({} requests), cache of {capacity} {}",
                loaded.name(),
                path.display(),
                result.requests,
                if ignore_sizes { "objects" } else { "bytes" }
            )?;
            outln!("misses {} of {}: miss ratio {:.6}", result.misses, result.requests, result.miss_ratio())?;
            if ignore_sizes {
                let optimum = trace::belady_misses(&requests, capacity);
                outln!(
                    "optimum (Belady) {optimum} misses: miss ratio {:.6}",
                    optimum as f64 / result.requests.max(1) as f64
                )?;
            }
            outln!(
                "{:.1} ns per access in batches of {} (through the component boundary, validated)",
                result.elapsed.as_nanos() as f64 / result.requests.max(1) as f64,
                sim::EVICT_BATCH
            )?;
            Ok(result.fallback_calls == 0)
        }
        PluginCommand::Sim(SimCommand::Partition { plugin, shards, ranks, records_per_shard, batch, weights }) => {
            let host = host()?;
            let loaded = host.load(&plugin.plugin)?;
            let dataset = sim::synthetic_shards(shards, records_per_shard)?;
            let (results, movements) = sim::partition(&loaded, &plugin.options, &dataset, &ranks, &weights, batch)?;
            outln!("plugin {} on {shards} shards x {records_per_shard} records, batch {batch}", loaded.name())?;
            for result in &results {
                let (min, max) = (
                    result.records.iter().min().copied().unwrap_or(0),
                    result.records.iter().max().copied().unwrap_or(0),
                );
                outln!(
                    "{:>5} ranks: plan in {:.1} ms, {} ranges, records per rank {min}..{max}, largest deviation from the weighted share {:.2}%; mixing: spread {:.3} of a full shuffle's, {:.1} shards per batch",
                    result.ranks,
                    result.elapsed.as_secs_f64() * 1e3,
                    result.ranges,
                    result.balance_error * 100.0,
                    result.mixing.spread,
                    result.mixing.shards_per_batch
                )?;
            }
            for (movement, pair) in movements.iter().zip(ranks.windows(2)) {
                let bound = 1.1 / f64::from(pair[0].max(pair[1]));
                outln!(
                    "{} -> {} ranks: {:.2}% of the records change rank (1.1/N = {:.2}%), {}",
                    pair[0],
                    pair[1],
                    movement.moved * 100.0,
                    bound * 100.0,
                    if movement.only_changed_members {
                        "all to or from the changed ranks"
                    } else {
                        "some between unchanged ranks"
                    }
                )?;
            }
            Ok(true)
        }
        PluginCommand::Sim(SimCommand::Rebalance {
            plugin,
            shards,
            records_per_shard,
            ranks,
            batch,
            every,
            straggler,
            resume_at,
            resume_ranks,
        }) => {
            let host = host()?;
            let loaded = host.load(&plugin.plugin)?;
            let dataset = sim::synthetic_shards(shards, records_per_shard)?;
            let config = sim::RebalanceSim { ranks, batch, every, straggler, resume_at, resume_ranks };
            let outcome = sim::rebalance(&loaded, &plugin.options, &dataset, &config)?;
            let slow = match straggler {
                Some(s) => format!("rank {} {} x slower from step {}", s.rank, s.factor, s.from_step),
                None => "no straggler".to_owned(),
            };
            outln!(
                "plugin {} on {shards} shards x {records_per_shard} records, {ranks} ranks, batch {batch}, {slow}",
                loaded.name()
            )?;
            let run = &outcome.rebalanced;
            if every > 0 {
                outln!("rebalance every {every} steps: {} points in {} steps", run.points, run.steps)?;
                let total: f64 = run.last_weights.iter().map(|&w| f64::from(w)).sum();
                let shares: Vec<String> = run
                    .last_weights
                    .iter()
                    .enumerate()
                    .map(|(rank, &w)| format!("{rank}:{:.3}", f64::from(w) / total.max(1.0)))
                    .collect();
                outln!("shares at the end: {}", shares.join(" "))?;
                outln!(
                    "records per rank: {}",
                    run.records_per_rank.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
                )?;
            }
            outln!("epoch time vs ideal: {:.3} x", run.vs_ideal())?;
            outln!("without rebalancing: {:.3} x", outcome.fixed.vs_ideal())?;
            let once = run.exactly_once && outcome.fixed.exactly_once;
            outln!("every record read exactly once: {}", if once { "yes" } else { "NO" })?;
            if let Some(same) = outcome.resumed_same_order {
                outln!(
                    "saved at step {} and resumed on {} ranks: {}",
                    resume_at.unwrap_or(0),
                    resume_ranks.unwrap_or(ranks),
                    if same { "the same global order, every record exactly once" } else { "A DIFFERENT ORDER" }
                )?;
            }
            Ok(once && outcome.resumed_same_order != Some(false))
        }
        PluginCommand::Sim(SimCommand::Replicate { plugin, nodes, replicas, weights, domains }) => {
            let host = host()?;
            let loaded = host.load(&plugin.plugin)?;
            let (results, movements) = sim::replicate(&loaded, &plugin.options, nodes, replicas, &weights, domains)?;
            outln!("plugin {} with {replicas} replicas, {domains} failure domains", loaded.name())?;
            for result in &results {
                outln!(
                    "{:>5} nodes: placed in {:.1} ms, largest deviation from the weighted share {:.2}%",
                    result.nodes,
                    result.elapsed.as_secs_f64() * 1e3,
                    result.balance_error * 100.0
                )?;
            }
            for (movement, what) in movements.iter().zip(["adding a node", "removing a node"]) {
                let n = if what == "adding a node" { nodes + 1 } else { nodes };
                outln!(
                    "{what}: {:.2}% of the copies move (1.1/N = {:.2}%), {}",
                    movement.moved * 100.0,
                    110.0 / f64::from(n),
                    if movement.only_changed_members { "all to or from that node" } else { "some between other nodes" }
                )?;
            }
            Ok(true)
        }
    }
}

fn check(plugin: &str, options: &[(String, String)], cases: u32, seed: u64) -> Result<bool> {
    let host = host()?;
    let loaded = host.load(plugin).with_context(|| format!("loading {plugin}"))?;
    outln!(
        "{} {}: a {} (id {}), loaded in {:.2} ms ({:?})",
        if loaded.compiled_from() == policy::CompiledFrom::Compiler { "compiled" } else { "found" },
        loaded.name(),
        loaded.kind().name(),
        loaded.id().short(12),
        loaded.load_time().as_secs_f64() * 1e3,
        loaded.compiled_from()
    )?;
    let report = conformance::check_with(&loaded, options, cases, seed);
    for check in &report.checks {
        match &check.failure {
            None => outln!("  ok    {} ({cases} cases)", check.name)?,
            Some(failure) => outln!("  FAIL  {}: {failure}", check.name)?,
        }
    }
    outln!("{}", if report.passed() { "conformance: passed" } else { "conformance: FAILED" })?;
    Ok(report.passed())
}
