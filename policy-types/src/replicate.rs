//! The replicator's records: the placement table it answers (`Placement`), where copies are
//! (`Holding`) and which to make (`Transfer`), and the inputs and answers of `adapt` (`NodeSpace`,
//! `ShardHeat`, `ShardGoal`). A shard is named by its key (`shard_key`).

pub use crate::partition::Node;

/// Whether an ingest waits for its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Wait until the copies are verified on their nodes.
    Synchronous,
    /// Copy in the background.
    Asynchronous,
}

/// Where every shard's copies go, as a table: shard key k lives on `buckets[k % len]`, most
/// preferred first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Sync or async.
    pub mode: Mode,
    /// The table.
    pub buckets: Vec<Vec<u32>>,
}

impl Placement {
    /// The nodes of the shard of key `key` (none in an empty table).
    pub fn nodes(&self, key: u64) -> &[u32] {
        let len = self.buckets.len() as u64;
        if len == 0 { &[] } else { &self.buckets[(key % len) as usize] }
    }
}

/// The placement key of a shard: the first 8 bytes of its id, little-endian.
pub fn shard_key(shard_id: &[u8; 32]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&shard_id[..8]);
    u64::from_le_bytes(word)
}

/// Where a shard's copies are now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The shard's key.
    pub key: u64,
    /// Nodes with a copy.
    pub nodes: Vec<u32>,
}

/// One copy to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The shard's key.
    pub key: u64,
    /// A node with a copy.
    pub source: u32,
    /// The node to copy to.
    pub target: u32,
}

/// A node's free space, as it last reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSpace {
    /// The node.
    pub id: u32,
    /// Bytes its store may still take.
    pub free_bytes: u64,
}

/// A shard as the job reads it: the input of `adapt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardHeat {
    /// The shard's key.
    pub key: u64,
    /// Bytes of the shard file.
    pub bytes: u64,
    /// How often it was read over the last window, summed over the nodes (each batch of a
    /// node's readers that reads its records counts once).
    pub reads: u64,
    /// Nodes that hold a copy now.
    pub holders: Vec<u32>,
    /// The nodes the previous answer named for it (empty: it had no goal).
    pub previous: Vec<u32>,
}

/// Where one shard's copies should be, when not where the table puts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardGoal {
    /// The shard's key.
    pub key: u64,
    /// The nodes that should hold a copy, most preferred first (distinct, up).
    pub nodes: Vec<u32>,
    /// Whether the policy calls it core (synchronous); reported, hot copies are pulled in the
    /// background either way.
    pub mode: Mode,
}

#[cfg(test)]
mod tests {
    use super::{Mode, Placement, shard_key};

    #[test]
    fn a_key_is_the_ids_first_eight_bytes_and_picks_a_bucket() {
        let mut id = [0u8; 32];
        id[0] = 5;
        id[8] = 0xff;
        assert_eq!(shard_key(&id), 5);
        let placement = Placement { mode: Mode::Synchronous, buckets: vec![vec![1], vec![2, 3]] };
        assert_eq!(placement.nodes(shard_key(&id)), [2, 3]);
        assert_eq!(Placement { mode: Mode::Asynchronous, buckets: Vec::new() }.nodes(7), [] as [u32; 0]);
    }
}
