//! The fragment format and the coder: round trips, and every kind of damage refused.

use super::*;

/// A shard-like file of `blocks` blocks of made-up bytes (the coder does not parse shards).
fn shard(blocks: usize, seed: u64) -> Vec<u8> {
    crate::shard::tests::noise(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), blocks * BLOCK_BYTES)
}

fn id(bytes: &[u8]) -> ShardId {
    ShardId(ObjectId::of(bytes))
}

fn decoded(files: &[Vec<u8>]) -> Vec<Fragment> {
    files.iter().map(|f| Fragment::decode(f.clone()).expect("a fragment")).collect()
}

#[test]
fn any_k_fragments_rebuild_the_shard() {
    let coding = Coding::new(4, 2).expect("4+2");
    let bytes = shard(13, 1);
    let files = encode(&bytes, coding).expect("encode");
    assert_eq!(files.len(), 6);
    let fragments = decoded(&files);
    for a in 0..6 {
        for b in a + 1..6 {
            let kept: Vec<Fragment> =
                fragments.iter().enumerate().filter(|(i, _)| *i != a && *i != b).map(|(_, f)| f.clone()).collect();
            assert_eq!(reconstruct(id(&bytes), &kept).expect("rebuilt"), bytes, "without fragments {a} and {b}");
        }
    }
    let three: Vec<Fragment> = fragments[..3].to_vec();
    let err = reconstruct(id(&bytes), &three).expect_err("3 of 4+2");
    assert!(err.to_string().contains("3 of its 6 fragments at hand, 4 needed"), "{err}");
}

#[test]
fn damaged_fragments_are_refused_with_the_reason() {
    let coding = Coding::new(2, 1).expect("2+1");
    let bytes = shard(5, 2);
    let files = encode(&bytes, coding).expect("encode");
    // A flipped bit in a data block.
    let mut flipped = files[1].clone();
    flipped[BLOCK_BYTES + 100] ^= 4;
    assert!(matches!(Fragment::decode(flipped), Err(FormatError::BlockChecksum { block: 0, .. })));
    // Truncated.
    let mut short = files[0].clone();
    short.truncate(short.len() - BLOCK_BYTES);
    assert!(matches!(Fragment::decode(short), Err(FormatError::Truncated { .. })));
    assert!(matches!(Fragment::decode(files[0][..100].to_vec()), Err(FormatError::Truncated { .. })));
    // A header bit.
    let mut header = files[0].clone();
    header[57] ^= 1;
    assert!(matches!(Fragment::decode(header), Err(FormatError::ChecksumMismatch { .. })));
    // A newer version reads as unsupported, not as damage.
    let mut newer = files[0].clone();
    newer[8] = 2;
    assert!(matches!(Fragment::decode(newer), Err(FormatError::UnsupportedVersion { found: 2, .. })));
    // A checksum table entry.
    let mut table = files[2].clone();
    let at = table.len() - BLOCK_BYTES;
    table[at] ^= 1;
    assert!(matches!(Fragment::decode(table), Err(FormatError::ChecksumMismatch { .. })));
}

#[test]
fn fragments_of_another_shard_or_a_repeat_are_not_used() {
    let coding = Coding::new(2, 2).expect("2+2");
    let (one, two) = (shard(4, 3), shard(4, 4));
    let a = decoded(&encode(&one, coding).expect("encode"));
    let b = decoded(&encode(&two, coding).expect("encode"));
    let refused = |fragments: &[Fragment], wanted: &[u8], why: &str| {
        let err = reconstruct(id(wanted), fragments).expect_err(why);
        assert!(matches!(err, Error::BadFragments { .. }), "{why}: {err}");
        assert!(err.is_corruption(), "{why}");
        err.to_string()
    };
    assert!(refused(&[a[0].clone(), b[1].clone()], &one, "mixed shards").contains("not of this shard"));
    assert!(refused(&[a[0].clone(), a[0].clone()], &one, "a repeat").contains("given twice"));
    // k whole, checked fragments of another shard than the one asked for.
    assert!(refused(&[b[0].clone(), b[1].clone()], &one, "another shard").contains("not of this shard"));
    // Another coding of the same shard.
    let other = decoded(&encode(&one, Coding::new(3, 1).expect("3+1")).expect("encode"));
    assert!(refused(&[a[0].clone(), other[1].clone()], &one, "mixed codings").contains("not of this shard"));
}

