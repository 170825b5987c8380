//! The epoch planner: one rank's (or several ranks') batches of an epoch from the plan (the
//! partitioner plugin's, or the native `EpochPlan`), each with the position after it, cut in
//! steps of `world x batch_size` (split by the rank weights in force when the loader
//! rebalances).
//!
//! Owns: `EpochPlanner` (the plan source, the weights, the cut), `PlanConfig` (what decides a
//! plan: a loader's, or that of a planner of other ranks' epochs), `shards_by_step`. Never: reads data, or cuts a plugin's
//! plan that is not step-cut (it names the rank and the record instead).

use super::{LoaderConfig, PlanSource};
use crate::error::{Error, Result};
use crate::plan::{EpochPlan, Order, Position, RankCursor, World};
use crate::read::Dataset;

/// One epoch's batches of this rank, each with the position after it.
pub(super) type EpochBatches = Vec<(Vec<u64>, Position)>;

/// The shards each batch of `batches` reads, in order, each once per batch.
pub(super) fn shards_by_step(dataset: &Dataset, batches: &EpochBatches) -> Vec<Vec<crate::id::ShardId>> {
    batches
        .iter()
        .map(|(records, _)| {
            let mut shards: Vec<usize> =
                records.iter().filter_map(|&index| dataset.locate(index).ok().map(|(shard, _)| shard)).collect();
            shards.sort_unstable();
            shards.dedup();
            shards.into_iter().map(|shard| dataset.shard_id(shard)).collect()
        })
        .collect()
}

/// What decides a plan's epochs: the world, seed, batch size and plan, whether a failing
/// partitioner falls back to the default, and whether the steps are rebalanced (then a plugin
/// that fails fails the stream, and a mixture's or packed windows' points are the built-in
/// partitioner's to decide). Nothing that reads.
#[derive(Clone)]
#[cfg_attr(not(feature = "policy"), allow(dead_code, reason = "partitioners and rebalancing need the policy feature"))]
pub(super) struct PlanConfig {
    pub(super) world: crate::plan::World,
    pub(super) seed: u64,
    pub(super) batch_size: u64,
    pub(super) plan: PlanSource,
    pub(super) partitioner_fallback: bool,
    pub(super) rebalancing: bool,
}

impl PlanConfig {
    /// A loader's plan.
    pub(super) fn of(config: &LoaderConfig) -> Self {
        #[cfg(feature = "policy")]
        let rebalancing = config.rebalance.is_some();
        #[cfg(not(feature = "policy"))]
        let rebalancing = false;
        Self {
            world: config.world,
            seed: config.seed,
            batch_size: config.batch_size,
            plan: config.plan.clone(),
            partitioner_fallback: config.partitioner_fallback,
            rebalancing,
        }
    }

    /// What a planner of other ranks' epochs (the tier's schedule, an origin cache's node plan)
    /// plans with: the loader's plan, its steps not rebalanced.
    pub(super) fn of_peers(config: &LoaderConfig) -> Self {
        Self { rebalancing: false, ..Self::of(config) }
    }
}

/// What a rank's planned epoch takes a position: its record index, and beside it each batch's
/// entry (its vector and the position after it, about 56 bytes) shared by the batch's positions.
/// A batch of 8 records comes to 15 bytes a position, as issue 55 measured.
fn plan_bytes(positions: u64, batch_size: u64) -> u64 {
    positions.saturating_mul(8).saturating_add(positions.div_ceil(batch_size.max(1)).saturating_mul(56))
}

/// Refuses an epoch whose plan, held whole for the epoch, would take more than half the memory
/// this process may use: a count a user can type (`mixture_samples`) would otherwise grow the
/// process until the kernel kills it.
pub(super) fn check_plan_memory(n_records: u64, world: crate::plan::World, batch_size: u64) -> Result<()> {
    let per_rank = n_records.div_ceil(u64::from(world.size()).max(1));
    let bytes = plan_bytes(per_rank, batch_size);
    let bound = crate::tier::memory_bound() / 2;
    if bytes > bound {
        return Err(Error::invalid_input(format!(
            "an epoch of {n_records} positions: a rank's plan of {per_rank} takes about {} MiB, more than half the \
             memory this process may use ({} MiB); an epoch's plan is held whole: read a shorter epoch \
             (mixture_samples) over more epochs, or more ranks",
            bytes >> 20,
            (bound * 2) >> 20
        )));
    }
    Ok(())
}

