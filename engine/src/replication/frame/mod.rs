//! The replication protocol's frames: what one decrypted record holds, and its byte layout.
//!
//! Owns: `Frame` (every message two nodes exchange), its encoder and its decoder, the per-kind
//! size caps, and `FrameError`. Pure code over byte slices, so the decoder is fuzzed on its own
//! (`fuzz/fuzz_targets/frame_decode.rs`). Invariants: a decoded frame has passed every check
//! (kind known, reserved bytes zero, length within its kind's cap, every count and string
//! consistent with the bytes present), so code past `decode` does not re-check; nothing is
//! allocated by a length before that length has been checked against the bytes present and the
//! kind's cap. Never: does I/O or cryptography (`secure` wraps frames in Noise records).
//!
//! Layout (little-endian; `docs/format.md` has the diagrams):
//!
//! ```text
//! 0   kind u8 | reserved [3] | body_bytes u32 | epoch u64 | seq u64     (24-byte header)
//! 24  body: body_bytes, at most the kind's cap
//! ```

use std::fmt;

use crate::error::FrameError;
use crate::id::{ID_BYTES, ObjectId};
use crate::store::ObjectKind;

mod goal;

pub use goal::Goal;

/// Largest record on the wire: a Noise message.
pub const RECORD_BYTES_MAX: usize = 65535;
/// The AEAD tag that encryption adds to every frame.
pub const TAG_BYTES: usize = 16;
/// Largest frame (plaintext of one record).
pub const FRAME_BYTES_MAX: usize = RECORD_BYTES_MAX - TAG_BYTES;
/// The frame header.
pub const HEADER_BYTES: usize = 24;
/// Largest chunk of an object's bytes in one frame.
pub const CHUNK_BYTES_MAX: usize = 60 << 10;
/// Largest number of inventory entries in one frame.
pub const INVENTORY_ENTRIES_MAX: usize = 1024;
/// Largest human-readable message (errors, progress).
pub const MESSAGE_BYTES_MAX: usize = 1024;
/// Largest dataset name or version spec.
pub const NAME_BYTES_MAX: usize = 256;
/// Largest listen address text.
pub const ADDRESS_BYTES_MAX: usize = 128;
/// Largest ref file carried by `PutRef`.
pub const REF_BYTES_MAX: usize = 48 << 10;
/// Largest number of alternative sources in a `Fetch`.
pub const SOURCES_MAX: usize = 64;
/// Largest status report text.
pub const STATUS_BYTES_MAX: usize = 60 << 10;
/// Largest membership list.
pub const MEMBERS_MAX: usize = 256;
/// Shards in a `Heat` or `Accessed` frame at most (the most read ones).
pub const HEAT_ENTRIES_MAX: usize = 1024;
const HEAT_ENTRY_BYTES: usize = ID_BYTES + 8;
/// The protocol version a `Hello` announces.
pub const PROTOCOL_VERSION: u16 = 1;

const INVENTORY_ENTRY_BYTES: usize = 2 + ID_BYTES + 8;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// The first frame each side sends: who it is.
    Hello = 1,
    /// Liveness probe.
    Ping = 2,
    /// Answer to `Ping`.
    Pong = 3,
    /// Asks for the objects a node holds, after a cursor.
    InventoryRequest = 4,
    /// One page of a node's objects.
    Inventory = 5,
    /// Asks for an object's bytes from an offset to its end.
    Get = 6,
    /// Some bytes of an object being sent.
    Chunk = 7,
    /// An object's bytes are all sent.
    End = 8,
    /// The answer to a request: success or a coded error.
    Reply = 9,
    /// Asks a node to pull an object (from the sender or the listed sources) and answer when it
    /// holds a verified copy.
    Fetch = 10,
    /// A dataset's ref file and replication factor, to adopt if newer.
    PutRef = 11,
    /// (Client) replicate a dataset version with this factor; answered by `Progress` frames.
    Replicate = 12,
    /// Progress of a long request; the last one is final.
    Progress = 13,
    /// (Client) asks for the node's status report.
    StatusRequest = 14,
    /// The status report, as text.
    Status = 15,
    /// (Client) a reader found this shard damaged or missing: replace it with a verified copy.
    Repair = 16,
    /// (Rendezvous) asks the rendezvous node for the members that have joined.
    MembersRequest = 17,
    /// The members that have joined: node ids and listen addresses.
    Members = 18,
    /// (Peer) asks for the node's shard reads over its last window and its free space.
    HeatRequest = 19,
    /// A node's shard reads over its last window (the most read first cut at the cap, listed
    /// by id) and its free space: the replicator's measured inputs.
    Heat = 20,
    /// (Client) a reader beside the node read these shards (how many times each): counted in
    /// the node's window.
    Accessed = 21,
}

impl Kind {
    /// Every kind, for tests and the fuzzer's dictionary.
    pub const ALL: [Kind; 21] = [
        Kind::Hello,
        Kind::Ping,
        Kind::Pong,
        Kind::InventoryRequest,
        Kind::Inventory,
        Kind::Get,
        Kind::Chunk,
        Kind::End,
        Kind::Reply,
        Kind::Fetch,
        Kind::PutRef,
        Kind::Replicate,
        Kind::Progress,
        Kind::StatusRequest,
        Kind::Status,
        Kind::Repair,
        Kind::MembersRequest,
        Kind::Members,
        Kind::HeatRequest,
        Kind::Heat,
        Kind::Accessed,
    ];

