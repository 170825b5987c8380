//! A node's metrics: its status report (`Shared::status`) as Prometheus samples at each
//! scrape: replication lag, the cache of fetched shards, transfers, refusals, and each peer's
//! state labelled by its node id (or address before its hello).
//!
//! Owns: `NodeMetrics`, the node's metrics source, and the last report it keeps once the node ends.
//!
//! Never: keeps the node alive (it holds a weak reference; a node being dropped leaves its last
//! report, whose counters the registry keeps, and ends the source), or
//! reports an event's text or an error message (those can name paths and peers; they stay in
//! `granary status`).

use std::sync::Weak;

use parking_lot::Mutex;

use super::shared::Shared;
use super::status::NodeStatus;
use crate::metrics::{Samples, Source, Unit};

/// The metrics source of one node.
pub(super) struct NodeMetrics {
    shared: Weak<Shared>,
    /// The node's last report, taken as it is dropped.
    last: Mutex<Option<NodeStatus>>,
}

impl NodeMetrics {
    pub(super) fn new(shared: Weak<Shared>) -> Self {
        Self { shared, last: Mutex::new(None) }
    }

    /// The node is being dropped: keeps its last report for the registry's retired totals.
    pub(super) fn end(&self) {
        if let Some(shared) = self.shared.upgrade() {
            *self.last.lock() = Some(shared.status());
        }
    }
}

impl Source for NodeMetrics {
    fn ended(&self) -> bool {
        self.last.lock().is_some() || self.shared.strong_count() == 0
    }

    fn collect(&self, out: &mut Samples) {
        let status = match self.last.lock().clone() {
            Some(last) => last,
            None => match self.shared.upgrade() {
                Some(shared) => shared.status(),
                None => return,
            },
        };
        counters(&status, out);
        gauges(&status, out);
        peers(&status, out);
    }
}

/// The node's counters.
fn counters(status: &NodeStatus, out: &mut Samples) {
    let node = || vec![("node", status.id.to_string())];
    let count = |out: &mut Samples, name, help, value: u64| out.counter(name, help, Unit::None, node(), value as f64);
    count(
        out,
        "granary_node_objects_received",
        "Objects received from peers and published here.",
        status.objects_received,
    );
    count(out, "granary_node_copies_made", "Copies this node had peers make.", status.copies_made);
    count(out, "granary_node_copies_failed", "Copies that failed.", status.copies_failed);
    count(
        out,
        "granary_node_verify_failures",
        "Transfers or local copies that failed verification.",
        status.verify_failures,
    );
    count(out, "granary_node_demotions", "Peers demoted for sending bad bytes.", status.demotions);
    count(
        out,
        "granary_node_connections_refused",
        "Connections refused: a failed handshake (wrong key, stale incarnation) or too many.",
        status.connections_refused,
    );
    count(
        out,
        "granary_node_connections_busy",
        "Of the refused connections, those told the node was busy.",
        status.connections_busy,
    );
    count(out, "granary_node_frames_rejected", "Connections dropped for a bad frame.", status.frames_rejected);
    count(out, "granary_node_repairs", "Read-time repairs done.", status.repairs);
    count(out, "granary_node_cache_evictions", "Shards evicted from the cache of fetched shards.", status.evicted);
    out.counter("granary_node_sent", "Bytes sent to peers.", Unit::Bytes, node(), status.bytes_sent as f64);
    out.counter(
        "granary_node_received",
        "Bytes received from peers.",
        Unit::Bytes,
        node(),
        status.bytes_received as f64,
    );
}

/// The node's gauges.
fn gauges(status: &NodeStatus, out: &mut Samples) {
    let node = || vec![("node", status.id.to_string())];
    let gauge = |out: &mut Samples, name, help, value: f64| out.gauge(name, help, Unit::None, node(), value);
    gauge(out, "granary_node_objects", "Objects stored here.", status.objects as f64);
    gauge(
        out,
        "granary_node_under_replicated_shards",
        "Shards of goal datasets with fewer copies than wanted.",
        status.under_replicated as f64,
    );
    gauge(
        out,
        "granary_node_unavailable_shards",
        "Shards of goal datasets with no copy on a node that is up.",
        status.unavailable as f64,
    );
    gauge(out, "granary_node_pending_fetches", "Fetch requests outstanding with peers.", status.pending_fetches as f64);
    gauge(out, "granary_node_cache_objects", "Shards in the cache of fetched shards.", status.cache_objects as f64);
    gauge(
        out,
        "granary_node_hot_shards",
        "Shards the replicator's last hot pass gave more copies.",
        status.hot_shards_total as f64,
    );
    gauge(out, "granary_node_hot_copies", "Hot copies this node holds.", status.hot_copies_here as f64);
    out.gauge(
        "granary_node_under_replicated_oldest_age",
        "How long the oldest under-replicated shard has been so.",
        Unit::Seconds,
        node(),
        status.lag_oldest_ms as f64 / 1e3,
    );
    out.gauge(
        "granary_node_cache",
        "Bytes of shards in the cache of fetched shards.",
        Unit::Bytes,
        node(),
        status.cache_bytes as f64,
    );
    out.gauge(
        "granary_node_under_replicated",
        "Bytes of the shards of goal datasets with fewer copies than wanted.",
        Unit::Bytes,
        node(),
        status.under_replicated_bytes as f64,
    );
    out.gauge("granary_node_uptime", "Since the node started.", Unit::Seconds, node(), status.uptime_ms as f64 / 1e3);
}

/// Each peer's gauges and counters, as this node sees them.
fn peers(status: &NodeStatus, out: &mut Samples) {
    for peer in &status.peers {
        let labels = || {
            let name = peer.id.map_or_else(|| peer.addr.to_string(), |id| id.to_string());
            vec![("node", status.id.to_string()), ("peer", name)]
        };
        out.gauge(
            "granary_peer_up",
            "Whether the peer answers heartbeats (1) or not (0).",
            Unit::None,
            labels(),
            f64::from(u8::from(peer.up)),
        );
        out.gauge(
            "granary_peer_demoted",
            "Whether the peer is demoted for sending bad bytes.",
            Unit::None,
            labels(),
            f64::from(u8::from(peer.demoted)),
        );
        if let Some(ago) = peer.answered_ms_ago {
            out.gauge(
                "granary_peer_heartbeat_age",
                "Since the peer last answered a heartbeat.",
                Unit::Seconds,
                labels(),
                ago as f64 / 1e3,
            );
        }
        out.gauge("granary_peer_objects", "Objects the peer lists.", Unit::None, labels(), peer.objects as f64);
        out.counter(
            "granary_peer_sent",
            "Bytes of objects sent to the peer.",
            Unit::Bytes,
            labels(),
            peer.bytes_sent as f64,
        );
        out.counter(
            "granary_peer_received",
            "Bytes of objects received from the peer.",
            Unit::Bytes,
            labels(),
            peer.bytes_received as f64,
        );
    }
}
