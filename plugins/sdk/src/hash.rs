//! Deterministic hashing and shuffling helpers shared by policies.

/// A hash map from `u64` keys to small `Copy` values: open addressing with linear probing and
/// backward-shift deletion, at most half full, keys placed by Fibonacci hashing.
///
/// Policies look a key up on every access, so this table is on the hot path of every plugin.
/// std's `HashMap` probes groups of 16 control bytes with SSE2 natively but has no SIMD path in
/// wasm32, where it runs several times slower than natively; this table is plain scalar code
/// that compiles to nearly the same instructions on both sides. Its iteration order depends only
/// on the operations applied, so policies built on it stay deterministic.
#[derive(Clone, Debug)]
pub struct KeyMap<V> {
    /// `(key, value)`; a slot holding [`VACANT`] is empty.
    slots: Vec<(u64, V)>,
    /// Occupied slots (the entry of key [`VACANT`] is kept apart, in `vacant_key`).
    len: usize,
    /// `64 - log2(slots.len())`: a key's home slot is the top bits of its Fibonacci hash.
    shift: u32,
    /// The value of the one key that cannot live in `slots`.
    vacant_key: Option<V>,
}

/// The key that marks an empty slot.
const VACANT: u64 = u64::MAX;

/// The smallest table allocated.
const MIN_SLOTS: usize = 16;

impl<V: Copy + Default> Default for KeyMap<V> {
    fn default() -> Self {
        Self { slots: Vec::new(), len: 0, shift: 64, vacant_key: None }
    }
}

impl<V: Copy + Default> KeyMap<V> {
    /// Keys in the map.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.vacant_key.is_some())
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is in the map.
    pub fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Option<V> {
        if key == VACANT {
            return self.vacant_key;
        }
        self.find(key).map(|at| self.slots[at].1)
    }

    /// The value of `key`, mutably.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == VACANT {
            return self.vacant_key.as_mut();
        }
        let at = self.find(key)?;
        Some(&mut self.slots[at].1)
    }

    /// Sets the value of `key`; returns the value it replaced.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == VACANT {
            return self.vacant_key.replace(value);
        }
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            let slot = &mut self.slots[at];
            if slot.0 == key {
                return Some(std::mem::replace(&mut slot.1, value));
            }
            if slot.0 == VACANT {
                *slot = (key, value);
                self.len += 1;
                return None;
            }
            at = (at + 1) & mask;
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == VACANT {
            return self.vacant_key.take();
        }
        let mut hole = self.find(key)?;
        let value = self.slots[hole].1;
        let mask = self.slots.len() - 1;
        // Backward shift: pull later keys of the same probe run into the hole, so a lookup
        // never stops early at a slot that was emptied.
        let mut at = (hole + 1) & mask;
        loop {
            let next = self.slots[at].0;
            if next == VACANT {
                break;
            }
            let home = self.home(next);
            if (at.wrapping_sub(home) & mask) >= (at.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[at];
                hole = at;
            }
            at = (at + 1) & mask;
        }
        self.slots[hole] = (VACANT, V::default());
        self.len -= 1;
        Some(value)
    }

    /// The keys, in an order that depends only on the operations applied.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(key, _)| key)
    }

    /// The entries, in the order of [`KeyMap::keys`].
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let stored = self.slots.iter().copied().filter(|&(key, _)| key != VACANT);
        stored.chain(self.vacant_key.map(|value| (VACANT, value)))
    }

    fn home(&self, key: u64) -> usize {
        // `shift` is below 64 whenever there are slots.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            let stored = self.slots[at].0;
            if stored == key {
                return Some(at);
            }
            if stored == VACANT {
                return None;
            }
            at = (at + 1) & mask;
        }
    }

    fn grow(&mut self) {
        let slots = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![(VACANT, V::default()); slots]);
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        for (key, value) in old {
            if key != VACANT {
                self.insert(key, value);
            }
        }
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Random inserts, removes and lookups over a small key space (so probe runs collide,
    /// wrap around the table and are shifted back on removal), checked against std's map.
    #[test]
    fn key_map_agrees_with_std_under_random_operations() {
        for seed in 0..64u64 {
            let mut map = KeyMap::<u32>::default();
            let mut model = HashMap::new();
            let mut state = mix(seed);
            // Keys crowd a few home slots: small integers, their multiples of the table size,
            // and the key that marks a vacant slot.
            let keys: Vec<u64> = (0..40).map(|i| i * 16).chain([1, 2, 3, VACANT, VACANT - 1]).collect();
            for step in 0..4000u32 {
                state = mix(state);
                let key = keys[(state % keys.len() as u64) as usize];
                match (state >> 32) % 5 {
                    0 | 1 => assert_eq!(map.insert(key, step), model.insert(key, step), "insert {key}"),
                    2 | 3 => assert_eq!(map.remove(key), model.remove(&key), "remove {key}"),
                    _ => {
                        if let Some(value) = map.get_mut(key) {
                            *value += 1;
                        }
                        if let Some(value) = model.get_mut(&key) {
                            *value += 1;
                        }
                    }
                }
                assert_eq!(map.len(), model.len());
                for &probe in &keys {
                    assert_eq!(map.get(probe), model.get(&probe).copied(), "seed {seed} step {step} key {probe}");
                }
            }
            let mut listed: Vec<(u64, u32)> = map.iter().collect();
            listed.sort_unstable();
            let mut expected: Vec<(u64, u32)> = model.into_iter().collect();
            expected.sort_unstable();
            assert_eq!(listed, expected);
        }
    }

    #[test]
    fn key_map_grows_past_many_keys_and_empties() {
        let mut map = KeyMap::<u64>::default();
        for key in 0..100_000u64 {
            assert_eq!(map.insert(mix(key), key), None);
        }
        assert_eq!(map.len(), 100_000);
        for key in 0..100_000u64 {
            assert_eq!(map.remove(mix(key)), Some(key));
        }
        assert!(map.is_empty());
        assert_eq!(map.keys().count(), 0);
    }
}
