//! The commands that print: ls, inspect, verify, repair, gc.
//!
//! Owns: `ls` (from the catalog, or from the files while another process holds the store),
//! `inspect`, `verify`, `repair` and `gc`, what they print (the attached datasets' lines among it),
//! and `bytes`, the size format the other commands use too. Never: waits for the write lock to list
//! (`ls` reads the files instead), or takes it to inspect or verify (they read the files).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use granary::engine::{self, DatasetSummary, GcOptions};
use granary::shard::{BLOCK_BYTES_U64, FORMAT_VERSION, ShardMeta};
use granary::store::ObjectKind;
use granary::{Dataset, Error, Granary, ObjectId, ShardId, StorePaths, VersionSpec};

/// Human-readable binary size.
pub(super) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

pub(super) fn ls(paths: &StorePaths) -> Result<()> {
    // The catalog is the fast path; while another process holds the store, read the files.
    let datasets: Vec<DatasetSummary> = match Granary::open(paths.root()) {
        Ok(granary) => granary.datasets()?,
        // Another writer holds it, or this process cannot write it (a read-only mount, another
        // user's store): the files say the same, without the lock.
        Err(Error::StoreLocked { .. } | Error::ReadOnlyStore { .. }) => engine::datasets_from_files(paths)?,
        // The catalog is only a cache: list from the files, and say what is wrong once.
        Err(e @ Error::NeedsRepair { .. }) => {
            errln!("granary: warning: {e}; listing from the files");
            engine::datasets_from_files(paths)?
        }
        Err(e) => return Err(e.into()),
    };
    if datasets.is_empty() {
        outln!("no datasets in {}", paths.root().display())?;
        return Ok(());
    }
    // Columns as wide as their content: every cell is made first.
    let mut rows: Vec<[String; 7]> = vec![[
        "DATASET".to_owned(),
        "VERSION".to_owned(),
        "MANIFEST".to_owned(),
        "RECORDS".to_owned(),
        "SHARDS".to_owned(),
        "SIZE".to_owned(),
        "LAYOUT".to_owned(),
    ]];
    let (mut n_versions, mut total) = (0, 0);
    for dataset in &datasets {
        for (i, version) in dataset.versions.iter().enumerate() {
            let name = if i == 0 { dataset.name.as_str() } else { "" };
            n_versions += 1;
            let (records, shards, size, layout) = match &version.entry {
                Some(entry) => {
                    total += entry.file_bytes;
                    (
                        entry.n_records.to_string(),
                        entry.n_shards.to_string(),
                        bytes(entry.file_bytes),
                        entry.layout.to_string(),
                    )
                }
                None => {
                    (String::new(), String::new(), String::new(), "(manifest missing: run `granary repair`)".into())
                }
            };
            rows.push([
                name.to_owned(),
                version.number.to_string(),
                version.manifest.0.short(12),
                records,
                shards,
                size,
                layout,
            ]);
        }
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in &rows {
        let [name, version, manifest, records, shards, size, layout] = row;
        let [w0, w1, w2, w3, w4, w5, _] = widths;
        outln!("{name:<w0$}  {version:>w1$}  {manifest:<w2$}  {records:>w3$}  {shards:>w4$}  {size:>w5$}  {layout}")?;
    }
    outln!(
        "{} datasets, {n_versions} versions, {} of shards referenced (shared shards counted per version)",
        datasets.len(),
        bytes(total)
    )?;
    attached(paths)
}

/// The attached datasets: where from, and how much of each is cached here.
fn attached(paths: &StorePaths) -> Result<()> {
    let attachments = granary::origin::attachments(paths)?;
    if attachments.is_empty() {
        return Ok(());
    }
    for attachment in &attachments {
        let (mut held, mut size) = (0u64, 0u64);
        let mut seen = std::collections::HashSet::new();
        if let Ok(log) = paths.read_ref(&attachment.name) {
            for version in log.versions() {
                for entry in paths.read_manifest(version.manifest)?.entries() {
                    if seen.insert(entry.shard) {
                        size += entry.file_bytes;
                        if paths.shard(entry.shard).exists() {
                            held += entry.file_bytes;
                        }
                    }
                }
            }
        }
        outln!(
            "{}: attached from {}, {} of {} cached here",
            attachment.name,
            attachment.url,
            bytes(held),
            bytes(size)
        )?;
    }
    match granary::origin::cache_bound(paths)? {
        0 => outln!("cache: unbounded")?,
        bound => outln!("cache: at most {}", bytes(bound))?,
    }
    Ok(())
}

pub(super) fn inspect(paths: &StorePaths, target: &str, n_records: u64) -> Result<()> {
    paths.check()?;
    if let Some(id) = ObjectId::parse_hex(target) {
        let shard_path = paths.shard(ShardId(id));
        if shard_path.exists() {
            return inspect_shard(shard_path, n_records);
        }
    }
    // A name of a dataset first; else an id prefix as `ls` and this command show them (a shard
    // or a manifest, at least 8 hex digits).
    let is_dataset = granary::DatasetName::new(target).is_ok_and(|name| paths.ref_file(&name).exists());
    let spec = if !is_dataset
        && target.len() >= granary::store::ID_PREFIX_MIN
        && target.bytes().all(|b| b.is_ascii_hexdigit())
    {
        match paths.expand_prefix(&[ObjectKind::Shard, ObjectKind::Manifest, ObjectKind::Fragment], target)? {
            (ObjectKind::Shard, id) => return inspect_shard(paths.shard(ShardId(id)), n_records),
            (ObjectKind::Manifest, id) => VersionSpec::Manifest(granary::ManifestId(id)),
            (ObjectKind::Fragment, id) => return inspect_fragment(paths.object(ObjectKind::Fragment, id)),
        }
    } else {
        paths.parse_spec(target)?
    };
    let dataset = Dataset::open(paths, &spec)?;
    match dataset.version() {
        Some((name, number)) => {
            let log = paths.read_ref(name)?;
            let numbers: Vec<String> = log.versions().iter().map(|v| v.number.to_string()).collect();
            outln!("dataset {name}, version {number} (live versions: {})", numbers.join(", "))?;
        }
        None => outln!("dataset version {}", dataset.manifest_id())?,
    }
    let manifest = dataset.manifest();
    outln!("manifest: {}", dataset.manifest_id())?;
    outln!("layout:   {}", manifest.layout())?;
    outln!("records:  {}", manifest.n_records())?;
    outln!("shards:   {} ({})", manifest.entries().len(), bytes(manifest.file_bytes()))?;
    let mut first = 0;
    for entry in manifest.entries() {
        outln!("  {}  records {first}..{}  {}", entry.shard, first + entry.n_records, bytes(entry.file_bytes))?;
        first += entry.n_records;
    }
    Ok(())
}

/// A fragment file: what its header names, once the whole file checked out.
fn inspect_fragment(path: PathBuf) -> Result<()> {
    let file = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
    let header =
        granary::erasure::Fragment::check(&file).map_err(|source| Error::Format { path: path.clone(), source })?;
    outln!("fragment: {}", path.file_stem().map(|s| s.to_string_lossy()).unwrap_or_default())?;
    outln!("path:     {}", path.display())?;
    outln!(
        "of:       shard {}, fragment {} of {} ({}: {} data, {} parity)",
        header.shard,
        header.index,
        header.coding.n(),
        header.coding,
        header.coding.k(),
        header.coding.m()
    )?;
    outln!(
        "bytes:    {} of the shard's {}, in {} blocks; {} file bytes; every block checks out",
        header.fragment_bytes(),
        header.shard_bytes,
        header.n_blocks(),
        file.len()
    )?;
    Ok(())
}

fn inspect_shard(path: PathBuf, n_records: u64) -> Result<()> {
    let meta = ShardMeta::read(&path)?;
    let footer = meta.footer();
    outln!("shard:    {}", path.file_stem().map(|s| s.to_string_lossy()).unwrap_or_default())?;
    outln!("path:     {}", path.display())?;
    outln!("format:   version {FORMAT_VERSION}, {BLOCK_BYTES_U64}-byte blocks, {} bytes", meta.file_bytes())?;
    outln!("layout:   {}", meta.layout())?;
    outln!("records:  {}, {} data bytes in {} blocks", meta.n_records(), meta.data_bytes(), meta.n_data_blocks())?;
    outln!(
        "regions:  header 0  data {}  index {} (+{})  checksums {} (+{})  footer {}",
        BLOCK_BYTES_U64,
        footer.index_offset,
        footer.index_bytes,
        footer.crc_table_offset,
        footer.crc_table_bytes,
        footer.footer_offset()
    )?;
    for local in 0..meta.n_records().min(n_records) {
        let range = meta.record_range(local);
        outln!("  record {local}: offset {} length {}", range.start, range.end - range.start)?;
    }
    if meta.n_records() > n_records {
        outln!("  ... {} more", meta.n_records() - n_records)?;
    }
    Ok(())
}

pub(super) fn verify(paths: &StorePaths, spec: Option<&str>) -> Result<ExitCode> {
    let spec = spec.map(|spec| paths.parse_spec(spec)).transpose()?;
    // Attached datasets' shards are fetched through the store's cache (a version's scrub), or
    // counted as at their origin (the whole store's).
    let cache = granary::origin::OriginCache::open(paths, None, &[])?;
    let fetcher = cache.as_deref().map(|cache| cache as &dyn engine::ShardFetcher);
    let report = engine::verify_through(paths, spec.as_ref(), fetcher)?;
    for failure in &report.failures {
        errln!("granary: FAILED {}: {}", failure.path.display(), failure.error);
    }
    for unreadable in &report.unreadable {
        errln!("granary: UNREADABLE {unreadable}");
    }
    let versions = if spec.is_none() {
        let mut at_origin = match report.shards_at_origin {
            0 => String::new(),
            n => format!(" ({n} of their shards at an origin, not here: `verify NAME` fetches and checks them)"),
        };
        if report.shards_as_fragments > 0 {
            at_origin.push_str(&format!(
                " ({} of their shards held here as erasure-coded fragments, the rest of each on other nodes: \
                 `granary get --cluster-key` rebuilds one, `status --cluster-key` shows their placement)",
                report.shards_as_fragments
            ));
        }
        format!(", {} live versions readable{at_origin}, {} unreadable", report.versions_ok, versions_hurt(&report))
    } else {
        String::new()
    };
    let fragments =
        if report.fragments_ok > 0 { format!(", {} fragments", report.fragments_ok) } else { String::new() };
    outln!(
        "verified {} shards, {} manifests, {} refs{fragments} ({}){versions}: {} failures",
        report.shards_ok,
        report.manifests_ok,
        report.refs_ok,
        bytes(report.bytes),
        report.failures.len() + report.unreadable.len()
    )?;
    if report.shards_through_cache > 0 {
        outln!(
            "note: {} shards were read through the page cache (its pages dropped first): this file system \
             refuses O_DIRECT, so pages another process keeps mapped were not read from the device",
            report.shards_through_cache
        )?;
    }
    Ok(if report.is_clean() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// How many versions (or datasets with unknown versions) the report names as unreadable.
fn versions_hurt(report: &engine::VerifyReport) -> usize {
    let mut hurt: Vec<(&str, Option<u64>)> = report.unreadable.iter().map(|u| (u.name.as_str(), u.number)).collect();
    hurt.dedup();
    hurt.len()
}

pub(super) fn repair(root: PathBuf) -> Result<()> {
    let (_granary, report) = super::open_and_repair(&root)?;
    if let Some((path, why)) = &report.catalog_quarantined {
        errln!("granary: the catalog could not be read ({why}); moved to {} and rebuilt", path.display());
    }
    for (path, why) in &report.quarantined {
        errln!("granary: quarantined {}: {why}", path.display());
    }
    for (name, log) in &report.refs_rebuilt {
        let numbers: Vec<String> = log.versions().iter().map(|v| v.number.to_string()).collect();
        errln!("granary: rebuilt the ref of {name} from its history (versions {})", numbers.join(", "));
    }
    for name in &report.refs_lost {
        errln!(
            "granary: the ref of {name} was damaged and has no history: its versions are unknown; `gc` keeps \
             its files (`--prune-now` too) until its ref is restored from quarantine/ or `granary rm {name}` \
             forgets it"
        );
    }
    for stray in &report.strays {
        errln!("granary: left alone {} (not a file the store wrote; remove it if it is not yours)", stray.display());
    }
    for missing in &report.missing {
        errln!("granary: missing {missing}");
    }
    for (path, why) in &report.unreadable {
        errln!("granary: could not read {} (left in place, not cataloged): {why}", path.display());
    }
    let unreadable = match report.unreadable.len() {
        0 => String::new(),
        n => format!(", {n} unreadable"),
    };
    outln!(
        "catalog rebuilt: {} shards, {} manifests, {} datasets; {} quarantined, {} missing{unreadable}, {} temp files \
         removed, {} refs rebuilt from their history",
        report.shards,
        report.manifests,
        report.datasets,
        report.quarantined.len(),
        report.missing.len(),
        report.tmp_removed,
        report.refs_rebuilt.len()
    )?;
    if report.shards_as_fragments > 0 {
        outln!(
            "{} listed shards are held here as erasure-coded fragments (the rest of each on other nodes; \
             `granary get --cluster-key` rebuilds one)",
            report.shards_as_fragments
        )?;
    }
    if !report.refs_lost.is_empty() {
        bail!("{} datasets lost their ref", report.refs_lost.len());
    }
    if !report.missing.is_empty() {
        bail!("{} referenced objects are missing", report.missing.len());
    }
    if !report.unreadable.is_empty() {
        bail!(
            "{} files could not be read by this user; the rest is repaired: run `granary repair` again as a user \
             who can read them",
            report.unreadable.len()
        );
    }
    Ok(())
}

pub(super) fn gc(root: PathBuf, prune_now: bool) -> Result<()> {
    let options = if prune_now { GcOptions::prune_now() } else { GcOptions::default() };
    let report = super::open_writer(&root, false)?.gc(options)?;
    let kept = if report.kept_in_grace > 0 {
        format!(
            "; kept {} unreferenced objects for the {}-day grace period (`--prune-now` removes them)",
            report.kept_in_grace,
            options.grace.as_secs() / 86_400
        )
    } else {
        String::new()
    };
    let fragments = if report.fragments > 0 { format!(", {} fragments", report.fragments) } else { String::new() };
    let damaged = if report.kept_damaged > 0 {
        format!(
            "; kept {} fragment files whose header does not check out (`granary verify` names them)",
            report.kept_damaged
        )
    } else {
        String::new()
    };
    outln!(
        "removed {} shards and {} manifests{fragments} ({}){kept}{damaged}",
        report.shards,
        report.manifests,
        bytes(report.bytes)
    )?;
    if !report.quarantined_datasets.is_empty() {
        let names: Vec<&str> = report.quarantined_datasets.iter().map(String::as_str).collect();
        outln!(
            "kept {} objects of {} whose ref `repair` quarantined, whatever the grace: restore the ref from \
             quarantine/, or forget the dataset with `granary rm NAME`",
            report.kept_quarantined,
            names.join(", ")
        )?;
    }
    Ok(())
}
