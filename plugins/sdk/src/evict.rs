//! Eviction policies: implement [`Evictor`] per object; [`Cache`] runs the batch protocol.
//!
//! The protocol is libCacheSim's: an access to a resident object is a hit; a miss evicts
//! victims until the object fits, then inserts it; an object larger than the cache is not
//! inserted. A policy only orders objects and picks victims; the cache keeps membership and
//! occupancy, so every policy agrees with the host on what is resident.

use crate::hash::KeyMap;

use crate::options::{Error, Options};

/// `next_use` of an access that will not recur (or whose future is unknown).
pub const NEVER: u64 = u64::MAX;

/// An eviction policy, driven one object at a time by a [`Cache`].
pub trait Evictor: Sized + 'static {
    /// The name snapshots carry; a snapshot with this name restores `state` too.
    const NAME: &'static str;

    /// A policy configured by `options` for a cache of `capacity` bytes.
    fn new(capacity: u64, options: &Options) -> Result<Self, Error>;

    /// `key` was missed and is now resident.
    fn insert(&mut self, key: u64, size: u32, next_use: u64);

    /// `key` is resident and was accessed again.
    fn hit(&mut self, key: u64, size: u32, next_use: u64);

    /// Picks a resident key to evict and forgets it; `None` only when nothing is resident.
    fn evict(&mut self) -> Option<u64>;

    /// The host removed `key` (it is resident); forget it.
    fn remove(&mut self, key: u64);

    /// Resident keys, next victim first (as far as the policy can tell cheaply).
    fn order(&self) -> Vec<u64>;

    /// Policy-specific state beyond the order, for a snapshot of the same policy.
    fn state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Rebuilds from a snapshot: `resident` in eviction order, and `state` when the snapshot
    /// came from this policy (`None` otherwise). The default re-inserts in order.
    fn restore(&mut self, resident: &[(u64, u32)], state: Option<&[u8]>) -> Result<(), Error> {
        let _ = state;
        for &(key, size) in resident {
            self.insert(key, size, NEVER);
        }
        Ok(())
    }
}

/// A cache: membership and occupancy, with a policy choosing victims.
pub struct Cache<P> {
    policy: P,
    capacity: u64,
    used: u64,
    resident: KeyMap<u32>,
}

impl<P: Evictor> Cache<P> {
    /// A cache of `capacity` bytes.
    pub fn new(capacity: u64, options: &Options) -> Result<Self, Error> {
        Ok(Self { policy: P::new(capacity, options)?, capacity, used: 0, resident: KeyMap::default() })
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Bytes resident.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Applies accesses in order; appends to `hits` and `evictions` (access index, key).
    pub fn access(
        &mut self,
        keys: &[u64],
        sizes: &[u32],
        next_uses: &[u64],
        hits: &mut Vec<bool>,
        evictions: &mut Vec<(u32, u64)>,
    ) -> Result<(), Error> {
        if keys.len() != sizes.len() || keys.len() != next_uses.len() || keys.len() > u32::MAX as usize {
            return Err(Error::InvalidInput(format!(
                "access lists of {} keys, {} sizes and {} next uses",
                keys.len(),
                sizes.len(),
                next_uses.len()
            )));
        }
        hits.reserve(keys.len());
        for (i, ((&key, &size), &next_use)) in keys.iter().zip(sizes).zip(next_uses).enumerate() {
            if self.resident.contains_key(key) {
                self.policy.hit(key, size, next_use);
                hits.push(true);
                continue;
            }
            hits.push(false);
            if u64::from(size) > self.capacity {
                continue;
            }
            while self.used + u64::from(size) > self.capacity {
                let victim = self.evict_one()?;
                evictions.push((i as u32, victim));
            }
            self.resident.insert(key, size);
            self.used += u64::from(size);
            self.policy.insert(key, size, next_use);
        }
        Ok(())
    }

    /// Evicts until at least `bytes` are freed or nothing is resident.
    pub fn evict_bytes(&mut self, bytes: u64) -> Result<Vec<u64>, Error> {
        let mut freed = 0;
        let mut victims = Vec::new();
        while freed < bytes && !self.resident.is_empty() {
            let before = self.used;
            victims.push(self.evict_one()?);
            freed += before - self.used;
        }
        Ok(victims)
    }

    /// Forgets keys the host removed; unknown keys are ignored.
    pub fn remove(&mut self, keys: &[u64]) {
        for key in keys {
            if let Some(size) = self.resident.remove(*key) {
                self.used -= u64::from(size);
                self.policy.remove(*key);
            }
        }
    }

    /// Resident objects in eviction order, and the policy's own state.
    pub fn snapshot(&self) -> (Vec<(u64, u32)>, Vec<u8>) {
        let order = self.policy.order();
        debug_assert_eq!(order.len(), self.resident.len());
        let resident = order.iter().map(|key| (*key, self.resident.get(*key).unwrap_or(0))).collect();
        (resident, self.policy.state())
    }

    /// Replaces the contents with a snapshot's (from this policy or another).
    pub fn restore(&mut self, policy: &str, resident: &[(u64, u32)], state: &[u8]) -> Result<(), Error> {
        let keys: Vec<u64> = self.resident.keys().collect();
        self.remove(&keys);
        let mut seen = KeyMap::default();
        let mut used = 0u64;
        for &(key, size) in resident {
            if seen.insert(key, size).is_some() {
                return Err(Error::InvalidInput(format!("snapshot lists key {key} twice")));
            }
            used += u64::from(size);
        }
        if used > self.capacity {
            return Err(Error::InvalidInput(format!("snapshot holds {used} bytes, the cache {}", self.capacity)));
        }
        self.policy.restore(resident, (policy == P::NAME).then_some(state))?;
        self.resident = seen;
        self.used = used;
        Ok(())
    }

    fn evict_one(&mut self) -> Result<u64, Error> {
        let victim = self
            .policy
            .evict()
            .ok_or_else(|| Error::InvalidInput(format!("{} found no victim in a non-empty cache", P::NAME)))?;
        let size = self
            .resident
            .remove(victim)
            .ok_or_else(|| Error::InvalidInput(format!("{} evicted key {victim}, which is not resident", P::NAME)))?;
        self.used -= u64::from(size);
        Ok(victim)
    }
}
