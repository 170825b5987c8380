//! Pulling one object from peers: resumable, verified against its id, published only whole.
//!
//! A pull asks the sources in turn (`Get` from an offset), appends what arrives to
//! `incoming/<id>.<kind>.part` and hashes it on a writer thread, so the network thread only
//! receives and decrypts. An interrupted transfer keeps its partial file and the next source
//! resumes it where it stopped, with the prefix re-hashed from disk. When the bytes are complete
//! the file is synced and its BLAKE3 hash compared with the id (a fragment, whose id names its
//! shard, coding and index, is checked whole against its header instead): a match is published
//! (`LocalStore::adopt`, which also checks that the bytes decode as what they claim to be); a
//! mismatch deletes the partial file, demotes the source when it alone sent the bytes, and starts
//! over from the next source. Concurrent pulls of one object share one transfer.
//!
//! Owns: `pull`, each object's partial file `incoming/<id>.<kind>.part` with its writer thread,
//! `Length` (what is known of an object's length before it arrives: a verified manifest's, or a
//! peer's word), and `fetch_into_memory` (an object read into memory, unchecked, for a rebuild that
//! checks it). Never: publishes bytes that did not check out against their id, or runs two
//! transfers of one object at once.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::flight::Flight;
use super::frame::{Frame, ReplyCode, WireKind};
use super::shared::{Pulled, Shared};
use crate::error::{Error, Result, TransportError};
use crate::id::ObjectId;
use crate::shard::{BLOCK_BYTES, FILE_BYTES_MAX};

/// The writer thread starts the disk's writeback each time this many bytes have arrived.
const WRITEBACK_BYTES: u64 = 8 << 20;
/// Bytes handed to the writer thread at a time.
const WRITE_BATCH_BYTES: usize = 1 << 20;
/// Batches queued for the writer at most (backpressure on the network side).
const WRITE_QUEUE_MAX: usize = 4;
/// Passes over the sources before a pull gives up (the second catches sources that failed for
/// a passing reason, such as a restart).
const PASSES_MAX: usize = 2;

/// What is known of an object's length before it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Length {
    bytes: u64,
    /// From a verified manifest: a source that sends more is misbehaving. Otherwise the length
    /// is a peer's word, and only the id decides.
    trusted: bool,
}

impl Length {
    /// `bytes` (0: unknown), trusted or not.
    pub(crate) fn new(bytes: u64, trusted: bool) -> Self {
        Self { bytes, trusted: trusted && bytes > 0 }
    }

    /// The most bytes a source may send.
    fn max(self) -> u64 {
        if self.trusted { self.bytes } else { FILE_BYTES_MAX }
    }
}

/// A transfer slower than this, once it has run for `SLOW_AFTER`, is given up on that source
/// (a peer that trickles bytes must not hold a pull slot for ever).
const BYTES_PER_SECOND_MIN: u64 = 1 << 20;
const SLOW_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// Pulls object `id` (of `length`) from `sources` (tried first, in order) and then from any
/// other up peer that lists it; returns once a verified copy is published here.
pub(crate) async fn pull(
    shared: &Arc<Shared>,
    kind: WireKind,
    id: ObjectId,
    length: Length,
    sources: &[u32],
) -> Result<Pulled> {
    if shared.local.holds(kind, id).is_some() {
        return Ok(Pulled::AlreadyHeld);
    }
    // One transfer per object: a second pull waits for the first one's outcome.
    let work = async {
        let _slot = shared.pull_slots.acquire().await.expect("the pull semaphore is never closed");
        run(shared, kind, id, length, sources).await
    };
    match shared.pulls.run((kind, id), work).await {
        Flight::Led(outcome) => outcome,
        Flight::Joined(outcome) => outcome.map(|_| Pulled::Joined).map_err(|detail| unavailable(id, detail)),
    }
}

fn unavailable(id: ObjectId, detail: String) -> Error {
    Error::Unavailable { what: format!("object {id}"), detail }
}