    fn from_code(code: u8) -> Option<Kind> {
        Kind::ALL.get(usize::from(code).wrapping_sub(1)).copied()
    }

    /// The kind's name, for errors.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Hello => "Hello",
            Kind::Ping => "Ping",
            Kind::Pong => "Pong",
            Kind::InventoryRequest => "InventoryRequest",
            Kind::Inventory => "Inventory",
            Kind::Get => "Get",
            Kind::Chunk => "Chunk",
            Kind::End => "End",
            Kind::Reply => "Reply",
            Kind::Fetch => "Fetch",
            Kind::PutRef => "PutRef",
            Kind::Replicate => "Replicate",
            Kind::Progress => "Progress",
            Kind::StatusRequest => "StatusRequest",
            Kind::Status => "Status",
            Kind::Repair => "Repair",
            Kind::MembersRequest => "MembersRequest",
            Kind::Members => "Members",
            Kind::HeatRequest => "HeatRequest",
            Kind::Heat => "Heat",
            Kind::Accessed => "Accessed",
        }
    }

    /// The largest body a frame of this kind may have.
    pub const fn body_bytes_max(self) -> usize {
        match self {
            Kind::Hello => 20 + ADDRESS_BYTES_MAX,
            Kind::Ping => 8,
            Kind::Pong => 16,
            Kind::InventoryRequest => 8 + ID_BYTES,
            Kind::Inventory => 8 + INVENTORY_ENTRIES_MAX * INVENTORY_ENTRY_BYTES,
            Kind::Get => 16 + ID_BYTES,
            Kind::Chunk => 16 + CHUNK_BYTES_MAX,
            Kind::End => 16,
            Kind::Reply => 8 + MESSAGE_BYTES_MAX,
            Kind::Fetch => 24 + ID_BYTES + 4 * SOURCES_MAX,
            Kind::PutRef => 16 + NAME_BYTES_MAX + REF_BYTES_MAX,
            Kind::Replicate => 16 + NAME_BYTES_MAX,
            Kind::Progress => 24 + MESSAGE_BYTES_MAX,
            Kind::StatusRequest => 8,
            Kind::Status => 8 + STATUS_BYTES_MAX,
            Kind::Repair => 8 + ID_BYTES,
            Kind::MembersRequest => 8,
            Kind::Members => 8 + MEMBERS_MAX * (8 + ADDRESS_BYTES_MAX),
            Kind::HeatRequest => 8,
            Kind::Heat => 16 + HEAT_ENTRIES_MAX * HEAT_ENTRY_BYTES,
            Kind::Accessed => 8 + HEAT_ENTRIES_MAX * HEAT_ENTRY_BYTES,
        }
    }

    /// Whether only a client (a command line tool, a reader) sends this kind to a node.
    pub const fn is_client_request(self) -> bool {
        matches!(self, Kind::Replicate | Kind::StatusRequest | Kind::Repair)
    }
}

// Every frame fits in one record, with the header and the tag.
const _: () = {
    let mut i = 0;
    while i < Kind::ALL.len() {
        assert!(HEADER_BYTES + Kind::ALL[i].body_bytes_max() <= FRAME_BYTES_MAX);
        i += 1;
    }
};

/// What a node says it is in its `Hello`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// A node of the job: serves objects, takes part in replication.
    Peer = 1,
    /// A command-line tool or a reader process: asks, never serves.
    Client = 2,
}

/// The outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum ReplyCode {
    /// Done.
    Ok = 0,
    /// The node does not have the object or dataset.
    NotFound = 1,
    /// The node's own copy failed verification (it is quarantined there).
    Corrupt = 2,
    /// The request is malformed or not allowed for this sender.
    Invalid = 3,
    /// No source could provide a verified copy.
    Unavailable = 4,
    /// The node failed for a reason of its own (disk, plugin, ...).
    Internal = 5,
    /// Refused: a stale incarnation, a conflicting ref, a duplicate node id.
    Refused = 6,
}

impl ReplyCode {
    fn from_code(code: u16) -> Option<ReplyCode> {
        Some(match code {
            0 => ReplyCode::Ok,
            1 => ReplyCode::NotFound,
            2 => ReplyCode::Corrupt,
            3 => ReplyCode::Invalid,
            4 => ReplyCode::Unavailable,
            5 => ReplyCode::Internal,
            6 => ReplyCode::Refused,
            _ => return None,
        })
    }
}

impl fmt::Display for ReplyCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            ReplyCode::Ok => "ok",
            ReplyCode::NotFound => "not found",
            ReplyCode::Corrupt => "corrupt",
            ReplyCode::Invalid => "invalid",
            ReplyCode::Unavailable => "unavailable",
            ReplyCode::Internal => "internal error",
            ReplyCode::Refused => "refused",
        };
        f.write_str(text)
    }
}

