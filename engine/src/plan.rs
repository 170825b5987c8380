//! The epoch plan: which record each rank reads, in which order, for one epoch.
//!
//! The global order of an epoch is a seeded permutation of the dataset version's records, a
//! function of (n_records, seed, epoch) alone. It is computed per position with a keyed Feistel
//! network and cycle walking, so a plan needs O(1) memory whatever the dataset size. The world
//! size only decides how the global order is cut: a step of `world_size * batch_size` consecutive
//! positions is split into one contiguous slice per rank, in rank order, so concatenating the
//! ranks' slices step by step gives back the global order for any world size. A `Position`
//! (epoch, cursor) counts the positions consumed by all ranks together; resuming from it on any
//! world size reads exactly the remaining positions: no duplicate, no drop. The last step of an
//! epoch, when short, is split as evenly as possible (ranks differ by at most one record).
//! `RankCut` counts a rank's batches and resumes its positions without the order. Weighted
//! ranks cut a step by `step_shares`; a rebalancing loader's weights become records
//! per rank by `rebalanced_step` (each rank between 1 record and `SHARE_MAX_BATCHES` batches).
//!
//! Owns: `Order`, `World`, `Position`, `EpochPlan` (with its keyed permutation), `RankCursor`, and
//! the arithmetic of weighted steps (`step_shares`, `bounded_weights`, `rebalanced_step`,
//! `SHARE_MAX_BATCHES`). Never: does I/O or calls a plugin: plain data (the partitioner plugin's
//! plans are asked for by the loader, in the terms of `Position` and `World`).

use std::ops::Range;

/// Feistel rounds; six keyed rounds of a strong mixer make a well-shuffled permutation.
const ROUNDS: usize = 6;

/// How an epoch orders records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Record `i` at position `i`.
    Sequential,
    /// A seeded pseudo-random permutation, different every epoch.
    Shuffled,
}

/// A rank within a world of `size` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct World {
    rank: u32,
    size: u32,
}

impl World {
    /// Rank `rank` of `size`; `None` unless `rank < size`.
    pub fn new(rank: u32, size: u32) -> Option<Self> {
        (rank < size).then_some(Self { rank, size })
    }

    /// A world of one.
    pub fn single() -> Self {
        Self { rank: 0, size: 1 }
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the world.
    pub fn size(&self) -> u32 {
        self.size
    }
}

/// Where a run is: the epoch, and the global positions all ranks together have consumed in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Position {
    /// The epoch.
    pub epoch: u64,
    /// Global positions consumed in this epoch.
    pub cursor: u64,
}

/// The read order of one epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochPlan {
    n_records: u64,
    order: Order,
    permutation: Permutation,
}

impl EpochPlan {
    /// The plan of `epoch` over `n_records` records.
    pub fn new(n_records: u64, seed: u64, epoch: u64, order: Order) -> Self {
        Self { n_records, order, permutation: Permutation::new(n_records, seed, epoch) }
    }

    /// Records in the epoch.
    pub fn n_records(&self) -> u64 {
        self.n_records
    }

    /// The record at global position `position` (which must be `< n_records`).
    pub fn record_at(&self, position: u64) -> u64 {
        assert!(position < self.n_records, "position {position} of {}", self.n_records);
        let record = match self.order {
            Order::Sequential => position,
            Order::Shuffled => self.permutation.apply(position),
        };
        debug_assert!(record < self.n_records, "a permutation maps the epoch onto itself");
        record
    }

    /// Positions consumed by the step that starts at `cursor`.
    pub fn step_len(&self, cursor: u64, world_size: u32, batch_size: u64) -> u64 {
        let full = u64::from(world_size).saturating_mul(batch_size);
        full.min(self.n_records.saturating_sub(cursor))
    }

    /// The global positions `world.rank()` reads in the step that starts at `cursor` when the
    /// ranks' weights are `weights` (one per rank of the world; see [`step_shares`]).
    pub fn weighted_rank_positions(&self, cursor: u64, world: World, batch_size: u64, weights: &[u32]) -> Range<u64> {
        let step = self.step_len(cursor, world.size, batch_size);
        let shares = step_shares(step, weights);
        // Exactly once: the ranks' slices tile the step, whatever the weights.
        debug_assert_eq!(shares.iter().sum::<u64>(), step, "shares {shares:?} of a step of {step}");
        let rank = world.rank as usize;
        let start = cursor + shares.iter().take(rank).sum::<u64>();
        start..start + shares.get(rank).copied().unwrap_or(0)
    }

