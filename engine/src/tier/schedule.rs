//! The plan as the tier sees it: every extent a loader will read (`ExtentInfo`: where its bytes
//! are and how to check them), the steps at which it reads each and how many records
//! (`TierSchedule`), and the questions fills and evictions ask of it (next use, reads between
//! two steps, the horizon a tier that cannot hold everything chooses over).
//!
//! Owns `ExtentInfo` and `TierSchedule`. Never: fills, evicts or reads (the coordinator in
//! `fill/` does, by these answers), or holds a lock.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::ExtentKey;
use crate::shard::ShardMeta;

/// Steps the tier looks ahead, at least, when it chooses what to hold of data that does not fit:
/// two of the coordinator's replans (`fill/` checks it against its `REPLAN_STEPS`).
pub(super) const HORIZON_STEPS_MIN: u64 = 32;

/// A step that never comes: the extent is not used again.
pub(super) const NEVER: u64 = u64::MAX;

/// Where an extent's bytes are on disk, and how to check them.
#[derive(Clone, Debug)]
pub struct ExtentInfo {
    /// The extent.
    pub key: ExtentKey,
    /// Its shard's file.
    pub path: PathBuf,
    /// Its shard's verified metadata (the block checksums).
    pub meta: Arc<ShardMeta>,
    /// Its first data block.
    pub first_block: u64,
    /// Its data blocks.
    pub n_blocks: u64,
}

/// Every extent a loader will read, the steps at which it reads each (ascending) and how many
/// records it reads there.
#[derive(Debug, Default)]
pub struct TierSchedule {
    pub(super) extents: Vec<ExtentInfo>,
    /// Per extent: (step, records read from it up to and including that step).
    pub(super) uses: Vec<Vec<(u64, u64)>>,
    /// Every (step, extent) with a read, by step (the evictor plugin is told them in order).
    pub(super) reads: Vec<(u64, usize)>,
    pub(super) index: HashMap<ExtentKey, usize>,
}

impl TierSchedule {
    /// A schedule over `extents` (indexed in this order), none of them used yet.
    pub fn with_extents(extents: Vec<ExtentInfo>) -> Self {
        let index = extents.iter().enumerate().map(|(i, info)| (info.key, i)).collect();
        let uses = vec![Vec::new(); extents.len()];
        Self { extents, uses, reads: Vec::new(), index }
    }

    /// The index of `key`, adding it with `info` when new.
    pub fn extent(&mut self, key: ExtentKey, info: impl FnOnce() -> ExtentInfo) -> usize {
        *self.index.entry(key).or_insert_with(|| {
            self.extents.push(info());
            self.uses.push(Vec::new());
            self.extents.len() - 1
        })
    }

    /// Records that a record of extent `extent` is read at `step` (steps are added in ascending
    /// order).
    pub fn add_use(&mut self, extent: usize, step: u64) {
        let uses = &mut self.uses[extent];
        match uses.last_mut() {
            Some((last, records)) if *last == step => *records += 1,
            last => {
                debug_assert!(last.as_ref().is_none_or(|(last, _)| *last < step), "uses are added in step order");
                let records = last.map_or(0, |(_, records)| *records);
                uses.push((step, records + 1));
                self.reads.push((step, extent));
            }
        }
    }

    /// Extents in the schedule.
    pub fn len(&self) -> usize {
        self.extents.len()
    }

    /// Whether the schedule is empty.
    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// The first step at or after `step` at which extent `extent` is read.
    pub(super) fn next_use(&self, extent: usize, step: u64) -> u64 {
        let uses = &self.uses[extent];
        uses.get(uses.partition_point(|&(s, _)| s < step)).map_or(NEVER, |&(s, _)| s)
    }

    /// How many records of extent `extent` the steps in `[from, to)` read.
    pub(super) fn reads_between(&self, extent: usize, from: u64, to: u64) -> u64 {
        let uses = &self.uses[extent];
        let before = |step: u64| match uses.partition_point(|&(s, _)| s < step) {
            0 => 0,
            i => uses[i - 1].1,
        };
        before(to) - before(from)
    }

    /// The steps from `step` on over which the tier chooses what to hold when the data does not
    /// fit (`ahead`: the extents read again, with their next use): until the reads have touched
    /// more than `fit` extents, so that what the plan reads soon after what it reads now counts
    /// too (a windowed plan's next shards), and at least `HORIZON_STEPS_MIN`. Returns its end.
    pub(super) fn horizon(&self, ahead: &[(u64, usize)], step: u64, fit: u64) -> u64 {
        let least = step.saturating_add(HORIZON_STEPS_MIN);
        let mut next: Vec<u64> = ahead.iter().map(|&(next, _)| next).collect();
        match usize::try_from(fit) {
            Ok(fit) if fit < next.len() => {
                let (_, &mut touching, _) = next.select_nth_unstable(fit);
                least.max(touching.saturating_add(1))
            }
            _ => NEVER,
        }
    }

    pub(super) fn bytes(&self, extent: usize) -> u64 {
        self.extents[extent].n_blocks * crate::shard::BLOCK_BYTES_U64
    }
}
