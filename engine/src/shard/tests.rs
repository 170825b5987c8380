//! Property tests of the shard format: round trips, and every single-bit flip and every
//! truncation of a shard file is detected.

use proptest::prelude::*;

use super::*;
use crate::error::FormatError;

/// Writes `records` into an in-memory shard.
fn shard_bytes(layout: &Layout, records: &[Vec<u8>]) -> (Vec<u8>, WrittenShard) {
    let mut writer = ShardWriter::new(Vec::new(), "memory".into(), layout.clone()).unwrap();
    for record in records {
        writer.push(record).unwrap();
    }
    writer.finish().unwrap()
}

/// Reads every record back through the decoded metadata, checking every block on the way.
fn records_back(bytes: &[u8]) -> Result<Vec<Vec<u8>>, FormatError> {
    let meta = check_file_bytes(bytes)?;
    let data = &bytes[BLOCK_BYTES..];
    Ok((0..meta.n_records())
        .map(|i| {
            let range = meta.record_range(i);
            data[range.start as usize..range.end as usize].to_vec()
        })
        .collect())
}

fn variable_records() -> impl Strategy<Value = Vec<Vec<u8>>> {
    // Sizes around block boundaries matter most: 0, 1, 4095, 4096, 4097 and runs across blocks.
    let size = prop_oneof![0usize..16, 4090usize..4100, 0usize..20_000];
    prop::collection::vec(size.prop_flat_map(|n| prop::collection::vec(any::<u8>(), n)), 0..24)
}

fn fixed_records() -> impl Strategy<Value = (Layout, Vec<Vec<u8>>)> {
    (prop::sample::select(Dtype::ALL.to_vec()), prop::collection::vec(1u64..40, 0..3), 0usize..60).prop_flat_map(
        |(dtype, dims, n)| {
            let layout = FixedLayout::new(dtype, &dims).unwrap();
            let record = prop::collection::vec(any::<u8>(), layout.record_bytes() as usize);
            (Just(Layout::Fixed(layout)), prop::collection::vec(record, n))
        },
    )
}

proptest! {
    #[test]
    fn variable_records_round_trip(records in variable_records(), samples: bool) {
        let layout = if samples { Layout::Samples } else { Layout::Bytes };
        let (bytes, written) = shard_bytes(&layout, &records);
        prop_assert_eq!(written.id.0, crate::id::ObjectId::of(&bytes));
        prop_assert_eq!(written.file_bytes, bytes.len() as u64);
        prop_assert_eq!(bytes.len() % BLOCK_BYTES, 0);
        prop_assert_eq!(records_back(&bytes).unwrap(), records);
    }

    #[test]
    fn fixed_records_round_trip((layout, records) in fixed_records()) {
        let (bytes, written) = shard_bytes(&layout, &records);
        prop_assert_eq!(written.n_records, records.len() as u64);
        let meta = ShardMeta::from_file_bytes(&bytes).unwrap();
        prop_assert_eq!(meta.layout(), &layout);
        prop_assert_eq!(records_back(&bytes).unwrap(), records);
    }

    #[test]
    fn any_single_bit_flip_is_detected(records in variable_records(), bit in any::<prop::sample::Index>()) {
        let (mut bytes, _) = shard_bytes(&Layout::Bytes, &records);
        let bit = bit.index(bytes.len() * 8);
        bytes[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(check_file_bytes(&bytes).is_err(), "flip of bit {} went unnoticed", bit);
    }

    #[test]
    fn any_truncation_is_detected(records in variable_records(), cut in any::<prop::sample::Index>()) {
        let (bytes, _) = shard_bytes(&Layout::Bytes, &records);
        let len = cut.index(bytes.len());
        prop_assert!(check_file_bytes(&bytes[..len]).is_err(), "truncation to {} bytes went unnoticed", len);
    }

    #[test]
    fn mutations_behind_fixed_checksums_never_panic_the_decoder(
        records in variable_records(),
        samples: bool,
        mutations in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let layout = if samples { Layout::Samples } else { Layout::Bytes };
        let records: Vec<Vec<u8>> = if samples {
            records.iter().map(|r| encode_sample("k", &[("bin", r)])).collect()
        } else {
            records
        };
        let (mut bytes, _) = shard_bytes(&layout, &records);
        // Aim at the metadata (the last blocks) as often as at the data.
        for (at, value) in mutations {
            let at = if value % 2 == 0 { at.index(bytes.len()) } else { bytes.len() - 1 - at.index((3 * BLOCK_BYTES).min(bytes.len())) };
            bytes[at] = value;
        }
        fix_checksums(&mut bytes);
        let _ = fuzz_decode(&bytes);
    }

    #[test]
    fn the_decoder_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..20_000)) {
        let _ = fuzz_decode(&bytes);
    }
}

