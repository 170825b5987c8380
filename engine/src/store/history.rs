//! Ref histories: the second record of every name -> version binding, like git's reflog.
//!
//! Owns: the text of `history/NAME` (the store reads and appends the file): `RefHistory` (a decoded
//! history: its entries, its damaged lines, `replay`, and the additions and removals that bring it
//! in line with a ref), `HistoryEntry` and `Change`.
//!
//! `history/NAME` is an append-only text file: a header line, then one line per change to the
//! ref of NAME (a version added or removed), each with the time it was made and its own CRC32C,
//! so a torn last append or a damaged line costs that line only. Replaying the lines gives the
//! live versions, which is how `repair` rebuilds a damaged or lost ref; the times tell `gc` what
//! a ref pointed at recently. Invariant: every version of a ref file is also live in its
//! history (the store appends an addition before the ref names it and a removal after the ref
//! stops naming it), so a history's replay holds at least what its ref holds. Never: decides
//! which record wins when both are intact (the ref file is the commit point; the store brings
//! the history in line with it).

use std::collections::BTreeMap;

use crate::error::FormatError;
use crate::id::{ManifestId, ObjectId};

use super::refs::{RefLog, Version};

const HISTORY_HEADER: &str = "granary-history 1";

/// What one history line records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The ref started naming this version.
    Add,
    /// The ref stopped naming this version.
    Remove,
}

impl Change {
    fn word(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Remove => "remove",
        }
    }
}

/// One line of a ref history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// When the change was made, in seconds since the Unix epoch.
    pub unix_secs: u64,
    /// Added or removed.
    pub change: Change,
    /// The version concerned.
    pub version: Version,
}

impl HistoryEntry {
    /// The entry's line, newline included.
    pub fn encode(&self) -> String {
        let body =
            format!("{} {} {} {}", self.unix_secs, self.change.word(), self.version.number, self.version.manifest);
        let crc = crc32c::crc32c(body.as_bytes());
        format!("{body} {crc:08x}\n")
    }

    fn decode(line: &str) -> Option<Self> {
        let (body, crc) = line.rsplit_once(' ')?;
        if crc.len() != 8 || u32::from_str_radix(crc, 16).ok()? != crc32c::crc32c(body.as_bytes()) {
            return None;
        }
        let mut words = body.split(' ');
        let unix_secs = words.next()?.parse().ok()?;
        let change = match words.next()? {
            "add" => Change::Add,
            "remove" => Change::Remove,
            _ => return None,
        };
        let number: u64 = words.next()?.parse().ok()?;
        let manifest = ManifestId(ObjectId::parse_hex(words.next()?)?);
        if words.next().is_some() || number == 0 {
            return None;
        }
        Some(Self { unix_secs, change, version: Version { number, manifest } })
    }
}

/// A decoded ref history: the lines that checked out, in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RefHistory {
    entries: Vec<HistoryEntry>,
    damaged_lines: usize,
}

impl RefHistory {
    /// The header line a new history file starts with, newline included.
    pub fn header() -> String {
        format!("{HISTORY_HEADER}\n")
    }

