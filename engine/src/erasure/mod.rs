//! Erasure coding: a shard file cut into `k` data fragments and `m` parity fragments
//! (Reed-Solomon, `reed-solomon-simd`), any `k` of which give the shard back.
//!
//! Owns: the fragment file format (docs/format.md, "Fragment file"): a header block naming the
//! shard's id and length, `k`, `m` and the fragment's index, then the fragment's bytes in 4 KiB
//! blocks, each with its CRC32C in a checksum table, as a shard's data blocks have; `encode`
//! (shard bytes to fragment files) and `reconstruct` (any `k` checked fragments to the shard's
//! bytes, checked against the shard's BLAKE3 id before they are returned).
//! `file.rs` reads fragment files (`FragmentFile`), checking them as they are read.
//! Never: writes files, picks nodes, or returns bytes that were not checked: a fragment
//! is used only once its header and every block checked out, and a reconstructed shard only when
//! its BLAKE3 is the id the fragments name.

mod file;

pub use file::FragmentFile;

use crate::error::{Error, FormatError, Result};
use crate::id::{ObjectId, ShardId};
use crate::shard::{BLOCK_BYTES, BLOCK_BYTES_U64, block_crc, crc32c};

/// The magic bytes that open a fragment file.
pub const MAGIC: [u8; 8] = *b"GRNFRAGM";
/// The fragment format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The most data fragments, and the most parity fragments, a shard is cut into: a fragment
/// lives on a node of its own, and jobs with more nodes than this code within groups.
pub const FRAGMENTS_MAX: u8 = 64;
/// Fragments are cut at multiples of this many bytes (the coder works in 64-byte units).
const FRAGMENT_ALIGN: u64 = 64;
/// The largest shard a fragment may name: 1 TiB, as for a shard file.
const SHARD_BYTES_MAX: u64 = crate::shard::FILE_BYTES_MAX;

/// A coding: `k` data fragments and `m` parity fragments; any `k` of the `k + m` rebuild the
/// shard, so it survives the loss of any `m`, at `(k + m) / k` of its size. Made only through
/// [`Coding::new`], so `k` and `m` are always in range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coding {
    k: u8,
    m: u8,
}

impl Coding {
    /// `k + m`, checked: `k` and `m` each from 1 to [`FRAGMENTS_MAX`].
    pub fn new(k: u8, m: u8) -> Result<Self> {
        if !(1..=FRAGMENTS_MAX).contains(&k) || !(1..=FRAGMENTS_MAX).contains(&m) {
            return Err(Error::invalid_input(format!(
                "an erasure coding of {k}+{m}: k and m must each be from 1 to {FRAGMENTS_MAX}"
            )));
        }
        Ok(Self { k, m })
    }

    /// Parses `K+M` (`4+2`).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = || Error::invalid_input(format!("{text:?} is not an erasure coding: write K+M, such as 4+2"));
        let (k, m) = text.trim().split_once('+').ok_or_else(bad)?;
        Self::new(k.trim().parse().map_err(|_| bad())?, m.trim().parse().map_err(|_| bad())?)
    }

    /// Data fragments.
    pub fn k(self) -> u8 {
        self.k
    }

    /// Parity fragments.
    pub fn m(self) -> u8 {
        self.m
    }

    /// Fragments in all.
    pub fn n(self) -> usize {
        usize::from(self.k) + usize::from(self.m)
    }

    /// Bytes of each fragment's payload for a shard of `shard_bytes`: a `k`th of it, rounded up
    /// to the coder's unit (the last data fragment is zero-padded).
    /// (Saturates rather than overflow for lengths no shard has.)
    pub fn fragment_bytes(self, shard_bytes: u64) -> u64 {
        shard_bytes.div_ceil(u64::from(self.k)).div_ceil(FRAGMENT_ALIGN).saturating_mul(FRAGMENT_ALIGN)
    }

    /// Bytes of each fragment file for a shard of `shard_bytes` (saturating, as above).
    pub fn file_bytes(self, shard_bytes: u64) -> u64 {
        let blocks = self.fragment_bytes(shard_bytes).div_ceil(BLOCK_BYTES_U64);
        let table_blocks = (4 * blocks).div_ceil(BLOCK_BYTES_U64);
        (1 + blocks + table_blocks).saturating_mul(BLOCK_BYTES_U64)
    }
}

