//! The memory tier's schedule for a loader: which extents this rank reads at which step, over
//! this epoch and the next, computed on a thread of its own so the first batch never waits for
//! it.
//!
//! Owns: `Scheduler` (the thread and the channel to it) and `tier_schedule` (the computation).
//! Never: loads or evicts extents (the tier's fillers do), or leaves the reader waiting for a
//! schedule that will not come (a failed or panicking computation hands over an empty one).

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;

use super::EpochBatches;
use crate::error::{Error, Result};
use crate::plan::Position;
use crate::read::Dataset;
use crate::tier::{Coordinator, ExtentInfo, ExtentKey, MemoryTier, TierSchedule};

/// Record reads a tier schedule holds at most (8 bytes each): beyond that, later reads of the
/// epoch are unknown to the fillers until the next epoch's schedule.
const SCHEDULE_USES_MAX: usize = 16 << 20;

/// What the tier's schedule is computed from: the step of the epoch's first batch, its batches,
/// and the next epoch's.
pub(super) type ScheduleRequest = (u64, Arc<EpochBatches>, Option<Arc<EpochBatches>>);

/// The tier's schedule thread and the channel to it: dropped, it closes the channel and then
/// joins the thread.
pub(super) struct Scheduler {
    coordinator: Arc<Coordinator>,
    send: Option<Sender<ScheduleRequest>>,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the thread that computes `coordinator`'s schedules over `dataset`.
    pub(super) fn start(dataset: &Arc<Dataset>, coordinator: &Arc<Coordinator>) -> Result<Self> {
        let (send, receive) = std::sync::mpsc::channel::<ScheduleRequest>();
        let (dataset, for_thread) = (Arc::clone(dataset), Arc::clone(coordinator));
        let thread = super::spawn("granary-tier-plan", move || {
            while let Ok((step, batches, next)) = receive.recv() {
                let computed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    tier_schedule(&dataset, for_thread.tier(), step, &batches, next.as_ref().map(|n| n.as_slice()))
                }));
                // On an error (or a bug) the reads go on from disk, where a failing shard is
                // reported; the reader never waits for a schedule that will not come.
                for_thread.set_schedule(computed.ok().and_then(Result::ok).unwrap_or_default());
            }
        })?;
        Ok(Self { coordinator: Arc::clone(coordinator), send: Some(send), thread: Some(thread) })
    }

    /// Asks for the schedule of an epoch; until it comes, the reader waits for it before it
    /// decides between disk and tier.
    pub(super) fn request(&self, request: ScheduleRequest) {
        self.coordinator.expect_schedule();
        if self.send.as_ref().is_none_or(|send| send.send(request).is_err()) {
            // The thread is gone: no schedule will come.
            self.coordinator.set_schedule(TierSchedule::default());
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.send = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// When each extent is read: the batches of this epoch from `step` on, then the next epoch's,
/// up to `SCHEDULE_USES_MAX` record reads. Extents are numbered shard by shard, so a record's
/// extent is found by arithmetic (this runs for every record of two epochs).
pub(super) fn tier_schedule(
    dataset: &Dataset,
    tier: &MemoryTier,
    step: u64,
    batches: &[(Vec<u64>, Position)],
    next_epoch: Option<&[(Vec<u64>, Position)]>,
) -> Result<TierSchedule> {
    let extent_bytes = tier.extent_bytes();
    let extent_blocks = tier.extent_blocks();
    let mut extents = Vec::new();
    let mut first_extent = Vec::with_capacity(dataset.n_shards());
    for shard in 0..dataset.n_shards() {
        first_extent.push(extents.len());
        let meta = dataset.shard_meta(shard)?;
        for extent in 0..tier.n_extents(meta.n_data_blocks()) {
            let first_block = extent * extent_blocks;
            extents.push(ExtentInfo {
                key: ExtentKey {
                    shard: dataset.shard_id(shard),
                    extent: u32::try_from(extent).map_err(|_| Error::invalid_input("a shard of 2^32 extents"))?,
                },
                path: dataset.shard_path(shard),
                meta: Arc::clone(meta),
                first_block,
                n_blocks: extent_blocks.min(meta.n_data_blocks() - first_block),
            });
        }
    }
    let mut schedule = TierSchedule::with_extents(extents);
    let mut uses = 0usize;
    let all = batches.iter().chain(next_epoch.unwrap_or_default());
    for (offset, (records, _)) in all.enumerate() {
        let at = step + offset as u64;
        for &index in records {
            uses += 1;
            if uses > SCHEDULE_USES_MAX {
                return Ok(schedule);
            }
            let (shard, local) = dataset.locate(index)?;
            let range = dataset.shard_meta(shard)?.record_range(local);
            if range.is_empty() {
                continue;
            }
            for extent in range.start / extent_bytes..=(range.end - 1) / extent_bytes {
                schedule.add_use(first_extent[shard] + extent as usize, at);
            }
        }
    }
    Ok(schedule)
}
