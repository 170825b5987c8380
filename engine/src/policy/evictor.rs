//! The evictor host: batched access events into a plugin, every outcome checked against the
//! host's own record of what is resident.
//!
//! The host keeps the resident set (the mirror) itself: a plugin's answer is replayed against it
//! (hits must be resident, misses must not be, victims must be resident, the cache must never
//! overflow) before anything changes, so an invalid answer changes nothing and the batch is
//! answered by the fallback policy instead. Because the mirror is the truth, any policy can
//! take over from any other: a new or rebuilt instance is restored from the mirror, in the order
//! of the latest snapshot (and with that snapshot's policy-specific state when it is still
//! exact).
//!
//! Owns: `Evictor` (a supervised evictor plugin, the mirror of what is resident, the latest
//! snapshot), `ResidentSet` (the mirror: keys, sizes, capacity, and `apply`, which replays an
//! answer against it), `AccessOutcome` and `EvictorStats`. Never: removes or fetches anything (it
//! answers with keys; the tier and the caches act on them), or changes the mirror with an answer
//! that failed its replay.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use wasmtime::component::ResourceAny;

use super::bindings::evictor::EvictorPlugin;
use super::bindings::v1::evictor::EvictorPlugin as EvictorPluginV1;
use super::supervise::{PolicyStatus, Supervisor, SwapHandle};
use super::{Instance, Plugin, PolicyKind, invalid, rejected};
use crate::error::{Error, PluginError};

/// What a batch did, as validated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessOutcome {
    /// Whether each access hit.
    pub hits: Vec<bool>,
    /// (access index, key): `key` was evicted before access `index` was inserted.
    pub evictions: Vec<(u32, u64)>,
}

/// Counters of an evictor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictorStats {
    /// Batches applied.
    pub batches: u64,
    /// Accesses applied.
    pub accesses: u64,
    /// Hits among them.
    pub hits: u64,
    /// Objects evicted.
    pub evictions: u64,
    /// Fuel burnt by the active plugin's current instance so far, when `Limits::fuel` meters it
    /// (a measure of the plugin's work that does not depend on the machine).
    pub fuel: u64,
}

struct Live {
    instance: Instance<Bindings>,
    policy: ResourceAny,
}

/// An evictor instance's bindings, of the version its plugin was built against (the evictor
/// interface is the same in both).
enum Bindings {
    V2(EvictorPlugin),
    V1(EvictorPluginV1),
}

/// A policy error of either version as the current version's.
fn policy_error(error: impl Into<super::bindings::WitPolicyError>) -> super::bindings::WitPolicyError {
    error.into()
}

/// Runs `$body` with `$guest` the instance's `policy` resource functions and `$wit` the module
/// of the interface's types, whichever version the instance is; a policy error comes back as
/// the current version's.
macro_rules! with_guest {
    ($bindings:expr, |$guest:ident, $wit:ident| $body:expr) => {
        match $bindings {
            Bindings::V2(bindings) => {
                #[allow(unused_imports, reason = "a call without types of its own")]
                use super::bindings::evictor::exports::granary::policy::evictor as $wit;
                let $guest = bindings.granary_policy_evictor().policy();
                $body
            }
            Bindings::V1(bindings) => {
                #[allow(unused_imports, reason = "a call without types of its own")]
                use super::bindings::v1::evictor::exports::granary::policy::evictor as $wit;
                let $guest = bindings.granary_policy_evictor().policy();
                $body
            }
        }
    };
}

/// The last snapshot: the order (and state) to restore a new instance with.
#[derive(Clone, Default)]
struct Snapshot {
    policy: String,
    order: Vec<(u64, u32)>,
    state: Vec<u8>,
}

/// A supervised evictor plugin with its cache's resident set.
pub struct Evictor {
    supervisor: Supervisor<Live>,
    state: State,
}

/// The host's side of an evictor: the truth about what is resident.
struct State {
    resident: ResidentSet,
    snapshot: Snapshot,
    /// Whether the resident set changed since `snapshot` was taken.
    changed_since_snapshot: bool,
    batches_since_snapshot: u32,
    stats: EvictorStats,
}

