//! How a reader learns that the files it keeps open were removed or replaced (an evicted cache
//! entry, a quarantined or repaired shard, by any process): inotify watches on their
//! directories, or a stat of each open file where notifications cannot be had.
//!
//! Owns `Watcher`, `gone_files` and `replaced_files`. Never: closes a file (the reader and its
//! pipeline do, once no batch in flight reads it), or reads one.

use std::path::PathBuf;

use super::Dataset;
use crate::io::FileId;

/// How often a reader without notifications looks whether the files it keeps open were removed
/// or replaced (a stat of each): a removed file's space is freed within this, and a replaced one
/// read afresh.
pub(super) const OPEN_FILES_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a reader with notifications reads them (a system call): a reader used a record at
/// a time does not pay one per record.
pub(super) const NOTIFICATIONS_CHECK: std::time::Duration = std::time::Duration::from_millis(1);

/// How a reader learns that files it keeps open were removed or replaced: inotify watches on
/// their directories, set before each file is opened.
#[derive(Default)]
pub(super) struct Watcher {
    pub(super) watch: Option<crate::io::DirWatch>,
    /// Notifications cannot be had (no inotify, or a directory could not be watched): the
    /// reader stats its open files instead.
    pub(super) failed: bool,
    /// Open files by path (a shard may sit at several indices of a dataset).
    pub(super) open_paths: std::collections::HashMap<PathBuf, Vec<usize>>,
    /// When the notifications were last read, or (without them) the open files last stat'ed.
    pub(super) checked_at: Option<std::time::Instant>,
    /// Shards found gone while a batch in flight still read them: closed at the next look.
    pub(super) pending: Vec<usize>,
}

impl Watcher {
    /// Watches `path`'s directory before shard `shard` opens it. False when the directory does
    /// not exist (yet: a cache directory is made with its first shard); the open then most
    /// likely fails too, and if it does not, `after_open` watches it.
    pub(super) fn before_open(&mut self, path: &std::path::Path, shard: usize) -> bool {
        if self.failed {
            return true;
        }
        if self.watch.is_none() {
            match crate::io::DirWatch::new() {
                Ok(watch) => self.watch = Some(watch),
                Err(_) => {
                    self.give_up();
                    return true;
                }
            }
        }
        let watch = self.watch.as_mut().expect("made above");
        match path.parent().map(|dir| watch.watch(dir)) {
            Some(Ok(())) => {}
            Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => return false,
            // No directory to name, or a watch refused (the per-user limit): stat instead.
            _ => {
                self.give_up();
                return true;
            }
        }
        let shards = self.open_paths.entry(path.to_owned()).or_default();
        if !shards.contains(&shard) {
            shards.push(shard);
        }
        true
    }

    /// A file opened although its directory was missing just before: watched now (a change in
    /// between is seen by the stat at the next failed read, not by a notification).
    pub(super) fn after_open(&mut self, path: &std::path::Path, shard: usize) {
        if !self.before_open(path, shard) {
            self.give_up();
        }
    }

    /// Shard `shard`'s file at `path` was closed while its path still named it (the reader let
    /// go of it): a later notification for the path is not about a file this reader holds.
    pub(super) fn closed(&mut self, path: &std::path::Path, shard: usize) {
        if let Some(shards) = self.open_paths.get_mut(path) {
            shards.retain(|&s| s != shard);
            if shards.is_empty() {
                self.open_paths.remove(path);
            }
        }
    }

    /// Notifications cannot be relied on: the reader stats its files instead, and the watches
    /// go (they count against a per-user limit).
    pub(super) fn give_up(&mut self) {
        self.failed = true;
        self.watch = None;
        self.open_paths.clear();
    }
}

/// The (device, inode) `path` names now; `None` when it names nothing.
pub(super) fn inode_of(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|meta| (meta.dev(), meta.ino()))
}

/// The shards whose open file is no longer the one their path names.
pub(super) fn replaced_files(dataset: &Dataset, files: &[Option<FileId>], inodes: &[Option<(u64, u64)>]) -> Vec<usize> {
    (0..files.len()).filter(|&s| files[s].is_some() && inode_of(&dataset.shard_path(s)) != inodes[s]).collect()
}

/// The open files removed or replaced since they were opened (an evicted cache entry, a
/// quarantined or repaired shard), each named once, to be closed: by the notifications (read
/// at most once a millisecond), else by a stat of each open file (when notifications
/// overflowed, or, without them, at most once a second). Shards named before but still read
/// by a batch in flight then (`Watcher::pending`) come first.
pub(super) fn gone_files(
    watcher: &mut Watcher,
    dataset: &Dataset,
    files: &[Option<FileId>],
    inodes: &[Option<(u64, u64)>],
) -> Vec<usize> {
    let mut gone = std::mem::take(&mut watcher.pending);
    gone.retain(|&s| files[s].is_some());
    let stat_all = if watcher.failed {
        watcher.checked_at.is_none_or(|at| at.elapsed() >= OPEN_FILES_CHECK)
    } else {
        match watcher.watch.as_mut() {
            None => false,
            Some(_) if watcher.checked_at.is_some_and(|at| at.elapsed() < NOTIFICATIONS_CHECK) => false,
            Some(watch) => match watch.changes() {
                Ok(crate::io::Changes::Entries(paths)) => {
                    watcher.checked_at = Some(std::time::Instant::now());
                    for path in paths {
                        gone.extend(watcher.open_paths.remove(&path).unwrap_or_default());
                    }
                    false
                }
                // Directories whose watch went are watched again at the next open in them.
                Ok(crate::io::Changes::Unknown) => true,
                Err(_) => {
                    watcher.give_up();
                    true
                }
            },
        }
    };
    if stat_all {
        watcher.checked_at = Some(std::time::Instant::now());
        gone.extend(replaced_files(dataset, files, inodes));
    }
    gone.sort_unstable();
    gone.dedup();
    gone.retain(|&s| files[s].is_some());
    gone
}
