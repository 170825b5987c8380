//! A reader's shard: read-time repair and the read cache.
//!
//! A reader that found a shard damaged or missing asks the node (`ShardSource`, or a `Repair`
//! frame): a damaged local copy is quarantined, then a verified copy is pulled from a peer that
//! lists it, or, for a coded shard no node that is up holds whole, rebuilt from `k` of its
//! fragments (`coded/`). A shard fetched for a read and not placed here by the replicator is
//! a cache entry: the evictor plugin (`ShardCache`) proposes victims as readers touch shards,
//! and a victim is deleted only when a node that is up holds a copy that is not itself a cache
//! entry, or the shard is coded (and no goal wants it copied) with more than `k` fragments up.
//!
//! Owns the read cache's entries and evictions, and quarantine. Never: evicts what may be the
//! last copy, or a copy the replicator places here; never takes a shard of an attached dataset
//! into this node's cache (the store's origin cache owns those).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::frame::WireKind;
use super::pull;
use super::shared::{Pulled, Shared};
use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};

impl Shared {
    /// Quarantines this node's damaged copy; the reconciler brings a good one back when the
    /// shard belongs here.
    pub(crate) async fn quarantine_and_heal(self: &Arc<Self>, kind: WireKind, id: ObjectId) {
        self.cache.lock().forget(ShardId(id));
        let shared = Arc::clone(self);
        let moved = tokio::task::spawn_blocking(move || shared.local.quarantine(kind, id)).await;
        match moved {
            Ok(Ok(Some(path))) => self.event(format!("quarantined {} to {}", id.short(12), path.display())),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => self.event(format!("could not quarantine {}: {e}", id.short(12))),
            Err(e) => self.event(format!("could not quarantine {}: {e}", id.short(12))),
        }
        self.wake.notify_one();
    }

