//! SIEVE (Zhang et al., NSDI '24), as libCacheSim's `Sieve` implements it: new objects enter at
//! the head unvisited; a hit marks an object visited; the hand walks from the tail towards the
//! head, clearing visited marks, and evicts the first unvisited object, then rests just newer
//! than it (wrapping to the tail).

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::list::KeyList;
use granary_policy_sdk::{Error, Options};

/// The queue (value: visited) and the hand.
pub struct Sieve {
    queue: KeyList<bool>,
    /// The key the hand rests on; `None` means the tail.
    hand: Option<u64>,
}

impl Evictor for Sieve {
    const NAME: &'static str = "sieve";

    fn new(_capacity: u64, options: &Options) -> Result<Self, Error> {
        options.allow_only(&[])?;
        Ok(Self { queue: KeyList::default(), hand: None })
    }

    fn insert(&mut self, key: u64, _size: u32, _next_use: u64) {
        self.queue.push_head(key, false);
    }

    fn hit(&mut self, key: u64, _size: u32, _next_use: u64) {
        if let Some(visited) = self.queue.get_mut(key) {
            *visited = true;
        }
    }

    fn evict(&mut self) -> Option<u64> {
        let mut at = self.hand.and_then(|key| self.queue.cursor(key)).or_else(|| self.queue.tail())?;
        loop {
            let (key, visited) = self.queue.at(at);
            if !visited {
                self.hand = self.queue.newer(at).map(|newer| self.queue.at(newer).0);
                self.queue.remove(key);
                return Some(key);
            }
            *self.queue.value_at(at) = false;
            at = self.queue.newer(at).or_else(|| self.queue.tail())?;
        }
    }

    fn remove(&mut self, key: u64) {
        if self.hand == Some(key) {
            self.hand = self.queue.cursor(key).and_then(|at| self.queue.newer(at)).map(|at| self.queue.at(at).0);
        }
        self.queue.remove(key);
    }

    fn order(&self) -> Vec<u64> {
        self.queue.keys_oldest_first()
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(Sieve);
