//! Placing and copying a dataset version: `replicate` (a user's call, through `Node` or a
//! `Replicate` frame), the fetch requests that ask a peer to pull a shard from this node, the
//! receiving side of such a request (`fetch_here`), and bringing a dataset's manifests and ref
//! to a peer.
//!
//! Owns the replication goals' first copies and the fetch requests (bounded: `FETCHES_MAX`
//! outstanding, one per object and target). Never: chooses targets itself (the replicator
//! plugin places; this file asks the targets that lack a copy), or counts a copy the plan
//! promised but no node confirmed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::flight::Flight;
use super::frame::{Frame, Goal, ReplicateMode, ReplyCode, WireKind};
use super::pull;
use super::shared::{Pulled, Shared};
use crate::erasure::Coding;
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::policy::{NodeInfo, ReplicationMode, shard_key};
use crate::store::{DatasetName, VersionSpec};

impl Shared {
    /// Pulls an object here on a peer's request (a replication transfer).
    pub(crate) async fn fetch_here(
        self: &Arc<Self>,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        sources: &[u32],
    ) -> Result<()> {
        let length = match (kind, self.manifest_bytes(ShardId(id))) {
            (WireKind::Shard, Some(known)) => {
                if bytes != known {
                    return Err(Error::invalid_input(format!(
                        "shard {id} is {known} bytes by the manifest here, not {bytes}"
                    )));
                }
                pull::Length::new(known, true)
            }
            _ => pull::Length::new(bytes, false),
        };
        // A peer asks this node to hold the object: a placed copy, not a cache entry.
        if self.local.is_cached(id) {
            self.local.set_cached(id, false);
            self.cache.lock().forget(ShardId(id));
            self.forget_hot(ShardId(id));
        }
        // The asking peer may not be up in this node's table yet (it just started, or its first
        // heartbeat has not been answered): give it a moment rather than refuse.
        if self.local.holds(kind, id).is_none() {
            self.wait_for_source(kind, id, sources).await;
        }
        match pull::pull(self, kind, id, length, sources).await? {
            Pulled::AlreadyHeld | Pulled::Joined => {}
            Pulled::Published { bytes } => {
                self.event(format!("received {kind:?} {} ({bytes} bytes)", id.short(12)));
                self.wake.notify_one();
            }
        }
        Ok(())
    }

    /// Returns once the heartbeat of peer `id` finds it down (polled: the wait it ends is long).
    async fn until_down(&self, id: u32) {
        while self.peers.is_up(id) {
            tokio::time::sleep(self.config.heartbeat.min(Duration::from_millis(100))).await;
        }
    }

    /// Asks `target` to pull object `id` (from this node first, then `others`) and waits for its
    /// answer: Ok once a verified copy is published there.
    async fn ask_to_fetch(
        self: &Arc<Self>,
        target: u32,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        others: &[u32],
    ) -> Result<()> {
        let addr = self.peers.addr_of(target).ok_or_else(|| Error::NotFound { what: format!("node {target}") })?;
        let went_down = |when: &str| Error::Unavailable {
            what: format!("node {target} ({addr})"),
            detail: format!("it is down{when} (its heartbeat goes unanswered)"),
        };
        if !self.peers.is_up(target) {
            return Err(went_down(""));
        }
        let transport = |source: TransportError| Error::Transport { peer: format!("node {target} ({addr})"), source };
        let (mut channel, _) = self.connect(addr).await.map_err(transport)?;
        let request = self.next_request_id();
        let mut sources = vec![self.hello.node_id];
        sources.extend(others.iter().copied().filter(|&n| n != self.hello.node_id && n != target));
        sources.truncate(super::frame::SOURCES_MAX);
        channel.send(&Frame::Fetch { request, kind, id, bytes, sources }).await.map_err(transport)?;
        // The target replies once it has pulled and verified the object: allow for the slowest
        // transfer a pull accepts (1 MiB/s), and for a wait for one of its pull slots. A target
        // that its heartbeat finds down meanwhile will not answer: the wait ends then, naming it.
        let wait = Duration::from_secs(120) + Duration::from_secs(bytes / (1 << 20));
        let answer = tokio::select! {
            answer = channel.recv_within(wait) => answer.map_err(transport)?,
            () = self.until_down(target) => return Err(went_down(&format!(", since the transfer of {} began", id.short(12)))),
        };
        match answer {
            Frame::Reply { request: r, code: ReplyCode::Ok, .. } if r == request => {
                self.peers.note_has(target, kind, id, bytes);
                Ok(())
            }
            Frame::Reply { request: r, code, message } if r == request => Err(Error::PeerRefused {
                peer: format!("node {target}"),
                request: "fetch",
                code: code.to_string(),
                message: message.to_owned(),
            }),
            other => {
                Err(transport(TransportError::Protocol { detail: format!("answered a fetch with {:?}", other.kind()) }))
            }
        }
    }

