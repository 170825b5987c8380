//! The errors of the engine's public boundary.
//!
//! Owns: `Error` (what a caller of the library sees) and `FormatError` (what a decoder of bytes
//! sees: shard files, manifests, refs, sample records). Corruption, I/O failure, bad input and
//! missing objects are distinct variants with structured fields, so a caller can act on them
//! without parsing text. Never: formats multi-line messages; every `Display` is one line.

use std::path::PathBuf;
use std::time::Duration;

use crate::id::{ManifestId, ObjectId, ShardId};

/// A result whose error is the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong while decoding bytes that claim to be in one of granary's formats.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The bytes end before the format says they should, or have a length the format forbids.
    #[error("truncated or mis-sized {region}: {detail}")]
    Truncated {
        /// Which part of the object.
        region: &'static str,
        /// What was expected against what was found.
        detail: String,
    },
    /// The magic bytes that open a region are wrong: not this format, or overwritten.
    #[error("bad magic in {region}")]
    BadMagic {
        /// Which part of the object.
        region: &'static str,
    },
    /// A format version this build does not read.
    #[error("unsupported {region} format version {found} (this build reads version {supported})")]
    UnsupportedVersion {
        /// Which part of the object.
        region: &'static str,
        /// The version the bytes claim.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// A region's CRC32C does not match its bytes.
    #[error("{region} checksum mismatch (expected {expected:#010x}, actual {actual:#010x})")]
    ChecksumMismatch {
        /// Which part of the object.
        region: &'static str,
        /// The checksum stored in the object.
        expected: u32,
        /// The checksum of the bytes as read.
        actual: u32,
    },
    /// A data block's CRC32C does not match its bytes (found by a whole-file check).
    #[error("data block {block} checksum mismatch (expected {expected:#010x}, actual {actual:#010x})")]
    BlockChecksum {
        /// The block's index in the data region.
        block: u64,
        /// The checksum stored in the shard.
        expected: u32,
        /// The checksum of the bytes as read.
        actual: u32,
    },
    /// Fields that are each well-formed but contradict one another.
    #[error("inconsistent {field}: {detail}")]
    Inconsistent {
        /// The field that does not fit.
        field: &'static str,
        /// What was expected against what was found.
        detail: String,
    },
}

