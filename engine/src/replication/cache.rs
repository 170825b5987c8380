//! The cache of shards a node fetched for its readers without being one of their placed nodes.
//!
//! Owns: which such shards are here and how many bytes they take, with the evictor plugin
//! choosing victims when they exceed the bound (accesses are fed to it in batches, one per read
//! batch). Sizes go to the plugin in 4 KiB blocks. Invariant: the cache only proposes victims;
//! the node deletes one only if another node that is up holds a copy (the last known copy of a
//! shard is never evicted). Never: touches files (the node does).

use std::collections::HashMap;

use crate::error::Result;
use crate::id::ShardId;
use crate::policy::{Evictor, PolicyHost, shard_key};
use crate::shard::BLOCK_BYTES_U64;

/// `next_use` of an access whose future is unknown.
const NEVER: u64 = u64::MAX;

/// Cached shards and their evictor.
pub(crate) struct ShardCache {
    /// `None` when the cache is unbounded.
    evictor: Option<Evictor>,
    entries: HashMap<u64, (ShardId, u64)>,
    used_bytes: u64,
}

impl ShardCache {
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

    /// Bytes of cached shards.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Whether shard `id` is one of the entries.
    #[cfg(feature = "origin")]
    pub(crate) fn holds(&self, id: ShardId) -> bool {
        self.entries.get(&shard_key(id.0.as_bytes())).is_some_and(|&(held, _)| held == id)
    }

    /// Cached shards.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// A shard of `bytes` was fetched for a read; returns the victims the evictor chose to make
    /// room for it (never the shard itself: the reader that fetched it is about to read it), and
    /// whether the shard is now a cache entry (one larger than the whole cache is not).
    pub(crate) fn admit(&mut self, id: ShardId, bytes: u64) -> Result<(Vec<(ShardId, u64)>, bool)> {
        self.admit_next(id, bytes, NEVER)
    }

    /// `admit`, with the step at which the shard is next used (`u64::MAX`: unknown), which the
    /// evictor gets as the access's `next-use`.
    pub(crate) fn admit_next(&mut self, id: ShardId, bytes: u64, next_use: u64) -> Result<(Vec<(ShardId, u64)>, bool)> {
        let key = shard_key(id.0.as_bytes());
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
        Ok((victims, resident))
    }

    /// Shards were read: the cached ones count as accesses; returns the victims (none, unless
    /// the plugin changed its mind about what fits).
    pub(crate) fn touch(&mut self, shards: &[ShardId]) -> Result<Vec<(ShardId, u64)>> {
        self.touch_next(shards, &mut |_| NEVER)
    }

    /// `touch`, with each shard's next use (`u64::MAX`: unknown) for the evictor.
    pub(crate) fn touch_next(
        &mut self,
        shards: &[ShardId],
        next_use: &mut dyn FnMut(ShardId) -> u64,
    ) -> Result<Vec<(ShardId, u64)>> {
        let Some(evictor) = &mut self.evictor else { return Ok(Vec::new()) };
        let (mut keys, mut sizes, mut next_uses) = (Vec::new(), Vec::new(), Vec::new());
        for shard in shards {
            let key = shard_key(shard.0.as_bytes());
            if let Some(&(_, bytes)) = self.entries.get(&key) {
                keys.push(key);
                sizes.push(u32::try_from(bytes.div_ceil(BLOCK_BYTES_U64)).unwrap_or(u32::MAX));
                next_uses.push(next_use(*shard));
            }
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let outcome = evictor.access(&keys, &sizes, &next_uses)?;
        Ok(self.take_victims(outcome.evictions.iter().map(|&(_, key)| key)))
    }

    /// Stops counting shard `id` (quarantined, or now a placed copy).
    pub(crate) fn forget(&mut self, id: ShardId) {
        let key = shard_key(id.0.as_bytes());
        if self.entries.get(&key).is_some_and(|&(held, _)| held == id) {
            self.take_victims(std::iter::once(key));
            if let Some(evictor) = &mut self.evictor {
                // The plugin forgets it too; a failure here only leaves it a victim later.
                let _ = evictor.remove(&[key]);
            }
        }
    }

    fn take_victims(&mut self, keys: impl Iterator<Item = u64>) -> Vec<(ShardId, u64)> {
        let mut victims = Vec::new();
        for key in keys {
            if let Some((id, bytes)) = self.entries.remove(&key) {
                self.used_bytes -= bytes;
                victims.push((id, bytes));
            }
        }
        victims
    }
}
