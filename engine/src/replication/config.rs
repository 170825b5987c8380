//! How a node is run (`NodeConfig`), and the check of everything it is given, done before it
//! listens: plugin names, plugin options (the plugins' own validation, by running each once),
//! and a peer list that names the node itself.
//!
//! Owns: `NodeConfig` (with the defaults of `NodeConfig::new`), its `check`, and `Faults` (injected
//! by tests, from `GRANARY_FAULT_*`).
//!
//! Invariant: a node that passed `NodeConfig::check` never fails later on what it was given; a
//! configuration that fails it starts nothing (no runtime, no listener, no store lock). Never:
//! repeats a plugin's rules about its options (the plugin is asked).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::membership::Membership;
use super::secure::{ClusterKey, Deadlines};
use crate::error::{Error, PluginError, Result};
use crate::policy::{NodeInfo, PolicyHost, PolicyKind, builtin};

/// Faults to inject, for tests of what the other nodes do about them. Off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Sleep this long after each MiB sent (a slow peer, so a test can kill it mid-transfer).
    pub send_delay_per_mib: Duration,
    /// Flip a byte in every MiB sent (a peer that sends wrong bytes for an id).
    pub corrupt_sends: bool,
}

impl Faults {
    /// From `GRANARY_FAULT_SEND_DELAY_MS` (per MiB) and `GRANARY_FAULT_CORRUPT_SENDS=1`.
    pub fn from_env() -> Self {
        let delay = std::env::var("GRANARY_FAULT_SEND_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            send_delay_per_mib: Duration::from_millis(delay.unwrap_or(0)),
            corrupt_sends: std::env::var("GRANARY_FAULT_CORRUPT_SENDS").is_ok_and(|v| v == "1"),
        }
    }
}

/// How to run a node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The store.
    pub root: PathBuf,
    /// Where to listen for peers and clients.
    pub listen: SocketAddr,
    /// Who the other nodes are.
    pub membership: Membership,
    /// The job's shared secret.
    pub key: ClusterKey,
    /// This node's id; by default the launcher's node rank, or one derived from `listen`.
    pub node_id: Option<u32>,
    /// This node's relative capacity for placement.
    pub weight: u32,
    /// This node's failure domain (by default its node id: every node its own domain).
    pub failure_domain: Option<u32>,
    /// Handshake and per-frame deadlines.
    pub deadlines: Deadlines,
    /// How long a connection may sit idle between requests.
    pub idle: Duration,
    /// How often each peer is probed.
    pub heartbeat: Duration,
    /// A peer that has not answered for this long is down.
    pub down_after: Duration,
    /// How often the reconciler runs when nothing wakes it.
    pub reconcile_every: Duration,
    /// A peer that sent bad bytes is not used as a source for this long.
    pub demote_for: Duration,
    /// How long a publication waits for another writer (an ingest) to release the store.
    pub lock_wait: Duration,
    /// Bytes of shards fetched for reads (not placed here) kept at most; 0: no limit.
    pub cache_bytes_max: u64,
    /// The evictor plugin of that cache (name or path; the built-in default when `None`).
    pub evictor: Option<String>,
    /// The replicator plugin (name or path; the built-in default when `None`) and its options.
    pub replicator: Option<String>,
    /// Options passed to the replicator (`mode=sync`, `buckets=N`).
    pub replicator_options: Vec<(String, String)>,
    /// Options passed to the evictor.
    pub evictor_options: Vec<(String, String)>,
    /// The window shard reads are counted over for hot copies (the reads of the last two
    /// windows count); the hot pass runs every half window.
    pub heat_window: Duration,
    /// Faults to inject (tests).
    pub faults: Faults,
    /// Where the node's metrics are registered: by default the process's registry.
    pub metrics: crate::metrics::Setting,
    /// Where to serve that registry's `/metrics` over HTTP, on the node's runtime (`None`: not
    /// served by the node).
    pub metrics_listen: Option<SocketAddr>,
}

