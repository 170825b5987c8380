//! The memory tier under the loader: warm epochs come from memory with the right bytes, a budget
//! smaller than one shard still reads every record right and holds no more than the budget, byte
//! records that span extents are assembled right, a bit flipped on disk after its extent entered
//! the tier is caught by `verify` and by the next disk read, a damaged block never enters the
//! tier, stray files in the tier's directory are not trusted, positions resume at another world
//! size, four ranks of a node hold one copy of the data, and with half of it in the tier they
//! keep one set within the budget, while a windowed plan is served from memory, the evictor
//! plugin (whatever it is) choosing what makes room within the plan's rules.

mod common;

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
fn a_bit_flipped_on_disk_after_its_extent_entered_the_tier_is_caught_by_verify_and_the_next_disk_read() {
    let f = fixture(500);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let tiered = || config(World::single(), 1, TierSetting::Shared(Arc::clone(&tier)));
    let mut loader = Loader::new(Arc::clone(&f.dataset), tiered(), Position::default()).unwrap();
    drain(&mut loader, &f.records);
    drop(loader);

    // Record 3 lives in the first shard's first data block.
    let shard = f.dataset.shard_path(0);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[4096 + 3 * 2048 + 17] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();

    let report = granary::engine::verify(&StorePaths::new(f.dir.path().join("store")), None).unwrap();
    assert!(!report.failures.is_empty(), "verify reads the disk, not the tier");

    let mut from_disk =
        Loader::new(Arc::clone(&f.dataset), config(World::single(), 1, TierSetting::Off), Position::default()).unwrap();
    let error = std::iter::from_fn(|| from_disk.next()).find_map(Result::err).expect("the flip is caught");
    assert!(error.is_corruption(), "{error}");

    // The tier's copy was verified before the flip: it still serves the original bytes.
    let mut loader = Loader::new(Arc::clone(&f.dataset), tiered(), Position::default()).unwrap();
    drain(&mut loader, &f.records);
}

#[test]
fn a_bit_flipped_in_a_tier_extent_is_never_delivered_and_the_record_comes_from_disk() {
    // The tier's memory is a file any process of the user can write: a fill's check does not
    // cover what happens to it later. Each copy out of the tier checks the blocks it touches.
    let f = fixture(500);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let tiered = || config(World::single(), 1, TierSetting::Shared(Arc::clone(&tier)));
    let mut loader = Loader::new(Arc::clone(&f.dataset), tiered(), Position::default()).unwrap();
    drain(&mut loader, &f.records);
    assert_eq!(loader.stats().read.verify_failures, 0);
    drop(loader);

    // Record 3 is the second half of data block 1 of shard 0; record 4 the first half of block 2.
    // Flip a bit inside record 3, and one in record 4's block outside it (in record 5): both
    // records' blocks then fail, whichever part of the block the flip is in.
    let extent = tier.dir().unwrap().join(format!("{}.64k.000000", f.dataset.shard_id(0)));
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&extent).unwrap();
    for at in [3 * 2048 + 17, 5 * 2048 + 1] {
        use std::os::unix::fs::FileExt;
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).unwrap();
        file.write_all_at(&[byte[0] ^ 0x10], at).unwrap();
    }
    drop(file);

    let mut loader = Loader::new(Arc::clone(&f.dataset), tiered(), Position::default()).unwrap();
    let seen = drain(&mut loader, &f.records);
    assert_eq!(seen.len(), 500, "every record delivered, with its right bytes (drain checks them)");
    let stats = loader.stats();
    assert!(stats.read.verify_failures >= 1, "a record of a damaged block failed in the tier: {:?}", stats.read);
    assert!(stats.read.tier_records < stats.read.records, "the damaged extent's records came from disk");
    drop(loader);
    // The damaged extent left the tier (a later fill may load it again from disk, checked).
    if let Ok(bytes) = std::fs::read(&extent) {
        let shard = std::fs::read(f.dataset.shard_path(0)).unwrap();
        assert_eq!(&bytes[..], &shard[4096..4096 + bytes.len()], "an extent in the tier is the disk's bytes");
    }
}