    /// Read-time repair: a reader found shard `id` damaged or missing. Checks the local copy;
    /// when it is damaged, quarantines it; then pulls a verified copy from a peer.
    pub(crate) async fn repair_shard(self: &Arc<Self>, id: ShardId) -> Result<String> {
        let kind = WireKind::Shard;
        let was_here = self.local.holds(kind, id.0).is_some();
        let was_cached = self.local.is_cached(id.0);
        if was_here {
            let path = self.local.object_path(kind, id.0);
            let checked = tokio::task::spawn_blocking(move || crate::engine::verify_shard(&path, id))
                .await
                .map_err(|e| Error::invalid_input(format!("verification failed to run: {e}")))?;
            match checked {
                Ok(_) => return Ok(format!("shard {id} is intact here")),
                Err(e) if e.is_corruption() => {
                    self.stats.verify_failures.fetch_add(1, Ordering::Relaxed);
                    self.event(format!("read found shard {} damaged: {e}", id.0.short(12)));
                    self.quarantine_and_heal(kind, id.0).await;
                }
                // Listed but gone (removed by another process): no longer listed.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    self.local.note_missing(kind, id.0);
                }
                Err(e) => return Err(e),
            }
        }
        // A shard of an attached dataset is the store's origin cache's (which asks here before
        // its origin): taken from a peer that lists it now, else refused at once, so the
        // origin is asked instead; this node's cache never takes it.
        let origin_cached = {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || {
                shared.local.is_origin_cached(id.0, false) || shared.local.is_origin_cached(id.0, true)
            })
            .await
            .unwrap_or(false)
        };
        // A shard fetched for a read and not placed here is a cache entry; peers must see it
        // flagged as such from the moment it is listed (they count on copies that are not).
        let as_cache = !origin_cached && (was_cached || !was_here) && !self.is_placed_here(id).await;
        if as_cache {
            self.local.set_cached(id.0, true);
        }
        // A coded shard that no node that is up holds whole is rebuilt from its fragments.
        let coded = if origin_cached || !self.peers.holders(kind, id.0).is_empty() { None } else { self.coding_of(id) };
        let pulled = match coded {
            Some((coding, bytes)) => self.rebuild_for_read(id, bytes, coding).await,
            None => match self.pull_for_read(id, !origin_cached).await {
                // The whole copy listed could not be had (evicted meanwhile, or damaged): a coded
                // shard is rebuilt from its fragments instead.
                Err(e) if !origin_cached => match self.coding_of(id) {
                    Some((coding, bytes)) => self.rebuild_for_read(id, bytes, coding).await,
                    None => Err(e),
                },
                other => other,
            },
        };
        let pulled = match pulled {
            Ok(pulled) => pulled,
            Err(e) => {
                if as_cache {
                    self.local.set_cached(id.0, false);
                    self.cache.lock().forget(id);
                }
                return Err(e);
            }
        };
        self.stats.repairs.fetch_add(1, Ordering::Relaxed);
        let message = match pulled {
            Pulled::AlreadyHeld | Pulled::Joined => format!("shard {id} is here"),
            Pulled::Published { bytes } => format!("shard {id} replaced with a verified copy ({bytes} bytes)"),
        };
        self.event(message.clone());
        if as_cache {
            let bytes = self.local.holds(kind, id.0).unwrap_or(0);
            let (victims, cached) = {
                let mut cache = self.cache.lock();
                cache.admit(id, bytes)?
            };
            if !cached {
                self.local.set_cached(id.0, false);
                self.event(format!("shard {} is larger than the whole cache: kept outside it", id.0.short(12)));
            }
            self.evict(victims).await;
        }
        self.wake.notify_one();
        Ok(message)
    }

    /// Pulls shard `id` for a reader: its length from a manifest here when there is one (a
    /// peer's inventory is only a hint), from whichever peer lists it, waiting a little for
    /// one to be up (right after a start, no heartbeat has answered yet).
    async fn pull_for_read(self: &Arc<Self>, id: ShardId, wait: bool) -> Result<Pulled> {
        let kind = WireKind::Shard;
        if wait {
            self.wait_for_source(kind, id.0, &[]).await;
        }
        let length = match self.manifest_bytes(id) {
            Some(bytes) => pull::Length::new(bytes, true),
            None => pull::Length::new(self.peers.bytes_known(kind, id.0), false),
        };
        pull::pull(self, kind, id.0, length, &[]).await
    }

    /// Takes the cache entries of an earlier life into the cache again (they count against its
    /// bound); the victims that makes are deleted once the peers' inventories are known.
    pub(super) fn readmit_cache(self: &Arc<Self>) -> Result<()> {
        let mut victims = Vec::new();
        for (id, bytes) in self.local.cached_entries() {
            let (evicted, cached) = self.cache.lock().admit(ShardId(id), bytes)?;
            if !cached {
                self.local.set_cached(id, false);
            }
            victims.extend(evicted);
        }
        if !victims.is_empty() {
            // A victim with no copy that is not cached on a node that is up is kept: wait for
            // the heartbeats to tell which.
            let shared = Arc::clone(self);
            self.runtime.spawn(async move {
                tokio::time::sleep(shared.config.down_after * 2).await;
                shared.evict(victims).await;
            });
        }
        Ok(())
    }

    /// A reader touched `shards`: tells the evictor, and deletes its victims on a task.
    pub(super) fn accessed(self: &Arc<Self>, shards: &[ShardId]) {
        {
            let mut heat = self.heat.lock();
            for shard in shards {
                heat.add(shard.0, 1);
            }
        }
        // On the reader's thread: the evictor call is short; a task is started only when
        // there is something to delete.
        let victims = self.cache.lock().touch(shards);
        match victims {
            Ok(victims) if victims.is_empty() => {}
            Ok(victims) => {
                let shared = Arc::clone(self);
                self.runtime.spawn(async move { shared.evict(victims).await });
            }
            Err(e) => self.event(format!("cache evictor failed: {e}")),
        }
    }

    /// Whether `shard` is coded, no goal wants it copied, and more than `k` of its fragments are
    /// on nodes that are up: its whole copies may go, and the loss of one more node would still
    /// leave it readable.
    fn fragments_spare(&self, shard: ShardId) -> bool {
        let copied = self.local.goals().map_or(true, |goals| {
            goals.iter().any(|(name, goal)| {
                matches!(goal, super::frame::Goal::Replicas(_))
                    && self.shards_of(name).map_or(true, |shards| shards.contains_key(&shard))
            })
        });
        !copied
            && self
                .coding_of(shard)
                .is_some_and(|(coding, _)| self.fragment_holders(shard, coding).present() > usize::from(coding.k()))
    }

    /// Deletes cache victims, except a copy that may be the last: a victim is deleted only when
    /// a node that is up holds it as a copy that is not cached, or it is coded with more than
    /// `k` fragments up (such copies are never evicted,
    /// so two caches evicting at once cannot both count on each other). Kept victims become
    /// ordinary copies, no longer cached.
    pub(super) async fn evict(self: &Arc<Self>, victims: Vec<(ShardId, u64)>) {
        for (id, _) in victims {
            if self.is_placed_here(id).await {
                // Placement moved it here since it was cached: it stays, as a placed copy.
                self.local.set_cached(id.0, false);
                self.forget_hot(id);
                continue;
            }
            if !self.peers.durable_copy_up(id.0) && !self.fragments_spare(id) {
                self.local.set_cached(id.0, false);
                self.forget_hot(id);
                self.stats.kept_last_copy.fetch_add(1, Ordering::Relaxed);
                self.event(format!(
                    "kept shard {} although evicted: no node that is up holds a copy that is not cached",
                    id.0.short(12)
                ));
                continue;
            }
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Shard, id.0)).await {
                Ok(Ok(())) => {
                    self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                    self.forget_hot(id);
                }
                Ok(Err(e)) => self.event(format!("could not evict {}: {e}", id.0.short(12))),
                Err(e) => self.event(format!("could not evict {}: {e}", id.0.short(12))),
            }
        }
    }
}
