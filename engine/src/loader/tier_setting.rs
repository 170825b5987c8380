//! Whether and how a loader uses the node's memory tier, and opening it: a tier that cannot work
//! on this node is done without (said once), a setting that cannot be right is an error.
//!
//! Owns: `TierSetting` and its `open`. Never: fills, reads or evicts (the `tier` module does), or
//! decides a loader's tier when given one (`Shared` is used as it is).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::tier::{MemoryTier, TierConfig};

/// Whether and how a loader uses the node's memory tier.
#[derive(Clone, Debug, Default)]
pub enum TierSetting {
    /// The default tier (`TierConfig::from_env`: the page cache, half of MemAvailable unless
    /// `GRANARY_TIER_BYTES` says otherwise). A bad `GRANARY_TIER`, `GRANARY_TIER_BYTES` or
    /// `GRANARY_TIER_DIR` (one that is not this user's alone), or a `GRANARY_TIER_EVICTOR` that
    /// does not load, is an error; a tier that cannot work here (its directory on a read-only
    /// or full file system, no /dev/shm) is left off: reads go to disk, and a warning says so
    /// once per process.
    #[default]
    Auto,
    /// No memory tier: every record is read from disk.
    Off,
    /// This tier; an error for a setting that cannot be right, and off (with the warning, as
    /// `Auto`) when it cannot work here.
    Config(TierConfig),
    /// A tier already open (kept by the caller across loaders, so it is not emptied between
    /// them).
    Shared(Arc<MemoryTier>),
}

impl TierSetting {
    /// The tier to use, if any.
    pub fn open(&self) -> Result<Option<Arc<MemoryTier>>> {
        match self {
            TierSetting::Auto => open_or_do_without(&TierConfig::from_env()?),
            TierSetting::Off => Ok(None),
            TierSetting::Config(config) => open_or_do_without(config),
            TierSetting::Shared(tier) => Ok(Some(Arc::clone(tier))),
        }
    }
}

/// Opens the tier `config` describes; one that fails for the system's reasons (an I/O error:
/// a read-only or full file system, a directory that cannot be made) is done without, said
/// once per process: the loader reads from disk, as it would with the tier off; so is the
/// default directory that cannot be the tier's. A setting that cannot be right (a directory
/// named that is not this user's alone, an evictor named that does not load) is an error.
fn open_or_do_without(config: &TierConfig) -> Result<Option<Arc<MemoryTier>>> {
    static WARNED: AtomicBool = AtomicBool::new(false);
    match MemoryTier::open(config) {
        Err(Error::Plugin(error)) if config.evictor.is_some() => Err(Error::Plugin(error)),
        // The default directory that cannot be the tier's is the system's doing too.
        Err(error) if matches!(error, Error::Io { .. }) || config.dir.is_none() => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                eprintln!("granary: the memory tier cannot work here ({error}); reading from disk without it");
            }
            Ok(None)
        }
        opened => opened,
    }
}
