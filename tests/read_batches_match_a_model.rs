//! Model-based test of the read path: any records, any shard size, any batches (repeats,
//! shared blocks, empty records, records spanning ops), any op size, queue depth and pipeline
//! depth return exactly what a plain `Vec<Vec<u8>>` holds, with or without the memory tier
//! holding some of the extents, and with or without verify workers checking long ops and copying
//! their records into the batch.

mod common;

use common::*;
use granary::{Backend, Granary, IoConfig, Layout, Reader, VersionSpec};
use proptest::prelude::*;

fn records() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let size = prop_oneof![Just(0usize), 1usize..200, 3000usize..9000, 4096usize..4097];
    prop::collection::vec(size.prop_map(|n| vec![0u8; n]), 1..80).prop_map(|mut records| {
        for (i, record) in records.iter_mut().enumerate() {
            let fill = bytes(i as u64, record.len());
            record.copy_from_slice(&fill);
        }
        records
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn batches_read_exactly_what_the_model_holds(
        records in records(),
        shard_kib in prop_oneof![1u64..64, 64u64..600],
        batches in prop::collection::vec(prop::collection::vec(any::<prop::sample::Index>(), 0..40), 1..8),
        op_blocks in prop_oneof![1usize..6, 16usize..40],
        queue_depth in 1u32..9,
        depth in 1usize..4,
        uring: bool,
        tier_extent_blocks in prop::option::of(1u64..4),
        tier_mask: u64,
        threads in 0usize..3,
    ) {
        let dir = tempdir();
        let (dataset, mut reader) =
            reader_of(dir.path(), Layout::Bytes, shard_kib << 10, &records, (uring, queue_depth, op_blocks), threads);
        // With the memory tier: some extents in memory (records may span one that is and one
        // that is not), the rest read from disk.
        let _tier_dir = tier_extent_blocks.map(|blocks| {
            let tier_dir = tempdir();
            let config = granary::TierConfig {
                kind: granary::TierKind::Memory,
                // As many extents as a tier may hold, at the smallest extent size.
                budget_bytes: Some(granary::tier::EXTENTS_MAX * blocks * 4096),
                dir: Some(tier_dir.path().join("tier")),
                extent_bytes: blocks * 4096,
                ..granary::TierConfig::default()
            };
            let tier = granary::MemoryTier::open(&config).unwrap().unwrap();
            fill_some(&tier, &dataset, tier_mask);
            reader.set_tier(granary::tier::TierReader::new(tier, None));
            tier_dir
        });
        let batches: Vec<Vec<u64>> =
            batches.iter().map(|b| b.iter().map(|i| i.index(records.len()) as u64).collect()).collect();

        let mut delivered = Vec::new();
        reader.read_batches(&batches, depth, &mut |batch| {
            delivered.push((batch.indices().to_vec(), batch.records().map(<[u8]>::to_vec).collect::<Vec<_>>()));
            Ok(())
        }).unwrap();
        prop_assert_eq!(delivered.len(), batches.len());
        for ((indices, got), wanted) in delivered.iter().zip(&batches) {
            prop_assert_eq!(indices, wanted);
            let expected: Vec<Vec<u8>> = wanted.iter().map(|&i| records[i as usize].clone()).collect();
            prop_assert_eq!(got, &expected);
        }
        // And one at a time, through the single-batch path.
        let mut batch = granary::Batch::default();
        for wanted in &batches {
            reader.read_batch(wanted, &mut batch).unwrap();
            let expected: Vec<u8> = wanted.iter().flat_map(|&i| records[i as usize].clone()).collect();
            prop_assert_eq!(batch.data(), &expected[..]);
        }
        let stats = reader.stats();
        if threads == 0 || op_blocks < 16 {
            prop_assert_eq!(stats.ops_offloaded, 0);
        }
    }
}

/// Puts the extents whose bit of `mask` is set (bit `(7 shard + extent) % 64`) in `tier`.
fn fill_some(tier: &granary::MemoryTier, dataset: &granary::Dataset, mask: u64) {
    for shard in 0..dataset.n_shards() {
        let meta = dataset.shard_meta(shard).unwrap();
        for extent in 0..tier.n_extents(meta.n_data_blocks()) {
            if mask >> ((7 * shard as u64 + extent) % 64) & 1 == 0 {
                continue;
            }
            let first_block = extent * tier.extent_blocks();
            let info = granary::tier::ExtentInfo {
                key: granary::tier::ExtentKey { shard: dataset.shard_id(shard), extent: extent as u32 },
                path: dataset.shard_path(shard),
                meta: std::sync::Arc::clone(meta),
                first_block,
                n_blocks: tier.extent_blocks().min(meta.n_data_blocks() - first_block),
            };
            tier.fill(&info, &mut *granary::IoConfig::default().build().unwrap()).unwrap();
        }
    }
}

/// A reader of `records`, ingested as one dataset in shards of about `shard_bytes` under `dir`,
/// through io_uring (or pread) with `queue_depth` ops of `op_blocks` blocks at most, and
/// `threads` verify workers.
fn reader_of(
    dir: &std::path::Path,
    layout: Layout,
    shard_bytes: u64,
    records: &[Vec<u8>],
    (uring, queue_depth, op_blocks): (bool, u32, usize),
    threads: usize,
) -> (std::sync::Arc<granary::Dataset>, Reader) {
    let mut granary = Granary::create(dir.join("store")).unwrap();
    ingest(&mut granary, "d", layout, small_shards(shard_bytes), records);
    let dataset = granary.open_dataset(&VersionSpec::parse("d").unwrap()).unwrap();
    let backend = if uring { Backend::Uring } else { Backend::Pread };
    let io = IoConfig { backend, queue_depth, op_bytes_max: op_blocks * 4096, direct: true }.build().unwrap();
    let mut reader = Reader::new(std::sync::Arc::clone(&dataset), io);
    reader.set_verify_threads(threads);
    (dataset, reader)
}

/// Batches made of runs of consecutive records from random starts, as block-shuffled chunks are.
fn batches_of_runs(batches: &[Vec<(prop::sample::Index, usize)>], n: usize) -> Vec<Vec<u64>> {
    batches
        .iter()
        .map(|runs| {
            runs.iter()
                .flat_map(|(start, len)| {
                    let start = start.index(n);
                    (start..(start + len).min(n)).map(|i| i as u64)
                })
                .collect()
        })
        .collect()
}

#[test]
fn a_failing_sink_stops_the_pipeline_with_its_error() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let records: Vec<Vec<u8>> = (0..100).map(|i| bytes(i, 4096)).collect();
    let mut granary = Granary::create(&root).unwrap();
    ingest(&mut granary, "d", tokens_layout(2048), small_shards(16 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("d").unwrap()).unwrap();
    let mut reader = Reader::new(dataset, IoConfig::default().build().unwrap());
    let indices: Vec<u64> = (0..100).collect();
    let mut seen = 0;
    let outcome = reader.read_batches(indices.chunks(10), 3, &mut |batch| {
        assert_eq!(batch.indices()[0], seen * 10, "batches arrive in order");
        seen += 1;
        if seen == 4 { Err(granary::Error::invalid_input("trainer stopped")) } else { Ok(()) }
    });
    assert!(matches!(outcome, Err(granary::Error::InvalidInput { .. })));
    assert_eq!(seen, 4);
    // The reader is still usable.
    let mut batch = granary::Batch::default();
    reader.read_batch(&[99, 0], &mut batch).unwrap();
    assert_eq!(batch.record(0), &records[99][..]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whole-block records (a token corpus of 2048 u16 tokens, 4 KiB each) are read straight
    /// into the batch and checked there, long ops on verify workers: the same bytes as the
    /// model, whatever the plan (runs, chunks that neighbour in a shard, repeats, single
    /// records), op size, queue, pipeline depth and number of workers.
    #[test]
    fn whole_block_records_read_in_place_and_checked_off_thread_match_the_model(
        n in 40usize..200,
        shard_kib in 64u64..512,
        batches in prop::collection::vec(
            prop::collection::vec((any::<prop::sample::Index>(), 1usize..40), 0..6), 1..6),
        op_blocks in prop_oneof![1usize..4, 16usize..40],
        queue_depth in 1u32..9,
        depth in 1usize..4,
        uring: bool,
        threads in 0usize..3,
    ) {
        let records: Vec<Vec<u8>> = (0..n).map(|i| bytes(i as u64 + 7, 4096)).collect();
        let dir = tempdir();
        let layout = tokens_layout(2048);
        let (_, mut reader) =
            reader_of(dir.path(), layout, shard_kib << 10, &records, (uring, queue_depth, op_blocks), threads);
        let batches = batches_of_runs(&batches, n);
        let mut delivered = Vec::new();
        reader.read_batches(&batches, depth, &mut |batch| {
            delivered.push(batch.data().to_vec());
            Ok(())
        }).unwrap();
        prop_assert_eq!(delivered.len(), batches.len());
        for (got, wanted) in delivered.iter().zip(&batches) {
            let expected: Vec<u8> = wanted.iter().flat_map(|&i| records[i as usize].clone()).collect();
            prop_assert!(got == &expected, "a batch differs from the model");
        }
        let stats = reader.stats();
        // Only ops of 64 KiB and more go straight into the batch.
        prop_assert!(stats.ops_direct <= stats.ops);
        if op_blocks < 16 {
            prop_assert_eq!(stats.ops_direct, 0);
        }
        if threads == 0 || op_blocks < 16 {
            prop_assert_eq!(stats.ops_offloaded, 0);
        }
        prop_assert!(stats.ops_offloaded <= stats.ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Records that are not whole blocks, read in runs (a sequential or block-shuffled plan over
    /// variable-length documents) with verify workers: long ops are read into scratch memory and
    /// checked and copied into the batch by a worker, short ones on the reading thread; the
    /// batches are the model's whatever the plan, op size, queue, pipeline depth and workers.
    #[test]
    fn records_copied_into_the_batch_by_workers_match_the_model(
        sizes in prop::collection::vec(prop_oneof![0usize..100, 100usize..5000, 5000usize..20000], 20..150),
        shard_kib in 64u64..600,
        batches in prop::collection::vec(
            prop::collection::vec((any::<prop::sample::Index>(), 1usize..60), 1..5), 1..6),
        op_blocks in 16usize..40,
        queue_depth in 1u32..9,
        depth in 1usize..4,
        uring: bool,
        threads in 1usize..3,
    ) {
        let records: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| bytes(i as u64 + 17, n)).collect();
        let n = records.len();
        let dir = tempdir();
        let (_, mut reader) =
            reader_of(dir.path(), Layout::Bytes, shard_kib << 10, &records, (uring, queue_depth, op_blocks), threads);
        let batches = batches_of_runs(&batches, n);
        let mut delivered = Vec::new();
        reader.read_batches(&batches, depth, &mut |batch| {
            delivered.push(batch.records().map(<[u8]>::to_vec).collect::<Vec<_>>());
            Ok(())
        }).unwrap();
        prop_assert_eq!(delivered.len(), batches.len());
        for (got, wanted) in delivered.iter().zip(&batches) {
            let expected: Vec<Vec<u8>> = wanted.iter().map(|&i| records[i as usize].clone()).collect();
            prop_assert!(got == &expected, "a batch differs from the model");
        }
        let stats = reader.stats();
        prop_assert!(stats.ops_offloaded <= stats.ops);
    }
}

/// With verify workers and long ops, a full read of the dataset in runs has its checks done off
/// the reading thread: the counters say so (the property test above allows zero).
#[test]
fn long_ops_read_into_the_batch_are_checked_by_a_worker() {
    let records: Vec<Vec<u8>> = (0..256).map(|i| bytes(i + 3, 4096)).collect();
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    ingest(&mut granary, "w", tokens_layout(2048), small_shards(256 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("w").unwrap()).unwrap();
    for backend in [Backend::Pread, Backend::Uring] {
        let io = IoConfig { backend, queue_depth: 4, op_bytes_max: 128 << 10, direct: true }.build().unwrap();
        let mut reader = Reader::new(std::sync::Arc::clone(&dataset), io);
        reader.set_verify_threads(2);
        let batches: Vec<Vec<u64>> = (0..8).map(|b| (b * 32..b * 32 + 32).collect()).collect();
        read_as_the_model(&mut reader, &batches, 3, &records, &format!("{backend:?}"));
        let stats = reader.stats();
        assert_eq!(stats.ops_direct, stats.ops, "{backend:?}: {stats:?}");
        assert_eq!(stats.ops_offloaded, stats.ops, "{backend:?}: {stats:?}");
        assert_eq!(stats.blocks_verified, 256, "{backend:?}: {stats:?}");
    }
}

/// Records that are not whole blocks (a token corpus of variable-length documents) cannot be
/// read straight into the batch; with verify workers, their long ops are read into the reader's
/// scratch memory and checked and copied into the batch by a worker, and the short ones on the
/// reading thread: every op is counted once, and the bytes are the model's.
#[test]
fn long_ops_of_records_that_are_not_whole_blocks_are_checked_and_copied_by_a_worker() {
    let records: Vec<Vec<u8>> = (0..300).map(|i| bytes(i + 5, 1000 + (i as usize * 37) % 3000)).collect();
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    ingest(&mut granary, "v", Layout::Bytes, small_shards(256 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("v").unwrap()).unwrap();
    for backend in [Backend::Pread, Backend::Uring] {
        let io = IoConfig { backend, queue_depth: 4, op_bytes_max: 128 << 10, direct: true }.build().unwrap();
        let mut reader = Reader::new(std::sync::Arc::clone(&dataset), io);
        reader.set_verify_threads(2);
        let batches: Vec<Vec<u64>> = (0..10).map(|b| (b * 30..b * 30 + 30).collect()).collect();
        read_as_the_model(&mut reader, &batches, 3, &records, &format!("{backend:?}"));
        let stats = reader.stats();
        assert_eq!(stats.ops_direct, 0, "{backend:?}: {stats:?}");
        // Batches of about 75 KiB: the ops of 64 KiB or more went to a worker (7 of 12 here);
        // shards' ends make shorter ones.
        assert!(stats.ops_offloaded * 2 >= stats.ops && stats.ops_offloaded <= stats.ops, "{backend:?}: {stats:?}");
    }
}
