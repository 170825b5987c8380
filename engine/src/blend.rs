//! The order of a mixture: which source, and which of its records, sits at each position of an
//! epoch, for sources read in given proportions.
//!
//! A blend reads one long sequence cut into epochs of `epoch_samples` positions. At each
//! position every source's target grows by its weight (weights are fixed-point fractions of
//! `WEIGHT_UNIT` that add up to it exactly, so the order is the same on every machine), and one
//! source is drawn by Tijdeman's rule for the chairman assignment problem: among the sources at
//! least `1 / (2S - 2)` behind their target, the one that would fall a whole draw behind first.
//! Each source's count then stays within `1 - 1 / (2S - 2)` of its target at every prefix under
//! fixed weights (Tijdeman's bound). A change of weights can put two sources that were nearly a
//! draw behind both past 1 at once (one is drawn at a position): within 2 after a change (what
//! the property test and `Draw::next`'s assertion check; measured, not proven). The greedy rule "the source furthest behind" drifts past 1
//! with more than a few sources. Weights may change at any position (a curriculum); the target
//! restarts at zero with every epoch, so an epoch's proportions hold from its first position.
//! Two sources' draws are a rotation (`Draw::jump`): counted at once from any position; more
//! sources jump whole periods from an epoch's start, and draw the rest one by one.
//! A source's draws continue across epochs: its k-th draw overall is record
//! `k mod n` of its pass `k / n`, each pass a fresh seeded permutation, so a small source is
//! repeated with a new shuffle each pass and a large one is read partly, going on where the
//! last epoch stopped.
//!
//! Owns `Blend`, `BlendSource`, `BlendEpoch` and `BlendDraws` (one epoch's positions from any
//! cursor, replayed
//! from the epoch's start) and the weights' fixed point. Never: reads data or opens a source
//! (`read::Mixture` does), or cuts positions between ranks (the plan's `World` arithmetic does,
//! as for any other order: a blend's positions are global, so any world size reads the same
//! sequence).

use crate::plan::{EpochPlan, Order, Position};

/// The fixed point of a weight: weights add up to this.
pub const WEIGHT_UNIT: u64 = 1 << 32;

/// Sources a blend may have.
pub const SOURCES_MAX: usize = 256;

/// One source of a blend, as its positions see it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BlendSource {
    /// Where its records start in the sequence of every source's records (the mixture's
    /// dataset: sources in order).
    pub start: u64,
    /// Its records.
    pub n_records: u64,
    /// Keys its passes' permutations (a digest of its version, so its order does not depend on
    /// its place in the list).
    pub key: u64,
}

/// The weights in force from a position on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Change {
    at: Position,
    units: Vec<u64>,
}

/// A mixture's order, a function of (sources, weights and their changes, epoch length, seed,
/// epoch) alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Blend {
    sources: Vec<BlendSource>,
    epoch_samples: u64,
    /// Sorted by position; the first is at (0, 0).
    changes: Vec<Change>,
}

impl Blend {
    /// A blend of `sources` in proportions `weights` (any non-negative numbers, at least one
    /// positive; normalized), `epoch_samples` positions an epoch.
    pub fn new(sources: Vec<BlendSource>, weights: &[f64], epoch_samples: u64) -> Result<Self, String> {
        if sources.is_empty() || sources.len() > SOURCES_MAX {
            return Err(format!("a mixture has 1 to {SOURCES_MAX} sources, not {}", sources.len()));
        }
        if epoch_samples == 0 {
            return Err("a mixture's epoch has at least one sample".to_owned());
        }
        let units = to_units(weights, sources.len())?;
        let blend = Self { sources, epoch_samples, changes: vec![Change { at: Position::default(), units }] };
        blend.check_sources()?;
        Ok(blend)
    }

    /// The same blend with `weights` in force from `at` on (replacing a change at the same
    /// position; later changes stay).
    pub fn with_change(mut self, at: Position, weights: &[f64]) -> Result<Self, String> {
        if at.cursor >= self.epoch_samples {
            return Err(format!("position {} is past the epoch's {} samples", at.cursor, self.epoch_samples));
        }
        let units = to_units(weights, self.sources.len())?;
        self.changes.retain(|change| change.at != at);
        let i = self.changes.partition_point(|change| (change.at.epoch, change.at.cursor) < (at.epoch, at.cursor));
        self.changes.insert(i, Change { at, units });
        self.check_sources()?;
        Ok(self)
    }

