//! The other ranks of this node in the plan an origin cache is told: the shards they read at
//! each step, planned on a thread of their own and handed to the cache beside this rank's.
//!
//! Owns: the thread that plans the node's other ranks (`LOCAL_WORLD_SIZE`, as the memory tier's
//! schedule does) one epoch at a time when the reader asks, and merges their shards per step.
//! Every rank of a node runs in step with the others, so step `s` of each is step `s` of the
//! node: a shard a neighbour reads soon is not evicted as one nobody needs, and is fetched ahead
//! for it. Never: blocks the reader (which tells the cache its own rank's plan itself, at once),
//! reads data, or fails a run (a plan that cannot be made leaves the cache with this rank's).

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;

use super::{EpochPlanner, LoaderConfig, PlanConfig, shards_by_step};
use crate::error::Result;
use crate::id::ShardId;
use crate::plan::{Position, World};
use crate::read::{Dataset, ShardSource};

/// The planning thread and the channel to it: dropped, it closes the channel, then joins the
/// thread.
pub(super) struct NodePlan {
    send: Option<Sender<(u64, Position)>>,
    thread: Option<JoinHandle<()>>,
}

impl NodePlan {
    /// Starts the thread that tells `hook` what `peers` (this node's other ranks) read, or
    /// `None` when this rank is alone on its node.
    pub(super) fn start(
        dataset: &Arc<Dataset>,
        config: &LoaderConfig,
        hook: Arc<dyn ShardSource>,
        peers: Vec<World>,
    ) -> Result<Option<Self>> {
        if peers.is_empty() {
            return Ok(None);
        }
        let plan = PlanConfig::of_peers(config);
        let dataset = Arc::clone(dataset);
        let (send, receive) = std::sync::mpsc::channel::<(u64, Position)>();
        let thread = super::spawn("granary-node-plan", move || {
            let Ok(mut planner) = EpochPlanner::new(&plan, &dataset) else { return };
            while let Ok((first_step, from)) = receive.recv() {
                let Ok(epochs) = planner.epochs(from, &peers) else { continue };
                let mut merged: Vec<Vec<ShardId>> = Vec::new();
                for batches in &epochs {
                    merge(&mut merged, shards_by_step(&dataset, batches));
                }
                hook.plan(first_step, &merged);
            }
        })?;
        Ok(Some(Self { send: Some(send), thread: Some(thread) }))
    }

    /// Plans the other ranks' epoch from `from` (a global position, the one this rank's epoch
    /// starts from), its first batch being step `first_step`.
    pub(super) fn request(&self, first_step: u64, from: Position) {
        if let Some(send) = &self.send {
            // A thread that is gone (its plugin failed to load) leaves the cache this rank's plan.
            let _ = send.send((first_step, from));
        }
    }
}

impl Drop for NodePlan {
    fn drop(&mut self) {
        self.send = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Adds `more`'s shards of each step to `into`'s, each once per step.
fn merge(into: &mut Vec<Vec<ShardId>>, more: Vec<Vec<ShardId>>) {
    if into.len() < more.len() {
        into.resize_with(more.len(), Vec::new);
    }
    for (step, shards) in more.into_iter().enumerate() {
        for shard in shards {
            if !into[step].contains(&shard) {
                into[step].push(shard);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ObjectId;

    #[test]
    fn merged_steps_hold_each_shard_once() {
        let (a, b, c) = (ShardId(ObjectId::of(b"a")), ShardId(ObjectId::of(b"b")), ShardId(ObjectId::of(b"c")));
        let mut into = vec![vec![a]];
        merge(&mut into, vec![vec![a, b], vec![c]]);
        assert_eq!(into, vec![vec![a, b], vec![c]]);
    }
}