    /// The global positions `world.rank()` reads in the step that starts at `cursor`.
    pub fn rank_positions(&self, cursor: u64, world: World, batch_size: u64) -> Range<u64> {
        assert!(batch_size > 0);
        let step = self.step_len(cursor, world.size, batch_size);
        let (size, rank) = (u64::from(world.size), u64::from(world.rank));
        if step == size * batch_size {
            let start = cursor + rank * batch_size;
            return start..start + batch_size;
        }
        // The short last step: the first `step % size` ranks take one record more.
        let (base, extra) = (step / size, step % size);
        let start = cursor + rank * base + rank.min(extra);
        let positions = start..start + base + u64::from(rank < extra);
        debug_assert!(positions.end <= cursor + step, "a rank's share lies inside its step");
        positions
    }
}

pub use granary_policy_types::partition::step_shares;

/// The cut of an epoch as one rank sees it, without the order: steps of `world x batch_size`
/// records, the short last step spread one record at a time over the first ranks (or split by
/// `weights` under rebalancing: `step_shares`), dropped with `drop_last`. What a caller that
/// counts batches or resumes positions needs (the Python loader's `len()` and its state), the
/// same arithmetic `RankCursor` and the loader's plans walk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankCut {
    /// Records in the epoch.
    pub n_records: u64,
    /// The rank, and the ranks of the world.
    pub world: World,
    /// Records per batch (of a full step).
    pub batch_size: u64,
    /// Whether the short last step is dropped.
    pub drop_last: bool,
    /// The ranks' weights in force (one per rank), when rebalancing.
    pub weights: Option<Vec<u32>>,
}

impl RankCut {
    fn step(&self) -> u64 {
        u64::from(self.world.size()).saturating_mul(self.batch_size)
    }

    /// `position` when it is one of this order's (a resume's): its cursor at most the epoch's
    /// length. A cursor past it would be read as the next epoch's start.
    pub fn check(&self, position: Position) -> Result<Position, String> {
        if position.cursor > self.n_records {
            return Err(format!(
                "cursor {} is past the end of an epoch of {}: not a position of this loader's order",
                position.cursor, self.n_records
            ));
        }
        Ok(position)
    }

    /// `position`, or the next epoch's start when this rank reads nothing more in its epoch:
    /// at the end, in the short last step when it holds fewer records than ranks and this
    /// rank's share is empty, or with `drop_last` in that step at all.
    pub fn normalized(&self, position: Position) -> Position {
        let step = self.step();
        if self.n_records == 0 || step == 0 {
            return position;
        }
        let end = if self.drop_last { self.n_records - self.n_records % step } else { self.n_records };
        let left = end.saturating_sub(position.cursor);
        let more = left >= step || (left > 0 && self.reads_in_short_step(left));
        debug_assert!(position.cursor <= self.n_records, "a position of this epoch (`check` refuses others)");
        let normalized = if more { position } else { Position { epoch: position.epoch + 1, cursor: 0 } };
        // A normalized position is an epoch's start or one this rank reads from: never at or
        // past the end of what its epoch reads.
        debug_assert!(normalized.cursor == 0 || normalized.cursor < end, "{normalized:?} of an epoch read to {end}");
        normalized
    }

    /// Whether this rank reads a record of a short step of `left` records.
    pub fn reads_in_short_step(&self, left: u64) -> bool {
        let size = u64::from(self.world.size());
        match &self.weights {
            Some(weights) if weights.len() as u64 == size => {
                step_shares(left, weights).get(self.world.rank() as usize).is_some_and(|&share| share > 0)
            }
            _ => left >= size || u64::from(self.world.rank()) < left,
        }
    }

    /// Whether the batch that ends at `after` is one this rank drops: with `drop_last`, the
    /// short last step (the batch that ends an epoch, reported at the next one's start, when
    /// the epoch does not divide into whole steps).
    pub fn dropped(&self, after: Position) -> bool {
        self.drop_last && after.cursor == 0 && self.step() > 0 && !self.n_records.is_multiple_of(self.step())
    }