    /// A source weighted above zero must have records to draw.
    fn check_sources(&self) -> Result<(), String> {
        for (s, source) in self.sources.iter().enumerate() {
            if source.n_records == 0 && self.changes.iter().any(|change| change.units[s] > 0) {
                return Err(format!("source {s} has no records and a weight above zero"));
            }
        }
        Ok(())
    }

    /// The sources.
    pub fn sources(&self) -> &[BlendSource] {
        &self.sources
    }

    /// Positions in an epoch.
    pub fn epoch_samples(&self) -> u64 {
        self.epoch_samples
    }

    /// Each change of weights: from which position, and the weights (fractions adding up to 1).
    pub fn changes(&self) -> Vec<(Position, Vec<f64>)> {
        self.changes
            .iter()
            .map(|change| (change.at, change.units.iter().map(|&u| u as f64 / WEIGHT_UNIT as f64).collect()))
            .collect()
    }

    /// The weights in force at `at`, in fixed point.
    pub fn units_at(&self, at: Position) -> &[u64] {
        let i = self.changes.partition_point(|change| (change.at.epoch, change.at.cursor) <= (at.epoch, at.cursor));
        &self.changes[i.saturating_sub(1)].units
    }

    /// The changes of weights inside epoch `epoch` (the weights at its start first).
    fn epoch_changes(&self, epoch: u64) -> EpochChanges<'_> {
        let mut out = vec![(0, self.units_at(Position { epoch, cursor: 0 }))];
        out.extend(
            self.changes.iter().filter(|c| c.at.epoch == epoch && c.at.cursor > 0).map(|c| (c.at.cursor, &c.units[..])),
        );
        out
    }

    /// Each source's draws in epoch `epoch`. The weights at the epoch's start run whole periods
    /// at once (`Draw::skip_periods`): an epoch of `2^64 - 1` samples under 1:1 weights is counted
    /// in two draws, and under any weights in at most `WEIGHT_UNIT` draws, plus those after a
    /// change inside the epoch.
    pub fn epoch_counts(&self, epoch: u64) -> Vec<u64> {
        let mut draw = Draw::new(self.sources.len());
        let changes = self.epoch_changes(epoch);
        for (i, &(from, units)) in changes.iter().enumerate() {
            let to = changes.get(i + 1).map_or(self.epoch_samples, |next| next.0);
            let mut at = from;
            if from == 0 {
                at = draw.skip_periods(units, to);
            }
            if !draw.jump(units, to - at) {
                for _ in at..to {
                    draw.next(units);
                }
            }
        }
        draw.counts
    }

    /// Epoch `epoch` of the blend under `seed`; refused when a source's draws up to its end
    /// would not fit a `u64` (an epoch no run reaches, but a state or a count can name).
    pub fn epoch(&self, seed: u64, epoch: u64) -> Result<BlendEpoch, String> {
        let before =
            self.drawn(epoch).filter(|before| before.iter().all(|d| d.checked_add(self.epoch_samples).is_some()));
        let before = before.ok_or_else(|| {
            format!(
                "epoch {epoch} of a mixture of {} samples an epoch: its draws pass what a u64 counts",
                self.epoch_samples
            )
        })?;
        Ok(BlendEpoch { blend: self.clone(), seed, epoch, before })
    }

    /// Each source's draws in epochs `0..epochs`, or `None` when one passes a `u64`. Epochs
    /// whose weights are the same throughout draw the same counts, and such epochs come in runs:
    /// an epoch a change falls in stands alone, and the epochs after it up to the next such
    /// epoch share one set of weights. So the time taken grows with the changes, not the epochs.
    pub fn drawn(&self, epochs: u64) -> Option<Vec<u64>> {
        let mut starts: Vec<u64> = vec![0];
        for change in &self.changes {
            starts.push(change.at.epoch);
            starts.push(change.at.epoch.saturating_add(1));
        }
        starts.retain(|&e| e < epochs);
        starts.sort_unstable();
        starts.dedup();
        let mut drawn = vec![0u64; self.sources.len()];
        let mut memo: Vec<(EpochChanges<'_>, Vec<u64>)> = Vec::new();
        for (i, &first) in starts.iter().enumerate() {
            let run = starts.get(i + 1).copied().unwrap_or(epochs) - first;
            let changes = self.epoch_changes(first);
            let counts = match memo.iter().find(|(seen, _)| *seen == changes) {
                Some((_, counts)) => counts.clone(),
                None => {
                    let counts = self.epoch_counts(first);
                    memo.push((changes, counts.clone()));
                    counts
                }
            };
            for (total, count) in drawn.iter_mut().zip(counts) {
                *total = total.checked_add(count.checked_mul(run)?)?;
            }
        }
        Some(drawn)
    }
}