    /// `ask_to_fetch` once per (object, target) at a time, within the fetch bound; a concurrent
    /// caller for the same pair gets the same outcome.
    pub(super) async fn fetch_once(
        self: &Arc<Self>,
        target: u32,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        others: Vec<u32>,
    ) -> Result<()> {
        let work = async {
            let _slot =
                Arc::clone(&self.fetch_slots).acquire_owned().await.expect("the fetch semaphore is never closed");
            self.ask_to_fetch(target, kind, id, bytes, &others).await
        };
        let outcome = match self.fetching.run((id, target), work).await {
            Flight::Led(outcome) => outcome,
            Flight::Joined(outcome) => {
                return outcome.map_err(|detail| Error::Unavailable {
                    what: format!("a copy of {} on node {target}", id.short(12)),
                    detail,
                });
            }
        };
        match &outcome {
            Ok(()) => {
                if kind == WireKind::Shard {
                    self.stats.copies_made.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.stats.copies_failed.fetch_add(1, Ordering::Relaxed);
                self.event(format!("node {target} could not fetch {}: {e}", id.short(12)));
            }
        }
        outcome
    }

    /// Brings `name`'s manifests and ref (and its goal) to peer `target`.
    pub(super) async fn push_ref(self: &Arc<Self>, target: u32, name: &DatasetName, goal: Goal) -> Result<()> {
        let paths = self.local.paths().clone();
        let log = paths.read_ref(name)?;
        for version in log.versions() {
            let id = version.manifest.0;
            if !self.node_holds(target, WireKind::Manifest, id) {
                let bytes = self
                    .local
                    .holds(WireKind::Manifest, id)
                    .ok_or_else(|| Error::NotFound { what: format!("manifest {id} of {name}@{}", version.number) })?;
                self.fetch_once(target, WireKind::Manifest, id, bytes, Vec::new()).await?;
            }
        }
        let addr = self.peers.addr_of(target).ok_or_else(|| Error::NotFound { what: format!("node {target}") })?;
        let transport = |source: TransportError| Error::Transport { peer: format!("node {target} ({addr})"), source };
        let (mut channel, _) = self.connect(addr).await.map_err(transport)?;
        let request = self.next_request_id();
        let text = log.encode();
        channel
            .send(&Frame::PutRef { request, goal, name: name.as_str(), log: text.as_bytes() })
            .await
            .map_err(transport)?;
        match channel.recv().await.map_err(transport)? {
            Frame::Reply { request: r, code: ReplyCode::Ok, .. } if r == request => {
                self.goals_pending.lock().remove(&(target, name.clone()));
                Ok(())
            }
            Frame::Reply { code, message, .. } => Err(Error::PeerRefused {
                peer: format!("node {target}"),
                request: "put-ref",
                code: code.to_string(),
                message: message.to_owned(),
            }),
            other => {
                Err(transport(TransportError::Protocol { detail: format!("answered a ref with {:?}", other.kind()) }))
            }
        }
    }

    /// Replicates `spec` as `goal` says (copies of each shard, or its coded fragments), waiting
    /// for them as `mode` says (or the replicator); reports (shards done, shards) to `progress`
    /// as copies are confirmed.
    pub(crate) async fn replicate(
        self: &Arc<Self>,
        spec: &str,
        goal: Goal,
        mode: ReplicateMode,
        progress: Option<mpsc::Sender<(u64, u64)>>,
    ) -> Result<ReplicateReport> {
        let started = Instant::now();
        let replicas = goal.nodes();
        if replicas == 0 {
            return Err(Error::invalid_input("--replicas must be at least 1"));
        }
        let spec = VersionSpec::parse(spec)?;
        let name = match &spec {
            VersionSpec::Latest(name) | VersionSpec::Numbered(name, _) => name.clone(),
            VersionSpec::Manifest(_) => {
                return Err(Error::invalid_input("replicate takes NAME or NAME@N (a ref goes with the copies)"));
            }
        };
        // What an ingest beside this node just published is not listed yet.
        {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || shared.local.rescan())
                .await
                .map_err(|e| Error::invalid_input(format!("rescan failed: {e}")))??;
        }
        let paths = self.local.paths().clone();
        let (manifest_id, _) = paths.resolve(&spec)?;
        let manifest = paths.read_manifest(manifest_id)?;
        // A node holds at most one copy of a shard: a factor above the nodes of the job cannot
        // be met, and is refused before a goal is saved or a ref pushed. (One above the nodes
        // up now can, once they are back: a goal, kept by the reconciler.)
        check_replicas_possible(&self.node_infos(), self.peers.not_heard_from(), goal)?;
        // Leaving a coding: the shards no node holds whole come back from their fragments first.
        let before = self.local.goals()?.get(&name).copied();
        if let Some(Goal::Coded(old)) = before
            && goal != Goal::Coded(old)
        {
            self.unfold_coded(&name, old).await?;
        }
        {
            let shared = Arc::clone(self);
            let name = name.clone();
            tokio::task::spawn_blocking(move || shared.local.set_goal(&name, goal))
                .await
                .map_err(|e| Error::invalid_input(format!("saving the goal failed: {e}")))??;
        }
        let mut failures = Vec::new();
        // Every peer learns the goal: those that are down, or fail now, once they are up.
        let known: Vec<u32> = self.peers.map(|p| p.id()).into_iter().flatten().collect();
        self.goals_pending.lock().extend(known.into_iter().map(|peer| (peer, name.clone())));
        for (peer, _) in self.peers.up() {
            if let Err(e) = self.push_ref(peer, &name, goal).await {
                failures.push(format!("ref to node {peer}: {e}"));
            }
        }
        let nodes = self.node_infos();
        let placement = self.placement(nodes, replicas).await?;
        let mode = match mode {
            ReplicateMode::Node => placement.mode,
            ReplicateMode::Synchronous => ReplicationMode::Synchronous,
            ReplicateMode::Asynchronous => ReplicationMode::Asynchronous,
        };
        let shards: Vec<(ShardId, u64)> = manifest
            .entries()
            .iter()
            .map(|e| (e.shard, e.file_bytes))
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect();
        let total = shards.len() as u64;
        let mut report = ReplicateReport {
            name: name.to_string(),
            replicas,
            coding: match goal {
                Goal::Coded(coding) => Some(coding),
                Goal::Replicas(_) => None,
            },
            mode,
            shards: total,
            shards_done: 0,
            copies_made: 0,
            failures: Vec::new(),
            elapsed: Duration::ZERO,
        };
        if report.coding.is_some() {
            return self.replicate_coded(report, shards, failures, progress, started).await;
        }
        let up: BTreeSet<u32> = self.peers.up().into_iter().map(|(id, _)| id).collect();
        let mut jobs = Vec::new();
        for (shard, bytes) in &shards {
            let holders = self.holders(WireKind::Shard, shard.0);
            if holders.is_empty() {
                failures.push(format!("shard {shard}: no node that is up holds it"));
                continue;
            }
            let targets: Vec<u32> = placement
                .nodes(shard_key(shard.0.as_bytes()))
                .iter()
                .copied()
                .filter(|t| up.contains(t) && !holders.contains(t))
                .collect();
            // A node holds at most one copy: no target holds it, none is named twice.
            debug_assert!(
                targets.iter().enumerate().all(|(i, t)| !targets[..i].contains(t) && !holders.contains(t)),
                "shard {shard}: targets {targets:?}, holders {holders:?}"
            );
            jobs.push((*shard, *bytes, holders, targets));
        }
        if mode == ReplicationMode::Asynchronous {
            // The reconciler makes the copies and measures how far behind they are.
            self.wake.notify_one();
            report.failures = failures;
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        let mut tasks = tokio::task::JoinSet::new();
        for (shard, bytes, holders, targets) in jobs {
            let shared = Arc::clone(self);
            tasks.spawn(async move {
                let mut made = 0u64;
                let mut errors = Vec::new();
                for target in targets {
                    match shared.fetch_once(target, WireKind::Shard, shard.0, bytes, holders.clone()).await {
                        Ok(_) => made += 1,
                        Err(e) => errors.push(format!("shard {} to node {target}: {e}", shard.0.short(12))),
                    }
                }
                // A node that is down is no target: the copies are counted, not assumed from
                // the plan.
                (made, errors, holders.len() as u64 + made)
            });
        }
        // A shard counts as done once every copy it needed is confirmed (at once, when it needed
        // none); one that no node holds never does.
        let mut done = 0;
        if let Some(progress) = &progress {
            let _ = progress.send((done, total)).await;
        }
        let (mut n_short, mut copies_min) = (0u64, u64::from(replicas));
        while let Some(joined) = tasks.join_next().await {
            let (made, errors, copies) =
                joined.map_err(|e| Error::invalid_input(format!("a replication task failed: {e}")))?;
            report.copies_made += made;
            if copies < u64::from(replicas) {
                n_short += 1;
                copies_min = copies_min.min(copies);
            } else if errors.is_empty() {
                done += 1;
            }
            failures.extend(errors);
            if let Some(progress) = &progress {
                let _ = progress.send((done, total)).await;
            }
        }
        if n_short > 0 {
            failures.push(format!(
                "{n_short} of {total} shards have fewer than {replicas} copies (as few as {copies_min}) with {} nodes up",
                // Now, not when the copies were planned: a peer may have gone down meanwhile.
                self.peers.up().len() + 1
            ));
        }
        // No command reports work that did not happen: a shard is done only once its copies are.
        debug_assert!(done + n_short <= total, "{done} done and {n_short} short of {total} shards");
        report.shards_done = done;
        report.failures = failures;
        report.elapsed = started.elapsed();
        if report.failures.is_empty() {
            Ok(report)
        } else {
            Err(Error::Unavailable {
                what: format!("{} copies of {}", replicas, report.name),
                detail: report.failures.join("; "),
            })
        }
    }
}

/// Refuses a replication factor above the nodes of the job that may take copies (`nodes` with
/// a weight, up or not, and the peers not heard from yet): each holds at most one copy of a
/// shard, so such a goal is never met.
fn check_replicas_possible(nodes: &[NodeInfo], n_unheard: usize, goal: Goal) -> Result<()> {
    let replicas = goal.nodes();
    let holding: Vec<&NodeInfo> = nodes.iter().filter(|n| n.weight > 0).collect();
    let n_job = holding.len() + n_unheard;
    if replicas as usize <= n_job {
        return Ok(());
    }
    let n_up = holding.iter().filter(|n| n.up).count();
    let domains: BTreeSet<u32> = holding.iter().map(|n| n.failure_domain).collect();
    let unheard = if n_unheard > 0 { format!(", {n_unheard} not heard from") } else { String::new() };
    if let Goal::Coded(coding) = goal {
        return Err(Error::invalid_input(format!(
            "a {coding} coding puts each shard's {replicas} fragments on {replicas} nodes, but the job has {n_job} nodes ({n_up} up{unheard}) in {} failure domains",
            domains.len()
        )));
    }
    Err(Error::invalid_input(format!(
        "{replicas} copies of each shard asked, but the job has {n_job} nodes ({n_up} up{unheard}) in {} failure domains, and a node holds at most one copy",
        domains.len()
    )))
}

/// What `replicate` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicateReport {
    /// The dataset.
    pub name: String,
    /// Copies wanted per shard (for a coding, its fragments).
    pub replicas: u32,
    /// The coding, when the goal is coded fragments rather than copies.
    pub coding: Option<Coding>,
    /// Whether the copies were waited for.
    pub mode: ReplicationMode,
    /// Shards in the version.
    pub shards: u64,
    /// Shards whose copies were all confirmed (synchronous mode).
    pub shards_done: u64,
    /// Copies made.
    pub copies_made: u64,
    /// What failed.
    pub failures: Vec<String>,
    /// How long it took.
    pub elapsed: Duration,
}