impl std::fmt::Display for Coding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}+{}", self.k, self.m)
    }
}

/// What a fragment's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragmentHeader {
    /// The shard the fragment is of.
    pub shard: ShardId,
    /// The shard file's length.
    pub shard_bytes: u64,
    /// The coding the shard was cut with.
    pub coding: Coding,
    /// The fragment's place: `0..k` data, `k..k + m` parity.
    pub index: u8,
}

impl FragmentHeader {
    /// Payload bytes (before the last block's padding).
    pub fn fragment_bytes(&self) -> u64 {
        self.coding.fragment_bytes(self.shard_bytes)
    }

    /// Data blocks.
    pub fn n_blocks(&self) -> u64 {
        self.fragment_bytes().div_ceil(BLOCK_BYTES_U64)
    }

    /// Where the checksum table starts.
    pub fn crc_table_offset(&self) -> u64 {
        BLOCK_BYTES_U64 + self.n_blocks() * BLOCK_BYTES_U64
    }

    /// The fragment file's length.
    pub fn file_bytes(&self) -> u64 {
        self.coding.file_bytes(self.shard_bytes)
    }

    /// The header block, its checksum table's CRC32C given.
    fn encode(&self, crc_table_crc: u32) -> [u8; BLOCK_BYTES] {
        let mut block = [0u8; BLOCK_BYTES];
        block[0..8].copy_from_slice(&MAGIC);
        block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        block[12..16].copy_from_slice(&(BLOCK_BYTES as u32).to_le_bytes());
        block[16..48].copy_from_slice(self.shard.0.as_bytes());
        block[48..56].copy_from_slice(&self.shard_bytes.to_le_bytes());
        block[56] = self.coding.k;
        block[57] = self.coding.m;
        block[58] = self.index;
        block[64..72].copy_from_slice(&self.fragment_bytes().to_le_bytes());
        block[72..76].copy_from_slice(&crc_table_crc.to_le_bytes());
        let crc = crc32c(&block[..BLOCK_BYTES - 4]);
        block[BLOCK_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
        block
    }

    /// Decodes a header block: magic, version (before the CRC, so a newer format reads as
    /// unsupported, not corrupt), CRC, block size, coding, index, the shard's length, the
    /// payload's length against the coding, reserved bytes. Returns the header and the checksum
    /// table's CRC32C. Never panics, whatever the bytes (the fuzz target calls it).
    pub fn decode(block: &[u8]) -> std::result::Result<(Self, u32), FormatError> {
        const REGION: &str = "fragment header";
        if block.len() != BLOCK_BYTES {
            return Err(FormatError::Truncated {
                region: REGION,
                detail: format!("{} bytes, not {BLOCK_BYTES}", block.len()),
            });
        }
        if block[0..8] != MAGIC {
            return Err(FormatError::BadMagic { region: REGION });
        }
        let u32_at = |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion { region: REGION, found: version, supported: FORMAT_VERSION });
        }
        let (expected, actual) = (u32_at(BLOCK_BYTES - 4), crc32c(&block[..BLOCK_BYTES - 4]));
        if expected != actual {
            return Err(FormatError::ChecksumMismatch { region: REGION, expected, actual });
        }
        let invalid = |detail: String| FormatError::Inconsistent { field: REGION, detail };
        if u32_at(12) != BLOCK_BYTES as u32 {
            return Err(invalid(format!("block size {}, not {BLOCK_BYTES}", u32_at(12))));
        }
        let coding = Coding::new(block[56], block[57])
            .map_err(|_| invalid(format!("coding {}+{} out of range", block[56], block[57])))?;
        let index = block[58];
        if usize::from(index) >= coding.n() {
            return Err(invalid(format!("fragment {index} of a {coding} coding")));
        }
        let shard_bytes = u64_at(48);
        if shard_bytes < 2 * BLOCK_BYTES_U64
            || !shard_bytes.is_multiple_of(BLOCK_BYTES_U64)
            || shard_bytes > SHARD_BYTES_MAX
        {
            return Err(invalid(format!("a shard of {shard_bytes} bytes")));
        }
        if u64_at(64) != coding.fragment_bytes(shard_bytes) {
            return Err(invalid(format!(
                "{} payload bytes, not the {} a {coding} coding of {shard_bytes} bytes gives",
                u64_at(64),
                coding.fragment_bytes(shard_bytes)
            )));
        }
        if block[59..64].iter().chain(&block[76..BLOCK_BYTES - 4]).any(|&b| b != 0) {
            return Err(invalid("reserved bytes are not zero".to_owned()));
        }
        let shard = ShardId(ObjectId::from_bytes(block[16..48].try_into().expect("32 bytes")));
        Ok((Self { shard, shard_bytes, coding, index }, u32_at(72)))
    }
}

