//! A hostile partitioner for the host's tests. Option `behave`: `loop`, `overlap` (a record
//! twice), `out-of-range` (past the last record), `missing` (drops a record), `down-rank`
//! (gives records to a rank that is down), `unknown-rank`, `empty-range`, `valid` (every record
//! to the first rank that is up, in order). Without the option it drops a record, so it fails
//! `plugin check`. Its `rebalance` answers by option `rebalance`: `zero` (a weight of 0),
//! `huge` (a weight above 2^20), `missing` (a rank left out), `twice` (a rank twice), `loop`;
//! otherwise the weights it was given.
#![cfg(target_arch = "wasm32")]

use granary_policy_sdk::partitioner_bindings::exports::granary::policy::partitioner as wit;
use granary_policy_sdk::partitioner_bindings::granary::policy::types::PolicyError;

struct Plugin;

impl wit::Guest for Plugin {
    fn plan(
        shards: Vec<wit::Shard>,
        membership: wit::Membership,
        epoch: wit::Epoch,
        options: Vec<(String, String)>,
    ) -> Result<Vec<wit::RankPlan>, PolicyError> {
        let behave = options.iter().find(|(k, _)| k == "behave").map_or("missing", |(_, v)| v.as_str());
        let total: u64 = shards.iter().map(|s| s.records).sum();
        let first_up = membership.ranks.iter().find(|r| r.up).map(|r| r.id).unwrap_or(0);
        let range = |start, end| wit::RecordRange { start, end };
        let plan = |rank, ranges| wit::RankPlan { rank, ranges };
        Ok(match behave {
            "loop" => loop {
                std::hint::black_box(());
            },
            "overlap" => vec![plan(first_up, vec![range(epoch.start, total), range(epoch.start, epoch.start + 1)])],
            "out-of-range" => vec![plan(first_up, vec![range(epoch.start, total + 1)])],
            "missing" => vec![plan(first_up, vec![range(epoch.start + 1, total)])],
            "down-rank" => {
                let down = membership.ranks.iter().find(|r| !r.up).map(|r| r.id).unwrap_or(first_up);
                vec![plan(down, vec![range(epoch.start, total)])]
            }
            "unknown-rank" => vec![plan(9999, vec![range(epoch.start, total)])],
            "empty-range" => vec![plan(first_up, vec![range(epoch.start, epoch.start), range(epoch.start, total)])],
            _ => vec![plan(first_up, vec![range(epoch.start, total)])],
        })
    }

    fn rebalance(
        point: wit::RebalancePoint,
        options: Vec<(String, String)>,
    ) -> Result<Vec<wit::RankWeight>, PolicyError> {
        let behave = options.iter().find(|(k, _)| k == "rebalance").map_or("same", |(_, v)| v.as_str());
        let mut weights = point.weights;
        match behave {
            "loop" => loop {
                std::hint::black_box(());
            },
            "zero" => weights[0].weight = 0,
            "huge" => weights[0].weight = (1 << 20) + 1,
            "missing" => {
                weights.pop();
            }
            "twice" => {
                let first = weights[0];
                weights.push(first);
            }
            _ => {}
        }
        Ok(weights)
    }
}

granary_policy_sdk::partitioner_bindings::__export_partitioner_world!(Plugin with_types_in granary_policy_sdk::partitioner_bindings);
