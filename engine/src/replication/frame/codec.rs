//! The frames' byte codec: `Frame::decode` and `Frame::encode`, over the types and caps of
//! `frame/mod.rs`.
//!
//! Owns: the body cursor (little-endian fields, truncation refused), each kind's body layout
//! both ways, and `fuzz_decode` (decode, re-encode, compare). Never: allocates by a length
//! before checking it against the bytes present and the kind's cap, or does I/O.

use super::*;

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