#[test]
fn a_damaged_block_never_enters_the_tier_and_its_read_fails() {
    let f = fixture(500);
    let shard = f.dataset.shard_path(1);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[4096 + 5] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let mut loader = Loader::new(
        Arc::clone(&f.dataset),
        config(World::single(), 1, TierSetting::Shared(Arc::clone(&tier))),
        Position::default(),
    )
    .unwrap();
    let mut error = None;
    while let Some(batch) = loader.next() {
        match batch {
            Ok(batch) => {
                for (i, &index) in batch.indices().iter().enumerate() {
                    assert_eq!(batch.record(i), &f.records[index as usize][..], "record {index}");
                }
            }
            Err(e) => error = Some(e),
        }
    }
    let error = error.expect("the damaged block's records fail");
    assert!(error.is_corruption(), "{error}");
    assert!(loader.stats().tier.unwrap().fill_failures >= 1);
    let name = format!("{}.64k.000000", f.dataset.shard_id(1));
    assert!(!tier.dir().unwrap().join(name).exists(), "the damaged extent was not published");
}

#[test]
fn stray_files_in_the_tier_directory_are_not_trusted() {
    let f = fixture(300);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    // A short file under an extent's name (not what a fill writes), and a claim nobody holds.
    let short = tier.dir().unwrap().join(format!("{}.64k.000000", f.dataset.shard_id(0)));
    let claim = tier.dir().unwrap().join(format!(".fill-{}.64k.000001", f.dataset.shard_id(0)));
    std::fs::write(&short, b"short").unwrap();
    std::fs::write(&claim, b"junk").unwrap();
    let mut reader = granary::Reader::new(Arc::clone(&f.dataset), IoConfig::default().build().unwrap());
    reader.set_tier(TierReader::new(Arc::clone(&tier), None));
    let indices: Vec<u64> = (0..300).collect();
    let mut batch = granary::Batch::default();
    reader.read_batch(&indices, &mut batch).unwrap();
    for (i, record) in batch.records().enumerate() {
        assert_eq!(record, &f.records[i][..], "record {i}");
    }
    assert!(!claim.exists(), "the stale claim went");
    assert!(!short.exists(), "the extent of the wrong length went, so it can be filled again");
}

#[test]
fn a_directory_holding_other_files_is_refused_and_clear_leaves_them_alone() {
    let dir = tempdir();
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), b"keep me").unwrap();
    let config = TierConfig { dir: Some(mine.clone()), ..tier_config(dir.path(), 64 << 20) };
    let refused = MemoryTier::open(&config).unwrap_err().to_string();
    assert!(refused.contains("notes.txt") && refused.contains("not a memory tier file"), "{refused}");
    assert_eq!(std::fs::read(mine.join("notes.txt")).unwrap(), b"keep me");
    // A tier's own directory where a file was put later: the tier empties only its own files.
    let tier = MemoryTier::open(&tier_config(dir.path(), 64 << 20)).unwrap().unwrap();
    std::fs::write(tier.dir().unwrap().join("later.txt"), b"mine too").unwrap();
    std::fs::write(tier.dir().unwrap().join(format!("{}.64k.000000", "ab".repeat(32))), vec![0; 4096]).unwrap();
    assert_eq!(tier.resident().unwrap().0.len(), 1, "only the extent counts");
    tier.clear().unwrap();
    assert_eq!(std::fs::read(tier.dir().unwrap().join("later.txt")).unwrap(), b"mine too");
    assert!(tier.resident().unwrap().0.is_empty());
    let dir_path = tier.dir().unwrap().to_owned();
    drop(tier);
    assert!(dir_path.join("later.txt").exists(), "the last user's clear left it too");
}

