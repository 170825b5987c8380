//! Placing one shard's fragments: encoded here, the one placed here kept, each other served
//! from memory while its target pulls it and checks it (`place_fragments`, `fragment_targets`),
//! and the checks a node runs on a fragment it was told to hold (`check_fragment`).
//!
//! Owns: `place_fragments`, `fragment_targets`, `publish_fragment`, `tell_to_check`,
//! `check_fragment`. Never: targets a node that already holds a fragment of the shard, or
//! publishes a fragment that was not checked whole (header, id, every block's CRC32C).

use super::{Entry, FragmentHolders, unique, write_then_adopt};
use crate::erasure::{Coding, fragment_id};
use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};
use crate::policy::{Placement, shard_key};
use crate::replication::frame::WireKind;
use crate::replication::shared::Shared;
use std::collections::BTreeSet;
use std::sync::Arc;

impl Shared {
    /// Asks `node` to check its copy of fragment `id`, which arrived damaged from it.
    pub(super) async fn tell_to_check(self: &Arc<Self>, node: u32, id: ObjectId) {
        let Some(addr) = self.peers.addr_of(node) else { return };
        let outcome = async {
            let (mut channel, _) = self.connect(addr).await.map_err(|e| e.to_string())?;
            let request = self.next_request_id();
            channel.send(&crate::replication::frame::Frame::Repair { request, id }).await.map_err(|e| e.to_string())?;
            channel.recv().await.map(|_| ()).map_err(|e| e.to_string())
        };
        if let Err(e) = outcome.await {
            self.event(format!("could not tell node {node} to check fragment {}: {e}", id.short(12)));
        }
    }

    /// A peer found fragment `id` damaged as this node sent it: checks it whole, quarantining it
    /// when it is (the shard's coordinator then rebuilds it).
    pub(crate) async fn check_fragment(self: &Arc<Self>, id: ObjectId) -> Result<String> {
        let path = self.local.object_path(WireKind::Fragment, id);
        let checked = tokio::task::spawn_blocking(move || {
            crate::erasure::FragmentFile::open(&path, id).and_then(crate::erasure::FragmentFile::read_whole)
        })
        .await
        .map_err(|e| Error::invalid_input(format!("checking fragment {id} failed: {e}")))?;
        match checked {
            Ok(_) => Ok(format!("fragment {id} is intact here")),
            Err(e) if e.is_corruption() => {
                self.stats.verify_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.event(format!("fragment {} is damaged here: {e}", id.short(12)));
                self.quarantine_and_heal(WireKind::Fragment, id).await;
                Ok(format!("fragment {id} was damaged here and is quarantined"))
            }
            Err(e) => Err(e),
        }
    }

    /// Publishes fragment file `file` (checked by `adopt`) here.
    async fn publish_fragment(self: &Arc<Self>, id: ObjectId, file: Vec<u8>) -> Result<()> {
        if self.local.holds(WireKind::Fragment, id).is_some() {
            return Ok(());
        }
        let shared = Arc::clone(self);
        tokio::task::spawn_blocking(move || -> Result<()> {
            let path = shared.local.incoming_path(WireKind::Fragment, id).with_extension(unique("new"));
            write_then_adopt(&shared, WireKind::Fragment, id, &path, &file)
        })
        .await
        .map_err(|e| Error::invalid_input(format!("publishing fragment {id} failed: {e}")))?
    }

