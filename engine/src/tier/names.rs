//! The names of a memory tier's files: an extent's (`<shard id>.<extent KiB>k.<index>`), a
//! fill's claim, the layout an older engine left; and `ExtentKey`, an extent's identity.
//!
//! Owns the name grammar and its parsing. Never: lists, creates or removes a file (the tier
//! does, by these names only).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::id::ShardId;

/// One extent: a shard and the index of the extent within its data region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExtentKey {
    /// The shard's content id.
    pub shard: ShardId,
    /// Which extent of the shard's data region.
    pub extent: u32,
}

#[cfg(feature = "policy")]
impl crate::policy::CacheKey for ExtentKey {
    fn cache_key(&self) -> u64 {
        // The shard's key is uniform (its id's first bytes); the index spread over all bits.
        crate::policy::shard_key(self.shard.0.as_bytes()) ^ u64::from(self.extent).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Whether `name` is an extent file's (`<shard id, 64 hex>.<extent KiB>k.<index, 6+ digits>`).
pub(super) fn is_extent_name(name: &str) -> bool {
    let mut parts = name.split('.');
    let (Some(shard), Some(size), Some(index), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    shard.len() == 64
        && shard.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        && size.strip_suffix('k').is_some_and(digits)
        && index.len() >= 6
        && digits(index)
}

/// The extent an extent's name (`<shard>.<K>k.<index>`) names, when it is cut in extents of
/// `extent_bytes`.
pub(super) fn extent_key_of(name: &str, extent_bytes: u64) -> Option<ExtentKey> {
    let mut parts = name.split('.');
    let shard = ShardId(crate::id::ObjectId::parse_hex(parts.next()?)?);
    (extent_size_of(name)? == extent_bytes).then_some(())?;
    let extent = parts.nth(1)?.parse().ok()?;
    Some(ExtentKey { shard, extent })
}

/// The extent size an extent's name says (`<shard>.<K>k.<index>`): K KiB.
pub(super) fn extent_size_of(name: &str) -> Option<u64> {
    name.split('.').nth(1)?.strip_suffix('k')?.parse::<u64>().ok()?.checked_mul(1024)
}

/// The extent name a claim (`.fill-NAME`) or a private fill file (`.new-PID-N-NAME`) is for.
pub(super) fn claimed_extent(name: &str) -> Option<&str> {
    let extent = match name.strip_prefix(".fill-") {
        Some(extent) => extent,
        None => name.strip_prefix(".new-")?.splitn(3, '-').nth(2)?,
    };
    is_extent_name(extent).then_some(extent)
}

/// An extent name of the layout before extent sizes were in the name (`<shard>.<index>`): a
/// tier directory left by an older engine is emptied, not refused.
pub(super) fn is_old_extent_name(name: &str) -> bool {
    name.split_once('.').is_some_and(|(shard, index)| {
        shard.len() == 64
            && shard.bytes().all(|b| b.is_ascii_hexdigit())
            && index.len() == 6
            && index.bytes().all(|b| b.is_ascii_digit())
    })
}

pub(super) fn nonce() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
