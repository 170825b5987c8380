//! `push`, `attach`, `detach`: datasets in object storage, from the command line.
//!
//! Owns: the command line's side of the three: the origin opened from its URL (`memory://` refused:
//! it would live and die inside one command), a push's progress bar, and the reports printed.
//! Never: does the work itself (`granary::origin` pushes, attaches and detaches), or takes the
//! store's write lock for a push (it only reads the store).

use std::path::Path;

use anyhow::{Result, bail};
use granary::origin::{self, Origin, PushProgress};
use granary::{StorePaths, VersionSpec};

use super::{Bar, open_writer};

/// The origin at `url`, refusing `memory://`: it would live and die inside this one command.
fn open_origin(url: &str) -> Result<Origin> {
    if url.starts_with("memory:") {
        bail!("memory:// lives inside one process: from the command line, give s3://, gs://, az:// or file://");
    }
    Ok(Origin::open(url)?)
}

pub(super) fn push(paths: &StorePaths, spec: &str, url: &str) -> Result<()> {
    let origin = open_origin(url)?;
    let spec = paths.parse_spec(spec)?;
    let bar = Bar::new();
    let report = origin::push(paths, &spec, &origin, &|progress| match progress {
        PushProgress::Total(total) => bar.0.set_length(total),
        PushProgress::Sent(bytes) => bar.0.inc(bytes),
    });
    bar.finish();
    let report = report?;
    outln!(
        "pushed {}@{} to {}: {} shards uploaded ({} bytes), {} already there; ref {}",
        report.name,
        report.number,
        origin.url(),
        report.shards_uploaded,
        report.bytes_uploaded,
        report.shards_present,
        if report.ref_written { "written" } else { "already named this version" }
    )?;
    Ok(())
}

pub(super) fn attach(
    root: &Path,
    spec: &str,
    url: &str,
    cache_bytes: Option<u64>,
    evictor: Option<&str>,
) -> Result<()> {
    let origin = open_origin(url)?;
    let spec = VersionSpec::parse(spec)?;
    // Like an ingest, an attach may be what makes the store.
    let mut granary = open_writer(root, true)?;
    let report = origin::attach(&mut granary, &origin, &spec, cache_bytes, evictor)?;
    let cache = match report.cache_bytes {
        0 => "unbounded".to_owned(),
        bytes => format!("{bytes} bytes"),
    };
    outln!(
        "attached {}@{} from {}: {} shards, {} bytes, metadata checked; cache {cache}",
        report.name,
        report.number,
        origin.url(),
        report.shards,
        report.dataset_bytes
    )?;
    if report.cache_bytes > 0 && report.cache_bytes < report.dataset_bytes {
        errln!(
            "granary: the cache holds {:.0}% of {}: a plan that shuffles records across the whole dataset would \
             fetch most of it again and again; the loader windows its default plan to the cache (the elastic \
             partitioner's window-shards), a plan you choose should keep a window that fits",
            100.0 * report.cache_bytes as f64 / report.dataset_bytes as f64,
            report.name
        );
    }
    Ok(())
}

pub(super) fn detach(root: &Path, name: &str) -> Result<()> {
    let name = granary::DatasetName::new(name)?;
    let mut granary = open_writer(root, false)?;
    let report = origin::detach(&mut granary, &name)?;
    outln!(
        "detached {name}: {} cached shards removed ({} bytes); the origin keeps them",
        report.shards_removed,
        report.bytes_removed
    )?;
    Ok(())
}