impl fmt::Display for ReplicateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(coding) = self.coding {
            return match self.mode {
                ReplicationMode::Synchronous => write!(
                    f,
                    "{}: {} shards as {coding} fragments, synchronous: {} of {} shards have every fragment placed, verified on their nodes ({} placed by this call, the others already were), in {:.2} s",
                    self.name,
                    self.shards,
                    self.shards_done,
                    self.shards,
                    self.copies_made,
                    self.elapsed.as_secs_f64()
                ),
                ReplicationMode::Asynchronous => write!(
                    f,
                    "{}: {} shards as {coding} fragments, asynchronous: fragments are placed in the background (`granary status` shows them)",
                    self.name, self.shards
                ),
            };
        }
        match self.mode {
            ReplicationMode::Synchronous => write!(
                f,
                "{}: {} shards at {} copies, synchronous: {} of {} shards confirmed, {} copies made, verified on their nodes, in {:.2} s",
                self.name,
                self.shards,
                self.replicas,
                self.shards_done,
                self.shards,
                self.copies_made,
                self.elapsed.as_secs_f64()
            ),
            ReplicationMode::Asynchronous => write!(
                f,
                "{}: {} shards at {} copies, asynchronous: copies are made in the background (`granary status` shows the lag)",
                self.name, self.shards, self.replicas
            ),
        }
    }
}
