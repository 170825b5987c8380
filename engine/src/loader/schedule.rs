//! The memory tier's schedule for a loader: which extents the ranks of this node read at which
//! step, over this epoch and the next, computed on a thread of its own so the first batch never
//! waits for it.
//!
//! Owns: `Scheduler` (the thread, the plans of the node's other ranks and, when the reader
//! leaves it, of this rank's next epoch, and the channel to it),
//! `node_peers` (which ranks share this rank's node) and `tier_schedule` (the computation).
//! Every rank of a node computes the same node-wide schedule, so they agree on what the tier
//! holds instead of each evicting what only the others read. The ranks are taken to move in
//! step (a synchronous job's do): another rank's batch `k` of an epoch is planned at this
//! rank's step `k`.
//! Never: loads or evicts extents (the tier's fillers do), or leaves the reader waiting for a
//! schedule that will not come (a failed or panicking computation hands over an empty one; a
//! peer whose plan fails is left out).

use std::sync::mpsc::Sender;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use super::{EpochBatches, EpochPlanner, LoaderConfig, PlanConfig};
use crate::error::{Error, Result};
use crate::plan::{Position, World};
use crate::read::Dataset;
use crate::tier::{Coordinator, ExtentInfo, ExtentKey, MemoryTier, TierSchedule};

/// Record reads a tier schedule holds at most (8 bytes each): beyond that, later reads of the
/// epoch are unknown to the fillers until the next epoch's schedule.
const SCHEDULE_USES_MAX: usize = 16 << 20;

/// What the tier's schedule is computed from: the step of an epoch's first batch, where the
/// epoch starts and this rank's batches of it, and the same of the next epoch when there is one.
pub(super) struct ScheduleRequest {
    pub(super) step: u64,
    pub(super) from: Position,
    pub(super) batches: Arc<EpochBatches>,
    pub(super) next: Option<(Position, NextBatches)>,
}

/// This rank's batches of the next epoch, for the schedule: planned by the reader already, or
/// to be planned by the schedule's thread, off the path to the first batch (issue 44), into a
/// slot the reader takes them from when it gets there (it plans them itself if the slot is
/// empty then).
pub(super) enum NextBatches {
    Planned(Arc<EpochBatches>),
    ToPlan(Arc<OnceLock<Arc<EpochBatches>>>),
}

/// The other ranks of this rank's node: `config.local_world_size` ranks per node, or
/// `LOCAL_WORLD_SIZE` from the environment (torchrun sets it), numbered node by node (node `n`
/// holds ranks `n * L` to `n * L + L - 1`). None when neither says, or when the environment's
/// `LOCAL_RANK` shows the ranks are numbered otherwise (the schedule is then this rank's alone,
/// which is correct, only not shared).
pub(super) fn node_peers(config: &LoaderConfig) -> Result<Vec<World>> {
    let world = config.world;
    let per_node = match config.local_world_size {
        Some(0) => return Err(Error::invalid_input("local_world_size is 0; a node runs at least one rank")),
        Some(n) => n,
        None => {
            let Some(text) = std::env::var_os("LOCAL_WORLD_SIZE") else { return Ok(Vec::new()) };
            let text = text.to_string_lossy();
            let n = text.trim().parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| {
                Error::invalid_input(format!("LOCAL_WORLD_SIZE={text:?} is not a count of ranks (1 or more)"))
            })?;
            let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|r| r.trim().parse::<u32>().ok());
            if local_rank.is_some_and(|local| local != world.rank() % n) {
                return Ok(Vec::new());
            }
            n
        }
    };
    let first = world.rank() / per_node * per_node;
    let end = first.saturating_add(per_node).min(world.size());
    Ok((first..end).filter(|&rank| rank != world.rank()).filter_map(|rank| World::new(rank, world.size())).collect())
}