/// Says once per process that a named partitioner failed and the built-in default planned
/// instead: a plugin the user chose, silently ignored for a whole run, would change the order
/// of every epoch without a trace. Also counted in `granary_plugin_fallback_calls`.
#[cfg(feature = "policy")]
fn warn_fallback_once(status: &crate::policy::PolicyStatus, epoch: u64) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let why = status.recent.last().map_or_else(|| "it failed".to_owned(), ToString::to_string);
    eprintln!(
        "granary: partitioner {} could not plan epoch {epoch} ({why}); the built-in default ({}) planned it \
         instead, and will plan while it fails. Set partitioner_fallback=False (LoaderConfig::partitioner_fallback) \
         to make this an error",
        status.active,
        status.fallback.as_deref().unwrap_or("default")
    );
}

/// Cuts epochs into this rank's batches, each with the position after it.
pub(super) struct EpochPlanner {
    pub(super) n_records: u64,
    seed: u64,
    world: World,
    batch_size: u64,
    source: Source,
    /// Each rank's weight (a plugin's steps are split by them); equal unless rebalanced.
    weights: Vec<u32>,
    /// The partitioner a mixture's rebalancing asks (the blend orders; the plugin decides the
    /// ranks' shares, as for its own plans).
    #[cfg(feature = "policy")]
    rebalancer: Option<Box<crate::policy::Partitioner>>,
}

enum Source {
    Native(Order),
    Blend(std::sync::Arc<crate::blend::Blend>),
    Packed(std::sync::Arc<crate::pack::PackPlan>, Order),
    PackedMixture(std::sync::Arc<crate::pack::PackedBlend>),
    #[cfg(feature = "policy")]
    Plugin {
        partitioner: Box<crate::policy::Partitioner>,
        shards: Vec<crate::policy::ShardInfo>,
        ranks: Vec<crate::policy::RankInfo>,
        nodes: Vec<crate::policy::NodeInfo>,
    },
}

