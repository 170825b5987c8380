//! The memory tier under the loader. This file holds the fixtures and the reads: warm epochs come
//! from memory with the right bytes, a budget smaller than one shard still reads every record
//! right, byte records that span extents are assembled right, positions resume at another world
//! size, a tier that cannot work here is done without, and the loader bench's tier rows;
//! `trust.rs` what the tier trusts (flipped bits, damaged blocks, stray files, directories),
//! `sharing.rs` the tier shared and bounded (ranks of a node, the evictor, cgroups, versions).

#[path = "../common/mod.rs"]
mod common;
mod sharing;
mod trust;

use std::path::Path;
use std::sync::Arc;

use common::*;
use granary::loader::{Loader, LoaderConfig, PlanSource, Target, TierSetting};
use granary::tier::{TierKind, TierReader};
use granary::{
    Backend, Dataset, Granary, IoConfig, Layout, MemoryTier, Order, Position, StorePaths, TierConfig, VersionSpec,
    World,
};

const TOKENS: u64 = 1024;
const EXTENT: u64 = 64 << 10;
/// Batches a loader plans before its first is delivered (`LoaderConfig::read_depth`'s default;
/// one more may be planned as the first goes out).
const READ_DEPTH: u64 = 2;

/// `n` records of 1024 u16 tokens (2 KiB) in shards of about 256 KiB.
fn fixture(n: usize) -> TokenStore {
    token_store(n, TOKENS, 256 << 10)
}

fn tier_config(dir: &Path, budget: u64) -> TierConfig {
    TierConfig {
        kind: TierKind::Memory,
        budget_bytes: Some(budget),
        dir: Some(dir.join("tier")),
        extent_bytes: EXTENT,
        ..TierConfig::default()
    }
}

fn config(world: World, epochs: u64, tier: TierSetting) -> LoaderConfig {
    LoaderConfig {
        batch_size: 32,
        world,
        seed: 11,
        plan: PlanSource::Native(Order::Shuffled),
        epochs: Some(epochs),
        io: IoConfig { backend: Backend::Auto, queue_depth: 16, op_bytes_max: 64 << 10, direct: true },
        target: Target::Host,
        tier,
        ..LoaderConfig::default()
    }
}

/// Reads the whole run, checking every record's bytes; returns the indices read.
fn drain(loader: &mut Loader, records: &[Vec<u8>]) -> Vec<u64> {
    let mut seen = Vec::new();
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
        }
        seen.extend_from_slice(batch.indices());
    }
    seen
}

fn data_bytes(dataset: &Dataset) -> u64 {
    (0..dataset.n_shards()).map(|s| dataset.shard_meta(s).unwrap().data_bytes()).sum()
}

fn n_extents(dataset: &Dataset) -> u64 {
    (0..dataset.n_shards()).map(|s| dataset.shard_meta(s).unwrap().n_data_blocks().div_ceil(EXTENT / 4096)).sum()
}

/// Memory the files in the tier's directory take (fills in progress included), each file once
/// (an extent and the private file it was linked from are one): their allocated blocks, so a
/// claim, a sparse file as long as its extent, takes none.
fn tier_dir_bytes(tier: &MemoryTier) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut files = std::collections::HashMap::new();
    for entry in std::fs::read_dir(tier.dir().unwrap()).unwrap().flatten() {
        if let Ok(meta) = entry.metadata()
            && entry.file_name() != ".users"
            && entry.file_name() != ".granary-tier"
        {
            files.insert(meta.ino(), meta.blocks() * 512);
        }
    }
    files.values().sum()
}

#[test]
fn every_epoch_comes_from_memory_with_the_right_bytes_each_extent_loaded_once() {
    let f = fixture(2000);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let mut loader = Loader::new(
        Arc::clone(&f.dataset),
        config(World::single(), 3, TierSetting::Shared(Arc::clone(&tier))),
        Position::default(),
    )
    .unwrap();
    let seen = drain(&mut loader, &f.records);
    assert_eq!(seen.len(), 3 * 2000, "three whole epochs");
    let stats = loader.stats();
    // The dataset fits: after the batches planned before the first is out (the read depth's,
    // read from disk while the fills start, issue 44) the reader waits for the fillers rather
    // than read records from disk.
    let first = (READ_DEPTH + 1) * 32;
    assert!(stats.read.tier_records >= stats.read.records - first, "every record from the tier: {:?}", stats.read);
    assert!(stats.read.bytes_read <= first * 2048 + (64 << 10), "only the first batches from disk: {:?}", stats.read);
    let tier_stats = stats.tier.unwrap();
    assert_eq!(tier_stats.extents_loaded, n_extents(&f.dataset), "each extent read from disk once");
    assert_eq!(tier_stats.extents_evicted, 0);
    assert_eq!(tier_dir_bytes(&tier), data_bytes(&f.dataset), "one copy of the data");
}

