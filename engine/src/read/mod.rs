//! The read path: from record indices to verified bytes.
//!
//! Owns: `Reader` (one per thread or rank: a backend, its open files, reusable planning
//! scratch); beside it `dataset.rs` (`Dataset`: an opened dataset version, its manifest and,
//! loaded on first use, each shard's verified metadata), `hook.rs` (`ShardSource`, what a read
//! asks of a repairer or cache), `mixture.rs` (`Mixture`: weighted versions read as one
//! concatenated dataset, ordered by `blend.rs`), `watch.rs` (how it learns its open files went), `pipeline.rs`
//! (the stream of one read), `batch.rs`, `batch_plan.rs`, `verify.rs`, `stats.rs`. A batch read maps indices to shard byte ranges, reads each block
//! that any record touches exactly once, coalescing adjacent blocks into ops of up to the
//! backend's op size, reads ops of whole block-aligned records straight into the batch's memory
//! and the rest into a buffer, checks every block's CRC32C as its op completes, and copies the
//! other records into the batch in request order. With verify workers (`verify.rs`), long ops are
//! checked, and those not read into the batch are read into the slot's scratch memory and copied
//! out, on the workers, in any order: the reaping thread only reaps and resubmits; short ops are
//! read into the backend's buffers and checked and copied on the reaping thread. A slot's scratch
//! is about its batch's read bytes, kept for the reader's life, outside the staging pool. Records
//! whose extents the memory tier holds (`Reader::set_tier`) are copied from it while the batch
//! is planned, every block they touch checked as it is copied (the bytes in the batch, and the
//! rest of the block in the tier); a record that fails is read from disk instead, counted as a
//! verify failure, and its extent leaves the tier. Invariant: no batch is delivered holding a
//! byte of a block whose checksum has not matched where that byte was copied from (the tier at
//! the copy, or the op's buffer as it completed: bytes read straight into a batch are checked
//! there before the batch is handed out); a failed read leaves the batch empty. Files stay open from read to
//! read (a reader used a record at a time opens each shard once); one removed or replaced under
//! its name (an evicted cache entry, a quarantined or repaired shard, by any process) is closed
//! at the next read, or within a read before the next batch is planned once no batch in flight
//! reads it: an inotify watch on its directory tells the reader (looked at once a
//! millisecond at most), or, where inotify is unavailable, a stat of every open file once a
//! second; and every file is closed when a read fails. Behind a hook that evicts (an origin
//! cache), a shard's file no batch in flight reads is closed before the batch that read it is
//! handed on when the hook does not keep it open (`ShardSource::keeps_open`: the plan does not
//! read it again soon), so its eviction frees the disk while the sink waits.
//! Never: writes, or touches the catalog (refs and manifests are files, so many reader processes
//! share a store with one writer).

mod batch;
mod batch_plan;
mod dataset;
mod hook;
mod mixture;
mod pipeline;
mod stats;
mod verify;
mod watch;

use std::sync::{Arc, OnceLock};

pub use batch::Batch;
pub use dataset::Dataset;
pub(crate) use dataset::forget_shard_reads;
pub use hook::{CacheStats, ShardSource};
pub use mixture::{EpochLength, Mixture, MixtureSource};
pub use stats::{PublishedStats, ReadStats};
pub use verify::{VERIFY_THREADS_MAX, default_verify_threads};

use crate::error::{Error, Result};
use crate::io::{FileId, Io};
use crate::staging::StagingPool;
use crate::tier::TierReader;
use pipeline::{Pipeline, Replay};
use stats::publish;
use watch::{Watcher, gone_files, inode_of, replaced_files};

/// Repairs beyond one per shard that a read may make without delivering a batch.
const REPAIRS_WITHOUT_PROGRESS_SLACK: usize = 8;

/// Files a reader opens before it closes them all at the end of a read and starts afresh: a
/// quarter of the process's soft limit on descriptors (several readers share it), at least 16
/// and at most 1024 (a backend numbers its files from the first open; io_uring registers 4096).
fn opens_before_reset() -> usize {
    static OPENS: OnceLock<usize> = OnceLock::new();
    *OPENS.get_or_init(|| {
        let soft =
            crate::io::open_files_limit().map_or(usize::MAX, |limit| usize::try_from(limit).unwrap_or(usize::MAX));
        (soft / 4).clamp(16, 1024)
    })
}

