//! What the benchmarks share: the median of a run's samples, the generator of their
//! incompressible test bytes, and the ops a bare io_uring reader is timed on for the same
//! records as the engine.
//!
//! Owns `median`, `Xorshift` and `bare_ops`. Never: times anything or prints (each benchmark does), or
//! serves where randomness must be unpredictable (the generator is for test data only).

use anyhow::{Context, Result};
use granary::Dataset;
use granary::io::bare::BareOp;
use granary::shard::{BLOCK_BYTES_U64, DATA_OFFSET};

/// The median of `values` (the upper one of an even count, so it is a sample); `None` when
/// there are none.
pub(crate) fn median<T: Copy + PartialOrd>(values: &[T]) -> Option<T> {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sorted.get(sorted.len() / 2).copied()
}

/// Marsaglia's xorshift64: fast bytes no compressor or deduplication shortens, the same for the
/// same seed.
pub(crate) struct Xorshift(u64);

impl Xorshift {
    /// A generator from `seed` (any value; 0 is made odd).
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Fills `bytes`, 8 at a time (the last word cut short).
    pub(crate) fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// The bare reader's ops for `records`: each record's blocks cut at `op_bytes`; with `coalesce`,
/// consecutive records' blocks merge as the engine's planner merges them (a block two records
/// share, when records are not whole blocks, is read once).
pub(crate) fn bare_ops(dataset: &Dataset, records: &[u64], op_bytes: usize, coalesce: bool) -> Result<Vec<BareOp>> {
    let op_blocks = (op_bytes as u64 / BLOCK_BYTES_U64).max(1);
    let mut ops: Vec<BareOp> = Vec::with_capacity(records.len());
    for &index in records {
        let (shard, local) = dataset.locate(index)?;
        let range = dataset.shard_meta(shard)?.record_range(local);
        let file = u32::try_from(shard).context("shard count")?;
        let (mut block, end) = (range.start / BLOCK_BYTES_U64, range.end.div_ceil(BLOCK_BYTES_U64));
        while block < end {
            if let Some(last) = ops.last_mut().filter(|last| coalesce && last.file == file) {
                let last_end = (last.offset - DATA_OFFSET) / BLOCK_BYTES_U64 + u64::from(last.len) / BLOCK_BYTES_U64;
                let last_start = (last.offset - DATA_OFFSET) / BLOCK_BYTES_U64;
                if block >= last_start && block < last_end {
                    block = last_end;
                    continue;
                }
                let room = op_blocks - u64::from(last.len) / BLOCK_BYTES_U64;
                if last_end == block && room > 0 {
                    let n = room.min(end - block);
                    last.len += u32::try_from(n * BLOCK_BYTES_U64).context("op size")?;
                    block += n;
                    continue;
                }
            }
            let n = op_blocks.min(end - block);
            ops.push(BareOp {
                file,
                offset: DATA_OFFSET + block * BLOCK_BYTES_U64,
                len: u32::try_from(n * BLOCK_BYTES_U64).context("op size")?,
            });
            block += n;
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_a_sample_and_nothing_has_none() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4, 1, 3, 2]), Some(3));
        assert_eq!(median::<f64>(&[]), None);
        let mut a = Xorshift::new(7);
        let mut b = Xorshift::new(7);
        let (mut x, mut y) = ([0u8; 13], [0u8; 13]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        assert_ne!(x, [0u8; 13]);
    }
}
