//! What the benchmarks share: the median of a run's samples, and the generator of their
//! incompressible test bytes.
//!
//! Owns `median` and `Xorshift`. Never: times anything or prints (each benchmark does), or
//! serves where randomness must be unpredictable (the generator is for test data only).

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
