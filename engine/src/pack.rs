//! Packed sequences: fixed windows of `seq_len + 1` tokens cut over the documents of an epoch's
//! order, and where each window's documents begin.
//!
//! An epoch orders the documents (records of token arrays) by the plan's permutation of them
//! and cuts windows over that order. Across documents (the default), the documents are
//! concatenated (each followed by the end-of-document token when one is given) and window `w`
//! is tokens `[w L, w L + L + 1)` of the concatenation, `L = seq_len`: consecutive windows
//! share one token (a window's last token is the next one's first, as a next-token target), so
//! every token is in one window per epoch apart from those overlaps, and the tail shorter than
//! a window is left out. Within documents, a document of `n` tokens (its end token included) is
//! cut into `ceil((n - 1) / L)` windows the same way, the last padded to `seq_len + 1` with the
//! pad token. Windows are an epoch's positions: they are cut between ranks and resumed like any
//! plan's records, so any world size reads the same windows.
//!
//! Owns `PackConfig`, `PackPlan` (the documents' lengths and the config), `PackEpoch` (one
//! epoch's document order and the cumulative counts that place a window), `Span` (the
//! documents a run of windows reads) and `pack_windows` (windows, `cu_seqlens` and position ids
//! from the documents' bytes). Never: reads data (the loader hands it the documents) or orders
//! the documents itself (the plan's permutation does).

use std::ops::Range;
use std::sync::Arc;

use crate::blend::{Blend, Drawn};
use crate::plan::{EpochPlan, Order};

/// How documents are packed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PackConfig {
    /// Tokens a window predicts: a window holds `seq_len + 1`.
    pub seq_len: u64,
    /// Appended after every document, when given.
    pub eod: Option<u64>,
    /// Windows run across document boundaries (true) or stay within one document, padded.
    pub cross_documents: bool,
    /// The pad token of windows within documents.
    pub pad: u64,
}

/// What packing reads: the documents' lengths (tokens, before the end token) and the config.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PackPlan {
    config: PackConfig,
    /// Tokens of each document, by record index.
    lengths: Arc<[u64]>,
    /// Bytes of a token.
    token_bytes: usize,
    n_windows: u64,
    longest: u64,
}

impl PackPlan {
    /// Packing of documents of `lengths` tokens of `token_bytes` bytes each.
    pub fn new(config: PackConfig, lengths: Arc<[u64]>, token_bytes: usize) -> Result<Self, String> {
        if config.seq_len == 0 {
            return Err("seq_len is at least 1".to_owned());
        }
        if !matches!(token_bytes, 1 | 2 | 4 | 8) {
            return Err(format!("tokens of {token_bytes} bytes cannot be packed"));
        }
        let max_token = if token_bytes == 8 { u64::MAX } else { (1u64 << (8 * token_bytes)) - 1 };
        for (what, token) in [("eod", config.eod), ("pad", Some(config.pad))] {
            if let Some(token) = token
                && token > max_token
            {
                return Err(format!("the {what} token {token} does not fit a token of {token_bytes} bytes"));
            }
        }
        let extra = u64::from(config.eod.is_some());
        let l = config.seq_len;
        let n_windows = if config.cross_documents {
            let total: u64 = lengths.iter().map(|n| n + extra).sum();
            total.saturating_sub(1) / l
        } else {
            lengths.iter().map(|n| (n + extra).saturating_sub(1).div_ceil(l)).sum()
        };
        let longest = lengths.iter().copied().max().unwrap_or(0) + extra;
        // Within documents a window holds at least one token of its document; across them,
        // every window but the last's overlap is `seq_len` tokens of the stream.
        debug_assert!(
            config.cross_documents || n_windows <= lengths.iter().map(|n| n + extra).sum::<u64>(),
            "no more windows than tokens"
        );
        Ok(Self { config, lengths, token_bytes, n_windows, longest })
    }

    /// The config.
    pub fn config(&self) -> &PackConfig {
        &self.config
    }

    /// Windows in an epoch.
    pub fn n_windows(&self) -> u64 {
        self.n_windows
    }

    /// Documents.
    pub fn n_documents(&self) -> u64 {
        self.lengths.len() as u64
    }