/// The weights in force within one epoch: from which cursor, which units.
type EpochChanges<'a> = Vec<(u64, &'a [u64])>;

/// One epoch of a blend (it holds its own copy of the blend, so its draws can outlive it).
#[derive(Clone, Debug)]
pub struct BlendEpoch {
    blend: Blend,
    seed: u64,
    epoch: u64,
    /// Each source's draws in the epochs before.
    before: Vec<u64>,
}

/// One position's draw: the source, its pass over the source, and the record of that pass
/// (the pass's permutation applied: the source's own record index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drawn {
    /// The source.
    pub source: usize,
    /// Its pass over the source (counted over the whole run).
    pub pass: u64,
    /// The record of the source.
    pub record: u64,
}

impl BlendEpoch {
    /// The positions from `cursor` to the epoch's end, as records of the mixture's dataset
    /// (replayed from the epoch's start: O(cursor x sources) before the first).
    pub fn records_from(&self, cursor: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.draws_from(cursor).map(|d| (d.source, self.blend.sources[d.source].start + d.record))
    }

    /// The draws from `cursor` to the epoch's end.
    pub fn draws_from(&self, cursor: u64) -> BlendDraws {
        let changes =
            self.blend.epoch_changes(self.epoch).into_iter().map(|(at, units)| (at, units.to_vec())).collect();
        let mut draws = BlendDraws {
            epoch: self.clone(),
            changes,
            draw: Draw::new(self.blend.sources.len()),
            change: 0,
            position: 0,
            passes: vec![None; self.blend.sources.len()],
        };
        let cursor = cursor.min(self.blend.epoch_samples);
        // The weights at the epoch's start run whole periods at once.
        let first_end = draws.changes.get(1).map_or(self.blend.epoch_samples, |next| next.0);
        if let Some((_, units)) = draws.changes.first() {
            draws.position = draws.draw.skip_periods(units, cursor.min(first_end));
        }
        draws.skip_to(cursor);
        draws
    }

    /// Each source's draws in the epochs before this one.
    pub fn drawn_before(&self) -> &[u64] {
        &self.before
    }
}

/// The draws of an epoch's positions, in order.
pub struct BlendDraws {
    epoch: BlendEpoch,
    /// The weights in force within the epoch: from which cursor, which units.
    changes: Vec<(u64, Vec<u64>)>,
    draw: Draw,
    change: usize,
    position: u64,
    /// Each source's current pass and its permutation.
    passes: Vec<Option<(u64, EpochPlan)>>,
}

impl BlendDraws {
    /// The source drawn at the next position, and its draw's index within the epoch.
    fn next_source(&mut self) -> (usize, u64) {
        while self.changes.get(self.change + 1).is_some_and(|next| next.0 <= self.position) {
            self.change += 1;
        }
        self.position += 1;
        self.draw.next(&self.changes[self.change].1)
    }

    /// Draws up to `cursor` without handing them out: two sources at once, change to change
    /// (`Draw::jump`), more one by one.
    fn skip_to(&mut self, cursor: u64) {
        while self.position < cursor {
            while self.changes.get(self.change + 1).is_some_and(|next| next.0 <= self.position) {
                self.change += 1;
            }
            let end = self.changes.get(self.change + 1).map_or(cursor, |next| next.0.min(cursor));
            if self.draw.jump(&self.changes[self.change].1, end - self.position) {
                self.position = end;
            } else {
                self.next_source();
            }
        }
    }

    /// The position the next draw is at.
    pub fn at(&self) -> u64 {
        self.position
    }
}

impl Iterator for BlendDraws {
    type Item = Drawn;