#[test]
fn a_budget_smaller_than_one_shard_reads_every_record_right_and_holds_no_more() {
    let f = fixture(1000);
    let budget = 2 * EXTENT;
    let tier = MemoryTier::open(&tier_config(f.dir.path(), budget)).unwrap().unwrap();
    let mut loader = Loader::new(
        Arc::clone(&f.dataset),
        config(World::single(), 2, TierSetting::Shared(Arc::clone(&tier))),
        Position::default(),
    )
    .unwrap();
    let mut batches = 0;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            assert_eq!(batch.record(i), &f.records[index as usize][..], "record {index}");
        }
        batches += 1;
        // Published extents within the budget; fills in progress add at most one extent each.
        let held = tier_dir_bytes(&tier);
        assert!(held <= budget + tier.fill_threads() as u64 * EXTENT, "{held} bytes held, budget {budget}");
    }
    assert_eq!(batches, 2 * (1000 / 32 + 1));
    let stats = loader.stats();
    assert!(stats.read.tier_records > 0, "some records came from the tier");
    assert!(stats.read.tier_records < stats.read.records, "most from disk: the tier holds 2 of 32 extents");
    drop(loader);
    assert!(tier_dir_bytes(&tier) <= budget);
}

#[test]
fn byte_records_that_span_extents_are_assembled_right() {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let records: Vec<Vec<u8>> = (0..600).map(|i| bytes(i, 1 + (i as usize * 7919) % 9000)).collect();
    ingest(&mut granary, "bytes", Layout::Bytes, small_shards(512 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("bytes").unwrap()).unwrap();
    // Extents of one block: most records span two or three.
    let tier_config = TierConfig { extent_bytes: 4096, ..tier_config(dir.path(), 64 << 20) };
    let tier = MemoryTier::open(&tier_config).unwrap().unwrap();
    let mut loader =
        Loader::new(dataset, config(World::single(), 2, TierSetting::Shared(tier)), Position::default()).unwrap();
    let seen = drain(&mut loader, &records);
    assert_eq!(seen.len(), 2 * 600);
    let stats = loader.stats();
    // All but the first batches (read from disk while the fills start).
    assert!(stats.read.tier_records >= stats.read.records - (READ_DEPTH + 1) * 32, "{:?}", stats.read);
}

#[test]
fn a_position_resumes_exactly_at_another_world_size_with_the_tier() {
    let f = fixture(1000);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let shared = || TierSetting::Shared(Arc::clone(&tier));
    let mut first =
        Loader::new(Arc::clone(&f.dataset), config(World::single(), 1, shared()), Position::default()).unwrap();
    let mut seen = Vec::new();
    for _ in 0..10 {
        let batch = first.next().unwrap().unwrap();
        seen.extend_from_slice(batch.indices());
    }
    let position = first.position();
    drop(first);
    for rank in 0..3 {
        let world = World::new(rank, 3).unwrap();
        let mut rest = Loader::new(Arc::clone(&f.dataset), config(world, 1, shared()), position).unwrap();
        seen.extend(drain(&mut rest, &f.records));
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..1000).collect::<Vec<u64>>(), "every record once, none twice");
}

/// What a rank saw: records read, and its loader's and tier's counters.
struct RankRun {
    records: u64,
    loaded: u64,
    evicted: u64,
    hits: u64,
    held_after: u64,
}

