//! The status report of a node: what `granary status` shows, gathered from the node's shared
//! state (`Shared::status`), as data (`NodeStatus`), as JSON (the body of a `Status` frame, and
//! `granary status --json`: its keys are the field names and stay stable) and as a report for
//! people (`Display`).
//!
//! Owns: `NodeStatus` with `GoalStatus`, `CodedVersionStatus`, `PeerStatus` and `HotShardStatus`;
//! `Shared::status`, which gathers it; its JSON (`to_json`, `to_json_pretty`, `from_json`) and its
//! `Display`.
//!
//! Invariant: the JSON a node sends fits a `Status` frame (oldest events, then peers beyond
//! what fits, are left out and counted). Never: changes what it reports on (it only reads
//! counters and tables, under their locks).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{Goal, STATUS_BYTES_MAX, WireKind};
use super::shared::Shared;
use crate::error::{Error, Result};

/// One replication goal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoalStatus {
    /// The dataset.
    pub dataset: String,
    /// Copies wanted of each of its shards (for a coding: its fragments, one per node).
    pub replicas: u32,
    /// The coding (`"4+2"`) when the goal is coded fragments rather than copies (absent from
    /// the JSON otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coding: Option<String>,
    /// For a coded goal, its latest live versions' fragments on the nodes that are up (at most
    /// `CODED_VERSIONS_SHOWN`, newest last).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<CodedVersionStatus>,
    /// Older live versions left out of `versions`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub versions_omitted: u64,
}

/// Versions of a coded dataset a status report details (the rest are counted): the report must
/// fit a `Status` frame.
pub(crate) const CODED_VERSIONS_SHOWN: usize = 8;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How one version of a coded dataset stands, from the inventories of the nodes that are up.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedVersionStatus {
    /// The version's number.
    pub version: u64,
    /// Its shards.
    pub shards: u64,
    /// `k`: fragments that rebuild a shard.
    pub k: u32,
    /// `k + m`: fragments of each shard.
    pub n: u32,
    /// The fewest distinct fragments of any of its shards on nodes that are up.
    pub fragments_min: u32,
    /// Shards with every fragment up.
    pub shards_complete: u64,
    /// Shards with fewer than `k + 1` fragments up: one more lost node can make them unreadable.
    pub shards_at_risk: u64,
    /// Shards with fewer than `k` fragments up (and no whole copy): unreadable now.
    pub shards_unreadable: u64,
    /// Bytes of the version's shard files.
    pub data_bytes: u64,
    /// Bytes of its fragment files on nodes that are up.
    pub fragment_bytes: u64,
    /// What copies with the same tolerance (`m` lost nodes: `m + 1` copies) would take.
    pub replicated_bytes: u64,
    /// Bytes of whole copies of its shards on nodes that are up (read-cache entries included):
    /// with `fragment_bytes`, what the version takes on disk.
    #[serde(default)]
    pub whole_bytes: u64,
}

/// One peer in a status report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerStatus {
    /// Its node id, once it said hello.
    pub id: Option<u32>,
    /// Its address.
    pub addr: SocketAddr,
    /// Whether it answers.
    pub up: bool,
    /// For how long it has been up (or down).
    pub for_ms: u64,
    /// Objects it lists.
    pub objects: usize,
    /// Whether it is demoted (it sent bad bytes).
    pub demoted: bool,
    /// Its last failure.
    pub last_error: String,
    /// Since its last answer to a heartbeat (`None` before the first).
    #[serde(default)]
    pub answered_ms_ago: Option<u64>,
    /// Bytes of objects sent to it.
    #[serde(default)]
    pub bytes_sent: u64,
    /// Bytes of objects received from it.
    #[serde(default)]
    pub bytes_received: u64,
}

/// A hot shard: extra copies for its reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotShardStatus {
    /// The shard id's first 12 hex digits.
    pub shard: String,
    /// Its reads over the last window, summed over the nodes.
    pub reads: u64,
    /// Copies its goal wants.
    pub copies_wanted: usize,
    /// Copies on nodes that are up.
    pub copies: usize,
    /// Whether the replicator calls it core (synchronous mode). Hot copies are pulled in the
    /// background either way: no ingest waits for them.
    pub synchronous: bool,
}

