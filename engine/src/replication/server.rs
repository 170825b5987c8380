//! The node's server: accepts connections, authenticates them, and answers requests one at a
//! time per connection.
//!
//! Objects go out verified: a manifest is hashed against its id before a byte of it is sent; a
//! shard's metadata is decoded (every metadata CRC checked) and each data block is CRC-checked by
//! a reader thread as it is read, so a node never passes on bytes its own disk corrupted: it
//! answers `Corrupt`, quarantines its copy and lets the reconciler fetch a good one. Bounds: at
//! most `CONNECTIONS_MAX` connections are served at once (more are closed at once), and the
//! reader thread is at most `READ_AHEAD_MAX` pieces ahead of the network.
//!
//! Owns: `listen` (the accept loop, until shutdown), each connection's handshake, slot and
//! incarnation check, the answer to each request, a peer's ref and goal adopted (`PutRef`), and
//! sending an object checked as it is read (`send_object`, with its reader thread). Never: lets a
//! client (a command line tool, a reader) make the node pull an object or adopt a ref (only a node
//! may send `Fetch` and `PutRef`), or answers two requests of one connection at once.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use super::frame::{
    CHUNK_BYTES_MAX, Frame, Goal, INVENTORY_ENTRIES_MAX, Kind, ReplicateMode, ReplyCode, Role, WireKind,
};
use super::secure::Channel;
use super::shared::{Shared, reply_code_of};
use crate::erasure::FragmentFile;
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::shard::{BLOCK_BYTES, BLOCK_BYTES_U64, DATA_OFFSET, ShardMeta};
use crate::store::{DatasetName, RefLog};

/// Authenticated connections served at once: every peer keeps one for its heartbeat (up to
/// 256 peers), and transfers, fetch requests and clients use the rest. An idle connection
/// holds about 200 KiB of buffers.
pub(crate) const CONNECTIONS_MAX: usize = super::frame::MEMBERS_MAX + 64;
/// Bytes the reader thread reads and checks at a time.
const PIECE_BYTES: usize = 1 << 20;
/// Pieces the reader thread may be ahead of the network.
const READ_AHEAD_MAX: usize = 4;

/// Accepts connections until `shutdown` turns true.
pub(crate) async fn listen(shared: Arc<Shared>, listener: TcpListener, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    let Some(handshake) = shared.begin_handshake(addr.ip()) else {
                        shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                        shared.stats.connections_busy.fetch_add(1, Ordering::Relaxed);
                        super::secure::refuse_busy(&stream);
                        continue;
                    };
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        serve_connection(&shared, stream, addr, handshake).await;
                    });
                }
                Err(e) => {
                    shared.event(format!("accept failed: {e}"));
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => return,
        }
    }
}

/// A request, owned (the frame it came in borrows the channel's buffer).
enum Request {
    Ping(u64),
    Inventory(Option<(WireKind, ObjectId)>),
    Get { transfer: u32, kind: WireKind, id: ObjectId, offset: u64 },
    Fetch { request: u32, kind: WireKind, id: ObjectId, bytes: u64, sources: Vec<u32> },
    PutRef { request: u32, goal: Goal, name: String, log: Vec<u8> },
    Replicate { request: u32, goal: Goal, mode: ReplicateMode, spec: String },
    Status { request: u32 },
    Repair { request: u32, id: ObjectId },
    Members { request: u32 },
    Heat { request: u32 },
    Accessed { request: u32, entries: Vec<(ObjectId, u64)> },
    Unexpected(Kind),
}

fn to_request(frame: Frame<'_>) -> Request {
    match frame {
        Frame::Ping(nonce) => Request::Ping(nonce),
        Frame::InventoryRequest { after } => Request::Inventory(after),
        Frame::Get { transfer, kind, id, offset } => Request::Get { transfer, kind, id, offset },
        Frame::Fetch { request, kind, id, bytes, sources } => Request::Fetch { request, kind, id, bytes, sources },
        Frame::PutRef { request, goal, name, log } => {
            Request::PutRef { request, goal, name: name.to_owned(), log: log.to_vec() }
        }
        Frame::Replicate { request, goal, mode, spec } => {
            Request::Replicate { request, goal, mode, spec: spec.to_owned() }
        }
        Frame::StatusRequest { request } => Request::Status { request },
        Frame::Repair { request, id } => Request::Repair { request, id },
        Frame::MembersRequest { request } => Request::Members { request },
        Frame::HeatRequest { request } => Request::Heat { request },
        Frame::Accessed { request, entries } => Request::Accessed { request, entries },
        other => Request::Unexpected(other.kind()),
    }
}

