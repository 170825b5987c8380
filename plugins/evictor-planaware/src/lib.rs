//! Plan-aware eviction: evicts the resident object whose next use is furthest away. With next
//! uses taken from the epoch plan (which is known in advance) this is Belady's MIN, the optimal
//! policy for objects of one size; for shuffled epochs, where LRU is close to the worst case, it
//! is the miss ratio to beat. Objects with no known next use go first.

use std::collections::BTreeSet;

use granary_policy_sdk::hash::KeyMap;

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::{Error, Options};

/// Resident objects ordered by next use.
pub struct PlanAware {
    by_next_use: BTreeSet<(u64, u64)>,
    next_use: KeyMap<u64>,
}

impl PlanAware {
    fn set(&mut self, key: u64, next_use: u64) {
        if let Some(old) = self.next_use.insert(key, next_use) {
            self.by_next_use.remove(&(old, key));
        }
        self.by_next_use.insert((next_use, key));
    }
}

impl Evictor for PlanAware {
    const NAME: &'static str = "plan-aware";

    fn new(_capacity: u64, options: &Options) -> Result<Self, Error> {
        options.allow_only(&[])?;
        Ok(Self { by_next_use: BTreeSet::new(), next_use: KeyMap::default() })
    }

    fn insert(&mut self, key: u64, _size: u32, next_use: u64) {
        self.set(key, next_use);
    }

    fn hit(&mut self, key: u64, _size: u32, next_use: u64) {
        self.set(key, next_use);
    }

    fn evict(&mut self) -> Option<u64> {
        let (_, key) = self.by_next_use.pop_last()?;
        self.next_use.remove(key);
        Some(key)
    }

    fn remove(&mut self, key: u64) {
        if let Some(next_use) = self.next_use.remove(key) {
            self.by_next_use.remove(&(next_use, key));
        }
    }

    fn order(&self) -> Vec<u64> {
        self.by_next_use.iter().rev().map(|&(_, key)| key).collect()
    }

    fn state(&self) -> Vec<u8> {
        self.by_next_use.iter().rev().flat_map(|&(next_use, _)| next_use.to_le_bytes()).collect()
    }

    fn restore(&mut self, resident: &[(u64, u32)], state: Option<&[u8]>) -> Result<(), Error> {
        let next_uses: Vec<u64> = match state {
            Some(state) if state.len() == resident.len() * 8 => {
                state.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
            }
            Some(_) => return Err(Error::InvalidInput("plan-aware state does not match its resident list".into())),
            None => vec![u64::MAX; resident.len()],
        };
        for (&(key, _), next_use) in resident.iter().zip(next_uses) {
            self.set(key, next_use);
        }
        Ok(())
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(PlanAware);
