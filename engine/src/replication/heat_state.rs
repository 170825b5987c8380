//! The state of hot shards that every job of a node shares: this node's reads per shard over a
//! window (`HeatWindow`), and what the hot pass keeps between passes (`HotState`, `HotShard`).
//!
//! Owns those types and the loading of the hot copies a restart still knows
//! (`replication/hot`). Below `shared.rs`, which holds them; the hot pass that fills and acts
//! on them is `heat.rs`. Never: talks to a peer, pulls or drops a copy, or uses `Shared`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::frame::HEAT_ENTRIES_MAX;
use crate::id::{ObjectId, ShardId};
use crate::policy::ReplicationMode;

/// Distinct shards counted in a window at most (others read in it are not counted).
const HEAT_SHARDS_MAX: usize = 1 << 16;

/// This node's reads per shard: the window being counted and the one before it.
pub(crate) struct HeatWindow {
    window: Duration,
    started: Instant,
    current: HashMap<ObjectId, u64>,
    previous: HashMap<ObjectId, u64>,
}

impl HeatWindow {
    pub(crate) fn new(window: Duration) -> Self {
        Self { window, started: Instant::now(), current: HashMap::new(), previous: HashMap::new() }
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.started);
        if elapsed >= self.window {
            // Two windows or more without a roll: the one before is empty too.
            self.previous = if elapsed >= self.window.saturating_mul(2) {
                HashMap::new()
            } else {
                std::mem::take(&mut self.current)
            };
            self.current.clear();
            self.started = now;
        }
    }

    /// Counts `reads` of shard `id`.
    pub(crate) fn add(&mut self, id: ObjectId, reads: u64) {
        self.roll(Instant::now());
        let room = self.current.len() < HEAT_SHARDS_MAX;
        match self.current.get_mut(&id) {
            Some(count) => *count = count.saturating_add(reads),
            None if room => {
                self.current.insert(id, reads);
            }
            None => {}
        }
    }

    /// Reads per shard over the last window and the current one, the `HEAT_ENTRIES_MAX` most
    /// read, in id order.
    pub(crate) fn report(&mut self) -> Vec<(ObjectId, u64)> {
        self.roll(Instant::now());
        let mut sums: HashMap<ObjectId, u64> = self.previous.clone();
        for (&id, &reads) in &self.current {
            let sum = sums.entry(id).or_default();
            *sum = sum.saturating_add(reads);
        }
        let mut entries: Vec<(ObjectId, u64)> = sums.into_iter().filter(|&(_, reads)| reads > 0).collect();
        if entries.len() > HEAT_ENTRIES_MAX {
            entries.sort_unstable_by_key(|&(id, reads)| (std::cmp::Reverse(reads), id));
            entries.truncate(HEAT_ENTRIES_MAX);
        }
        entries.sort_unstable();
        entries
    }
}

/// A hot shard as the last hot pass saw it: its reads over the nodes, the nodes its goal names
/// and how its copies are confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HotShard {
    pub(crate) reads: u64,
    pub(crate) nodes: Vec<u32>,
    pub(crate) mode: ReplicationMode,
}

/// What the hot pass keeps between passes.
#[derive(Default)]
pub(crate) struct HotState {
    /// The goals of the last pass, by shard.
    pub(crate) goals: BTreeMap<ShardId, HotShard>,
    /// Hot copies this node holds (recorded in `replication/hot`).
    pub(crate) held: BTreeSet<ShardId>,
    /// Hot copies being pulled.
    pub(crate) fetching: HashSet<ShardId>,
    /// When the last pass ran.
    pub(crate) last_pass: Option<Instant>,
}

impl HotState {
    /// The hot copies recorded under `root` by an earlier run.
    pub(crate) fn load(root: &std::path::Path) -> Self {
        let path = root.join("replication").join("hot");
        let held = std::fs::read_to_string(path)
            .map(|text| text.lines().filter_map(|line| ObjectId::parse_hex(line.trim()).map(ShardId)).collect())
            .unwrap_or_default();
        Self { held, ..Self::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_the_last_two_windows_and_keeps_the_most_read() {
        let mut heat = HeatWindow::new(Duration::from_millis(40));
        let (a, b) = (ObjectId::of(b"a"), ObjectId::of(b"b"));
        heat.add(a, 3);
        heat.add(b, 1);
        heat.add(a, 2);
        let mut expected = vec![(a, 5), (b, 1)];
        expected.sort_unstable();
        assert_eq!(heat.report(), expected);
        std::thread::sleep(Duration::from_millis(50));
        heat.add(b, 4);
        // The window before still counts.
        let mut expected = vec![(a, 5), (b, 5)];
        expected.sort_unstable();
        assert_eq!(heat.report(), expected);
        // Two windows later nothing is left.
        std::thread::sleep(Duration::from_millis(90));
        assert_eq!(heat.report(), Vec::new());
        // The report keeps the most read when it must cut.
        for i in 0..(HEAT_ENTRIES_MAX as u64 + 10) {
            heat.add(ObjectId::of(&i.to_le_bytes()), i + 1);
        }
        let report = heat.report();
        assert_eq!(report.len(), HEAT_ENTRIES_MAX);
        assert!(report.iter().all(|&(_, reads)| reads > 10));
        assert!(report.windows(2).all(|w| w[0].0 < w[1].0));
    }
}