    /// Bytes of a token.
    pub fn token_bytes(&self) -> usize {
        self.token_bytes
    }

    /// Tokens of document `record` (before its end token).
    pub fn length(&self, record: u64) -> u64 {
        self.lengths.get(record as usize).copied().unwrap_or(0)
    }

    /// Bytes of the tokens of `windows` windows.
    pub fn tokens_bytes(&self, windows: u64) -> usize {
        windows as usize * (self.config.seq_len as usize + 1) * self.token_bytes
    }

    /// The most bytes of documents a run of `windows` windows reads: its tokens and two whole
    /// documents across documents; `windows` whole documents within them.
    pub fn span_bytes_max(&self, windows: u64) -> u64 {
        let tokens = if self.config.cross_documents {
            windows * self.config.seq_len + 1 + 2 * self.longest
        } else {
            windows * self.longest
        };
        tokens * self.token_bytes as u64
    }

    /// Epoch `epoch`'s order of the documents under `seed`.
    pub fn epoch(&self, seed: u64, epoch: u64, order: Order) -> PackEpoch {
        let plan = EpochPlan::new(self.n_documents(), seed, epoch, order);
        let extra = u64::from(self.config.eod.is_some());
        let l = self.config.seq_len;
        let mut starts = Vec::with_capacity(self.lengths.len() + 1);
        let mut at = 0u64;
        starts.push(0);
        for position in 0..self.n_documents() {
            let n = self.lengths[plan.record_at(position) as usize] + extra;
            at += if self.config.cross_documents { n } else { n.saturating_sub(1).div_ceil(l) };
            starts.push(at);
        }
        debug_assert_eq!(starts.len() as u64, self.n_documents() + 1, "a start per document, and the end");
        debug_assert!(starts.windows(2).all(|pair| pair[0] <= pair[1]), "documents begin in order");
        PackEpoch { plan, starts }
    }
}

/// One epoch's documents in order, and where each begins: its first token in the
/// concatenation (across documents) or its first window (within them).
pub struct PackEpoch {
    plan: EpochPlan,
    starts: Vec<u64>,
}

/// The documents windows `[first, first + n)` read, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// The windows.
    pub windows: Range<u64>,
    /// Their documents' positions in the epoch's order.
    pub documents: Range<u64>,
    /// The documents' records, in that order.
    pub records: Vec<u64>,
}

impl PackEpoch {
    /// The documents windows `windows` read.
    pub fn span(&self, pack: &PackPlan, windows: Range<u64>) -> Span {
        let l = pack.config.seq_len;
        let documents = if windows.is_empty() {
            0..0
        } else if pack.config.cross_documents {
            let (first, end) = (windows.start * l, windows.end * l + 1);
            // The last document beginning at or before `first`, to the first beginning at or after `end`.
            let from = self.starts.partition_point(|&s| s <= first).saturating_sub(1);
            let to = self.starts.partition_point(|&s| s < end);
            from as u64..(to as u64).min(pack.n_documents()).max(from as u64)
        } else {
            let from = self.starts.partition_point(|&s| s <= windows.start).saturating_sub(1);
            let to = self.starts.partition_point(|&s| s < windows.end);
            from as u64..(to as u64).min(pack.n_documents()).max(from as u64)
        };
        debug_assert!(documents.end <= pack.n_documents(), "a span's documents are the epoch's");
        let records = documents.clone().map(|p| self.plan.record_at(p)).collect();
        Span { windows, documents, records }
    }

    /// Where document position `position` begins (a token or a window, as `span` counts).
    fn start(&self, position: u64) -> u64 {
        self.starts[position as usize]
    }
}

/// Packed windows: `windows x (seq_len + 1)` tokens, each window's segments (the runs of one
/// document, and the padding) as `cu_seqlens` over the flattened windows, position ids that
/// restart at 0 at each segment, and each window's tokens that are not padding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Packed {
    /// The tokens, little-endian, `token_bytes` each.
    pub tokens: Vec<u8>,
    /// Windows.
    pub windows: usize,
    /// Segment boundaries over the flattened windows: 0, then each segment's end.
    pub cu_seqlens: Vec<i32>,
    /// Each token's position within its segment.
    pub position_ids: Vec<i32>,
    /// Tokens of each window that are not padding.
    pub real_tokens: Vec<u32>,
}

