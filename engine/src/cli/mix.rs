//! `granary mix`: what a mixture reads, before a run reads it.
//!
//! Owns the command's arguments, the parsing of `NAME=WEIGHT` sources, and its report: each
//! source's version, records, weight, draws per epoch and passes over it. Never: reads record
//! data (the counts are the blend's arithmetic) or writes anything.

use anyhow::{Context, Result, bail};
use granary::{EpochLength, Mixture, StorePaths, VersionSpec};

/// The arguments of `granary mix`.
#[derive(clap::Args, Debug)]
pub(super) struct MixArgs {
    /// Sources as NAME=WEIGHT (NAME, NAME@N or a manifest id; weights are normalized).
    #[arg(required = true, value_name = "NAME=WEIGHT")]
    sources: Vec<String>,
    /// Samples an epoch reads (default: as many as the sources hold together).
    #[arg(long, conflicts_with = "pass_of")]
    samples: Option<u64>,
    /// An epoch is one pass over this source (a NAME given above) at its weight.
    #[arg(long, value_name = "NAME")]
    pass_of: Option<String>,
    /// Epochs to count.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
}

/// Parses `NAME=WEIGHT`.
pub(super) fn parse_source(text: &str) -> Result<(String, f64)> {
    let (name, weight) = text.rsplit_once('=').with_context(|| format!("{text:?}: expected NAME=WEIGHT"))?;
    let weight: f64 = weight.parse().with_context(|| format!("{text:?}: the weight {weight:?} is not a number"))?;
    if !weight.is_finite() || weight < 0.0 {
        bail!("{text:?}: a weight is a finite number >= 0");
    }
    Ok((name.to_owned(), weight))
}

pub(super) fn mix(paths: &StorePaths, args: &MixArgs) -> Result<()> {
    let parsed = args.sources.iter().map(|s| parse_source(s)).collect::<Result<Vec<_>>>()?;
    let parts =
        parsed.iter().map(|(name, weight)| Ok((VersionSpec::parse(name)?, *weight))).collect::<Result<Vec<_>>>()?;
    let epoch = match (&args.pass_of, args.samples) {
        (Some(name), _) => {
            let i = parsed
                .iter()
                .position(|(n, _)| n == name)
                .with_context(|| format!("--pass-of {name}: not one of the sources ({})", args.sources.join(" ")))?;
            EpochLength::PassOf(i)
        }
        (None, Some(n)) => EpochLength::Samples(n),
        (None, None) => EpochLength::Records,
    };
    if args.epochs == 0 {
        bail!("--epochs: at least 1");
    }
    let mixture = Mixture::open(paths, &parts, epoch)?;
    let drawn = mixture.drawn(args.epochs)?;
    outln!("mixture {}", mixture.id())?;
    outln!("{} samples an epoch, {} epoch(s)", mixture.blend().epoch_samples(), args.epochs)?;
    outln!("{:<28} {:>12} {:>8} {:>14} {:>8}", "source", "records", "weight", "draws", "passes")?;
    for (s, source) in mixture.sources().iter().enumerate() {
        let draws = drawn[s];
        let passes = if source.n_records == 0 { 0.0 } else { draws as f64 / source.n_records as f64 };
        outln!("{:<28} {:>12} {:>8.4} {:>14} {:>8.3}", source.label, source.n_records, source.weight, draws, passes)?;
    }
    Ok(())
}