/// Why bytes are not a valid replication frame (`replication::frame`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than the header or the body needs.
    #[error("truncated {what}: {needed} bytes needed, {present} present")]
    Truncated {
        /// The part that is cut short.
        what: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes there are.
        present: usize,
    },
    /// A frame (or record) longer than its cap.
    #[error("{what} of {bytes} bytes is over its cap of {max}")]
    TooLarge {
        /// What is too long.
        what: &'static str,
        /// Its length.
        bytes: usize,
        /// The cap.
        max: usize,
    },
    /// A kind byte this version does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Bytes that must be zero are not.
    #[error("nonzero reserved bytes in a {0} frame")]
    Reserved(&'static str),
    /// A field with a value outside its range.
    #[error("bad {field} in a {kind} frame: {detail}")]
    BadField {
        /// The frame's kind.
        kind: &'static str,
        /// The field.
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// What went wrong with a policy plugin. Every failure of a plugin is one of these: it never
/// panics or hangs the host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// The plugin could not be loaded: not a component, not a granary policy, or it imports
    /// something the sandbox does not offer (files, sockets).
    #[error("plugin {plugin}: refused at load: {detail}")]
    Load {
        /// The plugin's name.
        plugin: String,
        /// Why.
        detail: String,
    },
    /// The plugin trapped (a panic, an unreachable, a bad memory access).
    #[error("plugin {plugin}: trapped in {call}: {detail}")]
    Trap {
        /// The plugin's name.
        plugin: String,
        /// The call that trapped.
        call: &'static str,
        /// The trap, and what the guest printed.
        detail: String,
    },
    /// The plugin ran past the deadline of its call and was interrupted.
    #[error("plugin {plugin}: {call} ran past its deadline of {deadline_ms} ms and was interrupted")]
    Deadline {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
        /// The deadline.
        deadline_ms: u64,
    },
    /// The plugin tried to grow its memory past its cap.
    #[error("plugin {plugin}: {call} hit the memory cap of {limit_bytes} bytes")]
    MemoryLimit {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
        /// The cap.
        limit_bytes: u64,
    },
    /// The plugin overflowed its stack.
    #[error("plugin {plugin}: {call} overflowed its stack")]
    StackOverflow {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
    },
    /// The plugin ran out of fuel (fuel metering is used in tests and benchmarks).
    #[error("plugin {plugin}: {call} ran out of fuel")]
    OutOfFuel {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
    },
    /// The plugin returned something the host refuses: unknown ids, duplicates, ranges out of
    /// bounds, a plan that is not a permutation.
    #[error("plugin {plugin}: {call} returned an invalid output: {detail}")]
    InvalidOutput {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The plugin refused its input (its own `policy-error`).
    #[error("plugin {plugin}: {call} refused: {detail}")]
    Rejected {
        /// The plugin's name.
        plugin: String,
        /// The call.
        call: &'static str,
        /// The plugin's reason.
        detail: String,
    },
    /// The plugin failed too often in a row and is no longer called.
    #[error("plugin {plugin} is quarantined after {failures} consecutive failures (last: {last})")]
    Quarantined {
        /// The plugin's name.
        plugin: String,
        /// Failures in a row.
        failures: u32,
        /// The last failure.
        last: String,
    },
}

/// What went wrong on a connection between nodes. Each ends the connection; none harms the node.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A socket call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The other side closed the connection.
    #[error("the connection was closed")]
    Closed,
    /// A deadline passed.
    #[error("{what} took longer than {} ms", after.as_millis())]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The handshake failed: the other side does not hold the cluster key, or is not a node.
    #[error("handshake refused: {detail}")]
    Handshake {
        /// Why.
        detail: String,
    },
    /// The node is too busy to take the connection now (too many handshakes in progress): it
    /// said so with an empty record before closing. Trying again later may succeed.
    #[error("the node is busy (too many connections being opened at once); try again")]
    Busy,
    /// A record's length prefix is over the cap: refused before any of it is read.
    #[error("a record of {bytes} bytes is over the cap of {max}")]
    RecordTooLarge {
        /// The length the prefix claims.
        bytes: u64,
        /// The cap.
        max: usize,
    },
    /// A record did not authenticate: corrupted, forged, or replayed.
    #[error("a record failed authentication (corrupted, forged or replayed)")]
    Decrypt,
    /// An authenticated record that is not a valid frame.
    #[error("bad frame: {0}")]
    Frame(#[source] FrameError),
    /// A frame out of sequence: replayed, dropped or reordered.
    #[error("frame number {got} where {expected} was due (a replayed or reordered frame)")]
    Sequence {
        /// The sequence number due.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// A frame from another incarnation of the peer than the one that said hello.
    #[error("a frame of incarnation {got} on a connection of incarnation {expected}")]
    Epoch {
        /// The connection's incarnation.
        expected: u64,
        /// The frame's.
        got: u64,
    },
    /// A frame that is valid but not what the protocol allows here.
    #[error("protocol violation: {detail}")]
    Protocol {
        /// What happened.
        detail: String,
    },
}

impl TransportError {
    #[cfg(feature = "replication")]
    pub(crate) fn io(op: &'static str, source: std::io::Error) -> Self {
        Self::Io { op, source }
    }
}

/// Everything the engine's library API can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call failed on a path.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done ("open", "read", "rename", ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not valid in its format: truncated, corrupt metadata, unknown version.
    #[error("{}: {source}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: FormatError,
    },
    /// A data block's CRC32C does not match: the bytes were not returned.
    #[error("shard {shard}: block {block} checksum mismatch (expected {expected:#010x}, actual {actual:#010x})")]
    ChecksumMismatch {
        /// The shard holding the block.
        shard: ShardId,
        /// The block's index in the shard's data region.
        block: u64,
        /// The CRC32C stored in the shard.
        expected: u32,
        /// The CRC32C of the bytes as read.
        actual: u32,
    },
    /// Fragments that do not rebuild their shard: they disagree with one another or with the
    /// shard asked for, or the bytes they rebuild do not hash to its id. No rebuilt byte was
    /// returned.
    #[error("shard {shard}: its fragments do not rebuild it: {detail}")]
    BadFragments {
        /// The shard asked for.
        shard: ShardId,
        /// What does not check out.
        detail: String,
    },
    /// A file's BLAKE3 hash is not the id it is stored under.
    #[error("{}: content hash {actual} does not match its id {expected}", path.display())]
    HashMismatch {
        /// The file.
        path: PathBuf,
        /// The id it is stored under.
        expected: ObjectId,
        /// The hash of its bytes.
        actual: ObjectId,
    },
    /// An object-store origin failed or returned what does not check out. `origin` is the URL as
    /// given, which carries no credentials (`Origin::open` refuses one that does).
    #[error("origin {origin}: {op}: {detail}")]
    Origin {
        /// The origin's URL.
        origin: String,
        /// What was being done ("read", "upload", "fetch", ...).
        op: &'static str,
        /// What it was done to, and what went wrong.
        detail: String,
    },
    /// A dataset name that is not allowed, for example one that would escape the store root.
    #[error("invalid dataset name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A dataset, version or object that does not exist.
    #[error("not found: {what}")]
    NotFound {
        /// What was looked for.
        what: String,
    },
    /// A shard that a dataset version lists is not in the store (a peer may have it).
    #[error("not found: shard {shard} of {manifest}")]
    MissingShard {
        /// The shard.
        shard: ShardId,
        /// The version that lists it.
        manifest: ManifestId,
    },
    /// Input that cannot be ingested or a request that cannot be served as asked.
    #[error("invalid input: {detail}")]
    InvalidInput {
        /// What is wrong, in one line.
        detail: String,
    },
    /// A record index past the end of the dataset version.
    #[error("record {index} is out of range (the dataset has {n_records} records)")]
    RecordOutOfRange {
        /// The index asked for.
        index: u64,
        /// Records in the dataset version.
        n_records: u64,
    },
    /// Another process holds the store's write lock.
    #[error("store {} is locked by {}", root.display(), holder.as_deref().unwrap_or("another process"))]
    StoreLocked {
        /// The store root.
        root: PathBuf,
        /// Who holds it, as the holder wrote in the lock file (`process PID (COMMAND)`), when
        /// known.
        holder: Option<String>,
    },
    /// A store this process can read but not write: on a read-only file system, or another
    /// user's. Readers (listing, inspecting, verifying, loading) work without the write lock.
    #[error("store {} is read-only here ({detail}): reading works (ls, inspect, get, verify, loaders); writing needs a writable store", root.display())]
    ReadOnlyStore {
        /// The store root.
        root: PathBuf,
        /// Why: the file system, or the permissions.
        detail: String,
    },
    /// A directory that is not a granary store.
    #[error("{} is not a granary store ({detail})", root.display())]
    NotAStore {
        /// The directory.
        root: PathBuf,
        /// What is missing.
        detail: String,
    },
    /// A policy plugin failed and no fallback policy could take over.
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// An ingest into a dataset that exists, of records other than its current version's,
    /// without saying whether they are added to it or replace it.
    #[error(
        "dataset {name} exists ({name}@{version}{}) and this input differs ({incoming} records): append to add \
         its records to the current version's, or replace to make them the new version{}",
        records.map(|n| format!(": {n} records")).unwrap_or_default(),
        same_count_hint(*same_count_shard_bytes)
    )]
    IngestIntent {
        /// The dataset.
        name: String,
        /// Its current version.
        version: u64,
        /// Records in the current version, if the catalog knows.
        records: Option<u64>,
        /// Records this ingest would have made the version.
        incoming: u64,
        /// When the input has as many records of the same layout as the current version: the
        /// largest shard file of that version (the input may be the same records cut into
        /// shards of another size).
        same_count_shard_bytes: Option<u64>,
    },
    /// The trainer asked for a batch while it holds as many as the loader allows (waiting would
    /// never end: the loader has no buffer free until one comes back).
    #[error("the trainer holds {held} batches, the most this loader allows (`LoaderConfig::hold_max`); drop one first")]
    HoldLimit {
        /// Batches held.
        held: usize,
    },
    /// Batches were asked for on a GPU this process cannot use: no CUDA driver, no such
    /// device, or another device already in use.
    #[error("no usable GPU: {detail}")]
    NoGpu {
        /// Why (the driver's reason, or which device).
        detail: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call}: {detail}")]
    Cuda {
        /// The driver call.
        call: &'static str,
        /// The driver's error name and text.
        detail: String,
    },
    /// The catalog database failed.
    #[error("catalog: {detail} (`granary repair` rebuilds the catalog from the files)")]
    Catalog {
        /// The database's message.
        detail: String,
    },
    /// The store needs `granary repair` before this can go on: its catalog cannot be read, or a
    /// ref, a ref history or a live version's manifest is damaged, and going on could cost data.
    #[error("{what} ({detail}): run `granary repair`")]
    NeedsRepair {
        /// What is damaged, and what was not done.
        what: String,
        /// The error that found it.
        detail: String,
    },
    /// The catalog was opened in the process this one was forked from: the database's I/O
    /// threads do not exist here, and opening it would wait for them forever.
    #[error(
        "the store's catalog was opened in process {parent}, which this process ({child}) was forked \
         from, and its I/O threads do not survive a fork: write to the store (ingest, rm, gc) from a \
         process not forked after opening it, or start children with the 'spawn' method. Reading \
         (loaders, datasets) works in any process"
    )]
    CatalogForked {
        /// The process that opened the catalog first.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// A connection to another node failed.
    #[error("{peer}: {source}")]
    Transport {
        /// Which node, and where.
        peer: String,
        /// What went wrong.
        #[source]
        source: TransportError,
    },
    /// Another node answered a request with an error.
    #[error("{peer} refused {request}: {code}: {message}")]
    PeerRefused {
        /// Which node.
        peer: String,
        /// The request.
        request: &'static str,
        /// The kind of failure it reported.
        code: String,
        /// Its message.
        message: String,
    },
    /// No node could provide a verified copy, or not every copy could be made.
    #[error("{what} is unavailable: {detail}")]
    Unavailable {
        /// What was wanted.
        what: String,
        /// What each source said.
        detail: String,
    },
    /// Code the engine ran (its own, or a library it called on input it was given) panicked:
    /// what it was doing was abandoned and nothing of it was committed (see `catch_panic`).
    #[error("{what} failed inside the engine: {detail}")]
    Panicked {
        /// What was being done.
        what: String,
        /// The panic's message and where it was raised.
        detail: String,
    },
}