/// A fragment whose checks pass but whose payload is not the shard's (a coder bug, or a forged
/// fragment with its checksums redone): the rebuilt bytes do not hash to the id, and nothing
/// is returned.
#[test]
fn a_rebuilt_shard_that_does_not_hash_to_its_id_is_refused() {
    let coding = Coding::new(2, 1).expect("2+1");
    let files = encode(&shard(4, 5), coding).expect("encode");
    let fragments = decoded(&files);
    let forged_header = *fragments[0].header();
    let mut payload = fragments[0].payload().to_vec();
    payload[7] ^= 0x80;
    let mut file = fragments[0].file().to_vec();
    file[BLOCK_BYTES..BLOCK_BYTES + payload.len()].copy_from_slice(&payload);
    seal(&forged_header, &mut file);
    let forged = Fragment::decode(file).expect("its checks pass");
    let err = reconstruct(forged_header.shard, &[forged, fragments[1].clone()]).expect_err("forged");
    assert!(matches!(err, Error::BadFragments { .. }), "{err}");
    assert!(err.to_string().contains("not to the shard's id"), "{err}");
}

/// Coding a stripe at a time gives the bytes the coder gives for whole fragments: fragments
/// of several stripes, the last one short, against the crate's one-shot encode.
#[test]
fn striped_parity_is_the_coders_parity() {
    let coding = Coding::new(3, 2).expect("3+2");
    let bytes = shard(2 * STRIPE_BYTES / BLOCK_BYTES * 3 + 7, 6);
    let files = encode(&bytes, coding).expect("encode");
    let fragments = decoded(&files);
    let payload = fragments[0].payload().len();
    assert!(payload > 2 * STRIPE_BYTES && !payload.is_multiple_of(STRIPE_BYTES), "{payload}");
    let originals: Vec<&[u8]> = fragments[..3].iter().map(Fragment::payload).collect();
    let parity = reed_solomon_simd::encode(3, 2, &originals).expect("the crate encodes");
    assert_eq!(fragments[3].payload(), &parity[0][..]);
    assert_eq!(fragments[4].payload(), &parity[1][..]);
    // And decoding stripes: every pair of fragments lost.
    for lost in [[0, 1], [0, 2], [1, 2], [2, 4], [0, 3]] {
        let kept: Vec<Fragment> =
            fragments.iter().enumerate().filter(|(i, _)| !lost.contains(i)).map(|(_, f)| f.clone()).collect();
        assert_eq!(reconstruct(id(&bytes), &kept).expect("rebuilt"), bytes, "without {lost:?}");
    }
}

#[test]
fn codings_parse_and_sizes_add_up() {
    assert_eq!(Coding::parse("4+2").expect("4+2"), Coding::new(4, 2).expect("4+2"));
    assert_eq!(Coding::parse(" 10 + 4 ").expect("10+4").to_string(), "10+4");
    for bad in ["4", "4+0", "0+2", "4+x", "65+1", "+"] {
        assert!(Coding::parse(bad).is_err(), "{bad}");
    }
    // A 64 MiB shard in 4+2: 1.5 x plus, per fragment, a header block and a checksum table
    // (16 KiB for 16 MiB): 1.5018, under the 1.51.
    let coding = Coding::new(4, 2).expect("4+2");
    let shard_bytes = 64u64 << 20;
    let stored = coding.file_bytes(shard_bytes) * coding.n() as u64;
    assert_eq!(stored, 6 * (4096 + (16 << 20) + (16 << 10)));
    let ratio = stored as f64 / shard_bytes as f64;
    assert!((1.5..=1.51).contains(&ratio), "{ratio}");
}