/// One object a node holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InventoryEntry {
    /// Shard or manifest.
    pub kind: WireKind,
    /// Its content id.
    pub id: ObjectId,
    /// Its length.
    pub bytes: u64,
    /// Whether the node holds it only as a cache entry (it may evict it). Copies that are not
    /// cached are never evicted, so another node may evict its own cached copy only when some
    /// node holds one that is not.
    pub cached: bool,
}

/// Whether a `Replicate` request waits for its copies: as the node's replicator says, or as the
/// caller asks for this one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplicateMode {
    /// The node's setting (its replicator's `mode` option).
    #[default]
    Node,
    /// Return once every copy is verified on its node.
    Synchronous,
    /// Return once the copies are scheduled.
    Asynchronous,
}

impl ReplicateMode {
    fn code(self) -> u8 {
        match self {
            ReplicateMode::Node => 0,
            ReplicateMode::Synchronous => 1,
            ReplicateMode::Asynchronous => 2,
        }
    }

    fn from_code(code: u8) -> Option<ReplicateMode> {
        match code {
            0 => Some(ReplicateMode::Node),
            1 => Some(ReplicateMode::Synchronous),
            2 => Some(ReplicateMode::Asynchronous),
            _ => None,
        }
    }
}

/// An object kind as it travels: [`ObjectKind`] with a total order and a wire code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WireKind {
    /// A shard file.
    Shard,
    /// A manifest file.
    Manifest,
    /// A fragment of an erasure-coded shard.
    Fragment,
}

impl WireKind {
    fn code(self) -> u8 {
        match self {
            WireKind::Shard => 1,
            WireKind::Manifest => 2,
            WireKind::Fragment => 3,
        }
    }

    fn from_code(code: u8) -> Option<WireKind> {
        match code {
            1 => Some(WireKind::Shard),
            2 => Some(WireKind::Manifest),
            3 => Some(WireKind::Fragment),
            _ => None,
        }
    }

    /// The store's kind.
    pub fn object_kind(self) -> ObjectKind {
        match self {
            WireKind::Shard => ObjectKind::Shard,
            WireKind::Manifest => ObjectKind::Manifest,
            WireKind::Fragment => ObjectKind::Fragment,
        }
    }
}

impl From<ObjectKind> for WireKind {
    fn from(kind: ObjectKind) -> Self {
        match kind {
            ObjectKind::Shard => WireKind::Shard,
            ObjectKind::Manifest => WireKind::Manifest,
            ObjectKind::Fragment => WireKind::Fragment,
        }
    }
}