#[test]
fn the_loader_bench_prints_the_tier_rows_at_a_small_scale() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let tier = dir.path().join("tier");
    let out = granary_ok(
        &root,
        &[
            "bench",
            "loader",
            "--generate",
            "4MiB",
            "--batch",
            "16",
            "--batches",
            "8",
            "--runs",
            "1",
            "--keep-cache",
            "--rows",
            "tier,tier-partial",
            "--partial-epochs",
            "2",
            "--tier-dir",
            tier.to_str().unwrap(),
        ],
    );
    let mut labels = vec![
        "cold epoch: sequential read (limit)".to_owned(),
        "cold epoch random: mmap gather".to_owned(),
        "warm random: mmap gather".to_owned(),
        "new loader, warm epoch: mmap gather".to_owned(),
    ];
    let mut ratios = Vec::new();
    for tier in ["page-cache tier", "memory tier"] {
        for pattern in ["cold epoch random", "warm random", "new loader, warm epoch"] {
            labels.push(format!("{pattern}: {tier}"));
            ratios.push(format!("{pattern}: {tier} / mmap gather"));
        }
        ratios.push(format!("warm random: {tier} CPU per byte / mmap's"));
        ratios.push(format!("cold epoch random: sequential read time / {tier} time"));
    }
    for label in &labels {
        let line = out.lines().find(|line| line.starts_with(&**label)).unwrap_or_else(|| panic!("no {label}: {out}"));
        let rate: f64 = line[label.len()..].split_whitespace().next().unwrap().parse().unwrap();
        assert!(rate > 0.0, "{label}: {out}");
    }
    for ratio in &ratios {
        let line = out.lines().find(|line| line.starts_with(&**ratio)).unwrap_or_else(|| panic!("no {ratio}: {out}"));
        assert!(!line.contains("n/a"), "{line}");
    }
    let partial: Vec<_> = out.lines().filter(|l| l.starts_with("tier at half the dataset")).collect();
    assert_eq!(partial.len(), 2, "a shuffled and a windowed row: {out}");
    assert!(partial[0].contains("shuffled") && partial[1].contains("windowed"), "{partial:?}");
    for row in partial {
        assert!(row.contains("hit ratio") && row.contains("Belady"), "{row}");
    }
    // The bench leaves the tier empty.
    let left: Vec<_> = std::fs::read_dir(&tier)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name() != ".users" && e.file_name() != ".granary-tier")
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // Without --tier-dir the bench uses a tier of its own: the node's shared tier (the default
    // directory, held open here as a job would) is never emptied under a running job.
    let shared =
        MemoryTier::open(&TierConfig { keep: true, dir: None, ..tier_config(dir.path(), 64 << 20) }).unwrap().unwrap();
    let planted = shared.dir().unwrap().join(format!("{}.64k.000000", "cd".repeat(32)));
    std::fs::write(&planted, vec![0u8; 4096]).unwrap();
    let before: Vec<_> = std::fs::read_dir("/dev/shm").unwrap().flatten().map(|e| e.file_name()).collect();
    granary_ok(
        &root,
        &["bench", "loader", "--batch", "16", "--batches", "4", "--runs", "1", "--keep-cache", "--rows", "tier"],
    );
    assert!(planted.exists(), "the bench left other tiers alone");
    let after: Vec<_> = std::fs::read_dir("/dev/shm").unwrap().flatten().map(|e| e.file_name()).collect();
    let made: Vec<_> = after.iter().filter(|n| !before.contains(n) && n.to_string_lossy().contains("bench")).collect();
    assert!(made.is_empty(), "the bench removed its own tier: {made:?}");
    std::fs::remove_file(&planted).unwrap();
}

#[test]
fn a_tier_that_cannot_work_here_is_done_without_and_every_record_read_from_disk() {
    let f = fixture(300);
    let read_all = |tier: TierConfig| {
        let mut loader = Loader::new(
            Arc::clone(&f.dataset),
            config(World::single(), 1, TierSetting::Config(tier)),
            Position::default(),
        )
        .unwrap();
        assert!(loader.tier().is_none(), "no tier");
        drain(&mut loader, &f.records);
        let stats = loader.stats().read;
        assert_eq!((stats.records, stats.tier_records), (300, 0), "{stats:?}");
    };
    // Its directory cannot be made (a file is in the way).
    let blocked = f.dir.path().join("a-file");
    std::fs::write(&blocked, b"").unwrap();
    read_all(TierConfig { dir: Some(blocked.join("tier")), ..tier_config(f.dir.path(), 64 << 20) });
    // A read-only memory file system (root mounts one; CI runs as root): this user's alone, and
    // fresh, as a mount leaves it (mode 1777, root's: its mode must not hide that it is
    // read-only, issue 53).
    for (k, options) in ["ro,size=16m,mode=700", "ro,size=16m"].into_iter().enumerate() {
        let ro = f.dir.path().join(format!("ro{k}"));
        std::fs::create_dir(&ro).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&ro)
            .status()
            .is_ok_and(|s| s.success());
        if !machine_has(mounted, "a read-only tmpfs mount (root)") {
            return;
        }
        let mounted = Mounted(ro.clone());
        for dir in [ro.clone(), ro.join("tier")] {
            read_all(TierConfig { dir: Some(dir), ..tier_config(f.dir.path(), 64 << 20) });
        }
        drop(mounted);
    }
    // A directory named that is not this user's alone is a setting to fix: an error.
    let open = f.dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let tier = TierConfig { dir: Some(open), ..tier_config(f.dir.path(), 64 << 20) };
    let refused =
        Loader::new(Arc::clone(&f.dataset), config(World::single(), 1, TierSetting::Config(tier)), Position::default());
    assert!(refused.is_err_and(|e| e.to_string().contains("only it can write")));
}