    /// Batches this rank reads per epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.batches_from(0)
    }

    /// Batches this rank reads from `cursor` (a step boundary) to the end of the epoch.
    pub fn batches_from(&self, cursor: u64) -> u64 {
        let step = self.step();
        if step == 0 {
            return 0;
        }
        let left_records = self.n_records.saturating_sub(cursor);
        let (full, left) = (left_records / step, left_records % step);
        let last = !self.drop_last && left > 0 && self.reads_in_short_step(left);
        full + u64::from(last)
    }
}

/// One rank's walk through an epoch plan, batch by batch.
#[derive(Clone, Debug)]
pub struct RankCursor {
    plan: EpochPlan,
    world: World,
    batch_size: u64,
    cursor: u64,
}

impl RankCursor {
    /// Starts (or resumes) `plan` at global cursor `cursor` for `world`.
    pub fn new(plan: EpochPlan, world: World, batch_size: u64, cursor: u64) -> Self {
        assert!(batch_size > 0, "a batch holds at least one record");
        Self { plan, world, batch_size, cursor: cursor.min(plan.n_records) }
    }

    /// The global cursor: the same on every rank after the same number of steps.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Fills `records` with this rank's next batch and advances every rank's shared cursor by
    /// one step. Returns false (and leaves `records` empty) at the end of the epoch.
    pub fn next_batch(&mut self, records: &mut Vec<u64>) -> bool {
        records.clear();
        if self.cursor >= self.plan.n_records {
            return false;
        }
        let positions = self.plan.rank_positions(self.cursor, self.world, self.batch_size);
        let step = self.plan.step_len(self.cursor, self.world.size, self.batch_size);
        // Exactly once: this rank's slice lies inside the step, which the cursor then passes.
        debug_assert!(positions.start >= self.cursor && positions.end <= self.cursor + step, "{positions:?}");
        records.extend(positions.map(|position| self.plan.record_at(position)));
        self.cursor += step;
        true
    }
}

/// A keyed pseudo-random permutation of `0..n`: a balanced Feistel network over the smallest
/// even-bit domain that covers `n`, cycle-walked back into range (at most ~4 rounds on average).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; ROUNDS],
}

impl Permutation {
    fn new(n: u64, seed: u64, epoch: u64) -> Self {
        let bits = (u64::BITS - n.saturating_sub(1).leading_zeros()).max(2);
        let half_bits = bits.div_ceil(2);
        let mut state = seed ^ mix(epoch.wrapping_add(0x5851_f42d_4c95_7f2d));
        let keys = std::array::from_fn(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix(state)
        });
        // The cipher permutes 2^(2 half_bits) values; walking cycles maps the epoch's onto itself.
        debug_assert!(u128::from(n) <= 1u128 << (2 * half_bits), "the cipher's domain covers the epoch");
        Self { n, half_bits, keys }
    }

    fn apply(&self, position: u64) -> u64 {
        debug_assert!(position < self.n);
        let mut x = position;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            (left, right) = (right, left ^ (mix(right ^ key) & mask));
        }
        (left << self.half_bits) | right
    }
}

/// The splitmix64 finalizer: a fast, well-mixing bijection of u64.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A rank reads at most this many batch sizes of a step when rebalanced (its staging buffers
/// are sized for it).
pub const SHARE_MAX_BATCHES: u64 = 2;

