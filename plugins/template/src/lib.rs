//! A template evictor: MRU (evict the most recently used object), which beats LRU on loops that
//! are a little larger than the cache. Copy this crate to write your own policy: implement
//! `Evictor` (per object; the SDK runs the batch protocol and keeps membership) and export it.

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::list::KeyList;
use granary_policy_sdk::{Error, Options};

/// Recency order: head is the most recent, and the next victim.
pub struct Mru {
    queue: KeyList<()>,
}

impl Evictor for Mru {
    /// Snapshots carry this name; keep it unique.
    const NAME: &'static str = "mru";

    fn new(_capacity: u64, options: &Options) -> Result<Self, Error> {
        // Refuse options you do not know: a typo should be an error, not a silent default.
        options.allow_only(&[])?;
        Ok(Self { queue: KeyList::default() })
    }

    fn insert(&mut self, key: u64, _size: u32, _next_use: u64) {
        self.queue.push_head(key, ());
    }

    fn hit(&mut self, key: u64, _size: u32, _next_use: u64) {
        self.queue.move_to_head(key);
    }

    fn evict(&mut self) -> Option<u64> {
        let (key, ()) = self.queue.at(self.queue.head()?);
        self.queue.remove(key);
        Some(key)
    }

    fn remove(&mut self, key: u64) {
        self.queue.remove(key);
    }

    fn order(&self) -> Vec<u64> {
        let mut order = self.queue.keys_oldest_first();
        order.reverse();
        order
    }

    /// A snapshot lists the next victim first, here the most recent object: rebuild from the
    /// other end, or a restored instance would evict in the opposite order (`plugin check`
    /// compares a restored instance's decisions with the original's). The SDK's default
    /// re-inserts in the listed order, which is right for policies whose victim is the oldest.
    fn restore(&mut self, resident: &[(u64, u32)], _state: Option<&[u8]>) -> Result<(), Error> {
        for &(key, _) in resident.iter().rev() {
            self.queue.push_head(key, ());
        }
        Ok(())
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(Mru);

#[cfg(test)]
mod tests {
    use granary_policy_sdk::Options;
    use granary_policy_sdk::evict::{Cache, NEVER};

    use super::Mru;

    #[test]
    fn mru_keeps_the_old_part_of_a_loop() {
        let mut cache = Cache::<Mru>::new(3, &Options::default()).unwrap();
        let keys = [1, 2, 3, 4, 1, 2, 3, 4];
        let (mut hits, mut evictions) = (Vec::new(), Vec::new());
        cache.access(&keys, &[1; 8], &[NEVER; 8], &mut hits, &mut evictions).unwrap();
        assert_eq!(hits, [false, false, false, false, true, true, false, true]);
    }
}