/// The header every frame starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the body is.
    pub kind: Kind,
    /// The sender's incarnation (a counter that grows every time a node starts), so that frames
    /// of a node's earlier life are told apart from its current ones.
    pub epoch: u64,
    /// 1 for the first frame in each direction of a connection, then +1 per frame: a replayed,
    /// dropped or reordered frame breaks the sequence and ends the connection.
    pub seq: u64,
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Who the sender is.
    Hello {
        /// The protocol version it speaks.
        version: u16,
        /// Its node id (any value for a client).
        node_id: u32,
        /// Peer or client.
        role: Role,
        /// Its relative capacity for placement (0 takes no copies).
        weight: u32,
        /// Nodes that fail together share a failure domain.
        failure_domain: u32,
        /// Where it listens for peers (empty for a client).
        listen: &'a str,
    },
    /// Liveness probe with a nonce to echo.
    Ping(u64),
    /// The echo, with the generation of the answering node's inventory (it changes whenever the
    /// inventory does, so a peer refetches the inventory only then).
    Pong {
        /// The probe's nonce.
        nonce: u64,
        /// The inventory's generation.
        generation: u64,
    },
    /// Inventory from the start, or after `after` in (kind, id) order.
    InventoryRequest {
        /// The last entry of the previous page.
        after: Option<(WireKind, ObjectId)>,
    },
    /// One page of the inventory in (kind, id) order; `more` when another page follows.
    Inventory {
        /// The objects.
        entries: Vec<InventoryEntry>,
        /// Whether the listing continues after the last entry.
        more: bool,
    },
    /// The bytes of an object from `offset` to its end, as `Chunk`s then `End` (or a `Reply`
    /// with an error), tagged with `transfer`.
    Get {
        /// The requester's tag for this transfer.
        transfer: u32,
        /// Shard or manifest.
        kind: WireKind,
        /// The object.
        id: ObjectId,
        /// Where to start (resuming an interrupted transfer).
        offset: u64,
    },
    /// Bytes `offset..offset + data.len()` of the object of `transfer`.
    Chunk {
        /// The transfer.
        transfer: u32,
        /// Where the bytes go in the object.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// Every byte of `transfer` was sent; the object is `total_bytes` long.
    End {
        /// The transfer.
        transfer: u32,
        /// The object's length.
        total_bytes: u64,
    },
    /// The outcome of request (or transfer) `request`.
    Reply {
        /// The request answered.
        request: u32,
        /// Success or the kind of failure.
        code: ReplyCode,
        /// Details for a person.
        message: &'a str,
    },
    /// Pull this object and reply once a verified copy is published.
    Fetch {
        /// The request.
        request: u32,
        /// Shard or manifest.
        kind: WireKind,
        /// The object.
        id: ObjectId,
        /// Its length.
        bytes: u64,
        /// Nodes that hold it, preferred first (the sender, usually).
        sources: Vec<u32>,
    },
    /// Adopt this ref file of dataset `name` (if it is newer than the local one) and keep its
    /// versions as `goal` says.
    PutRef {
        /// The request.
        request: u32,
        /// Copies or fragments of each shard.
        goal: Goal,
        /// The dataset's name.
        name: &'a str,
        /// The ref file's bytes (`docs/format.md`).
        log: &'a [u8],
    },
    /// Replicate dataset version `spec` as `goal` says: copies, or coded fragments.
    Replicate {
        /// The request.
        request: u32,
        /// Copies or fragments wanted.
        goal: Goal,
        /// Whether to wait for the copies.
        mode: ReplicateMode,
        /// NAME, NAME@N or a manifest id.
        spec: &'a str,
    },
    /// `done` of `total` units of request `request`; `last` ends the request with `code`.
    Progress {
        /// The request.
        request: u32,
        /// Units done.
        done: u64,
        /// Units in all.
        total: u64,
        /// Whether this is the final frame of the request.
        last: bool,
        /// The outcome, when `last`.
        code: ReplyCode,
        /// Details for a person.
        message: &'a str,
    },
    /// Asks for the status report.
    StatusRequest {
        /// The request.
        request: u32,
    },
    /// The status report, one `key value...` line per fact.
    Status {
        /// The request.
        request: u32,
        /// The text.
        text: &'a str,
    },
    /// Replace shard `id` with a verified copy from a peer (the local one is damaged or gone).
    Repair {
        /// The request.
        request: u32,
        /// The shard.
        id: ObjectId,
    },
    /// Which members have joined the rendezvous so far.
    MembersRequest {
        /// The request.
        request: u32,
    },
    /// The members that have joined: (node id, listen address), by node id.
    Members {
        /// The request answered.
        request: u32,
        /// The members.
        members: Vec<(u32, &'a str)>,
    },
    /// Asks for the node's heat.
    HeatRequest {
        /// The request.
        request: u32,
    },
    /// The node's shard reads over its window and its free space.
    Heat {
        /// The request answered.
        request: u32,
        /// Bytes the node's store may still take.
        free_bytes: u64,
        /// (shard, reads), in strictly increasing id order.
        entries: Vec<(ObjectId, u64)>,
    },
    /// Shards a reader beside the node read.
    Accessed {
        /// The request.
        request: u32,
        /// (shard, reads), in strictly increasing id order.
        entries: Vec<(ObjectId, u64)>,
    },
}

/// Reads little-endian fields from a body, failing on truncation.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or(FrameError::Truncated {
            what: "frame body",
            needed: self.at.saturating_add(n),
            present: self.bytes.len(),
        })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn id(&mut self) -> Result<ObjectId, FrameError> {
        Ok(ObjectId::from_bytes(self.take(ID_BYTES)?.try_into().expect("32 bytes")))
    }

    /// A byte that must be 0 (false) or 1 (true).
    fn flag(&mut self, kind: Kind, field: &'static str) -> Result<bool, FrameError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => {
                Err(FrameError::BadField { kind: kind.name(), field, detail: format!("{other} is neither 0 nor 1") })
            }
        }
    }

    fn zeros(&mut self, n: usize, kind: Kind) -> Result<(), FrameError> {
        if self.take(n)?.iter().any(|&b| b != 0) { Err(FrameError::Reserved(kind.name())) } else { Ok(()) }
    }

    fn rest(&mut self) -> &'a [u8] {
        let out = &self.bytes[self.at..];
        self.at = self.bytes.len();
        out
    }

    fn end(&self, kind: Kind) -> Result<(), FrameError> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(FrameError::BadField {
                kind: kind.name(),
                field: "length",
                detail: format!("{} bytes left over after the last field", self.bytes.len() - self.at),
            })
        }
    }
}

fn text<'a>(bytes: &'a [u8], kind: Kind, field: &'static str, max: usize) -> Result<&'a str, FrameError> {
    if bytes.len() > max {
        return Err(FrameError::BadField {
            kind: kind.name(),
            field,
            detail: format!("{} bytes, at most {max}", bytes.len()),
        });
    }
    std::str::from_utf8(bytes).map_err(|_| FrameError::BadField {
        kind: kind.name(),
        field,
        detail: "not UTF-8".to_owned(),
    })
}

fn wire_kind(code: u8, kind: Kind) -> Result<WireKind, FrameError> {
    WireKind::from_code(code).ok_or_else(|| FrameError::BadField {
        kind: kind.name(),
        field: "object kind",
        detail: format!("unknown object kind {code}"),
    })
}

fn reply_code(code: u16, kind: Kind) -> Result<ReplyCode, FrameError> {
    ReplyCode::from_code(code).ok_or_else(|| FrameError::BadField {
        kind: kind.name(),
        field: "code",
        detail: format!("unknown reply code {code}"),
    })
}

