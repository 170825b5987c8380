//! The bytes of a LitData chunk beyond its offset table: the frames of an `LDFZ01` chunk (zstd in
//! batches of items) and the Arrow IPC file a chunk of dict items carries at its end (`LDARW01`).
//!
//! Owns: `framed`, `arrow_footer`, `check_arrow_file` and `unzstd`. Never: decodes an item's
//! leaves or the footer's rows, takes a frame or a footer whose offsets run outside its chunk, or
//! decompresses past the length the chunk (or the index) claims.

/// The magic that ends a chunk carrying its items as an Arrow IPC file.
const ARROW_FOOTER_MAGIC: &[u8; 8] = b"LDARW01\0";

/// The Arrow IPC file at the end of a chunk's `data`, when it ends with LitData's footer magic.
pub(super) fn arrow_footer(data: &[u8]) -> std::result::Result<Option<&[u8]>, String> {
    let Some(body) = data.strip_suffix(ARROW_FOOTER_MAGIC) else { return Ok(None) };
    let Some(length_at) = body.len().checked_sub(4) else { return Err("an Arrow footer without its length".into()) };
    let length = u32::from_le_bytes([body[length_at], body[length_at + 1], body[length_at + 2], body[length_at + 3]]);
    let start = length_at
        .checked_sub(length as usize)
        .filter(|_| length > 0)
        .ok_or_else(|| format!("an Arrow footer of {length} bytes in a chunk of {}", data.len()))?;
    Ok(Some(&body[start..length_at]))
}

/// What an Arrow footer's compressed buffers may decompress to, in all: this many times the
/// footer's own bytes, and never less than `ARROW_UNPACKED_FLOOR`. arrow-ipc allocates what a
/// buffer claims before it decompresses it.
const ARROW_UNPACKED_RATIO: u64 = 64;
const ARROW_UNPACKED_FLOOR: u64 = 64 << 20;

/// Checks the Arrow IPC file `ipc` (a chunk's footer) before arrow-ipc reads it, which trusts
/// what it says: every block its footer lists (record batches, dictionaries) lies inside it, and
/// the lengths its compressed buffers claim add up to no more than `ARROW_UNPACKED_RATIO` times
/// its size (or `ARROW_UNPACKED_FLOOR`). What arrow-ipc then refuses it refuses by itself.
pub(super) fn check_arrow_file(ipc: &[u8]) -> std::result::Result<(), String> {
    let trailer_at = ipc.len().checked_sub(10).ok_or("an Arrow file shorter than its trailer")?;
    let trailer: [u8; 10] = ipc[trailer_at..].try_into().map_err(|_| "an Arrow file shorter than its trailer")?;
    let footer_len = arrow_ipc::reader::read_footer_length(trailer).map_err(|e| e.to_string())?;
    let footer_at = trailer_at
        .checked_sub(footer_len)
        .ok_or_else(|| format!("an Arrow file's footer of {footer_len} bytes in {}", ipc.len()))?;
    let footer = arrow_ipc::root_as_footer(&ipc[footer_at..trailer_at])
        .map_err(|e| format!("an Arrow file's footer cannot be read: {e}"))?;
    let limit = (ipc.len() as u64).saturating_mul(ARROW_UNPACKED_RATIO).max(ARROW_UNPACKED_FLOOR);
    let mut claimed = 0u64;
    let blocks = footer.recordBatches().into_iter().flatten().chain(footer.dictionaries().into_iter().flatten());
    for block in blocks {
        let (offset, meta, body) = (block.offset(), block.metaDataLength(), block.bodyLength());
        let place = |n: i64| usize::try_from(n).ok();
        let (Some(start), Some(meta_len), Some(body_len)) = (place(offset), place(meta.into()), place(body)) else {
            return Err(format!("an Arrow block at {offset} of {meta} + {body} bytes"));
        };
        let end = start.checked_add(meta_len).and_then(|at| at.checked_add(body_len)).filter(|&end| end <= footer_at);
        let Some(end) = end else {
            return Err(format!("an Arrow block at {offset} of {meta} + {body} bytes past the file's {footer_at}"));
        };
        claimed = claimed.saturating_add(unpacked_claims(&ipc[start..end], meta_len)?);
        if claimed > limit {
            return Err(format!(
                "an Arrow file of {} bytes whose buffers claim more than {limit} bytes decompressed: refused",
                ipc.len()
            ));
        }
    }
    Ok(())
}

