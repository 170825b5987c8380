//! Supervision: keeps a policy answering while its plugin fails.
//!
//! A supervisor holds the active plugin and a fallback (the previous plugin after a swap, or a
//! built-in, run with its default options). A call goes to the active plugin; when it traps,
//! overruns its deadline or returns
//! an invalid output, its store is dropped, the failure is counted and recorded, and the call is
//! answered by the fallback. The failed plugin is rebuilt on a later call once its backoff (which
//! doubles with each consecutive failure) has passed; after `quarantine_after` failures in a row
//! it is quarantined and only the fallback is used. A plugin's own refusal of its input is
//! returned to the caller as is: it is an answer, not a failure.
//!
//! Owns: `Supervisor` (the active plugin and the fallback, each one's backoff and quarantine, the
//! last `EVENTS_MAX` failures), `PolicyStatus`, and `SwapHandle` (a plugin handed over from another
//! thread, switched to between two calls). Never: asks the plugin that failed a call to answer it
//! again (the fallback does), counts a refusal (`PluginError::Rejected`) as a failure, or checks an
//! answer itself (each host's call does).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::metrics::PluginCounters;
use super::{Limits, Plugin};
use crate::error::{Error, PluginError};

/// Failures kept for reports.
const EVENTS_MAX: usize = 16;

/// Which plugin answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Active,
    Fallback,
}

/// Options a plugin is run with.
pub(crate) type Options = Vec<(String, String)>;

/// Builds an instance of a plugin run with its options.
pub(crate) type Make<'a, I> = dyn FnMut(&Plugin, &[(String, String)]) -> Result<I, PluginError> + 'a;

/// One call on an instance: `fresh` when it must first be brought up to date, and its options.
pub(crate) type Op<'a, I, R> = dyn FnMut(&mut I, bool, &[(String, String)]) -> Result<R, PluginError> + 'a;

struct Slot<I> {
    plugin: Plugin,
    options: Options,
    instance: Option<I>,
    consecutive: u32,
    failures: u64,
    retry_at: Option<Instant>,
    quarantined: bool,
    /// The process-wide counters of plugins of this name (the metrics).
    counters: Arc<PluginCounters>,
}

impl<I> Slot<I> {
    fn new(plugin: Plugin, options: Options, instance: Option<I>) -> Self {
        let counters = super::metrics::counters(plugin.name());
        Self { plugin, options, instance, consecutive: 0, failures: 0, retry_at: None, quarantined: false, counters }
    }
}

/// Where a policy stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyStatus {
    /// The active plugin's name.
    pub active: String,
    /// The fallback's name.
    pub fallback: Option<String>,
    /// Whether the active plugin is quarantined.
    pub quarantined: bool,
    /// Failures of the active plugin so far.
    pub failures: u64,
    /// Failures of the active plugin in a row.
    pub consecutive_failures: u32,
    /// Calls the fallback answered.
    pub fallback_calls: u64,
    /// The most recent failures, oldest first.
    pub recent: Vec<PluginError>,
}

/// Hands a new plugin to a running policy from another thread; the policy switches to it
/// between two calls.
#[derive(Clone)]
pub struct SwapHandle(Arc<Mutex<Option<(Plugin, Options)>>>);

impl SwapHandle {
    /// Asks the policy to switch to `plugin`, run with `options`, before its next call.
    pub fn swap(&self, plugin: Plugin, options: &[(String, String)]) {
        *self.0.lock() = Some((plugin, options.to_vec()));
    }
}

pub(crate) struct Supervisor<I> {
    active: Slot<I>,
    fallback: Option<Slot<I>>,
    pending: Arc<Mutex<Option<(Plugin, Options)>>>,
    last_side: Option<Side>,
    limits: Limits,
    events: VecDeque<PluginError>,
    fallback_calls: u64,
}

impl<I> Supervisor<I> {
    /// A supervisor of `active` (run with `options`, its instance already built when given) and
    /// `fallback` (run with its defaults).
    pub(crate) fn new(
        active: Plugin,
        options: Options,
        instance: Option<I>,
        fallback: Option<Plugin>,
        limits: Limits,
    ) -> Self {
        let last_side = instance.as_ref().map(|_| Side::Active);
        Self {
            active: Slot::new(active, options, instance),
            fallback: fallback.map(|plugin| Slot::new(plugin, Vec::new(), None)),
            pending: Arc::new(Mutex::new(None)),
            last_side,
            limits,
            events: VecDeque::new(),
            fallback_calls: 0,
        }
    }

    /// A supervisor of `plugin`, run with `options` and instantiated by `instantiate` now (a
    /// plugin that does not start is refused here), and `fallback` (run with its defaults); both
    /// must be plugins of `kind`. What every policy kind's constructor does.
    pub(crate) fn of_kind(
        kind: super::PolicyKind,
        plugin: Plugin,
        options: &[(String, String)],
        fallback: Option<Plugin>,
        instantiate: impl FnOnce(&Plugin) -> Result<I, Error>,
    ) -> Result<Self, Error> {
        plugin.expect_kind(kind)?;
        if let Some(fallback) = &fallback {
            fallback.expect_kind(kind)?;
        }
        let instance = instantiate(&plugin)?;
        let limits = plugin.host().limits().clone();
        Ok(Self::new(plugin, options.to_vec(), Some(instance), fallback, limits))
    }