/// A fragment whose header and every block checked out.
#[derive(Clone)]
pub struct Fragment {
    header: FragmentHeader,
    /// The fragment file.
    file: Vec<u8>,
}

impl std::fmt::Debug for Fragment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fragment").field("header", &self.header).field("file_bytes", &self.file.len()).finish()
    }
}

impl Fragment {
    /// Checks a fragment file: its header, its length, its checksum table's CRC32C, every data
    /// block's CRC32C and the payload's zero padding. Never panics, whatever the bytes.
    pub fn decode(file: Vec<u8>) -> std::result::Result<Self, FormatError> {
        let header = Self::check(&file)?;
        Ok(Self { header, file })
    }

    /// The checks of [`Fragment::decode`] on borrowed bytes: the header, when they all pass.
    pub fn check(file: &[u8]) -> std::result::Result<FragmentHeader, FormatError> {
        const REGION: &str = "fragment";
        let head = file.get(..BLOCK_BYTES).ok_or_else(|| FormatError::Truncated {
            region: REGION,
            detail: format!("{} bytes, shorter than its header block", file.len()),
        })?;
        let (header, table_crc) = FragmentHeader::decode(head)?;
        if file.len() as u64 != header.file_bytes() {
            return Err(FormatError::Truncated {
                region: REGION,
                detail: format!("{} bytes, not the {} its header gives", file.len(), header.file_bytes()),
            });
        }
        let table_at = usize::try_from(header.crc_table_offset()).expect("the file is in memory");
        let table = &file[table_at..];
        let actual = crc32c(table);
        if actual != table_crc {
            return Err(FormatError::ChecksumMismatch {
                region: "fragment checksum table",
                expected: table_crc,
                actual,
            });
        }
        let n_blocks = usize::try_from(header.n_blocks()).expect("the file is in memory");
        if table[4 * n_blocks..].iter().any(|&b| b != 0) {
            return Err(FormatError::Inconsistent {
                field: REGION,
                detail: "checksum table padding is not zero".to_owned(),
            });
        }
        for (b, block) in file[BLOCK_BYTES..table_at].chunks_exact(BLOCK_BYTES).enumerate() {
            let expected = u32::from_le_bytes(table[4 * b..4 * b + 4].try_into().expect("4 bytes"));
            let actual = block_crc(b as u64, block);
            if actual != expected {
                return Err(FormatError::BlockChecksum { block: b as u64, expected, actual });
            }
        }
        let payload_end = BLOCK_BYTES + usize::try_from(header.fragment_bytes()).expect("the file is in memory");
        if file[payload_end..table_at].iter().any(|&b| b != 0) {
            return Err(FormatError::Inconsistent { field: REGION, detail: "payload padding is not zero".to_owned() });
        }
        Ok(header)
    }

    /// What the header says.
    pub fn header(&self) -> &FragmentHeader {
        &self.header
    }

    /// The fragment's id ([`fragment_id`] of what its header names).
    pub fn id(&self) -> ObjectId {
        fragment_id(self.header.shard, self.header.coding, self.header.index)
    }

    /// The fragment file.
    pub fn file(&self) -> &[u8] {
        &self.file
    }