#[test]
fn tiers_cut_into_other_extent_sizes_never_read_each_others_files() {
    let f = fixture(300);
    let small = MemoryTier::open(&tier_config(f.dir.path(), 64 << 20)).unwrap().unwrap();
    let mut loader = Loader::new(
        Arc::clone(&f.dataset),
        config(World::single(), 1, TierSetting::Shared(Arc::clone(&small))),
        Position::default(),
    )
    .unwrap();
    drain(&mut loader, &f.records);
    drop(loader);
    assert_eq!(small.stats().extents_loaded, n_extents(&f.dataset));
    let large = MemoryTier::open(&TierConfig { extent_bytes: 2 * EXTENT, ..tier_config(f.dir.path(), 64 << 20) })
        .unwrap()
        .unwrap();
    let mut reader = granary::Reader::new(Arc::clone(&f.dataset), IoConfig::default().build().unwrap());
    reader.set_tier(TierReader::new(Arc::clone(&large), None));
    let indices: Vec<u64> = (0..300).collect();
    let mut batch = granary::Batch::default();
    reader.read_batch(&indices, &mut batch).unwrap();
    for (i, record) in batch.records().enumerate() {
        assert_eq!(record, &f.records[i][..], "record {i}");
    }
    assert_eq!(reader.stats().tier_records, 0, "extents of 64 KiB are not extents of 128 KiB");
    assert_eq!(large.resident().unwrap().0.len() as u64, n_extents(&f.dataset), "both count what the node holds");
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

/// Four ranks of a node read `epochs` epochs of `f` through a tier of `budget` bytes, each
/// opening the tier as a process of its own would.
fn four_ranks(f: &TokenStore, budget: u64, epochs: u64, local_world_size: Option<u32>) -> Vec<RankRun> {
    let tier_dir = f.dir.path().to_path_buf();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            let dataset = Arc::clone(&f.dataset);
            let records = f.records.clone();
            let tier_dir = tier_dir.clone();
            std::thread::spawn(move || {
                let tier = MemoryTier::open(&tier_config(&tier_dir, budget)).unwrap().unwrap();
                let mut config = config(World::new(rank, 4).unwrap(), epochs, TierSetting::Shared(Arc::clone(&tier)));
                config.local_world_size = local_world_size;
                let mut loader = Loader::new(dataset, config, Position::default()).unwrap();
                let seen = drain(&mut loader, &records);
                let stats = loader.stats();
                let tier_stats = stats.tier.unwrap();
                let run = RankRun {
                    records: seen.len() as u64,
                    loaded: tier_stats.extents_loaded,
                    evicted: tier_stats.extents_evicted,
                    hits: stats.read.tier_records,
                    held_after: tier_dir_bytes(&tier),
                };
                (run, tier)
            })
        })
        .collect();
    // Every tier stays open until all ranks are done, so none empties the directory early.
    let runs: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    runs.into_iter().map(|(run, _)| run).collect()
}

#[test]
fn four_ranks_of_a_node_hold_one_copy() {
    let f = fixture(2000);
    let runs = four_ranks(&f, 64 << 20, 2, None);
    assert_eq!(runs.iter().map(|r| r.records).sum::<u64>(), 2 * 2000);
    let loaded: u64 = runs.iter().map(|r| r.loaded).sum();
    assert_eq!(loaded, n_extents(&f.dataset), "each extent loaded by one rank only");
    for run in &runs {
        assert!(run.held_after <= data_bytes(&f.dataset), "one copy: {} bytes held", run.held_after);
    }
}

/// Four ranks read three epochs of a dataset twice the tier's budget; returns the extents they
/// loaded and evicted in all, and the share of records served from memory.
fn four_ranks_over_half_a_budget(local_world_size: Option<u32>) -> (u64, u64, f64) {
    let f = fixture(4000);
    let budget = data_bytes(&f.dataset) / 2;
    let runs = four_ranks(&f, budget, 3, local_world_size);
    for run in &runs {
        assert!(run.held_after <= budget, "{} bytes in the tier, over the budget of {budget}", run.held_after);
    }
    let records: u64 = runs.iter().map(|r| r.records).sum();
    assert_eq!(records, 3 * 4000, "every record of every epoch, once");
    let loaded = runs.iter().map(|r| r.loaded).sum();
    let evicted = runs.iter().map(|r| r.evicted).sum();
    let hits: u64 = runs.iter().map(|r| r.hits).sum();
    (loaded, evicted, hits as f64 / records as f64)
}