/// Why one source did not deliver.
enum SourceFailure {
    /// It does not have the object, or its copy is damaged: try another.
    Refused(String),
    /// The connection failed (a crash, a partition): the bytes so far are kept for the next.
    Interrupted(String),
    /// It sent bytes that are not the object's: it is demoted.
    Misbehaved(String),
    /// This node failed (its disk): the pull stops, nobody is blamed.
    Local(Error),
}

async fn run(shared: &Arc<Shared>, kind: WireKind, id: ObjectId, length: Length, sources: &[u32]) -> Result<Pulled> {
    if shared.local.holds(kind, id).is_some() {
        return Ok(Pulled::AlreadyHeld);
    }
    if shared.peers.sources_for(kind, id, sources).is_empty() {
        return Err(unavailable(id, "no peer that is up lists it".to_owned()));
    }
    let bytes_max = length.max();
    let path = shared.local.incoming_path(kind, id);
    let mut writer = Writer::open(path.clone()).await?;
    // Bytes already on disk came from an earlier attempt (perhaps of an earlier life of this
    // node): nobody can be blamed for them if the whole turns out wrong.
    let mut anonymous_prefix = writer.len > 0;
    let mut contributors: BTreeSet<u32> = BTreeSet::new();
    let mut failures: Vec<String> = Vec::new();
    let mut received = 0u64;
    for pass in 0..PASSES_MAX {
        let candidates = shared.peers.sources_for(kind, id, sources);
        if candidates.is_empty() && pass == 0 {
            failures.push("no peer that is up lists it".to_owned());
        }
        for source in candidates {
            let Some(addr) = shared.peers.addr_of(source) else { continue };
            let start = writer.len;
            if start > 0 {
                shared.event(format!("resuming the transfer of {} at byte {start} from node {source}", id.short(12)));
            }
            let attempt = fetch_from(shared, addr, kind, id, bytes_max, &mut writer).await;
            received += writer.len.saturating_sub(start);
            shared
                .stats
                .bytes_received
                .fetch_add(writer.len.saturating_sub(start), std::sync::atomic::Ordering::Relaxed);
            shared.peers.count_bytes(source, 0, writer.len.saturating_sub(start));
            if writer.len > start {
                contributors.insert(source);
            }
            match attempt {
                Ok(()) => {}
                Err(SourceFailure::Refused(why)) | Err(SourceFailure::Interrupted(why)) => {
                    shared.event(format!(
                        "transfer of {} from node {source} stopped at byte {}: {why}",
                        id.short(12),
                        writer.len
                    ));
                    failures.push(format!("node {source}: {why}"));
                    continue;
                }
                Err(SourceFailure::Local(e)) => return Err(e),
                Err(SourceFailure::Misbehaved(why)) => {
                    shared.demote(source, &format!("sent a bad transfer of {id}: {why}"));
                    failures.push(format!("node {source} (demoted): {why}"));
                    writer.reset().await?;
                    contributors.clear();
                    anonymous_prefix = false;
                    continue;
                }
            }
            // Every byte is here: verify, then publish. A shard or manifest hashes to its id; a
            // fragment's id names its shard, coding and index, which its header must name, with
            // every block's CRC32C right (`check_fragment_file`).
            let digest = writer.finish().await?;
            let wrong = match kind {
                WireKind::Shard | WireKind::Manifest => {
                    (digest != id).then(|| format!("the bytes hash to {digest}, not to the id"))
                }
                WireKind::Fragment => {
                    let file = path.clone();
                    match tokio::task::spawn_blocking(move || crate::engine::check_fragment_file(id, &file))
                        .await
                        .map_err(|e| Error::invalid_input(format!("checking {id} failed: {e}")))?
                    {
                        Ok(_) => None,
                        Err(e) if e.is_corruption() => Some(e.to_string()),
                        Err(e) => return Err(e),
                    }
                }
            };
            if wrong.is_none() {
                let file = path.clone();
                let local = Arc::clone(shared);
                tokio::task::spawn_blocking(move || local.local.adopt(kind, id, &file))
                    .await
                    .map_err(|e| Error::invalid_input(format!("publishing {id} failed: {e}")))??;
                shared.stats.objects_received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Ok(Pulled::Published { bytes: received });
            }
            shared.stats.verify_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let why = wrong.unwrap_or_default();
            if contributors.len() == 1 && !anonymous_prefix {
                shared.demote(source, &format!("sent wrong bytes for {id}"));
                failures.push(format!("node {source} (demoted): {why}"));
            } else {
                failures.push(format!("nodes {contributors:?} together: {why}; starting over"));
            }
            writer.reset().await?;
            contributors.clear();
            anonymous_prefix = false;
        }
    }
    Err(unavailable(id, failures.join("; ")))
}