    /// The payload (what the coder works on).
    fn payload(&self) -> &[u8] {
        let len = usize::try_from(self.header.fragment_bytes()).expect("the file is in memory");
        &self.file[BLOCK_BYTES..BLOCK_BYTES + len]
    }
}

/// The id of fragment `index` of `shard` cut with `coding`: the BLAKE3 hash of a domain tag and
/// of those three, which fix the fragment's bytes (the shard's bytes are its id's preimage; the
/// coder is deterministic and pinned, with a known-answer test). So any node names every fragment
/// of a shard from the manifest alone, and a fragment's file is checked against its id by its
/// header (which must name the same three) and its blocks' CRC32C; the shard rebuilt from
/// fragments is checked against the shard's BLAKE3 before it is used.
pub fn fragment_id(shard: ShardId, coding: Coding, index: u8) -> ObjectId {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"granary fragment 1\0");
    hasher.update(shard.0.as_bytes());
    hasher.update(&[coding.k, coding.m, index]);
    ObjectId::from_hash(hasher.finalize())
}

/// Bytes of each fragment the coder works on at once: the coder's transform is the same at every
/// 64-byte position, so a fragment is coded a stripe at a time, and `k + m` stripes stay in the
/// core's cache (coding 16 MiB fragments whole ran at half the speed, BENCHMARKS.md).
const STRIPE_BYTES: usize = 64 << 10;

/// Cuts `shard` (a whole shard file, named by its BLAKE3) into `coding.k()` data fragments and
/// `coding.m()` parity fragments, returned as fragment files in index order: `(k + m) / k` times
/// the shard's bytes in memory at once.
pub fn encode(shard: &[u8], coding: Coding) -> Result<Vec<Vec<u8>>> {
    let shard_bytes = shard.len() as u64;
    if shard_bytes < 2 * BLOCK_BYTES_U64
        || !shard_bytes.is_multiple_of(BLOCK_BYTES_U64)
        || shard_bytes > SHARD_BYTES_MAX
    {
        return Err(Error::invalid_input(format!("{shard_bytes} bytes are not a shard file's length")));
    }
    let id = ShardId(ObjectId::of(shard));
    let too_large = || Error::invalid_input("a fragment larger than memory");
    let payload = usize::try_from(coding.fragment_bytes(shard_bytes)).map_err(|_| too_large())?;
    let file_bytes = usize::try_from(coding.file_bytes(shard_bytes)).map_err(|_| too_large())?;
    let (k, m) = (usize::from(coding.k), usize::from(coding.m));
    // The data fragments hold the whole shard between them.
    debug_assert!((k as u64) * (payload as u64) >= shard_bytes, "{k} x {payload} bytes hold {shard_bytes}");
    let mut files: Vec<Vec<u8>> = (0..coding.n()).map(|_| vec![0u8; file_bytes]).collect();
    for (i, file) in files[..k].iter_mut().enumerate() {
        let start = (i * payload).min(shard.len());
        let end = (start + payload).min(shard.len());
        file[BLOCK_BYTES..BLOCK_BYTES + end - start].copy_from_slice(&shard[start..end]);
    }
    let (data, parity) = files.split_at_mut(k);
    let coder_error = |e: reed_solomon_simd::Error| Error::invalid_input(format!("erasure coding {coding}: {e}"));
    let mut encoder: Option<reed_solomon_simd::ReedSolomonEncoder> = None;
    for at in (0..payload).step_by(STRIPE_BYTES) {
        let len = STRIPE_BYTES.min(payload - at);
        let encoder = match encoder.as_mut() {
            Some(encoder) => {
                encoder.reset(k, m, len).map_err(coder_error)?;
                encoder
            }
            None => encoder.insert(reed_solomon_simd::ReedSolomonEncoder::new(k, m, len).map_err(coder_error)?),
        };
        let stripe = BLOCK_BYTES + at..BLOCK_BYTES + at + len;
        for file in data.iter() {
            encoder.add_original_shard(&file[stripe.clone()]).map_err(coder_error)?;
        }
        let result = encoder.encode().map_err(coder_error)?;
        for (file, recovery) in parity.iter_mut().zip(result.recovery_iter()) {
            file[stripe.clone()].copy_from_slice(recovery);
        }
    }
    for (index, file) in files.iter_mut().enumerate() {
        let index = u8::try_from(index).expect("at most 128 fragments");
        seal(&FragmentHeader { shard: id, shard_bytes, coding, index }, file);
    }
    Ok(files)
}