/// `weights` made the records of a full step of `step_len` each rank reads: every rank at least
/// 1 and at most `cap` (what a staging buffer holds), in proportion to its weight where no bound
/// holds it: the level `x` with `sum(clamp(x * w, 1, cap)) = step_len` is found by bisection,
/// each rank takes the whole part of its `clamp(x * w, 1, cap)`, and the records left over go one
/// each to the ranks of largest fraction (ties to the lower rank). Equal weights split as
/// `step_shares` does. The same inputs give the same answer on every rank. `None` when no split
/// fits (`cap` times the ranks below the step, more ranks than records, or a step above 2^32).
pub fn bounded_weights(weights: &[u32], step_len: u64, cap: u64) -> Option<Vec<u32>> {
    let n = weights.len() as u64;
    if n == 0 || cap == 0 || n > step_len || cap.saturating_mul(n) < step_len || u32::try_from(step_len).is_err() {
        return None;
    }
    let cap = cap.min(step_len);
    let records: Vec<u64> = if weights.iter().all(|&w| w == weights[0]) {
        step_shares(step_len, weights)
    } else {
        let (low, high) = (1.0, cap as f64);
        // A weight of 0 counts as a millionth of the smallest other one: its rank takes more
        // than 1 record only once every other rank is at the cap.
        let smallest = weights.iter().copied().filter(|&w| w > 0).min().map_or(1.0, f64::from);
        let real: Vec<f64> = weights.iter().map(|&w| if w == 0 { smallest * 1e-6 } else { f64::from(w) }).collect();
        let level = |x: f64| -> f64 { real.iter().map(|&w| (x * w).clamp(low, high)).sum() };
        // By this level every rank is at the cap.
        let (mut below, mut above) = (0.0f64, step_len as f64 / (smallest * 1e-6) + 1.0);
        for _ in 0..200 {
            let middle = (below + above) / 2.0;
            if level(middle) < step_len as f64 { below = middle } else { above = middle }
        }
        let exact: Vec<f64> = real.iter().map(|&w| (above * w).clamp(low, high)).collect();
        let mut records: Vec<u64> = exact.iter().map(|&r| r.floor() as u64).collect();
        let mut by_fraction: Vec<usize> = (0..weights.len()).collect();
        by_fraction
            .sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
        // Integer fix-ups in that order: the sum and the bounds hold exactly whatever the
        // rounding of the level.
        let mut sum: u64 = records.iter().sum();
        while sum < step_len {
            let i = *by_fraction.iter().find(|&&i| records[i] < cap)?;
            records[i] += 1;
            sum += 1;
            by_fraction.retain(|&j| j != i);
            if by_fraction.is_empty() {
                by_fraction = (0..weights.len()).collect();
            }
        }
        while sum > step_len {
            let i = *by_fraction.iter().rev().find(|&&i| records[i] > 1)?;
            records[i] -= 1;
            sum -= 1;
            by_fraction.retain(|&j| j != i);
            if by_fraction.is_empty() {
                by_fraction = (0..weights.len()).collect();
            }
        }
        records
    };
    debug_assert!(
        records.iter().sum::<u64>() == step_len && records.iter().all(|&r| (1..=cap).contains(&r)),
        "{records:?}: every rank 1 to {cap} records of a step of {step_len}"
    );
    records.iter().map(|&r| u32::try_from(r).ok()).collect()
}

