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
    // Opened with the configured budget, or one byte when it is off, only to look.
    let budget = config.budget_bytes.filter(|&b| b > 0);
    config.budget_bytes = Some(budget.unwrap_or(1));
    // Keep what is there: this is a look, not a user's run that ends.
    config.keep = true;
    let tier = MemoryTier::open(&config)?.context("the tier opens with a budget")?;
    match command {
        TierCommand::Status { .. } => {
            let (extents, held) = tier.resident()?;
            outln!("directory  {}", tier.dir().display())?;
            outln!("holds      {} in {} extents of up to {}", bytes(held), extents.len(), bytes(tier.extent_bytes()))?;
            match budget {
                Some(budget) => outln!("budget     {} (GRANARY_TIER_BYTES)", bytes(budget))?,
                None => outln!(
                    "budget     set by each loader (default: half of MemAvailable, now {} after memory pressure)",
                    bytes(tier.effective_budget(held))
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
