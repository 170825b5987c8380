//! Ingest sources: fixed-size record files, directory trees, WebDataset tars.
//!
//! Each source checks what it can before the first record is written (paths exist, sizes divide),
//! then streams: no source holds more than one record (for tars, one sample) in memory.
//!
//! Owns: `Progress`, `records_from_files`, `files_from_dir`, `samples_from_tars` with `tar_samples`
//! (a tar's members grouped into samples as webdataset 1.0 groups them), `expand_tar_inputs` and
//! `check_regular_files`. Never: writes a shard itself (every record goes to the `Ingest` session),
//! follows a symbolic link within a directory tree, or runs a command (`pipe:` inputs are refused).

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read};
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
                 dropping each file's remainder skips them: --drop-remainder, drop_remainder=True in Python)",
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

/// Ingests WebDataset tar files (plain or gzip-compressed): the members that share a key are
/// one sample, one record, grouped as `webdataset.WebDataset` (1.0) groups them (see
/// `tar_samples`). Members that are not sample parts are passed to `progress.skipped`. Returns
/// the samples ingested; a set of tars holding none is refused.
pub fn samples_from_tars(ingest: &mut Ingest<'_>, tars: &[PathBuf], progress: &dyn Progress) -> Result<u64> {
    if tars.is_empty() {
        return Err(Error::invalid_input("no input tar files"));
    }
    progress.start(check_regular_files(tars)?);
    let mut n_samples = 0;
    for path in tars {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        n_samples += tar_samples(
            BufReader::with_capacity(1 << 20, file),
            &mut |key, parts| {
                let parts: Vec<(&str, &[u8])> =
                    parts.iter().map(|(name, data)| (name.as_str(), data.as_slice())).collect();
                ingest.push(&encode_sample(key, &parts))
            },
            &mut |member, reason| progress.skipped(path, member, reason),
            &mut |bytes| progress.advance(bytes),
        )
        .map_err(|e| name_source(e, path))?;
    }
    if n_samples == 0 {
        return Err(Error::invalid_input(format!(
            "{}: no sample in the input (no member is a sample part): nothing to ingest",
            names(tars)
        )));
    }
    Ok(n_samples)
}

/// What `tar_samples` hands each sample to: its key and its parts (name, bytes), in tar order.
pub type SampleSink<'a> = dyn FnMut(&str, &[(String, Vec<u8>)]) -> Result<()> + 'a;

/// The largest tar member taken as a sample part.
const PART_BYTES_MAX: u64 = 1 << 30;

/// `text` as it may go into a message: the tar reader quotes the bytes of a bad header, which
/// for a file that is no tar at all are raw binary; anything but printable ASCII becomes its
/// `\u{..}` escape, and the text stops at 200 characters.
fn printable(text: &str) -> String {
    // Only printable ASCII as it is: what random bytes become (control characters, replacement
    // characters, stray letters of other scripts) is escaped, so a terminal shows words.
    let mut out = String::new();
    for c in text.chars().take(200) {
        if c.is_ascii_graphic() || c == ' ' {
            out.push(c);
        } else {
            out.extend(c.escape_unicode());
        }
    }
    if text.chars().nth(200).is_some() {
        out.push_str("...");
    }
    out
}

