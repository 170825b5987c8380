//! The authenticated, encrypted channel between two nodes (or a node and a client).
//!
//! Owns: `ClusterKey` (the job's shared secret, never printed), `Channel` (one TCP connection
//! after a Noise handshake) and the record layer under it. A connection is: a Noise
//! `NNpsk0_25519_AESGCM_SHA256` handshake keyed with the cluster key (snow: no home-made
//! cryptography), then one `Hello` each way, then frames, each encrypted into one record:
//! `length u32 LE | ciphertext`. Invariants: a peer without the cluster key fails the handshake's
//! first message, before any application byte is read; no record longer than
//! `RECORD_BYTES_MAX` is read (its length is checked before a byte of it is); every read and
//! write has a deadline; a frame whose epoch is not the peer's `Hello` epoch, or whose sequence
//! number is not exactly the next, ends the connection (a replayed or reordered frame has no
//! effect); a node with no room for a handshake says so with an empty record (busy, which the
//! initiator retries within its deadline), never by a silent close that reads as a wrong key.
//! Never: interprets a frame beyond its header (the node does).

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::frame::{FRAME_BYTES_MAX, Frame, Kind, PROTOCOL_VERSION, RECORD_BYTES_MAX, Role, TAG_BYTES};
use crate::error::{Error, Result, TransportError};

/// The Noise protocol: a pre-shared key mixed in before the first message authenticates both
/// sides (each proves it holds the key by producing a message the other can decrypt), and
/// fresh ephemeral keys give each connection its own session keys.
const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";
/// Bound into the handshake, so a key used by another protocol cannot be confused with ours.
const PROLOGUE: &[u8] = b"granary replication";
/// The environment variable a cluster secret can come from.
pub const CLUSTER_KEY_ENV: &str = "GRANARY_CLUSTER_KEY";
/// The shortest secret accepted.
pub const SECRET_BYTES_MIN: usize = 16;
/// A connecting side must send its first handshake message within this long: a connection
/// that sends nothing holds a handshake slot only this long.
const FIRST_MESSAGE_DEADLINE: Duration = Duration::from_secs(1);
/// Handshake records are small; anything longer is not a granary peer.
const HANDSHAKE_RECORD_BYTES_MAX: usize = 256;
/// The read buffer: prefixes and small frames come out of it; a large record (a chunk) finds it
/// empty and is read straight into the record buffer, which saves a copy of every byte (measured:
/// a 256 KiB buffer, copying everything, was no faster).
const READ_BUFFER_BYTES: usize = 8 << 10;
/// Encrypted records queued before they are written in one system call.
const WRITE_BUFFER_BYTES: usize = 256 << 10;

/// The job's shared secret, as the 32-byte Noise pre-shared key derived from it.
#[derive(Clone)]
pub struct ClusterKey([u8; 32]);

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// The key of `secret` (at least 16 bytes; surrounding whitespace is not part of it).
    pub fn from_secret(secret: &[u8]) -> Result<Self> {
        let secret = secret.trim_ascii();
        if secret.len() < SECRET_BYTES_MIN {
            return Err(Error::invalid_input(format!(
                "a cluster secret of {} bytes is too short (at least {SECRET_BYTES_MIN})",
                secret.len()
            )));
        }
        Ok(Self(blake3::derive_key("granary 2026 cluster key v1", secret)))
    }

    /// The key in file `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let secret = std::fs::read(path).map_err(|e| Error::io("read cluster key", path, e))?;
        Self::from_secret(&secret).map_err(|e| match e {
            Error::InvalidInput { detail } => Error::invalid_input(format!("{}: {detail}", path.display())),
            other => other,
        })
    }

    /// The key of the environment variable `GRANARY_CLUSTER_KEY`, if it is set: the secret
    /// itself, or the path of a file holding it (a value with a `/` that names a file; a secret
    /// `cluster-key` makes is hex, which has none).
    pub fn from_env() -> Result<Option<Self>> {
        std::env::var_os(CLUSTER_KEY_ENV).map(|value| Self::from_env_value(&value)).transpose()
    }

    /// The key of `value`, as `GRANARY_CLUSTER_KEY` holds it (see `from_env`).
    fn from_env_value(value: &std::ffi::OsStr) -> Result<Self> {
        let path = Path::new(value);
        if value.as_encoded_bytes().contains(&b'/') && path.is_file() {
            return Self::from_file(path);
        }
        // Never echoes the value: it may be the secret.
        Self::from_secret(value.as_encoded_bytes()).map_err(|e| match e {
            Error::InvalidInput { detail } => {
                Error::invalid_input(format!("{CLUSTER_KEY_ENV} is neither a file's path nor a secret: {detail}"))
            }
            other => other,
        })
    }

    /// A new random secret (64 hex digits) for a key file.
    pub fn generate_secret() -> Result<String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| Error::io("read randomness", "getrandom", std::io::Error::other(e.to_string())))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// Deadlines of a channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// Connecting and the whole handshake, `Hello`s included.
    pub handshake: Duration,
    /// Reading one record once its first byte is awaited, and writing one record.
    pub io: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self { handshake: Duration::from_secs(5), io: Duration::from_secs(10) }
    }
}