impl EpochPlanner {
    pub(super) fn new(config: &PlanConfig, dataset: &Dataset) -> Result<Self> {
        let source = match &config.plan {
            #[cfg(feature = "policy")]
            PlanSource::Native(_) if config.rebalancing => {
                return Err(Error::invalid_input(
                    "rebalancing splits a partitioner plugin's steps: give a partitioner (the built-in elastic), \
                     not a native order",
                ));
            }
            PlanSource::Native(order) => Source::Native(*order),
            PlanSource::Packed(pack, order) => {
                if pack.n_documents() != dataset.n_records() {
                    return Err(Error::invalid_input("a pack's plan reads the dataset it was made of"));
                }
                Source::Packed(std::sync::Arc::clone(pack), *order)
            }
            PlanSource::PackedMixture(packed) => {
                let documents: u64 = packed.packs.iter().map(|pack| pack.n_documents()).sum();
                if documents != dataset.n_records() {
                    return Err(Error::invalid_input("a packed mixture's plan reads the mixture's own dataset"));
                }
                Source::PackedMixture(std::sync::Arc::clone(packed))
            }
            PlanSource::Mixture(blend) => {
                if blend.sources().last().map(|s| s.start + s.n_records) != Some(dataset.n_records()) {
                    return Err(Error::invalid_input(
                        "a mixture's plan reads the mixture's own dataset (Mixture::dataset)",
                    ));
                }
                Source::Blend(std::sync::Arc::clone(blend))
            }
            #[cfg(feature = "policy")]
            PlanSource::Partitioner { plugin, options } => {
                use crate::policy::{Limits, NodeInfo, PolicyHost, RankInfo, ShardInfo};
                let host = PolicyHost::new(Limits::default(), None)?;
                // Rebalancing ranks must all decide alike: a failing plugin fails the stream
                // rather than let a fallback (with its default options) answer on one rank.
                let partitioner = if config.rebalancing || !config.partitioner_fallback {
                    let plugin = match plugin.as_deref() {
                        Some(name) => host.load(name)?,
                        None => host.load_builtin(crate::policy::builtin::DEFAULT_PARTITIONER)?,
                    };
                    crate::policy::Partitioner::new(plugin, options, None)?
                } else {
                    host.partitioner(plugin.as_deref(), options)?
                };
                if config.rebalancing && !partitioner.can_rebalance() {
                    return Err(Error::invalid_input(format!(
                        "partitioner {} is built against granary:policy@0.1.0, which cannot rebalance; rebuild it \
                         against 0.2.0",
                        plugin.as_deref().unwrap_or("(default)")
                    )));
                }
                let shards = dataset
                    .manifest()
                    .entries()
                    .iter()
                    .map(|entry| ShardInfo {
                        id: *entry.shard.0.as_bytes(),
                        bytes: entry.file_bytes,
                        records: entry.n_records,
                        replicas: Vec::new(),
                    })
                    .collect();
                let ranks = (0..config.world.size()).map(|id| RankInfo { id, node: 0, weight: 1, up: true }).collect();
                let nodes = vec![NodeInfo { id: 0, weight: 1, failure_domain: 0, up: true }];
                Source::Plugin { partitioner: Box::new(partitioner), shards, ranks, nodes }
            }
        };
        // A mixture and packed windows rebalance by the built-in partitioner's decisions, their
        // steps cut by them.
        #[cfg(feature = "policy")]
        let rebalancer = match (&config.plan, config.rebalancing) {
            (PlanSource::Mixture(_) | PlanSource::Packed(..) | PlanSource::PackedMixture(_), true) => {
                let host = crate::policy::PolicyHost::new(crate::policy::Limits::default(), None)?;
                let plugin = host.load_builtin(crate::policy::builtin::DEFAULT_PARTITIONER)?;
                Some(Box::new(crate::policy::Partitioner::new(plugin, &[], None)?))
            }
            _ => None,
        };
        let n_records = config.plan.epoch_len(dataset);
        Ok(Self {
            #[cfg(feature = "policy")]
            rebalancer,
            n_records,
            seed: config.seed,
            world: config.world,
            batch_size: config.batch_size,
            source,
            weights: vec![1; config.world.size() as usize],
        })
    }

    /// Splits the following steps by `weights` (one per rank).
    #[cfg(feature = "policy")]
    pub(super) fn set_weights(&mut self, weights: Vec<u32>) {
        if let Source::Plugin { ranks, .. } = &mut self.source {
            for rank in ranks.iter_mut() {
                rank.weight = weights.get(rank.id as usize).copied().unwrap_or(1);
            }
        }
        self.weights = weights;
    }

    /// `weights` as the records of a full step each rank reads, at least 1 (a rank with none
    /// would never reach the next point) and at most `SHARE_MAX_BATCHES` batch sizes (what its
    /// staging buffers hold); `None` when no split fits.
    #[cfg(feature = "policy")]
    pub(super) fn bounded(&self, weights: &[u32]) -> Option<Vec<u32>> {
        crate::plan::rebalanced_step(weights, self.world.size(), self.batch_size)
    }

