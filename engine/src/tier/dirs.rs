//! The memory tier's directory: which file system a directory is on, and making (or trusting)
//! one as the tier's.
//!
//! Owns the directory checks (owner, mode, no symlink, the `.granary-tier` marker, a memory
//! file system). Never: trusts a directory another user owns, or one that holds other files
//! and no marker; never removes a file.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use super::MARKER;
use super::names::{claimed_extent, is_extent_name, is_old_extent_name};
use crate::error::{Error, Result};

/// File systems whose files live in memory.
pub(super) const MEMORY_FILE_SYSTEMS: &[&str] = &["tmpfs", "ramfs", "hugetlbfs"];

/// The type of the file system a directory is on, and whether it keeps its files in memory
/// (`None` when `/proc/self/mounts` does not say).
pub fn file_system_of(dir: &Path) -> Option<(String, bool)> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let dir = dir.canonicalize().ok()?;
    let kind = fs_type_of(&mounts, &dir)?;
    Some((kind.to_owned(), MEMORY_FILE_SYSTEMS.contains(&kind)))
}

/// The type of the file system `path` (absolute, resolved) is on, from `/proc/self/mounts`
/// text: that of the longest mount point that holds it (the last such line, for stacked mounts).
pub(super) fn fs_type_of<'m>(mounts: &'m str, path: &Path) -> Option<&'m str> {
    mount_of(mounts, path).map(|(kind, _)| kind)
}

/// The type and the options of the mount that holds `path` (absolute, resolved), from
/// `/proc/self/mounts` text: the longest mount point that holds it (the last such line, for
/// stacked mounts).
fn mount_of<'m>(mounts: &'m str, path: &Path) -> Option<(&'m str, &'m str)> {
    let mut best: Option<(usize, &str, &str)> = None;
    for line in mounts.lines() {
        let mut fields = line.split(' ');
        let (Some(_), Some(point), Some(kind), Some(options)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        // Spaces and the like are octal escapes there (`\040`).
        let point = point.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\");
        let point = Path::new(&point);
        if path.starts_with(point) && best.is_none_or(|(depth, _, _)| point.components().count() >= depth) {
            best = Some((point.components().count(), kind, options));
        }
    }
    best.map(|(_, kind, options)| (kind, options))
}

/// Whether the file system `dir` is on is mounted read-only (`ro` among its options in
/// `/proc/self/mounts`; false when that does not say).
fn mounted_read_only(dir: &Path) -> bool {
    let (Ok(mounts), Ok(dir)) = (std::fs::read_to_string("/proc/self/mounts"), dir.canonicalize()) else {
        return false;
    };
    mount_of(&mounts, &dir).is_some_and(|(_, options)| options.split(',').any(|o| o == "ro"))
}

pub(super) fn current_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}

/// Creates the tier directory (mode 0700, marked as the tier's) or checks that an existing one
/// is a real directory owned by this user (extents are trusted as verified, so nobody else may
/// write them) and the tier's: marked, or holding nothing but tier files. A directory of the
/// user's own files is refused, since the tier empties its directory.
pub(super) fn prepare_dir(dir: &Path) -> Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io("chmod", dir, e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io("create", dir, e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| Error::io("stat", dir, e))?;
    // A directory on a read-only file system cannot be the tier whoever owns it: the system's
    // reason (an I/O error, which the loader does without), said before its owner or mode are
    // (a fresh read-only tmpfs is root's, mode 1777).
    if meta.is_dir() && mounted_read_only(dir) {
        return Err(Error::io("write", dir, std::io::Error::from_raw_os_error(libc::EROFS)));
    }
    if !meta.is_dir() || meta.uid() != current_uid() || meta.mode() & 0o022 != 0 {
        return Err(Error::invalid_input(format!(
            "the memory tier's directory {} is not a directory of this user's that only it can write; \
             remove it or choose another (GRANARY_TIER_DIR)",
            dir.display()
        )));
    }
    let marker = dir.join(MARKER);
    if std::fs::symlink_metadata(&marker).is_ok_and(|m| m.is_file()) {
        return Ok(());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in entries {
        let name = entry.map_err(|e| Error::io("list", dir, e))?.file_name();
        let name = name.to_string_lossy();
        // The marker itself: another process opening the tier at this moment wrote it since
        // the check above.
        if !(name == MARKER
            || name == ".users"
            || is_extent_name(&name)
            || is_old_extent_name(&name)
            || claimed_extent(&name).is_some())
        {
            return Err(Error::invalid_input(format!(
                "{} holds {name:?}, which is not a memory tier file: the tier empties its directory, so it \
                 needs one of its own (an empty or new directory for GRANARY_TIER_DIR)",
                dir.display()
            )));
        }
    }
    std::fs::write(&marker, b"granary memory tier: files here are removed when the last reader closes\n")
        .map_err(|e| Error::io("create", &marker, e))
}
