//! Ingest sources: fixed-size record files, directory trees, WebDataset tars.
//!
//! Each source checks what it can before the first record is written (paths exist, sizes divide),
//! then streams: no source holds more than one record (for tars, one sample) in memory.

use std::fs::{self, File};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use super::Ingest;
use crate::error::{Error, Result};
use crate::shard::encode_sample;

/// Receives progress of a long ingest, in input bytes, and what it skipped.
pub trait Progress {
    /// The total, once known.
    fn start(&self, total_bytes: u64);
    /// `bytes` more are done.
    fn advance(&self, bytes: u64);
    /// A member of input `source` (a link, a device, ... in a tar) was not ingested, for
    /// `reason`. The default ignores it; a caller that shows progress should show this too.
    fn skipped(&self, source: &Path, member: &str, reason: &str) {
        let _ = (source, member, reason);
    }
}

impl Progress for () {
    fn start(&self, _: u64) {}
    fn advance(&self, _: u64) {}
}

/// Ingests files of back-to-back fixed-size records (nanoGPT and Megatron `.bin` token files, for
/// example), in the order given. Every file's size must be a multiple of the record size, unless
/// `drop_remainder` is set, in which case each file's incomplete last record is skipped.
pub fn records_from_files(
    ingest: &mut Ingest<'_>,
    files: &[PathBuf],
    drop_remainder: bool,
    progress: &dyn Progress,
) -> Result<()> {
    let record_bytes = ingest
        .layout()
        .record_bytes()
        .ok_or_else(|| Error::invalid_input("record files need a fixed-size record layout"))?;
    if files.is_empty() {
        return Err(Error::invalid_input("no input files"));
    }
    let mut plan = Vec::with_capacity(files.len());
    for path in files {
        let meta = regular_file(path)?;
        let remainder = meta.len() % record_bytes;
        if remainder != 0 && !drop_remainder {
            return Err(Error::invalid_input(format!(
                "{}: {} bytes is not a multiple of the record size {record_bytes} ({remainder} bytes left over; \
                 --drop-remainder skips them)",
                path.display(),
                meta.len()
            )));
        }
        plan.push((path, meta.len() / record_bytes));
    }
    if plan.iter().all(|(_, n)| *n == 0) {
        return Err(Error::invalid_input(format!(
            "{}: no record of {record_bytes} bytes in the input: nothing to ingest",
            names(files)
        )));
    }
    progress.start(plan.iter().map(|(_, n)| n * record_bytes).sum());
    for (path, n_records) in plan {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        for _ in 0..n_records {
            ingest.push_from(&mut reader, record_bytes).map_err(|e| name_source(e, path))?;
            progress.advance(record_bytes);
        }
    }
    Ok(())
}

/// Ingests every regular file under `dir` as one record, in byte order of their relative paths
/// (so the order does not depend on the filesystem). Symbolic links are not followed. Returns the
/// relative paths in record order.
pub fn files_from_dir(ingest: &mut Ingest<'_>, dir: &Path, progress: &dyn Progress) -> Result<Vec<PathBuf>> {
    let meta = fs::metadata(dir).map_err(|e| Error::io("open", dir, e))?;
    if !meta.is_dir() {
        return Err(Error::invalid_input(format!("{} is not a directory", dir.display())));
    }
    let mut files = Vec::new();
    walk(dir, Path::new(""), &mut files)?;
    if files.is_empty() {
        return Err(Error::invalid_input(format!("{}: no regular file under it: nothing to ingest", dir.display())));
    }
    files.sort_by(|a, b| a.0.as_os_str().as_encoded_bytes().cmp(b.0.as_os_str().as_encoded_bytes()));
    progress.start(files.iter().map(|(_, len)| len).sum());
    for (relative, len) in &files {
        let path = dir.join(relative);
        let mut file = File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        ingest.push_from(&mut file, *len).map_err(|e| name_source(e, &path))?;
        progress.advance(*len);
    }
    Ok(files.into_iter().map(|(relative, _)| relative).collect())
}