async fn serve_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    addr: std::net::SocketAddr,
    handshake: super::admission::HandshakeSlot,
) {
    let evicted = handshake.evicted();
    let accepted = Channel::accept(stream, &shared.config.key, &shared.hello, shared.config.deadlines, evicted, || {
        handshake.authenticated();
    })
    .await;
    drop(handshake);
    let (mut channel, peer) = match accepted {
        Ok(accepted) => accepted,
        Err(e) => {
            shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            // Connections that never sent a first message are counted, not logged one by one:
            // under a flood of them the log would be the flood.
            if !matches!(e, TransportError::Busy | TransportError::Timeout { what: "the first handshake message", .. })
            {
                shared.event(format!("refused a connection from {addr}: {e}"));
            }
            return;
        }
    };
    let Ok(_slot) = Arc::clone(&shared.connection_slots).try_acquire_owned() else {
        shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
        let message = format!("{CONNECTIONS_MAX} connections already served");
        let _ = channel.send(&Frame::Reply { request: 0, code: ReplyCode::Refused, message: &message }).await;
        return;
    };
    if peer.role == Role::Peer
        && let Err(why) = shared.check_incarnation(peer.node_id, peer.epoch, &peer.listen, addr)
    {
        shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
        shared.event(format!("refused node {} at {addr}: {why}", peer.node_id));
        let _ = channel.send(&Frame::Reply { request: 0, code: ReplyCode::Refused, message: &why }).await;
        return;
    }
    loop {
        let request = match channel.recv_within(shared.config.idle).await {
            // A client (a command line tool, a reader) asks; only a node makes this node pull
            // objects or adopt refs.
            Ok(frame) if peer.role == Role::Client && matches!(frame.kind(), Kind::Fetch | Kind::PutRef) => {
                Request::Unexpected(frame.kind())
            }
            Ok(frame) => to_request(frame),
            Err(TransportError::Closed) => return,
            Err(TransportError::Timeout { .. }) => return,
            Err(e) => {
                shared.stats.frames_rejected.fetch_add(1, Ordering::Relaxed);
                shared.event(format!("dropped the connection of node {} ({addr}): {e}", peer.node_id));
                return;
            }
        };
        if let Err(e) = answer(shared, &mut channel, request, peer.node_id).await {
            if !matches!(e, TransportError::Closed) {
                shared.event(format!("connection of node {} ({addr}) ended: {e}", peer.node_id));
            }
            return;
        }
    }
}

async fn reply(channel: &mut Channel, request: u32, code: ReplyCode, message: &str) -> Result<(), TransportError> {
    channel.send(&Frame::Reply { request, code, message }).await
}