/// Reads records of one dataset version through one backend. Not shared between threads: each
/// thread or rank makes its own (they share the `Dataset`).
pub struct Reader {
    dataset: Arc<Dataset>,
    io: Box<dyn Io>,
    files: Vec<Option<FileId>>,
    /// Per open file: the (device, inode) its path named just before it was opened.
    inodes: Vec<Option<(u64, u64)>>,
    /// Files opened since the backend last closed them all.
    opens: usize,
    /// Notifications of open files removed or replaced.
    watcher: Watcher,
    /// The batch `get` reads into, kept from call to call.
    get_batch: Batch,
    slots: Vec<BatchSlot>,
    stats: ReadStats,
    /// A copy of `stats` kept current for another thread (see `publish_stats`).
    published: Option<Arc<PublishedStats>>,
    staging: Option<StagingPool>,
    repair: Option<Arc<dyn ShardSource>>,
    tier: Option<TierReader>,
    /// Verify workers to start for long ops (0: every check on the reading thread).
    verify_threads: usize,
    /// The workers, started at the first op they take.
    verify: Option<verify::VerifyPool>,
    /// Whether reads are counted per shard (`Dataset::shard_reads`).
    count_shard_reads: bool,
}

/// A batch being read: its plan, its bytes, and how far its ops have got.
#[derive(Default)]
struct BatchSlot {
    planner: batch_plan::Planner,
    batch: Batch,
    /// Sequence number of the batch's first op in the current stream.
    first_seq: u64,
    /// Extents issued so far.
    issued: usize,
    /// Extents not yet completed and checked.
    remaining: usize,
    /// Extents handed to a verify worker.
    offloaded: u64,
    /// Of `remaining`, extents read and waiting only for a worker's verdict.
    awaiting_verdicts: usize,
    /// Per extent: completed already (a backend that completes an op twice is refused).
    completed: Vec<bool>,
    /// Where long ops that are not read straight into the batch are read, for a verify worker
    /// to check and copy into it (`Planner::plan_scratch`); grown as plans need, kept.
    scratch: Option<crate::io::AlignedBuf>,
}

impl BatchSlot {
    /// The address of `len` bytes at `at` in the scratch memory, which holds them.
    fn scratch_range(&self, at: u64, len: usize) -> Result<std::ptr::NonNull<u8>> {
        let scratch =
            self.scratch.as_ref().ok_or_else(|| Error::invalid_input("an op into scratch memory the slot lacks"))?;
        let at = usize::try_from(at).unwrap_or(usize::MAX);
        if at.checked_add(len).is_none_or(|end| end > scratch.len()) || len == 0 {
            return Err(Error::invalid_input(format!(
                "bytes {at}..+{len} are not inside scratch memory of {} bytes",
                scratch.len()
            )));
        }
        // Inside the mapping (checked above): plain address arithmetic, no dereference here.
        std::ptr::NonNull::new(scratch.base_ptr().wrapping_add(at))
            .ok_or_else(|| Error::invalid_input("scratch memory at address 0"))
    }
}

impl BatchSlot {
    fn is_complete(&self) -> bool {
        self.remaining == 0 && self.issued == self.planner.n_extents()
    }
}

impl Reader {
    /// A reader of `dataset` through `io`.
    pub fn new(dataset: Arc<Dataset>, io: Box<dyn Io>) -> Self {
        let files = vec![None; dataset.n_shards()];
        Self {
            inodes: vec![None; dataset.n_shards()],
            opens: 0,
            watcher: Watcher::default(),
            get_batch: Batch::default(),
            dataset,
            io,
            files,
            slots: Vec::new(),
            stats: ReadStats::default(),
            published: None,
            staging: None,
            repair: None,
            tier: None,
            verify_threads: default_verify_threads(),
            verify: None,
            count_shard_reads: true,
        }
    }

    /// Whether this reader counts its reads per shard in the dataset's `shard_reads` (the
    /// metrics' hot shards); on by default.
    pub fn set_count_shard_reads(&mut self, count: bool) {
        self.count_shard_reads = count;
    }

    /// Checks ops of at least 64 KiB on `threads` worker threads (0: on the reading thread),
    /// which also copy the records of those not read straight into the batch; the default is
    /// [`default_verify_threads`]. Takes effect at the next read.
    pub fn set_verify_threads(&mut self, threads: usize) {
        let threads = threads.min(VERIFY_THREADS_MAX);
        if threads != self.verify_threads {
            self.verify = None;
        }
        self.verify_threads = threads;
    }

    /// Serves records from the memory tier where their extents are in it (or about to be, when
    /// the tier's fillers promised them); the rest are read from disk as before.
    pub fn set_tier(&mut self, tier: TierReader) {
        self.tier = Some(tier);
    }

