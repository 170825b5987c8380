//! The frames' round trips, and every truncation, extension and bad field refused.

use super::*;
use crate::erasure::Coding;

fn coding(k: u8, m: u8) -> Coding {
    Coding::new(k, m).expect("a valid coding")
}

fn samples() -> Vec<Frame<'static>> {
    let id = ObjectId::of(b"a shard");
    let entries = (0..INVENTORY_ENTRIES_MAX as u64)
        .map(|i| InventoryEntry {
            kind: WireKind::Shard,
            id: ObjectId::of(&i.to_le_bytes()),
            bytes: i,
            cached: i % 3 == 0,
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut heat: Vec<(ObjectId, u64)> =
        (0..HEAT_ENTRIES_MAX as u64).map(|i| (ObjectId::of(&(i + 1_000_000).to_le_bytes()), i * 7)).collect();
    heat.sort_unstable();
    vec![
        Frame::Hello {
            version: PROTOCOL_VERSION,
            node_id: 7,
            role: Role::Peer,
            weight: 2,
            failure_domain: 1,
            listen: "127.0.0.1:7000",
        },
        Frame::Hello {
            version: PROTOCOL_VERSION,
            node_id: 0,
            role: Role::Client,
            weight: 0,
            failure_domain: 0,
            listen: "",
        },
        Frame::Ping(42),
        Frame::Pong { nonce: u64::MAX, generation: 3 },
        Frame::InventoryRequest { after: None },
        Frame::InventoryRequest { after: Some((WireKind::Manifest, id)) },
        Frame::Inventory { entries, more: true },
        Frame::Inventory { entries: Vec::new(), more: false },
        Frame::Get { transfer: 3, kind: WireKind::Shard, id, offset: 1 << 33 },
        Frame::Chunk { transfer: 3, offset: 4096, data: &[0xa5; CHUNK_BYTES_MAX] },
        Frame::End { transfer: 3, total_bytes: 1 << 26 },
        Frame::Reply { request: 9, code: ReplyCode::Corrupt, message: "block 3 checksum mismatch" },
        Frame::Fetch { request: 1, kind: WireKind::Manifest, id, bytes: 196, sources: vec![2, 0, 1] },
        Frame::PutRef { request: 2, goal: Goal::Replicas(3), name: "tokens", log: b"granary-ref 1\n" },
        Frame::PutRef { request: 3, goal: Goal::Coded(coding(4, 2)), name: "tokens", log: b"granary-ref 1\n" },
        Frame::Replicate { request: 4, goal: Goal::Replicas(2), mode: ReplicateMode::Node, spec: "tokens@3" },
        Frame::Replicate { request: 8, goal: Goal::Replicas(3), mode: ReplicateMode::Synchronous, spec: "tokens" },
        Frame::Replicate { request: 9, goal: Goal::Replicas(1), mode: ReplicateMode::Asynchronous, spec: "t@1" },
        Frame::Replicate { request: 10, goal: Goal::Coded(coding(10, 4)), mode: ReplicateMode::Node, spec: "t" },
        Frame::Progress { request: 4, done: 5, total: 16, last: false, code: ReplyCode::Ok, message: "" },
        Frame::StatusRequest { request: 5 },
        Frame::Status { request: 5, text: "node 1\npeer 2 up\n" },
        Frame::Repair { request: 6, id },
        Frame::MembersRequest { request: 7 },
        Frame::Members { request: 7, members: vec![(0, "10.0.0.1:7000"), (3, "[::1]:7003")] },
        Frame::HeatRequest { request: 12 },
        Frame::Heat { request: 12, free_bytes: 1 << 40, entries: heat.clone() },
        Frame::Heat { request: 13, free_bytes: 0, entries: Vec::new() },
        Frame::Accessed { request: 14, entries: heat },
    ]
}

/// Writes one encoded sample of every kind into `$GRANARY_FRAME_SEEDS` (the fuzzer's seed
/// corpus; `scripts/fuzz-seeds.sh` runs this).
#[test]
#[ignore = "writes the fuzz corpus when asked"]
fn write_frame_fuzz_seeds() {
    let dir = std::path::PathBuf::from(std::env::var("GRANARY_FRAME_SEEDS").expect("GRANARY_FRAME_SEEDS is set"));
    std::fs::create_dir_all(&dir).expect("the seed directory");
    for (i, frame) in samples().iter().enumerate() {
        let mut bytes = Vec::new();
        frame.encode(3, i as u64 + 1, &mut bytes).expect("encodes");
        std::fs::write(dir.join(format!("{:02}-{}", i, frame.kind().name())), bytes).expect("a seed file");
    }
}

#[test]
fn every_kind_round_trips() {
    let frames = samples();
    for kind in Kind::ALL {
        assert!(frames.iter().any(|f| f.kind() == kind), "{kind:?} has a sample");
    }
    for (i, frame) in frames.iter().enumerate() {
        let mut bytes = Vec::new();
        frame.encode(11, i as u64 + 1, &mut bytes).expect("encodes");
        assert!(bytes.len() <= FRAME_BYTES_MAX);
        let (header, decoded) = Frame::decode(&bytes).expect("decodes");
        assert_eq!(header, Header { kind: frame.kind(), epoch: 11, seq: i as u64 + 1 });
        assert_eq!(&decoded, frame);
        fuzz_decode(&bytes);
    }
}

#[test]
fn every_truncation_and_extension_is_refused() {
    for frame in samples() {
        let mut bytes = Vec::new();
        frame.encode(1, 1, &mut bytes).expect("encodes");
        for len in 0..bytes.len() {
            assert!(Frame::decode(&bytes[..len]).is_err(), "{:?} cut to {len} bytes decoded", frame.kind());
        }
        bytes.push(0);
        assert!(Frame::decode(&bytes).is_err(), "{:?} with a byte more decoded", frame.kind());
    }
}

#[test]
fn oversized_and_malformed_frames_are_refused() {
    let mut bytes = Vec::new();
    Frame::Ping(1).encode(1, 1, &mut bytes).expect("encodes");
    // A body length over the kind's cap is refused before the body is looked at.
    let mut long = bytes.clone();
    long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(Frame::decode(&long), Err(FrameError::TooLarge { max: 8, .. })));
    let mut unknown = bytes.clone();
    unknown[0] = 200;
    assert_eq!(Frame::decode(&unknown), Err(FrameError::UnknownKind(200)));
    let mut reserved = bytes.clone();
    reserved[2] = 1;
    assert_eq!(Frame::decode(&reserved), Err(FrameError::Reserved("Ping")));
    assert!(matches!(Frame::decode(&vec![0; FRAME_BYTES_MAX + 1]), Err(FrameError::TooLarge { what: "frame", .. })));
    // An inventory page that claims more entries than the cap, or than its bytes hold.
    let mut page = Vec::new();
    Frame::Inventory { entries: Vec::new(), more: false }.encode(1, 1, &mut page).expect("encodes");
    let mut claims = page.clone();
    claims[HEADER_BYTES..HEADER_BYTES + 2].copy_from_slice(&2000u16.to_le_bytes());
    assert!(matches!(Frame::decode(&claims), Err(FrameError::TooLarge { what: "inventory page", .. })));
    claims[HEADER_BYTES..HEADER_BYTES + 2].copy_from_slice(&3u16.to_le_bytes());
    assert!(matches!(Frame::decode(&claims), Err(FrameError::Truncated { .. })));
    // Text that is not UTF-8.
    let mut reply = Vec::new();
    Frame::Reply { request: 1, code: ReplyCode::Ok, message: "ab" }.encode(1, 1, &mut reply).expect("encodes");
    let last = reply.len() - 1;
    reply[last] = 0xff;
    assert!(matches!(Frame::decode(&reply), Err(FrameError::BadField { field: "message", .. })));
    // An empty chunk.
    let mut chunk = Vec::new();
    Frame::Chunk { transfer: 1, offset: 0, data: b"x" }.encode(1, 1, &mut chunk).expect("encodes");
    chunk.pop();
    chunk[4..8].copy_from_slice(&16u32.to_le_bytes());
    assert!(matches!(Frame::decode(&chunk), Err(FrameError::BadField { field: "data", .. })));
}

