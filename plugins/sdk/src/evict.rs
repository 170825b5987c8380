//! Eviction policies: implement [`Evictor`] per object; [`Cache`] runs the batch protocol.
//!
//! The protocol is libCacheSim's: an access to a resident object is a hit; a miss evicts
//! victims until the object fits, then inserts it; an object larger than the cache is not
//! inserted. A policy only orders objects and picks victims; the cache keeps membership and
//! occupancy, so every policy agrees with the host on what is resident.
//!
//! A policy whose own index already says which keys are resident (an LRU's list, a FIFO's queue)
//! can set [`Evictor::KEEPS_RESIDENTS`] and answer [`Evictor::hit_if_resident`],
//! [`Evictor::resident`] and [`Evictor::evict_sized`]: the cache then keeps no table of its own,
//! so a hit is one lookup and a miss one insert and one removal per victim, in one table (inside
//! the sandbox every table operation costs about twice what it does natively, and the cache's
//! table was half of them). Membership is then the policy's word: a policy that loses track
//! disagrees with the host, whose check of every outcome refuses the batch, and the cache
//! reports what it can tell is inconsistent (a victim when nothing is resident, more bytes
//! evicted than are resident) as an error.

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

    /// Resident keys, next victim first (as far as the policy can tell cheaply). With
    /// `KEEPS_RESIDENTS` it must list every resident key: a restore removes what it lists.
    fn order(&self) -> Vec<u64>;

    /// Whether the policy's index answers which keys are resident, and their sizes, so that the
    /// [`Cache`] keeps no table of its own. A policy that sets it implements
    /// [`hit_if_resident`](Self::hit_if_resident), [`resident`](Self::resident) and
    /// [`evict_sized`](Self::evict_sized); the cache then never calls [`hit`](Self::hit) or
    /// [`evict`](Self::evict).
    const KEEPS_RESIDENTS: bool = false;

    /// With `KEEPS_RESIDENTS`: if `key` is resident, records the hit and returns `true`. (The
    /// cache calls it only when `KEEPS_RESIDENTS` is set; a policy that sets it without this
    /// method stops at its first access, naming what is missing.)
    fn hit_if_resident(&mut self, key: u64, size: u32, next_use: u64) -> bool {
        let _ = (key, size, next_use);
        panic!("{} sets KEEPS_RESIDENTS but does not implement hit_if_resident", Self::NAME)
    }

    /// With `KEEPS_RESIDENTS`: the size of `key` if it is resident.
    fn resident(&self, key: u64) -> Option<u32> {
        let _ = key;
        panic!("{} sets KEEPS_RESIDENTS but does not implement resident", Self::NAME)
    }

    /// With `KEEPS_RESIDENTS`: picks a resident key to evict, forgets it and returns it with its
    /// size; `None` only when nothing is resident.
    fn evict_sized(&mut self) -> Option<(u64, u32)> {
        panic!("{} sets KEEPS_RESIDENTS but does not implement evict_sized", Self::NAME)
    }

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
    /// Resident keys and their sizes, unless the policy keeps them (`Evictor::KEEPS_RESIDENTS`).
    resident: KeyMap<u32>,
    /// Resident keys.
    count: usize,
}

impl<P: Evictor> Cache<P> {
    /// A cache of `capacity` bytes.
    pub fn new(capacity: u64, options: &Options) -> Result<Self, Error> {
        Ok(Self { policy: P::new(capacity, options)?, capacity, used: 0, resident: KeyMap::default(), count: 0 })
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
            if P::KEEPS_RESIDENTS {
                if self.policy.hit_if_resident(key, size, next_use) {
                    hits.push(true);
                    continue;
                }
            } else if self.resident.contains_key(key) {
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
            if !P::KEEPS_RESIDENTS {
                self.resident.insert(key, size);
            }
            self.count += 1;
            self.used += u64::from(size);
            self.policy.insert(key, size, next_use);
        }
        Ok(())
    }

    /// Evicts until at least `bytes` are freed or nothing is resident.
    pub fn evict_bytes(&mut self, bytes: u64) -> Result<Vec<u64>, Error> {
        let mut freed = 0;
        let mut victims = Vec::new();
        while freed < bytes && self.count > 0 {
            let before = self.used;
            victims.push(self.evict_one()?);
            freed += before - self.used;
        }
        Ok(victims)
    }

    /// Forgets keys the host removed; unknown keys are ignored.
    pub fn remove(&mut self, keys: &[u64]) {
        for &key in keys {
            let size = if P::KEEPS_RESIDENTS { self.policy.resident(key) } else { self.resident.remove(key) };
            if let Some(size) = size {
                // Saturating: with `KEEPS_RESIDENTS` the sizes are the policy's word, and a
                // policy that lost track is refused by the host's check, not by a panic here.
                self.used = self.used.saturating_sub(u64::from(size));
                self.count = self.count.saturating_sub(1);
                self.policy.remove(key);
            }
        }
    }

    /// Resident objects in eviction order, and the policy's own state.
    pub fn snapshot(&self) -> (Vec<(u64, u32)>, Vec<u8>) {
        let order = self.policy.order();
        debug_assert_eq!(order.len(), self.count);
        let size =
            |key: u64| if P::KEEPS_RESIDENTS { self.policy.resident(key) } else { self.resident.get(key) }.unwrap_or(0);
        let resident = order.iter().map(|&key| (key, size(key))).collect();
        (resident, self.policy.state())
    }

    /// Replaces the contents with a snapshot's (from this policy or another).
    pub fn restore(&mut self, policy: &str, resident: &[(u64, u32)], state: &[u8]) -> Result<(), Error> {
        let keys: Vec<u64> = if P::KEEPS_RESIDENTS { self.policy.order() } else { self.resident.keys().collect() };
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
        self.count = seen.len();
        self.resident = if P::KEEPS_RESIDENTS { KeyMap::default() } else { seen };
        self.used = used;
        Ok(())
    }

    fn evict_one(&mut self) -> Result<u64, Error> {
        if P::KEEPS_RESIDENTS {
            let (victim, size) = self
                .policy
                .evict_sized()
                .ok_or_else(|| Error::InvalidInput(format!("{} found no victim in a non-empty cache", P::NAME)))?;
            // The policy's word alone: a size it never admitted is its bug, reported, not trusted.
            let inconsistent = || {
                Error::InvalidInput(format!("{} evicted key {victim} of {size} bytes, more than is resident", P::NAME))
            };
            self.used = self.used.checked_sub(u64::from(size)).ok_or_else(inconsistent)?;
            self.count = self.count.checked_sub(1).ok_or_else(inconsistent)?;
            return Ok(victim);
        }
        let victim = self
            .policy
            .evict()
            .ok_or_else(|| Error::InvalidInput(format!("{} found no victim in a non-empty cache", P::NAME)))?;
        let size = self
            .resident
            .remove(victim)
            .ok_or_else(|| Error::InvalidInput(format!("{} evicted key {victim}, which is not resident", P::NAME)))?;
        self.used -= u64::from(size);
        self.count -= 1;
        Ok(victim)
    }
}
