//! What the memory tier trusts: a bit flipped on disk after its extent entered the tier is
//! caught by `verify` and the next disk read, one flipped in an extent is never delivered, a
//! damaged block never enters, stray files and other users' directories are not trusted, and
//! tiers of other extent sizes never read each other's files.

use super::*;

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