    /// Repairs shards through `hook` when a read finds one damaged or missing, then reads again
    /// what was not delivered yet: the caller sees the same records in the same order, or the
    /// original error when no verified copy can be had.
    pub fn set_repair(&mut self, hook: Arc<dyn ShardSource>) {
        self.repair = Some(hook);
    }

    /// Puts every batch's bytes in leases of `pool` from now on: planning a batch waits for a
    /// free buffer (so a consumer that holds batches slows the reader down instead of making it
    /// allocate), and a batch larger than the pool's buffers is an error.
    pub fn set_staging(&mut self, pool: StagingPool) {
        self.staging = Some(pool);
    }

    /// Copies the counters into `to` after every delivered batch and every repair, so another
    /// thread sees them while a long read runs.
    pub fn publish_stats(&mut self, to: Arc<PublishedStats>) {
        self.published = Some(to);
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }

    /// The backend's name.
    pub fn io_name(&self) -> &'static str {
        self.io.name()
    }

    /// Counters so far.
    pub fn stats(&self) -> ReadStats {
        self.stats
    }

    /// Reads the records `indices` (in that order, repeats allowed) into `batch`. On error the
    /// batch is left empty: no unverified byte is ever visible in it.
    pub fn read_batch(&mut self, indices: &[u64], batch: &mut Batch) -> Result<()> {
        if self.slots.is_empty() {
            self.slots.push(BatchSlot::default());
        }
        std::mem::swap(batch, &mut self.slots[0].batch);
        let mut outcome = self.run(std::iter::once(indices), 1, &mut |_| Ok(()));
        if let Err(RunError::Replaced(_)) = outcome {
            // A file kept open from an earlier read was replaced meanwhile (a repaired shard):
            // the files are open afresh now, so the batch is read again, once.
            outcome = self.run(std::iter::once(indices), 1, &mut |_| Ok(()));
        }
        let outcome = outcome.map_err(RunError::into_error);
        std::mem::swap(batch, &mut self.slots[0].batch);
        if outcome.is_err() {
            batch.clear();
        }
        outcome
    }

    /// Reads a sequence of batches, handing each to `sink` in order as soon as it is complete,
    /// with up to `depth` batches in flight: the next batches are planned and read while earlier
    /// ones are checked, copied and consumed, so the disk never waits between batches. Stops at
    /// the first error; every batch handed to `sink` was fully verified. The sink may take the
    /// batch (`std::mem::take`), its staging lease with it; the reader then starts afresh.
    pub fn read_batches<B: AsRef<[u64]>>(
        &mut self,
        batches: impl IntoIterator<Item = B>,
        depth: usize,
        sink: &mut dyn FnMut(&mut Batch) -> Result<()>,
    ) -> Result<()> {
        let depth = depth.max(1);
        while self.slots.len() < depth {
            self.slots.push(BatchSlot::default());
        }
        self.run(batches.into_iter(), depth, sink).map_err(RunError::into_error)
    }

    /// One read, with the files kept open from earlier reads: those removed or replaced since
    /// are closed first, and during the read as soon as no batch in flight reads them (see
    /// `gone_files`); after a failure every file is closed, and the failure says whether one of
    /// them had been replaced (the caller may read again).
    fn run<B: AsRef<[u64]>>(
        &mut self,
        batches: impl Iterator<Item = B>,
        depth: usize,
        sink: &mut dyn FnMut(&mut Batch) -> Result<()>,
    ) -> std::result::Result<(), RunError> {
        self.close_gone_files().map_err(RunError::Failed)?;
        let outcome = self.run_open(batches, depth, sink);
        match outcome {
            Ok(()) if self.opens <= opens_before_reset() => Ok(()),
            Ok(()) => self.close_files().map_err(RunError::Failed),
            Err(error) => {
                let replaced = !replaced_files(&self.dataset, &self.files, &self.inodes).is_empty();
                self.close_files().map_err(RunError::Failed)?;
                Err(if replaced { RunError::Replaced(error) } else { RunError::Failed(error) })
            }
        }
    }

    /// Closes every open file removed or replaced since it was opened (no op is in flight).
    fn close_gone_files(&mut self) -> Result<()> {
        let mut failure = None;
        for s in gone_files(&mut self.watcher, &self.dataset, &self.files, &self.inodes) {
            self.inodes[s] = None;
            if let Some(id) = self.files[s].take()
                && let Err(e) = self.io.close(id)
            {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    fn close_files(&mut self) -> Result<()> {
        self.opens = 0;
        self.watcher.open_paths.clear();
        self.watcher.pending.clear();
        self.inodes.iter_mut().for_each(|inode| *inode = None);
        if self.files.iter().all(Option::is_none) {
            return Ok(());
        }
        self.files.iter_mut().for_each(|file| *file = None);
        self.io.close_all()
    }

    fn run_open<B: AsRef<[u64]>>(
        &mut self,
        batches: impl Iterator<Item = B>,
        depth: usize,
        sink: &mut dyn FnMut(&mut Batch) -> Result<()>,
    ) -> Result<()> {
        // `Io` is a public trait: a backend is checked, never trusted to be sane.
        let op_blocks_max = self.io.op_bytes_max() / crate::shard::BLOCK_BYTES;
        if op_blocks_max == 0 {
            return Err(Error::invalid_input(format!(
                "backend {} reads at most {} bytes per op, less than one block",
                self.io.name(),
                self.io.op_bytes_max()
            )));
        }
        let mut batches = batches;
        // Batches planned but not delivered when a repairable failure stopped the read: they are
        // read again, first, after the repair.
        let mut replay: std::collections::VecDeque<Vec<u64>> = std::collections::VecDeque::new();
        // A read gives up when repairs stop helping: the shard just repaired fails again before
        // any batch is delivered, or more repairs than shards pass without one. (A missing shard
        // is fetched where a batch is planned, in the pipeline; it comes here only when it could
        // not be had.) However many
        // shards a long read (an epoch on a node that caches) repairs along the way, it goes on.
        let mut repairs = 0;
        let mut delivered = self.stats.records;
        let mut last_repaired: Option<usize> = None;
        loop {
            let replayed_shards: std::collections::HashSet<usize> =
                replay.iter().flatten().filter_map(|&index| self.dataset.locate(index).ok().map(|(s, _)| s)).collect();
            let replays_left = replay.len();
            let mut source = Replay { replay: &mut replay, rest: &mut batches };
            let mut pipeline = Pipeline {
                dataset: &self.dataset,
                files: &mut self.files,
                inodes: &mut self.inodes,
                opens: &mut self.opens,
                watcher: &mut self.watcher,
                slots: &mut self.slots[..depth],
                op_blocks_max,
                batches: &mut source,
                exhausted: false,
                in_order: std::collections::VecDeque::with_capacity(depth),
                free: (0..depth).rev().collect(),
                issued: 0,
                delivered_ops: 0,
                sink: &mut *sink,
                stats: &mut self.stats,
                staging: self.staging.as_ref(),
                published: self.published.as_deref(),
                touched: Vec::new(),
                letting_go: Vec::new(),
                hook: self.repair.as_deref(),
                unplanned: None,
                replayed_shards,
                replays_left,
                tier: self.tier.as_mut(),
                verify: &mut self.verify,
                verify_threads: self.verify_threads,
                count_shard_reads: self.count_shard_reads,
                fetch_failed: false,
            };
            let outcome = self
                .io
                .read_stream(&mut pipeline)
                .and_then(|()| pipeline.finish(&mut crate::io::BackendFiles(&mut *self.io)));
            let error = match outcome {
                Ok(()) => {
                    debug_assert!(pipeline.in_order.is_empty(), "every planned batch was delivered");
                    return Ok(());
                }
                Err(error) => error,
            };
            let mut undelivered: Vec<Vec<u64>> =
                pipeline.in_order.iter().map(|&slot| pipeline.slots[slot].batch.indices().to_vec()).collect();
            undelivered.extend(pipeline.unplanned.take());
            let fetch_failed = pipeline.fetch_failed;
            drop(pipeline);
            // Nothing in flight now: the undelivered batches are read again after the repair.
            if let Some(hook) = &self.repair {
                hook.in_flight(0);
            }
            if error.is_corruption() {
                self.stats.verify_failures += 1;
                self.publish();
            }
            let (Some(hook), Some(shard), false) =
                (self.repair.clone(), self.dataset.shard_of_error(&error), fetch_failed)
            else {
                return Err(error);
            };
            if self.stats.records > delivered {
                delivered = self.stats.records;
                repairs = 0;
                last_repaired = None;
            }
            // A damaged shard that fails again after its repair would fail the same way each time.
            if last_repaired == Some(shard) || repairs >= self.dataset.n_shards() + REPAIRS_WITHOUT_PROGRESS_SLACK {
                return Err(error);
            }
            repairs += 1;
            last_repaired = Some(shard);
            if hook.repair(self.dataset.shard_id(shard), &error).is_err() {
                // The damaged shard's own error is the stronger of the two.
                return Err(error);
            }
            self.stats.shards_repaired += 1;
            self.publish();
            self.close_after_repair(shard, &undelivered)?;
            for indices in undelivered.into_iter().rev() {
                replay.push_front(indices);
            }
        }
    }

    /// After shard `shard` was repaired: its file is a new file under the old name, so it is
    /// reopened; so are files whose shards are gone (cache entries another reader evicted), so
    /// their space frees, unless a batch still to be read (`undelivered`) needs them: those
    /// stay open until it is read. Files still in place stay open, so a batch that needs more
    /// shards than a cache holds at once still makes progress.
    fn close_after_repair(&mut self, shard: usize, undelivered: &[Vec<u64>]) -> Result<()> {
        // The tier's view of the old file goes too (a page cache tier maps shard files).
        if let Some(tier) = &mut self.tier {
            tier.forget_shard(shard, self.dataset.shard_id(shard));
        }
        let needed: std::collections::HashSet<usize> = undelivered
            .iter()
            .flatten()
            .filter_map(|&index| self.dataset.locate(index).ok().map(|(shard, _)| shard))
            .collect();
        for (s, file) in self.files.iter_mut().enumerate() {
            let Some(id) = *file else { continue };
            if s == shard || (!needed.contains(&s) && !self.dataset.shard_path(s).exists()) {
                self.io.close(id)?;
                *file = None;
                self.inodes[s] = None;
            }
        }
        Ok(())
    }

    fn publish(&self) {
        publish(self.published.as_deref(), &self.stats);
    }

    /// The bytes of one record.
    pub fn get(&mut self, index: u64) -> Result<Vec<u8>> {
        // The batch's memory is kept for the next call: a page-aligned mapping per call would
        // cost more than the read.
        let mut batch = std::mem::take(&mut self.get_batch);
        let outcome = self.read_batch(&[index], &mut batch).map(|()| batch.record(0).to_vec());
        self.get_batch = batch;
        outcome
    }
}

/// How a read ended badly: with the files it found, or with one of the files kept open from an
/// earlier read replaced under its name meanwhile (worth reading again, now that it is closed).
enum RunError {
    Failed(Error),
    Replaced(Error),
}

impl RunError {
    fn into_error(self) -> Error {
        match self {
            RunError::Failed(error) | RunError::Replaced(error) => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{DatasetName, VersionSpec};
    use crate::{Dtype, FixedLayout, Granary, IngestOptions, IoConfig, Layout};

    /// A dataset of `n` records of 256 bytes (record `i` all `i`), in shards of about 8 KiB,
    /// in a store under `dir`.
    fn dataset_of(dir: &std::path::Path, n: u8) -> Arc<Dataset> {
        let mut granary = Granary::create(dir.join("store")).expect("a store");
        let name = DatasetName::new("t").expect("a name");
        let layout = Layout::Fixed(FixedLayout::new(Dtype::U8, &[256]).expect("a layout"));
        let options = IngestOptions { shard_bytes_target: 8 << 10, ..IngestOptions::default() };
        let mut ingest = granary.ingest(name, layout, options).expect("ingest");
        for i in 0..n {
            ingest.push(&[i; 256]).expect("push");
        }
        ingest.commit().expect("commit");
        granary.open_dataset(&VersionSpec::parse("t").expect("a spec")).expect("open")
    }

    /// Shards a repair hook fetches, moved aside until then (a cold origin cache).
    #[derive(Debug)]
    struct Cold {
        aside: std::path::PathBuf,
        home: std::path::PathBuf,
        fetches: std::sync::Mutex<Vec<crate::id::ShardId>>,
    }

    impl ShardSource for Cold {
        fn repair(&self, shard: crate::id::ShardId, cause: &Error) -> Result<()> {
            assert!(matches!(cause, Error::MissingShard { .. }), "only missing shards here: {cause}");
            let name = format!("{shard}.shard");
            let found = walk(&self.aside).into_iter().find(|path| path.ends_with(&name)).expect("moved aside");
            let to = self.home.join(found.strip_prefix(&self.aside).expect("under aside"));
            std::fs::rename(&found, &to).map_err(|e| Error::io("rename", &to, e))?;
            self.fetches.lock().expect("lock").push(shard);
            Ok(())
        }
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
        }
        out
    }

    /// A backend that counts the ops the reader issues through it.
    struct Counting {
        inner: Box<dyn Io>,
        ops: Arc<std::sync::atomic::AtomicU64>,
    }

    struct CountingStream<'s> {
        inner: &'s mut dyn crate::io::ReadStream,
        ops: &'s std::sync::atomic::AtomicU64,
    }

    impl crate::io::ReadStream for CountingStream<'_> {
        fn next_op(&mut self, files: &mut dyn crate::io::FileOpener) -> Result<crate::io::Next> {
            let next = self.inner.next_op(files)?;
            if matches!(next, crate::io::Next::Op(_) | crate::io::Next::Into(..)) {
                self.ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(next)
        }
        fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
            self.inner.complete(seq, bytes)
        }
        fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
            self.inner.complete_into(seq, bytes)
        }
        fn idle(&mut self) -> Result<bool> {
            self.inner.idle()
        }
    }

    impl Io for Counting {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
        fn queue_depth(&self) -> usize {
            self.inner.queue_depth()
        }
        fn op_bytes_max(&self) -> usize {
            self.inner.op_bytes_max()
        }
        fn open(&mut self, path: &std::path::Path) -> Result<FileId> {
            self.inner.open(path)
        }
        fn read_stream(&mut self, stream: &mut dyn crate::io::ReadStream) -> Result<()> {
            self.inner.read_stream(&mut CountingStream { inner: stream, ops: &self.ops })
        }
        fn close_all(&mut self) -> Result<()> {
            self.inner.close_all()
        }
        fn close(&mut self, file: FileId) -> Result<()> {
            self.inner.close(file)
        }
    }

    /// A shard the reader lacks is fetched where a batch needing it is planned: the batches in
    /// flight go on and none is read twice (every op issued is one of a delivered batch); each
    /// shard is fetched once.
    #[test]
    fn a_cold_shard_is_fetched_as_its_batch_is_planned_and_the_stream_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dataset = dataset_of(dir.path(), 200);
        let n_shards = dataset.n_shards();
        assert!(n_shards >= 5, "{n_shards} shards");
        let home = dir.path().join("store/shards");
        let aside = dir.path().join("aside");
        std::fs::rename(&home, &aside).expect("move the shards aside");
        for path in walk(&aside) {
            let parent = home.join(path.parent().expect("a dir").strip_prefix(&aside).expect("under"));
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        let cold = Arc::new(Cold { aside, home, fetches: Default::default() });
        let issued = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let io = Counting { inner: IoConfig::default().build().expect("io"), ops: Arc::clone(&issued) };
        let mut reader = Reader::new(Arc::clone(&dataset), Box::new(io));
        reader.set_repair(cold.clone());
        let batches: Vec<Vec<u64>> = (0..200u64).collect::<Vec<_>>().chunks(8).map(<[u64]>::to_vec).collect();
        let mut delivered = Vec::new();
        reader
            .read_batches(&batches, 4, &mut |batch| {
                for (i, &index) in batch.indices().iter().enumerate() {
                    assert_eq!(batch.record(i), &[index as u8; 256][..], "record {index}");
                }
                delivered.push(batch.indices().to_vec());
                Ok(())
            })
            .expect("read through the cold shards");
        assert_eq!(delivered, batches, "every batch once, in order");
        let fetches = cold.fetches.lock().expect("lock").clone();
        assert_eq!(fetches.len(), n_shards, "each shard fetched once: {fetches:?}");
        assert_eq!(reader.stats().shards_repaired, n_shards as u64);
        assert_eq!(issued.load(std::sync::atomic::Ordering::Relaxed), reader.stats().ops, "no op read twice");
    }

    /// Without notifications (no inotify, or a watch refused) the reader stats its open files
    /// once a second: a removed shard's open file serves verified bytes until then, and is let
    /// go after.
    #[test]
    fn without_notifications_removed_files_are_let_go_within_a_second() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dataset = dataset_of(dir.path(), 100);
        let mut reader = Reader::new(Arc::clone(&dataset), IoConfig::default().build().expect("io"));
        reader.watcher.failed = true;
        assert_eq!(reader.get(0).expect("read"), vec![0; 256]);
        std::fs::remove_file(dataset.shard_path(0)).expect("rm");
        assert_eq!(reader.get(0).expect("still open"), vec![0; 256]);
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(matches!(reader.get(0), Err(Error::MissingShard { .. })));
        assert!(reader.watcher.watch.is_none(), "no watch was set");
    }
}