impl Evictor {
    /// An evictor for a cache of `capacity` bytes (give every object size 1 to count objects),
    /// run by `plugin` with `options`, and `fallback` (with its defaults) answering when it fails.
    pub fn new(
        plugin: Plugin,
        options: &[(String, String)],
        fallback: Option<Plugin>,
        capacity: u64,
    ) -> Result<Self, Error> {
        let supervisor = Supervisor::of_kind(PolicyKind::Evictor, plugin, options, fallback, |plugin| {
            instantiate(plugin, capacity, &options.to_vec())
        })?;
        Ok(Self {
            supervisor,
            state: State {
                resident: ResidentSet::new(capacity),
                snapshot: Snapshot::default(),
                changed_since_snapshot: false,
                batches_since_snapshot: 0,
                stats: EvictorStats::default(),
            },
        })
    }

    /// Applies a batch of accesses (parallel lists) and returns what the policy did. On success
    /// the host's resident set reflects it.
    pub fn access(&mut self, keys: &[u64], sizes: &[u32], next_uses: &[u64]) -> Result<AccessOutcome, Error> {
        if keys.len() != sizes.len() || keys.len() != next_uses.len() || keys.len() > u32::MAX as usize {
            return Err(Error::invalid_input("keys, sizes and next uses must be lists of one length"));
        }
        self.apply_pending_swap()?;
        let outcome = self.run(&mut |this, live, plugin| {
            let deadline = plugin.host().limits().deadline_evict;
            let policy = live.policy;
            let outcome = live
                .instance
                .call("access", deadline, |b, s| {
                    with_guest!(b, |guest, wit| {
                        let batch =
                            wit::Accesses { keys: keys.to_vec(), sizes: sizes.to_vec(), next_uses: next_uses.to_vec() };
                        Ok(guest.call_access(s, policy, &batch)?.map_err(policy_error).map(|answer| AccessOutcome {
                            hits: answer.hits,
                            evictions: answer.evictions.into_iter().map(|e| (e.before, e.key)).collect(),
                        }))
                    })
                })?
                .map_err(|e| rejected(plugin, "access", e))?;
            this.resident.apply(keys, sizes, &outcome).map_err(|detail| invalid(plugin, "access", detail))?;
            Ok(outcome)
        })?;
        let state = &mut self.state;
        if let Some(live) = self.supervisor.active_instance() {
            state.stats.fuel = live.instance.fuel_used;
        }
        state.stats.batches += 1;
        state.stats.accesses += keys.len() as u64;
        state.stats.hits += outcome.hits.iter().filter(|&&hit| hit).count() as u64;
        state.stats.evictions += outcome.evictions.len() as u64;
        state.changed_since_snapshot |= outcome.hits.iter().any(|&hit| !hit);
        state.batches_since_snapshot += 1;
        if state.batches_since_snapshot >= self.supervisor.active_plugin().host().limits().snapshot_every {
            self.take_snapshot();
        }
        Ok(outcome)
    }

    /// Asks the policy to free at least `bytes` (or everything); returns the victims.
    pub fn evict(&mut self, bytes: u64) -> Result<Vec<u64>, Error> {
        self.apply_pending_swap()?;
        let victims = self.run(&mut |this, live, plugin| {
            let deadline = plugin.host().limits().deadline_evict;
            let policy = live.policy;
            let victims = live
                .instance
                .call("evict", deadline, |b, s| with_guest!(b, |guest, _wit| guest.call_evict(s, policy, bytes)))?;
            let mut freed = 0u64;
            let mut seen = HashSet::with_capacity(victims.len());
            for key in &victims {
                let size = this
                    .resident
                    .size_of(*key)
                    .ok_or_else(|| invalid(plugin, "evict", format!("key {key} is not resident")))?;
                if !seen.insert(*key) {
                    return Err(invalid(plugin, "evict", format!("key {key} evicted twice")));
                }
                freed += u64::from(size);
            }
            if freed < bytes.min(this.resident.used()) {
                return Err(invalid(plugin, "evict", format!("freed {freed} of the {bytes} bytes asked")));
            }
            for key in &victims {
                this.resident.remove(*key);
            }
            Ok(victims)
        })?;
        self.state.changed_since_snapshot |= !victims.is_empty();
        Ok(victims)
    }

    /// Tells the policy the host removed `keys` by itself (keys not resident are ignored).
    pub fn remove(&mut self, keys: &[u64]) -> Result<(), Error> {
        let state = &mut self.state;
        let keys: Vec<u64> = keys.iter().copied().filter(|key| state.resident.contains(*key)).collect();
        for key in &keys {
            state.resident.remove(*key);
        }
        state.changed_since_snapshot |= !keys.is_empty();
        // The host's record is updated first: an instance rebuilt after a failure here is
        // restored without these keys.
        self.run(&mut |_, live, plugin| {
            let deadline = plugin.host().limits().deadline_evict;
            let policy = live.policy;
            live.instance
                .call("remove", deadline, |b, s| with_guest!(b, |guest, _wit| guest.call_remove(s, policy, &keys)))
        })
    }

