//! Erasure-coded goals: a version's shards cut into `k + m` fragments (`erasure`), fragment `i`
//! of a shard on the `i`-th node the replicator places the shard on when asked for `k + m`
//! copies (so the plugin's spreading over failure domains spreads fragments as it spreads
//! copies, and no WIT change is needed), read back from any `k` of them, and rebuilt when nodes
//! are lost. Beside this file: `place.rs` (one shard's fragments encoded and placed),
//! `gather.rs` (a shard read back from its fragments, for a reader or a rebuild),
//! `reconcile.rs` (the reconciler's coded pass).
//!
//! Owns: `replicate_coded` (a user's `replicate --ec`), `unfold_coded` (whole shards rebuilt
//! before a dataset leaves its coding), how a shard's fragments stand (`FragmentHolders`,
//! `coding_of`), and the helpers the three share (the coordination rank `rendezvous`, publishing
//! a rebuilt object, `Entry`). Never: keeps a fragment it fetched to rebuild a shard (fragments
//! live where placement puts them; a shard rebuilt for a read is a cache entry), targets a node
//! that holds a fragment of the shard (two that views put on one node meanwhile are undone by
//! `drop_duplicate_fragments`), or uses a byte that was not checked: fragments are
//! checked whole (header, id, every block's CRC32C), a rebuilt shard against its BLAKE3 id.

mod gather;
mod place;
mod reconcile;

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::frame::WireKind;
use super::replicate::ReplicateReport;
use super::shared::Shared;
use crate::erasure::{Coding, fragment_id};
use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};
use crate::policy::ReplicationMode;

/// Shards encoded (or rebuilt and encoded) at once by one node (`Shared::encode_slots`): each
/// holds the shard and its fragments in memory (`(2k + m) / k` times the shard's bytes).
pub(super) const ENCODES_MAX: usize = 2;

/// How a shard's fragments stand: for each index, the nodes that are up and hold it.
pub(crate) struct FragmentHolders {
    pub(crate) coding: Coding,
    pub(crate) by_index: Vec<Vec<u32>>,
}

impl FragmentHolders {
    /// Distinct fragments held by nodes that are up.
    pub(crate) fn present(&self) -> usize {
        self.by_index.iter().filter(|h| !h.is_empty()).count()
    }

    /// Indices no node that is up holds.
    pub(crate) fn missing(&self) -> Vec<u8> {
        (0..self.by_index.len()).filter(|&i| self.by_index[i].is_empty()).map(|i| i as u8).collect()
    }

    /// Nodes holding some fragment of the shard.
    fn nodes(&self) -> BTreeSet<u32> {
        self.by_index.iter().flatten().copied().collect()
    }
}

impl Shared {
    /// Which nodes that are up (this one included) hold each fragment of `shard`.
    pub(crate) fn fragment_holders(&self, shard: ShardId, coding: Coding) -> FragmentHolders {
        let by_index =
            (0..coding.n()).map(|i| self.holders(WireKind::Fragment, fragment_id(shard, coding, i as u8))).collect();
        FragmentHolders { coding, by_index }
    }

    /// The coding of the coded goal that covers `shard`, if one does.
    pub(crate) fn coding_of(&self, shard: ShardId) -> Option<(Coding, u64)> {
        let goals = self.local.goals().ok()?;
        goals.into_iter().find_map(|(name, goal)| match goal {
            super::frame::Goal::Coded(coding) => self.shards_of(&name).ok()?.get(&shard).map(|&bytes| (coding, bytes)),
            super::frame::Goal::Replicas(_) => None,
        })
    }