/// What one side of a connection says of itself in its `Hello` (this side's, sent; or the
/// other side's, as received).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The node's id (0 for a client).
    pub node_id: u32,
    /// Peer or client.
    pub role: Role,
    /// The node's placement weight.
    pub weight: u32,
    /// The node's failure domain.
    pub failure_domain: u32,
    /// Where the node listens ("" for a client).
    pub listen: String,
    /// The node's incarnation (0 for a client).
    pub epoch: u64,
}

/// One authenticated, encrypted connection.
pub struct Channel {
    /// Reads are buffered; writes go through to the socket (from `out`).
    stream: BufReader<TcpStream>,
    noise: snow::TransportState,
    peer_addr: SocketAddr,
    deadlines: Deadlines,
    /// One record as read: ciphertext.
    record: Box<[u8]>,
    /// The plaintext of the last record read.
    plain: Box<[u8]>,
    plain_len: usize,
    /// Scratch: an encoded frame.
    frame_out: Vec<u8>,
    /// Records queued to be written: `out[..queued]` (never cleared: every byte sent is
    /// written first).
    out: Vec<u8>,
    queued: usize,
    local_epoch: u64,
    sent: u64,
    peer_epoch: u64,
    received: u64,
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel").field("peer", &self.peer_addr).field("sent", &self.sent).finish_non_exhaustive()
    }
}

fn noise_builder(key: &ClusterKey) -> std::result::Result<snow::Builder<'_>, snow::Error> {
    let params: snow::params::NoiseParams = NOISE_PARAMS.parse().expect("the protocol name is valid");
    snow::Builder::new(params).psk(0, &key.0)?.prologue(PROLOGUE)
}

fn noise_error(e: snow::Error) -> TransportError {
    match e {
        snow::Error::Decrypt => TransportError::Decrypt,
        other => TransportError::Protocol { detail: format!("noise: {other}") },
    }
}

impl Channel {
    /// Connects to `addr`, runs the handshake and exchanges `Hello`s. A node that answers busy
    /// is tried again after a pause (doubling from 20 ms) until the handshake deadline.
    pub async fn connect(
        addr: SocketAddr,
        key: &ClusterKey,
        hello: &Hello,
        deadlines: Deadlines,
    ) -> std::result::Result<(Channel, Hello), TransportError> {
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(20);
        loop {
            let left = deadlines.handshake.saturating_sub(started.elapsed());
            match Self::connect_once(addr, key, hello, Deadlines { handshake: left, ..deadlines }).await {
                Err(TransportError::Busy) if started.elapsed() + pause < deadlines.handshake => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(TransportError::Timeout { what, .. }) => {
                    return Err(TransportError::Timeout { what, after: deadlines.handshake });
                }
                outcome => return outcome,
            }
        }
    }

