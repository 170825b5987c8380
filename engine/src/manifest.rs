//! Manifests: one dataset version as an ordered list of shards, itself a content-addressed object.
//!
//! Encoding (little-endian): `"GRNMANIF" | version u32 | reserved u32 | layout (80 bytes) |
//! n_shards u64 | n_records u64 | { shard_id [32] | n_records u64 | file_bytes u64 |
//! meta_digest [32] } * n_shards | crc32c u32`. The id of a manifest is the BLAKE3 hash of these
//! bytes. The same shards in the same order give the same manifest, so a version is named by its
//! content. Never: holds a dataset name (refs do), so identical versions of two datasets are one
//! object.
//!
//! Owns: `Manifest` and `ManifestEntry`, their encoding (`MANIFEST_MAGIC`, `MANIFEST_VERSION`) and
//! the id it gives (`encode`), and `decode`, which checks the magic, the version, the CRC32C and
//! the counts. Never: reads or writes a file (the store does), or checks bytes against their id
//! (`decode`'s caller does).

use crate::error::FormatError;
use crate::id::{ID_BYTES, ManifestId, ObjectId, ShardId};
use crate::shard::{LAYOUT_BYTES, Layout, MetaDigest, read_u32, read_u64};

/// Opens every manifest.
pub const MANIFEST_MAGIC: [u8; 8] = *b"GRNMANIF";
/// The manifest format this build writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
const PREFIX_BYTES: usize = 16 + LAYOUT_BYTES + 16;
const ENTRY_BYTES: usize = ID_BYTES + 16 + 32;

/// One shard of a dataset version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManifestEntry {
    /// The shard's content id.
    pub shard: ShardId,
    /// Records in the shard.
    pub n_records: u64,
    /// Length of the shard file (checked when the shard is opened, so truncation is caught early).
    pub file_bytes: u64,
    /// The digest of the shard's metadata, checked when the shard is opened: the read path
    /// never hashes whole shards, and this is what proves that the file under the shard's name
    /// is that shard (and so that its block checksums are the right ones).
    pub meta_digest: MetaDigest,
}

/// A dataset version: a layout and an ordered list of shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    layout: Layout,
    entries: Vec<ManifestEntry>,
    n_records: u64,
}

impl Manifest {
    /// A manifest of `entries`, all of `layout`.
    pub fn new(layout: Layout, entries: Vec<ManifestEntry>) -> Self {
        let n_records = entries.iter().map(|entry| entry.n_records).sum();
        Self { layout, entries, n_records }
    }

    /// What the records are.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The shards in dataset order.
    pub fn entries(&self) -> &[ManifestEntry] {
        &self.entries
    }

    /// Records in the version.
    pub fn n_records(&self) -> u64 {
        self.n_records
    }

    /// Bytes of all shard files.
    pub fn file_bytes(&self) -> u64 {
        self.entries.iter().map(|entry| entry.file_bytes).sum()
    }

    /// The encoded bytes and their id.
    pub fn encode(&self) -> (ManifestId, Vec<u8>) {
        let mut out = Vec::with_capacity(PREFIX_BYTES + self.entries.len() * ENTRY_BYTES + 4);
        out.extend_from_slice(&MANIFEST_MAGIC);
        out.extend_from_slice(&MANIFEST_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.layout.encode());
        out.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.n_records.to_le_bytes());
        for entry in &self.entries {
            out.extend_from_slice(entry.shard.0.as_bytes());
            out.extend_from_slice(&entry.n_records.to_le_bytes());
            out.extend_from_slice(&entry.file_bytes.to_le_bytes());
            out.extend_from_slice(&entry.meta_digest.0);
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        (ManifestId(ObjectId::of(&out)), out)
    }

    /// Decodes and validates manifest bytes (the caller checks them against their id).
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let region = "manifest";
        if bytes.len() < PREFIX_BYTES + 4 {
            return Err(FormatError::Truncated { region, detail: format!("{} bytes", bytes.len()) });
        }
        if bytes[..8] != MANIFEST_MAGIC {
            return Err(FormatError::BadMagic { region });
        }
        let version = read_u32(bytes, 8);
        if version != MANIFEST_VERSION {
            return Err(FormatError::UnsupportedVersion { region, found: version, supported: MANIFEST_VERSION });
        }
        let body = bytes.len() - 4;
        let expected = read_u32(bytes, body);
        let actual = crc32c::crc32c(&bytes[..body]);
        if expected != actual {
            return Err(FormatError::ChecksumMismatch { region, expected, actual });
        }
        if read_u32(bytes, 12) != 0 {
            return Err(FormatError::Inconsistent {
                field: "manifest",
                detail: "reserved bytes are not zero".to_owned(),
            });
        }
        let mut layout = [0u8; LAYOUT_BYTES];
        layout.copy_from_slice(&bytes[16..16 + LAYOUT_BYTES]);
        let layout = Layout::decode(&layout)?;
        let n_shards = read_u64(bytes, 16 + LAYOUT_BYTES);
        let n_records = read_u64(bytes, 24 + LAYOUT_BYTES);
        let entries_bytes = (body - PREFIX_BYTES) as u64;
        if n_shards.checked_mul(ENTRY_BYTES as u64) != Some(entries_bytes) {
            return Err(FormatError::Truncated {
                region,
                detail: format!("{n_shards} shards in {entries_bytes} bytes of entries"),
            });
        }
        let entries: Vec<ManifestEntry> = bytes[PREFIX_BYTES..body]
            .chunks_exact(ENTRY_BYTES)
            .map(|entry| {
                let mut id = [0u8; ID_BYTES];
                id.copy_from_slice(&entry[..ID_BYTES]);
                let mut digest = [0u8; 32];
                digest.copy_from_slice(&entry[ID_BYTES + 16..]);
                ManifestEntry {
                    shard: ShardId(ObjectId::from_bytes(id)),
                    n_records: read_u64(entry, ID_BYTES),
                    file_bytes: read_u64(entry, ID_BYTES + 8),
                    meta_digest: MetaDigest(digest),
                }
            })
            .collect();
        if entries.iter().try_fold(0u64, |sum, entry| sum.checked_add(entry.file_bytes)).is_none() {
            return Err(FormatError::Inconsistent {
                field: "file_bytes",
                detail: "the entries sum past 2^64".to_owned(),
            });
        }
        let sum = entries.iter().try_fold(0u64, |sum, entry| sum.checked_add(entry.n_records));
        if sum != Some(n_records) {
            return Err(FormatError::Inconsistent {
                field: "n_records",
                detail: format!("{n_records}, the entries sum to {sum:?}"),
            });
        }
        Ok(Self { layout, entries, n_records })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_round_trip_and_reject_damage() {
        let entries = (0..3u8)
            .map(|i| ManifestEntry {
                shard: ShardId(ObjectId::of(&[i])),
                n_records: u64::from(i) * 10,
                file_bytes: 8192,
                meta_digest: MetaDigest([i; 32]),
            })
            .collect();
        let manifest = Manifest::new(Layout::Bytes, entries);
        let (id, bytes) = manifest.encode();
        assert_eq!(id.0, ObjectId::of(&bytes));
        assert_eq!(Manifest::decode(&bytes).unwrap(), manifest);
        assert_eq!(manifest.n_records(), 30);
        for bit in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(Manifest::decode(&bad).is_err(), "bit {bit}");
        }
        for len in 0..bytes.len() {
            assert!(Manifest::decode(&bytes[..len]).is_err(), "length {len}");
        }
    }
}
