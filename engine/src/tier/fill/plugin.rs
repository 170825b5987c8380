//! The evictor plugin's part in making room in the tier: started outside the budget lock, told
//! the plan's reads step by step and what the tier holds, asked for victims for each fill, its
//! choice kept within the plan's rules (an admitted extent stays while one not admitted could go,
//! and never goes for a fill needed later than itself).
//!
//! Owns `PluginEvictor`, `EvictorInput`, `evictor_host` and the coordinator's plugin calls.
//! Never: evicts what the plugin chose against those rules, or waits on the plugin under the
//! node-wide budget lock.

use super::*;

/// The evictor plugin of this process's fillers, and the steps whose reads it was told.
#[cfg(feature = "policy")]
#[derive(Default)]
pub(super) struct PluginEvictor {
    /// `None` until started, and again after it failed (started afresh before a later fill).
    pub(super) cache: Option<crate::policy::KeyedCache<ExtentKey>>,
    /// The plan's reads of steps before this one were told.
    pub(super) told_to: u64,
}

/// Steps of reads told to the evictor plugin at most at once (the older ones are skipped: they
/// no longer bear on what to evict).
#[cfg(feature = "policy")]
pub(super) const TELL_STEPS_MAX: u64 = 256;

/// The evictor plugin's view of one fill: what the tier holds (this tier's extents, with their
/// bytes and next use), the reads it has not been told (per step: extents and their next use
/// after it), and the extent room is made for (with its next use and bytes).
#[cfg(feature = "policy")]
pub(super) struct EvictorInput {
    pub(super) held: Vec<(ExtentKey, u64, u64)>,
    pub(super) reads: Vec<Vec<(ExtentKey, u64)>>,
    pub(super) told_to: u64,
    pub(super) fill: (ExtentKey, u64, u64),
}

/// The host's process-wide policy host for the tiers' evictors: each plugin compiled once per
/// process, not once per loader.
#[cfg(feature = "policy")]
pub(in crate::tier) fn evictor_host() -> Result<crate::policy::PolicyHost> {
    static HOST: Mutex<Option<crate::policy::PolicyHost>> = Mutex::new(None);
    let mut host = HOST.lock();
    if let Some(host) = &*host {
        return Ok(host.clone());
    }
    let made = crate::policy::PolicyHost::new(crate::policy::Limits::default(), None)?;
    *host = Some(made.clone());
    Ok(made)
}

