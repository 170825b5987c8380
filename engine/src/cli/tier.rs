//! `granary tier`: the node's tier as an operator sees it: what it holds (of a store's shards,
//! for the page cache tier), its budget, and emptying a memory tier.
//!
//! Owns: `TierCommand` (`tier status`, `tier clear`) and their reports: a memory tier opened as a
//! loader of this environment would open it, but keeping what it holds; for the page cache tier,
//! how much of the store's shard files is in memory (`mincore`). Never: fills a tier, removes an
//! extent but by `tier clear` of a memory tier, or empties the page cache (the kernel's to do).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;
use granary::tier::TierKind;
use granary::{MemoryTier, TierConfig};

use super::show::bytes;

#[derive(Subcommand)]
pub(crate) enum TierCommand {
    /// The tier's kind and budget; what it holds (a memory tier's directory, or, for the page
    /// cache tier, how much of the store's shards under --root is in memory).
    Status {
        /// The tier's directory (default: GRANARY_TIER_DIR, else /dev/shm/granary-tier-UID).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Remove every extent of a memory tier (mappings that readers hold stay valid; their
    /// loaders read from disk or fill it again). The page cache is the kernel's to empty.
    Clear {
        /// The tier's directory (default: GRANARY_TIER_DIR, else /dev/shm/granary-tier-UID).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

pub(crate) fn run(command: TierCommand, root: Option<&Path>) -> Result<()> {
    let (TierCommand::Status { dir } | TierCommand::Clear { dir }) = &command;
    let mut config = TierConfig::from_env()?;
    if dir.is_some() {
        config.dir.clone_from(dir);
        config.kind = TierKind::Memory;
    }
    if config.kind == TierKind::PageCache {
        return page_cache(&command, &config, root);
    }
    // Opened with the budget a loader of this environment would get (the default one when the
    // environment turns the tier off: the directory is looked at all the same).
    let configured = config.budget_bytes;
    if configured == Some(0) {
        config.budget_bytes = None;
    }
    // Keep what is there: this is a look, not a user's run that ends.
    config.keep = true;
    let tier = MemoryTier::open(&config)?.context("the tier opens with a budget")?;
    match command {
        TierCommand::Status { .. } => {
            let (extents, held) = tier.resident()?;
            let dir = tier.dir().context("a memory tier has a directory")?;
            outln!("tier       memory (extent files in a memory file system)")?;
            outln!("directory  {}", dir.display())?;
            if let Some((kind, in_memory)) = granary::tier::file_system_of(dir) {
                let note = if in_memory { "in memory" } else { "not in memory: its extents are files on that disk" };
                outln!("on         {kind} ({note})")?;
            }
            outln!("holds      {} in {} extents of up to {}", bytes(held), extents.len(), bytes(tier.extent_bytes()))?;
            let usable = tier.effective_budget(held);
            match configured {
                Some(0) => outln!("budget     none: GRANARY_TIER_BYTES=0 turns the tier off, loaders read from disk")?,
                Some(budget) => {
                    outln!("budget     {} (GRANARY_TIER_BYTES), {} usable now", bytes(budget), bytes(usable))?
                }
                None => outln!(
                    "budget     {} (a loader's default: half of MemAvailable when it opens), {} usable now",
                    bytes(tier.budget_bytes()),
                    bytes(usable)
                )?,
            }
        }
        TierCommand::Clear { .. } => {
            let (extents, held) = tier.resident()?;
            tier.clear()?;
            let dir = tier.dir().context("a memory tier has a directory")?;
            outln!("removed {} extents ({}) from {}", extents.len(), bytes(held), dir.display())?;
        }
    }
    Ok(())
}

/// `status` and `clear` of the page cache tier: the kernel holds its memory, so what it holds is
/// measured (the store's shard files' pages in memory, with `mincore`), and nothing is removed.
fn page_cache(command: &TierCommand, config: &TierConfig, root: Option<&Path>) -> Result<()> {
    if let TierCommand::Clear { .. } = command {
        outln!(
            "the tier is the page cache (GRANARY_TIER=page-cache, the default): the kernel holds its pages and \
             takes them back as it needs; nothing to clear (as root: echo 1 > /proc/sys/vm/drop_caches)"
        )?;
        return Ok(());
    }
    outln!("tier       page cache (shard files' pages, shared by every process of the node, kept across runs)")?;
    match root {
        Some(root) => {
            let paths = granary::store::StorePaths::new(root);
            paths.check()?;
            let (mut held, mut total, mut shards) = (0u64, 0u64, 0usize);
            for (_, path) in paths.list_objects(granary::store::ObjectKind::Shard)? {
                // A shard that cannot be mapped (removed meanwhile, unreadable) is not counted.
                let Ok(map) = granary::io::MappedFile::open_lazy(&path) else { continue };
                held += map.resident_bytes(0, map.len());
                total += map.len() as u64;
                shards += 1;
            }
            outln!("holds      {} of the {} in {} shards of {}", bytes(held), bytes(total), shards, root.display())?;
        }
        None => outln!("holds      (pass --root STORE to see how much of its shards is in memory)")?,
    }
    match config.budget_bytes {
        Some(0) => outln!("budget     none: GRANARY_TIER_BYTES=0 turns the tier off, loaders read from disk")?,
        Some(budget) => outln!("budget     {} (GRANARY_TIER_BYTES) read ahead for a loader's plan", bytes(budget))?,
        None => {
            let tier = MemoryTier::open(config)?.context("the tier opens with a budget")?;
            outln!(
                "budget     {} (a loader's default: half of MemAvailable when it opens) read ahead for its plan",
                bytes(tier.budget_bytes())
            )?;
        }
    }
    Ok(())
}
