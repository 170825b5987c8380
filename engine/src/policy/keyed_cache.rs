//! The entries of a bounded cache whose victims an evictor plugin chooses: the node's cache of
//! shards it fetched for its readers, the origin cache's shards on disk and the memory tier's
//! extents.
//!
//! Owns: which entries are held and how many bytes they take, and the evictor fed with their
//! accesses (in batches, sizes in 4 KiB blocks, each with its next use when the plan knows it).
//! Invariant: the cache only proposes victims; its owner decides whether to delete one (the
//! node keeps the last known copy of a shard, the origin cache and the tier keep what the plan
//! needs sooner) and tells it what it removed or found. Never: touches files or memory (its
//! owner does).

use std::collections::HashMap;

use super::{Evictor, PolicyHost, shard_key};
use crate::error::Result;
use crate::id::ShardId;
use crate::shard::BLOCK_BYTES_U64;

/// `next_use` of an access whose future is unknown.
const NEVER: u64 = u64::MAX;

/// What a cache holds, by the 64-bit key the evictor plugin sees.
pub(crate) trait CacheKey: Copy + Eq {
    /// The key: equal entries have equal keys; distinct ones almost never do (a clash makes one
    /// shadow the other in the evictor, never a wrong deletion: the owner checks the entry).
    fn cache_key(&self) -> u64;
}

impl CacheKey for ShardId {
    fn cache_key(&self) -> u64 {
        shard_key(self.0.as_bytes())
    }
}

/// A cache of shards.
#[cfg(feature = "replication")]
pub(crate) type ShardCache = KeyedCache<ShardId>;

/// Held entries and their evictor.
pub(crate) struct KeyedCache<Id: CacheKey> {
    /// `None` when the cache is unbounded.
    evictor: Option<Evictor>,
    entries: HashMap<u64, (Id, u64)>,
    used_bytes: u64,
}

impl<Id: CacheKey> KeyedCache<Id> {
    /// A cache of at most `capacity_bytes` (0: unbounded, no evictor) run by the evictor plugin
    /// `evictor` (the built-in default when `None`) with `options`.
    pub(crate) fn new(
        host: &PolicyHost,
        evictor: Option<&str>,
        options: &[(String, String)],
        capacity_bytes: u64,
    ) -> Result<Self> {
        let evictor = if capacity_bytes == 0 {
            None
        } else {
            Some(host.evictor(evictor, options, (capacity_bytes / BLOCK_BYTES_U64).max(1))?)
        };
        Ok(Self { evictor, entries: HashMap::new(), used_bytes: 0 })
    }

    /// Bytes of held entries.
    #[cfg_attr(not(feature = "replication"), allow(dead_code, reason = "the node's calls"))]
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Whether `id` is one of the entries.
    pub(crate) fn holds(&self, id: Id) -> bool {
        self.entries.get(&id.cache_key()).is_some_and(|&(held, _)| held == id)
    }

    /// The bytes entry `id` was admitted with.
    pub(crate) fn bytes_of(&self, id: Id) -> Option<u64> {
        self.entries.get(&id.cache_key()).filter(|&&(held, _)| held == id).map(|&(_, bytes)| bytes)
    }

    /// The entries.
    pub(crate) fn held(&self) -> Vec<Id> {
        self.entries.values().map(|&(id, _)| id).collect()
    }

    /// Held entries.
    #[cfg_attr(not(feature = "replication"), allow(dead_code, reason = "the node's calls"))]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// An entry of `bytes` was loaded for a read; returns the victims the evictor chose to make
    /// room for it (never the entry itself: the reader that loaded it is about to read it), and
    /// whether it is now an entry (one larger than the whole cache is not).
    #[cfg_attr(not(feature = "replication"), allow(dead_code, reason = "the node's calls"))]
    pub(crate) fn admit(&mut self, id: Id, bytes: u64) -> Result<(Vec<(Id, u64)>, bool)> {
        self.admit_next(id, bytes, NEVER)
    }

    /// `admit`, with the step at which the entry is next used (`u64::MAX`: unknown), which the
    /// evictor gets as the access's `next-use`.
    pub(crate) fn admit_next(&mut self, id: Id, bytes: u64, next_use: u64) -> Result<(Vec<(Id, u64)>, bool)> {
        let key = id.cache_key();
        let Some(evictor) = &mut self.evictor else {
            if self.entries.insert(key, (id, bytes)).is_none() {
                self.used_bytes += bytes;
            }
            return Ok((Vec::new(), true));
        };
        let blocks = u32::try_from(bytes.div_ceil(BLOCK_BYTES_U64)).unwrap_or(u32::MAX);
        let outcome = evictor.access(&[key], &[blocks], &[next_use])?;
        let resident = evictor.contains(key);
        let victims = self.take_victims(outcome.evictions.iter().map(|&(_, key)| key).filter(|&k| k != key));
        if resident && self.entries.insert(key, (id, bytes)).is_none() {
            self.used_bytes += bytes;
        }
        self.check();
        Ok((victims, resident))
    }

    /// Entries were read: the held ones count as accesses; returns the victims (none, unless
    /// the plugin changed its mind about what fits).
    #[cfg_attr(not(feature = "replication"), allow(dead_code, reason = "the node's calls"))]
    pub(crate) fn touch(&mut self, ids: &[Id]) -> Result<Vec<(Id, u64)>> {
        self.touch_next(ids, &mut |_| NEVER)
    }

    /// `touch`, with each entry's next use (`u64::MAX`: unknown) for the evictor.
    pub(crate) fn touch_next(&mut self, ids: &[Id], next_use: &mut dyn FnMut(Id) -> u64) -> Result<Vec<(Id, u64)>> {
        let Some(evictor) = &mut self.evictor else { return Ok(Vec::new()) };
        let (mut keys, mut sizes, mut next_uses) = (Vec::new(), Vec::new(), Vec::new());
        for id in ids {
            let key = id.cache_key();
            if let Some(&(_, bytes)) = self.entries.get(&key) {
                keys.push(key);
                sizes.push(u32::try_from(bytes.div_ceil(BLOCK_BYTES_U64)).unwrap_or(u32::MAX));
                next_uses.push(next_use(*id));
            }
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let outcome = evictor.access(&keys, &sizes, &next_uses)?;
        Ok(self.take_victims(outcome.evictions.iter().map(|&(_, key)| key)))
    }

    /// Stops counting entry `id` (removed by its owner, or no longer the cache's).
    pub(crate) fn forget(&mut self, id: Id) {
        let key = id.cache_key();
        if self.entries.get(&key).is_some_and(|&(held, _)| held == id) {
            self.take_victims(std::iter::once(key));
            if let Some(evictor) = &mut self.evictor {
                // The plugin forgets it too; a failure here only leaves it a victim later.
                let _ = evictor.remove(&[key]);
            }
        }
    }

    fn take_victims(&mut self, keys: impl Iterator<Item = u64>) -> Vec<(Id, u64)> {
        let mut victims = Vec::new();
        for key in keys {
            if let Some((id, bytes)) = self.entries.remove(&key) {
                self.used_bytes -= bytes;
                victims.push((id, bytes));
            }
        }
        self.check();
        victims
    }

    /// The count of bytes held is the entries' (what the caller's budget is measured by).
    fn check(&self) {
        debug_assert_eq!(self.used_bytes, self.entries.values().map(|&(_, bytes)| bytes).sum::<u64>());
    }
}