/// The lengths the compressed buffers of one block (its message, then its body, `meta_len`
/// bytes in) say they decompress to, in all; 0 for a block whose body is not compressed.
fn unpacked_claims(block: &[u8], meta_len: usize) -> std::result::Result<u64, String> {
    let message = match block.get(..4) {
        Some([0xFF, 0xFF, 0xFF, 0xFF]) => block.get(8..meta_len),
        _ => block.get(4..meta_len),
    }
    .ok_or("an Arrow block shorter than its message")?;
    let message = arrow_ipc::root_as_message(message).map_err(|e| format!("an Arrow message cannot be read: {e}"))?;
    let batch = match message.header_as_record_batch() {
        Some(batch) => batch,
        None => match message.header_as_dictionary_batch().and_then(|d| d.data()) {
            Some(batch) => batch,
            None => return Ok(0),
        },
    };
    if batch.compression().is_none() {
        return Ok(0);
    }
    let body = &block[meta_len..];
    let mut claimed = 0u64;
    for buffer in batch.buffers().into_iter().flatten() {
        // An empty buffer is written without a length (pyarrow's validity of a column of no
        // null): what is at its offset is the next buffer's.
        if buffer.length() < 8 {
            continue;
        }
        let at = usize::try_from(buffer.offset()).ok();
        // A compressed buffer starts with its decompressed length (-1: stored as it is).
        let Some(prefix) = at.and_then(|at| body.get(at..at.checked_add(8)?)) else { continue };
        let length = i64::from_le_bytes(prefix.try_into().unwrap_or([0; 8]));
        claimed = claimed.saturating_add(u64::try_from(length).unwrap_or(0));
    }
    Ok(claimed)
}

/// Most bytes a classic chunk can address (its offsets are `u32`): the bound of what one of its
/// items, or the whole of it, decompresses to when nothing tighter is said.
pub(super) const CLASSIC_BYTES_MAX: u64 = u32::MAX as u64;

/// `packed`, one or more zstd frames, decompressed; refused at the first byte past `limit`, so a
/// decompression bomb costs no more memory than what it claims to hold.
pub(super) fn unzstd(packed: &[u8], limit: u64) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    let mut out = Vec::with_capacity(usize::try_from(limit).unwrap_or(usize::MAX).min(64 << 20));
    let decoder = zstd::stream::read::Decoder::new(packed).map_err(|e| format!("not zstd: {e}"))?;
    decoder.take(limit.saturating_add(1)).read_to_end(&mut out).map_err(|e| format!("not zstd: {e}"))?;
    if out.len() as u64 > limit {
        return Err(format!("it decompresses to more than the {limit} bytes it claims: refused"));
    }
    Ok(out)
}

/// What one zstd frame says it decompresses to, when its header says (LitData's compressor
/// writes it); else `otherwise`.
pub(super) fn frame_content_size(packed: &[u8], otherwise: u64) -> u64 {
    match zstd::zstd_safe::get_frame_content_size(packed) {
        Ok(Some(size)) => size.min(otherwise),
        _ => otherwise,
    }
}