    fn next(&mut self) -> Option<Drawn> {
        if self.position >= self.epoch.blend.epoch_samples {
            return None;
        }
        let (s, k) = self.next_source();
        let source = &self.epoch.blend.sources[s];
        let drawn = self.epoch.before[s] + k;
        let (pass, index) = (drawn / source.n_records, drawn % source.n_records);
        let plan = match self.passes[s] {
            Some((at, plan)) if at == pass => plan,
            _ => {
                let plan = EpochPlan::new(source.n_records, self.epoch.seed ^ source.key, pass, Order::Shuffled);
                self.passes[s] = Some((pass, plan));
                plan
            }
        };
        Some(Drawn { source: s, pass, record: plan.record_at(index) })
    }
}

/// Tijdeman's draw, in fixed point: targets `t` (in `WEIGHT_UNIT`s) and counts.
struct Draw {
    targets: Vec<u128>,
    counts: Vec<u64>,
    /// The weights of the first draw, and whether a later one had others (see `DRAWS_OFF_MAX`).
    first_units: Option<Vec<u64>>,
    changed: bool,
}

/// How far (in draws) a source's count may be from its target. Under one set of weights,
/// Tijdeman's rule keeps every count within one draw of its target (at most `1 - 1 / (2n - 2)`);
/// a change of weights can push two sources that were nearly a draw behind both past it at
/// once (only one is drawn at a position), so after a change the promise is two draws.
const DRAWS_OFF_MAX: [u128; 2] = [1, 2];

impl Draw {
    fn new(n: usize) -> Self {
        Self { targets: vec![0; n], counts: vec![0; n], first_units: None, changed: false }
    }

    /// The positions after which draws under `units`, from a start where every source is at its
    /// target, are all at their targets again: the weights' fixed point has a common
    /// denominator of `WEIGHT_UNIT / gcd(units)`, at which every target is a whole number of
    /// draws, and Tijdeman's rule keeps each count within one draw of its target, so each is
    /// exactly its target there, and the draws repeat.
    fn period(units: &[u64]) -> u64 {
        let gcd = units.iter().fold(WEIGHT_UNIT, |a, &b| {
            let (mut a, mut b) = (a, b);
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        });
        WEIGHT_UNIT / gcd.max(1)
    }

    /// From a fresh draw (every count and target 0), jumps over the whole periods of `units`
    /// within `positions` positions; returns the positions jumped over.
    fn skip_periods(&mut self, units: &[u64], positions: u64) -> u64 {
        debug_assert!(self.counts.iter().all(|&c| c == 0) && self.targets.iter().all(|&t| t == 0));
        let period = Self::period(units);
        let periods = positions / period;
        for ((target, count), &w) in self.targets.iter_mut().zip(&mut self.counts).zip(units) {
            *target = u128::from(periods) * u128::from(period) * u128::from(w);
            debug_assert!(target.is_multiple_of(u128::from(WEIGHT_UNIT)), "a period ends on whole draws");
            // The count at a period's end is its target exactly: `periods x period x w / unit`.
            *count = u64::try_from(*target / u128::from(WEIGHT_UNIT)).unwrap_or(u64::MAX);
        }
        periods * period
    }

    /// Draws `positions` positions under `units` at once when there are two sources, and says
    /// whether it did (with more, nothing is drawn). With two, source 0's deficit `d = t0 - c0`
    /// (in units) stays in `[-U/2, U/2)`: after its target grows by `u0` it is drawn exactly when
    /// `d + u0 >= U/2` (the rule's eligibility at `1 / (2S - 2)` = 1/2, a tie going to the first
    /// source unless its weight is 0), so `d` turns as `(d + U/2 + u0) mod U - U/2` and source 0
    /// is drawn `floor((d + U/2 + k u0) / U)` times in `k` positions: Tijdeman's draws of two
    /// sources are a rotation, counted in O(1) from any position and any history of weights.
    fn jump(&mut self, units: &[u64], positions: u64) -> bool {
        if self.targets.len() != 2 {
            return false;
        }
        let unit = i128::from(WEIGHT_UNIT);
        let deficit = i128::try_from(self.targets[0]).unwrap_or(i128::MAX) - i128::from(self.counts[0]) * unit;
        debug_assert!((-unit / 2..unit / 2).contains(&deficit), "two sources' deficit {deficit} in [-U/2, U/2)");
        // At most 2^31 + 2^64 x 2^32: an i128.
        let turned = deficit + unit / 2 + i128::from(positions) * i128::from(units[0]);
        let drawn = u64::try_from(turned.div_euclid(unit)).unwrap_or(u64::MAX).min(positions);
        self.counts[0] += drawn;
        self.counts[1] += positions - drawn;
        for (target, &w) in self.targets.iter_mut().zip(units) {
            *target += u128::from(positions) * u128::from(w);
        }
        self.note_units(units);
        true
    }

