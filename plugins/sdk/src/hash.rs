//! Deterministic hashing and shuffling helpers shared by policies.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A hash map keyed by `u64` with a fast, deterministic hash (policies must be deterministic,
/// and SipHash costs more than the policy's own work on small keys).
pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// A set of `u64` keys with the same hash.
pub type KeySet = HashSet<u64, BuildHasherDefault<KeyHasher>>;

/// Hashes a `u64` with one multiply and a fold (Fibonacci hashing).
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, key: u64) {
        let h = (self.0 ^ key).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }
}

/// The splitmix64 finalizer: a fast, well-mixing bijection of u64.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The first 8 bytes of a content id, little-endian: the key the host uses for placement.
pub fn key_of(id: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    let n = id.len().min(8);
    word[..n].copy_from_slice(&id[..n]);
    u64::from_le_bytes(word)
}

/// Weighted rendezvous (highest random weight) score of `item` on `bucket` with `weight`:
/// each item goes to the bucket of highest score. Adding or removing a bucket moves only the
/// items whose top choice it is (about weight / total of them), and shares follow the weights.
pub fn rendezvous_score(item: u64, bucket: u64, weight: u32) -> f64 {
    if weight == 0 {
        return f64::NEG_INFINITY;
    }
    let hash = mix(item ^ mix(bucket.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    // A uniform draw in (0, 1), never 0 or 1.
    let unit = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -f64::from(weight) / unit.ln()
}

/// A keyed pseudo-random permutation of `0..n` (a balanced Feistel network over the smallest
/// even-bit domain covering `n`, cycle-walked back into range).
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 6],
}

impl Permutation {
    /// The permutation of `0..n` for `seed`.
    pub fn new(n: u64, seed: u64) -> Self {
        let bits = (u64::BITS - n.saturating_sub(1).leading_zeros()).max(2);
        let mut state = mix(seed ^ 0x5851_f42d_4c95_7f2d);
        let keys = std::array::from_fn(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix(state)
        });
        Self { n, half_bits: bits.div_ceil(2), keys }
    }

    /// The image of `i < n`.
    pub fn apply(&self, i: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let mut x = i;
        loop {
            let (mut left, mut right) = (x >> self.half_bits, x & mask);
            for key in self.keys {
                (left, right) = (right, left ^ (mix(right ^ key) & mask));
            }
            x = (left << self.half_bits) | right;
            if x < self.n {
                return x;
            }
        }
    }
}