#[test]
fn the_ranks_of_a_node_plan_the_tier_together_and_keep_one_set() {
    let f = fixture(4000);
    let fit = n_extents(&f.dataset) / 2;
    drop(f);
    let (loaded, evicted, hits) = four_ranks_over_half_a_budget(Some(4));
    // Every rank computes the node's schedule: they admit the same extents, load them once
    // between them and keep them, instead of each evicting what only the others read.
    eprintln!("node plan: {loaded} extents loaded, {evicted} evicted, hit ratio {hits:.3} ({fit} fit)");
    let (alone_loaded, alone_evicted, alone_hits) = four_ranks_over_half_a_budget(Some(1));
    eprintln!("each rank alone: {alone_loaded} loaded, {alone_evicted} evicted, hit ratio {alone_hits:.3}");
    // Ranks planning alone evict each other's extents as "never read here" and load them again.
    assert!(
        loaded * 3 <= alone_loaded * 2 && evicted * 2 <= alone_evicted,
        "a node plan loaded {loaded} and evicted {evicted}; ranks alone {alone_loaded} and {alone_evicted}"
    );
    assert!(loaded >= fit && hits >= 0.4, "hit ratio {hits:.3} with half of the data in the tier");
}

/// Three epochs over half of the data in the tier, `plan` ordering them; the extents loaded and
/// the share of records served from memory.
fn half_a_budget(plan: PlanSource) -> (u64, f64) {
    let (stats, hits) = half_a_budget_evicting(plan, None, Vec::new());
    (stats.extents_loaded, hits)
}

/// `half_a_budget`, with the evictor plugin `evictor` (`None`: the default) and its options;
/// the tier's counters and the share of records served from memory. Checks that the tier never
/// held more than its budget.
fn half_a_budget_evicting(
    plan: PlanSource,
    evictor: Option<String>,
    evictor_options: Vec<(String, String)>,
) -> (granary::TierStats, f64) {
    let f = fixture(4000);
    let budget = data_bytes(&f.dataset) / 2;
    let tier = MemoryTier::open(&TierConfig { evictor, evictor_options, ..tier_config(f.dir.path(), budget) })
        .unwrap()
        .unwrap();
    // Named like a claim, but not of an extent: the fillers' listings leave it alone.
    let notes = tier.dir().unwrap().join(".fill-notes");
    std::fs::write(&notes, b"not the tier's").unwrap();
    let mut config = config(World::single(), 3, TierSetting::Shared(Arc::clone(&tier)));
    config.plan = plan;
    let mut loader = Loader::new(Arc::clone(&f.dataset), config, Position::default()).unwrap();
    let seen = drain(&mut loader, &f.records);
    assert_eq!(seen.len(), 3 * 4000);
    assert_eq!(std::fs::read(&notes).unwrap(), b"not the tier's");
    let stats = loader.stats();
    let tier_stats = stats.tier.unwrap();
    assert!(tier_stats.bytes_held <= budget && tier_dir_bytes(&tier) <= budget, "over the budget: {tier_stats:?}");
    (tier_stats, stats.read.tier_records as f64 / seen.len() as f64)
}

fn windowed() -> PlanSource {
    PlanSource::Partitioner {
        plugin: None,
        options: vec![("window-shards".into(), "4".into()), ("chunk-records".into(), "4".into())],
    }
}

