//! The memory tier's fills: an extent claimed with a flock'ed `.fill-` file, read from its shard
//! through the filler's backend (`io::read_exact`: O_DIRECT ops straight into a private file's
//! mapping, the faults a `FaultIo` injects met as the reader meets them), every block checked,
//! and published by a link under the extent's name; `fill_within_budget` takes the claim under the node-wide budget
//! lock. (The page cache tier's fills are `page_cache.rs`'s.)
//!
//! Owns `Claim`, the private files and the publication of an extent file. Never: decides what to
//! fill or what makes room (`fill/` does), or writes an extent file after its link.

use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};

use crate::io::Io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::*;

impl MemoryTier {
    /// Reads extent `info` from its shard into the tier: a claim, a read through `io` (the
    /// caller's for this fill alone; a page cache tier maps the shard instead) into a private
    /// file's mapping, every block checked against `meta`, then the private file linked under the
    /// extent's name. The budget is the caller's affair (`fill_within_budget` keeps it).
    pub fn fill(&self, info: &ExtentInfo, io: &mut dyn Io) -> Result<Filled> {
        if self.page_cache.is_some() {
            return self.fill_page_cache(info);
        }
        let name = self.extent_name(&info.key);
        if self.dir.join(&name).exists() {
            return Ok(Filled::Elsewhere);
        }
        let Some(claim) = self.claim(&name, info.n_blocks * BLOCK_BYTES_U64)? else { return Ok(Filled::Elsewhere) };
        self.fill_under(claim, info, &name, io)
    }

    /// `fill`, within the node-wide budget. Under the budget lock (a flock on the directory that
    /// every filler of the node, in any process, takes in turn), the extent is claimed (or left
    /// to the filler that holds it), then, with what the tier holds listed afresh and every other
    /// fill under way counted at the length its claim says, `room` evicts what it chooses and says whether
    /// the extent fits now; the lock goes after that, so two fillers never spend the same room.
    /// `None`: no room was made, or the lock stayed taken for `BUDGET_LOCK_WAIT` (a process
    /// forked while holding it keeps it until it exits).
    pub fn fill_within_budget(
        &self,
        info: &ExtentInfo,
        io: &mut dyn Io,
        room: impl FnOnce(Holdings) -> Result<bool>,
    ) -> Result<Option<Filled>> {
        if let Some(page_cache) = &self.page_cache {
            // The page cache is the node's: fills of other processes need no claim (two reads
            // of one page are one read), and the budget is this process's plan's to keep.
            let (extents, held) = self.resident()?;
            let holdings = Holdings { extents, held, filling: page_cache.filling() };
            if !room(holdings)? {
                return Ok(None);
            }
            return self.fill_page_cache(info).map(Some);
        }
        let name = self.extent_name(&info.key);
        if self.dir.join(&name).exists() {
            return Ok(Some(Filled::Elsewhere));
        }
        let claim = {
            let Some(_budget_lock) = self.budget_lock()? else { return Ok(None) };
            if self.dir.join(&name).exists() {
                return Ok(Some(Filled::Elsewhere));
            }
            let bytes = info.n_blocks * BLOCK_BYTES_U64;
            let Some(claim) = self.claim(&name, bytes)? else { return Ok(Some(Filled::Elsewhere)) };
            let mut holdings = self.holdings_now()?;
            // Its own claim is what `room` is asked about.
            holdings.filling = holdings.filling.saturating_sub(bytes);
            match room(holdings) {
                Ok(true) => claim,
                outcome => {
                    remove_if_same(&claim.path, &claim.file);
                    return outcome.map(|_| None);
                }
            }
        };
        self.fill_under(claim, info, &name, io).map(Some)
    }

    /// The budget lock (an exclusive flock on the directory), held until the file is dropped;
    /// `None` when it stayed taken for `BUDGET_LOCK_WAIT`. The descriptor is its own: a flock
    /// is per open file, so this also orders the fillers of this process.
    fn budget_lock(&self) -> Result<Option<std::fs::File>> {
        let file = std::fs::File::open(&self.dir).map_err(|e| Error::io("open", &self.dir, e))?;
        let deadline = Instant::now() + BUDGET_LOCK_WAIT;
        while flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(Some(file))
    }

    fn fill_under(&self, claim: Claim, info: &ExtentInfo, name: &str, io: &mut dyn Io) -> Result<Filled> {
        // Another filler may have published it between the check and the claim.
        let outcome = if self.dir.join(name).exists() {
            Ok(Filled::Elsewhere)
        } else {
            self.fill_claimed(info, name, &claim, io)
        };
        if outcome.is_err() {
            self.counters.fill_failures.fetch_add(1, Ordering::Relaxed);
        }
        remove_if_same(&claim.path, &claim.file);
        outcome
    }