    /// Draws one position under `units`; returns the source and its count before this draw.
    fn next(&mut self, units: &[u64]) -> (usize, u64) {
        let n = self.targets.len();
        debug_assert_eq!(units.len(), n);
        debug_assert_eq!(units.iter().sum::<u64>(), WEIGHT_UNIT, "weights add up to the unit");
        for (target, &w) in self.targets.iter_mut().zip(units) {
            *target += u128::from(w);
        }
        let chosen = if n == 1 { 0 } else { self.choose(units) };
        let before = self.counts[chosen];
        self.counts[chosen] += 1;
        // The blend's promise: at every prefix each source is within one draw of its share
        // (two, once the weights have changed: `DRAWS_OFF_MAX`).
        if cfg!(debug_assertions) {
            self.note_units(units);
            let off_max = DRAWS_OFF_MAX[usize::from(self.changed)] * u128::from(WEIGHT_UNIT);
            debug_assert!(
                self.targets
                    .iter()
                    .zip(&self.counts)
                    .all(|(&t, &c)| t.abs_diff(u128::from(c) * u128::from(WEIGHT_UNIT)) <= off_max),
                "a source more than {} draw(s) from its share",
                off_max / u128::from(WEIGHT_UNIT)
            );
        }
        (chosen, before)
    }

    /// Remembers the first weights drawn under, and whether others came since (checks only).
    fn note_units(&mut self, units: &[u64]) {
        if cfg!(debug_assertions) {
            match &self.first_units {
                None => self.first_units = Some(units.to_vec()),
                Some(first) => self.changed |= first.as_slice() != units,
            }
        }
    }

    fn choose(&self, units: &[u64]) -> usize {
        let unit = i128::from(WEIGHT_UNIT as i64);
        let m = 2 * (self.targets.len() as i128) - 2;
        // Behind its target by at least 1 / m of a draw: m (t - c) >= 1, in units.
        let behind = |s: usize| self.targets[s] as i128 - i128::from(self.counts[s]) * unit;
        // Falls a whole draw (less 1 / m) behind after `(c + 1 - 1/m - t) / w` more positions:
        // compared as fractions, numerators scaled by m.
        let numerator = |s: usize| m * (i128::from(self.counts[s] + 1) * unit - self.targets[s] as i128) - unit;
        let mut best: Option<usize> = None;
        for s in 0..self.targets.len() {
            if m * behind(s) < unit {
                continue;
            }
            best = match best {
                None => Some(s),
                Some(b) => {
                    let (ws, wb) = (i128::from(units[s] as i64), i128::from(units[b] as i64));
                    // A source whose weight is now zero never falls further behind: last.
                    let earlier = match (ws, wb) {
                        (0, _) => false,
                        (_, 0) => true,
                        _ => numerator(s) * wb < numerator(b) * ws,
                    };
                    Some(if earlier { s } else { b })
                }
            };
        }
        // None eligible cannot happen while the weights add up to one draw a position (the
        // deficits add up to zero); the source furthest behind, then.
        best.unwrap_or_else(|| (0..self.targets.len()).max_by_key(|&s| (behind(s), std::cmp::Reverse(s))).unwrap_or(0))
    }
}

