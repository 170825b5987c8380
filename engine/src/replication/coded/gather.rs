//! Reading a coded shard back: its bytes from a copy here, a peer's whole copy, or `k` of its
//! fragments (`gather`, with hedged fetches and the search for a fragment that lies), and a
//! reader's shard rebuilt and published here once however many ask (`rebuild_for_read`).
//!
//! Owns: `shard_bytes`, `gather`, `fetch_fragment`, `rebuild_for_read`, the hedge delay. Never:
//! keeps a fragment it fetched (fragments live where placement puts them), or returns bytes that
//! did not hash to the shard's id.

use super::{unique, write_then_adopt};
use crate::erasure::{Coding, Fragment, fragment_id};
use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};
use crate::replication::flight::Flight;
use crate::replication::frame::WireKind;
use crate::replication::pull;
use crate::replication::shared::{Pulled, Shared};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// A fragment fetch that has not answered for this long, while the rebuild still lacks some of
/// its `k`, gets a stand-in: the next fragment is asked for too, and the first `k` that check
/// out are used.
const HEDGE_AFTER: std::time::Duration = std::time::Duration::from_millis(300);

impl Shared {
    /// The shard's bytes, verified against its id: this node's copy when it checks out, else a
    /// peer's whole copy, else rebuilt from `k` fragments (`gather`).
    pub(super) async fn shard_bytes(self: &Arc<Self>, shard: ShardId, bytes: u64, coding: Coding) -> Result<Vec<u8>> {
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

    /// A reader's shard that no node that is up holds whole, rebuilt from `k` of its fragments
    /// (`gather`: checked against the shard's id) and published here, once however many readers
    /// ask at the same time. Right after a start, waits a little for the peers' inventories.
    pub(in crate::replication) async fn rebuild_for_read(
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
            && waited.elapsed() < crate::replication::shared::PEER_WAIT_FOR_SOURCE
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

/// Rebuilds a shard from checked fragments, off the runtime's threads.
async fn rebuild(shard: ShardId, fragments: Vec<Fragment>) -> Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || crate::erasure::reconstruct(shard, &fragments))
        .await
        .map_err(|e| Error::invalid_input(format!("rebuilding shard {shard} failed: {e}")))?
}