#[test]
fn goals_read_back_and_bad_codings_are_refused() {
    for text in ["replicas 3", "ec 4+2", "ec 10+4"] {
        assert_eq!(Goal::parse(text).expect(text).to_string(), text);
    }
    for text in ["replicas 0", "replicas", "ec 0+2", "ec 4+0", "ec 65+1", "ec 4-2", "copies 3"] {
        assert_eq!(Goal::parse(text), None, "{text}");
    }
    assert_eq!(Goal::Coded(coding(4, 2)).nodes(), 6);
    // On the wire: a coding whose k + m is not the node count, or out of range, or no
    // copies at all.
    let encoded = |goal: Goal| {
        let mut bytes = Vec::new();
        Frame::Replicate { request: 1, goal, mode: ReplicateMode::Node, spec: "t" }
            .encode(1, 1, &mut bytes)
            .expect("encodes");
        bytes
    };
    let mut bytes = encoded(Goal::Coded(coding(4, 2)));
    bytes[HEADER_BYTES + 4..HEADER_BYTES + 8].copy_from_slice(&5u32.to_le_bytes());
    assert!(matches!(Frame::decode(&bytes), Err(FrameError::BadField { field: "goal", .. })));
    let mut bytes = encoded(Goal::Coded(coding(4, 2)));
    bytes[HEADER_BYTES + 11] = 65;
    assert!(matches!(Frame::decode(&bytes), Err(FrameError::BadField { field: "goal", .. })));
    let mut bytes = encoded(Goal::Replicas(2));
    bytes[HEADER_BYTES + 4..HEADER_BYTES + 8].copy_from_slice(&0u32.to_le_bytes());
    assert!(matches!(Frame::decode(&bytes), Err(FrameError::BadField { field: "goal", .. })));
    // What older nodes sent (zeros there) still reads as copies.
    let bytes = encoded(Goal::Replicas(2));
    assert_eq!(&bytes[HEADER_BYTES + 11..HEADER_BYTES + 16], &[0; 5]);
}

