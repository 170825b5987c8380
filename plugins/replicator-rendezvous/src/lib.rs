//! Weighted rendezvous replication: each bucket of shard keys goes to the nodes of highest
//! weighted rendezvous score, at most one per failure domain while distinct domains remain.
//! Shares follow node weights, and adding or removing a node moves only the copies it gains or
//! loses. Options: `buckets` (table size, default 4096), `mode` (`async` default, or `sync`).
//!
//! Hot shards (`adapt`): with `hot-replicas=H` (H above the factor; default 0, off), a shard
//! read more than `hot-factor` (default 4) times the mean of the shards asked about is hot: it
//! gets H copies, on its table nodes and then the next nodes of its bucket's rendezvous order
//! with room for it, and synchronous mode (it is the core of the job's reads). A shard that was
//! hot at the previous answer stays hot until its reads fall below half that threshold, so a
//! shard near the line does not flap; a cool shard gets no goal and drops back to the table's
//! copies.

use granary_policy_sdk::hash::{mix, rendezvous_score};
use granary_policy_sdk::replicate::{Mode, Node, NodeSpace, Placement, Replicator, ShardGoal, ShardHeat};
use granary_policy_sdk::{Error, Options};

/// The rendezvous replicator.
pub struct Rendezvous;

const OPTIONS: &[&str] = &["buckets", "mode", "hot-replicas", "hot-factor"];

/// The key that ranks the nodes of `bucket`.
fn bucket_key(bucket: u32) -> u64 {
    mix(u64::from(bucket) ^ 0x243f_6a88_85a3_08d3)
}

/// The up nodes of positive weight, most preferred first for `key`.
fn ranked<'a>(up: &[&'a Node], key: u64) -> Vec<(f64, &'a Node)> {
    let mut scored: Vec<(f64, &Node)> =
        up.iter().map(|n| (rendezvous_score(key, u64::from(n.id), n.weight), *n)).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.id.cmp(&b.1.id)));
    scored
}

impl Replicator for Rendezvous {
    fn adapt(
        nodes: &[Node],
        space: &[NodeSpace],
        replicas: u32,
        shards: &[ShardHeat],
        options: &Options,
    ) -> Result<Vec<ShardGoal>, Error> {
        let placement = Self::place(nodes, replicas, options)?;
        let hot_replicas: u32 = options.parse("hot-replicas", 0)?;
        let hot_factor: f64 = options.parse("hot-factor", 4.0)?;
        if !(hot_factor > 1.0 && hot_factor < 1e9) {
            return Err(Error::InvalidInput("hot-factor must be above 1".into()));
        }
        if hot_replicas <= replicas || shards.is_empty() {
            return Ok(Vec::new());
        }
        let up: Vec<&Node> = nodes.iter().filter(|n| n.up && n.weight > 0).collect();
        let mean = shards.iter().map(|h| h.reads as f64).sum::<f64>() / shards.len() as f64;
        let (hot, stays_hot) = (mean * hot_factor, mean * hot_factor / 2.0);
        let free = |id: u32| space.iter().find(|n| n.id == id).map_or(u64::MAX, |n| n.free_bytes);
        let buckets = placement.buckets.len() as u64;
        let mut goals = Vec::new();
        for shard in shards {
            let table = placement.nodes(shard.key);
            let was_hot = !shard.previous.is_empty();
            let reads = shard.reads as f64;
            if !(reads > hot || (was_hot && reads > 0.0 && reads >= stays_hot)) {
                continue;
            }
            let mut chosen: Vec<u32> = table.to_vec();
            // Extra copies go where the bucket's order continues, to nodes with room (or already
            // holding it).
            let bucket = (shard.key % buckets) as u32;
            for (_, node) in ranked(&up, bucket_key(bucket)) {
                if chosen.len() >= hot_replicas as usize {
                    break;
                }
                let holds = shard.holders.contains(&node.id);
                if !chosen.contains(&node.id) && (holds || free(node.id) >= shard.bytes) {
                    chosen.push(node.id);
                }
            }
            if chosen.len() > table.len() {
                goals.push(ShardGoal { key: shard.key, nodes: chosen, mode: Mode::Synchronous });
            }
        }
        Ok(goals)
    }

    fn place(nodes: &[Node], replicas: u32, options: &Options) -> Result<Placement, Error> {
        options.allow_only(OPTIONS)?;
        let buckets: u32 = options.parse("buckets", 4096)?;
        if buckets == 0 || buckets > 1 << 20 {
            return Err(Error::InvalidInput("buckets must be in 1..=1048576".into()));
        }
        let mode = match options.get("mode").unwrap_or("async") {
            "async" => Mode::Asynchronous,
            "sync" => Mode::Synchronous,
            other => return Err(Error::InvalidInput(format!("unknown mode {other:?} (sync or async)"))),
        };
        let up: Vec<&Node> = nodes.iter().filter(|n| n.up && n.weight > 0).collect();
        if up.is_empty() {
            return Err(Error::InvalidInput("no node is up".into()));
        }
        let copies = (replicas as usize).min(up.len());
        let table = (0..buckets)
            .map(|bucket| {
                let scored = ranked(&up, bucket_key(bucket));
                let mut chosen: Vec<u32> = Vec::with_capacity(copies);
                let mut domains: Vec<u32> = Vec::with_capacity(copies);
                for (_, node) in &scored {
                    if chosen.len() == copies {
                        break;
                    }
                    if !domains.contains(&node.failure_domain) {
                        chosen.push(node.id);
                        domains.push(node.failure_domain);
                    }
                }
                for (_, node) in &scored {
                    if chosen.len() == copies {
                        break;
                    }
                    if !chosen.contains(&node.id) {
                        chosen.push(node.id);
                    }
                }
                chosen
            })
            .collect();
        Ok(Placement { mode, buckets: table })
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_replicator!(Rendezvous);