/// What a node knows: peers, goals, lag, counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// This node's id.
    pub id: u32,
    /// This start's incarnation.
    pub incarnation: u64,
    /// Where it listens.
    pub listen: String,
    /// Its store.
    pub root: PathBuf,
    /// Since when it runs.
    pub uptime_ms: u64,
    /// Objects stored here.
    pub objects: usize,
    /// Its peers.
    pub peers: Vec<PeerStatus>,
    /// Replication goals.
    pub goals: Vec<GoalStatus>,
    /// Shards of goal datasets with fewer copies than wanted on nodes that are up.
    pub under_replicated: usize,
    /// Their bytes.
    #[serde(default)]
    pub under_replicated_bytes: u64,
    /// Shards of goal datasets with no copy on a node that is up.
    pub unavailable: usize,
    /// How long the oldest under-replicated shard has been so.
    pub lag_oldest_ms: u64,
    /// How long the last shard that reached its goal was under it.
    pub lag_last_ms: Option<u64>,
    /// The longest such time seen.
    pub lag_max_ms: u64,
    /// Fetch requests outstanding with peers.
    pub pending_fetches: usize,
    /// Copies this node had peers make.
    pub copies_made: u64,
    /// Copies that failed.
    pub copies_failed: u64,
    /// Objects received and published here.
    pub objects_received: u64,
    /// Bytes sent to peers.
    pub bytes_sent: u64,
    /// Bytes received from peers.
    #[serde(default)]
    pub bytes_received: u64,
    /// Transfers or local copies that failed verification.
    pub verify_failures: u64,
    /// Peers demoted for sending bad bytes.
    pub demotions: u64,
    /// Connections refused (wrong key, stale incarnation, too many).
    pub connections_refused: u64,
    /// Of those, connections told the node was busy (too many handshakes at once).
    pub connections_busy: u64,
    /// Connections dropped for a bad frame (oversized, corrupt, replayed, unexpected).
    pub frames_rejected: u64,
    /// Read-time repairs done.
    pub repairs: u64,
    /// Bytes of cached shards.
    pub cache_bytes: u64,
    /// The cache's bound (0: none).
    pub cache_bytes_max: u64,
    /// Cached shards.
    pub cache_objects: usize,
    /// Shards evicted from the cache.
    pub evicted: u64,
    /// Victims kept because no other node holds them.
    pub kept_last_copy: u64,
    /// Shards the replicator's last hot pass gave more copies (the most read 16).
    #[serde(default)]
    pub hot_shards: Vec<HotShardStatus>,
    /// All such shards.
    #[serde(default)]
    pub hot_shards_total: usize,
    /// Hot copies this node holds.
    #[serde(default)]
    pub hot_copies_here: usize,
    /// Recent events, oldest first.
    pub events: Vec<String>,
    /// Older events left out of the report (to fit a frame).
    #[serde(default)]
    pub events_omitted: usize,
    /// Peers left out of the report (to fit a frame).
    #[serde(default)]
    pub peers_omitted: usize,
}

impl Shared {
    /// The latest live versions of coded dataset `name` (`CODED_VERSIONS_SHOWN`): their
    /// fragments on the nodes that are up; and how many older ones were left out.
    fn coded_versions(
        &self,
        name: &crate::store::DatasetName,
        coding: crate::erasure::Coding,
    ) -> (Vec<CodedVersionStatus>, u64) {
        let paths = self.local.paths();
        let Ok(log) = paths.read_ref(name) else { return (Vec::new(), 0) };
        let (k, n) = (u32::from(coding.k()), coding.n() as u32);
        let mut out = Vec::new();
        let versions = log.versions();
        let omitted = versions.len().saturating_sub(CODED_VERSIONS_SHOWN);
        for version in &versions[omitted..] {
            let Ok(manifest) = paths.read_manifest(version.manifest) else { continue };
            let mut v = CodedVersionStatus { version: version.number, k, n, fragments_min: n, ..Default::default() };
            let shards: std::collections::BTreeMap<_, _> =
                manifest.entries().iter().map(|e| (e.shard, e.file_bytes)).collect();
            for (&shard, &shard_bytes) in &shards {
                let holders = self.fragment_holders(shard, coding);
                let present = holders.present() as u32;
                let copies: u64 = holders.by_index.iter().map(|h| h.len() as u64).sum();
                v.shards += 1;
                v.data_bytes += shard_bytes;
                v.fragment_bytes += copies * coding.file_bytes(shard_bytes);
                v.whole_bytes += self.holders(WireKind::Shard, shard.0).len() as u64 * shard_bytes;
                v.fragments_min = v.fragments_min.min(present);
                if present == n {
                    v.shards_complete += 1;
                }
                if present < k + 1 {
                    v.shards_at_risk += 1;
                }
                if present < k && self.holders(WireKind::Shard, shard.0).is_empty() {
                    v.shards_unreadable += 1;
                }
            }
            if v.shards == 0 {
                v.fragments_min = 0;
            }
            v.replicated_bytes = v.data_bytes * u64::from(n - k + 1);
            out.push(v);
        }
        (out, omitted as u64)
    }