fn walk(root: &Path, relative: &Path, out: &mut Vec<(PathBuf, u64)>) -> Result<()> {
    let dir = root.join(relative);
    let entries = fs::read_dir(&dir).map_err(|e| Error::io("read directory", &dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read directory", &dir, e))?;
        let kind = entry.file_type().map_err(|e| Error::io("stat", entry.path(), e))?;
        let child = relative.join(entry.file_name());
        if kind.is_dir() {
            walk(root, &child, out)?;
        } else if kind.is_file() {
            let len = entry.metadata().map_err(|e| Error::io("stat", entry.path(), e))?.len();
            out.push((child, len));
        }
    }
    Ok(())
}

/// Ingests WebDataset tar files: consecutive entries that share a key (the path up to the first
/// dot of the file name) form one sample, stored as one record in the sample encoding with one
/// part per entry, named by the rest of the file name ("jpg", "seg.png", "cls"). Returns the
/// number of samples.
///
/// Reading goes on past an end-of-archive marker when more headers follow (GNU tar's
/// `--ignore-zeros`), so concatenated tars (`cat a.tar b.tar`) are read whole. Directories and
/// pax global headers hold no data and are passed over; every other member that is not a
/// regular file (a link, a device, a FIFO) is reported to `progress.skipped` with the reason.
pub fn samples_from_tars(ingest: &mut Ingest<'_>, tars: &[PathBuf], progress: &dyn Progress) -> Result<u64> {
    if tars.is_empty() {
        return Err(Error::invalid_input("no input tar files"));
    }
    progress.start(check_regular_files(tars)?);
    let mut n_samples = 0;
    for path in tars {
        let bad_tar =
            |e: std::io::Error| Error::invalid_input(format!("{}: not a readable tar file: {e}", path.display()));
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let mut archive = tar::Archive::new(BufReader::with_capacity(1 << 20, file));
        archive.set_ignore_zeros(true);
        let mut sample = SampleBuilder::default();
        for entry in archive.entries().map_err(bad_tar)? {
            let mut entry = entry.map_err(bad_tar)?;
            let size = entry.size();
            progress.advance(size.saturating_add(512));
            let name = entry.path().map_err(bad_tar)?.to_string_lossy().into_owned();
            match not_a_part(&entry) {
                None => {}
                Some(Skip::Quietly) => continue,
                Some(Skip::Report(reason)) => {
                    progress.skipped(path, &name, &reason);
                    continue;
                }
            }
            let (key, part) = split_key(&name);
            if sample.key.as_deref() != Some(key) {
                if sample.flush(ingest)? {
                    n_samples += 1;
                }
                sample.key = Some(key.to_owned());
            }
            // As WebDataset: a part name twice in one sample, or one that would stand for the
            // key, is refused rather than one of the two silently lost.
            let clash = if part == "__key__" {
                Some("the part name \"__key__\" stands for the sample's key")
            } else if sample.parts.iter().any(|(other, _)| other == part) {
                Some("the sample already has a part of that name")
            } else {
                None
            };
            if let Some(clash) = clash {
                return Err(Error::invalid_input(format!("{}: {name}: {clash}", path.display())));
            }
            let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(1 << 26));
            entry.read_to_end(&mut data).map_err(bad_tar)?;
            sample.parts.push((part.to_owned(), data));
        }
        if sample.flush(ingest)? {
            n_samples += 1;
        }
    }
    if n_samples == 0 {
        return Err(Error::invalid_input(format!(
            "{}: no sample in the input (no member is a regular file): nothing to ingest",
            names(tars)
        )));
    }
    Ok(n_samples)
}