use proptest::prelude::prop_oneof;

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..proptest::prelude::ProptestConfig::default() })]

    /// Encode, drop any `m` fragments (and shuffle the rest), decode: the shard comes back, for
    /// random codings and lengths.
    #[test]
    fn encode_then_drop_any_m_then_decode_gives_the_shard_back(
        k in 1u8..12,
        m in 1u8..6,
        blocks in prop_oneof![2usize..40, 40usize..200],
        seed: u64,
        drop_seed: u64,
    ) {
        let coding = Coding::new(k, m).expect("in range");
        let bytes = shard(blocks, seed);
        let files = encode(&bytes, coding).expect("encode");
        proptest::prop_assert_eq!(files.len(), coding.n());
        let mut fragments = decoded(&files);
        // A Fisher-Yates shuffle from the seed, then the first m dropped.
        let mut state = drop_seed | 1;
        for i in (1..fragments.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            fragments.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let kept = &fragments[usize::from(m)..];
        proptest::prop_assert_eq!(reconstruct(id(&bytes), kept).expect("rebuilt"), bytes);
        for file in &files {
            proptest::prop_assert_eq!(file.len() as u64, coding.file_bytes(blocks as u64 * 4096));
        }
    }

    /// A real header with any byte changed and its CRC redone: decoding never panics, and what
    /// it accepts encodes back to the same block.
    #[test]
    fn header_decoding_never_panics_and_round_trips(at in 0usize..4092, value: u8) {
        let file = &encode(&shard(3, 8), Coding::new(2, 1).expect("2+1")).expect("encode")[0];
        let mut block = file[..BLOCK_BYTES].to_vec();
        block[at] = value;
        let crc = crc32c(&block[..BLOCK_BYTES - 4]);
        block[BLOCK_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
        if let Ok((header, table_crc)) = FragmentHeader::decode(&block) {
            proptest::prop_assert_eq!(&header.encode(table_crc)[..], &block[..]);
        }
    }
}

/// Writes the fragments of a small shard in a few codings to `$GRANARY_FRAGMENT_SEEDS`, the
/// fuzz target's corpus (`scripts/fuzz-seeds.sh`).
#[test]
#[ignore = "writes fuzz seeds; run by scripts/fuzz-seeds.sh"]
fn write_fragment_fuzz_seeds() {
    let dir = std::path::PathBuf::from(std::env::var("GRANARY_FRAGMENT_SEEDS").expect("GRANARY_FRAGMENT_SEEDS is set"));
    std::fs::create_dir_all(&dir).expect("the seed directory");
    for (k, m) in [(1, 1), (2, 1), (4, 2)] {
        let coding = Coding::new(k, m).expect("in range");
        for (i, file) in encode(&shard(3, 9), coding).expect("encode").iter().enumerate() {
            std::fs::write(dir.join(format!("{k}+{m}-{i}")), file).expect("a seed file");
        }
    }
}

/// Each field the header checks behind its CRC, changed and resealed: refused, and named.
#[test]
fn header_fields_out_of_range_are_refused() {
    let file = encode(&shard(3, 10), Coding::new(2, 1).expect("2+1")).expect("encode").remove(0);
    type Change = fn(&mut [u8]);
    let cases: [(&str, Change); 8] = [
        ("block size", |b| b[13] = 0),
        ("coding", |b| b[56] = 0),
        ("coding", |b| b[57] = 65),
        ("fragment 3 of a 2+1", |b| b[58] = 3),
        ("a shard of", |b| b[48] = 1),
        ("payload bytes", |b| b[64] ^= 0x40),
        ("reserved", |b| b[60] = 1),
        ("reserved", |b| b[2000] = 1),
    ];
    for (why, change) in cases {
        let mut bytes = file.clone();
        change(&mut bytes);
        fix_checksums(&mut bytes);
        let err = Fragment::check(&bytes).expect_err(why);
        assert!(matches!(err, FormatError::Inconsistent { .. }), "{why}: {err}");
        assert!(err.to_string().contains(why), "{why}: {err}");
    }
}

/// Bytes that must be zero and are covered by checksums: checked even with the checksums
/// redone, and a rebuild with non-zero padding past the shard's end is refused.
#[test]
fn padding_must_be_zero() {
    // 3 blocks in 2+1: 6144 payload bytes per fragment, so each has padding in its last block.
    let bytes = shard(3, 11);
    let files = encode(&bytes, Coding::new(2, 1).expect("2+1")).expect("encode");
    let mut padded = files[0].clone();
    padded[BLOCK_BYTES + 6144 + 5] = 1;
    fix_checksums(&mut padded);
    assert!(Fragment::check(&padded).expect_err("payload padding").to_string().contains("payload padding"));
    let mut table = files[0].clone();
    let end = table.len() - 1;
    table[end] = 1;
    fix_checksums(&mut table);
    assert!(Fragment::check(&table).expect_err("table padding").to_string().contains("table padding"));
    // 5 blocks in 3+1: 6848 bytes per fragment (a third, rounded up to 64), 20544 in all for a
    // 20480-byte shard: the last data fragment ends in 64 bytes of padding.
    let bytes = shard(5, 12);
    let fragments = decoded(&encode(&bytes, Coding::new(3, 1).expect("3+1")).expect("encode"));
    let mut last = fragments[2].file().to_vec();
    let payload = usize::try_from(fragments[2].header().fragment_bytes()).expect("small");
    assert_eq!(payload, 6848);
    last[BLOCK_BYTES + payload - 1] = 7;
    fix_checksums(&mut last);
    let last = Fragment::decode(last).expect("the fragment's own checks pass");
    let err = reconstruct(id(&bytes), &[fragments[0].clone(), fragments[1].clone(), last]).expect_err("padding");
    assert!(err.to_string().contains("padding past the shard's end"), "{err}");
}

/// The parity bytes are the format's (docs/format.md names reed-solomon-simd 3.1's coding): a
/// known answer, so that a change of the coder's output is seen here, not on a node that cannot
/// rebuild from old fragments.
#[test]
fn parity_is_a_known_answer() {
    let files = encode(&shard(5, 13), Coding::new(3, 2).expect("3+2")).expect("encode");
    let ids: Vec<String> = files[3..].iter().map(|f| ObjectId::of(f).to_string()).collect();
    assert_eq!(
        ids,
        [
            "e3d29b471f0cbc20fe3fe40c6fc14d1a8d1fa94e5acc2de6723d99384cc1feb8",
            "107fadfc31daf82c86db02c7d9e0bd329e48c680f14b7d17d4d4f6b6c5fed37c"
        ]
    );
}
