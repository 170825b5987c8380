//! What a loader takes from the store it reads: the repair hook of an attached dataset (the
//! store's origin cache) and the plan over a dataset the cache cannot hold (windowed to it).
//!
//! Owns `plan_for_store`, `window_for_cache` and the loader's origin hook. Never: fetches or
//! evicts (the cache does), or plans (the partitioner does).

use std::sync::Arc;

use crate::error::Result;

use super::config::*;
use crate::read::Dataset;

/// The repair hook of a loader of `dataset` given `given`: for an attached dataset (or a mixture
/// with an attached source), the store's
/// origin cache, through which its missing shards are fetched (asking `given`, a replication
/// node, before the origin); otherwise, or when `given` is a cache itself, `given`.
#[cfg(feature = "origin")]
pub(super) fn origin_hook(
    dataset: &Dataset,
    given: Option<Arc<dyn crate::read::ShardSource>>,
) -> Result<Option<Arc<dyn crate::read::ShardSource>>> {
    // A hook that is a cache of its own (an origin cache the caller opened) is used as given:
    // wrapped, its fetches would wait on the claims of the wrapping cache's. A mixture's dataset
    // needs the cache when any of its sources is attached.
    if given.as_ref().is_some_and(|hook| hook.cache_stats().is_some()) {
        return Ok(given);
    }
    let mut attached = false;
    for (name, _) in dataset.parts() {
        attached |= crate::origin::attachment(dataset.paths(), name)?.is_some();
    }
    if !attached {
        return Ok(given);
    }
    let Some(cache) = crate::origin::OriginCache::open(dataset.paths(), None, &[])? else { return Ok(given) };
    if let Some(node) = given {
        cache.set_peers(node);
    }
    Ok(Some(cache))
}

#[cfg(not(feature = "origin"))]
pub(super) fn origin_hook(
    _: &Dataset,
    given: Option<Arc<dyn crate::read::ShardSource>>,
) -> Result<Option<Arc<dyn crate::read::ShardSource>>> {
    Ok(given)
}

/// The plan a loader of `dataset` reads with when asked for `plan` (`Loader::new` applies it;
/// callers that record the plan, to resume under the same order, ask here): `plan` itself,
/// windowed to the cache when `dataset` is an attached one that its store's cache cannot hold
/// whole and `plan` is the default partitioner's global order without a window:
/// `window-shards` is then about as many shards as the cache holds (`window_for_cache`), so
/// the reader works through a few shards at a time, each batch drawn from as many as the cache
/// allows, instead of needing most of the dataset every few steps.
/// The window follows from the cache bound: nodes of one job give the same `--cache-bytes`
/// (or pass `window-shards` themselves), or their ranks would read different plans. Any other
/// plan (a native order, another plugin, a window or mode given) is left as chosen.
#[cfg(feature = "origin")]
pub fn plan_for_store(dataset: &Dataset, plan: PlanSource) -> Result<PlanSource> {
    let PlanSource::Partitioner { plugin, mut options } = plan else { return Ok(plan) };
    let chosen = options.iter().any(|(key, value)| key == "window-shards" || (key == "mode" && value != "global"));
    let attached = match dataset.version() {
        Some((name, _)) if !chosen && matches!(plugin.as_deref(), None | Some("elastic")) => {
            crate::origin::attachment(dataset.paths(), name)?.is_some()
        }
        _ => false,
    };
    if attached {
        let bound = crate::origin::cache_bound(dataset.paths())?;
        let entries = dataset.manifest().entries();
        let total: u64 = entries.iter().map(|e| e.file_bytes).sum();
        let largest = entries.iter().map(|e| e.file_bytes).max().unwrap_or(1).max(1);
        if bound > 0 && total > bound {
            options.push(("window-shards".to_owned(), window_for_cache(bound, largest).to_string()));
        }
    }
    Ok(PlanSource::Partitioner { plugin, options })
}

/// The window of shards a cache of `bound` bytes reads a dataset of shards up to `largest`
/// bytes through: one less than the C shards it holds, less an eighth of C, at least 1. A window
/// of W has at most W + 1 shards begun and not finished at any point, which the cache then
/// holds; the shard that enters next is fetched as one read to its end leaves, and the eighth
/// lets the prefetch fetch ahead. Measured with a quarter-size cache (issue 40): 16 shards
/// (C = 4), a window of 1 drew every batch from one shard and fetched 1.19 x the data, 3 drew
/// 3.0-3.2 shards a batch and fetched 1.00-1.06 x; 64 shards (C = 16), a window of 15 fetched
/// 1.23 x, 13 fetched 1.03 x with 12 shards a batch.
pub fn window_for_cache(bound: u64, largest: u64) -> u64 {
    let shards = bound / largest.max(1);
    shards.saturating_sub(1).saturating_sub(shards / 8).max(1)
}

/// The plan a loader of a dataset reads with when asked for `plan`: `plan` (without origins,
/// nothing windows it).
#[cfg(not(feature = "origin"))]
pub fn plan_for_store(_: &Dataset, plan: PlanSource) -> Result<PlanSource> {
    Ok(plan)
}