#[test]
fn the_evictor_plugin_chooses_what_makes_room_within_the_plans_rules() {
    // The default (plan-aware: Belady on the plan's next uses), a recency policy, and a plugin
    // that traps at every call (its fallback, LRU, answers): each chooses the victims, the plan's
    // rules keep what it needs sooner, and the reads stay right and within the budget.
    let hostile = granary::policy::builtin::built_plugin_path("hostile_evictor").display().to_string();
    let cases = [
        ("plan-aware", None, Vec::new()),
        ("lru", Some("lru".to_owned()), Vec::new()),
        ("trapping", Some(hostile), vec![("behave".to_owned(), "trap".to_owned())]),
    ];
    for (label, evictor, options) in cases {
        let (stats, hits) = half_a_budget_evicting(windowed(), evictor, options);
        eprintln!("{label}: hit ratio {hits:.3}, {stats:?}");
        assert!(stats.evictor_chosen > 0, "{label}: the plugin chose no victim: {stats:?}");
        assert_eq!(stats.evictor_failures, 0, "{label}: {stats:?}");
        assert!(hits >= 0.9, "{label}: hit ratio {hits:.3}");
    }
    // A plugin that is not there is refused when the tier opens, not at its first eviction.
    let dir = tempdir();
    let missing = TierConfig { evictor: Some("no-such-evictor".into()), ..tier_config(dir.path(), 1 << 20) };
    let error = MemoryTier::open(&missing).expect_err("refused");
    assert!(error.to_string().contains("no-such-evictor"), "{error}");
    // So is one that refuses its options.
    let refusing = TierConfig {
        evictor: Some("lru".into()),
        evictor_options: vec![("bogus".into(), "1".into())],
        ..tier_config(dir.path(), 1 << 20)
    };
    let error = MemoryTier::open(&refusing).expect_err("refused");
    assert!(error.to_string().contains("bogus"), "{error}");
}

#[test]
fn a_windowed_plan_over_twice_the_budget_is_served_from_memory() {
    let (loaded, hits) = half_a_budget(windowed());
    let (shuffled_loaded, shuffled_hits) = half_a_budget(PlanSource::Native(Order::Shuffled));
    eprintln!("windowed: {loaded} loaded, hit ratio {hits:.3}; shuffled: {shuffled_loaded} loaded, {shuffled_hits:.3}");
    // The tier follows the window, loading each extent ahead of its reads at most once an epoch
    // (128 extents, 3 epochs); a full shuffle keeps one set of half of them.
    assert!(hits >= 0.9 && loaded <= 3 * 128, "windowed: {loaded} extents loaded, hit ratio {hits:.3}");
    assert!(shuffled_hits >= 0.4 && shuffled_loaded <= 128, "shuffled: {shuffled_loaded} loaded, {shuffled_hits:.3}");
}

#[test]
fn a_bad_local_world_size_is_refused() {
    let f = fixture(100);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 1 << 20)).unwrap().unwrap();
    let mut config = config(World::new(1, 4).unwrap(), 1, TierSetting::Shared(tier));
    config.local_world_size = Some(0);
    let error = Loader::new(Arc::clone(&f.dataset), config, Position::default()).err().expect("refused");
    assert!(error.to_string().contains("local_world_size"), "{error}");
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

/// The child of `a_cgroup_limit_shrinks_the_tier_instead_of_killing_the_trainer`, run inside a
/// memory cgroup: fills the tier, then allocates memory while it reads on, and prints what the
/// tier held before and after.
#[test]
#[ignore = "run by its parent test inside a memory cgroup"]
fn child_reading_under_a_cgroup_limit() {
    let (Ok(store), Ok(tier_dir)) =
        (std::env::var("GRANARY_TEST_PRESSURE_STORE"), std::env::var("GRANARY_TEST_PRESSURE_TIER"))
    else {
        return;
    };
    let dataset = Dataset::open(&StorePaths::new(store), &VersionSpec::parse("tokens").unwrap()).unwrap();
    let tier = MemoryTier::open(&tier_config(Path::new(&tier_dir), 1 << 30)).unwrap().unwrap();
    let n_batches = dataset.n_records() / 32 + 1;
    let mut loader = Loader::new(
        dataset,
        config(World::single(), 1000, TierSetting::Shared(Arc::clone(&tier))),
        Position::default(),
    )
    .unwrap();
    for _ in 0..2 * n_batches {
        loader.next().unwrap().unwrap();
    }
    let full = tier_dir_bytes(&tier);
    let hog = allocate_while_reading(|| drop(loader.next().unwrap().unwrap()));
    let after = tier_dir_bytes(&tier);
    println!("tier held {full} bytes, then {after} bytes with {} MiB allocated", hog.len() * 16);
}

