//! Notifications of entries removed or replaced in directories (Linux inotify): how a reader learns
//! at once, from any process, that a shard file it keeps open was evicted, quarantined, repaired
//! or removed, and lets it go.
//!
//! Owns: one non-blocking inotify instance and its watches (one per directory). Never: opens,
//! closes or stats the watched files, or blocks. Where inotify is missing (another OS) or refused
//! (the per-user watch limit), `DirWatch::new` or `watch` fails and the caller looks at its files
//! itself; a queue that overflowed, or a watched directory that went away, is reported as such
//! (`Changes::Unknown`), never as "nothing changed".

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What happened in the watched directories since the last look.
#[derive(Debug, PartialEq, Eq)]
pub enum Changes {
    /// These entries were removed, renamed away, or replaced (some may repeat).
    Entries(Vec<PathBuf>),
    /// Events were lost (the queue overflowed, or a watched directory went): anything may have
    /// changed.
    Unknown,
}

/// Watches directories for entries that go away or are replaced.
pub struct DirWatch {
    #[cfg(target_os = "linux")]
    fd: std::os::fd::OwnedFd,
    /// Watch descriptor -> directory.
    dirs: HashMap<i32, PathBuf>,
    /// Directory -> watch descriptor.
    watched: HashMap<PathBuf, i32>,
    buf: Vec<u8>,
}