    /// Places the fragments of `shard` that no node that is up holds on `targets` (`targets[i]`
    /// takes fragment `i`): encodes the shard (a whole copy, or rebuilt from fragments),
    /// publishes the one placed here, and serves each other one from memory (`outgoing`, never
    /// listed) while its target pulls it. One placement of a shard at a time per node. Returns
    /// the fragments placed and what failed.
    pub(super) async fn place_fragments(
        self: &Arc<Self>,
        shard: ShardId,
        bytes: u64,
        coding: Coding,
        targets: &[Option<u32>],
    ) -> (u64, Vec<String>) {
        // At most `ENCODES_MAX` shards in memory at once on this node, and one placement of a
        // shard at a time (a `replicate` and the reconciler may both want it); the fragments
        // still missing are read once it is this one's turn.
        let _slot = self.encode_slots.acquire().await.expect("the encode semaphore is never closed");
        loop {
            if self.coding_work.lock().insert(shard) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // Taken out of the table however this ends (a task aborted mid-way included).
        let _working = Entry(self, shard, |shared: &Shared, shard: &ShardId| {
            shared.coding_work.lock().remove(shard);
        });
        let indices = self.fragment_holders(shard, coding).missing();
        if indices.is_empty() {
            return (0, Vec::new());
        }
        let data = match self.shard_bytes(shard, bytes, coding).await {
            Ok(data) => data,
            Err(e) => return (0, vec![format!("shard {}: {e}", shard.0.short(12))]),
        };
        let mut files = match tokio::task::spawn_blocking(move || crate::erasure::encode(&data, coding)).await {
            Ok(Ok(files)) => files,
            Ok(Err(e)) => return (0, vec![format!("shard {}: {e}", shard.0.short(12))]),
            Err(e) => return (0, vec![format!("shard {}: encoding failed: {e}", shard.0.short(12))]),
        };
        let mut placed = 0;
        let mut errors = Vec::new();
        let own = self.hello.node_id;
        let mut asks = tokio::task::JoinSet::new();
        for &index in &indices {
            let id = fragment_id(shard, coding, index);
            let Some(target) = targets[usize::from(index)] else {
                errors.push(format!(
                    "fragment {index} of shard {}: every node that is up holds one of its fragments",
                    shard.0.short(12)
                ));
                continue;
            };
            let file = std::mem::take(&mut files[usize::from(index)]);
            if target == own {
                match self.publish_fragment(id, file).await {
                    Ok(()) => placed += 1,
                    Err(e) => errors.push(format!("fragment {index} of shard {}: {e}", shard.0.short(12))),
                }
                continue;
            }
            // Served from memory while the target pulls it: this node does not hold it.
            let file_bytes = file.len() as u64;
            self.outgoing.lock().insert(id, Arc::new(file));
            let shared = Arc::clone(self);
            asks.spawn(async move {
                let _served = Entry(&shared, id, |shared: &Shared, id: &ObjectId| {
                    shared.outgoing.lock().remove(id);
                });
                let outcome = shared.fetch_once(target, WireKind::Fragment, id, file_bytes, Vec::new()).await;
                (index, target, outcome)
            });
        }
        while let Some(joined) = asks.join_next().await {
            let Ok((index, target, outcome)) = joined else { continue };
            match outcome {
                Ok(()) => placed += 1,
                Err(e) => errors.push(format!("fragment {index} of shard {} to node {target}: {e}", shard.0.short(12))),
            }
        }
        (placed, errors)
    }

    /// The nodes `shard`'s fragments go on, in index order: the replicator's placement for
    /// `k + m` copies. The nodes that already hold a fragment of it keep theirs (a fragment is
    /// never moved to make room); a lost fragment goes to a node that is up and holds none of the
    /// shard's fragments, in the failure domain holding the fewest of them (the replicator's
    /// placed nodes first among equals); `None` when no such node is left.
    pub(super) fn fragment_targets(
        &self,
        placement: &Placement,
        shard: ShardId,
        holders: &FragmentHolders,
        up: &BTreeSet<u32>,
    ) -> Vec<Option<u32>> {
        let n = holders.coding.n();
        let placed: Vec<u32> = placement.nodes(shard_key(shard.0.as_bytes())).to_vec();
        let mut targets: Vec<Option<u32>> = holders.by_index.iter().map(|h| h.first().copied()).collect();
        let mut taken: BTreeSet<u32> = holders.nodes();
        // A fresh shard: fragment i on placed node i, as the replicator ordered them.
        if taken.is_empty() && placed.len() >= n && placed[..n].iter().all(|node| up.contains(node)) {
            return placed[..n].iter().copied().map(Some).collect();
        }
        // A lost fragment goes to a node whose failure domain holds the fewest of the shard's
        // fragments, the replicator's placed nodes first, then the others that are up.
        let domain_of: std::collections::HashMap<u32, u32> =
            self.node_infos().iter().map(|n| (n.id, n.failure_domain)).collect();
        let mut in_domain: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for node in &taken {
            *in_domain.entry(domain_of.get(node).copied().unwrap_or(*node)).or_default() += 1;
        }
        let mut candidates: Vec<u32> = Vec::new();
        for node in placed.iter().copied().chain(up.iter().copied()) {
            if up.contains(&node) && !candidates.contains(&node) {
                candidates.push(node);
            }
        }
        for target in targets.iter_mut().filter(|t| t.is_none()) {
            // None left: the fragment waits for a node (status counts the shard under its goal).
            let free = candidates.iter().copied().filter(|node| !taken.contains(node));
            let Some(node) = free
                .min_by_key(|node| in_domain.get(&domain_of.get(node).copied().unwrap_or(*node)).copied().unwrap_or(0))
            else {
                break;
            };
            taken.insert(node);
            *in_domain.entry(domain_of.get(&node).copied().unwrap_or(node)).or_default() += 1;
            *target = Some(node);
        }
        targets
    }
}