    async fn connect_once(
        addr: SocketAddr,
        key: &ClusterKey,
        hello: &Hello,
        deadlines: Deadlines,
    ) -> std::result::Result<(Channel, Hello), TransportError> {
        let handshake = async {
            let stream = TcpStream::connect(addr).await.map_err(|e| TransportError::io("connect", e))?;
            stream.set_nodelay(true).map_err(|e| TransportError::io("set TCP_NODELAY", e))?;
            let mut stream = stream;
            let mut noise = noise_builder(key).and_then(|b| b.build_initiator()).map_err(noise_error)?;
            let mut message = [0u8; HANDSHAKE_RECORD_BYTES_MAX];
            let n = noise.write_message(&[], &mut message).map_err(noise_error)?;
            write_record(&mut stream, &message[..n]).await?;
            // A node that cannot decrypt the first message closes the connection: that is how a
            // wrong key looks from this side. One with no room for the handshake says so first,
            // with an empty record.
            let n = read_handshake_record(&mut stream, &mut message).await.map_err(|e| match e {
                TransportError::Closed => TransportError::Handshake {
                    detail: "the other side closed the connection: it does not hold this cluster key \
                             (or is not a granary node)"
                        .to_owned(),
                },
                other => other,
            })?;
            if n == 0 {
                return Err(TransportError::Busy);
            }
            let mut payload = [0u8; HANDSHAKE_RECORD_BYTES_MAX];
            noise.read_message(&message[..n], &mut payload).map_err(|e| match e {
                snow::Error::Decrypt => TransportError::Handshake {
                    detail: "the peer does not hold this cluster key (or is not a granary node)".to_owned(),
                },
                other => noise_error(other),
            })?;
            let noise = noise.into_transport_mode().map_err(noise_error)?;
            let mut channel = Channel::new(stream, noise, addr, deadlines, hello.epoch);
            channel.send(&hello_frame(hello)).await?;
            let peer = channel.recv_hello().await?;
            Ok((channel, peer))
        };
        tokio::time::timeout(deadlines.handshake, handshake)
            .await
            .unwrap_or(Err(TransportError::Timeout { what: "connection handshake", after: deadlines.handshake }))
    }

    /// Runs the responder's side of the handshake on an accepted connection and exchanges
    /// `Hello`s. A peer without the cluster key is refused here, after its first message.
    /// `evicted` completes when the node needs this connection's room for another one: if that
    /// happens before the first message has authenticated, the connection is told it is busy
    /// and closed (`TransportError::Busy`); `authenticated` is called once it has.
    pub async fn accept(
        stream: TcpStream,
        key: &ClusterKey,
        hello: &Hello,
        deadlines: Deadlines,
        evicted: impl std::future::Future<Output = ()>,
        authenticated: impl FnOnce(),
    ) -> std::result::Result<(Channel, Hello), TransportError> {
        let handshake = async {
            let peer_addr = stream.peer_addr().map_err(|e| TransportError::io("peer address", e))?;
            stream.set_nodelay(true).map_err(|e| TransportError::io("set TCP_NODELAY", e))?;
            let mut stream = stream;
            let mut noise = noise_builder(key).and_then(|b| b.build_responder()).map_err(noise_error)?;
            let mut message = [0u8; HANDSHAKE_RECORD_BYTES_MAX];
            let first = FIRST_MESSAGE_DEADLINE.min(deadlines.handshake);
            let read = tokio::select! {
                read = tokio::time::timeout(first, read_handshake_record(&mut stream, &mut message)) => Some(read),
                () = evicted => None,
            };
            let Some(read) = read else {
                refuse_busy(&stream);
                return Err(TransportError::Busy);
            };
            let n =
                read.map_err(|_| TransportError::Timeout { what: "the first handshake message", after: first })??;
            let mut payload = [0u8; HANDSHAKE_RECORD_BYTES_MAX];
            noise.read_message(&message[..n], &mut payload).map_err(|e| match e {
                snow::Error::Decrypt => TransportError::Handshake {
                    detail: "the connecting side does not hold this cluster key".to_owned(),
                },
                other => noise_error(other),
            })?;
            authenticated();
            let n = noise.write_message(&[], &mut message).map_err(noise_error)?;
            write_record(&mut stream, &message[..n]).await?;
            let noise = noise.into_transport_mode().map_err(noise_error)?;
            let mut channel = Channel::new(stream, noise, peer_addr, deadlines, hello.epoch);
            // A replayed first message gets this far; its sender cannot produce the Hello, and
            // holds the handshake slot only as long as an honest peer needs to send it.
            let peer = tokio::time::timeout(first, channel.recv_hello())
                .await
                .map_err(|_| TransportError::Timeout { what: "the Hello", after: first })??;
            channel.send(&hello_frame(hello)).await?;
            Ok((channel, peer))
        };
        tokio::time::timeout(deadlines.handshake, handshake)
            .await
            .unwrap_or(Err(TransportError::Timeout { what: "connection handshake", after: deadlines.handshake }))
    }