impl Coordinator {
    /// Evicts the extents the plugin `chose`, in its order, until `fits` the `held` bytes, but
    /// keeps an admitted one while one not admitted is still there or when it is needed no later
    /// than `next` (the fill's next use); marks what went in `gone`, returns the bytes held.
    #[cfg(feature = "policy")]
    pub(super) fn evict_chosen(
        &self,
        chosen: &[ExtentKey],
        victims: &[(bool, u64, String, u64)],
        gone: &mut [bool],
        mut held: u64,
        next: u64,
        fits: &dyn Fn(u64) -> bool,
    ) -> Result<u64> {
        let at: HashMap<&str, usize> = victims.iter().enumerate().map(|(i, v)| (v.2.as_str(), i)).collect();
        let mut unadmitted = victims.iter().filter(|v| !v.0).count();
        for key in chosen {
            if fits(held) {
                break;
            }
            let Some(&i) = at.get(self.tier.extent_name(key).as_str()) else { continue };
            let (admitted, their_next, ref name, size) = victims[i];
            if gone[i] {
                continue;
            }
            if admitted && (unadmitted > 0 || their_next <= next) {
                self.tier.counters.evictor_refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.evict(name)?;
            held = held.saturating_sub(size);
            gone[i] = true;
            unadmitted -= usize::from(!admitted);
            self.tier.counters.evictor_chosen.fetch_add(1, Ordering::Relaxed);
        }
        Ok(held)
    }

    /// The victims the evictor plugin proposes to make room for extent `key` (next used at
    /// `next`, `bytes` of room), among `victims` (the tier's holdings: admitted, next use, name,
    /// bytes), after it has been told what the tier holds and the plan's reads since it was last
    /// asked. Empty when the plugin cannot answer (counted; the native order decides).
    #[cfg(feature = "policy")]
    pub(super) fn plugin_victims(
        &self,
        victims: &[(bool, u64, String, u64)],
        key: ExtentKey,
        next: u64,
        bytes: u64,
    ) -> Vec<ExtentKey> {
        let extent_bytes = self.tier.extent_bytes();
        let held = victims
            .iter()
            .filter_map(|(_, next, name, size)| Some((crate::tier::extent_key_of(name, extent_bytes)?, *size, *next)))
            .collect();
        let mut evictor = self.evictor.lock();
        let input = {
            let state = self.lock();
            let schedule = &state.schedule;
            let from = evictor.told_to.max(state.step.saturating_sub(TELL_STEPS_MAX));
            let first = schedule.reads.partition_point(|&(step, _)| step < from);
            let last = schedule.reads.partition_point(|&(step, _)| step < state.step);
            let mut reads: Vec<Vec<(ExtentKey, u64)>> = Vec::new();
            let mut at = None;
            for &(step, e) in &schedule.reads[first..last] {
                if at != Some(step) {
                    reads.push(Vec::new());
                    at = Some(step);
                }
                if let Some(told) = reads.last_mut() {
                    told.push((schedule.extents[e].key, schedule.next_use(e, step + 1)));
                }
            }
            EvictorInput { held, reads, told_to: state.step, fill: (key, next, bytes) }
        };
        match self.ask_evictor(&mut evictor, input) {
            Ok(chosen) => chosen,
            Err(_) => {
                // Started afresh at the next fill; the native order decides this one.
                evictor.cache = None;
                self.tier.counters.evictor_failures.fetch_add(1, Ordering::Relaxed);
                Vec::new()
            }
        }
    }

    /// Starts the evictor plugin if it is not running: before a fill takes the node-wide budget
    /// lock (compiling a plugin there would hold up every filler of the node).
    #[cfg(feature = "policy")]
    pub(super) fn start_evictor(&self) {
        let lock = || self.evictor.lock();
        if lock().cache.is_some() {
            return;
        }
        // Built without the lock: a filler asking the plugin under the budget lock never waits
        // for a compile (two fillers may both build one; the first stored stays).
        let (name, options) = self.tier.evictor();
        let started = evictor_host().and_then(|host| {
            crate::policy::KeyedCache::new(&host, Some(name.unwrap_or("plan-aware")), options, self.tier.budget_bytes())
        });
        match started {
            Ok(cache) => {
                lock().cache.get_or_insert(cache);
            }
            // The native order decides until a later start succeeds.
            Err(_) => {
                self.tier.counters.evictor_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[cfg(feature = "policy")]
    pub(super) fn ask_evictor(&self, evictor: &mut PluginEvictor, input: EvictorInput) -> Result<Vec<ExtentKey>> {
        // Not started (or failed): the fill goes by the native order; the filler starts it
        // before its next fill that needs room.
        let Some(cache) = evictor.cache.as_mut() else { return Ok(Vec::new()) };
        let EvictorInput { held, reads, told_to, fill: (key, next, bytes) } = input;
        let mut chosen = Vec::new();
        // What the tier holds node-wide: extents gone (any process evicted them) are forgotten,
        // extents it does not know (other processes loaded them; or this one, admitted with the
        // room made for it rather than its own size) are told, farthest next use first.
        let here: HashMap<ExtentKey, u64> = held.iter().map(|&(key, size, _)| (key, size)).collect();
        let stale: Vec<ExtentKey> =
            cache.held().into_iter().filter(|key| cache.bytes_of(*key) != here.get(key).copied()).collect();
        for key in stale {
            cache.forget(key);
        }
        let mut unknown: Vec<&(ExtentKey, u64, u64)> = held.iter().filter(|(key, ..)| !cache.holds(*key)).collect();
        unknown.sort_unstable_by_key(|&&(key, _, next)| (std::cmp::Reverse(next), key.extent));
        for &&(key, size, next) in &unknown {
            chosen.extend(cache.admit_next(key, size, next)?.0.into_iter().map(|(key, _)| key));
        }
        for step in reads {
            let next_uses: HashMap<ExtentKey, u64> = step.iter().copied().collect();
            let keys: Vec<ExtentKey> = step.iter().map(|&(key, _)| key).collect();
            let touched = cache.touch_next(&keys, &mut |key| next_uses.get(&key).copied().unwrap_or(NEVER))?;
            chosen.extend(touched.into_iter().map(|(key, _)| key));
        }
        evictor.told_to = told_to;
        chosen.extend(cache.admit_next(key, bytes, next)?.0.into_iter().map(|(key, _)| key));
        Ok(chosen)
    }
}