/// Not sampled: every bit of a shard with records across block boundaries, one at a time.
#[test]
fn every_single_bit_flip_of_a_small_shard_is_detected() {
    let records: Vec<Vec<u8>> =
        [0usize, 1, 4095, 4097, 300].iter().map(|&n| (0..n).map(|i| (i * 7) as u8).collect()).collect();
    let (bytes, _) = shard_bytes(&Layout::Bytes, &records);
    assert_eq!(records_back(&bytes).unwrap(), records);
    let mut flipped = bytes.clone();
    for bit in 0..bytes.len() * 8 {
        flipped[bit / 8] ^= 1 << (bit % 8);
        assert!(check_file_bytes(&flipped).is_err(), "flip of bit {bit} went unnoticed");
        flipped[bit / 8] ^= 1 << (bit % 8);
    }
    for len in 0..bytes.len() {
        assert!(check_file_bytes(&bytes[..len]).is_err(), "truncation to {len} bytes went unnoticed");
    }
}

#[test]
fn a_block_read_from_the_wrong_place_fails_its_check() {
    let records = vec![vec![0xaa; 4096], vec![0xaa; 4096], (0..4096).map(|i| (i % 251) as u8).collect()];
    let (bytes, _) = shard_bytes(&Layout::Bytes, &records);
    let meta = ShardMeta::from_file_bytes(&bytes).unwrap();
    let block = |i: usize| &bytes[BLOCK_BYTES * (i + 1)..BLOCK_BYTES * (i + 2)];
    for i in 0..3 {
        assert!(meta.check_block(i as u64, block(i)).is_ok());
    }
    // Blocks 0 and 1 hold the same bytes, yet a block travelling with its own checksum does not
    // pass at another index: the checksum is bound to the position.
    assert_eq!(block(0), block(1));
    assert_ne!(meta.expected_crc(0), meta.expected_crc(1));
    assert_ne!(block_crc(1, block(0)), meta.expected_crc(0));
    // A misdirected read of different bytes fails, as does a read off by one byte.
    assert!(meta.check_block(0, block(2)).is_err());
    assert!(meta.check_block(2, &bytes[3 * BLOCK_BYTES + 1..4 * BLOCK_BYTES + 1]).is_err());
}

#[test]
fn a_fixed_record_of_the_wrong_size_is_refused() {
    let layout = Layout::Fixed(FixedLayout::new(Dtype::U16, &[8]).unwrap());
    let mut writer = ShardWriter::new(Vec::new(), "memory".into(), layout).unwrap();
    assert!(writer.push(&[0u8; 16]).is_ok());
    assert!(matches!(writer.push(&[0u8; 15]), Err(crate::Error::InvalidInput { .. })));
}

#[test]
fn identical_records_make_identical_shards() {
    let records: Vec<Vec<u8>> = (0..50u8).map(|i| vec![i; usize::from(i) * 100]).collect();
    let (a, id_a) = shard_bytes(&Layout::Samples, &records);
    let (b, id_b) = shard_bytes(&Layout::Samples, &records);
    assert_eq!(a, b);
    assert_eq!(id_a, id_b);
    let (_, other) = shard_bytes(&Layout::Bytes, &records);
    assert_ne!(id_a.id, other.id, "the layout is part of the content");
}

#[test]
fn fixed_checksums_make_an_intact_shard_again() {
    let records: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; usize::from(i) * 500]).collect();
    let (mut bytes, _) = shard_bytes(&Layout::Bytes, &records);
    let original = bytes.clone();
    fix_checksums(&mut bytes);
    assert_eq!(bytes, original, "the checksums were right already");
    bytes[BLOCK_BYTES + 7] ^= 0xff;
    assert!(check_file_bytes(&bytes).is_err());
    fix_checksums(&mut bytes);
    assert!(check_file_bytes(&bytes).is_ok(), "a data change behind fixed checksums decodes");
}

