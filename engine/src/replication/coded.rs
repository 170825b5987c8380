//! Erasure-coded goals: a version's shards cut into `k + m` fragments (`erasure`), fragment `i`
//! of a shard on the `i`-th node the replicator places the shard on when asked for `k + m`
//! copies (so the plugin's spreading over failure domains spreads fragments as it spreads
//! copies, and no WIT change is needed), read back from any `k` of them, and rebuilt when nodes
//! are lost.
//!
//! Owns: `replicate_coded` (a user's `replicate --ec`), placing one shard's fragments
//! (`place_fragments`: encode, keep the one placed here, serve each other one from memory while
//! its target pulls it), `gather` (a shard rebuilt from peers' fragments, for a
//! reader or a rebuild) and the reconciler's coded pass (`reconcile_coded`: missing fragments
//! rebuilt and placed by the shard's coordinator, whole copies turned into cache entries once
//! every fragment is placed; `drop_stale_fragments`: the fragments of a coding no goal names,
//! once the goal that replaced it is met); `unfold_coded`, whole shards rebuilt before a
//! dataset leaves its coding. Never: keeps a fragment it fetched to rebuild a shard (fragments
//! live where placement puts them; a shard rebuilt for a read is a cache entry), targets a node
//! that holds a fragment of the shard (two that views put on one node meanwhile are undone by
//! `drop_duplicate_fragments`), or uses a byte that was not checked: fragments are
//! checked whole (header, id, every block's CRC32C), a rebuilt shard against its BLAKE3 id.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::flight::Flight;
use super::frame::WireKind;
use super::pull;
use super::replicate::ReplicateReport;
use super::shared::{Pulled, Shared};
use crate::erasure::{Coding, Fragment, fragment_id};
use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};
use crate::policy::{Placement, ReplicationMode, shard_key};

/// Shards encoded (or rebuilt and encoded) at once by one node (`Shared::encode_slots`): each
/// holds the shard and its fragments in memory (`(2k + m) / k` times the shard's bytes).
pub(super) const ENCODES_MAX: usize = 2;