/// The items of an `LDFZ01` chunk: each frame decompressed and checked against its lengths, the
/// items cut at the directory's offsets.
pub(super) fn framed(data: &[u8], expected: u64) -> std::result::Result<Vec<Vec<u8>>, String> {
    const PREFIX: usize = 24;
    const FRAME: usize = 24;
    if data.len() < PREFIX || &data[..8] != b"LDFZ01\0\0" {
        return Err("no LDFZ01 directory".into());
    }
    let u16_at = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    let u32_at = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let version = u16_at(8);
    if version != 1 {
        return Err(format!("LDFZ01 version {version}"));
    }
    let (count, frames) = (u32_at(12).unwrap_or(0), u32_at(20).unwrap_or(0) as usize);
    if u64::from(count) != expected || count == 0 {
        return Err(format!("{count} items where the index says {expected}"));
    }
    let count = count as usize;
    let offsets: Vec<usize> = (0..=count)
        .map(|i| u32_at(PREFIX + 4 * i).map(|o| o as usize))
        .collect::<Option<_>>()
        .ok_or("its offsets run past its end")?;
    let table = PREFIX + 4 * (count + 1);
    // The frames' lengths, summed before anything is decompressed, are the items' end: each
    // frame is then decompressed to no more than its entry says.
    let mut claimed = 0_u64;
    for f in 0..frames {
        let at = table + FRAME * f + 20;
        let raw_len = u32_at(at).ok_or("its frame table runs past its end")?;
        claimed += u64::from(raw_len);
    }
    if claimed != offsets[count] as u64 {
        return Err(format!("its frames hold {claimed} bytes where its offsets end at {}", offsets[count]));
    }
    let mut joined = Vec::with_capacity(offsets[count].min(64 << 20));
    for f in 0..frames {
        let at = table + FRAME * f;
        let entry = data.get(at..at + FRAME).ok_or("its frame table runs past its end")?;
        let word = |i: usize| u32::from_le_bytes([entry[i], entry[i + 1], entry[i + 2], entry[i + 3]]) as usize;
        let offset =
            u64::from_le_bytes([entry[8], entry[9], entry[10], entry[11], entry[12], entry[13], entry[14], entry[15]]);
        let (packed_len, raw_len) = (word(16), word(20));
        let start = usize::try_from(offset).map_err(|_| "a frame past the end".to_owned())?;
        let packed = start
            .checked_add(packed_len)
            .and_then(|end| data.get(start..end))
            .ok_or_else(|| format!("frame {f} runs past the chunk"))?;
        let raw = unzstd(packed, raw_len as u64).map_err(|e| format!("frame {f}: {e}"))?;
        if raw.len() != raw_len {
            return Err(format!("frame {f} holds {} bytes where its entry says {raw_len}", raw.len()));
        }
        joined.extend_from_slice(&raw);
    }
    let mut items = Vec::with_capacity(count);
    for (i, pair) in offsets.windows(2).enumerate() {
        let (start, end) = (pair[0], pair[1]);
        if start > end || end > joined.len() {
            return Err(format!("item {i} at bytes {start}..{end} of {}", joined.len()));
        }
        items.push(joined[start..end].to_vec());
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Arrow IPC file of one zstd-compressed batch: a million empty strings (an empty values
    /// buffer, which has no length written) and a million zeros, which compress to almost
    /// nothing.
    fn ipc_file() -> Vec<u8> {
        use std::sync::Arc;

        use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
        let empty: ArrayRef = Arc::new(StringArray::from(vec![""; 1 << 20]));
        let zeros: ArrayRef = Arc::new(Int64Array::from(vec![0i64; 1 << 20]));
        let batch = RecordBatch::try_from_iter([("empty", empty), ("zeros", zeros)]).unwrap();
        let options = arrow_ipc::writer::IpcWriteOptions::default()
            .try_with_compression(Some(arrow_ipc::CompressionType::ZSTD))
            .unwrap();
        let mut out = Vec::new();
        let mut writer =
            arrow_ipc::writer::FileWriter::try_new_with_options(&mut out, &batch.schema(), options).unwrap();
        writer.write(&batch).unwrap();
        writer.finish().unwrap();
        drop(writer);
        out
    }

    #[test]
    fn arrow_blocks_past_the_file_and_buffers_claiming_too_much_are_refused() {
        let ipc = ipc_file();
        // 4 MiB of offsets and 8 MiB of zeros in a file of a few KiB: within the floor.
        assert!(ipc.len() < 1 << 16, "{}", ipc.len());
        check_arrow_file(&ipc).unwrap();
        arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(&ipc[..]), None).unwrap();

        // The footer's block (offset i64, metadata length i32, padding, body length i64) found
        // by its values, and its body length made 1 TiB: arrow-ipc would allocate that first.
        let trailer_at = ipc.len() - 10;
        let footer_len = arrow_ipc::reader::read_footer_length(ipc[trailer_at..].try_into().unwrap()).unwrap();
        let footer_at = trailer_at - footer_len;
        let block = *arrow_ipc::root_as_footer(&ipc[footer_at..trailer_at]).unwrap().recordBatches().unwrap().get(0);
        let mut pattern = block.offset().to_le_bytes().to_vec();
        pattern.extend_from_slice(&block.metaDataLength().to_le_bytes());
        let at = footer_at + ipc[footer_at..].windows(pattern.len()).position(|w| w == pattern).unwrap();
        let mut huge_block = ipc.clone();
        huge_block[at + 16..at + 24].copy_from_slice(&(1i64 << 40).to_le_bytes());
        assert!(check_arrow_file(&huge_block).unwrap_err().contains("past the file"));
        let mut negative = ipc.clone();
        negative[at..at + 8].copy_from_slice(&(-8i64).to_le_bytes());
        assert!(check_arrow_file(&negative).unwrap_err().contains("an Arrow block at -8"));

        // Exactly what the buffers claim: the strings' offsets and the zeros, nothing counted
        // twice for the empty buffers (validity, the strings' values) standing at others'.
        let block_bytes = &ipc[block.offset() as usize..];
        let claimed = unpacked_claims(block_bytes, block.metaDataLength() as usize).unwrap();
        assert_eq!(claimed, ((1 << 20) + 1) * 4 + (1 << 20) * 8);

        // The first buffer's decompressed length (the 8 bytes that start it in the body) made
        // 1 TiB: refused before anything is allocated for it.
        let body_at = block.offset() as usize + block.metaDataLength() as usize;
        let mut bomb = ipc.clone();
        bomb[body_at..body_at + 8].copy_from_slice(&(1i64 << 40).to_le_bytes());
        assert!(check_arrow_file(&bomb).unwrap_err().contains("claim more than"));
        // Every prefix and a flipped byte anywhere: checked or refused, never a panic.
        for cut in (0..ipc.len()).step_by(7) {
            let _ = check_arrow_file(&ipc[..cut]);
            let mut flipped = ipc.clone();
            flipped[cut] ^= 0x40;
            let _ = check_arrow_file(&flipped);
        }
    }

    #[test]
    fn framed_chunks_are_read_and_bad_ones_refused() {
        // Two items, "ab" and "cde", in one frame.
        let raw = b"abcde";
        let packed = zstd::stream::encode_all(&raw[..], 3).unwrap();
        let mut data = b"LDFZ01\0\0".to_vec();
        data.extend_from_slice(&1u16.to_le_bytes());
        data.extend_from_slice(&0u16.to_le_bytes());
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&256u32.to_le_bytes());
        data.extend_from_slice(&1u32.to_le_bytes());
        for offset in [0u32, 2, 5] {
            data.extend_from_slice(&offset.to_le_bytes());
        }
        let payload_at = (data.len() + 24) as u64;
        data.extend_from_slice(&0u32.to_le_bytes());
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&payload_at.to_le_bytes());
        data.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        data.extend_from_slice(&5u32.to_le_bytes());
        data.extend_from_slice(&packed);
        assert_eq!(framed(&data, 2).unwrap(), [b"ab".to_vec(), b"cde".to_vec()]);
        assert!(framed(&data, 3).unwrap_err().contains("index says 3"));
        for cut in 0..data.len() {
            assert!(framed(&data[..cut], 2).is_err(), "a chunk cut at {cut}");
        }
        let mut wrong = data.clone();
        let at = wrong.len() - packed.len() - 4;
        wrong[at..at + 4].copy_from_slice(&6u32.to_le_bytes());
        let error = framed(&wrong, 2).unwrap_err();
        assert!(error.contains("its frames hold 6 bytes where its offsets end at 5"), "{error}");
        // Entries and offsets that agree on 4 bytes, a frame of 5: refused at the fifth.
        let mut short = wrong;
        short[at..at + 4].copy_from_slice(&4u32.to_le_bytes());
        short[32..36].copy_from_slice(&4u32.to_le_bytes());
        let error = framed(&short, 2).unwrap_err();
        assert!(error.contains("frame 0: it decompresses to more than the 4 bytes it claims"), "{error}");
    }
}
