//! The loader's start, stage by stage: when each step on the way to the first batch ended,
//! counted from the moment `Loader::new` was called (issue 44: a trainer meets the start at every
//! launch, restart and evaluation pass, so where its time goes is reported, not guessed).
//!
//! Owns: `StartClock` (the marks, shared by the trainer's thread, the reader's and a lazily built
//! disk backend) and `StartStage` (what each mark means).
//! Never: waits, or moves a mark (the first mark of a stage stands; later epochs do not count),
//! or takes a lock for a stage already marked (the reader and `next` mark at every batch).

use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A step on the way to the first batch, in the order a loader usually passes them (the disk
/// backend may be built later, at the first record not served from memory, or never).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StartStage {
    /// The memory tier opened (or found off).
    TierOpened,
    /// The staging buffers allocated (pinned ones for a GPU).
    StagingReady,
    /// The disk backend (io_uring, or the one asked for) set up.
    IoReady,
    /// `Loader::new` returned: its threads started.
    Built,
    /// The reader's planner built (a partitioner plugin compiled, when one plans).
    PlannerReady,
    /// The first epoch's plan made.
    EpochPlanned,
    /// The next epoch's plan made (the tier's schedule and an origin cache's plan need it).
    NextEpochPlanned,
    /// The first batch read, verified and queued.
    FirstBatchRead,
    /// The first batch handed to the trainer (after its copy to the device, when it has one).
    FirstBatchTaken,
}

impl StartStage {
    /// Every stage, in order.
    pub const ALL: [StartStage; 9] = [
        Self::TierOpened,
        Self::StagingReady,
        Self::IoReady,
        Self::Built,
        Self::PlannerReady,
        Self::EpochPlanned,
        Self::NextEpochPlanned,
        Self::FirstBatchRead,
        Self::FirstBatchTaken,
    ];

    /// The stage's name in reports (`bench loader`, Python's `metrics()["start"]`).
    pub fn name(self) -> &'static str {
        match self {
            Self::TierOpened => "tier_opened",
            Self::StagingReady => "staging_ready",
            Self::IoReady => "io_ready",
            Self::Built => "built",
            Self::PlannerReady => "planner_ready",
            Self::EpochPlanned => "epoch_planned",
            Self::NextEpochPlanned => "next_epoch_planned",
            Self::FirstBatchRead => "first_batch_read",
            Self::FirstBatchTaken => "first_batch_taken",
        }
    }
}

/// When each stage of a loader's start ended, from its origin.
#[derive(Debug)]
pub struct StartClock {
    origin: Instant,
    /// One bit per stage (`StartStage as u16`) marked so far: a later mark costs one load.
    marked: AtomicU16,
    marks: Mutex<Vec<(StartStage, Duration)>>,
}

impl StartClock {
    /// A clock counting from now.
    pub fn new() -> Self {
        Self { origin: Instant::now(), marked: AtomicU16::new(0), marks: Mutex::new(Vec::new()) }
    }

    /// Marks `stage` as ended now, unless it was marked before.
    pub fn mark(&self, stage: StartStage) {
        let bit = 1u16 << stage as u16;
        if self.marked.load(Ordering::Relaxed) & bit != 0 {
            return;
        }
        let at = self.origin.elapsed();
        // The first of two threads marking at once wins, as the lock orders them.
        let mut marks = self.marks.lock();
        if self.marked.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            marks.push((stage, at));
        }
    }

    /// The stages marked so far, each with the time from the origin to its end, in the order
    /// they ended.
    pub fn marks(&self) -> Vec<(StartStage, Duration)> {
        let mut marks = self.marks.lock().clone();
        marks.sort_by_key(|&(_, at)| at);
        marks
    }
}

impl Default for StartClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_mark_of_a_stage_stands_and_marks_come_in_order() {
        let clock = StartClock::new();
        clock.mark(StartStage::Built);
        std::thread::sleep(Duration::from_millis(2));
        clock.mark(StartStage::FirstBatchRead);
        clock.mark(StartStage::Built);
        let marks = clock.marks();
        assert_eq!(marks.iter().map(|&(s, _)| s).collect::<Vec<_>>(), [StartStage::Built, StartStage::FirstBatchRead]);
        assert!(marks[1].1 >= marks[0].1 + Duration::from_millis(2), "{marks:?}");
    }
}