async fn answer(
    shared: &Arc<Shared>,
    channel: &mut Channel,
    request: Request,
    from: u32,
) -> Result<(), TransportError> {
    match request {
        Request::Ping(nonce) => channel.send(&Frame::Pong { nonce, generation: shared.local.generation() }).await,
        Request::Inventory(after) => {
            let (entries, more) = shared.local.page(after, INVENTORY_ENTRIES_MAX);
            channel.send(&Frame::Inventory { entries, more }).await
        }
        Request::Get { transfer, kind, id, offset } => {
            send_object(shared, channel, transfer, kind, id, offset, from).await
        }
        Request::Fetch { request, kind, id, bytes, sources } => {
            let outcome = shared.fetch_here(kind, id, bytes, &sources).await;
            match outcome {
                Ok(()) => reply(channel, request, ReplyCode::Ok, "").await,
                Err(e) => reply(channel, request, reply_code_of(&e), &e.to_string()).await,
            }
        }
        Request::PutRef { request, goal, name, log } => {
            let outcome = put_ref(shared, goal, &name, &log).await;
            match outcome {
                Ok(message) => reply(channel, request, ReplyCode::Ok, &message).await,
                Err(e) => reply(channel, request, reply_code_of(&e), &e.to_string()).await,
            }
        }
        Request::Replicate { request, goal, mode, spec } => {
            let (tx, mut rx) = mpsc::channel::<(u64, u64)>(16);
            let node = Arc::clone(shared);
            let work = tokio::spawn(async move { node.replicate(&spec, goal, mode, Some(tx)).await });
            while let Some((done, total)) = rx.recv().await {
                channel
                    .send(&Frame::Progress { request, done, total, last: false, code: ReplyCode::Ok, message: "" })
                    .await?;
            }
            let outcome =
                work.await.unwrap_or_else(|e| Err(Error::invalid_input(format!("replication task failed: {e}"))));
            let (code, message, done, total) = match &outcome {
                Ok(report) => (ReplyCode::Ok, report.to_string(), report.shards_done, report.shards),
                Err(e) => (reply_code_of(e), e.to_string(), 0, 0),
            };
            channel.send(&Frame::Progress { request, done, total, last: true, code, message: &message }).await
        }
        Request::Status { request } => {
            let text = shared.status().to_json();
            channel.send(&Frame::Status { request, text: &text }).await
        }
        Request::Repair { request, id } => {
            // A fragment of this node's that a peer found damaged, or a reader's shard.
            let outcome = if shared.local.holds(WireKind::Fragment, id).is_some() {
                shared.check_fragment(id).await
            } else if shared.local.holds(WireKind::Shard, id).is_none() && shared.manifest_bytes(ShardId(id)).is_none()
            {
                // A fragment dropped or quarantined since, or nothing this node knows.
                Err(Error::NotFound { what: format!("a shard or fragment {id} on node {}", shared.hello.node_id) })
            } else {
                shared.repair_shard(ShardId(id)).await
            };
            match outcome {
                Ok(message) => reply(channel, request, ReplyCode::Ok, &message).await,
                Err(e) => reply(channel, request, reply_code_of(&e), &e.to_string()).await,
            }
        }
        Request::Members { request } => {
            let members = shared.rendezvous_members();
            let members: Vec<(u32, &str)> = members.iter().map(|(id, addr)| (*id, addr.as_str())).collect();
            channel.send(&Frame::Members { request, members }).await
        }
        Request::Heat { request } => {
            let (free_bytes, entries) = shared.heat_report();
            channel.send(&Frame::Heat { request, free_bytes, entries }).await
        }
        Request::Accessed { request, entries } => {
            shared.count_reads(&entries);
            reply(channel, request, ReplyCode::Ok, "").await
        }
        Request::Unexpected(kind) => {
            shared.stats.frames_rejected.fetch_add(1, Ordering::Relaxed);
            reply(channel, 0, ReplyCode::Invalid, &format!("a node does not take {kind:?} frames")).await?;
            Err(TransportError::Protocol { detail: format!("unexpected {kind:?}") })
        }
    }
}

/// Adopts a peer's ref (when newer) and its replication goal.
async fn put_ref(shared: &Arc<Shared>, goal: Goal, name: &str, log: &[u8]) -> Result<String> {
    let name = DatasetName::new(name)?;
    let log =
        RefLog::decode(log).map_err(|source| Error::Format { path: PathBuf::from(format!("ref {name}")), source })?;
    for version in log.versions() {
        if shared.local.holds(WireKind::Manifest, version.manifest.0).is_none() {
            return Err(Error::NotFound {
                what: format!("manifest {} of {name}@{} (fetch it before the ref)", version.manifest, version.number),
            });
        }
    }
    let node = Arc::clone(shared);
    let adopted = {
        let name = name.clone();
        tokio::task::spawn_blocking(move || -> Result<bool> {
            let adopted = node.local.adopt_ref(&name, &log)?;
            node.local.set_goal(&name, goal)?;
            Ok(adopted)
        })
        .await
        .map_err(|e| Error::invalid_input(format!("adopting a ref failed: {e}")))??
    };
    shared.wake.notify_one();
    Ok(if adopted { format!("adopted {name}") } else { format!("kept the local ref of {name}") })
}