    /// `replicate NAME --ec K+M`, once `replicate` saved the goal and brought it to every peer
    /// with the ref: each shard's missing fragments placed (synchronous: waited for and counted
    /// from the targets' confirmations; asynchronous: left to the reconciler). `report` names
    /// the dataset, the coding and the mode.
    pub(crate) async fn replicate_coded(
        self: &Arc<Self>,
        mut report: ReplicateReport,
        shards: Vec<(ShardId, u64)>,
        mut failures: Vec<String>,
        progress: Option<mpsc::Sender<(u64, u64)>>,
        started: Instant,
    ) -> Result<ReplicateReport> {
        let coding = report.coding.ok_or_else(|| Error::invalid_input("a coded replication without a coding"))?;
        let (total, n, mode) = (shards.len() as u64, coding.n() as u32, report.mode);
        report.shards = total;
        if mode == ReplicationMode::Asynchronous {
            self.wake.notify_one();
            report.failures = failures;
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        let placement = self.placement(self.node_infos(), n).await?;
        let up: BTreeSet<u32> =
            self.peers.up().into_iter().map(|(id, _)| id).chain(std::iter::once(self.hello.node_id)).collect();
        let mut tasks = tokio::task::JoinSet::new();
        for (shard, bytes) in shards {
            let holders = self.fragment_holders(shard, coding);
            let targets = self.fragment_targets(&placement, shard, &holders, &up);
            let shared = Arc::clone(self);
            tasks.spawn(async move {
                let (made, errors) = shared.place_fragments(shard, bytes, coding, &targets).await;
                // Complete when every fragment is on a node that is up, whoever placed it.
                let complete = errors.is_empty() && shared.fragment_holders(shard, coding).missing().is_empty();
                (made, errors, complete)
            });
        }
        let mut done = 0;
        if let Some(progress) = &progress {
            let _ = progress.send((done, total)).await;
        }
        while let Some(joined) = tasks.join_next().await {
            let (made, errors, complete) =
                joined.map_err(|e| Error::invalid_input(format!("a coding task failed: {e}")))?;
            report.copies_made += made;
            if complete {
                done += 1;
            }
            failures.extend(errors);
            if let Some(progress) = &progress {
                let _ = progress.send((done, total)).await;
            }
        }
        report.shards_done = done;
        report.failures = failures;
        report.elapsed = started.elapsed();
        self.wake.notify_one();
        if report.failures.is_empty() {
            Ok(report)
        } else {
            Err(Error::Unavailable {
                what: format!("the {coding} fragments of {}", report.name),
                detail: report.failures.join("; "),
            })
        }
    }
}

impl Shared {
    /// Before dataset `name`'s coded goal (`old`) changes: each shard of its live versions that
    /// no node that is up holds whole is rebuilt here from its fragments and kept as a copy, so
    /// the new goal (copies, or another coding) starts from whole shards. Fails, naming the
    /// shards that could not be rebuilt, before the goal changes. (The old fragments stay, kept
    /// by gc while their shards are live.)
    pub(super) async fn unfold_coded(self: &Arc<Self>, name: &crate::store::DatasetName, old: Coding) -> Result<()> {
        let mut failed = Vec::new();
        for (shard, bytes) in self.shards_of(name)? {
            if !self.holders(WireKind::Shard, shard.0).is_empty() {
                continue;
            }
            match self.rebuild_for_read(shard, bytes, old).await {
                Ok(_) => self.local.set_cached(shard.0, false),
                Err(e) => failed.push(format!("shard {}: {e}", shard.0.short(12))),
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        Err(Error::Unavailable {
            what: format!(
                "whole copies of {name}'s shards, rebuilt from their {old} fragments before its goal changes"
            ),
            detail: format!("the goal stays ec {old}: {}", failed.join("; ")),
        })
    }
}

/// An entry of one of `Shared`'s tables, removed (by the function) when this is dropped.
struct Entry<'a, K>(&'a Shared, K, fn(&Shared, &K));

impl<K> Drop for Entry<'_, K> {
    fn drop(&mut self) {
        (self.2)(self.0, &self.1);
    }
}

/// The rank of `node` for `shard`'s coordination: every node computes the same.
fn rendezvous(shard: ShardId, node: u32) -> [u8; 8] {
    rendezvous_of(shard, u8::MAX, node)
}

/// The rank of `node` for fragment `index` of `shard` (`u8::MAX`: the shard itself).
fn rendezvous_of(shard: ShardId, index: u8, node: u32) -> [u8; 8] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(shard.0.as_bytes());
    hasher.update(&[index]);
    hasher.update(&node.to_le_bytes());
    let mut rank = [0u8; 8];
    rank.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    rank
}

/// Writes `bytes` to `path` (in `incoming/`), syncs it and publishes it as object `id`
/// (`LocalStore::adopt` checks it); the file is gone afterwards whatever happened.
fn write_then_adopt(shared: &Shared, kind: WireKind, id: ObjectId, path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let written = std::fs::File::create(path)
        .and_then(|mut out| out.write_all(bytes).and_then(|()| out.sync_all()))
        .map_err(|e| Error::io("write", path, e));
    let adopted = written.and_then(|()| shared.local.adopt(kind, id, path));
    let _ = std::fs::remove_file(path);
    adopted
}

/// A file name extension no other write of this process uses: `<what>-<n>`.
fn unique(what: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("{what}-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}
