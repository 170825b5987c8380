//! `Goal`: what a dataset's shards are kept as across the job's nodes, in its text form (goal
//! files) and on the wire (`PutRef`, `Replicate`).
//!
//! Owns: `Goal`, its text form (`parse`, `Display`) and its wire form (`wire`, `from_wire`). Never:
//! reads or writes a goal file or a frame (`LocalStore` and the frame codec do), or decodes 0
//! copies, or a coding whose node count differs from the frame's.

use super::{FrameError, Kind};
use crate::erasure::Coding;

/// What a dataset's shards are kept as across the job's nodes: whole copies, or erasure-coded
/// fragments (`k + m` of them on as many nodes, any `k` of which rebuild the shard).
///
/// On the wire (`PutRef`, `Replicate`): `replicas u32` then, in two bytes that older frames kept
/// zero, `k u8 | m u8`; zero for copies, else the coding, with `replicas` its `k + m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Goal {
    /// This many copies of each shard, on as many nodes.
    Replicas(u32),
    /// The shards cut into fragments with this coding, one per node.
    Coded(Coding),
}

impl Goal {
    /// Nodes each shard spans: its copies, or its fragments.
    pub fn nodes(self) -> u32 {
        match self {
            Goal::Replicas(replicas) => replicas,
            Goal::Coded(coding) => coding.n() as u32,
        }
    }

    /// Parses the text form: `replicas R` or `ec K+M`.
    pub fn parse(text: &str) -> Option<Goal> {
        if let Some(rest) = text.strip_prefix("replicas ") {
            return rest.parse::<u32>().ok().filter(|&r| r >= 1).map(Goal::Replicas);
        }
        text.strip_prefix("ec ").and_then(|rest| Coding::parse(rest).ok()).map(Goal::Coded)
    }

    pub(super) fn wire(self) -> (u32, [u8; 2]) {
        // `Replicas(0)` is refused before it is encoded (`encode`).
        match self {
            Goal::Replicas(replicas) => (replicas, [0, 0]),
            Goal::Coded(coding) => (coding.n() as u32, [coding.k(), coding.m()]),
        }
    }

    pub(super) fn from_wire(replicas: u32, km: [u8; 2], kind: Kind) -> Result<Goal, FrameError> {
        let bad = |detail: String| FrameError::BadField { kind: kind.name(), field: "goal", detail };
        match km {
            [0, 0] if replicas >= 1 => Ok(Goal::Replicas(replicas)),
            [0, 0] => Err(bad("0 copies".to_owned())),
            [k, m] => {
                let coding = Coding::new(k, m).map_err(|_| bad(format!("coding {k}+{m} is out of range")))?;
                if replicas as usize != coding.n() {
                    return Err(bad(format!("coding {coding} spans {} nodes, not {replicas}", coding.n())));
                }
                Ok(Goal::Coded(coding))
            }
        }
    }
}

impl std::fmt::Display for Goal {
    /// The text form `Goal::parse` reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Goal::Replicas(replicas) => write!(f, "replicas {replicas}"),
            Goal::Coded(coding) => write!(f, "ec {coding}"),
        }
    }
}
