//! `batch_plan.rs`'s unit tests: a copy from the tier checks every block a record touches.
//!
//! Owns the tests and their shard fixture. Never: is built outside `cargo test`.

use super::*;
use crate::shard::{Layout, ShardWriter, check_file_bytes};

/// A shard of variable-length records that start and end inside blocks and span several,
/// its data region, and its metadata.
fn shard() -> (Vec<u8>, crate::shard::ShardMeta, Vec<Range<u64>>) {
    let records: Vec<Vec<u8>> =
        [100usize, 3000, 9000, 4096, 50, 20000].iter().enumerate().map(|(i, &n)| vec![i as u8 + 1; n]).collect();
    let mut writer = ShardWriter::new(Vec::new(), "memory".into(), Layout::Bytes).unwrap();
    for record in &records {
        writer.push(record).unwrap();
    }
    let (file, _) = writer.finish().unwrap();
    let meta = check_file_bytes(&file).unwrap();
    let data = file[to_usize(DATA_OFFSET)..to_usize(DATA_OFFSET + meta.n_data_blocks() * BLOCK_BYTES_U64)].to_vec();
    let ranges = (0..meta.n_records()).map(|i| meta.record_range(i)).collect();
    (data, meta, ranges)
}

#[test]
fn a_copy_from_the_tier_checks_every_block_the_record_touches_wherever_a_bit_flips() {
    let (data, meta, ranges) = shard();
    // Intact: every record copies and checks, as a whole and cut at a block inside it.
    for range in &ranges {
        let mut dst = vec![0u8; to_usize(range.end - range.start)];
        assert_eq!(copy_checked(&meta, &data, 0, range.clone(), &mut dst), Ok(()));
        assert_eq!(dst, data[to_usize(range.start)..to_usize(range.end)]);
    }
    // An "extent" that starts at block 2: offsets are the data region's.
    let at = 2 * BLOCK_BYTES_U64;
    let range = ranges.iter().find(|r| r.start >= at).unwrap().clone();
    let mut dst = vec![0u8; to_usize(range.end - range.start)];
    assert_eq!(copy_checked(&meta, &data[to_usize(at)..], at, range.clone(), &mut dst), Ok(()));
    // One bit flipped anywhere in a block a record touches fails that record's copy, naming the
    // block: inside the record, or in the same block outside it (another record's bytes).
    for range in &ranges {
        let touched = range.start / BLOCK_BYTES_U64..range.end.div_ceil(BLOCK_BYTES_U64);
        for at_byte in [
            range.start,
            range.end - 1,
            touched.start * BLOCK_BYTES_U64,
            touched.end * BLOCK_BYTES_U64 - 1,
            (range.start + range.end) / 2,
        ] {
            let mut damaged = data.clone();
            damaged[to_usize(at_byte)] ^= 0x04;
            let mut dst = vec![0u8; to_usize(range.end - range.start)];
            let outcome = copy_checked(&meta, &damaged, 0, range.clone(), &mut dst);
            assert_eq!(outcome, Err(at_byte / BLOCK_BYTES_U64), "record {range:?}, flip at {at_byte}");
        }
        // A flip in a block the record does not touch is not this copy's business.
        if touched.end < meta.n_data_blocks() {
            let mut damaged = data.clone();
            damaged[to_usize(touched.end * BLOCK_BYTES_U64)] ^= 0x04;
            let mut dst = vec![0u8; to_usize(range.end - range.start)];
            assert_eq!(copy_checked(&meta, &damaged, 0, range.clone(), &mut dst), Ok(()));
        }
    }
}