/// One piece read by the reader thread: `bytes` of the object from `offset`.
struct Piece {
    offset: u64,
    bytes: Vec<u8>,
}

/// Sends object `id` from `offset` to its end as chunks, then `End`; or a `Reply` with the
/// reason it cannot.
async fn send_object(
    shared: &Arc<Shared>,
    channel: &mut Channel,
    transfer: u32,
    kind: WireKind,
    id: ObjectId,
    offset: u64,
    to: u32,
) -> Result<(), TransportError> {
    let path = shared.local.object_path(kind, id);
    let (tx, mut rx) = mpsc::channel::<Result<Piece>>(READ_AHEAD_MAX);
    let (spare_tx, spare_rx) = mpsc::channel::<Vec<u8>>(READ_AHEAD_MAX + 1);
    let reader_path = path.clone();
    // A fragment this node encoded for a peer to pull is served from memory (`coded/place.rs`).
    let outgoing = if kind == WireKind::Fragment { shared.outgoing.lock().get(&id).cloned() } else { None };
    let reader = tokio::task::spawn_blocking(move || match outgoing {
        Some(file) => send_outgoing(id, &file, offset, &tx),
        None => read_verified(kind, id, &reader_path, offset, &tx, spare_rx),
    });
    let faults = shared.config.faults;
    let mut sent = offset;
    let mut failure: Option<Error> = None;
    while let Some(piece) = rx.recv().await {
        let mut piece = match piece {
            Ok(piece) => piece,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        if faults.corrupt_sends {
            // Fault injection for tests: a peer that sends wrong bytes for an id.
            let middle = piece.bytes.len() / 2;
            if let Some(byte) = piece.bytes.get_mut(middle) {
                *byte ^= 0x40;
            }
        }
        // The first piece starts at the block holding `offset`.
        let skip = (sent - piece.offset) as usize;
        let before = sent;
        for chunk in piece.bytes[skip..].chunks(CHUNK_BYTES_MAX) {
            channel.queue(&Frame::Chunk { transfer, offset: sent, data: chunk }).await?;
            sent += chunk.len() as u64;
            shared.stats.bytes_sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        shared.peers.count_bytes(to, sent - before, 0);
        let _ = spare_tx.try_send(piece.bytes);
        if !faults.send_delay_per_mib.is_zero() {
            tokio::time::sleep(faults.send_delay_per_mib).await;
        }
    }
    drop(rx);
    let _ = reader.await;
    match failure {
        None => channel.send(&Frame::End { transfer, total_bytes: sent }).await,
        Some(e) => {
            let code = reply_code_of(&e);
            if code == ReplyCode::Corrupt {
                shared.stats.verify_failures.fetch_add(1, Ordering::Relaxed);
                shared.event(format!("own copy of {id} failed verification while being sent: {e}"));
                shared.quarantine_and_heal(kind, id).await;
            }
            reply(channel, transfer, code, &e.to_string()).await
        }
    }
}

/// The reader thread for a fragment held in memory: checks it whole, then queues it from the
/// block holding `offset` in pieces.
fn send_outgoing(id: ObjectId, file: &[u8], offset: u64, out: &mpsc::Sender<Result<Piece>>) {
    let send = |piece: Result<Piece>| out.blocking_send(piece).is_ok();
    let checked = crate::erasure::Fragment::check(file)
        .map_err(|source| Error::Format { path: PathBuf::from(format!("fragment {id} (in memory)")), source });
    match checked {
        Ok(header) if crate::erasure::fragment_id(header.shard, header.coding, header.index) == id => {}
        Ok(_) => {
            send(Err(Error::invalid_input(format!("the fragment held for {id} is another one"))));
            return;
        }
        Err(e) => {
            send(Err(e));
            return;
        }
    }
    if offset > file.len() as u64 {
        send(Err(Error::invalid_input(format!("offset {offset} is past the end ({})", file.len()))));
        return;
    }
    let mut at = (offset - offset % BLOCK_BYTES_U64) as usize;
    while at < file.len() {
        let end = (at + PIECE_BYTES).min(file.len());
        if !send(Ok(Piece { offset: at as u64, bytes: file[at..end].to_vec() })) {
            return;
        }
        at = end;
    }
}

/// The reader thread: checks the object, then reads it from the block holding `offset` in
/// pieces, CRC-checking every data block of a shard or a fragment, and queues the pieces.
fn read_verified(
    kind: WireKind,
    id: ObjectId,
    path: &std::path::Path,
    offset: u64,
    out: &mpsc::Sender<Result<Piece>>,
    mut spare: mpsc::Receiver<Vec<u8>>,
) {
    let send = |piece: Result<Piece>| out.blocking_send(piece).is_ok();
    let not_found = |e: Error| match e {
        Error::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Error::NotFound { what: format!("object {id}") }
        }
        other => other,
    };
    match kind {
        WireKind::Manifest => {
            let bytes = match std::fs::read(path).map_err(|e| not_found(Error::io("read", path, e))) {
                Ok(bytes) => bytes,
                Err(e) => {
                    send(Err(e));
                    return;
                }
            };
            let actual = ObjectId::of(&bytes);
            if actual != id {
                send(Err(Error::HashMismatch { path: path.to_owned(), expected: id, actual }));
                return;
            }
            if offset > bytes.len() as u64 {
                send(Err(Error::invalid_input(format!("offset {offset} is past the end ({})", bytes.len()))));
                return;
            }
            send(Ok(Piece { offset: 0, bytes }));
        }
        WireKind::Shard => {
            let meta = match ShardMeta::read(path).map_err(not_found) {
                Ok(meta) => meta,
                Err(e) => {
                    send(Err(e));
                    return;
                }
            };
            let file_bytes = meta.file_bytes();
            if offset > file_bytes {
                send(Err(Error::invalid_input(format!("offset {offset} is past the end ({file_bytes})"))));
                return;
            }
            let file = match File::open(path).map_err(|e| not_found(Error::io("open", path, e))) {
                Ok(file) => file,
                Err(e) => {
                    send(Err(e));
                    return;
                }
            };
            let data = DATA_OFFSET..meta.footer().index_offset;
            let mut at = offset - offset % BLOCK_BYTES_U64;
            while at < file_bytes {
                let len = ((file_bytes - at) as usize).min(PIECE_BYTES);
                // Buffers come back from the network side: after the first few, nothing is
                // allocated or zeroed per piece.
                let mut bytes = spare.try_recv().unwrap_or_default();
                bytes.resize(len, 0);
                if let Err(e) = file.read_exact_at(&mut bytes, at) {
                    send(Err(Error::io("read", path, e)));
                    return;
                }
                let (start, end) = (at.max(data.start), (at + len as u64).min(data.end));
                if start < end {
                    let first_block = (start - DATA_OFFSET) / BLOCK_BYTES_U64;
                    let blocks = &bytes[(start - at) as usize..(end - at) as usize];
                    debug_assert_eq!(blocks.len() % BLOCK_BYTES, 0);
                    if let Err((block, expected, actual)) = meta.check_blocks(first_block, blocks) {
                        send(Err(Error::ChecksumMismatch { shard: ShardId(id), block, expected, actual }));
                        return;
                    }
                }
                if !send(Ok(Piece { offset: at, bytes })) {
                    return;
                }
                at += len as u64;
            }
        }
        WireKind::Fragment => {
            let fragment = match FragmentFile::open(path, id) {
                Ok(fragment) => fragment,
                Err(e) => {
                    send(Err(e));
                    return;
                }
            };
            let file_bytes = fragment.file_bytes();
            if offset > file_bytes {
                send(Err(Error::invalid_input(format!("offset {offset} is past the end ({file_bytes})"))));
                return;
            }
            let mut at = offset - offset % BLOCK_BYTES_U64;
            while at < file_bytes {
                let len = ((file_bytes - at) as usize).min(PIECE_BYTES);
                let mut bytes = spare.try_recv().unwrap_or_default();
                bytes.resize(len, 0);
                if let Err(e) = fragment.read_at(&mut bytes, at).and_then(|()| fragment.check_piece(at, &bytes)) {
                    send(Err(e));
                    return;
                }
                if !send(Ok(Piece { offset: at, bytes })) {
                    return;
                }
                at += len as u64;
            }
        }
    }
}