    fn new(
        stream: TcpStream,
        noise: snow::TransportState,
        peer_addr: SocketAddr,
        deadlines: Deadlines,
        local_epoch: u64,
    ) -> Channel {
        Channel {
            stream: BufReader::with_capacity(READ_BUFFER_BYTES, stream),
            noise,
            peer_addr,
            deadlines,
            record: vec![0; RECORD_BYTES_MAX].into_boxed_slice(),
            plain: vec![0; FRAME_BYTES_MAX].into_boxed_slice(),
            plain_len: 0,
            frame_out: Vec::with_capacity(FRAME_BYTES_MAX),
            // Room for one record; grown to a batch's worth by the first stream of chunks.
            out: vec![0; 4 + RECORD_BYTES_MAX],
            queued: 0,
            local_epoch,
            sent: 0,
            peer_epoch: 0,
            received: 0,
        }
    }

    async fn recv_hello(&mut self) -> std::result::Result<Hello, TransportError> {
        let (header_epoch, frame) = self.recv_raw().await?;
        let Frame::Hello { version, node_id, role, weight, failure_domain, listen } = frame else {
            return Err(TransportError::Protocol { detail: format!("expected Hello first, got {:?}", frame.kind()) });
        };
        if version != PROTOCOL_VERSION {
            return Err(TransportError::Protocol {
                detail: format!("the peer speaks protocol version {version}, this node {PROTOCOL_VERSION}"),
            });
        }
        let peer = Hello { node_id, role, weight, failure_domain, listen: listen.to_owned(), epoch: header_epoch };
        self.peer_epoch = header_epoch;
        Ok(peer)
    }

    /// The address of the other end.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Encrypts and sends one frame (and any queued before it).
    pub async fn send(&mut self, frame: &Frame<'_>) -> std::result::Result<(), TransportError> {
        self.queue(frame).await?;
        self.flush().await
    }

    /// Encrypts one frame into the write queue; the queue is written out when it is full or at
    /// the next `flush` (or `send`). For streams of frames (an object's chunks).
    pub async fn queue(&mut self, frame: &Frame<'_>) -> std::result::Result<(), TransportError> {
        self.frame_out.clear();
        frame.encode(self.local_epoch, self.sent + 1, &mut self.frame_out).map_err(TransportError::Frame)?;
        let at = self.queued;
        if at + 4 + RECORD_BYTES_MAX > self.out.len() {
            self.out.resize(WRITE_BUFFER_BYTES + 4 + RECORD_BYTES_MAX, 0);
        }
        let n = self.noise.write_message(&self.frame_out, &mut self.out[at + 4..]).map_err(noise_error)?;
        // The peer refuses a longer record before reading it.
        debug_assert!((TAG_BYTES..=RECORD_BYTES_MAX).contains(&n), "a record of {n} bytes");
        self.out[at..at + 4].copy_from_slice(&(n as u32).to_le_bytes());
        self.queued += 4 + n;
        self.sent += 1;
        if self.queued >= WRITE_BUFFER_BYTES {
            self.flush().await?;
        }
        Ok(())
    }