    /// The status report.
    pub(crate) fn status(&self) -> NodeStatus {
        let now = Instant::now();
        let mut peers = self.peers.map(|p| PeerStatus {
            id: p.id(),
            addr: p.addr,
            up: p.up,
            for_ms: now.duration_since(p.changed).as_millis() as u64,
            objects: p.objects(),
            demoted: p.demoted(now),
            last_error: p.last_error.clone(),
            answered_ms_ago: p.last_ok().map(|t| now.duration_since(t).as_millis() as u64),
            bytes_sent: 0,
            bytes_received: 0,
        });
        for peer in &mut peers {
            if let Some(id) = peer.id {
                (peer.bytes_sent, peer.bytes_received) = self.peers.bytes_of(id);
            }
        }
        let goals = self.local.goals().unwrap_or_default();
        let (under_replicated, under_replicated_bytes, unavailable, lag_oldest_ms, lag_last_ms, lag_max_ms) = {
            let lag = self.lag.lock();
            let oldest = lag.under.values().map(|since| now.duration_since(*since)).max().unwrap_or_default();
            (
                lag.under.len(),
                lag.under_bytes,
                lag.unavailable,
                oldest.as_millis() as u64,
                lag.last.map(|d| d.as_millis() as u64),
                lag.max.as_millis() as u64,
            )
        };
        let (cache_bytes, cache_objects) = {
            let cache = self.cache.lock();
            (cache.used_bytes(), cache.len())
        };
        let (hot_shards, hot_shards_total, hot_copies_here) = self.hot_status();
        let stat = |c: &AtomicU64| c.load(Ordering::Relaxed);
        NodeStatus {
            id: self.hello.node_id,
            incarnation: self.hello.epoch,
            listen: self.hello.listen.clone(),
            root: self.config.root.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            objects: self.local.len(),
            peers,
            goals: goals
                .into_iter()
                .map(|(name, goal)| match goal {
                    Goal::Replicas(replicas) => GoalStatus {
                        dataset: name.to_string(),
                        replicas,
                        coding: None,
                        versions: Vec::new(),
                        versions_omitted: 0,
                    },
                    Goal::Coded(coding) => {
                        let (versions, versions_omitted) = self.coded_versions(&name, coding);
                        GoalStatus {
                            dataset: name.to_string(),
                            replicas: goal.nodes(),
                            coding: Some(coding.to_string()),
                            versions,
                            versions_omitted,
                        }
                    }
                })
                .collect(),
            under_replicated,
            under_replicated_bytes,
            unavailable,
            lag_oldest_ms,
            lag_last_ms,
            lag_max_ms,
            pending_fetches: self.fetching.len(),
            copies_made: stat(&self.stats.copies_made),
            copies_failed: stat(&self.stats.copies_failed),
            objects_received: stat(&self.stats.objects_received),
            bytes_sent: stat(&self.stats.bytes_sent),
            bytes_received: stat(&self.stats.bytes_received),
            verify_failures: stat(&self.stats.verify_failures),
            demotions: stat(&self.stats.demotions),
            connections_refused: stat(&self.stats.connections_refused),
            connections_busy: stat(&self.stats.connections_busy),
            frames_rejected: stat(&self.stats.frames_rejected),
            repairs: stat(&self.stats.repairs),
            cache_bytes,
            cache_bytes_max: self.config.cache_bytes_max,
            cache_objects,
            evicted: stat(&self.stats.evicted),
            kept_last_copy: stat(&self.stats.kept_last_copy),
            hot_shards,
            hot_shards_total,
            hot_copies_here,
            events: self.events.lock().iter().cloned().collect(),
            events_omitted: 0,
            peers_omitted: 0,
        }
    }
}