    /// Switches to `plugin` (of `kind`, run with `options`, instantiated by `instantiate` now:
    /// on any failure the current plugin stays); the current one becomes the fallback. What
    /// every policy kind's `swap` does.
    pub(crate) fn swap_to(
        &mut self,
        kind: super::PolicyKind,
        plugin: Plugin,
        options: &[(String, String)],
        instantiate: impl FnOnce(&Plugin) -> Result<I, Error>,
    ) -> Result<(), Error> {
        plugin.expect_kind(kind)?;
        let instance = instantiate(&plugin)?;
        self.promote(plugin, options.to_vec(), Some(instance));
        Ok(())
    }

    pub(crate) fn swap_handle(&self) -> SwapHandle {
        SwapHandle(self.pending.clone())
    }

    /// A plugin handed over through a `SwapHandle`, if any.
    pub(crate) fn take_pending(&mut self) -> Option<(Plugin, Options)> {
        self.pending.lock().take()
    }

    pub(crate) fn active_plugin(&self) -> &Plugin {
        &self.active.plugin
    }

    /// The live instance of the active plugin, if it is up and last answered.
    pub(crate) fn active_instance(&mut self) -> Option<&mut I> {
        if self.last_side == Some(Side::Active) { self.active.instance.as_mut() } else { None }
    }

    /// Makes `plugin` (with its instance, when already built and in sync) the active plugin; the
    /// old one becomes the fallback unless it is quarantined.
    pub(crate) fn promote(&mut self, plugin: Plugin, options: Options, instance: Option<I>) {
        let in_sync = instance.is_some();
        let old = std::mem::replace(&mut self.active, Slot::new(plugin, options, instance));
        if !old.quarantined {
            self.fallback = Some(Slot { instance: None, ..old });
        }
        self.last_side = if in_sync { Some(Side::Active) } else { None };
    }

    /// Runs `op` on the active plugin, or on the fallback when the active one is down or fails.
    /// `make` builds an instance; `op` gets `true` when the instance must first be brought up to
    /// date (it is new, or the other plugin answered last).
    pub(crate) fn run<R>(&mut self, make: &mut Make<'_, I>, op: &mut Op<'_, I, R>) -> Result<R, Error> {
        let mut last_error = None;
        let active_counters = Arc::clone(&self.active.counters);
        for side in [Side::Active, Side::Fallback] {
            let slot = match side {
                Side::Active => &mut self.active,
                Side::Fallback => match &mut self.fallback {
                    Some(slot) => slot,
                    None => continue,
                },
            };
            if slot.quarantined || slot.retry_at.is_some_and(|at| Instant::now() < at) {
                continue;
            }
            let fresh = slot.instance.is_none() || self.last_side != Some(side);
            if slot.instance.is_none() {
                match make(&slot.plugin, &slot.options) {
                    Ok(instance) => slot.instance = Some(instance),
                    Err(error) => {
                        last_error = Some(self.fail(side, error));
                        continue;
                    }
                }
            }
            let instance = slot.instance.as_mut().expect("built above");
            let started = Instant::now();
            let outcome = op(instance, fresh, &slot.options);
            slot.counters.called(started.elapsed());
            match outcome {
                Ok(out) => {
                    slot.consecutive = 0;
                    slot.retry_at = None;
                    self.last_side = Some(side);
                    if side == Side::Fallback {
                        self.fallback_calls += 1;
                        active_counters.fell_back();
                    }
                    return Ok(out);
                }
                Err(error @ PluginError::Rejected { .. }) => {
                    // The instance is intact and still in sync: a refusal changes no state.
                    self.last_side = Some(side);
                    return Err(Error::Plugin(error));
                }
                Err(error) => last_error = Some(self.fail(side, error)),
            }
        }
        Err(Error::Plugin(last_error.unwrap_or_else(|| PluginError::Quarantined {
            plugin: self.active.plugin.name().to_owned(),
            failures: self.active.consecutive,
            last: self.events.back().map_or_else(|| "none".to_owned(), ToString::to_string),
        })))
    }

    fn fail(&mut self, side: Side, error: PluginError) -> PluginError {
        let limits = &self.limits;
        let slot = match side {
            Side::Active => &mut self.active,
            Side::Fallback => self.fallback.as_mut().expect("only a present fallback fails"),
        };
        slot.instance = None;
        slot.failures += 1;
        slot.consecutive += 1;
        slot.counters.failed(&error);
        if slot.consecutive >= limits.quarantine_after {
            if !slot.quarantined {
                slot.counters.quarantined();
            }
            slot.quarantined = true;
        } else {
            let backoff =
                limits.backoff_base.saturating_mul(1 << (slot.consecutive - 1).min(16)).min(limits.backoff_max);
            slot.retry_at = Some(Instant::now() + backoff);
        }
        if self.last_side == Some(side) {
            self.last_side = None;
        }
        if self.events.len() == EVENTS_MAX {
            self.events.pop_front();
        }
        self.events.push_back(error.clone());
        error
    }

    pub(crate) fn status(&self) -> PolicyStatus {
        PolicyStatus {
            active: self.active.plugin.name().to_owned(),
            fallback: self.fallback.as_ref().map(|slot| slot.plugin.name().to_owned()),
            quarantined: self.active.quarantined,
            failures: self.active.failures,
            consecutive_failures: self.active.consecutive,
            fallback_calls: self.fallback_calls,
            recent: self.events.iter().cloned().collect(),
        }
    }
}
