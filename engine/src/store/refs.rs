//! Dataset names and refs: a name points at its versions, like a git ref with its reflog.
//!
//! A ref file `refs/NAME` lists every live version of dataset NAME as `NUMBER MANIFEST_ID`, oldest
//! first, closed by a CRC32C line. Version numbers only grow; removing a version leaves a gap.
//! Invariant: a `DatasetName` cannot name a path outside `refs/`.
//!
//! Owns: `DatasetName`, `VersionSpec` (`NAME`, `NAME@N`, or a manifest id), `Version`, and `RefLog`
//! with the ref file's text (`encode`, `decode`). Never: reads or writes a file
//! (`StorePaths::read_ref` and `Store::write_ref` do), or numbers a new version at or below one the
//! ref holds.

use std::fmt;

use crate::error::{Error, FormatError, Result};
use crate::id::{ManifestId, ObjectId};

const NAME_BYTES_MAX: usize = 128;
const REF_HEADER: &str = "granary-ref 1";

/// A validated dataset name: 1 to 128 of `A-Z a-z 0-9 . _ -`, not starting with `.` or `-`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DatasetName(String);

impl DatasetName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self> {
        let refuse = |reason| Err(Error::InvalidName { name: name.to_owned(), reason });
        if name.is_empty() {
            return refuse("it is empty");
        }
        if name.len() > NAME_BYTES_MAX {
            return refuse("it is longer than 128 bytes");
        }
        if name.contains(['/', '\\']) || name == ".." || name == "." {
            return refuse("it would escape the store root");
        }
        if name.starts_with(['.', '-']) {
            return refuse("it starts with '.' or '-'");
        }
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
            return refuse("only A-Z, a-z, 0-9, '.', '_' and '-' are allowed");
        }
        Ok(Self(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DatasetName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which dataset version a user means: `NAME` (the newest), `NAME@N`, or a manifest id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionSpec {
    /// The newest version of a dataset.
    Latest(DatasetName),
    /// A numbered version of a dataset.
    Numbered(DatasetName, u64),
    /// A version by its manifest id (64 hex digits).
    Manifest(ManifestId),
}

impl VersionSpec {
    /// Parses `NAME`, `NAME@N` or a 64-digit manifest id.
    pub fn parse(text: &str) -> Result<Self> {
        if let Some(id) = ObjectId::parse_hex(text) {
            return Ok(Self::Manifest(ManifestId(id)));
        }
        match text.split_once('@') {
            None => Ok(Self::Latest(DatasetName::new(text)?)),
            Some((name, number)) => {
                let number = number
                    .parse()
                    .map_err(|_| Error::invalid_input(format!("{text:?}: the version after '@' must be a number")))?;
                Ok(Self::Numbered(DatasetName::new(name)?, number))
            }
        }
    }
}

impl fmt::Display for VersionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Latest(name) => write!(f, "{name}"),
            Self::Numbered(name, number) => write!(f, "{name}@{number}"),
            Self::Manifest(id) => write!(f, "{id}"),
        }
    }
}

/// One version of a dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    /// The version number (1 for the first ingest).
    pub number: u64,
    /// The manifest that is this version.
    pub manifest: ManifestId,
}

/// The live versions of one dataset, oldest first; never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefLog {
    versions: Vec<Version>,
}

impl RefLog {
    /// A ref with one version.
    pub fn first(manifest: ManifestId) -> Self {
        Self { versions: vec![Version { number: 1, manifest }] }
    }

    /// The ref's invariant: never empty, numbers from 1 on, strictly increasing (a number is
    /// never reused, so `NAME@N` names one manifest for the ref's life).
    fn checked(self) -> Self {
        debug_assert!(self.versions.first().is_some_and(|v| v.number >= 1), "a ref holds a version from 1 on");
        debug_assert!(self.versions.windows(2).all(|pair| pair[0].number < pair[1].number), "versions increase");
        self
    }

    /// A ref of `versions`, which must be non-empty with strictly increasing numbers from 1.
    pub(crate) fn from_versions(versions: Vec<Version>) -> Option<Self> {
        let ordered = versions.windows(2).all(|pair| pair[0].number < pair[1].number);
        (ordered && versions.first().is_some_and(|v| v.number >= 1)).then(|| Self { versions }.checked())
    }

    /// The live versions, oldest first.
    pub fn versions(&self) -> &[Version] {
        &self.versions
    }

    /// The newest version.
    pub fn latest(&self) -> Version {
        *self.versions.last().expect("a RefLog is never empty")
    }

    /// The version numbered `number`, if it is live.
    pub fn version(&self, number: u64) -> Option<Version> {
        self.versions.iter().copied().find(|version| version.number == number)
    }

    /// This ref with `manifest` added as the next version; `None` once version numbers run out.
    pub fn with_next(&self, manifest: ManifestId) -> Option<Self> {
        let number = self.latest().number.checked_add(1)?;
        let mut versions = self.versions.clone();
        versions.push(Version { number, manifest });
        Some(Self { versions }.checked())
    }

