//! `granary tier`: the node's memory tier as an operator sees it: what it holds, and emptying it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use granary::{MemoryTier, TierConfig};

use super::show::bytes;

#[derive(Subcommand)]
pub(crate) enum TierCommand {
    /// The tier's directory, the bytes and extents it holds, its budget.
    Status {
        /// The tier's directory (default: GRANARY_TIER_DIR, else /dev/shm/granary-tier-UID).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Remove every extent (mappings that readers hold stay valid; their loaders read from
    /// disk or fill it again).
    Clear {
        /// The tier's directory (default: GRANARY_TIER_DIR, else /dev/shm/granary-tier-UID).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

pub(crate) fn run(command: TierCommand) -> Result<()> {
    let (TierCommand::Status { dir } | TierCommand::Clear { dir }) = &command;
    let mut config = TierConfig::from_env()?;
    if dir.is_some() {
        config.dir.clone_from(dir);
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
            outln!("directory  {}", tier.dir().display())?;
            if let Some((kind, in_memory)) = granary::tier::file_system_of(tier.dir()) {
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
            outln!("removed {} extents ({}) from {}", extents.len(), bytes(held), tier.dir().display())?;
        }
    }
    Ok(())
}