    /// Writes out the queued records.
    pub async fn flush(&mut self) -> std::result::Result<(), TransportError> {
        if self.queued == 0 {
            return Ok(());
        }
        let deadline = self.deadlines.io;
        let queued = self.queued;
        self.queued = 0;
        tokio::time::timeout(deadline, self.stream.get_mut().write_all(&self.out[..queued]))
            .await
            .map_err(|_| TransportError::Timeout { what: "sending frames", after: deadline })?
            .map_err(|e| TransportError::io("write", e))
    }

    /// Receives one frame, waiting at most `idle` for it to start (the per-record deadline
    /// applies once it has).
    pub async fn recv_within(&mut self, idle: Duration) -> std::result::Result<Frame<'_>, TransportError> {
        // Whatever was queued is due before an answer can come.
        self.flush().await?;
        let mut prefix = [0u8; 4];
        tokio::time::timeout(idle, self.stream.read_exact(&mut prefix))
            .await
            .map_err(|_| TransportError::Timeout { what: "waiting for a frame", after: idle })?
            .map_err(closed_or_io)?;
        self.finish_recv(prefix).await
    }

    /// Receives one frame within the I/O deadline.
    pub async fn recv(&mut self) -> std::result::Result<Frame<'_>, TransportError> {
        self.recv_within(self.deadlines.io).await
    }

    async fn recv_raw(&mut self) -> std::result::Result<(u64, Frame<'_>), TransportError> {
        let mut prefix = [0u8; 4];
        let deadline = self.deadlines.io;
        tokio::time::timeout(deadline, self.stream.read_exact(&mut prefix))
            .await
            .map_err(|_| TransportError::Timeout { what: "waiting for a frame", after: deadline })?
            .map_err(closed_or_io)?;
        self.read_record(prefix).await?;
        let (header, frame) = Frame::decode(&self.plain[..self.plain_len]).map_err(TransportError::Frame)?;
        if header.seq != self.received + 1 {
            return Err(TransportError::Sequence { expected: self.received + 1, got: header.seq });
        }
        self.received += 1;
        Ok((header.epoch, frame))
    }

    /// Reads the record whose length prefix is `prefix`, and decrypts it.
    async fn read_record(&mut self, prefix: [u8; 4]) -> std::result::Result<(), TransportError> {
        let deadline = self.deadlines.io;
        let stream = &mut self.stream;
        let record = &mut self.record;
        let read = async {
            let len = u32::from_le_bytes(prefix) as usize;
            // The length is checked before any byte of the record is read.
            if len > RECORD_BYTES_MAX {
                return Err(TransportError::RecordTooLarge { bytes: len as u64, max: RECORD_BYTES_MAX });
            }
            if len < TAG_BYTES {
                return Err(TransportError::Protocol {
                    detail: format!("a record of {len} bytes has no room for its tag"),
                });
            }
            stream.read_exact(&mut record[..len]).await.map_err(closed_or_io)?;
            Ok(len)
        };
        let len = tokio::time::timeout(deadline, read)
            .await
            .map_err(|_| TransportError::Timeout { what: "reading a frame", after: deadline })??;
        self.plain_len = self.noise.read_message(&self.record[..len], &mut self.plain).map_err(noise_error)?;
        Ok(())
    }

    async fn finish_recv(&mut self, prefix: [u8; 4]) -> std::result::Result<Frame<'_>, TransportError> {
        self.read_record(prefix).await?;
        let (header, frame) = Frame::decode(&self.plain[..self.plain_len]).map_err(TransportError::Frame)?;
        if header.epoch != self.peer_epoch {
            return Err(TransportError::Epoch { expected: self.peer_epoch, got: header.epoch });
        }
        if header.seq != self.received + 1 {
            return Err(TransportError::Sequence { expected: self.received + 1, got: header.seq });
        }
        if header.kind == Kind::Hello {
            return Err(TransportError::Protocol { detail: "a second Hello".to_owned() });
        }
        debug_assert!(self.plain_len <= self.plain.len(), "a frame inside its buffer");
        self.received += 1;
        Ok(frame)
    }

    /// Sends raw bytes as they are, bypassing encryption: for tests of what a node does with a
    /// malformed stream.
    #[doc(hidden)]
    pub async fn send_raw_for_tests(&mut self, bytes: &[u8]) -> std::result::Result<(), TransportError> {
        self.flush().await?;
        self.stream.get_mut().write_all(bytes).await.map_err(|e| TransportError::io("write", e))
    }

    /// Encrypts a frame with an explicit epoch and sequence number, for tests of replay
    /// protection. Returns the record as sent, so a test can send it again byte for byte.
    #[doc(hidden)]
    pub async fn send_with_seq_for_tests(
        &mut self,
        frame: &Frame<'_>,
        epoch: u64,
        seq: u64,
    ) -> std::result::Result<Vec<u8>, TransportError> {
        self.frame_out.clear();
        frame.encode(epoch, seq, &mut self.frame_out).map_err(TransportError::Frame)?;
        let mut wire = vec![0u8; 4 + self.frame_out.len() + TAG_BYTES];
        let n = self.noise.write_message(&self.frame_out, &mut wire[4..]).map_err(noise_error)?;
        wire[..4].copy_from_slice(&(n as u32).to_le_bytes());
        wire.truncate(4 + n);
        self.flush().await?;
        self.stream.get_mut().write_all(&wire).await.map_err(|e| TransportError::io("write", e))?;
        self.sent = self.sent.max(seq);
        Ok(wire)
    }
}