/// Asks `addr` for the rest of the object and appends it to `writer`, through `End`.
async fn fetch_from(
    shared: &Arc<Shared>,
    addr: std::net::SocketAddr,
    kind: WireKind,
    id: ObjectId,
    bytes_max: u64,
    writer: &mut Writer,
) -> std::result::Result<(), SourceFailure> {
    let interrupted = |e: TransportError| SourceFailure::Interrupted(e.to_string());
    let (mut channel, _) = shared.connect(addr).await.map_err(interrupted)?;
    let transfer = shared.next_request_id();
    channel.send(&Frame::Get { transfer, kind, id, offset: writer.len }).await.map_err(interrupted)?;
    let mut expected = writer.len;
    let started = std::time::Instant::now();
    let start = writer.len;
    loop {
        let elapsed = started.elapsed();
        if elapsed > SLOW_AFTER && (expected - start) < BYTES_PER_SECOND_MIN * elapsed.as_secs() {
            return Err(SourceFailure::Interrupted(format!(
                "{} bytes in {} s: slower than {BYTES_PER_SECOND_MIN} bytes per second",
                expected - start,
                elapsed.as_secs()
            )));
        }
        let frame = channel.recv().await.map_err(|e| match e {
            // A frame that fails to decrypt or decode came from a peer that holds the key.
            TransportError::Frame(_) | TransportError::Sequence { .. } | TransportError::Epoch { .. } => {
                SourceFailure::Misbehaved(e.to_string())
            }
            other => interrupted(other),
        })?;
        match frame {
            Frame::Chunk { transfer: t, offset, data } if t == transfer => {
                if offset != expected {
                    return Err(SourceFailure::Misbehaved(format!("a chunk at {offset}, {expected} expected")));
                }
                let end = offset + data.len() as u64;
                if end > bytes_max {
                    return Err(SourceFailure::Misbehaved(format!("{end} bytes, more than the {bytes_max} expected")));
                }
                writer.append(data).await.map_err(SourceFailure::Local)?;
                expected = end;
                // The partial file is the transfer's bytes in order: resumed at its length.
                debug_assert_eq!(writer.len, expected, "the partial file holds every chunk once");
            }
            Frame::End { transfer: t, total_bytes } if t == transfer => {
                if total_bytes != expected {
                    return Err(SourceFailure::Misbehaved(format!(
                        "ended at {total_bytes} bytes after sending {expected}"
                    )));
                }
                writer.flush().await.map_err(SourceFailure::Local)?;
                return Ok(());
            }
            Frame::Reply { request, code, message } if request == transfer => {
                writer.flush().await.map_err(SourceFailure::Local)?;
                return Err(match code {
                    ReplyCode::NotFound | ReplyCode::Corrupt | ReplyCode::Unavailable | ReplyCode::Internal => {
                        SourceFailure::Refused(format!("{code}: {message}"))
                    }
                    _ => SourceFailure::Misbehaved(format!("answered {code}: {message}")),
                });
            }
            other => {
                return Err(SourceFailure::Misbehaved(format!("sent {:?} during transfer {transfer}", other.kind())));
            }
        }
    }
}

/// The partial file, written and hashed on a blocking thread.
struct Writer {
    path: PathBuf,
    /// Bytes written (or queued) so far.
    len: u64,
    batch: Vec<u8>,
    tx: mpsc::Sender<WriterMsg>,
    spare: mpsc::Receiver<Vec<u8>>,
}