    fn fill_claimed(&self, info: &ExtentInfo, name: &str, claim: &Claim, io: &mut dyn Io) -> Result<Filled> {
        let len = usize::try_from(info.n_blocks * BLOCK_BYTES_U64)
            .map_err(|_| Error::invalid_input("an extent larger than memory"))?;
        let (file, private) = self.private_file(name)?;
        let final_path = self.dir.join(name);
        let outcome = (|| {
            // The disk's DMA lands in the private file's own pages: no copy into the tier.
            let mut map = WritableMap::new(&file, len, &private)?;
            let bytes = map.as_mut_slice();
            crate::io::read_exact(io, &info.path, DATA_OFFSET + info.first_block * BLOCK_BYTES_U64, bytes)?;
            info.meta.check_blocks(info.first_block, bytes).map_err(|(block, expected, actual)| {
                Error::ChecksumMismatch { shard: info.key.shard, block, expected, actual }
            })?;
            drop(map);
            file.set_permissions(std::fs::Permissions::from_mode(0o400))
                .map_err(|e| Error::io("chmod", &private, e))?;
            // Only this call knows the private name, so what is linked is what was checked; the
            // link fails rather than replace an extent someone else published.
            // Under the budget lock, the extent appears and its claim goes in one step for a
            // filler that lists the directory to count what is held (a listing is not atomic:
            // it could miss both). A lock that stays taken does not stop the publication.
            let _budget_lock = self.budget_lock()?;
            let linked = match std::fs::hard_link(&private, &final_path) {
                Ok(()) => Ok(Filled::Loaded),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(Filled::Elsewhere),
                Err(e) => Err(Error::io("link", &final_path, e)),
            };
            remove_if_same(&claim.path, &claim.file);
            linked
        })();
        let _ = std::fs::remove_file(&private);
        if let Ok(Filled::Loaded) = outcome {
            self.counters.extents_loaded.fetch_add(1, Ordering::Relaxed);
            self.counters.bytes_loaded.fetch_add(len as u64, Ordering::Relaxed);
            let ino = file.metadata().map(|m| m.ino()).unwrap_or(0);
            let mut listing = self.listing.lock();
            if listing.extents.insert(name.to_owned(), (len as u64, ino)).is_none() {
                listing.bytes += len as u64;
            }
        }
        outcome
    }

    /// A new file only this process names (`.new-PID-N-NAME`), for extent `name`.
    fn private_file(&self, name: &str) -> Result<(std::fs::File, PathBuf)> {
        let mut tries = 0;
        loop {
            // The pid alone is not unique across PID namespaces sharing the directory: a taken
            // name is skipped.
            let path = self.dir.join(format!(".new-{}-{}-{name}", std::process::id(), nonce()));
            match std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path) {
                Ok(file) => return Ok((file, path)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => tries += 1,
                Err(e) => return Err(Error::io("create", &path, e)),
            }
        }
    }

    /// Takes the claim on extent `name`, `bytes` long: a fresh file, locked, as long as the fill
    /// (sparse: no memory, the length tells other fillers the room it takes), then linked to `.fill-NAME` (the
    /// link fails if another claim exists, so the lock is held before the name is visible).
    /// `None` when a live filler holds it.
    fn claim(&self, name: &str, bytes: u64) -> Result<Option<Claim>> {
        let claim_path = self.dir.join(format!(".fill-{name}"));
        let (file, fresh) = self.private_file(name)?;
        let claimed = flock(&file, libc::LOCK_EX | libc::LOCK_NB)
            .and_then(|()| file.set_len(bytes))
            .map_err(|e| Error::io("claim", &fresh, e))
            .and_then(|()| {
                for _ in 0..2 {
                    match std::fs::hard_link(&fresh, &claim_path) {
                        Ok(()) => return Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                            if self.claim_is_live(name) {
                                return Ok(false);
                            }
                        }
                        // A clear emptied the directory meanwhile: leave the extent for now.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                        Err(e) => return Err(Error::io("link", &claim_path, e)),
                    }
                }
                Ok(false)
            });
        let _ = std::fs::remove_file(&fresh);
        Ok(claimed?.then_some(Claim { file, path: claim_path }))
    }
}

/// A claim on an extent, locked by this process until it is removed.
pub(super) struct Claim {
    file: std::fs::File,
    path: PathBuf,
}

/// Removes `path` if it still names `file`. Another process's clean-up may have replaced a
/// name since it was opened; what is left between the check and the removal is harmless: a
/// live claim removed so lets a second filler load the same extent, and the second link fails.
pub(super) fn remove_if_same(path: &Path, file: &std::fs::File) {
    let same = match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(named), Ok(held)) => named.dev() == held.dev() && named.ino() == held.ino(),
        _ => false,
    };
    if same {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_fillers_claim_is_stale_and_a_live_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = TierConfig {
            kind: TierKind::Memory,
            budget_bytes: Some(1 << 30),
            dir: Some(dir.path().join("t")),
            ..TierConfig::default()
        };
        let tier = MemoryTier::open(&config).expect("open").expect("on");
        let name = format!("{}.4096k.000000", "ab".repeat(32));
        let claim = tier.claim(&name, 4 << 20).expect("claim").expect("free");
        assert!(tier.claim_is_live(&name), "held by this process's open claim");
        assert!(tier.claim(&name, 4 << 20).expect("claim").is_none(), "one claim at a time");
        drop(claim);
        assert!(!tier.claim_is_live(&name), "its lock went with it");
        assert!(!dir.path().join(format!("t/.fill-{name}")).exists(), "the stale claim was removed");
    }

    #[test]
    fn a_claim_removes_only_its_own_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = TierConfig {
            kind: TierKind::Memory,
            budget_bytes: Some(1 << 30),
            dir: Some(dir.path().join("t")),
            ..TierConfig::default()
        };
        let tier = MemoryTier::open(&config).expect("open").expect("on");
        let name = format!("{}.4096k.000000", "cd".repeat(32));
        let claim = tier.claim(&name, 4 << 20).expect("claim").expect("free");
        // Someone else's clean-up replaced the name meanwhile (another filler's claim now).
        std::fs::remove_file(&claim.path).expect("unlink");
        std::fs::write(&claim.path, b"theirs").expect("write");
        remove_if_same(&claim.path, &claim.file);
        assert_eq!(std::fs::read(&claim.path).expect("read"), b"theirs", "another's claim stays");
    }
}