fn hello_frame(hello: &Hello) -> Frame<'_> {
    Frame::Hello {
        version: PROTOCOL_VERSION,
        node_id: hello.node_id,
        role: hello.role,
        weight: hello.weight,
        failure_domain: hello.failure_domain,
        listen: &hello.listen,
    }
}

fn closed_or_io(e: std::io::Error) -> TransportError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
            TransportError::Closed
        }
        _ => TransportError::io("read", e),
    }
}

/// Tells a connection that has not finished its handshake that the node is busy (an empty
/// record, which no handshake message is) and lets it close: never waits, since the node does
/// this when it has no room. What the other side sent is read away first, so that the close is
/// an orderly one (closing over unread bytes resets the connection, which may discard the
/// record before the other side reads it).
pub fn refuse_busy(stream: &TcpStream) {
    // A handshake message is one read's worth; a few more bound the work a sender that keeps
    // writing can cause here.
    let mut sink = [0u8; HANDSHAKE_RECORD_BYTES_MAX];
    for _ in 0..4 {
        if !matches!(stream.try_read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
    let _ = stream.try_write(&0u32.to_le_bytes());
}

async fn write_record(stream: &mut TcpStream, message: &[u8]) -> std::result::Result<(), TransportError> {
    let mut wire = Vec::with_capacity(4 + message.len());
    wire.extend_from_slice(&(message.len() as u32).to_le_bytes());
    wire.extend_from_slice(message);
    stream.write_all(&wire).await.map_err(|e| TransportError::io("write", e))
}

async fn read_handshake_record(
    stream: &mut TcpStream,
    out: &mut [u8; HANDSHAKE_RECORD_BYTES_MAX],
) -> std::result::Result<usize, TransportError> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).await.map_err(closed_or_io)?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > HANDSHAKE_RECORD_BYTES_MAX {
        return Err(TransportError::RecordTooLarge { bytes: len as u64, max: HANDSHAKE_RECORD_BYTES_MAX });
    }
    stream.read_exact(&mut out[..len]).await.map_err(closed_or_io)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_holds_the_secret_or_its_files_path_and_never_shows_it() {
        let secret = ClusterKey::generate_secret().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("job.key");
        std::fs::write(&file, format!("{secret}\n")).unwrap();
        let by_value = ClusterKey::from_env_value(std::ffi::OsStr::new(&secret)).unwrap();
        let by_path = ClusterKey::from_env_value(file.as_os_str()).unwrap();
        assert!(by_value.0 == by_path.0, "the file's secret and the secret itself are one key");
        let short = "a/short/secret";
        let error = ClusterKey::from_env_value(std::ffi::OsStr::new(short)).err().unwrap().to_string();
        assert!(error.contains("neither a file's path nor a secret") && !error.contains(short), "{error}");
    }
}