impl NodeStatus {
    /// Whether every goal is met on the nodes that are up.
    pub fn converged(&self) -> bool {
        self.under_replicated == 0 && self.pending_fetches == 0
    }
}

impl NodeStatus {
    /// The report as JSON that fits a `Status` frame: events (oldest first), then peers, are
    /// left out until it does, and counted in `events_omitted` and `peers_omitted`.
    pub fn to_json(&self) -> String {
        let mut status = self.clone();
        loop {
            let json = serde_json::to_string(&status).expect("a status report always serializes");
            // Without events and peers the report is a few hundred bytes, and 250 per detailed
            // version of a coded goal (`CODED_VERSIONS_SHOWN` of each).
            if json.len() <= STATUS_BYTES_MAX || (status.events.is_empty() && status.peers.is_empty()) {
                return json;
            }
            if status.events.is_empty() {
                status.peers.pop();
                status.peers_omitted += 1;
            } else {
                status.events.remove(0);
                status.events_omitted += 1;
            }
        }
    }

    /// The report a node sent.
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json)
            .map_err(|e| Error::invalid_input(format!("a status report that does not decode: {e}")))
    }

    /// The report as pretty-printed JSON, for scripts.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a status report always serializes")
    }
}

/// `1.2 s`, `3 min 4 s`, `2 h 5 min`.
fn took(ms: u64) -> String {
    let d = Duration::from_millis(ms);
    let s = d.as_secs();
    if s < 60 {
        format!("{:.1} s", d.as_secs_f64())
    } else if s < 3600 {
        format!("{} min {} s", s / 60, s % 60)
    } else if s < 86400 {
        format!("{} h {} min", s / 3600, s % 3600 / 60)
    } else {
        format!("{} d {} h", s / 86400, s % 86400 / 3600)
    }
}

/// `512 B`, `4.0 MiB`.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// `1 shard`, `2 shards`.
fn count(n: u64, one: &str) -> String {
    counted(n, one, &format!("{one}s"))
}

/// `1 copy`, `2 copies`.
fn counted(n: u64, one: &str, many: &str) -> String {
    if n == 1 { format!("1 {one}") } else { format!("{n} {many}") }
}

impl fmt::Display for NodeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "node {} (incarnation {}) on {}, serving {}",
            self.id,
            self.incarnation,
            self.listen,
            self.root.display()
        )?;
        writeln!(f, "  up {}, {} stored", took(self.uptime_ms), count(self.objects as u64, "object"))?;
        self.fmt_peers(f)?;
        self.fmt_goals(f)?;
        self.fmt_traffic(f)
    }
}

impl NodeStatus {
    fn fmt_peers(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_up = self.peers.iter().filter(|p| p.up).count();
        let omitted =
            if self.peers_omitted > 0 { format!(" ({} more not shown)", self.peers_omitted) } else { String::new() };
        writeln!(f, "peers: {n_up} of {} up{omitted}", self.peers.len())?;
        for p in &self.peers {
            let who = p.id.map_or_else(|| "node ?".to_owned(), |id| format!("node {id}"));
            let state = if p.up { "up" } else { "DOWN" };
            write!(
                f,
                "  {who:<12} {:<22} {state} for {}, {} listed",
                p.addr,
                took(p.for_ms),
                count(p.objects as u64, "object")
            )?;
            if p.demoted {
                write!(f, ", demoted (sent bad bytes)")?;
            }
            if !p.last_error.is_empty() {
                write!(f, "; last error: {}", p.last_error)?;
            }
            writeln!(f)?;
        }
        Ok(())
    }