/// Writes the checksum table and the header of a fragment file whose payload is in place.
fn seal(header: &FragmentHeader, file: &mut [u8]) {
    debug_assert_eq!(file.len() as u64, header.file_bytes(), "a fragment file as its header says");
    let table_at = usize::try_from(header.crc_table_offset()).expect("the file is in memory");
    debug_assert!(table_at.is_multiple_of(BLOCK_BYTES), "the checksum table on a block");
    let (blocks, table) = file.split_at_mut(table_at);
    for (b, block) in blocks[BLOCK_BYTES..].chunks_exact(BLOCK_BYTES).enumerate() {
        table[4 * b..4 * b + 4].copy_from_slice(&block_crc(b as u64, block).to_le_bytes());
    }
    let table_crc = crc32c(table);
    file[..BLOCK_BYTES].copy_from_slice(&header.encode(table_crc));
}

/// Shard `shard`, rebuilt from any `k` of its fragments (data fragments are used as they are;
/// missing ones are decoded from the others, parity first), and returned only when its BLAKE3
/// is `shard`. Fragments of another shard, coding or length, and repeats of an index, are
/// refused ([`Error::BadFragments`]); so is every rebuilt byte when the whole does not hash to
/// the id, or when the padding past the shard's end is not zero.
pub fn reconstruct(shard: ShardId, fragments: &[Fragment]) -> Result<Vec<u8>> {
    let bad = |detail: String| Error::BadFragments { shard, detail };
    let first = fragments
        .first()
        .ok_or_else(|| Error::invalid_input(format!("no fragments to rebuild shard {shard} from")))?
        .header;
    let coding = first.coding;
    let mut by_index: Vec<Option<&Fragment>> = vec![None; coding.n()];
    for fragment in fragments {
        let h = fragment.header;
        if h.shard != shard || h.coding != coding || h.shard_bytes != first.shard_bytes {
            return Err(bad(format!(
                "fragment {} is of shard {} ({} coding, {} bytes), not of this shard ({coding}, {} bytes)",
                h.index, h.shard, h.coding, h.shard_bytes, first.shard_bytes
            )));
        }
        let place = &mut by_index[usize::from(h.index)];
        if place.is_some() {
            return Err(bad(format!("fragment {} given twice", h.index)));
        }
        *place = Some(fragment);
    }
    let (k, m) = (usize::from(coding.k), usize::from(coding.m));
    let present = by_index.iter().filter(|f| f.is_some()).count();
    if present < k {
        return Err(Error::invalid_input(format!(
            "shard {shard} cannot be rebuilt: {present} of its {} fragments at hand, {k} needed",
            coding.n()
        )));
    }
    let too_large = || Error::invalid_input("a shard larger than memory");
    let shard_bytes = usize::try_from(first.shard_bytes).map_err(|_| too_large())?;
    let payload = usize::try_from(first.fragment_bytes()).map_err(|_| too_large())?;
    let mut bytes = vec![0u8; k * payload];
    for (i, fragment) in by_index[..k].iter().enumerate() {
        if let Some(fragment) = fragment {
            bytes[i * payload..(i + 1) * payload].copy_from_slice(fragment.payload());
        }
    }
    let missing: Vec<usize> = (0..k).filter(|&i| by_index[i].is_none()).collect();
    if !missing.is_empty() {
        // As many parity fragments as data fragments are missing, the first ones at hand.
        let parity: Vec<(usize, &Fragment)> =
            (0..m).filter_map(|j| by_index[k + j].map(|f| (j, f))).take(missing.len()).collect();
        let coder_error = |e: reed_solomon_simd::Error| bad(format!("the coder refused them: {e}"));
        let mut decoder: Option<reed_solomon_simd::ReedSolomonDecoder> = None;
        for at in (0..payload).step_by(STRIPE_BYTES) {
            let len = STRIPE_BYTES.min(payload - at);
            let decoder = match decoder.as_mut() {
                Some(decoder) => {
                    decoder.reset(k, m, len).map_err(coder_error)?;
                    decoder
                }
                None => decoder.insert(reed_solomon_simd::ReedSolomonDecoder::new(k, m, len).map_err(coder_error)?),
            };
            for (i, fragment) in by_index[..k].iter().enumerate() {
                if let Some(fragment) = fragment {
                    decoder.add_original_shard(i, &fragment.payload()[at..at + len]).map_err(coder_error)?;
                }
            }
            for (j, fragment) in &parity {
                decoder.add_recovery_shard(*j, &fragment.payload()[at..at + len]).map_err(coder_error)?;
            }
            let result = decoder.decode().map_err(coder_error)?;
            for &i in &missing {
                let restored =
                    result.restored_original(i).ok_or_else(|| bad(format!("decoding gave no fragment {i}")))?;
                bytes[i * payload + at..i * payload + at + len].copy_from_slice(restored);
            }
        }
    }
    if bytes[shard_bytes..].iter().any(|&b| b != 0) {
        return Err(bad("the last data fragment's padding past the shard's end is not zero".to_owned()));
    }
    bytes.truncate(shard_bytes);
    let actual = ObjectId::of(&bytes);
    if actual != shard.0 {
        return Err(bad(format!("the bytes rebuilt from {present} fragments hash to {actual}, not to the shard's id")));
    }
    Ok(bytes)
}