#[test]
fn a_future_format_version_is_reported_as_such() {
    let (mut bytes, _) = shard_bytes(&Layout::Bytes, &[vec![1, 2, 3]]);
    bytes[8] = 2;
    let crc = crc32c::crc32c(&bytes[..BLOCK_BYTES - 4]);
    bytes[BLOCK_BYTES - 4..BLOCK_BYTES].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        ShardMeta::from_file_bytes(&bytes),
        Err(FormatError::UnsupportedVersion { found: 2, supported: 1, .. })
    ));
}

/// Pseudo-random bytes, the same for the same seed (xorshift; the erasure tests use it too).
pub(crate) fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A run checked in one pass agrees with a check per block: intact blocks pass, and any
    /// flipped bit, any wrong stored checksum and any two blocks swapped fail.
    #[test]
    fn blocks_checked_together_agree_with_blocks_checked_one_by_one(
        first_block in 0u64..1 << 40,
        n_blocks in 1usize..3 * CHECK_RUN_BLOCKS + 2,
        seed in any::<u64>(),
        flip in any::<(usize, u8)>(),
        wrong in any::<(usize, u32)>(),
        swap in any::<(usize, usize)>(),
    ) {
        let bytes = noise(seed, n_blocks * BLOCK_BYTES);
        let blocks = |bytes: &[u8]| -> Vec<u32> {
            bytes.chunks_exact(BLOCK_BYTES).zip(first_block..).map(|(b, i)| block_crc(i, b)).collect()
        };
        let expected = blocks(&bytes);
        prop_assert!(blocks_match(first_block, &bytes, &expected));
        // Each block's bytes alone have the CRC its stored checksum implies (the one a copy out
        // of the tier compares with).
        for ((chunk, &stored), block) in bytes.chunks_exact(BLOCK_BYTES).zip(&expected).zip(first_block..) {
            prop_assert_eq!(super::format::bytes_crc(block, stored), crc32c::crc32c(chunk));
        }

        let mut flipped = bytes.clone();
        flipped[flip.0 % bytes.len()] ^= 1 << (flip.1 % 8);
        prop_assert!(!blocks_match(first_block, &flipped, &expected));

        let mut lying = expected.clone();
        lying[wrong.0 % n_blocks] ^= wrong.1.max(1);
        prop_assert!(!blocks_match(first_block, &bytes, &lying));

        let (a, b) = (swap.0 % n_blocks, swap.1 % n_blocks);
        if a != b {
            let mut swapped = bytes.clone();
            for k in 0..BLOCK_BYTES {
                swapped.swap(a * BLOCK_BYTES + k, b * BLOCK_BYTES + k);
            }
            prop_assert!(!blocks_match(first_block, &swapped, &expected));
        }
        prop_assert!(!blocks_match(first_block, &bytes[..bytes.len() - BLOCK_BYTES], &expected));
    }
}

#[test]
fn check_blocks_names_the_bad_block_of_a_run_checked_in_one_pass() {
    let records: Vec<Vec<u8>> = (0..40).map(|i| noise(i, 4096)).collect();
    let layout = Layout::Fixed(FixedLayout::new(Dtype::U8, &[4096]).unwrap());
    let (mut bytes, _) = shard_bytes(&layout, &records);
    let meta = ShardMeta::from_file_bytes(&bytes).unwrap();
    let data = BLOCK_BYTES..BLOCK_BYTES * 41;
    assert_eq!(meta.check_blocks(0, &bytes[data.clone()]), Ok(()));
    assert_eq!(meta.check_blocks(3, &bytes[BLOCK_BYTES * 4..BLOCK_BYTES * 37]), Ok(()));
    bytes[BLOCK_BYTES * 30 + 17] ^= 0x10;
    let (block, expected, actual) = meta.check_blocks(0, &bytes[data]).unwrap_err();
    assert_eq!(block, 29);
    assert_eq!(expected, meta.expected_crc(29));
    assert_ne!(actual, expected);
}