impl DirWatch {
    /// A watcher with no directories yet.
    pub fn new() -> std::io::Result<Self> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::FromRawFd;
            #[allow(unsafe_code, reason = "inotify has no safe wrapper in std")]
            // SAFETY: the call takes flags only and touches no memory of this process.
            let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            #[allow(unsafe_code, reason = "taking ownership of a descriptor just created")]
            // SAFETY: `fd` is a descriptor this call created and nothing else owns.
            let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            Ok(Self { fd, dirs: HashMap::new(), watched: HashMap::new(), buf: vec![0; 64 << 10] })
        }
        #[cfg(not(target_os = "linux"))]
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "inotify exists only on Linux"))
    }

    /// Watches `dir` (once; later calls for it do nothing).
    pub fn watch(&mut self, dir: &Path) -> std::io::Result<()> {
        if self.watched.contains_key(dir) {
            return Ok(());
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::ffi::OsStrExt;
            let name = std::ffi::CString::new(dir.as_os_str().as_bytes())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            let mask = libc::IN_DELETE
                | libc::IN_MOVED_FROM
                | libc::IN_MOVED_TO
                | libc::IN_CREATE
                | libc::IN_DELETE_SELF
                | libc::IN_MOVE_SELF
                | libc::IN_ONLYDIR;
            #[allow(unsafe_code, reason = "inotify has no safe wrapper in std")]
            // SAFETY: `name` is a NUL-terminated string that outlives the call, which only reads it.
            let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), name.as_ptr(), mask) };
            if wd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            self.dirs.insert(wd, dir.to_owned());
            self.watched.insert(dir.to_owned(), wd);
            Ok(())
        }
        #[cfg(not(target_os = "linux"))]
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "inotify exists only on Linux"))
    }

    /// Watches every directory watched so far again, under its name now: the same directory
    /// keeps its watch, one re-created or moved in under the name gets a new one, one gone is
    /// forgotten.
    fn refresh(&mut self) -> std::io::Result<()> {
        let dirs: Vec<PathBuf> = self.watched.keys().cloned().collect();
        self.watched.clear();
        self.dirs.clear();
        for dir in dirs {
            match self.watch(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether `dir` is watched.
    pub fn is_watched(&self, dir: &Path) -> bool {
        self.watched.contains_key(dir)
    }

    /// What changed since the last call; never blocks.
    pub fn changes(&mut self) -> std::io::Result<Changes> {
        let mut entries = Vec::new();
        loop {
            let n = self.read_events()?;
            if n == 0 {
                return Ok(Changes::Entries(entries));
            }
            if self.parse(n, &mut entries) {
                // Drain what is left so the next look starts clean, watch every directory
                // afresh (a watch may have gone with events that were dropped, or followed a
                // directory moved away), then say so.
                while self.read_events()? > 0 {}
                self.refresh()?;
                return Ok(Changes::Unknown);
            }
        }
    }

    /// Reads pending events into the buffer: their bytes, 0 when there are none.
    fn read_events(&mut self) -> std::io::Result<usize> {
        #[cfg(target_os = "linux")]
        loop {
            use std::os::fd::AsRawFd;
            #[allow(unsafe_code, reason = "reading inotify events has no safe wrapper in std")]
            // SAFETY: the buffer is ours, writable and `len` bytes long, for the whole call.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), self.buf.as_mut_ptr().cast(), self.buf.len()) };
            if n >= 0 {
                return Ok(usize::try_from(n).unwrap_or(0));
            }
            let error = std::io::Error::last_os_error();
            match error.kind() {
                std::io::ErrorKind::WouldBlock => return Ok(0),
                std::io::ErrorKind::Interrupted => {}
                _ => return Err(error),
            }
        }
        #[cfg(not(target_os = "linux"))]
        Ok(0)
    }

    /// Nothing to decode where there is no inotify.
    #[cfg(not(target_os = "linux"))]
    fn parse(&mut self, _: usize, _: &mut Vec<PathBuf>) -> bool {
        false
    }

    /// Decodes the first `n` bytes of the buffer into `entries`; true when events were lost or a
    /// watched directory went.
    #[cfg(target_os = "linux")]
    #[allow(clippy::host_endian_bytes, reason = "the kernel writes inotify_event in the host's byte order")]
    fn parse(&mut self, n: usize, entries: &mut Vec<PathBuf>) -> bool {
        use std::os::unix::ffi::OsStrExt;
        // struct inotify_event { int wd; u32 mask; u32 cookie; u32 len; char name[len]; }
        const HEADER: usize = 16;
        let mut lost = false;
        let mut at = 0;
        while at + HEADER <= n {
            let field = |offset: usize| {
                let bytes: [u8; 4] = self.buf[at + offset..at + offset + 4].try_into().expect("4 bytes");
                u32::from_ne_bytes(bytes)
            };
            let wd = i32::from_ne_bytes(self.buf[at..at + 4].try_into().expect("4 bytes"));
            let (mask, len) = (field(4), field(12) as usize);
            let name_end = (at + HEADER + len).min(n);
            let name = &self.buf[at + HEADER..name_end];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if mask & libc::IN_Q_OVERFLOW != 0
                || mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF | libc::IN_IGNORED) != 0
            {
                lost = true;
                if mask & libc::IN_IGNORED != 0
                    && let Some(dir) = self.dirs.remove(&wd)
                {
                    // The watch is gone: a later `watch` of the directory adds it again.
                    self.watched.remove(&dir);
                }
            } else if let Some(dir) = self.dirs.get(&wd)
                && !name.is_empty()
            {
                entries.push(dir.join(std::ffi::OsStr::from_bytes(name)));
            }
            at += HEADER + len;
        }
        lost
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn removals_and_replacements_are_named_and_a_lost_directory_is_unknown() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let sub = dir.path().join("ab");
        std::fs::create_dir(&sub).expect("mkdir");
        let (a, b) = (sub.join("a"), sub.join("b"));
        std::fs::write(&a, b"a").expect("write");
        std::fs::write(&b, b"b").expect("write");
        let mut watch = DirWatch::new().expect("inotify");
        watch.watch(&sub).expect("a watch");
        watch.watch(&sub).expect("again: nothing to do");
        assert_eq!(watch.changes().expect("events"), Changes::Entries(Vec::new()));
        std::fs::remove_file(&a).expect("rm");
        let fresh = dir.path().join("fresh");
        std::fs::write(&fresh, b"B").expect("write");
        std::fs::rename(&fresh, &b).expect("rename over b");
        let Changes::Entries(entries) = watch.changes().expect("events") else { panic!("events lost") };
        assert!(entries.contains(&a) && entries.contains(&b), "{entries:?}");
        assert_eq!(watch.changes().expect("events"), Changes::Entries(Vec::new()));
        std::fs::remove_file(&b).expect("rm");
        std::fs::remove_dir(&sub).expect("rmdir");
        assert_eq!(watch.changes().expect("events"), Changes::Unknown);
        assert!(!watch.is_watched(&sub));
        // Made again under the same name: watched afresh, its removals named.
        std::fs::create_dir(&sub).expect("mkdir");
        std::fs::write(&a, b"a").expect("write");
        watch.watch(&sub).expect("a new watch");
        std::fs::remove_file(&a).expect("rm");
        let Changes::Entries(entries) = watch.changes().expect("events") else { panic!("events lost") };
        assert!(entries.contains(&a), "{entries:?}");
        // Moved away: unknown, and the name is no longer watched (the watch followed the move).
        let moved = dir.path().join("moved");
        std::fs::rename(&sub, &moved).expect("mv");
        assert_eq!(watch.changes().expect("events"), Changes::Unknown);
        assert!(!watch.is_watched(&sub));
        std::fs::create_dir(&sub).expect("mkdir");
        assert!(watch.watch(&sub).is_ok() && watch.is_watched(&sub));
    }
}