/// The end of an `IngestIntent` message when the input has as many records as the current
/// version: a re-ingest that changed only the shard size looks like this.
pub fn same_count_hint(shard_bytes: Option<u64>) -> String {
    match shard_bytes {
        Some(bytes) => format!(
            " (it has as many records as the current version: if only the shard size differs, its records are \
             already stored, in shards of up to {bytes} bytes)"
        ),
        None => String::new(),
    }
}

impl Error {
    /// An `Error::Io` for `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { op, path: path.into(), source }
    }

    /// An `Error::InvalidInput` with a one-line detail.
    pub fn invalid_input(detail: impl Into<String>) -> Self {
        Self::InvalidInput { detail: detail.into() }
    }

    /// True when another writer holds the store (its lock, or the catalog that comes with it,
    /// which sled releases a moment after a writer in this process closed it): worth waiting for.
    pub fn is_busy(&self) -> bool {
        match self {
            Self::StoreLocked { .. } => true,
            Self::Io { op: "open catalog", source, .. } => source.kind() == std::io::ErrorKind::WouldBlock,
            _ => false,
        }
    }

    /// True for errors that mean stored bytes are damaged (as opposed to I/O or usage errors, or
    /// a file written by a newer build, which is intact but not readable by this one).
    pub fn is_corruption(&self) -> bool {
        match self {
            Self::Format { source: FormatError::UnsupportedVersion { .. }, .. } => false,
            Self::Format { .. }
            | Self::ChecksumMismatch { .. }
            | Self::HashMismatch { .. }
            | Self::BadFragments { .. } => true,
            _ => false,
        }
    }
}