impl<'a> Frame<'a> {
    /// The frame's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Frame::Hello { .. } => Kind::Hello,
            Frame::Ping(_) => Kind::Ping,
            Frame::Pong { .. } => Kind::Pong,
            Frame::InventoryRequest { .. } => Kind::InventoryRequest,
            Frame::Inventory { .. } => Kind::Inventory,
            Frame::Get { .. } => Kind::Get,
            Frame::Chunk { .. } => Kind::Chunk,
            Frame::End { .. } => Kind::End,
            Frame::Reply { .. } => Kind::Reply,
            Frame::Fetch { .. } => Kind::Fetch,
            Frame::PutRef { .. } => Kind::PutRef,
            Frame::Replicate { .. } => Kind::Replicate,
            Frame::Progress { .. } => Kind::Progress,
            Frame::StatusRequest { .. } => Kind::StatusRequest,
            Frame::Status { .. } => Kind::Status,
            Frame::Repair { .. } => Kind::Repair,
            Frame::MembersRequest { .. } => Kind::MembersRequest,
            Frame::Members { .. } => Kind::Members,
            Frame::HeatRequest { .. } => Kind::HeatRequest,
            Frame::Heat { .. } => Kind::Heat,
            Frame::Accessed { .. } => Kind::Accessed,
        }
    }

    /// Decodes one frame (the plaintext of one record).
    pub fn decode(bytes: &'a [u8]) -> Result<(Header, Frame<'a>), FrameError> {
        if bytes.len() > FRAME_BYTES_MAX {
            return Err(FrameError::TooLarge { what: "frame", bytes: bytes.len(), max: FRAME_BYTES_MAX });
        }
        if bytes.len() < HEADER_BYTES {
            return Err(FrameError::Truncated { what: "frame header", needed: HEADER_BYTES, present: bytes.len() });
        }
        let mut header = Cursor { bytes: &bytes[..HEADER_BYTES], at: 0 };
        let code = header.u8()?;
        let kind = Kind::from_code(code).ok_or(FrameError::UnknownKind(code))?;
        header.zeros(3, kind)?;
        let body_bytes = header.u32()? as usize;
        let epoch = header.u64()?;
        let seq = header.u64()?;
        let body = &bytes[HEADER_BYTES..];
        if body_bytes > kind.body_bytes_max() {
            return Err(FrameError::TooLarge { what: "frame body", bytes: body_bytes, max: kind.body_bytes_max() });
        }
        if body_bytes != body.len() {
            return Err(FrameError::Truncated { what: "frame body", needed: body_bytes, present: body.len() });
        }
        let frame = Self::decode_body(kind, body)?;
        Ok((Header { kind, epoch, seq }, frame))
    }

    fn decode_body(kind: Kind, body: &'a [u8]) -> Result<Frame<'a>, FrameError> {
        let mut c = Cursor { bytes: body, at: 0 };
        let frame = match kind {
            Kind::Hello => {
                let version = c.u16()?;
                let role = match c.u8()? {
                    1 => Role::Peer,
                    2 => Role::Client,
                    other => {
                        return Err(FrameError::BadField {
                            kind: kind.name(),
                            field: "role",
                            detail: format!("unknown role {other}"),
                        });
                    }
                };
                c.zeros(1, kind)?;
                let node_id = c.u32()?;
                let weight = c.u32()?;
                let failure_domain = c.u32()?;
                let listen_len = usize::from(c.u16()?);
                c.zeros(2, kind)?;
                let listen = text(c.take(listen_len)?, kind, "listen address", ADDRESS_BYTES_MAX)?;
                Frame::Hello { version, node_id, role, weight, failure_domain, listen }
            }
            Kind::Ping => Frame::Ping(c.u64()?),
            Kind::Pong => Frame::Pong { nonce: c.u64()?, generation: c.u64()? },
            Kind::InventoryRequest => {
                let present = c.flag(kind, "cursor flag")?;
                let code = c.u8()?;
                c.zeros(6, kind)?;
                let id = c.id()?;
                let after = if present {
                    Some((wire_kind(code, kind)?, id))
                } else if code != 0 || id != ObjectId::from_bytes([0; ID_BYTES]) {
                    return Err(FrameError::Reserved(kind.name()));
                } else {
                    None
                };
                Frame::InventoryRequest { after }
            }
            Kind::Inventory => {
                let n = usize::from(c.u16()?);
                let more = c.flag(kind, "more")?;
                c.zeros(5, kind)?;
                if n > INVENTORY_ENTRIES_MAX {
                    return Err(FrameError::TooLarge { what: "inventory page", bytes: n, max: INVENTORY_ENTRIES_MAX });
                }
                // Checked against the bytes present before anything is allocated.
                let raw = c.take(n * INVENTORY_ENTRY_BYTES)?;
                let mut entries = Vec::with_capacity(n);
                for entry in raw.chunks_exact(INVENTORY_ENTRY_BYTES) {
                    let mut e = Cursor { bytes: entry, at: 0 };
                    let object = wire_kind(e.u8()?, kind)?;
                    let cached = e.flag(kind, "entry flags")?;
                    let id = e.id()?;
                    let bytes = e.u64()?;
                    entries.push(InventoryEntry { kind: object, id, bytes, cached });
                }
                if entries.windows(2).any(|w| (w[0].kind, w[0].id) >= (w[1].kind, w[1].id)) {
                    return Err(FrameError::BadField {
                        kind: kind.name(),
                        field: "entries",
                        detail: "not in strictly increasing (kind, id) order".to_owned(),
                    });
                }
                Frame::Inventory { entries, more }
            }
            Kind::Get => {
                let transfer = c.u32()?;
                let object = wire_kind(c.u8()?, kind)?;
                c.zeros(3, kind)?;
                let id = c.id()?;
                let offset = c.u64()?;
                Frame::Get { transfer, kind: object, id, offset }
            }
            Kind::Chunk => {
                let transfer = c.u32()?;
                c.zeros(4, kind)?;
                let offset = c.u64()?;
                let data = c.rest();
                if data.is_empty() {
                    return Err(FrameError::BadField {
                        kind: kind.name(),
                        field: "data",
                        detail: "an empty chunk".to_owned(),
                    });
                }
                if offset.checked_add(data.len() as u64).is_none() {
                    return Err(FrameError::BadField {
                        kind: kind.name(),
                        field: "offset",
                        detail: format!("{offset} overflows"),
                    });
                }
                Frame::Chunk { transfer, offset, data }
            }
            Kind::End => {
                let transfer = c.u32()?;
                c.zeros(4, kind)?;
                Frame::End { transfer, total_bytes: c.u64()? }
            }
            Kind::Reply => {
                let request = c.u32()?;
                let code = reply_code(c.u16()?, kind)?;
                let len = usize::from(c.u16()?);
                let message = text(c.take(len)?, kind, "message", MESSAGE_BYTES_MAX)?;
                Frame::Reply { request, code, message }
            }
            Kind::Fetch => {
                let request = c.u32()?;
                let object = wire_kind(c.u8()?, kind)?;
                c.zeros(3, kind)?;
                let id = c.id()?;
                let bytes = c.u64()?;
                let n = usize::from(c.u16()?);
                c.zeros(6, kind)?;
                if n > SOURCES_MAX {
                    return Err(FrameError::TooLarge { what: "source list", bytes: n, max: SOURCES_MAX });
                }
                let raw = c.take(4 * n)?;
                let sources = raw.chunks_exact(4).map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes"))).collect();
                Frame::Fetch { request, kind: object, id, bytes, sources }
            }
            Kind::PutRef => {
                let request = c.u32()?;
                let replicas = c.u32()?;
                let name_len = usize::from(c.u16()?);
                let goal = Goal::from_wire(replicas, [c.u8()?, c.u8()?], kind)?;
                let log_len = c.u32()? as usize;
                let name = text(c.take(name_len)?, kind, "name", NAME_BYTES_MAX)?;
                if log_len > REF_BYTES_MAX {
                    return Err(FrameError::TooLarge { what: "ref file", bytes: log_len, max: REF_BYTES_MAX });
                }
                let log = c.take(log_len)?;
                Frame::PutRef { request, goal, name, log }
            }
            Kind::Replicate => {
                let request = c.u32()?;
                let replicas = c.u32()?;
                let len = usize::from(c.u16()?);
                let code = c.u8()?;
                let mode = ReplicateMode::from_code(code).ok_or_else(|| FrameError::BadField {
                    kind: kind.name(),
                    field: "mode",
                    detail: format!("{code} is not 0 (the node's), 1 (sync) or 2 (async)"),
                })?;
                let goal = Goal::from_wire(replicas, [c.u8()?, c.u8()?], kind)?;
                c.zeros(3, kind)?;
                let spec = text(c.take(len)?, kind, "spec", NAME_BYTES_MAX)?;
                Frame::Replicate { request, goal, mode, spec }
            }
            Kind::Progress => {
                let request = c.u32()?;
                let last = c.flag(kind, "last")?;
                c.zeros(1, kind)?;
                let code = reply_code(c.u16()?, kind)?;
                let done = c.u64()?;
                let total = c.u64()?;
                let message = text(c.rest(), kind, "message", MESSAGE_BYTES_MAX)?;
                Frame::Progress { request, done, total, last, code, message }
            }
            Kind::StatusRequest => {
                let request = c.u32()?;
                c.zeros(4, kind)?;
                Frame::StatusRequest { request }
            }
            Kind::Status => {
                let request = c.u32()?;
                c.zeros(4, kind)?;
                let text = text(c.rest(), kind, "report", STATUS_BYTES_MAX)?;
                Frame::Status { request, text }
            }
            Kind::Repair => {
                let request = c.u32()?;
                c.zeros(4, kind)?;
                Frame::Repair { request, id: c.id()? }
            }
            Kind::MembersRequest => {
                let request = c.u32()?;
                c.zeros(4, kind)?;
                Frame::MembersRequest { request }
            }
            Kind::Members => {
                let request = c.u32()?;
                let n = usize::from(c.u16()?);
                c.zeros(2, kind)?;
                if n > MEMBERS_MAX {
                    return Err(FrameError::TooLarge { what: "member list", bytes: n, max: MEMBERS_MAX });
                }
                let mut members = Vec::with_capacity(n.min(c.bytes.len() / 8));
                for _ in 0..n {
                    let id = c.u32()?;
                    let len = usize::from(c.u16()?);
                    c.zeros(2, kind)?;
                    let addr = text(c.take(len)?, kind, "member address", ADDRESS_BYTES_MAX)?;
                    members.push((id, addr));
                }
                if members.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err(FrameError::BadField {
                        kind: kind.name(),
                        field: "members",
                        detail: "not in strictly increasing node id order".to_owned(),
                    });
                }
                Frame::Members { request, members }
            }
            Kind::HeatRequest => {
                let request = c.u32()?;
                c.zeros(4, kind)?;
                Frame::HeatRequest { request }
            }
            Kind::Heat => {
                let request = c.u32()?;
                let n = usize::from(c.u16()?);
                c.zeros(2, kind)?;
                let free_bytes = c.u64()?;
                Frame::Heat { request, free_bytes, entries: heat_entries(&mut c, n, kind)? }
            }
            Kind::Accessed => {
                let request = c.u32()?;
                let n = usize::from(c.u16()?);
                c.zeros(2, kind)?;
                Frame::Accessed { request, entries: heat_entries(&mut c, n, kind)? }
            }
        };
        c.end(kind)?;
        Ok(frame)
    }

    /// Appends the encoded frame to `out`. A frame whose fields exceed its kind's caps is a
    /// caller's bug: it is refused here, before anything is sent.
    pub fn encode(&self, epoch: u64, seq: u64, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let start = out.len();
        let kind = self.kind();
        out.push(kind as u8);
        out.extend_from_slice(&[0; 3]);
        out.extend_from_slice(&[0; 4]); // body length, patched below
        out.extend_from_slice(&epoch.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        let checked = |field: &'static str, len: usize, max: usize| {
            if len > max {
                Err(FrameError::BadField { kind: kind.name(), field, detail: format!("{len} bytes, at most {max}") })
            } else {
                Ok(())
            }
        };
        let no_copies = |goal: &Goal| match goal {
            Goal::Replicas(0) => {
                Err(FrameError::BadField { kind: kind.name(), field: "goal", detail: "0 copies".to_owned() })
            }
            _ => Ok(()),
        };
        match self {
            Frame::Hello { version, node_id, role, weight, failure_domain, listen } => {
                checked("listen address", listen.len(), ADDRESS_BYTES_MAX)?;
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&[*role as u8, 0]);
                out.extend_from_slice(&node_id.to_le_bytes());
                out.extend_from_slice(&weight.to_le_bytes());
                out.extend_from_slice(&failure_domain.to_le_bytes());
                out.extend_from_slice(&(listen.len() as u16).to_le_bytes());
                out.extend_from_slice(&[0; 2]);
                out.extend_from_slice(listen.as_bytes());
            }
            Frame::Ping(nonce) => out.extend_from_slice(&nonce.to_le_bytes()),
            Frame::Pong { nonce, generation } => {
                out.extend_from_slice(&nonce.to_le_bytes());
                out.extend_from_slice(&generation.to_le_bytes());
            }
            Frame::InventoryRequest { after } => {
                let (present, code, id) = match after {
                    None => (0, 0, ObjectId::from_bytes([0; ID_BYTES])),
                    Some((object, id)) => (1, object.code(), *id),
                };
                out.extend_from_slice(&[present, code, 0, 0, 0, 0, 0, 0]);
                out.extend_from_slice(id.as_bytes());
            }
            Frame::Inventory { entries, more } => {
                checked("entries", entries.len(), INVENTORY_ENTRIES_MAX)?;
                out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                out.push(u8::from(*more));
                out.extend_from_slice(&[0; 5]);
                for entry in entries {
                    out.push(entry.kind.code());
                    out.push(u8::from(entry.cached));
                    out.extend_from_slice(entry.id.as_bytes());
                    out.extend_from_slice(&entry.bytes.to_le_bytes());
                }
            }
            Frame::Get { transfer, kind: object, id, offset } => {
                out.extend_from_slice(&transfer.to_le_bytes());
                out.extend_from_slice(&[object.code(), 0, 0, 0]);
                out.extend_from_slice(id.as_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
            }
            Frame::Chunk { transfer, offset, data } => {
                checked("data", data.len(), CHUNK_BYTES_MAX)?;
                out.extend_from_slice(&transfer.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(data);
            }
            Frame::End { transfer, total_bytes } => {
                out.extend_from_slice(&transfer.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&total_bytes.to_le_bytes());
            }
            Frame::Reply { request, code, message } => {
                let message = truncate(message, MESSAGE_BYTES_MAX);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&(*code as u16).to_le_bytes());
                out.extend_from_slice(&(message.len() as u16).to_le_bytes());
                out.extend_from_slice(message.as_bytes());
            }
            Frame::Fetch { request, kind: object, id, bytes, sources } => {
                checked("sources", sources.len(), SOURCES_MAX)?;
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[object.code(), 0, 0, 0]);
                out.extend_from_slice(id.as_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
                out.extend_from_slice(&(sources.len() as u16).to_le_bytes());
                out.extend_from_slice(&[0; 6]);
                for source in sources {
                    out.extend_from_slice(&source.to_le_bytes());
                }
            }
            Frame::PutRef { request, goal, name, log } => {
                checked("name", name.len(), NAME_BYTES_MAX)?;
                no_copies(goal)?;
                checked("ref file", log.len(), REF_BYTES_MAX)?;
                let (replicas, km) = goal.wire();
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&replicas.to_le_bytes());
                out.extend_from_slice(&(name.len() as u16).to_le_bytes());
                out.extend_from_slice(&km);
                out.extend_from_slice(&(log.len() as u32).to_le_bytes());
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(log);
            }
            Frame::Replicate { request, goal, mode, spec } => {
                checked("spec", spec.len(), NAME_BYTES_MAX)?;
                no_copies(goal)?;
                let (replicas, km) = goal.wire();
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&replicas.to_le_bytes());
                out.extend_from_slice(&(spec.len() as u16).to_le_bytes());
                out.push(mode.code());
                out.extend_from_slice(&km);
                out.extend_from_slice(&[0; 3]);
                out.extend_from_slice(spec.as_bytes());
            }
            Frame::Progress { request, done, total, last, code, message } => {
                let message = truncate(message, MESSAGE_BYTES_MAX);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[u8::from(*last), 0]);
                out.extend_from_slice(&(*code as u16).to_le_bytes());
                out.extend_from_slice(&done.to_le_bytes());
                out.extend_from_slice(&total.to_le_bytes());
                out.extend_from_slice(message.as_bytes());
            }
            Frame::StatusRequest { request } => {
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
            }
            Frame::Status { request, text } => {
                let text = truncate(text, STATUS_BYTES_MAX);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(text.as_bytes());
            }
            Frame::Repair { request, id } => {
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(id.as_bytes());
            }
            Frame::MembersRequest { request } => {
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
            }
            Frame::HeatRequest { request } => {
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
            }
            Frame::Heat { request, free_bytes, entries } => {
                checked("entries", entries.len(), HEAT_ENTRIES_MAX)?;
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                out.extend_from_slice(&[0; 2]);
                out.extend_from_slice(&free_bytes.to_le_bytes());
                encode_heat_entries(entries, out);
            }
            Frame::Accessed { request, entries } => {
                checked("entries", entries.len(), HEAT_ENTRIES_MAX)?;
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                out.extend_from_slice(&[0; 2]);
                encode_heat_entries(entries, out);
            }
            Frame::Members { request, members } => {
                checked("members", members.len(), MEMBERS_MAX)?;
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&(members.len() as u16).to_le_bytes());
                out.extend_from_slice(&[0; 2]);
                for (id, addr) in members {
                    checked("member address", addr.len(), ADDRESS_BYTES_MAX)?;
                    out.extend_from_slice(&id.to_le_bytes());
                    out.extend_from_slice(&(addr.len() as u16).to_le_bytes());
                    out.extend_from_slice(&[0; 2]);
                    out.extend_from_slice(addr.as_bytes());
                }
            }
        }
        let body_bytes = out.len() - start - HEADER_BYTES;
        debug_assert!(body_bytes <= kind.body_bytes_max(), "{kind:?} body of {body_bytes} bytes");
        out[start + 4..start + 8].copy_from_slice(&(body_bytes as u32).to_le_bytes());
        Ok(())
    }
}