    /// Decodes a history file. A wrong header is an error; a line that fails its checksum (a
    /// torn last append, or damage) is skipped and counted.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let region = "ref history";
        let Some(newline) = bytes.iter().position(|&b| b == b'\n') else {
            return Err(FormatError::Truncated { region, detail: "no header line".to_owned() });
        };
        let mut history = Self::default();
        let rest = &bytes[newline + 1..];
        for line in rest.split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            match std::str::from_utf8(line).ok().and_then(HistoryEntry::decode) {
                Some(entry) => history.entries.push(entry),
                None => history.damaged_lines += 1,
            }
        }
        match std::str::from_utf8(&bytes[..newline]) {
            Ok(HISTORY_HEADER) => Ok(history),
            Ok(header) if header.starts_with("granary-history ") => {
                // The header has no checksum of its own. A version that is not a number, or one
                // under whose header every line still checks out as this version's (a bit
                // flipped in the digit), is damage to be quarantined; otherwise a newer format,
                // left alone.
                let text = &header["granary-history ".len()..];
                match text.parse::<u32>() {
                    Ok(found) if history.damaged_lines > 0 || history.entries.is_empty() => {
                        Err(FormatError::UnsupportedVersion { region, found, supported: 1 })
                    }
                    _ => Err(FormatError::Inconsistent {
                        field: "ref history header",
                        detail: format!("version {text:?}, but its lines are version 1's: the header is damaged"),
                    }),
                }
            }
            _ => Err(FormatError::BadMagic { region }),
        }
    }

    /// The lines that checked out, oldest first.
    pub fn entries(&self) -> &[HistoryEntry] {
        &self.entries
    }

    /// Lines skipped because they failed their checksum.
    pub fn damaged_lines(&self) -> usize {
        self.damaged_lines
    }

    /// The live versions the history records, by number; empty once every version was removed.
    fn live(&self) -> BTreeMap<u64, ManifestId> {
        let mut live = BTreeMap::new();
        for entry in &self.entries {
            match entry.change {
                Change::Add => live.insert(entry.version.number, entry.version.manifest),
                Change::Remove => live.remove(&entry.version.number),
            };
        }
        live
    }

    /// The ref this history rebuilds: its live versions, or `None` when there are none.
    pub fn replay(&self) -> Option<RefLog> {
        let versions: Vec<Version> =
            self.live().into_iter().map(|(number, manifest)| Version { number, manifest }).collect();
        RefLog::from_versions(versions)
    }

    /// The additions that bring this history up to every version of `target` (what a ref is
    /// about to name), stamped `unix_secs`.
    pub fn additions_for(&self, target: &RefLog, unix_secs: u64) -> Vec<HistoryEntry> {
        let live = self.live();
        target
            .versions()
            .iter()
            .filter(|v| live.get(&v.number) != Some(&v.manifest))
            .map(|&version| HistoryEntry { unix_secs, change: Change::Add, version })
            .collect()
    }

    /// The removals that bring this history down to `target` (what the ref now names; `None`
    /// when the ref is gone), stamped `unix_secs`.
    pub fn removals_for(&self, target: Option<&RefLog>, unix_secs: u64) -> Vec<HistoryEntry> {
        self.live()
            .into_iter()
            .filter(|&(number, manifest)| target.and_then(|t| t.version(number)).map(|v| v.manifest) != Some(manifest))
            .map(|(number, manifest)| HistoryEntry {
                unix_secs,
                change: Change::Remove,
                version: Version { number, manifest },
            })
            .collect()
    }

    /// Every manifest live in this history, or named by a line stamped at or after `since`:
    /// what the ref points at, or pointed at recently.
    pub fn manifests_since(&self, since_unix_secs: u64) -> impl Iterator<Item = ManifestId> + '_ {
        let recent = self.entries.iter().filter(move |e| e.unix_secs >= since_unix_secs).map(|e| e.version.manifest);
        self.live().into_values().chain(recent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(number: u64, seed: &[u8]) -> Version {
        Version { number, manifest: ManifestId(ObjectId::of(seed)) }
    }

    fn text(entries: &[HistoryEntry]) -> String {
        let mut text = RefHistory::header();
        entries.iter().for_each(|e| text.push_str(&e.encode()));
        text
    }

    #[test]
    fn a_history_replays_to_the_ref_it_recorded() {
        let ref_1 = RefLog::first(version(1, b"a").manifest);
        let ref_12 = ref_1.with_next(version(2, b"b").manifest).unwrap();
        let ref_2 = ref_12.without(1).unwrap();
        let mut history = RefHistory::default();
        for (at, target) in [(10, Some(&ref_1)), (20, Some(&ref_12)), (30, Some(&ref_2)), (40, None)] {
            let mut lines = target.map(|t| history.additions_for(t, at)).unwrap_or_default();
            lines.extend(history.removals_for(target, at));
            history = RefHistory::decode(text(&[history.entries(), &lines].concat()).as_bytes()).unwrap();
            assert_eq!(history.replay().as_ref(), target, "at {at}");
        }
        assert_eq!(history.entries().len(), 4);
        let recent: Vec<ManifestId> = history.manifests_since(30).collect();
        assert_eq!(recent, [version(1, b"a").manifest, version(2, b"b").manifest]);
        assert_eq!(history.manifests_since(41).count(), 0);
    }

    #[test]
    fn a_damaged_line_costs_that_line_only() {
        let lines = [
            HistoryEntry { unix_secs: 1, change: Change::Add, version: version(1, b"a") },
            HistoryEntry { unix_secs: 2, change: Change::Add, version: version(2, b"b") },
        ];
        let good = text(&lines);
        assert_eq!(RefHistory::decode(good.as_bytes()).unwrap().replay().unwrap().versions().len(), 2);
        let header = RefHistory::header().len();
        for at in header..good.len() {
            let mut bad = good.clone().into_bytes();
            bad[at] ^= 0x01;
            let history = RefHistory::decode(&bad).unwrap();
            assert!(history.damaged_lines() >= 1, "byte {at}");
            assert!(history.entries().iter().all(|e| lines.contains(e)), "byte {at}");
            // A torn append: every whole line before it survives.
            let torn = RefHistory::decode(&good.as_bytes()[..at]).unwrap();
            assert_eq!(torn.entries(), &lines[..torn.entries().len()], "prefix {at}");
        }
        for bad_header in [&b""[..], b"granary-history 1", b"granary-ref 1\n", b"granary-history 2\n"] {
            assert!(RefHistory::decode(bad_header).is_err());
        }
    }

    #[test]
    fn a_bit_flipped_in_the_header_is_damage_and_a_newer_format_is_not() {
        let lines = [HistoryEntry { unix_secs: 1, change: Change::Add, version: version(1, b"a") }];
        let good = text(&lines);
        // Every single-bit flip of the header: damage (repair quarantines it), never a claim of
        // a version this build cannot read ('1' flips to '0', '3', '5' and '9', among others).
        for at in 0..RefHistory::header().len() - 1 {
            for bit in 0..8 {
                let mut bad = good.clone().into_bytes();
                bad[at] ^= 1 << bit;
                let error = RefHistory::decode(&bad).unwrap_err();
                let error = crate::error::Error::Format { path: "h".into(), source: error };
                assert!(error.is_corruption(), "byte {at} bit {bit}: {error}");
            }
        }
        // A newer format's header over lines this build cannot read is left alone.
        let newer = "granary-history 2\nsomething of version 2\n";
        assert!(matches!(RefHistory::decode(newer.as_bytes()), Err(FormatError::UnsupportedVersion { found: 2, .. })));
    }
}
