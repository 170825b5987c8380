//! SIEVE (Zhang et al., NSDI '24), as libCacheSim's `Sieve` implements it: new objects enter at
//! the head unvisited; a hit marks an object visited; the hand walks from the tail towards the
//! head, clearing visited marks, and evicts the first unvisited object, then rests just newer
//! than it (wrapping to the tail).

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::list::KeyList;
use granary_policy_sdk::{Error, Options};

/// The queue (value: visited, size) and the hand. The cache keeps no table of its own
/// (`KEEPS_RESIDENTS`).
pub struct Sieve {
    queue: KeyList<(bool, u32)>,
    /// The key the hand rests on; `None` means the tail.
    hand: Option<u64>,
}

impl Evictor for Sieve {
    const NAME: &'static str = "sieve";

    fn new(_capacity: u64, options: &Options) -> Result<Self, Error> {
        options.allow_only(&[])?;
        Ok(Self { queue: KeyList::default(), hand: None })
    }

    const KEEPS_RESIDENTS: bool = true;

    fn insert(&mut self, key: u64, size: u32, _next_use: u64) {
        self.queue.push_head(key, (false, size));
    }

    fn hit(&mut self, key: u64, size: u32, next_use: u64) {
        self.hit_if_resident(key, size, next_use);
    }

    fn hit_if_resident(&mut self, key: u64, _size: u32, _next_use: u64) -> bool {
        match self.queue.get_mut(key) {
            Some((visited, _)) => {
                *visited = true;
                true
            }
            None => false,
        }
    }

    fn resident(&self, key: u64) -> Option<u32> {
        self.queue.get(key).map(|(_, size)| size)
    }

    fn evict(&mut self) -> Option<u64> {
        self.evict_sized().map(|(key, _)| key)
    }

    fn evict_sized(&mut self) -> Option<(u64, u32)> {
        let mut at = self.hand.and_then(|key| self.queue.cursor(key)).or_else(|| self.queue.tail())?;
        loop {
            let (key, (visited, size)) = self.queue.at(at);
            if !visited {
                self.hand = self.queue.newer(at).map(|newer| self.queue.at(newer).0);
                self.queue.remove(key);
                return Some((key, size));
            }
            self.queue.value_at(at).0 = false;
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

    /// The hand (a flag byte, then its key) and each resident object's visited mark, in
    /// `order`'s order: with them a restored SIEVE decides as this one would.
    fn state(&self) -> Vec<u8> {
        let mut state = Vec::with_capacity(9 + self.queue.len());
        state.push(u8::from(self.hand.is_some()));
        state.extend_from_slice(&self.hand.unwrap_or(0).to_le_bytes());
        let mut at = self.queue.tail();
        while let Some(cursor) = at {
            state.push(u8::from(self.queue.at(cursor).1.0));
            at = self.queue.newer(cursor);
        }
        state
    }

    fn restore(&mut self, resident: &[(u64, u32)], state: Option<&[u8]>) -> Result<(), Error> {
        let Some(state) = state else {
            for &(key, size) in resident {
                self.queue.push_head(key, (false, size));
            }
            return Ok(());
        };
        if state.len() != 9 + resident.len() || state[0] > 1 {
            return Err(Error::InvalidInput(format!(
                "a SIEVE state of {} bytes for {} objects",
                state.len(),
                resident.len()
            )));
        }
        for (&(key, size), &visited) in resident.iter().zip(&state[9..]) {
            self.queue.push_head(key, (visited != 0, size));
        }
        let mut hand = [0u8; 8];
        hand.copy_from_slice(&state[1..9]);
        let hand = u64::from_le_bytes(hand);
        self.hand = (state[0] == 1 && self.queue.contains(hand)).then_some(hand);
        Ok(())
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(Sieve);