    /// The weights from rebalance point `step` on, from the ranks' measures: the plugin's
    /// answer, bounded (`bounded`); then planned with.
    #[cfg(feature = "policy")]
    pub(super) fn rebalance(
        &mut self,
        step: u64,
        current: &[u32],
        measured: Vec<crate::policy::RankMeasure>,
    ) -> Result<Vec<u32>> {
        let partitioner = match (&mut self.source, &mut self.rebalancer) {
            (Source::Plugin { partitioner, .. }, _) | (_, Some(partitioner)) => partitioner,
            _ => return Err(Error::invalid_input("rebalancing needs a partitioner plugin")),
        };
        let point = crate::policy::RebalancePoint {
            step,
            weights: current.iter().enumerate().map(|(rank, &w)| (rank as u32, w)).collect(),
            measured,
        };
        let answer = partitioner.rebalance(&point)?;
        let mut weights = current.to_vec();
        for (rank, weight) in answer {
            if let Some(slot) = weights.get_mut(rank as usize) {
                *slot = weight;
            }
        }
        let weights = self.bounded(&weights).ok_or_else(|| {
            Error::invalid_input(format!(
                "the rebalanced weights {weights:?} cannot give every rank 1 to {} records of a step of {}",
                self.batch_size.saturating_mul(crate::plan::SHARE_MAX_BATCHES),
                u64::from(self.world.size()).saturating_mul(self.batch_size)
            ))
        })?;
        debug_assert!(
            weights.len() == self.world.size() as usize && weights.iter().all(|&w| w >= 1),
            "every rank reads at least a record a step: {weights:?}"
        );
        self.set_weights(weights.clone());
        Ok(weights)
    }

    /// This rank's batches from `from` to the end of its epoch, each with the position after
    /// it. Steps in which this rank reads nothing (a short last step) give no batch.
    pub(super) fn epoch(&mut self, from: Position) -> Result<EpochBatches> {
        let world = self.world;
        let mut epochs = self.epochs(from, &[world])?;
        epochs.pop().ok_or_else(|| Error::invalid_input("no plan for this rank"))
    }

    /// The batches of each of `worlds` (ranks of this planner's world size) from `from` to the
    /// end of the epoch, as `epoch` gives them; a plugin plans once for all of them.
    pub(super) fn epochs(&mut self, from: Position, worlds: &[World]) -> Result<Vec<EpochBatches>> {
        let (n, batch_size) = (self.n_records, self.batch_size);
        // Positions and step sizes follow the native plan's arithmetic, which the step-cut
        // plugin plans share.
        let steps = EpochPlan::new(n, self.seed, from.epoch, Order::Sequential);
        let after = |cursor: u64, world: World| {
            let next = cursor + steps.step_len(cursor, world.size(), batch_size);
            if next >= n {
                Position { epoch: from.epoch + 1, cursor: 0 }
            } else {
                Position { epoch: from.epoch, cursor: next }
            }
        };
        let mut out = Vec::with_capacity(worlds.len());
        match &mut self.source {
            Source::Native(order) => {
                for &world in worlds {
                    let plan = EpochPlan::new(n, self.seed, from.epoch, *order);
                    let mut cursor = RankCursor::new(plan, world, batch_size, from.cursor);
                    let mut batches = Vec::new();
                    loop {
                        let at = cursor.cursor();
                        let mut records = Vec::new();
                        if !cursor.next_batch(&mut records) {
                            break;
                        }
                        if !records.is_empty() {
                            batches.push((records, after(at, world)));
                        }
                    }
                    out.push(batches);
                }
            }
            Source::Packed(pack, order) => {
                let epoch = pack.epoch(self.seed, from.epoch, *order);
                for &world in worlds {
                    let mut batches = Vec::new();
                    let mut cursor = from.cursor;
                    while cursor < n {
                        let windows = steps.weighted_rank_positions(cursor, world, batch_size, &self.weights);
                        if !windows.is_empty() {
                            batches.push((epoch.span(pack, windows).records, after(cursor, world)));
                        }
                        cursor += steps.step_len(cursor, world.size(), batch_size);
                    }
                    out.push(batches);
                }
            }
            Source::PackedMixture(packed) => {
                // Each window's documents, source by source.
                let packed = std::sync::Arc::clone(packed);
                let epoch = packed.blend.epoch(self.seed, from.epoch).map_err(Error::invalid_input)?;
                let mut passes = crate::pack::PlacedPasses::default();
                out = self.cut_in_order(&steps, from, worlds, epoch.draws_from(from.cursor), &after, |share| {
                    let mut records = Vec::new();
                    for drawn in share {
                        let (span, _) = packed.window(&mut passes, self.seed, *drawn);
                        let start = packed.doc_starts[drawn.source];
                        records.extend(span.records.iter().map(|r| r + start));
                    }
                    records
                })?;
            }
            Source::Blend(blend) => {
                let epoch = blend.epoch(self.seed, from.epoch).map_err(Error::invalid_input)?;
                let records = epoch.records_from(from.cursor).map(|(_, record)| record);
                out = self.cut_in_order(&steps, from, worlds, records, &after, <[u64]>::to_vec)?;
            }
            #[cfg(feature = "policy")]
            Source::Plugin { partitioner, shards, ranks, nodes } => {
                let spec =
                    crate::policy::EpochSpec { seed: self.seed, epoch: from.epoch, batch_size, start: from.cursor };
                let fallback_calls = partitioner.status().fallback_calls;
                let plans = partitioner.plan(shards, ranks, nodes, spec)?;
                let status = partitioner.status();
                if status.fallback_calls > fallback_calls {
                    warn_fallback_once(&status, from.epoch);
                }
                for &world in worlds {
                    let mine = plans.iter().find(|plan| plan.rank == world.rank());
                    let mut records = mine.map(|plan| plan.records()).into_iter().flatten();
                    let mut batches = Vec::new();
                    let mut cursor = from.cursor;
                    let mut planned = 0u64;
                    while cursor < n {
                        let take = steps.weighted_rank_positions(cursor, world, batch_size, &self.weights);
                        let batch: Vec<u64> = records.by_ref().take((take.end - take.start) as usize).collect();
                        planned += batch.len() as u64;
                        if batch.len() as u64 != take.end - take.start {
                            return Err(step_mismatch(world, planned));
                        }
                        if !batch.is_empty() {
                            batches.push((batch, after(cursor, world)));
                        }
                        cursor += steps.step_len(cursor, world.size(), batch_size);
                    }
                    if records.next().is_some() {
                        return Err(step_mismatch(world, planned + 1));
                    }
                    out.push(batches);
                }
            }
        }
        Ok(out)
    }
}

