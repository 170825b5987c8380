//! The pace of an origin cache's fetches ahead: how fast one fetch brings bytes and how fast the
//! reader steps, and from both how many fetches to keep under way.
//!
//! Owns: the moving averages and the sizing rule. Never: fetches, or looks at the store (the
//! cache measures and asks).

use std::time::Instant;

use crate::id::ShardId;

/// Shards fetched ahead at once at most (a fetch mostly waits: on the origin, on fsync); how
/// many are is sized from the measured pace (`Pace`).
pub(super) const PREFETCH_THREADS: usize = 8;
/// Headroom over the fetches the measured pace says are enough.
const PACE_MARGIN: f64 = 1.5;
/// Weight of the newest sample in the moving averages of `Pace`.
const PACE_WEIGHT: f64 = 0.2;

/// The measured pace that sizes how many fetches run ahead at once: how fast one fetch brings
/// bytes, and how fast the reader steps.
#[derive(Debug, Default)]
pub(super) struct Pace {
    /// Bytes per second of one shard fetch from an origin (moving average; 0: none yet).
    pub(super) fetch_rate: f64,
    /// Seconds per step of the reader (moving average; 0: fewer than two steps yet).
    pub(super) step_secs: f64,
    pub(super) last_step: Option<Instant>,
}

impl Pace {
    pub(super) fn average(old: f64, sample: f64) -> f64 {
        if old == 0.0 { sample } else { old + PACE_WEIGHT * (sample - old) }
    }

    /// Fetches to keep under way so that each of `missing` (the shards of the plan not here,
    /// soonest first: next use, bytes) lands before the reader reaches it, at `now`: with `c`
    /// fetches at `fetch_rate` each, the first `k` shards' bytes take `bytes / (c * rate)`,
    /// which must not exceed the time to their use. Every thread until both rates are known.
    pub(super) fn fetches_wanted(&self, now: u64, missing: &[(ShardId, u64, u64)]) -> usize {
        if self.fetch_rate <= 0.0 || self.step_secs <= 0.0 {
            return PREFETCH_THREADS;
        }
        let mut behind = 0u64;
        let mut need = 0.0f64;
        for &(_, next_use, bytes) in missing {
            behind += bytes;
            let secs = next_use.saturating_sub(now).max(1) as f64 * self.step_secs;
            need = need.max(behind as f64 / (self.fetch_rate * secs));
        }
        // One spare: a fetch that stalls on a slow request does not hold the rest up.
        let wanted = (need * PACE_MARGIN).ceil() as usize + 1;
        wanted.clamp(1, PREFETCH_THREADS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetches_ahead_follow_the_measured_pace() {
        let shard = |n: u8| ShardId(crate::id::ObjectId::from_bytes([n; 32]));
        let mb = 1_000_000u64;
        // Four 4 MB shards needed at steps 10, 20, 30, 40 (the reader at step 0).
        let missing: Vec<(ShardId, u64, u64)> = (1..=4).map(|k| (shard(k), u64::from(k) * 10, 4 * mb)).collect();
        let mut pace = Pace::default();
        assert_eq!(pace.fetches_wanted(0, &missing), PREFETCH_THREADS, "nothing measured yet: all threads");
        // 10 ms steps: 4 MB per 100 ms is 40 MB/s wanted. One fetch at 100 MB/s keeps up
        // (0.4 of one, with headroom 1), plus the spare.
        pace.step_secs = 0.010;
        pace.fetch_rate = 100.0 * mb as f64;
        assert_eq!(pace.fetches_wanted(0, &missing), 2);
        // At 10 MB/s a fetch: 4 of them (1.5 x 4 = 6, plus the spare).
        pace.fetch_rate = 10.0 * mb as f64;
        assert_eq!(pace.fetches_wanted(0, &missing), 7);
        // An origin that cannot keep up gets every thread, no more.
        pace.fetch_rate = mb as f64;
        assert_eq!(pace.fetches_wanted(0, &missing), PREFETCH_THREADS);
        // Nothing missing: the spare alone.
        pace.fetch_rate = 100.0 * mb as f64;
        assert_eq!(pace.fetches_wanted(0, &[]), 1);
    }
}