enum WriterMsg {
    Data(Vec<u8>),
    /// Wait until everything before is written; answer with the length on disk.
    Flush(oneshot::Sender<Result<u64>>),
    /// Sync and answer with the hash of everything written.
    Finish(oneshot::Sender<Result<ObjectId>>),
    /// Truncate to nothing and start hashing afresh.
    Reset(oneshot::Sender<Result<()>>),
}

impl Writer {
    /// Opens (or resumes) the partial file at `path`: a prefix already there is cut to whole
    /// blocks (an offset every source accepts) and re-hashed.
    async fn open(path: PathBuf) -> Result<Writer> {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE_MAX);
        let (spare_tx, spare) = mpsc::channel(WRITE_QUEUE_MAX + 1);
        let (ready_tx, ready_rx) = oneshot::channel();
        let thread_path = path.clone();
        tokio::task::spawn_blocking(move || writer_thread(&thread_path, rx, spare_tx, ready_tx));
        let len = ready_rx.await.map_err(|_| Error::invalid_input("the transfer's writer thread died"))??;
        debug_assert!(len.is_multiple_of(BLOCK_BYTES as u64), "a resumed transfer starts on a block: {len}");
        Ok(Writer { path, len, batch: Vec::with_capacity(WRITE_BATCH_BYTES), tx, spare })
    }

    async fn append(&mut self, data: &[u8]) -> Result<()> {
        self.batch.extend_from_slice(data);
        self.len += data.len() as u64;
        if self.batch.len() >= WRITE_BATCH_BYTES {
            let next = self.spare.try_recv().unwrap_or_else(|_| Vec::with_capacity(WRITE_BATCH_BYTES));
            let full = std::mem::replace(&mut self.batch, next);
            self.send(WriterMsg::Data(full)).await?;
        }
        Ok(())
    }

    async fn send(&mut self, msg: WriterMsg) -> Result<()> {
        self.tx.send(msg).await.map_err(|_| Error::invalid_input(format!("the writer of {} died", self.path.display())))
    }

    /// Writes out the batch and waits for the thread; the length is then what is on disk.
    async fn flush(&mut self) -> Result<()> {
        if !self.batch.is_empty() {
            let full = std::mem::take(&mut self.batch);
            self.send(WriterMsg::Data(full)).await?;
        }
        let (tx, rx) = oneshot::channel();
        self.send(WriterMsg::Flush(tx)).await?;
        let on_disk = rx.await.map_err(|_| Error::invalid_input("the transfer's writer thread died"))??;
        debug_assert_eq!(on_disk, self.len, "every byte queued is on disk after a flush");
        self.len = on_disk;
        Ok(())
    }

    async fn finish(&mut self) -> Result<ObjectId> {
        self.flush().await?;
        let (tx, rx) = oneshot::channel();
        self.send(WriterMsg::Finish(tx)).await?;
        rx.await.map_err(|_| Error::invalid_input("the transfer's writer thread died"))?
    }

    async fn reset(&mut self) -> Result<()> {
        self.batch.clear();
        let (tx, rx) = oneshot::channel();
        self.send(WriterMsg::Reset(tx)).await?;
        rx.await.map_err(|_| Error::invalid_input("the transfer's writer thread died"))??;
        self.len = 0;
        Ok(())
    }
}

