//! The device stage: each verified batch copied to a device buffer on the loader's CUDA stream.
//!
//! Owns `DeviceStage`. Never: reads or verifies (the reader stage did), or touches the host
//! memory of a batch the trainer holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;

use super::Message;
use super::batch::*;
use crate::error::{Error, Result};
use crate::read::Batch;
use crate::staging::cuda::{Stream, Upload};

/// Copies each verified batch to a device buffer on the loader's stream.
pub(super) struct DeviceStage {
    pub(super) stream: Stream,
    /// Oldest returned first: its consumer's work is the likeliest to be done.
    pub(super) free: std::collections::VecDeque<Returned>,
    pub(super) returned: Receiver<Returned>,
    pub(super) input: Receiver<Message>,
    pub(super) out: SyncSender<Message>,
    pub(super) stop: Arc<AtomicBool>,
}

impl DeviceStage {
    pub(super) fn run(mut self) {
        while let Ok(message) = self.input.recv() {
            let message = match message {
                Message::Batch(mut batch, tag) => match self.upload(&mut batch) {
                    Ok(upload) => Message::Uploaded(batch, upload, tag),
                    Err(error) => Message::Failed(error),
                },
                other => other,
            };
            let failed = matches!(message, Message::Failed(_));
            if self.out.send(message).is_err() || failed {
                return;
            }
        }
    }

    fn upload(&mut self, batch: &mut Batch) -> Result<Upload> {
        self.free.extend(self.returned.try_iter());
        // The trainer holds at most `hold_max` and the queue two, so one comes back, unless the
        // loader is being dropped while the trainer keeps its batches: then stop.
        let free = loop {
            if let Some(free) = self.free.pop_front() {
                break free;
            }
            match self.returned.recv_timeout(Duration::from_millis(10)) {
                Ok(free) => break free,
                Err(RecvTimeoutError::Timeout) if !self.stop.load(Ordering::Acquire) => {}
                Err(_) => return Err(Error::invalid_input("stopped")),
            }
        };
        let lease = batch.take_lease().ok_or_else(|| Error::invalid_input("a batch without a staging buffer"))?;
        // The trainer's kernels that read the buffer's last batch run before the copy into it
        // (and should the upload fail, it waits for them before the buffer goes).
        let buffer = free.after_fences_on(&self.stream)?;
        self.stream.upload(lease, buffer)
    }
}
