//! How a tier is asked for: `TierConfig` (its kind, directory, budget and extent size, from
//! options or `GRANARY_TIER_*`), `TierKind`, and their parsing (sizes in `crate::size`'s grammar).
//!
//! Owns those types, their defaults (the extent size follows the node's memory) and the
//! parsing of sizes. Never: opens the tier or touches a file.

use std::path::PathBuf;

use super::memory::Memory;
use crate::error::{Error, Result};
use crate::shard::BLOCK_BYTES_U64;

/// The smallest default extent size: large enough that a fill reads at the disk's sequential
/// rate, small enough that a budget of a few GiB holds hundreds of them.
pub const EXTENT_BYTES_DEFAULT: u64 = 4 << 20;

/// Extents a tier holds at most. Every extent is one mapping in each process that reads it, and
/// a process has 65530 (`vm.max_map_count`) for everything it maps: the default extent size
/// grows with the node's memory so that a tier as large as the memory stays under this.
pub const EXTENTS_MAX: u64 = 16 << 10;

/// The default extent size on this node: 4 MiB, or the power of two that keeps a tier of all
/// of the node's memory within `EXTENTS_MAX` extents. Every process of the node computes the
/// same, so they share extents.
pub fn default_extent_bytes() -> u64 {
    let total = Memory::read().total;
    if total == u64::MAX {
        return EXTENT_BYTES_DEFAULT;
    }
    total.div_ceil(EXTENTS_MAX).next_power_of_two().clamp(EXTENT_BYTES_DEFAULT, 1 << 30)
}

/// Where the tier's memory is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TierKind {
    /// The kernel's page cache: shard files mapped read-only, extents read in ahead of the plan.
    /// Shared by every process of the node, kept across loaders, processes and restarts,
    /// reclaimed by the kernel under pressure (`page_cache.rs`).
    #[default]
    PageCache,
    /// Extent files in a memory file system (`/dev/shm`), filled with O_DIRECT reads, emptied
    /// when the last process using it closes it.
    Memory,
}

impl TierKind {
    /// The kind `GRANARY_TIER` names: `page-cache` or `memory`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "page-cache" => Some(Self::PageCache),
            "memory" => Some(Self::Memory),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::PageCache => "page-cache",
            Self::Memory => "memory",
        }
    }
}

/// How the tier is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// Where the tier's memory is (the page cache by default).
    pub kind: TierKind,
    /// Bytes the tier may hold node-wide; `None`: half of MemAvailable (and of the cgroup's
    /// limit) when the tier opens. 0 turns the tier off.
    pub budget_bytes: Option<u64>,
    /// The memory tier's directory (in a memory file system); `None`:
    /// `/dev/shm/granary-tier-UID`. A page cache tier has none.
    pub dir: Option<PathBuf>,
    /// Bytes per extent, a multiple of 4 KiB (`default_extent_bytes`: 4 MiB, more on a node
    /// of more than 64 GiB). Processes share only extents of the same size.
    pub extent_bytes: u64,
    /// Threads reading extents from disk into the tier (4 by default: on a 2-core machine the
    /// fill is bound by the kernel's page allocation for the tier's memory, not by the disk, and
    /// more threads than cores keep the disk busy while others allocate).
    pub fill_threads: usize,
    /// Leave the extents in place when the last user closes the tier (a later run starts warm;
    /// the memory stays taken until someone clears it).
    pub keep: bool,
    /// The evictor plugin (a built-in name or a `.wasm` file) that chooses which extents make
    /// room among those the plan does not hold; `None`: `plan-aware` (Belady on the plan). Each
    /// process runs its own, told what the tier holds node-wide. Needs the `policy` feature.
    pub evictor: Option<String>,
    /// The evictor's options (the built-ins take none).
    pub evictor_options: Vec<(String, String)>,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            kind: TierKind::default(),
            budget_bytes: None,
            dir: None,
            extent_bytes: default_extent_bytes(),
            fill_threads: 4,
            keep: false,
            evictor: None,
            evictor_options: Vec::new(),
        }
    }
}

impl TierConfig {
    /// The default, with `GRANARY_TIER` (`page-cache` or `memory`; a `GRANARY_TIER_DIR` alone
    /// means `memory`), `GRANARY_TIER_BYTES` (0 turns it off; size suffixes as `4GiB`),
    /// `GRANARY_TIER_DIR`, `GRANARY_TIER_KEEP=1` and `GRANARY_TIER_EVICTOR` applied.
    pub fn from_env() -> Result<Self> {
        let mut config = Self::default();
        if std::env::var_os("GRANARY_TIER_DIR").is_some() {
            config.kind = TierKind::Memory;
        }
        if let Ok(kind) = std::env::var("GRANARY_TIER") {
            config.kind = TierKind::parse(&kind).ok_or_else(|| {
                Error::invalid_input(format!("GRANARY_TIER={kind:?} is not a tier (page-cache or memory)"))
            })?;
        }
        if let Ok(bytes) = std::env::var("GRANARY_TIER_BYTES") {
            config.budget_bytes = Some(crate::size::parse_bytes(&bytes).map_err(|_| {
                Error::invalid_input(format!("GRANARY_TIER_BYTES={bytes:?} is not a size (as 0, 512MiB or 8GiB)"))
            })?);
        }
        if let Some(dir) = std::env::var_os("GRANARY_TIER_DIR") {
            config.dir = Some(PathBuf::from(dir));
        }
        config.keep = std::env::var("GRANARY_TIER_KEEP").is_ok_and(|v| v == "1");
        config.evictor = std::env::var("GRANARY_TIER_EVICTOR").ok().filter(|name| !name.is_empty());
        Ok(config)
    }

    /// A tier that is off.
    pub fn off() -> Self {
        Self { budget_bytes: Some(0), ..Self::default() }
    }

    pub(super) fn validate(&self) -> Result<()> {
        if self.extent_bytes == 0 || !self.extent_bytes.is_multiple_of(BLOCK_BYTES_U64) || self.extent_bytes > 1 << 30 {
            return Err(Error::invalid_input(format!(
                "tier extent size {} is not a multiple of 4096 in 4 KiB..=1 GiB",
                self.extent_bytes
            )));
        }
        if self.fill_threads == 0 || self.fill_threads > 64 {
            return Err(Error::invalid_input(format!("tier fill threads {} is not in 1..=64", self.fill_threads)));
        }
        if self.kind == TierKind::PageCache && self.dir.is_some() {
            return Err(Error::invalid_input(
                "a tier directory is for the memory tier: the page cache tier has none (GRANARY_TIER=memory)",
            ));
        }
        if self.kind == TierKind::PageCache && self.keep {
            return Err(Error::invalid_input(
                "keeping the tier is for the memory tier: the page cache tier is kept by the kernel",
            ));
        }
        #[cfg(not(feature = "policy"))]
        if self.evictor.is_some() {
            return Err(Error::invalid_input("a tier evictor plugin needs granary built with the `policy` feature"));
        }
        Ok(())
    }
}
