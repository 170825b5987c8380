//! The record encoding of the `Samples` layout: one WebDataset sample (a key and named parts).
//!
//! Encoding (little-endian): `n_parts u32 | key_len u32 | key | { name_len u32 | name |
//! data_len u64 | data } * n_parts`. Names and the key are UTF-8. The decoder checks every length
//! against the bytes it has before slicing.
//!
//! Owns: `Sample` (a decoded sample, borrowing the record's bytes) and `encode_sample`. Never:
//! allocates by an unchecked length, or groups a tar's members into samples (`ingest` does).

use crate::error::FormatError;

/// One decoded sample, borrowing the record's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample<'a> {
    /// The sample's key: its path in the tar up to the first dot of the file name.
    pub key: &'a str,
    /// The parts, in tar order: (extension after the key's dot, bytes).
    pub parts: Vec<(&'a str, &'a [u8])>,
}

impl<'a> Sample<'a> {
    /// The part whose name is `name`.
    pub fn part(&self, name: &str) -> Option<&'a [u8]> {
        self.parts.iter().find(|(part, _)| *part == name).map(|(_, bytes)| *bytes)
    }

    /// Decodes a record of the `Samples` layout.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, FormatError> {
        let mut cursor = Cursor { bytes, at: 0 };
        let n_parts = cursor.u32()?;
        let key = cursor.text()?;
        // Each part takes at least 12 bytes, which bounds the allocation by the input length.
        if u64::from(n_parts) * 12 > (bytes.len() - cursor.at) as u64 {
            return Err(truncated(format!("{n_parts} parts in {} bytes", bytes.len())));
        }
        let mut parts = Vec::with_capacity(n_parts as usize);
        for _ in 0..n_parts {
            let name = cursor.text()?;
            let len = cursor.u64()?;
            parts.push((name, cursor.take(len)?));
        }
        if cursor.at != bytes.len() {
            return Err(FormatError::Inconsistent {
                field: "sample",
                detail: format!("{} bytes after the last part", bytes.len() - cursor.at),
            });
        }
        Ok(Self { key, parts })
    }
}

/// Encodes a sample; `parts` are (name, bytes).
pub fn encode_sample(key: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
    let len = 8 + key.len() + parts.iter().map(|(name, data)| 12 + name.len() + data.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&u32::try_from(parts.len()).expect("fewer than 2^32 parts").to_le_bytes());
    push_text(&mut out, key);
    for (name, data) in parts {
        push_text(&mut out, name);
        out.extend_from_slice(&(data.len() as u64).to_le_bytes());
        out.extend_from_slice(data);
    }
    debug_assert_eq!(out.len(), len);
    out
}

fn push_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&u32::try_from(text.len()).expect("names are short").to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

fn truncated(detail: String) -> FormatError {
    FormatError::Truncated { region: "sample", detail }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, len: u64) -> Result<&'a [u8], FormatError> {
        let left = self.bytes.len() - self.at;
        match usize::try_from(len) {
            Ok(len) if len <= left => {
                let out = &self.bytes[self.at..self.at + len];
                self.at += len;
                Ok(out)
            }
            _ => Err(truncated(format!("{len} bytes wanted at offset {}, {left} left", self.at))),
        }
    }

    fn u32(&mut self) -> Result<u32, FormatError> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn u64(&mut self) -> Result<u64, FormatError> {
        let bytes = self.take(8)?;
        let mut word = [0u8; 8];
        word.copy_from_slice(bytes);
        Ok(u64::from_le_bytes(word))
    }

    fn text(&mut self) -> Result<&'a str, FormatError> {
        let len = self.u32()?;
        std::str::from_utf8(self.take(u64::from(len))?).map_err(|_| FormatError::Inconsistent {
            field: "sample",
            detail: "a key or part name that is not UTF-8".to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_round_trip_and_truncations_fail() {
        let encoded = encode_sample("shard-0/000017", &[("jpg", b"\xff\xd8 image"), ("cls", b"7"), ("json", b"")]);
        let sample = Sample::decode(&encoded).unwrap();
        assert_eq!(sample.key, "shard-0/000017");
        assert_eq!(sample.part("cls"), Some(&b"7"[..]));
        assert_eq!(sample.part("json"), Some(&b""[..]));
        assert_eq!(sample.parts.len(), 3);
        for len in 0..encoded.len() {
            assert!(Sample::decode(&encoded[..len]).is_err(), "prefix of {len} bytes");
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert!(Sample::decode(&longer).is_err());
        assert!(Sample::decode(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]).is_err());
    }
}