/// Checks that every path is a regular file and returns their total size: a FIFO, a device or a
/// socket would block or never end, so it is refused before anything is opened (the command
/// line calls this before it takes the store's lock).
pub fn check_regular_files(paths: &[PathBuf]) -> Result<u64> {
    let mut total: u64 = 0;
    for path in paths {
        total = total.saturating_add(regular_file(path)?.len());
    }
    Ok(total)
}

fn regular_file(path: &Path) -> Result<fs::Metadata> {
    use std::os::unix::fs::FileTypeExt;
    let meta = fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
    let kind = meta.file_type();
    let what = if kind.is_file() {
        return Ok(meta);
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(Error::invalid_input(format!("{} is {what}; only regular files are ingested", path.display())))
}

/// The input paths for a message: the one, or the first and how many more.
fn names(paths: &[PathBuf]) -> String {
    match paths {
        [one] => one.display().to_string(),
        [first, rest @ ..] => format!("{} and {} more", first.display(), rest.len()),
        [] => "no input".to_owned(),
    }
}

/// Why a tar member is not a sample part.
enum Skip {
    /// It holds no data of its own (a directory, a pax global header).
    Quietly,
    /// It is something the user may have meant as data; the reason says what.
    Report(String),
}

/// `None` for a member whose bytes are a sample part (a regular file, contiguous or sparse).
fn not_a_part<R: Read>(entry: &tar::Entry<'_, R>) -> Option<Skip> {
    use tar::EntryType;
    let kind = entry.header().entry_type();
    let target = || match entry.link_name() {
        Ok(Some(target)) => format!(" to {}", target.to_string_lossy()),
        _ => String::new(),
    };
    let reason = match kind {
        EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => return None,
        EntryType::Directory | EntryType::XGlobalHeader => return Some(Skip::Quietly),
        EntryType::Symlink => format!("a symbolic link{}; links are not followed", target()),
        EntryType::Link => format!("a hard link{}; links are not followed", target()),
        EntryType::Char => "a character device".to_owned(),
        EntryType::Block => "a block device".to_owned(),
        EntryType::Fifo => "a FIFO".to_owned(),
        other => format!("a member of type {:?}, not a regular file", other.as_byte() as char),
    };
    Some(Skip::Report(reason))
}

/// Splits a tar path into its WebDataset key and part name: `dir/000017.seg.png` is key
/// `dir/000017`, part `seg.png`; a file name without a dot is a key with the part "".
fn split_key(path: &str) -> (&str, &str) {
    let name_start = path.rfind('/').map_or(0, |slash| slash + 1);
    match path[name_start..].find('.') {
        Some(dot) => (&path[..name_start + dot], &path[name_start + dot + 1..]),
        None => (path, ""),
    }
}

#[derive(Default)]
struct SampleBuilder {
    key: Option<String>,
    parts: Vec<(String, Vec<u8>)>,
}

impl SampleBuilder {
    /// Pushes the sample being built, if any; returns whether one was pushed.
    fn flush(&mut self, ingest: &mut Ingest<'_>) -> Result<bool> {
        let Some(key) = self.key.take() else { return Ok(false) };
        let parts: Vec<(&str, &[u8])> =
            self.parts.iter().map(|(name, data)| (name.as_str(), data.as_slice())).collect();
        ingest.push(&encode_sample(&key, &parts))?;
        self.parts.clear();
        Ok(true)
    }
}

/// Names the input file in an error about its contents.
fn name_source(error: Error, path: &Path) -> Error {
    match error {
        Error::InvalidInput { detail } => Error::invalid_input(format!("{}: {detail}", path.display())),
        Error::Io { op: "read", source, .. } => Error::io("read", path, source),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::split_key;

    #[test]
    fn webdataset_keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("a/b.c/000017.seg.png"), ("a/b.c/000017", "seg.png"));
        assert_eq!(split_key("000017.jpg"), ("000017", "jpg"));
        assert_eq!(split_key("dir/README"), ("dir/README", ""));
    }
}