/// Packs span `span` of `epoch` from its documents' bytes (`documents[i]` is record
/// `span.records[i]`, whole).
pub fn pack_windows(pack: &PackPlan, epoch: &PackEpoch, span: &Span, documents: &[&[u8]]) -> Result<Packed, String> {
    let mut tokens = vec![0u8; pack.tokens_bytes(span.windows.end - span.windows.start)];
    let mut packed = pack_windows_into(pack, epoch, span, documents, &mut tokens)?;
    packed.tokens = tokens;
    Ok(packed)
}

/// `pack_windows`, the tokens written into `tokens` (exactly `tokens_bytes` of the span's
/// windows long; the caller's memory, a Python buffer say); the `Packed` returned holds none.
pub fn pack_windows_into(
    pack: &PackPlan,
    epoch: &PackEpoch,
    span: &Span,
    documents: &[&[u8]],
    tokens: &mut [u8],
) -> Result<Packed, String> {
    let tb = pack.token_bytes;
    let width = pack.config.seq_len as usize + 1;
    let l = pack.config.seq_len;
    let n_windows = (span.windows.end - span.windows.start) as usize;
    if tokens.len() != n_windows * width * tb {
        return Err(format!("{} bytes for {n_windows} windows of {width} tokens of {tb} bytes", tokens.len()));
    }
    let mut at = 0usize;
    let mut put = |bytes: &[u8]| {
        tokens[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    if documents.len() != span.records.len() {
        return Err(format!("{} documents for a span of {}", documents.len(), span.records.len()));
    }
    for (doc, &record) in documents.iter().zip(&span.records) {
        let expected = pack.lengths.get(record as usize).copied().unwrap_or(u64::MAX) as usize * tb;
        if doc.len() != expected {
            return Err(format!("document {record} has {} bytes, its plan says {expected}", doc.len()));
        }
    }
    let token = |value: u64| value.to_le_bytes()[..tb].to_vec();
    let eod = pack.config.eod.map(token);
    let mut out = Packed { windows: n_windows, cu_seqlens: vec![0], ..Packed::default() };
    out.position_ids.reserve(n_windows * width);
    // A window's tokens as runs of (document index in the span, first token, tokens).
    let mut runs: Vec<(usize, u64, u64)> = Vec::new();
    for w in span.windows.clone() {
        runs.clear();
        if pack.config.cross_documents {
            let (mut at, end) = (w * l, w * l + l + 1);
            while at < end {
                let position = epoch.plan_position_of_token(at, span)?;
                let i = (position - span.documents.start) as usize;
                let doc_start = epoch.start(position);
                let doc_end = epoch.start(position + 1);
                let take = doc_end.min(end) - at;
                runs.push((i, at - doc_start, take));
                at += take;
            }
        } else {
            let position = epoch.plan_position_of_window(w, span)?;
            let i = (position - span.documents.start) as usize;
            let piece = w - epoch.start(position);
            let n = (documents[i].len() / tb) as u64 + u64::from(eod.is_some());
            let first = piece * l;
            runs.push((i, first, (first + l + 1).min(n) - first));
        }
        let mut real = 0u64;
        for &(i, first, take) in &runs {
            let doc = documents[i];
            let doc_tokens = (doc.len() / tb) as u64;
            // The document's own tokens, then its end token.
            let own_end = (first + take).min(doc_tokens);
            if first < own_end {
                put(&doc[first as usize * tb..own_end as usize * tb]);
            }
            if first + take > doc_tokens {
                put(eod.as_deref().unwrap_or_default());
            }
            real += take;
            push_segment(&mut out, take);
        }
        if real < width as u64 {
            let pad = token(pack.config.pad);
            for _ in real..width as u64 {
                put(&pad);
            }
            push_segment(&mut out, width as u64 - real);
        }
        debug_assert_eq!(out.cu_seqlens.last().copied(), Some(((w - span.windows.start + 1) as usize * width) as i32));
        out.real_tokens.push(real as u32);
    }
    if at != tokens.len() {
        return Err(format!("{at} bytes of tokens packed where {n_windows} windows take {}", tokens.len()));
    }
    debug_assert_eq!(out.position_ids.len(), n_windows * width, "a position id per token");
    Ok(out)
}

fn push_segment(out: &mut Packed, tokens: u64) {
    let last = out.cu_seqlens.last().copied().unwrap_or(0);
    out.cu_seqlens.push(last + tokens as i32);
    out.position_ids.extend(0..tokens as i32);
}

impl PackEpoch {
    /// The position of the document holding token `token` (across documents), within `span`.
    fn plan_position_of_token(&self, token: u64, span: &Span) -> Result<u64, String> {
        let position = self.starts.partition_point(|&s| s <= token).saturating_sub(1) as u64;
        if !span.documents.contains(&position) {
            return Err(format!("token {token} is outside the span's documents {:?}", span.documents));
        }
        Ok(position)
    }

    /// The position of the document holding window `window` (within documents), within `span`.
    fn plan_position_of_window(&self, window: u64, span: &Span) -> Result<u64, String> {
        let position = self.starts.partition_point(|&s| s <= window).saturating_sub(1) as u64;
        if !span.documents.contains(&position) {
            return Err(format!("window {window} is outside the span's documents {:?}", span.documents));
        }
        Ok(position)
    }
}

/// A mixture of packed sources: each source packed on its own, the blend drawing windows (a
/// source's pass over its windows is one epoch of its pack: a fresh order of its documents,
/// seeded by the source).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PackedBlend {
    /// Over the sources' windows.
    pub blend: Arc<Blend>,
    /// Each source's packing.
    pub packs: Vec<Arc<PackPlan>>,
    /// Where each source's documents start among the mixture's records.
    pub doc_starts: Vec<u64>,
}

/// The epochs of the sources' packs a run of windows has placed (a source's current pass, and
/// the one before it, which a batch may still straddle).
#[derive(Default)]
pub struct PlacedPasses {
    placed: std::collections::HashMap<(usize, u64), PackEpoch>,
}

impl PackedBlend {
    /// The documents window `drawn` reads (records of its source: add `doc_starts[source]` for
    /// the mixture's), in order, and the source's pack epoch that places it.
    pub fn window<'a>(&self, passes: &'a mut PlacedPasses, seed: u64, drawn: Drawn) -> (Span, &'a PackEpoch) {
        let pack = &self.packs[drawn.source];
        let key = self.blend.sources()[drawn.source].key;
        passes.placed.retain(|&(s, p), _| s != drawn.source || p + 1 >= drawn.pass);
        let placed = passes
            .placed
            .entry((drawn.source, drawn.pass))
            .or_insert_with(|| pack.epoch(seed ^ key, drawn.pass, Order::Shuffled));
        (placed.span(pack, drawn.record..drawn.record + 1), placed)
    }

    /// The most bytes of documents `windows` windows read.
    pub fn span_bytes_max(&self, windows: u64) -> u64 {
        self.packs.iter().map(|pack| pack.span_bytes_max(1)).max().unwrap_or(0).saturating_mul(windows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Documents of u16 tokens: document d's token t is d * 1000 + t.
    fn docs(lengths: &[u64]) -> Vec<Vec<u8>> {
        lengths
            .iter()
            .enumerate()
            .map(|(d, &n)| (0..n).flat_map(|t| ((d as u64 * 1000 + t) as u16).to_le_bytes()).collect())
            .collect()
    }

    fn tokens(bytes: &[u8]) -> Vec<u16> {
        bytes.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
    }

    fn pack_all(pack: &PackPlan, docs: &[Vec<u8>], order: Order) -> Packed {
        let epoch = pack.epoch(3, 0, order);
        let span = epoch.span(pack, 0..pack.n_windows());
        let bytes: Vec<&[u8]> = span.records.iter().map(|&r| &docs[r as usize][..]).collect();
        pack_windows(pack, &epoch, &span, &bytes).expect("packs")
    }

    #[test]
    fn across_documents_every_token_is_in_one_window_but_the_overlaps() {
        let lengths = [5u64, 1, 12, 3, 7];
        let d = docs(&lengths);
        let config = PackConfig { seq_len: 4, eod: Some(65535), cross_documents: true, pad: 0 };
        let pack = PackPlan::new(config, lengths.to_vec().into(), 2).unwrap();
        // 28 tokens with their end tokens + 5 = 33: (33 - 1) / 4 = 8 windows.
        assert_eq!(pack.n_windows(), 8);
        let packed = pack_all(&pack, &d, Order::Sequential);
        let t = tokens(&packed.tokens);
        let stream: Vec<u16> = d.iter().flat_map(|doc| tokens(doc).into_iter().chain([65535])).collect();
        for w in 0..8 {
            assert_eq!(t[w * 5..w * 5 + 5], stream[w * 4..w * 4 + 5], "window {w}");
        }
        assert_eq!(packed.real_tokens, vec![5; 8]);
        // Segments: window 0 is doc 0 (5 + eod = 6 > 5 tokens): one segment of 5.
        assert_eq!(packed.cu_seqlens[..2], [0, 5]);
        assert_eq!(*packed.cu_seqlens.last().unwrap(), 40);
        // Position ids restart at every segment.
        for pair in packed.cu_seqlens.windows(2) {
            let ids = &packed.position_ids[pair[0] as usize..pair[1] as usize];
            assert_eq!(ids, (0..pair[1] - pair[0]).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_span_of_any_windows_packs_as_the_whole_epoch_does() {
        let lengths: Vec<u64> = (0..40).map(|i| (i * 7 % 23) + 1).collect();
        let d = docs(&lengths);
        for cross in [true, false] {
            let config = PackConfig { seq_len: 6, eod: cross.then_some(9999), cross_documents: cross, pad: 7 };
            let pack = PackPlan::new(config, lengths.clone().into(), 2).unwrap();
            let whole = pack_all(&pack, &d, Order::Shuffled);
            let epoch = pack.epoch(3, 0, Order::Shuffled);
            for (a, b) in [(0, 1), (3, 9), (10, pack.n_windows())] {
                let span = epoch.span(&pack, a..b);
                let bytes: Vec<&[u8]> = span.records.iter().map(|&r| &d[r as usize][..]).collect();
                let part = pack_windows(&pack, &epoch, &span, &bytes).unwrap();
                let width = 7 * 2;
                assert_eq!(part.tokens, whole.tokens[a as usize * width..b as usize * width], "{cross} {a}..{b}");
                assert_eq!(part.real_tokens, whole.real_tokens[a as usize..b as usize]);
            }
        }
    }

    #[test]
    fn within_documents_each_window_is_one_documents_and_padded() {
        let lengths = [5u64, 1, 12];
        let d = docs(&lengths);
        let config = PackConfig { seq_len: 4, eod: None, cross_documents: false, pad: 7 };
        let pack = PackPlan::new(config, lengths.to_vec().into(), 2).unwrap();
        // 5 tokens: 1 window; 1 token: none (no target); 12: ceil(11 / 4) = 3.
        assert_eq!(pack.n_windows(), 4);
        let packed = pack_all(&pack, &d, Order::Sequential);
        let t = tokens(&packed.tokens);
        assert_eq!(t[..5], [0, 1, 2, 3, 4]);
        assert_eq!(t[5..10], [2000, 2001, 2002, 2003, 2004]);
        assert_eq!(t[15..20], [2008, 2009, 2010, 2011, 7]);
        assert_eq!(packed.real_tokens, vec![5, 5, 5, 4]);
        assert_eq!(packed.cu_seqlens, vec![0, 5, 10, 15, 19, 20]);
    }

    #[test]
    fn tokens_that_do_not_fit_are_refused() {
        let config = PackConfig { seq_len: 4, eod: Some(70_000), cross_documents: true, pad: 0 };
        assert!(PackPlan::new(config, vec![3].into(), 2).is_err());
        let config = PackConfig { seq_len: 0, eod: None, cross_documents: true, pad: 0 };
        assert!(PackPlan::new(config, vec![3].into(), 2).is_err());
    }
}
