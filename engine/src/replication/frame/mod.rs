//! The replication protocol's frames: what one decrypted record holds, and its byte layout.
//!
//! Owns: `Frame` (every message two nodes exchange; its encoder and decoder are in
//! `codec.rs`), the per-kind size caps, and `FrameError`. Pure code over byte slices, so the decoder is fuzzed on its own
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

mod codec;
mod goal;

pub use codec::fuzz_decode;
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

#[cfg(test)]
mod tests;