/// `weights` as fixed-point fractions adding up to `WEIGHT_UNIT` exactly (largest remainders).
fn to_units(weights: &[f64], n: usize) -> Result<Vec<u64>, String> {
    if weights.len() != n {
        return Err(format!("{} weights for {n} sources", weights.len()));
    }
    if let Some(bad) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return Err(format!("weight {bad} is not a finite number >= 0"));
    }
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        return Err("at least one weight is above zero".to_owned());
    }
    let exact: Vec<f64> = weights.iter().map(|w| w / total * WEIGHT_UNIT as f64).collect();
    let mut units: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
    let mut short = WEIGHT_UNIT.saturating_sub(units.iter().sum());
    let mut by_remainder: Vec<usize> = (0..n).filter(|&s| weights[s] > 0.0).collect();
    by_remainder
        .sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for &s in by_remainder.iter().cycle().take(by_remainder.len() * 2) {
        if short == 0 {
            break;
        }
        units[s] += 1;
        short -= 1;
    }
    while units.iter().sum::<u64>() > WEIGHT_UNIT {
        // Rounding can only add: take the excess off the largest.
        let s = (0..n).max_by_key(|&s| units[s]).unwrap_or(0);
        units[s] -= 1;
    }
    if units.iter().sum::<u64>() != WEIGHT_UNIT {
        return Err(format!("weights {weights:?} cannot be put in fixed point"));
    }
    Ok(units)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(sizes: &[u64]) -> Vec<BlendSource> {
        let mut start = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                let source = BlendSource { start, n_records: n, key: s as u64 * 0x9e37_79b9 };
                start += n;
                source
            })
            .collect()
    }

    #[test]
    fn fixed_point_weights_add_up_to_the_unit() {
        for weights in [vec![0.7, 0.2, 0.1], vec![1.0; 7], vec![1e-9, 1.0], vec![0.0, 3.0, 0.0]] {
            let units = to_units(&weights, weights.len()).expect("weights");
            assert_eq!(units.iter().sum::<u64>(), WEIGHT_UNIT, "{weights:?}");
        }
        assert!(to_units(&[0.0, 0.0], 2).is_err());
        assert!(to_units(&[f64::NAN, 1.0], 2).is_err());
        assert!(to_units(&[1.0], 2).is_err());
    }

    #[test]
    fn a_source_reads_each_record_once_a_pass_and_goes_on_next_epoch() {
        let blend = Blend::new(sources(&[10, 1000]), &[0.5, 0.5], 100).expect("blend");
        let mut small = Vec::new();
        let mut large = Vec::new();
        for epoch in 0..3 {
            for (s, record) in blend.epoch(7, epoch).expect("epoch").records_from(0) {
                if s == 0 { small.push(record) } else { large.push(record - 10) }
            }
        }
        assert_eq!(small.len(), 150);
        for pass in small.chunks(10) {
            let mut pass = pass.to_vec();
            pass.sort_unstable();
            assert_eq!(pass, (0..10).collect::<Vec<_>>());
        }
        // The large source's 150 draws are distinct: epochs go on through its first pass.
        let mut distinct = large.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 150);
    }

    #[test]
    fn the_draws_before_an_epoch_are_the_sum_of_the_epochs_before_whatever_the_changes() {
        // Changes inside epochs 2 and 5 and at the start of 4: every epoch's draws summed one by
        // one, against the runs of alike epochs.
        let blend = Blend::new(sources(&[5, 17, 40]), &[0.2, 0.5, 0.3], 90)
            .and_then(|b| b.with_change(Position { epoch: 2, cursor: 33 }, &[0.0, 0.1, 0.9]))
            .and_then(|b| b.with_change(Position { epoch: 4, cursor: 0 }, &[0.6, 0.2, 0.2]))
            .and_then(|b| b.with_change(Position { epoch: 5, cursor: 89 }, &[0.3, 0.3, 0.4]))
            .expect("blend");
        let mut summed = vec![0u64; 3];
        for epoch in 0..9 {
            assert_eq!(blend.drawn(epoch), Some(summed.clone()), "before epoch {epoch}");
            assert_eq!(blend.epoch(1, epoch).expect("epoch").drawn_before(), &summed[..]);
            for (total, count) in summed.iter_mut().zip(blend.epoch_counts(epoch)) {
                *total += count;
            }
        }
    }

    #[test]
    fn an_epoch_far_out_is_reached_at_once_and_one_past_counting_is_refused() {
        let blend = Blend::new(sources(&[5, 17]), &[0.5, 0.5], 90).expect("blend");
        // 2**62 epochs of 45 draws each pass a u64; 2**56 do not.
        let started = std::time::Instant::now();
        let far = blend.epoch(1, 1 << 56).expect("epoch 2**56");
        assert_eq!(far.drawn_before(), &[45 << 56, 45 << 56]);
        assert_eq!(far.records_from(89).count(), 1);
        assert!(blend.epoch(1, 1 << 62).is_err());
        assert!(blend.drawn(u64::MAX).is_none());
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    }

    #[test]
    fn resuming_at_a_cursor_reads_the_rest_of_the_epoch() {
        let blend = Blend::new(sources(&[5, 17, 40]), &[0.2, 0.5, 0.3], 90)
            .and_then(|b| b.with_change(Position { epoch: 1, cursor: 33 }, &[0.0, 0.1, 0.9]))
            .expect("blend");
        let epoch = blend.epoch(3, 1).expect("epoch");
        let whole: Vec<_> = epoch.records_from(0).collect();
        for cursor in [0, 1, 32, 33, 34, 89, 90] {
            let rest: Vec<_> = epoch.records_from(cursor).collect();
            assert_eq!(rest, whole[cursor as usize..], "from {cursor}");
        }
        // The change applies from its position: source 0 is drawn at most once more after it
        // (what it was behind its target then).
        assert!(whole[33..].iter().filter(|(s, _)| *s == 0).count() <= 1);
    }

    #[test]
    fn whole_periods_are_jumped_over_and_give_the_draws_one_by_one_gives() {
        for weights in [vec![1.0, 1.0], vec![1.0, 3.0], vec![2.0, 1.0, 1.0], vec![0.7, 0.2, 0.1], vec![5.0, 0.0, 3.0]] {
            let blend = Blend::new(sources(&[7, 5, 3][..weights.len()]), &weights, 53).expect("a blend");
            let units = blend.units_at(Position::default()).to_vec();
            // One by one, from the start.
            let mut draw = Draw::new(weights.len());
            let naive: Vec<(usize, u64)> = (0..53).map(|_| draw.next(&units)).collect();
            assert_eq!(blend.epoch_counts(0), draw.counts, "{weights:?}");
            let epoch = blend.epoch(9, 0).expect("an epoch");
            let all: Vec<Drawn> = epoch.draws_from(0).collect();
            assert_eq!(all.iter().map(|d| d.source).collect::<Vec<_>>(), naive.iter().map(|d| d.0).collect::<Vec<_>>());
            for cursor in [1, 2, 3, 4, 8, 17, 52, 53] {
                let rest: Vec<Drawn> = epoch.draws_from(cursor).collect();
                assert_eq!(rest, all[cursor as usize..], "{weights:?} from {cursor}");
            }
        }
        // Two sources are counted in closed form from any position and across changes of
        // weights: the same draws as one by one.
        for (weights, change) in [
            (vec![0.7, 0.3], vec![0.2, 0.8]),
            (vec![0.999, 0.001], vec![0.0, 1.0]),
            (vec![0.0, 1.0], vec![1.0, 0.0]),
            (vec![1.0, 3.0], vec![0.5, 0.5]),
            (vec![0.3141592653589793, 0.6858407346410207], vec![0.123456789, 0.876543211]),
        ] {
            for at in [1u64, 17, 52] {
                let blend = Blend::new(sources(&[7, 5]), &weights, 97)
                    .and_then(|b| b.with_change(Position { epoch: 1, cursor: at }, &change))
                    .expect("a blend");
                for epoch in 0..3 {
                    let all: Vec<Drawn> = blend.epoch(4, epoch).expect("an epoch").draws_from(0).collect();
                    let mut counted = vec![0u64; 2];
                    all.iter().for_each(|d| counted[d.source] += 1);
                    assert_eq!(blend.epoch_counts(epoch), counted, "{weights:?} -> {change:?} at {at}, epoch {epoch}");
                    let epoch_draws = blend.epoch(4, epoch).expect("an epoch");
                    for cursor in [1, 16, at, at + 1, 60, 96, 97] {
                        let rest: Vec<Drawn> = epoch_draws.draws_from(cursor).collect();
                        assert_eq!(rest, all[cursor as usize..], "{weights:?} -> {change:?} at {at} from {cursor}");
                    }
                }
            }
        }
        // An epoch of 2^64 - 1 positions under 1:1 weights is counted at once.
        let blend = Blend::new(sources(&[7, 5]), &[1.0, 1.0], u64::MAX).expect("a blend");
        assert_eq!(blend.epoch_counts(0), vec![u64::MAX / 2 + 1, u64::MAX / 2]);
        assert_eq!(Draw::period(&[WEIGHT_UNIT / 2, WEIGHT_UNIT / 2]), 2);
    }
}