    /// Switches to `plugin` (run with `options`) now: it is restored from the current state
    /// first; on any failure the current plugin stays. The current one becomes the fallback.
    pub fn swap(&mut self, plugin: Plugin, options: &[(String, String)]) -> Result<(), Error> {
        self.take_snapshot();
        let Self { supervisor, state } = self;
        supervisor.swap_to(PolicyKind::Evictor, plugin, options, |plugin| {
            let mut live = instantiate(plugin, state.resident.capacity(), &options.to_vec())?;
            state.restore(&mut live, plugin).map_err(Error::Plugin)?;
            Ok(live)
        })
    }

    /// A handle through which another thread can swap the plugin; the swap happens before the
    /// next call.
    pub fn swap_handle(&self) -> SwapHandle {
        self.supervisor.swap_handle()
    }

    /// Resident objects.
    pub fn len(&self) -> usize {
        self.state.resident.len()
    }

    /// Whether nothing is resident.
    pub fn is_empty(&self) -> bool {
        self.state.resident.is_empty()
    }

    /// Whether `key` is resident.
    pub fn contains(&self, key: u64) -> bool {
        self.state.resident.contains(key)
    }

    /// Bytes resident.
    pub fn used(&self) -> u64 {
        self.state.resident.used()
    }

    /// Counters.
    pub fn stats(&self) -> EvictorStats {
        self.state.stats
    }

    /// Supervision state: which plugin answers, failures, quarantine.
    pub fn status(&self) -> PolicyStatus {
        self.supervisor.status()
    }

    fn apply_pending_swap(&mut self) -> Result<(), Error> {
        match self.supervisor.take_pending() {
            Some((plugin, options)) => self.swap(plugin, &options),
            None => Ok(()),
        }
    }

    /// Runs `op` under supervision, restoring an instance from the host's state first when it is
    /// new or the other plugin answered last.
    fn run<R>(
        &mut self,
        op: &mut dyn FnMut(&mut State, &mut Live, &Plugin) -> Result<R, PluginError>,
    ) -> Result<R, Error> {
        let state = &mut self.state;
        let capacity = state.resident.capacity();
        let mut make = |plugin: &Plugin, options: &[(String, String)]| {
            instantiate(plugin, capacity, &options.to_vec()).map_err(plugin_error)
        };
        self.supervisor.run(&mut make, &mut |live, fresh, _| {
            let plugin = live.instance.plugin.clone();
            if fresh {
                state.restore(live, &plugin)?;
            }
            op(state, live, &plugin)
        })
    }

    /// Takes a snapshot of the answering instance, if it is up; keeps the old one otherwise.
    fn take_snapshot(&mut self) {
        let _ = self.snapshot_now();
    }

    /// Asks the answering instance for its snapshot now and keeps it for restores: an error
    /// (naming the call) when the call traps or the snapshot disagrees with what the host knows
    /// is resident. The evictor goes on either way (the old snapshot is kept); `plugin check`
    /// calls this so that a plugin whose `snapshot` fails is caught before a run relies on it.
    pub fn snapshot_now(&mut self) -> Result<(), Error> {
        let state = &mut self.state;
        state.batches_since_snapshot = 0;
        let Some(live) = self.supervisor.active_instance() else {
            return Err(Error::invalid_input("no instance of the evictor is up to snapshot"));
        };
        let plugin = live.instance.plugin.clone();
        let deadline = plugin.host().limits().deadline_setup;
        let policy = live.policy;
        let taken = live.instance.call("snapshot", deadline, |b, s| {
            with_guest!(b, |guest, _wit| guest.call_snapshot(s, policy).map(|snapshot| Snapshot {
                policy: snapshot.policy,
                order: snapshot.resident.into_iter().map(|e| (e.key, e.size)).collect(),
                state: snapshot.state,
            }))
        });
        state.stats.fuel = live.instance.fuel_used;
        let snapshot = taken.map_err(Error::Plugin)?;
        // A snapshot that disagrees with the host's resident set is not used for order or state.
        if snapshot.order.len() != state.resident.len()
            || !snapshot.order.iter().all(|&(key, size)| state.resident.size_of(key) == Some(size))
        {
            return Err(Error::Plugin(super::invalid(
                &plugin,
                "snapshot",
                format!(
                    "its snapshot lists {} objects, not the {} resident ones with their sizes",
                    snapshot.order.len(),
                    state.resident.len()
                ),
            )));
        }
        state.snapshot = snapshot;
        state.changed_since_snapshot = false;
        Ok(())
    }
}

