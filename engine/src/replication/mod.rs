//! Replication: the nodes of one training job keep copies of each other's shards, over an
//! authenticated, encrypted transport, as the replicator plugin decides.
//!
//! Owns: the wire format (`frame`, always built, so the fuzzer and the docs need no network
//! stack), the secure channel (`secure`: Noise with the cluster key over TCP), and the node
//! (`Node`, feature `replication`): its own tokio runtime on its own threads, a listener that
//! serves objects to peers, a heartbeat per peer (up/down, inventories), a reconciler that turns
//! replication goals, the membership and the replicator plugin's repair plan into transfers, and
//! read-time repair for readers. Invariants: an object is published on this node only after its
//! bytes hashed to its id (BLAKE3) and decoded as what they claim to be; a partial transfer lives
//! in `incoming/` and is never visible under `shards/`; a peer that sent bytes that did not hash
//! to the id is demoted; the last known copy of a shard is never evicted; every network read has
//! a deadline and every queue a bound. Never: runs on the trainer's threads (the node's runtime
//! has its own), or decides placement itself (the replicator plugin does; the host checks it).

pub mod frame;
#[cfg(feature = "replication")]
mod admission;
#[cfg(feature = "replication")]
mod client;
#[cfg(feature = "replication")]
mod coded;
#[cfg(feature = "replication")]
mod config;
#[cfg(feature = "replication")]
mod flight;
#[cfg(feature = "replication")]
mod heartbeat;
#[cfg(feature = "replication")]
mod heat;
#[cfg(feature = "replication")]
mod heat_state;
#[cfg(feature = "replication")]
mod local;
#[cfg(feature = "replication")]
pub mod membership;
#[cfg(feature = "replication")]
mod metrics;
#[cfg(feature = "replication")]
mod node;
#[cfg(feature = "replication")]
mod peers;
#[cfg(feature = "replication")]
mod pull;
#[cfg(feature = "replication")]
mod read_repair;
#[cfg(feature = "replication")]
mod reconcile;
#[cfg(feature = "replication")]
mod replicate;
#[cfg(feature = "replication")]
pub mod secure;
#[cfg(feature = "replication")]
mod server;
#[cfg(feature = "replication")]
mod shared;
#[cfg(feature = "replication")]
mod status;
#[cfg(feature = "replication")]
pub use client::NodeClient;
#[cfg(feature = "replication")]
pub use membership::Membership;
#[cfg(feature = "replication")]
pub use node::{CodedVersionStatus, Faults, GoalStatus, Node, NodeConfig, NodeStatus, PeerStatus, ReplicateReport};
#[cfg(feature = "replication")]
pub use secure::{ClusterKey, Deadlines};