thread_local! {
    /// Depth of `catch_panic` calls on this thread: while above zero, a panic here is quiet
    /// (the hook keeps its message for the error instead of printing it).
    static CATCHING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// The message and place of the last panic caught quietly on this thread.
    static CAUGHT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Runs `work`; a panic inside it becomes `Error::Panicked` naming `what` (the panic's message
/// and place as its detail) instead of unwinding further. For the doors where input a caller
/// gave reaches code that may panic on it (another format's decoder on a hostile file), and for
/// the bindings, where no panic may cross into the host language. While it runs, a panic on
/// this thread prints nothing (the error carries it); elsewhere the process's hook is unchanged.
pub fn catch_panic<T>(what: impl FnOnce() -> String, work: impl FnOnce() -> Result<T>) -> Result<T> {
    static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CATCHING.with(std::cell::Cell::get) == 0 {
                return previous(info);
            }
            let place = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
            let message = format!("{}{place}", panic_message(info.payload()));
            CAUGHT.with(|caught| *caught.borrow_mut() = Some(message));
        }));
    });
    CATCHING.with(|depth| depth.set(depth.get() + 1));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    CATCHING.with(|depth| depth.set(depth.get() - 1));
    match outcome {
        Ok(result) => result,
        Err(payload) => {
            let detail = CAUGHT.with(|caught| caught.borrow_mut().take()).unwrap_or_else(|| panic_message(&*payload));
            Err(Error::Panicked { what: what(), detail: detail.replace('\n', " ") })
        }
    }
}

/// A panic's message: its payload's text when it is one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_owned(),
        (_, Some(text)) => text.clone(),
        _ => "a panic without a message".to_owned(),
    }
}