impl State {
    /// Brings `live` to the host's resident set.
    fn restore(&self, live: &mut Live, plugin: &Plugin) -> Result<(), PluginError> {
        let mut order: Vec<(u64, u32)> = Vec::with_capacity(self.resident.len());
        let mut listed = HashSet::with_capacity(self.resident.len());
        for &(key, size) in &self.snapshot.order {
            if self.resident.contains(key) && listed.insert(key) {
                order.push((key, size));
            }
        }
        let mut rest: Vec<(u64, u32)> = self
            .resident
            .map
            .iter()
            .filter(|(key, _)| !listed.contains(*key))
            .map(|(&key, &size)| (key, size))
            .collect();
        rest.sort_unstable();
        order.extend(rest);
        let exact = !self.changed_since_snapshot;
        let deadline = plugin.host().limits().deadline_setup;
        let policy = live.policy;
        live.instance
            .call("restore", deadline, |b, s| {
                with_guest!(b, |guest, wit| {
                    let snapshot = wit::Snapshot {
                        policy: if exact { self.snapshot.policy.clone() } else { String::new() },
                        resident: order.iter().map(|&(key, size)| wit::Entry { key, size }).collect(),
                        state: if exact { self.snapshot.state.clone() } else { Vec::new() },
                    };
                    Ok(guest.call_restore(s, policy, &snapshot)?.map_err(policy_error))
                })
            })?
            .map_err(|e| rejected(plugin, "restore", e))
    }
}

/// The host's record of what a cache holds, against which every outcome of a policy is
/// replayed before it is believed. Public so that a native policy can be measured with the same
/// check (`benches/policy.rs`).
#[derive(Clone, Debug)]
pub struct ResidentSet {
    capacity: u64,
    map: HashMap<u64, u32, BuildHasherDefault<KeyHasher>>,
    used: u64,
    /// Scratch: how to undo the batch being checked (kept, so a batch allocates nothing).
    undo: Vec<(u64, Option<u32>)>,
}

impl ResidentSet {
    /// An empty set for a cache of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Self { capacity, map: HashMap::default(), used: 0, undo: Vec::new() }
    }

    /// The cache's capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes resident.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Objects resident.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is resident.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `key` is resident.
    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    /// The size of resident `key`.
    pub fn size_of(&self, key: u64) -> Option<u32> {
        self.map.get(&key).copied()
    }

    /// Removes `key`; returns its size.
    pub fn remove(&mut self, key: u64) -> Option<u32> {
        let size = self.map.remove(&key)?;
        debug_assert!(self.used >= u64::from(size), "the resident sizes add up to `used`");
        self.used -= u64::from(size);
        Some(size)
    }

    /// Replays a batch's outcome against the resident set; applies it only if it is valid.
    pub fn apply(&mut self, keys: &[u64], sizes: &[u32], outcome: &AccessOutcome) -> Result<(), String> {
        if outcome.hits.len() != keys.len() {
            return Err(format!("{} hit flags for {} accesses", outcome.hits.len(), keys.len()));
        }
        let mut undo = std::mem::take(&mut self.undo);
        undo.clear();
        let mut used = self.used;
        let checked = (|| {
            let mut evictions = outcome.evictions.iter().peekable();
            for (i, ((&key, &size), &hit)) in keys.iter().zip(sizes).zip(&outcome.hits).enumerate() {
                while let Some(&&(before, victim)) = evictions.peek() {
                    if before as usize != i {
                        break;
                    }
                    evictions.next();
                    if hit {
                        return Err(format!("eviction before access {i}, which hit"));
                    }
                    let size =
                        self.map.remove(&victim).ok_or_else(|| format!("evicted key {victim} is not resident"))?;
                    undo.push((victim, Some(size)));
                    debug_assert!(used >= u64::from(size));
                    used -= u64::from(size);
                }
                let resident = self.map.contains_key(&key);
                if hit != resident {
                    return Err(format!(
                        "access {i} (key {key}) reported as a {} but is {}resident",
                        if hit { "hit" } else { "miss" },
                        if resident { "" } else { "not " }
                    ));
                }
                if !hit && u64::from(size) <= self.capacity {
                    self.map.insert(key, size);
                    undo.push((key, None));
                    used += u64::from(size);
                    if used > self.capacity {
                        return Err(format!("after access {i} the cache holds {used} of {} bytes", self.capacity));
                    }
                }
            }
            match evictions.next() {
                Some((before, key)) => {
                    Err(format!("eviction of {key} before access {before}, out of order or past the batch"))
                }
                None => Ok(()),
            }
        })();
        let result = match checked {
            Ok(()) => {
                self.used = used;
                Ok(())
            }
            Err(detail) => {
                for (key, size) in undo.drain(..).rev() {
                    match size {
                        Some(size) => self.map.insert(key, size),
                        None => self.map.remove(&key),
                    };
                }
                Err(detail)
            }
        };
        self.undo = undo;
        result
    }
}