/// The records of a full step each of `world_size` ranks reads under `weights` when a loader
/// rebalances: at least 1 and at most twice `batch_size` each, the rest split by weight (the
/// weights a rebalancing loader's batches carry are these). `None` when `weights` is not one per
/// rank or no split fits.
pub fn rebalanced_step(weights: &[u32], world_size: u32, batch_size: u64) -> Option<Vec<u32>> {
    if weights.len() != world_size as usize {
        return None;
    }
    let step_len = u64::from(world_size).saturating_mul(batch_size);
    bounded_weights(weights, step_len, batch_size.saturating_mul(SHARE_MAX_BATCHES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_cut_counts_the_batches_the_rank_cursor_walks() {
        for n in [0u64, 1, 5, 63, 64, 65, 100, 257] {
            for size in 1..=5u32 {
                for batch in [1u64, 3, 8] {
                    for rank in 0..size {
                        let world = World::new(rank, size).unwrap();
                        let plan = EpochPlan::new(n, 7, 0, Order::Shuffled);
                        let mut cursor = RankCursor::new(plan, world, batch, 0);
                        let (mut walked, mut records) = (0u64, Vec::new());
                        while cursor.next_batch(&mut records) {
                            walked += u64::from(!records.is_empty());
                        }
                        let cut = RankCut { n_records: n, world, batch_size: batch, drop_last: false, weights: None };
                        assert_eq!(cut.batches_per_epoch(), walked, "n {n} world {size} batch {batch} rank {rank}");
                        let dropped = RankCut { drop_last: true, ..cut.clone() };
                        assert_eq!(dropped.batches_per_epoch(), n / (u64::from(size) * batch));
                        // The end of an epoch is the next one's start (an empty dataset has none).
                        let end = Position { epoch: 2, cursor: n };
                        let next = if n == 0 { end } else { Position { epoch: 3, cursor: 0 } };
                        assert_eq!(cut.normalized(end), next);
                    }
                }
            }
        }
    }

    #[test]
    fn bounded_weights_keep_every_rank_between_one_record_and_the_cap() {
        // Equal weights: the equal split.
        assert_eq!(bounded_weights(&[1, 1, 1, 1], 64, 32), Some(vec![16, 16, 16, 16]));
        // A rank that would get nothing gets 1; one above the cap is held at it.
        assert_eq!(bounded_weights(&[1, 100_000], 32, 32), Some(vec![1, 31]));
        assert_eq!(bounded_weights(&[100, 1, 1], 48, 32), Some(vec![32, 8, 8]));
        // The rest keeps its proportions, and the answer always adds up to the step.
        for weights in [vec![7, 3, 1 << 20, 1], vec![0, 0, 5], vec![1 << 20; 3], vec![3, 1]] {
            let out = bounded_weights(&weights, 64, 32).unwrap();
            assert_eq!(out.iter().map(|&r| u64::from(r)).sum::<u64>(), 64, "{weights:?}");
            assert!(out.iter().all(|&r| (1..=32).contains(&r)), "{weights:?} -> {out:?}");
        }
        // Small batches: every rank keeps at least 1 (the split always exists once the step fits).
        assert_eq!(bounded_weights(&[1000, 1000, 1, 1, 1], 10, 4), Some(vec![4, 3, 1, 1, 1]));
        // Where no bound holds, the split is the weights' (no record reserved first).
        assert_eq!(bounded_weights(&[3, 3, 3, 1], 128, 64), Some(vec![39, 38, 38, 13]));
        assert_eq!(bounded_weights(&[10, 1, 1, 1], 4, 2), Some(vec![1, 1, 1, 1]));
        assert_eq!(bounded_weights(&[1000, 1, 1, 1], 8, 4), Some(vec![4, 2, 1, 1]));
        let mut seed = 7u64;
        for _ in 0..2000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let ranks = 1 + (seed >> 60) as usize;
            let batch = 1 + (seed >> 56) % 5;
            let weights: Vec<u32> =
                (0..ranks).map(|i| ((seed >> (i % 12 * 5)) % 7) as u32 * ((seed >> 40) % 3000) as u32).collect();
            let step = batch * ranks as u64;
            let out = bounded_weights(&weights, step, 2 * batch).expect("a split always fits");
            assert_eq!(out.iter().map(|&r| u64::from(r)).sum::<u64>(), step, "{weights:?}");
            assert!(out.iter().all(|&r| (1..=2 * batch).contains(&u64::from(r))), "{weights:?} -> {out:?}");
        }
        // No split fits: a cap too small for the step, more ranks than records.
        assert_eq!(bounded_weights(&[1, 1], 64, 31), None);
        assert_eq!(bounded_weights(&[1, 1, 1], 2, 2), None);
        assert_eq!(bounded_weights(&[], 2, 2), None);
    }
    use proptest::prelude::*;

    /// Runs `world_size` ranks in lock step from `cursor` for at most `max_steps` steps; returns
    /// every record read (ranks concatenated step by step) and the final cursor.
    fn run(plan: EpochPlan, world_size: u32, batch: u64, cursor: u64, max_steps: usize) -> (Vec<u64>, u64) {
        let mut cursors: Vec<RankCursor> =
            (0..world_size).map(|r| RankCursor::new(plan, World::new(r, world_size).unwrap(), batch, cursor)).collect();
        let mut read = Vec::new();
        let mut records = Vec::new();
        for _ in 0..max_steps {
            let mut any = false;
            for rank in &mut cursors {
                any |= rank.next_batch(&mut records);
                read.extend_from_slice(&records);
            }
            if !any {
                break;
            }
        }
        let cursor = cursors[0].cursor();
        assert!(cursors.iter().all(|c| c.cursor() == cursor), "ranks disagree on the cursor");
        (read, cursor)
    }

    proptest! {
        #[test]
        fn an_epoch_is_a_permutation(n in 0u64..3000, seed: u64, epoch in 0u64..4) {
            let plan = EpochPlan::new(n, seed, epoch, Order::Shuffled);
            let mut order: Vec<u64> = (0..n).map(|p| plan.record_at(p)).collect();
            order.sort_unstable();
            prop_assert_eq!(order, (0..n).collect::<Vec<_>>());
        }

        #[test]
        fn the_global_order_does_not_depend_on_the_world_size(
            n in 0u64..2000, seed: u64, world_size in 1u32..9, batch in 1u64..40,
        ) {
            let plan = EpochPlan::new(n, seed, 1, Order::Shuffled);
            let global: Vec<u64> = (0..n).map(|p| plan.record_at(p)).collect();
            let (read, cursor) = run(plan, world_size, batch, 0, usize::MAX);
            prop_assert_eq!(read, global);
            prop_assert_eq!(cursor, n);
        }

        #[test]
        fn resuming_on_another_world_size_is_exact(
            n in 1u64..2000, seed: u64, first in 1u32..9, second in 1u32..9,
            batch in 1u64..40, steps in 0usize..30, second_batch in 1u64..40,
        ) {
            let plan = EpochPlan::new(n, seed, 3, Order::Shuffled);
            let (mut read, cursor) = run(plan, first, batch, 0, steps);
            let (rest, end) = run(plan, second, second_batch, cursor, usize::MAX);
            read.extend(rest);
            prop_assert_eq!(end, n);
            let global: Vec<u64> = (0..n).map(|p| plan.record_at(p)).collect();
            prop_assert_eq!(&read, &global);
            let mut sorted = read;
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len() as u64, n, "a duplicate or a drop");
        }

        #[test]
        fn ranks_of_a_short_last_step_differ_by_at_most_one(
            n in 1u64..500, world_size in 1u32..17, batch in 1u64..64,
        ) {
            let plan = EpochPlan::new(n, 0, 0, Order::Sequential);
            let mut cursor = 0;
            while cursor < n {
                let sizes: Vec<u64> = (0..world_size)
                    .map(|r| plan.rank_positions(cursor, World::new(r, world_size).unwrap(), batch))
                    .map(|range| range.end - range.start)
                    .collect();
                let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                prop_assert!(max - min <= 1);
                cursor += plan.step_len(cursor, world_size, batch);
            }
        }
    }

    #[test]
    fn epochs_and_seeds_change_the_order_and_sequential_is_identity() {
        let order = |seed, epoch| {
            (0..1000).map(|p| EpochPlan::new(1000, seed, epoch, Order::Shuffled).record_at(p)).collect::<Vec<_>>()
        };
        assert_ne!(order(1, 0), order(1, 1));
        assert_ne!(order(1, 0), order(2, 0));
        assert_eq!(order(1, 0), order(1, 0));
        // A shuffle that leaves most records in place is no shuffle.
        let fixed_points = order(1, 0).iter().enumerate().filter(|(i, r)| *i as u64 == **r).count();
        assert!(fixed_points < 20, "{fixed_points} fixed points");
        let plan = EpochPlan::new(10, 1, 0, Order::Sequential);
        assert_eq!((0..10).map(|p| plan.record_at(p)).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
    }
    #[test]
    fn weighted_steps_split_by_weight_and_equal_weights_cut_as_before() {
        assert_eq!(step_shares(12, &[2, 1, 1]), [6, 3, 3]);
        assert_eq!(step_shares(10, &[3, 1]), [8, 2]);
        assert_eq!(step_shares(7, &[1, 1, 5]), [1, 1, 5]);
        assert_eq!(step_shares(5, &[0, 1]), [0, 5]);
        let plan = EpochPlan::new(1000, 7, 0, Order::Shuffled);
        for size in 1..6u32 {
            for batch in [1u64, 3, 8] {
                let mut cursor = 0;
                while cursor < plan.n_records() {
                    let step = plan.step_len(cursor, size, batch);
                    let mut next = cursor;
                    for rank in 0..size {
                        let world = World::new(rank, size).unwrap();
                        let equal = plan.rank_positions(cursor, world, batch);
                        assert_eq!(plan.weighted_rank_positions(cursor, world, batch, &vec![4; size as usize]), equal);
                        // Unequal weights: the slices still tile the step, in rank order.
                        let weights: Vec<u32> = (1..=size).collect();
                        let weighted = plan.weighted_rank_positions(cursor, world, batch, &weights);
                        assert_eq!(weighted.start, next);
                        next = weighted.end;
                    }
                    assert_eq!(next, cursor + step);
                    cursor += step;
                }
            }
        }
    }
}