/// Reads the WebDataset samples of one tar stream, plain or gzip-compressed (told by its
/// first bytes), past end-of-archive blocks (concatenated tars), as `webdataset.WebDataset`
/// 1.0 groups them: a regular member `dir/KEY.EXT` is part `EXT` (lowercased) of sample
/// `dir/KEY`, `KEY` being its file name up to the first dot; consecutive members of one key
/// are one sample. Not parts, and passed to `skipped` with why: members that are not regular
/// files, file names that start with a dot (`._x.jpg` AppleDouble files a Mac's tar writes,
/// `.DS_Store`) or have no dot (`README`), and WebDataset's metadata (`__meta__`,
/// `__index__/...`). A part name twice in one sample (`x.jpg` and `x.JPG`) is refused, as
/// webdataset refuses it. Calls `sample` for each sample; `advance` with the bytes read.
/// Returns the samples read.
pub fn tar_samples(
    input: impl Read,
    sample: &mut SampleSink<'_>,
    skipped: &mut dyn FnMut(&str, &str),
    advance: &mut dyn FnMut(u64),
) -> Result<u64> {
    let bad_tar = |e: std::io::Error| {
        Error::invalid_input(format!("not a readable tar or gzip-compressed tar file: {}", printable(&e.to_string())))
    };
    let mut input = BufReader::new(input);
    let gzip = input.fill_buf().map_err(bad_tar)?.starts_with(&[0x1f, 0x8b]);
    let input: Box<dyn Read> = if gzip { Box::new(flate2::read::MultiGzDecoder::new(input)) } else { Box::new(input) };
    let mut archive = tar::Archive::new(input);
    archive.set_ignore_zeros(true);
    let mut current = SampleBuilder::default();
    let mut n_samples = 0;
    for entry in archive.entries().map_err(bad_tar)? {
        let mut entry = entry.map_err(bad_tar)?;
        let size = entry.size();
        advance(size.saturating_add(512));
        let name = entry.path().map_err(bad_tar)?.to_string_lossy().into_owned();
        match not_a_part(&entry) {
            None => {}
            Some(Skip::Quietly) => continue,
            Some(Skip::Report(reason)) => {
                skipped(&name, &reason);
                continue;
            }
        }
        let (key, part) = match split_key(&name) {
            Ok(split) => split,
            Err(reason) => {
                skipped(&name, reason);
                continue;
            }
        };
        if current.key.as_deref() != Some(key) {
            if current.flush(sample)? {
                n_samples += 1;
            }
            current.key = Some(key.to_owned());
        }
        // As WebDataset: a part name twice in one sample, or one that would stand for the
        // key, is refused rather than one of the two silently lost.
        let clash = if part == "__key__" {
            Some("the part name \"__key__\" stands for the sample's key")
        } else if current.parts.iter().any(|(other, _)| *other == part) {
            Some("the sample already has a part of that name (part names are lowercased, as webdataset does)")
        } else {
            None
        };
        if let Some(clash) = clash {
            return Err(Error::invalid_input(format!("{name}: {clash}")));
        }
        // A sample is one record, held in memory while it is built: a member larger than a
        // record may be is refused before its bytes are read (a hostile header, or a gzip
        // bomb, cannot make the reader allocate what it says).
        if size > PART_BYTES_MAX {
            return Err(Error::invalid_input(format!(
                "{name}: a member of {size} bytes, more than a sample part may hold ({PART_BYTES_MAX})"
            )));
        }
        let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(1 << 26));
        entry.read_to_end(&mut data).map_err(bad_tar)?;
        current.parts.push((part, data));
    }
    if current.flush(sample)? {
        n_samples += 1;
    }
    Ok(n_samples)
}

/// The tar files named by `inputs` as webdataset's users write them: `a.tar::b.tar` (several),
/// brace patterns (`shard-{000..009}.tar`, `{train,val}.tar`), `file:` URLs, and directories
/// (their `.tar`, `.tar.gz` and `.tgz` files, sorted). `pipe:` and other URLs are refused: the
/// engine reads files.
pub fn expand_tar_inputs(inputs: &[String]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for input in inputs {
        for one in input.split("::").filter(|s| !s.is_empty()) {
            if one.starts_with("pipe:") {
                return Err(Error::invalid_input(format!(
                    "{one}: pipe: URLs run a shell command, and granary reads files: run the command into a file \
                     first, then ingest that"
                )));
            }
            let one = one.strip_prefix("file://").or_else(|| one.strip_prefix("file:")).unwrap_or(one);
            if let Some((scheme, _)) = one.split_once("://") {
                return Err(Error::invalid_input(format!(
                    "{one}: {scheme}:// URLs are not read: download the tars first"
                )));
            }
            for path in expand_braces(one)? {
                let path = PathBuf::from(path);
                if path.is_dir() {
                    let mut tars: Vec<PathBuf> = fs::read_dir(&path)
                        .map_err(|e| Error::io("read directory", &path, e))?
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|p| {
                            let name =
                                p.file_name().map(|n| n.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                            p.is_file() && [".tar", ".tar.gz", ".tgz"].iter().any(|ext| name.ends_with(ext))
                        })
                        .collect();
                    if tars.is_empty() {
                        return Err(Error::invalid_input(format!(
                            "{}: a directory without .tar, .tar.gz or .tgz files",
                            path.display()
                        )));
                    }
                    tars.sort();
                    out.extend(tars);
                } else {
                    out.push(path);
                }
            }
        }
    }
    Ok(out)
}

/// Expands brace groups as the shell and Python's `braceexpand` do: `{a,b}` alternatives and
/// `{0..9}` / `{000..099}` numeric ranges (zero-padded to the first bound's width), every
/// group of a pattern in turn (not nested).
fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let Some(open) = pattern.find('{') else { return Ok(vec![pattern.to_owned()]) };
    let Some(close) = pattern[open..].find('}').map(|c| open + c) else { return Ok(vec![pattern.to_owned()]) };
    let (head, body, tail) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    let choices: Vec<String> = match body.split_once("..") {
        Some((first, last))
            if !first.is_empty()
                && !last.is_empty()
                && first.bytes().chain(last.bytes()).all(|b| b.is_ascii_digit()) =>
        {
            let bad = || Error::invalid_input(format!("{pattern}: a range {{{body}}} of too large numbers"));
            let (from, to): (u64, u64) = (first.parse().map_err(|_| bad())?, last.parse().map_err(|_| bad())?);
            if to < from || to - from >= 1 << 20 {
                return Err(Error::invalid_input(format!("{pattern}: the range {{{body}}} is empty or too long")));
            }
            let width = first.len();
            (from..=to).map(|n| format!("{n:0width$}")).collect()
        }
        _ if body.contains(',') => body.split(',').map(str::to_owned).collect(),
        // Not a group: literal braces.
        _ => return Ok(expand_braces(tail)?.into_iter().map(|t| format!("{head}{{{body}}}{t}")).collect()),
    };
    let tails = expand_braces(tail)?;
    Ok(choices.iter().flat_map(|c| tails.iter().map(move |t| format!("{head}{c}{t}"))).collect())
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