#[test]
fn a_cgroup_limit_shrinks_the_tier_instead_of_killing_the_trainer() {
    // 96 MiB of records; the child's cgroup allows 320 MiB, and it allocates 224 MiB on top of
    // the tier it filled: unless the tier gives memory back, the kernel kills the child.
    let f = fixture(48 * 1024);
    let store = f.dir.path().join("store");
    let envs = [("GRANARY_TEST_PRESSURE_STORE", store.as_path()), ("GRANARY_TEST_PRESSURE_TIER", f.dir.path())];
    let Some(out) = run_in_memory_cgroup(320 << 20, "child_reading_under_a_cgroup_limit", &envs) else { return };
    let numbers = child_report(&out, "tier held");
    assert!(numbers[0] >= 64 << 20, "the tier filled first: {numbers:?}");
    assert!(numbers[1] < numbers[0] / 2, "then gave memory back: {numbers:?}");
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
    // A read-only memory file system (root mounts one; CI runs as root).
    let ro = f.dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=16m,mode=700", "tmpfs"])
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
    // A directory named that is not this user's alone is a setting to fix: an error.
    let open = f.dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let tier = TierConfig { dir: Some(open), ..tier_config(f.dir.path(), 64 << 20) };
    let refused =
        Loader::new(Arc::clone(&f.dataset), config(World::single(), 1, TierSetting::Config(tier)), Position::default());
    assert!(refused.is_err_and(|e| e.to_string().contains("only it can write")));
}

#[test]
fn versions_that_share_shards_share_their_extents() {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let first: Vec<Vec<u8>> = (0..1000).map(|i| bytes(i, TOKENS as usize * 2)).collect();
    ingest(&mut granary, "tokens", tokens_layout(TOKENS), small_shards(256 << 10), &first);
    let more: Vec<Vec<u8>> = (1000..1200).map(|i| bytes(i, TOKENS as usize * 2)).collect();
    ingest(&mut granary, "tokens", tokens_layout(TOKENS), small_shards(256 << 10), &more);
    let all: Vec<Vec<u8>> = first.iter().chain(&more).cloned().collect();
    let v1 = granary.open_dataset(&VersionSpec::parse("tokens@1").unwrap()).unwrap();
    let v2 = granary.open_dataset(&VersionSpec::parse("tokens@2").unwrap()).unwrap();
    let tier = MemoryTier::open(&tier_config(dir.path(), 64 << 20)).unwrap().unwrap();
    let shared = || TierSetting::Shared(Arc::clone(&tier));
    let mut loader = Loader::new(Arc::clone(&v1), config(World::single(), 1, shared()), Position::default()).unwrap();
    drain(&mut loader, &first);
    let after_v1 = tier.stats().extents_loaded;
    assert_eq!(after_v1, n_extents(&v1));
    let mut loader = Loader::new(Arc::clone(&v2), config(World::single(), 1, shared()), Position::default()).unwrap();
    drain(&mut loader, &all);
    // All but its first batches (read from disk while the fills start).
    assert!(loader.stats().read.tier_records >= 1200 - (READ_DEPTH + 1) * 32, "version 2 read from the tier too");
    // Version 2 appends: it shares version 1's shards, so only its own extents were loaded.
    assert_eq!(tier.stats().extents_loaded - after_v1, n_extents(&v2) - n_extents(&v1));
}