    fn fmt_goals(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.goals.is_empty() {
            writeln!(f, "replication: no goals")?;
        } else {
            writeln!(f, "replication: {}", count(self.goals.len() as u64, "goal"))?;
            for goal in &self.goals {
                let Some(coding) = &goal.coding else {
                    writeln!(
                        f,
                        "  {} at {} of each shard",
                        goal.dataset,
                        counted(u64::from(goal.replicas), "copy", "copies")
                    )?;
                    continue;
                };
                writeln!(f, "  {} as {coding} fragments of each shard, one per node", goal.dataset)?;
                for v in &goal.versions {
                    writeln!(
                        f,
                        "    @{}: {} shards, {} with all {} fragments up, fewest {} (k = {}); {} at risk, {} unreadable; {} of fragments for {} of data = {:.3} x, against {} ({}x) as {} copies; on disk with whole copies: {} ({:.3} x)",
                        v.version,
                        v.shards,
                        v.shards_complete,
                        v.n,
                        v.fragments_min,
                        v.k,
                        v.shards_at_risk,
                        v.shards_unreadable,
                        size(v.fragment_bytes),
                        size(v.data_bytes),
                        v.fragment_bytes as f64 / v.data_bytes.max(1) as f64,
                        size(v.replicated_bytes),
                        v.n - v.k + 1,
                        v.n - v.k + 1,
                        size(v.fragment_bytes + v.whole_bytes),
                        (v.fragment_bytes + v.whole_bytes) as f64 / v.data_bytes.max(1) as f64
                    )?;
                }
                if goal.versions_omitted > 0 {
                    writeln!(f, "    ({} older live versions not shown)", goal.versions_omitted)?;
                }
            }
            if self.under_replicated == 0 {
                writeln!(f, "  every shard at its goal on the nodes that are up")?;
            } else {
                let under = match self.under_replicated {
                    1 => "1 shard under its goal (for".to_owned(),
                    n => format!("{n} shards under their goal (the oldest for"),
                };
                writeln!(
                    f,
                    "  {under} {}), {} with no copy on a node that is up",
                    took(self.lag_oldest_ms),
                    self.unavailable
                )?;
            }
            let last = self.lag_last_ms.map_or_else(|| "none yet".to_owned(), took);
            writeln!(
                f,
                "  lag: last {last}, worst {}; {} pending",
                took(self.lag_max_ms),
                count(self.pending_fetches as u64, "fetch request")
            )?;
        }
        Ok(())
    }

    /// Transfers, the read cache, hot shards, refusals and recent events.
    fn fmt_traffic(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "transfers: {} made, {} failed; {} received, {} sent; {}, {}, {}",
            counted(self.copies_made, "copy", "copies"),
            self.copies_failed,
            count(self.objects_received, "object"),
            size(self.bytes_sent),
            count(self.verify_failures, "verification failure"),
            counted(self.demotions, "peer demoted", "peers demoted"),
            count(self.repairs, "read repair")
        )?;
        let bound = if self.cache_bytes_max == 0 { "no bound".to_owned() } else { size(self.cache_bytes_max) };
        writeln!(
            f,
            "read cache: {} of {bound} in {}; {} evicted, {} kept as the last copy",
            size(self.cache_bytes),
            count(self.cache_objects as u64, "shard"),
            self.evicted,
            self.kept_last_copy
        )?;
        if self.hot_shards_total > 0 || self.hot_copies_here > 0 {
            let shown: Vec<String> = self
                .hot_shards
                .iter()
                .map(|h| {
                    let mode = if h.synchronous { ", sync" } else { "" };
                    format!("{} ({} reads, {} of {} copies{mode})", h.shard, h.reads, h.copies, h.copies_wanted)
                })
                .collect();
            let more = self.hot_shards_total.saturating_sub(self.hot_shards.len());
            writeln!(
                f,
                "hot shards: {}; {} held here{}{}",
                self.hot_shards_total,
                count(self.hot_copies_here as u64, "hot copy"),
                if shown.is_empty() { String::new() } else { format!(": {}", shown.join(", ")) },
                if more > 0 { format!(" and {more} more") } else { String::new() }
            )?;
        }
        writeln!(
            f,
            "security: {} refused ({} told busy), {} dropped for a bad frame",
            count(self.connections_refused, "connection"),
            self.connections_busy,
            self.frames_rejected
        )?;
        if !self.events.is_empty() {
            let omitted = if self.events_omitted > 0 {
                format!(" ({} older not shown)", self.events_omitted)
            } else {
                String::new()
            };
            writeln!(f, "recent events, oldest first{omitted}:")?;
            for event in &self.events {
                writeln!(f, "  {event}")?;
            }
        }
        Ok(())
    }
}