fn plugin_error(error: Error) -> PluginError {
    match error {
        Error::Plugin(error) => error,
        other => PluginError::Load { plugin: "(host)".to_owned(), detail: other.to_string() },
    }
}

/// A new instance of `plugin` with an empty policy for `capacity`.
fn instantiate(plugin: &Plugin, capacity: u64, options: &Vec<(String, String)>) -> Result<Live, Error> {
    let mut instance = match &plugin.inner.pre {
        super::PluginPre::Evictor(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V2))
        }
        super::PluginPre::EvictorV1(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V1))
        }
        _ => {
            return Err(Error::Plugin(PluginError::Load {
                plugin: plugin.name().to_owned(),
                detail: "not an evictor".to_owned(),
            }));
        }
    }
    .map_err(Error::Plugin)?;
    let deadline = plugin.host().limits().deadline_setup;
    let policy = instance
        .call("create", deadline, |b, s| {
            with_guest!(b, |guest, _wit| Ok(guest.call_create(s, capacity, options)?.map_err(policy_error)))
        })?
        .map_err(|e| rejected(plugin, "create", e))?;
    Ok(Live { instance, policy })
}

/// The resident set is checked on every access of every batch: a multiply-and-fold hash of the
/// `u64` key, instead of SipHash, keeps that check well below the policy's own cost. Keys come
/// from the host, not from an adversary.
#[derive(Clone, Copy, Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, key: u64) {
        let h = (self.0 ^ key).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(hits: &[bool], evictions: &[(u32, u64)]) -> AccessOutcome {
        AccessOutcome { hits: hits.to_vec(), evictions: evictions.to_vec() }
    }

    #[test]
    fn an_invalid_outcome_changes_nothing_and_a_valid_one_applies() {
        let mut set = ResidentSet::new(2);
        set.apply(&[1, 2], &[1, 1], &outcome(&[false, false], &[])).expect("valid");
        let before: Vec<(u64, u32)> = {
            let mut v: Vec<_> = set.map.iter().map(|(&k, &s)| (k, s)).collect();
            v.sort_unstable();
            v
        };
        // Each answer goes wrong only after it has inserted or evicted something.
        let wrong = [
            (vec![3, 1], outcome(&[false, false], &[(0, 2)]), "reported as a miss"),
            (vec![3, 4], outcome(&[false, false], &[(0, 2), (1, 9)]), "not resident"),
            (vec![3, 4], outcome(&[false, false], &[(0, 2)]), "holds 3 of 2"),
            (vec![3, 1], outcome(&[false, true], &[(0, 2), (5, 1)]), "past the batch"),
            (vec![3], outcome(&[false, false], &[]), "hit flags"),
        ];
        for (keys, answer, why) in wrong {
            let sizes = vec![1; keys.len()];
            let error = set.apply(&keys, &sizes, &answer).expect_err(why);
            assert!(error.contains(why), "{error:?} should say {why:?}");
            let mut after: Vec<_> = set.map.iter().map(|(&k, &s)| (k, s)).collect();
            after.sort_unstable();
            assert_eq!(after, before, "{why}: the set changed");
            assert_eq!(set.used(), 2);
        }
        set.apply(&[3, 1], &[1, 1], &outcome(&[false, true], &[(0, 2)])).expect("valid");
        assert!(set.contains(1) && set.contains(3) && !set.contains(2));
        assert_eq!((set.len(), set.used()), (2, 2));
    }
}