fn writer_thread(
    path: &Path,
    mut rx: mpsc::Receiver<WriterMsg>,
    spare: mpsc::Sender<Vec<u8>>,
    ready: oneshot::Sender<Result<u64>>,
) {
    let opened = open_partial(path);
    let (mut file, mut hasher, mut len) = match opened {
        Ok(state) => state,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(len));
    // The first write error is kept and reported at the next flush or finish.
    let mut failed: Option<Error> = None;
    // Bytes before this offset have been handed to the kernel's writeback.
    let mut written_back = len;
    while let Some(msg) = rx.blocking_recv() {
        match msg {
            WriterMsg::Data(mut data) => {
                if failed.is_none() {
                    match file.write_all(&data) {
                        Ok(()) => {
                            hasher.update(&data);
                            len += data.len() as u64;
                        }
                        Err(e) => failed = Some(Error::io("write", path, e)),
                    }
                }
                if failed.is_none() && len - written_back >= WRITEBACK_BYTES {
                    // The disk writes while the network delivers the rest; the fsync at the end
                    // then has little left. Only a hint: a failure here changes nothing.
                    let _ = crate::io::start_writeback(&file, written_back, len - written_back);
                    written_back = len;
                }
                data.clear();
                let _ = spare.try_send(data);
            }
            WriterMsg::Flush(answer) => {
                let _ = answer.send(match failed.take() {
                    Some(e) => Err(e),
                    None => Ok(len),
                });
            }
            WriterMsg::Finish(answer) => {
                let synced = match failed.take() {
                    Some(e) => Err(e),
                    None => file.sync_all().map_err(|e| Error::io("fsync", path, e)),
                };
                let _ = answer.send(synced.map(|()| ObjectId::from_hash(hasher.finalize())));
            }
            WriterMsg::Reset(answer) => {
                let reset = file
                    .set_len(0)
                    .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
                    .map_err(|e| Error::io("truncate", path, e));
                hasher = blake3::Hasher::new();
                len = 0;
                written_back = 0;
                failed = None;
                let _ = answer.send(reset);
            }
        }
    }
}

/// Opens the partial file, cuts it to whole blocks and hashes what remains.
fn open_partial(path: &Path) -> Result<(File, blake3::Hasher, u64)> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::io("open", path, e))?;
    let on_disk = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    let len = on_disk - on_disk % BLOCK_BYTES as u64;
    file.set_len(len).map_err(|e| Error::io("truncate", path, e))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; WRITE_BATCH_BYTES];
    let mut left = len;
    file.seek(SeekFrom::Start(0)).map_err(|e| Error::io("seek", path, e))?;
    while left > 0 {
        let n = (left as usize).min(buf.len());
        file.read_exact(&mut buf[..n]).map_err(|e| Error::io("read", path, e))?;
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    file.seek(SeekFrom::Start(len)).map_err(|e| Error::io("seek", path, e))?;
    Ok((file, hasher, len))
}

/// Reads object `id` (exactly `bytes` long) from the peer at `addr` into memory, unchecked: the
/// caller checks it before any use (a fragment gathered for a rebuild is checked whole). For
/// objects a node does not keep (fragments read to rebuild a shard); `Err` says why, for the
/// caller to try another holder.
pub(super) async fn fetch_into_memory(
    shared: &Arc<Shared>,
    addr: std::net::SocketAddr,
    kind: WireKind,
    id: ObjectId,
    bytes: u64,
) -> std::result::Result<Vec<u8>, String> {
    let (mut channel, _) = shared.connect(addr).await.map_err(|e| e.to_string())?;
    let transfer = shared.next_request_id();
    channel.send(&Frame::Get { transfer, kind, id, offset: 0 }).await.map_err(|e| e.to_string())?;
    let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit in memory"))?;
    let mut out = Vec::with_capacity(len);
    let started = std::time::Instant::now();
    loop {
        let elapsed = started.elapsed();
        if elapsed > SLOW_AFTER && (out.len() as u64) < BYTES_PER_SECOND_MIN * elapsed.as_secs() {
            return Err(format!("{} bytes in {} s: too slow", out.len(), elapsed.as_secs()));
        }
        match channel.recv().await.map_err(|e| e.to_string())? {
            Frame::Chunk { transfer: t, offset, data } if t == transfer => {
                if offset != out.len() as u64 || out.len() + data.len() > len {
                    return Err(format!("a chunk of {} bytes at {offset} of {bytes}", data.len()));
                }
                out.extend_from_slice(data);
                shared.stats.bytes_received.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            Frame::End { transfer: t, total_bytes } if t == transfer => {
                if total_bytes != bytes || out.len() != len {
                    return Err(format!("ended at {total_bytes} bytes, {bytes} expected"));
                }
                return Ok(out);
            }
            Frame::Reply { request, code, message } if request == transfer => return Err(format!("{code}: {message}")),
            other => return Err(format!("sent {:?} during transfer {transfer}", other.kind())),
        }
    }
}