/// The tier's schedule thread and the channel to it: dropped, it closes the channel and then
/// joins the thread.
pub(super) struct Scheduler {
    coordinator: Arc<Coordinator>,
    send: Option<Sender<ScheduleRequest>>,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the thread that computes `coordinator`'s schedules over `dataset` for this rank
    /// (`config`) and the other ranks of its node (`peers`).
    pub(super) fn start(
        dataset: &Arc<Dataset>,
        coordinator: &Arc<Coordinator>,
        config: &LoaderConfig,
        peers: Vec<World>,
    ) -> Result<Self> {
        let (send, receive) = std::sync::mpsc::channel::<ScheduleRequest>();
        let (dataset, for_thread) = (Arc::clone(dataset), Arc::clone(coordinator));
        let plan = PlanConfig::of_peers(config);
        let thread = super::spawn("granary-tier-plan", move || {
            // The peers' batches (and this rank's next epoch, when the reader left it) are
            // planned here, off the reader's path, by one planner (a partitioner plugin plans
            // every rank at once), made at the first request; if they cannot be, the schedule
            // is this rank's alone.
            let mut planner = None;
            while let Ok(request) = receive.recv() {
                // Not before the reader's first batch: it needs both cores to itself (issue 44).
                for_thread.wait_until_started();
                let computed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    if planner.is_none() {
                        planner = EpochPlanner::new(&plan, &dataset).ok();
                    }
                    let own_next = match &request.next {
                        Some((_, NextBatches::Planned(batches))) => Some(Arc::clone(batches)),
                        Some((from, NextBatches::ToPlan(slot))) => {
                            let planned = planner.as_mut().and_then(|planner| planner.epoch(*from).ok());
                            planned.map(|batches| Arc::clone(slot.get_or_init(|| Arc::new(batches))))
                        }
                        None => None,
                    };
                    let mut ranks = vec![(Arc::clone(&request.batches), own_next)];
                    if !peers.is_empty()
                        && let Some(planner) = &mut planner
                        && let Ok(this) = planner.epochs(request.from, &peers)
                    {
                        let next = match &request.next {
                            Some((from, _)) => planner.epochs(*from, &peers).ok(),
                            None => None,
                        };
                        let mut next = next.map(|epochs| epochs.into_iter().map(Arc::new));
                        for batches in this {
                            ranks.push((Arc::new(batches), next.as_mut().and_then(Iterator::next)));
                        }
                    }
                    tier_schedule(&dataset, for_thread.tier(), request.step, &ranks)
                }));
                // On an error (or a bug) the reads go on from disk, where a failing shard is
                // reported; the reader never waits for a schedule that will not come.
                for_thread.set_schedule(computed.ok().and_then(Result::ok).unwrap_or_default());
            }
        })?;
        Ok(Self { coordinator: Arc::clone(coordinator), send: Some(send), thread: Some(thread) })
    }

    /// Asks for the schedule of an epoch; until it comes, the reader reads from disk what the
    /// tier does not hold.
    pub(super) fn request(&self, request: ScheduleRequest) {
        self.coordinator.expect_schedule();
        if self.send.as_ref().is_none_or(|send| send.send(request).is_err()) {
            // The thread is gone: no schedule will come.
            self.coordinator.set_schedule(TierSchedule::default());
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.send = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Each rank's batches of an epoch, and of the next one when there is one.
pub(super) type RankBatches = (Arc<EpochBatches>, Option<Arc<EpochBatches>>);

/// When each extent is read: the ranks' batches of this epoch from `step` on, then the next
/// epoch's, batch `k` of every rank at step `step + k`, up to `SCHEDULE_USES_MAX` record reads.
/// Extents are numbered shard by shard, so a record's extent is found by arithmetic (this runs
/// for every record of two epochs of the node's ranks).
pub(super) fn tier_schedule(
    dataset: &Dataset,
    tier: &MemoryTier,
    step: u64,
    ranks: &[RankBatches],
) -> Result<TierSchedule> {
    let extent_bytes = tier.extent_bytes();
    let extent_blocks = tier.extent_blocks();
    let mut extents = Vec::new();
    let mut first_extent = Vec::with_capacity(dataset.n_shards());
    for shard in 0..dataset.n_shards() {
        first_extent.push(extents.len());
        let meta = dataset.shard_meta(shard)?;
        for extent in 0..tier.n_extents(meta.n_data_blocks()) {
            let first_block = extent * extent_blocks;
            extents.push(ExtentInfo {
                key: ExtentKey {
                    shard: dataset.shard_id(shard),
                    extent: u32::try_from(extent).map_err(|_| Error::invalid_input("a shard of 2^32 extents"))?,
                },
                path: dataset.shard_path(shard),
                meta: Arc::clone(meta),
                first_block,
                n_blocks: extent_blocks.min(meta.n_data_blocks() - first_block),
            });
        }
    }
    let mut schedule = TierSchedule::with_extents(extents);
    let mut uses = 0usize;
    fn batch_at((this, next): &RankBatches, offset: usize) -> Option<&[u64]> {
        match this.get(offset) {
            Some((records, _)) => Some(records.as_slice()),
            None => next.as_ref()?.get(offset - this.len()).map(|(records, _)| records.as_slice()),
        }
    }
    let longest = ranks.iter().map(|(this, next)| this.len() + next.as_ref().map_or(0, |n| n.len())).max();
    for offset in 0..longest.unwrap_or(0) {
        let at = step + offset as u64;
        for &index in ranks.iter().filter_map(|rank| batch_at(rank, offset)).flatten() {
            uses += 1;
            if uses > SCHEDULE_USES_MAX {
                return Ok(schedule);
            }
            let (shard, local) = dataset.locate(index)?;
            let range = dataset.shard_meta(shard)?.record_range(local);
            if range.is_empty() {
                continue;
            }
            for extent in range.start / extent_bytes..=(range.end - 1) / extent_bytes {
                schedule.add_use(first_extent[shard] + extent as usize, at);
            }
        }
    }
    Ok(schedule)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(rank: u32, size: u32, per_node: u32) -> Vec<u32> {
        let config = LoaderConfig {
            world: World::new(rank, size).unwrap(),
            local_world_size: Some(per_node),
            ..Default::default()
        };
        node_peers(&config).unwrap().iter().map(World::rank).collect()
    }

    #[test]
    fn a_nodes_ranks_are_numbered_node_by_node() {
        assert_eq!(peers(5, 8, 4), [4, 6, 7]);
        assert_eq!(peers(0, 8, 4), [1, 2, 3]);
        assert_eq!(peers(3, 4, 1), Vec::<u32>::new());
        // A last node with fewer ranks, and more ranks per node than the world has.
        assert_eq!(peers(7, 8, 3), [6]);
        assert_eq!(peers(1, 2, 8), [0]);
        let zero = LoaderConfig { local_world_size: Some(0), ..Default::default() };
        assert!(node_peers(&zero).is_err());
    }
}