/// Checks arbitrary bytes presented as a fragment file, as a node does before it uses one, then
/// the same bytes with every checksum redone (`fix_checksums`), so that mutations reach the
/// checks behind the CRCs; a fragment that passes must have a header that encodes back to the
/// same block. Never panics on a decoding, whatever the bytes: the fuzz target calls it, and its
/// assertions are the round trip's.
#[doc(hidden)]
pub fn fuzz_decode(bytes: &[u8]) {
    let round_trip = |bytes: &[u8]| {
        if let Ok(fragment) = Fragment::decode(bytes.to_vec()) {
            let (header, table_crc) = FragmentHeader::decode(&bytes[..BLOCK_BYTES]).expect("decoded once already");
            assert_eq!(header, *fragment.header());
            assert_eq!(header.encode(table_crc)[..], bytes[..BLOCK_BYTES], "a header that does not round-trip");
        }
    };
    round_trip(bytes);
    let mut fixed = bytes.to_vec();
    fix_checksums(&mut fixed);
    round_trip(&fixed);
}

/// Redoes a fragment file's checksums in place (block CRCs and the table's CRC, where the header
/// gives a layout the bytes are long enough for; then the header's CRC): damaged bytes then
/// reach the checks behind the checksums. For tests and the fuzz target.
#[doc(hidden)]
pub fn fix_checksums(bytes: &mut [u8]) {
    if bytes.len() < BLOCK_BYTES {
        return;
    }
    let reseal_header = |bytes: &mut [u8]| {
        let crc = crc32c(&bytes[..BLOCK_BYTES - 4]);
        bytes[BLOCK_BYTES - 4..BLOCK_BYTES].copy_from_slice(&crc.to_le_bytes());
    };
    reseal_header(bytes);
    let Ok((header, _)) = FragmentHeader::decode(&bytes[..BLOCK_BYTES]) else { return };
    if bytes.len() as u64 != header.file_bytes() {
        return;
    }
    let table_at = usize::try_from(header.crc_table_offset()).expect("inside the bytes");
    let (blocks, table) = bytes.split_at_mut(table_at);
    for (b, block) in blocks[BLOCK_BYTES..].chunks_exact(BLOCK_BYTES).enumerate() {
        table[4 * b..4 * b + 4].copy_from_slice(&block_crc(b as u64, block).to_le_bytes());
    }
    let table_crc = crc32c(table);
    bytes[72..76].copy_from_slice(&table_crc.to_le_bytes());
    reseal_header(bytes);
}

#[cfg(test)]
mod tests;