/// A fragment fetch that has not answered for this long, while the rebuild still lacks some of
/// its `k`, gets a stand-in: the next fragment is asked for too, and the first `k` that check
/// out are used.
const HEDGE_AFTER: std::time::Duration = std::time::Duration::from_millis(300);

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

    /// The shard's bytes, verified against its id: this node's copy when it checks out, else a
    /// peer's whole copy, else rebuilt from `k` fragments (`gather`).
    async fn shard_bytes(self: &Arc<Self>, shard: ShardId, bytes: u64, coding: Coding) -> Result<Vec<u8>> {
        if self.local.holds(WireKind::Shard, shard.0).is_some() {
            let path = self.local.object_path(WireKind::Shard, shard.0);
            let read = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
                let data = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
                let actual = ObjectId::of(&data);
                if actual != shard.0 {
                    return Err(Error::HashMismatch { path, expected: shard.0, actual });
                }
                Ok(data)
            })
            .await
            .map_err(|e| Error::invalid_input(format!("reading shard {shard} failed: {e}")))?;
            match read {
                Ok(data) => return Ok(data),
                Err(e) if e.is_corruption() => {
                    self.event(format!("shard {} is damaged here: {e}", shard.0.short(12)));
                    self.quarantine_and_heal(WireKind::Shard, shard.0).await;
                }
                Err(e) => self.event(format!("could not read shard {} here: {e}", shard.0.short(12))),
            }
        }
        // A whole copy on a peer (the version was copied before it was coded, or ingested there).
        for node in self.peers.holders(WireKind::Shard, shard.0) {
            let Some(addr) = self.peers.addr_of(node) else { continue };
            match pull::fetch_into_memory(self, addr, WireKind::Shard, shard.0, bytes).await {
                Ok(data) if ObjectId::of(&data) == shard.0 => return Ok(data),
                Ok(_) => self.event(format!("node {node} sent shard {} with wrong bytes", shard.0.short(12))),
                Err(e) => self.event(format!("could not read shard {} from node {node}: {e}", shard.0.short(12))),
            }
        }
        self.gather(shard, bytes, coding).await
    }

    /// Rebuilds `shard` (`bytes` long) from `k` of its fragments: those here, then peers', `k`
    /// asked at once (the next fragment when one fails or sends a fragment that does not check
    /// out, or is slow: `HEDGE_AFTER`). When the `k` rebuild bytes that do not hash to the shard's id (a fragment
    /// whose blocks check out but whose bytes are wrong), every other fragment is fetched and
    /// the sets that leave one out are tried; the one whose absence rebuilds the shard is named.
    /// Fails, naming the shard and what was found, when fewer than `k` good fragments are up.
    pub(crate) async fn gather(self: &Arc<Self>, shard: ShardId, bytes: u64, coding: Coding) -> Result<Vec<u8>> {
        let holders = self.fragment_holders(shard, coding);
        let k = usize::from(coding.k());
        if holders.present() < k {
            return Err(Error::Unavailable {
                what: format!("shard {shard}"),
                detail: format!(
                    "{} of its {} fragments ({coding}) are on nodes that are up, and {k} are needed to rebuild it",
                    holders.present(),
                    coding.n()
                ),
            });
        }
        let mut good: BTreeMap<u8, Fragment> = BTreeMap::new();
        let mut failures = Vec::new();
        // Data fragments first: rebuilding from them alone is a copy, not a decode.
        let order: Vec<u8> = (0..coding.n() as u8).filter(|&i| !holders.by_index[usize::from(i)].is_empty()).collect();
        let mut next = order.iter().copied();
        let mut tasks = tokio::task::JoinSet::new();
        let spawn = |tasks: &mut tokio::task::JoinSet<_>, index: u8| {
            let shared = Arc::clone(self);
            let nodes = holders.by_index[usize::from(index)].clone();
            tasks.spawn(async move { (index, shared.fetch_fragment(shard, bytes, coding, index, &nodes).await) });
        };
        for index in next.by_ref().take(k) {
            spawn(&mut tasks, index);
        }
        while good.len() < k {
            let joined = match tokio::time::timeout(HEDGE_AFTER, tasks.join_next()).await {
                Ok(Some(joined)) => joined,
                Ok(None) => break,
                // A slow holder: ask for one more fragment beside it.
                Err(_) => {
                    if let Some(index) = next.next() {
                        spawn(&mut tasks, index);
                    }
                    continue;
                }
            };
            let (index, outcome) = joined.map_err(|e| Error::invalid_input(format!("a fragment fetch failed: {e}")))?;
            match outcome {
                Ok(fragment) => {
                    good.insert(index, fragment);
                }
                Err(why) => {
                    failures.push(format!("fragment {index}: {why}"));
                    if let Some(index) = next.next() {
                        spawn(&mut tasks, index);
                    }
                }
            }
        }
        // The fetches still running (stand-ins no longer needed) end here.
        tasks.abort_all();
        if good.len() < k {
            return Err(Error::Unavailable {
                what: format!("shard {shard}"),
                detail: format!(
                    "only {} of the {k} fragments needed ({coding}) could be read: {}",
                    good.len(),
                    failures.join("; ")
                ),
            });
        }
        let first: Vec<Fragment> = good.values().cloned().collect();
        match rebuild(shard, first).await {
            Ok(data) => return Ok(data),
            Err(e) if e.is_corruption() => {
                self.event(format!("fragments of shard {} did not rebuild it: {e}", shard.0.short(12)));
            }
            Err(e) => return Err(e),
        }
        // Some fragment checks out but is wrong: fetch the rest, try the sets that leave one out.
        let rest: Vec<u8> = order.iter().copied().filter(|i| !good.contains_key(i)).collect();
        for index in rest {
            let nodes = holders.by_index[usize::from(index)].clone();
            if let Ok(fragment) = self.fetch_fragment(shard, bytes, coding, index, &nodes).await {
                good.insert(index, fragment);
            }
        }
        for &left_out in good.keys() {
            let set: Vec<Fragment> = good.iter().filter(|(i, _)| **i != left_out).map(|(_, f)| f.clone()).collect();
            if set.len() < k {
                break;
            }
            if let Ok(data) = rebuild(shard, set).await {
                self.event(format!(
                    "fragment {left_out} of shard {} is wrong although its blocks check out; rebuilt without it",
                    shard.0.short(12)
                ));
                if self.local.holds(WireKind::Fragment, fragment_id(shard, coding, left_out)).is_some() {
                    self.quarantine_and_heal(WireKind::Fragment, fragment_id(shard, coding, left_out)).await;
                }
                return Ok(data);
            }
        }
        Err(Error::BadFragments {
            shard,
            detail: format!("no {k} of the {} fragments read ({coding}) rebuild it", good.len()),
        })
    }

    /// Fragment `index` of `shard`, checked whole: this node's copy, else a peer's (each holder
    /// in turn). A damaged copy here is quarantined; a peer that sent one that does not check
    /// out is told to check its copy (`Repair`: it quarantines a damaged one, and the shard's
    /// coordinator rebuilds it).
    async fn fetch_fragment(
        self: &Arc<Self>,
        shard: ShardId,
        bytes: u64,
        coding: Coding,
        index: u8,
        nodes: &[u32],
    ) -> std::result::Result<Fragment, String> {
        let id = fragment_id(shard, coding, index);
        let file_bytes = coding.file_bytes(bytes);
        let mut why = Vec::new();
        for &node in nodes {
            if node == self.hello.node_id {
                let path = self.local.object_path(WireKind::Fragment, id);
                let read = tokio::task::spawn_blocking(move || {
                    crate::erasure::FragmentFile::open(&path, id).and_then(crate::erasure::FragmentFile::read_whole)
                })
                .await;
                match read {
                    Ok(Ok(fragment)) => return Ok(fragment),
                    Ok(Err(e)) => {
                        if e.is_corruption() {
                            self.quarantine_and_heal(WireKind::Fragment, id).await;
                        }
                        why.push(format!("here: {e}"));
                    }
                    Err(e) => why.push(format!("here: {e}")),
                }
                continue;
            }
            let Some(addr) = self.peers.addr_of(node) else { continue };
            match pull::fetch_into_memory(self, addr, WireKind::Fragment, id, file_bytes).await {
                Ok(file) => match Fragment::decode(file) {
                    Ok(fragment) if fragment.id() == id => return Ok(fragment),
                    Ok(_) => why.push(format!("node {node} sent another fragment")),
                    Err(e) => {
                        self.stats.verify_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        self.event(format!(
                            "node {node} sent fragment {index} of shard {} damaged: {e}",
                            shard.0.short(12)
                        ));
                        why.push(format!("node {node}: {e}"));
                        let shared = Arc::clone(self);
                        tokio::spawn(async move { shared.tell_to_check(node, id).await });
                    }
                },
                Err(e) => why.push(format!("node {node}: {e}")),
            }
        }
        Err(if why.is_empty() { "no holder is reachable".to_owned() } else { why.join("; ") })
    }

    /// Asks `node` to check its copy of fragment `id`, which arrived damaged from it.
    async fn tell_to_check(self: &Arc<Self>, node: u32, id: ObjectId) {
        let Some(addr) = self.peers.addr_of(node) else { return };
        let outcome = async {
            let (mut channel, _) = self.connect(addr).await.map_err(|e| e.to_string())?;
            let request = self.next_request_id();
            channel.send(&super::frame::Frame::Repair { request, id }).await.map_err(|e| e.to_string())?;
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
    async fn place_fragments(
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
    fn fragment_targets(
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

    /// The reconciler's pass over coded goals: for each shard, a second copy of a fragment here
    /// is dropped when another node keeps it; the fragments no node that is up holds are
    /// rebuilt and placed by the shard's coordinator (among the nodes that are up and hold the
    /// whole shard, else a fragment of it, the first by rendezvous hash), at most `budget`
    /// shards per pass; a whole copy here of a shard whose every fragment is placed becomes a cache entry.
    /// Returns (shards below their goal with their bytes, shards that cannot be read).
    pub(super) async fn reconcile_coded(
        self: &Arc<Self>,
        coded: &BTreeMap<Coding, BTreeMap<ShardId, u64>>,
        budget: usize,
    ) -> (Vec<(ShardId, u64)>, usize) {
        let own = self.hello.node_id;
        let up: BTreeSet<u32> = self.peers.up().into_iter().map(|(id, _)| id).chain(std::iter::once(own)).collect();
        let mut under = Vec::new();
        let mut unreadable = 0;
        let mut started = 0;
        for (&coding, shards) in coded {
            let placement = match self.placement(self.node_infos(), coding.n() as u32).await {
                Ok(placement) => placement,
                Err(e) => {
                    self.event(format!("the replicator's placement failed: {e}"));
                    continue;
                }
            };
            for (&shard, &bytes) in shards {
                let holders = self.fragment_holders(shard, coding);
                let whole = self.holders(WireKind::Shard, shard.0);
                if holders.present() < usize::from(coding.k()) && whole.is_empty() {
                    unreadable += 1;
                }
                self.drop_duplicate_fragments(shard, &holders).await;
                let missing = holders.missing();
                if missing.is_empty() {
                    if self.local.holds(WireKind::Shard, shard.0).is_some()
                        && !self.local.is_cached(shard.0)
                        && !self.is_placed_here(shard).await
                    {
                        self.keep_as_cache_entry(shard);
                    }
                    continue;
                }
                under.push((shard, bytes));
                // A node with the whole shard encodes it; else one with a fragment rebuilds it,
                // chosen per shard by rendezvous hashing so the rebuilds spread over the nodes.
                let candidates: Vec<u32> =
                    if whole.is_empty() { holders.nodes().into_iter().collect() } else { whole.clone() };
                let coordinator = candidates.into_iter().min_by_key(|&node| rendezvous(shard, node));
                if coordinator != Some(own) || started >= budget || self.coding_work.lock().contains(&shard) {
                    continue;
                }
                let targets = self.fragment_targets(&placement, shard, &holders, &up);
                if missing.iter().all(|&i| targets[usize::from(i)].is_none()) {
                    // No node is free for any of them: they wait for one to join.
                    continue;
                }
                started += 1;
                let shared = Arc::clone(self);
                tokio::spawn(async move {
                    let (made, errors) = shared.place_fragments(shard, bytes, coding, &targets).await;
                    if made > 0 {
                        shared.event(format!("rebuilt {made} fragments of shard {}", shard.0.short(12)));
                    }
                    for e in errors {
                        shared.event(format!("rebuilding fragments: {e}"));
                    }
                    shared.wake.notify_one();
                });
            }
        }
        (under, unreadable)
    }

    /// Drops this node's copy of a fragment of `shard` that another node that is up also holds,
    /// when this node holds two or more of the shard's fragments (it knows its own holdings
    /// for sure), or holds one and the rendezvous hash prefers another holder. Only while at
    /// least `k + 2` fragments are up: should two nodes' views disagree and both drop their
    /// copy, the shard keeps `k + 1`, and the lost index is rebuilt.
    async fn drop_duplicate_fragments(self: &Arc<Self>, shard: ShardId, holders: &FragmentHolders) {
        let own = self.hello.node_id;
        let coding = holders.coding;
        if holders.present() < usize::from(coding.k()) + 2 {
            return;
        }
        let mut own_count = (0..coding.n())
            .filter(|&i| self.local.holds(WireKind::Fragment, fragment_id(shard, coding, i as u8)).is_some())
            .count();
        for (index, nodes) in holders.by_index.iter().enumerate() {
            if nodes.len() < 2 || !nodes.contains(&own) {
                continue;
            }
            let keeper = nodes.iter().copied().min_by_key(|&node| rendezvous_of(shard, index as u8, node));
            if own_count < 2 && keeper == Some(own) {
                continue;
            }
            let id = fragment_id(shard, coding, index as u8);
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Fragment, id)).await {
                Ok(Ok(())) => {
                    own_count -= 1;
                    self.event(format!(
                        "dropped a second copy of fragment {index} of shard {} (another node holds it)",
                        shard.0.short(12)
                    ));
                }
                Ok(Err(e)) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
                Err(e) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
            }
        }
    }

    /// Drops the fragments held here of a coding no goal names for their shard any more (the
    /// dataset went back to copies, or to another coding) once the goal that replaced it is met
    /// on the nodes that are up: `R` copies that are not cache entries, or every fragment of the
    /// new coding. Fragments of shards no goal names are left to gc.
    pub(super) async fn drop_stale_fragments(
        self: &Arc<Self>,
        goals: &BTreeMap<crate::store::DatasetName, super::frame::Goal>,
    ) {
        let ids = self.local.fragment_ids();
        if ids.is_empty() {
            return;
        }
        // A shard two datasets share answers to both goals.
        let mut goals_of: BTreeMap<ShardId, Vec<super::frame::Goal>> = BTreeMap::new();
        for (name, &goal) in goals {
            if let Ok(shards) = self.shards_of(name) {
                for shard in shards.into_keys() {
                    goals_of.entry(shard).or_default().push(goal);
                }
            }
        }
        for id in ids {
            let known = self.fragment_headers.lock().get(&id).copied();
            let (shard, coding) = match known {
                Some(known) => known,
                None => {
                    let path = self.local.object_path(WireKind::Fragment, id);
                    let opened =
                        tokio::task::spawn_blocking(move || crate::erasure::FragmentFile::open(&path, id)).await;
                    let Ok(Ok(file)) = opened else { continue };
                    let known = (file.header().shard, file.header().coding);
                    self.fragment_headers.lock().insert(id, known);
                    known
                }
            };
            let Some(goals) = goals_of.get(&shard) else { continue };
            let met = |goal: &super::frame::Goal| match *goal {
                super::frame::Goal::Coded(current) => {
                    current != coding && self.fragment_holders(shard, current).missing().is_empty()
                }
                super::frame::Goal::Replicas(replicas) => {
                    let here = usize::from(
                        self.local.holds(WireKind::Shard, shard.0).is_some() && !self.local.is_cached(shard.0),
                    );
                    here + self.peers.durable_holders(shard.0) >= replicas as usize
                }
            };
            if !goals.iter().all(met) {
                continue;
            }
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Fragment, id)).await {
                Ok(Ok(())) => {
                    self.fragment_headers.lock().remove(&id);
                    self.event(format!(
                        "dropped fragment {} of shard {} ({coding}): its dataset's goal changed and is met",
                        id.short(12),
                        shard.0.short(12)
                    ));
                }
                Ok(Err(e)) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
                Err(e) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
            }
        }
    }

    /// A whole copy of a coded shard, every fragment of which is placed: a cache entry from now
    /// on (it serves reads until the read cache needs its room), or, on a node without a read
    /// cache bound (`serve --cache-bytes`, none by default), gone at once: the disk the coding
    /// saves is the point of it (issue 40: six nodes held 51.3 MB for 16.2 MB coded 4+2).
    /// `evict` keeps it where a copies goal places it here, or where no copy that is not cached
    /// is up and the fragments would not be enough.
    fn keep_as_cache_entry(self: &Arc<Self>, shard: ShardId) {
        let Some(bytes) = self.local.holds(WireKind::Shard, shard.0) else { return };
        if self.declined.lock().contains(&shard) {
            return;
        }
        self.local.set_cached(shard.0, true);
        if self.config.cache_bytes_max == 0 {
            let shared = Arc::clone(self);
            tokio::spawn(async move { shared.evict(vec![(shard, bytes)]).await });
            return;
        }
        let admitted = self.cache.lock().admit(shard, bytes);
        match admitted {
            Ok((victims, cached)) => {
                if !cached {
                    // Larger than the whole cache: kept as a copy, and not offered again.
                    self.local.set_cached(shard.0, false);
                    self.declined.lock().insert(shard);
                }
                if !victims.is_empty() {
                    let shared = Arc::clone(self);
                    tokio::spawn(async move { shared.evict(victims).await });
                }
            }
            Err(e) => {
                self.local.set_cached(shard.0, false);
                self.event(format!("cache evictor failed: {e}"));
            }
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

    /// A reader's shard that no node that is up holds whole, rebuilt from `k` of its fragments
    /// (`gather`: checked against the shard's id) and published here, once however many readers
    /// ask at the same time. Right after a start, waits a little for the peers' inventories.
    pub(super) async fn rebuild_for_read(
        self: &Arc<Self>,
        shard: ShardId,
        bytes: u64,
        coding: Coding,
    ) -> Result<Pulled> {
        if self.local.holds(WireKind::Shard, shard.0).is_some() {
            return Ok(Pulled::AlreadyHeld);
        }
        let waited = Instant::now();
        while self.fragment_holders(shard, coding).present() < usize::from(coding.k())
            && waited.elapsed() < super::shared::PEER_WAIT_FOR_SOURCE
        {
            tokio::time::sleep(self.config.heartbeat.min(std::time::Duration::from_millis(100))).await;
        }
        let work = async {
            // As a pull: at most `PULLS_MAX` at once, each holding a shard in memory.
            let _slot = self.pull_slots.acquire().await.expect("the pull semaphore is never closed");
            let data = self.gather(shard, bytes, coding).await?;
            let received = data.len() as u64;
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || -> Result<()> {
                let path = shared.local.incoming_path(WireKind::Shard, shard.0).with_extension(unique("rebuilt"));
                write_then_adopt(&shared, WireKind::Shard, shard.0, &path, &data)
            })
            .await
            .map_err(|e| Error::invalid_input(format!("publishing the rebuilt shard {shard} failed: {e}")))??;
            self.event(format!("rebuilt shard {} from its {coding} fragments", shard.0.short(12)));
            Ok(Pulled::Published { bytes: received })
        };
        match self.pulls.run((WireKind::Shard, shard.0), work).await {
            Flight::Led(outcome) => outcome,
            Flight::Joined(outcome) => outcome
                .map(|_| Pulled::Joined)
                .map_err(|detail| Error::Unavailable { what: format!("shard {shard}"), detail }),
        }
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

/// Rebuilds a shard from checked fragments, off the runtime's threads.
async fn rebuild(shard: ShardId, fragments: Vec<Fragment>) -> Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || crate::erasure::reconstruct(shard, &fragments))
        .await
        .map_err(|e| Error::invalid_input(format!("rebuilding shard {shard} failed: {e}")))?
}
