//! What a loader is asked for: `LoaderConfig` (the batch, the world, the plan, the tier, the
//! staging and the target), `Target`, `PlanSource`, and the check of a configuration before
//! anything starts.
//!
//! Owns those types and their defaults. Never: starts a thread, opens a file or reads.

use std::sync::Arc;

#[cfg(feature = "policy")]
use super::rebalance::RebalanceConfig;
use super::tier_setting::TierSetting;
use crate::error::{Error, Result};
use crate::io::{Fault, IoConfig};
use crate::plan::{Order, World};

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
    /// A mixture's order (`Mixture::blend`), over the mixture's dataset (`Mixture::dataset`):
    /// an epoch is the blend's `epoch_samples` positions.
    Mixture(std::sync::Arc<crate::blend::Blend>),
    /// Packed windows of tokens (a packed `Session` reads with it): an epoch is the pack's windows,
    /// over the documents in this order; a batch reads the documents of its windows.
    Packed(std::sync::Arc<crate::pack::PackPlan>, Order),
    /// A mixture of packed sources (`pack_mixture`): an epoch is the blend's positions, each a
    /// window of one source; a batch reads its windows' documents.
    PackedMixture(std::sync::Arc<crate::pack::PackedBlend>),
}

impl PlanSource {
    /// Positions in an epoch of `dataset` under this plan: its records, or a mixture's samples.
    pub fn epoch_len(&self, dataset: &crate::read::Dataset) -> u64 {
        match self {
            PlanSource::Mixture(blend) => blend.epoch_samples(),
            PlanSource::Packed(pack, _) => pack.n_windows(),
            PlanSource::PackedMixture(packed) => packed.blend.epoch_samples(),
            _ => dataset.n_records(),
        }
    }
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
    pub repair: Option<Arc<dyn crate::read::ShardSource>>,
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

impl LoaderConfig {
    /// The most positions (records, or packed windows) one of a rank's batches holds: a batch
    /// size, or with rebalancing `SHARE_MAX_BATCHES` of them (a rank's largest share of a step).
    pub(super) fn batch_positions_max(&self) -> u64 {
        #[cfg(feature = "policy")]
        if self.rebalance.is_some() {
            return self.batch_size.saturating_mul(crate::plan::SHARE_MAX_BATCHES);
        }
        self.batch_size
    }
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

pub(super) fn check(config: &LoaderConfig) -> Result<()> {
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