/// Splits a tar path into its WebDataset key and part name as webdataset 1.0 does, by its
/// pattern `^((?:.*/|)[^.]+)[.]([^/]*)$` (the part lowercased): `a/b.c/000017.seg.PNG` is key
/// `a/b.c/000017`, part `seg.png`. No part: a path the pattern does not match (a file name
/// without a dot; `._x.jpg` and `.DS_Store` at the top), and WebDataset's metadata
/// (`__meta__`, `__index__/...`). (The pattern makes `dir/.x.jpg` key `dir/`, part `x.jpg`:
/// kept, so that both give the same samples.)
fn split_key(path: &str) -> std::result::Result<(&str, String), &'static str> {
    let first = path.split('/').next().unwrap_or(path);
    if first.len() > 4 && first.starts_with("__") && first.ends_with("__") {
        return Err("WebDataset metadata, not a sample");
    }
    // `(?:.*/|)`: the longest prefix ending in '/' first, then shorter ones, then none; then
    // `[^.]+` runs to the next dot, which must leave no '/' after it.
    let starts = path.match_indices('/').rev().map(|(at, _)| at + 1).chain(std::iter::once(0));
    for start in starts {
        let Some(dot) = path[start..].find('.').map(|d| start + d) else { continue };
        if dot > start && !path[dot + 1..].contains('/') {
            return Ok((&path[..dot], path[dot + 1..].to_lowercase()));
        }
    }
    let name = &path[path.rfind('/').map_or(0, |slash| slash + 1)..];
    Err(if name.starts_with('.') {
        "a dotfile (as ._NAME AppleDouble files and .DS_Store that a Mac's tar adds), not a sample part"
    } else {
        "a file name without an extension, not a sample part"
    })
}

#[derive(Default)]
struct SampleBuilder {
    key: Option<String>,
    parts: Vec<(String, Vec<u8>)>,
}

impl SampleBuilder {
    /// Hands the sample being built, if any, to `sample`; returns whether there was one.
    fn flush(&mut self, sample: &mut SampleSink<'_>) -> Result<bool> {
        let Some(key) = self.key.take() else { return Ok(false) };
        sample(&key, &self.parts)?;
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
    use super::{Result, expand_braces, split_key, tar_samples};

    #[test]
    fn webdataset_keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("a/b.c/000017.seg.png"), Ok(("a/b.c/000017", "seg.png".to_owned())));
        assert_eq!(split_key("./000017.JPG"), Ok(("./000017", "jpg".to_owned())));
        assert!(split_key("dir/README").is_err());
        assert!(split_key("._000017.jpg").is_err());
        assert_eq!(split_key("x/.DS_Store"), Ok(("x/", "ds_store".to_owned())), "as webdataset's pattern has it");
        assert_eq!(split_key("x/y.z/w.jpg"), Ok(("x/y.z/w", "jpg".to_owned())));
        assert!(split_key("__meta__").is_err());
        assert!(split_key("__index__/000.json").is_err());
        assert_eq!(split_key("a.").map(|(k, p)| (k.to_owned(), p)), Ok(("a".to_owned(), String::new())));
    }

    #[test]
    fn brace_patterns_expand_as_braceexpand_does() {
        assert_eq!(expand_braces("s-{000..002}.tar").unwrap(), ["s-000.tar", "s-001.tar", "s-002.tar"]);
        assert_eq!(expand_braces("{a,b}-{1..2}").unwrap(), ["a-1", "a-2", "b-1", "b-2"]);
        assert_eq!(expand_braces("plain{x}.tar").unwrap(), ["plain{x}.tar"]);
        assert!(expand_braces("s-{5..1}.tar").is_err());
    }

    #[test]
    fn random_bytes_given_as_a_tar_are_refused_in_printable_words() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            })
            .collect();
        let mut sink = |_: &str, _: &[(String, Vec<u8>)]| -> Result<()> { Ok(()) };
        let error = tar_samples(&noise[..], &mut sink, &mut |_, _| {}, &mut |_| {}).unwrap_err().to_string();
        assert!(error.contains("not a readable tar or gzip-compressed tar file"), "{error}");
        assert!(error.chars().all(|c| c.is_ascii_graphic() || c == ' ') && error.len() < 2000, "{error:?}");
    }
}