impl NodeConfig {
    /// A configuration with the defaults for everything but the essentials.
    pub fn new(root: impl Into<PathBuf>, listen: SocketAddr, membership: Membership, key: ClusterKey) -> Self {
        Self {
            root: root.into(),
            listen,
            membership,
            key,
            node_id: None,
            weight: 1,
            failure_domain: None,
            deadlines: Deadlines::default(),
            idle: Duration::from_secs(120),
            heartbeat: Duration::from_millis(500),
            down_after: Duration::from_secs(2),
            reconcile_every: Duration::from_secs(1),
            demote_for: Duration::from_secs(300),
            lock_wait: Duration::from_secs(60),
            cache_bytes_max: 0,
            evictor: None,
            replicator: None,
            replicator_options: Vec::new(),
            evictor_options: Vec::new(),
            heat_window: Duration::from_secs(30),
            faults: Faults::default(),
            metrics: crate::metrics::Setting::Process,
            metrics_listen: None,
        }
    }
}

impl NodeConfig {
    /// Checks everything the node is given, before anything starts: the plugins exist and are
    /// of their kind, each takes its options (asked by running it once: the replicator places
    /// a one-node job, the evictor is made for the cache), and no peer is this node itself.
    pub fn check(&self, host: &PolicyHost) -> Result<()> {
        self.check_peers()?;
        let replicator = self.replicator.as_deref();
        check_plugin_name(host, PolicyKind::Replicator, replicator)?;
        let refused = |kind: PolicyKind, options: &[(String, String)], e: Error| {
            Error::invalid_input(format!(
                "the {} does not take the options {}: {e}",
                kind.name(),
                show_options(options)
            ))
        };
        let mut placed = host.replicator(replicator, &self.replicator_options)?;
        let one_node = [NodeInfo { id: 0, weight: 1, failure_domain: 0, up: true }];
        placed.place(&one_node, 1).map_err(|e| refused(PolicyKind::Replicator, &self.replicator_options, e))?;
        let evictor = self.evictor.as_deref();
        check_plugin_name(host, PolicyKind::Evictor, evictor)?;
        // Made whether or not the cache is bounded: a node given an evictor that cannot run is
        // told now, not when a bound is set.
        let capacity_blocks = (self.cache_bytes_max / crate::shard::BLOCK_BYTES_U64).max(1);
        host.evictor(evictor, &self.evictor_options, capacity_blocks).map_err(|e| match e {
            Error::Plugin(PluginError::Rejected { .. }) => refused(PolicyKind::Evictor, &self.evictor_options, e),
            other => other,
        })?;
        Ok(())
    }

    /// Refuses a peer list that names this node (its listen address, or the same port on a
    /// loopback address when it listens on every interface): it would probe itself forever.
    fn check_peers(&self) -> Result<()> {
        let Membership::Peers(peers) = &self.membership else { return Ok(()) };
        let listen = self.listen;
        let is_self = |peer: &SocketAddr| {
            *peer == listen
                || (listen.ip().is_unspecified()
                    && peer.port() == listen.port()
                    && (peer.ip().is_loopback() || peer.ip().is_unspecified()))
        };
        match peers.iter().find(|peer| is_self(peer)) {
            Some(peer) => Err(Error::invalid_input(format!(
                "the peer list names this node itself ({peer}, where it listens): list only the other nodes"
            ))),
            None => Ok(()),
        }
    }
}

/// `KEY=VALUE,...`, as the user wrote them.
fn show_options(options: &[(String, String)]) -> String {
    let shown: Vec<String> = options.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if shown.is_empty() { "(none)".to_owned() } else { shown.join(",") }
}

/// Refuses a plugin name that is neither a built-in nor a file, listing the built-ins of that
/// kind (found by loading them, on this error path only).
fn check_plugin_name(host: &PolicyHost, kind: PolicyKind, name: Option<&str>) -> Result<()> {
    let Some(name) = name else { return Ok(()) };
    if builtin::bytes(name).is_some() || Path::new(name).is_file() {
        return Ok(());
    }
    let of_kind: Vec<&str> = builtin::NAMES
        .iter()
        .copied()
        .filter(|builtin| host.load_builtin(builtin).is_ok_and(|plugin| plugin.kind() == kind))
        .collect();
    Err(Error::invalid_input(format!(
        "no {} plugin {name:?}: not a built-in ({}) nor a .wasm file",
        kind.name(),
        of_kind.join(", ")
    )))
}