    /// This ref without version `number`; `None` when that would leave no version.
    pub fn without(&self, number: u64) -> Option<Self> {
        let versions: Vec<Version> = self.versions.iter().copied().filter(|v| v.number != number).collect();
        (!versions.is_empty()).then(|| Self { versions }.checked())
    }

    /// The ref file's text.
    pub fn encode(&self) -> String {
        let mut text = format!("{REF_HEADER}\n");
        for version in &self.versions {
            text.push_str(&format!("{} {}\n", version.number, version.manifest));
        }
        let crc = crc32c::crc32c(text.as_bytes());
        text.push_str(&format!("crc32c {crc:08x}\n"));
        text
    }

    /// Decodes a ref file.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let region = "ref";
        let bad = |detail: String| FormatError::Inconsistent { field: "ref", detail };
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8".to_owned()))?;
        let truncated = |detail: &str| FormatError::Truncated { region, detail: detail.to_owned() };
        let without_last_newline = text.strip_suffix('\n').ok_or_else(|| truncated("no final newline"))?;
        let body_end = without_last_newline.rfind('\n').map(|at| at + 1).ok_or_else(|| truncated("one line"))?;
        let (body, crc_line) = text.split_at(body_end);
        let expected = crc_line
            .strip_prefix("crc32c ")
            .and_then(|hex| hex.strip_suffix('\n'))
            .filter(|hex| hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .ok_or_else(|| truncated("no checksum line"))?;
        let actual = crc32c::crc32c(body.as_bytes());
        if expected != actual {
            return Err(FormatError::ChecksumMismatch { region, expected, actual });
        }
        let mut lines = body.lines();
        match lines.next() {
            Some(REF_HEADER) => {}
            Some(header) if header.starts_with("granary-ref ") => {
                let found = header["granary-ref ".len()..].parse().unwrap_or(u32::MAX);
                return Err(FormatError::UnsupportedVersion { region, found, supported: 1 });
            }
            _ => return Err(FormatError::BadMagic { region }),
        }
        let mut versions = Vec::new();
        for line in lines {
            let (number, id) = line.split_once(' ').ok_or_else(|| bad(format!("line {line:?}")))?;
            let number: u64 = number.parse().map_err(|_| bad(format!("version {number:?}")))?;
            let id = ObjectId::parse_hex(id).ok_or_else(|| bad(format!("manifest id {id:?}")))?;
            if versions.last().is_some_and(|last: &Version| last.number >= number) || number == 0 {
                return Err(bad(format!("version {number} out of order")));
            }
            versions.push(Version { number, manifest: ManifestId(id) });
        }
        if versions.is_empty() {
            return Err(bad("no versions".to_owned()));
        }
        Ok(Self { versions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_escape_or_hide_are_refused() {
        for bad in ["", "..", ".", "a/b", "../x", "x\\y", ".hidden", "-flag", "sp ace", "ü", &"n".repeat(129)] {
            assert!(DatasetName::new(bad).is_err(), "{bad:?}");
        }
        for good in ["tokens", "web-2024.v1", "A_b-9", &"n".repeat(128)] {
            assert_eq!(DatasetName::new(good).unwrap().as_str(), good);
        }
    }

    #[test]
    fn specs_parse() {
        let name = DatasetName::new("tok").unwrap();
        assert_eq!(VersionSpec::parse("tok").unwrap(), VersionSpec::Latest(name.clone()));
        assert_eq!(VersionSpec::parse("tok@3").unwrap(), VersionSpec::Numbered(name, 3));
        assert!(VersionSpec::parse("tok@x").is_err());
        let id = ObjectId::of(b"m");
        assert_eq!(VersionSpec::parse(&id.to_string()).unwrap(), VersionSpec::Manifest(ManifestId(id)));
    }

    #[test]
    fn refs_round_trip_and_reject_damage() {
        let log = RefLog::first(ManifestId(ObjectId::of(b"1")))
            .with_next(ManifestId(ObjectId::of(b"2")))
            .unwrap()
            .with_next(ManifestId(ObjectId::of(b"3")))
            .unwrap();
        let log = log.without(2).unwrap();
        assert_eq!(log.versions().iter().map(|v| v.number).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(log.with_next(ManifestId(ObjectId::of(b"4"))).unwrap().latest().number, 4);
        let text = log.encode();
        assert_eq!(RefLog::decode(text.as_bytes()).unwrap(), log);
        for at in 0..text.len() {
            let mut bad = text.clone().into_bytes();
            bad[at] ^= 0x01;
            assert!(RefLog::decode(&bad).is_err(), "byte {at}");
            assert!(RefLog::decode(&text.as_bytes()[..at]).is_err(), "prefix {at}");
        }
        assert!(RefLog::first(ManifestId(ObjectId::of(b"1"))).without(1).is_none());
    }
}