/// `n` (shard, reads) entries, checked against the cap and the bytes present before anything is
/// allocated, in strictly increasing id order.
fn heat_entries(c: &mut Cursor<'_>, n: usize, kind: Kind) -> Result<Vec<(ObjectId, u64)>, FrameError> {
    if n > HEAT_ENTRIES_MAX {
        return Err(FrameError::TooLarge { what: "heat entries", bytes: n, max: HEAT_ENTRIES_MAX });
    }
    let raw = c.take(n * HEAT_ENTRY_BYTES)?;
    let mut entries = Vec::with_capacity(n);
    for entry in raw.chunks_exact(HEAT_ENTRY_BYTES) {
        let mut e = Cursor { bytes: entry, at: 0 };
        entries.push((e.id()?, e.u64()?));
    }
    if entries.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err(FrameError::BadField {
            kind: kind.name(),
            field: "entries",
            detail: "not in strictly increasing id order".to_owned(),
        });
    }
    Ok(entries)
}

fn encode_heat_entries(entries: &[(ObjectId, u64)], out: &mut Vec<u8>) {
    for (id, reads) in entries {
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&reads.to_le_bytes());
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Fuzzing entry point: decodes `bytes` as a frame; when it decodes, re-encodes it and checks
/// that the same bytes come back (the encoding is canonical). Panics only on a bug.
pub fn fuzz_decode(bytes: &[u8]) {
    if let Ok((header, frame)) = Frame::decode(bytes) {
        let mut again = Vec::with_capacity(bytes.len());
        frame.encode(header.epoch, header.seq, &mut again).expect("a decoded frame re-encodes");
        assert_eq!(again, bytes, "the frame encoding is canonical");
    }
}

#[cfg(test)]
mod tests;
