//! Owns: a reader's counters: `ReadStats`, and `PublishedStats`, the copy another thread (a
//! loader's `stats`, a metrics scrape) reads while the reader runs.
//!
//! Never: takes a lock (the published copy is relaxed atomics, fields possibly a batch apart).

/// Counters of one reader.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Records delivered.
    pub records: u64,
    /// Record bytes delivered.
    pub bytes_delivered: u64,
    /// Bytes read from files (whole blocks).
    pub bytes_read: u64,
    /// Ops issued.
    pub ops: u64,
    /// Blocks whose checksum was checked on reads from disk and on copies from the memory tier
    /// (a block two records of a batch share, once per record); the tier's fills check theirs
    /// too, counted in `TierStats::bytes_loaded`.
    pub blocks_verified: u64,
    /// Shards the repair hook made whole: missing ones fetched as a batch needing them was
    /// planned (a cold cache's), damaged ones replaced.
    pub shards_repaired: u64,
    /// Reads that found damaged bytes (a block's CRC32C, a shard's BLAKE3 or its metadata did
    /// not check out): each was repaired (see `shards_repaired`) or ended the read with an error;
    /// and records whose blocks failed their check as they were copied from the memory tier
    /// (each read from disk instead).
    pub verify_failures: u64,
    /// Records copied from the memory tier (the rest of `records` came from disk).
    pub tier_records: u64,
    /// Record bytes copied from the memory tier.
    pub tier_bytes: u64,
    /// Ops read straight into the batch's memory and checked there (no copy); the rest of
    /// `ops` were read into a buffer and their records copied out.
    pub ops_direct: u64,
    /// Ops checked by a verify worker rather than the thread that reaps the disk (and, for
    /// those not read straight into the batch, copied into it by the worker).
    pub ops_offloaded: u64,
    /// Batches delivered.
    pub batches: u64,
    /// Distinct shards each delivered batch drew its records from, summed over the batches: over
    /// `batches`, how well the plan mixes (a record-level shuffle draws nearly every shard; a
    /// window of W shards about W).
    pub batch_shards: u64,
}

impl ReadStats {
    /// Shards a batch drew from, on average (0 before any batch).
    pub fn shards_per_batch(&self) -> f64 {
        if self.batches == 0 { 0.0 } else { self.batch_shards as f64 / self.batches as f64 }
    }

    /// Every counter, in declaration order: named one by one, so a new counter cannot be left
    /// out of a sum or a copy.
    fn to_array(self) -> [u64; 13] {
        let ReadStats {
            records,
            bytes_delivered,
            bytes_read,
            ops,
            blocks_verified,
            shards_repaired,
            verify_failures,
            tier_records,
            tier_bytes,
            ops_direct,
            ops_offloaded,
            batches,
            batch_shards,
        } = self;
        [
            records,
            bytes_delivered,
            bytes_read,
            ops,
            blocks_verified,
            shards_repaired,
            verify_failures,
            tier_records,
            tier_bytes,
            ops_direct,
            ops_offloaded,
            batches,
            batch_shards,
        ]
    }

    /// The counters `to_array` gave.
    fn from_array(values: [u64; 13]) -> Self {
        let [a, b, c, d, e, f, g, h, i, j, k, l, m] = values;
        ReadStats {
            records: a,
            bytes_delivered: b,
            bytes_read: c,
            ops: d,
            blocks_verified: e,
            shards_repaired: f,
            verify_failures: g,
            tier_records: h,
            tier_bytes: i,
            ops_direct: j,
            ops_offloaded: k,
            batches: l,
            batch_shards: m,
        }
    }
}

impl std::ops::AddAssign<&ReadStats> for ReadStats {
    /// Adds another reader's (or another run's) counters, every one of them.
    fn add_assign(&mut self, more: &ReadStats) {
        let mut sum = self.to_array();
        for (have, add) in sum.iter_mut().zip(more.to_array()) {
            *have += add;
        }
        *self = ReadStats::from_array(sum);
    }
}

pub(super) fn publish(to: Option<&PublishedStats>, stats: &ReadStats) {
    if let Some(to) = to {
        to.set(stats);
    }
}

/// A reader's counters as another thread sees them while the reader runs
/// (`Reader::publish_stats`): relaxed atomics, so publishing after a batch takes no lock and a
/// scrape of the metrics never waits on the reader (fields may be a batch apart).
#[derive(Debug, Default)]
pub struct PublishedStats([std::sync::atomic::AtomicU64; 13], std::sync::atomic::AtomicU64);

impl PublishedStats {
    /// Ops issued whose batch was not delivered yet, as of the last delivered batch (the reads
    /// in flight, and those done but waiting for an earlier batch).
    pub fn pending_ops(&self) -> u64 {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn set_pending_ops(&self, ops: u64) {
        self.1.store(ops, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counters as of the reader's last delivered batch or repair.
    pub fn get(&self) -> ReadStats {
        ReadStats::from_array(self.0.each_ref().map(|v| v.load(std::sync::atomic::Ordering::Relaxed)))
    }

    pub(super) fn set(&self, stats: &ReadStats) {
        for (to, value) in self.0.iter().zip(stats.to_array()) {
            to.store(value, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
