//! LRU: evicts the least recently accessed object (libCacheSim's `LRU`, exactly).

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::list::KeyList;
use granary_policy_sdk::{Error, Options};

/// Recency order: head is the most recent; each key with its size (the cache keeps no table of
/// its own: `KEEPS_RESIDENTS`).
pub struct Lru {
    queue: KeyList<u32>,
}

impl Evictor for Lru {
    const NAME: &'static str = "lru";

    fn new(_capacity: u64, options: &Options) -> Result<Self, Error> {
        options.allow_only(&[])?;
        Ok(Self { queue: KeyList::default() })
    }

    const KEEPS_RESIDENTS: bool = true;

    fn insert(&mut self, key: u64, size: u32, _next_use: u64) {
        self.queue.push_head(key, size);
    }

    fn hit(&mut self, key: u64, _size: u32, _next_use: u64) {
        self.queue.move_to_head(key);
    }

    fn hit_if_resident(&mut self, key: u64, _size: u32, _next_use: u64) -> bool {
        self.queue.touch(key).is_some()
    }

    fn resident(&self, key: u64) -> Option<u32> {
        self.queue.get(key)
    }

    fn evict(&mut self) -> Option<u64> {
        self.queue.pop_tail().map(|(key, _)| key)
    }

    fn evict_sized(&mut self) -> Option<(u64, u32)> {
        self.queue.pop_tail()
    }

    fn remove(&mut self, key: u64) {
        self.queue.remove(key);
    }

    fn order(&self) -> Vec<u64> {
        self.queue.keys_oldest_first()
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(Lru);