impl EpochPlanner {
    /// The batches of each of `worlds` from `from` to the epoch's end when `positions` gives
    /// the epoch's positions in order (one item each, from `from`): each step's items are cut
    /// among the ranks (by their weights: equal ones as `rank_positions`), and a rank's share
    /// becomes its batch's records through `records`.
    fn cut_in_order<T>(
        &self,
        steps: &EpochPlan,
        from: Position,
        worlds: &[World],
        mut positions: impl Iterator<Item = T>,
        after: &dyn Fn(u64, World) -> Position,
        mut records: impl FnMut(&[T]) -> Vec<u64>,
    ) -> Result<Vec<EpochBatches>> {
        let mut outs: Vec<EpochBatches> = vec![Vec::new(); worlds.len()];
        let mut step = Vec::new();
        let mut cursor = from.cursor;
        while cursor < self.n_records {
            let len = steps.step_len(cursor, self.world.size(), self.batch_size);
            assert!(len > 0, "a step before the epoch's end takes a position (cursor {cursor} of {})", self.n_records);
            step.clear();
            step.extend(positions.by_ref().take(len as usize));
            if step.len() as u64 != len {
                return Err(Error::invalid_input(format!(
                    "the epoch's order ended at position {}",
                    cursor + step.len() as u64
                )));
            }
            for (world, batches) in worlds.iter().zip(outs.iter_mut()) {
                let range = steps.weighted_rank_positions(cursor, *world, self.batch_size, &self.weights);
                if !range.is_empty() {
                    debug_assert!(range.start >= cursor && range.end <= cursor + len, "{range:?} inside its step");
                    let share = &step[(range.start - cursor) as usize..(range.end - cursor) as usize];
                    batches.push((records(share), after(cursor, *world)));
                }
            }
            cursor += len;
        }
        Ok(outs)
    }
}

#[cfg(feature = "policy")]
fn step_mismatch(world: World, planned: u64) -> Error {
    Error::invalid_input(format!(
        "the partitioner's plan for rank {} is not cut in steps of world x batch size (at its record {planned}); \
         the loader needs a step-cut plan (the built-in elastic partitioner's mode=global) to resume exactly",
        world.rank()
    ))
}
