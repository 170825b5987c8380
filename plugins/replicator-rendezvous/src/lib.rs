//! Weighted rendezvous replication: each bucket of shard keys goes to the nodes of highest
//! weighted rendezvous score, at most one per failure domain while distinct domains remain.
//! Shares follow node weights, and adding or removing a node moves only the copies it gains or
//! loses. Options: `buckets` (table size, default 4096), `mode` (`async` default, or `sync`).

use granary_policy_sdk::hash::{mix, rendezvous_score};
use granary_policy_sdk::replicate::{Mode, Node, Placement, Replicator};
use granary_policy_sdk::{Error, Options};

/// The rendezvous replicator.
pub struct Rendezvous;

impl Replicator for Rendezvous {
    fn place(nodes: &[Node], replicas: u32, options: &Options) -> Result<Placement, Error> {
        options.allow_only(&["buckets", "mode"])?;
        let buckets: u32 = options.parse("buckets", 4096)?;
        if buckets == 0 || buckets > 1 << 20 {
            return Err(Error::InvalidInput("buckets must be in 1..=1048576".into()));
        }
        let mode = match options.get("mode").unwrap_or("async") {
            "async" => Mode::Async,
            "sync" => Mode::Sync,
            other => return Err(Error::InvalidInput(format!("unknown mode {other:?} (sync or async)"))),
        };
        let up: Vec<&Node> = nodes.iter().filter(|n| n.up && n.weight > 0).collect();
        if up.is_empty() {
            return Err(Error::InvalidInput("no node is up".into()));
        }
        let copies = (replicas as usize).min(up.len());
        let mut scored: Vec<(f64, &Node)> = Vec::with_capacity(up.len());
        let table = (0..buckets)
            .map(|bucket| {
                let key = mix(u64::from(bucket) ^ 0x243f_6a88_85a3_08d3);
                scored.clear();
                scored.extend(up.iter().map(|n| (rendezvous_score(key, u64::from(n.id), n.weight), *n)));
                scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.id.cmp(&b.1.id)));
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