#[test]
fn inventory_entries_must_be_sorted() {
    let id = ObjectId::of(b"x");
    let entry = InventoryEntry { kind: WireKind::Shard, id, bytes: 1, cached: false };
    let mut bytes = Vec::new();
    Frame::Inventory { entries: vec![entry, entry], more: false }.encode(1, 1, &mut bytes).expect("encodes");
    assert!(matches!(Frame::decode(&bytes), Err(FrameError::BadField { field: "entries", .. })));
}

#[test]
fn encoding_refuses_what_decoding_would() {
    let too_long = "x".repeat(ADDRESS_BYTES_MAX + 1);
    let hello =
        Frame::Hello { version: 1, node_id: 1, role: Role::Peer, weight: 1, failure_domain: 1, listen: &too_long };
    assert!(hello.encode(1, 1, &mut Vec::new()).is_err());
    let data = vec![0; CHUNK_BYTES_MAX + 1];
    assert!(Frame::Chunk { transfer: 1, offset: 0, data: &data }.encode(1, 1, &mut Vec::new()).is_err());
    // Messages for people are cut to their cap (on a character boundary), not refused.
    let long = "é".repeat(MESSAGE_BYTES_MAX);
    let mut bytes = Vec::new();
    Frame::Reply { request: 1, code: ReplyCode::Internal, message: &long }.encode(1, 1, &mut bytes).expect("encodes");
    let (_, Frame::Reply { message, .. }) = Frame::decode(&bytes).expect("decodes") else { panic!("a reply") };
    assert!(message.len() <= MESSAGE_BYTES_MAX && long.starts_with(message));
}
