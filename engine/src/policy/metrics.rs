//! The policy plugins' metrics: calls, their latency, failures by kind, calls the fallback
//! answered and quarantines, per plugin name, for the whole process (every supervisor of a
//! plugin of that name counts into one entry). Reported to the process's registry
//! (`metrics::global`, whatever registry a loader or node is given) from the first
//! `PolicyHost` on.
//!
//! Owns: `PluginCounters` (one plugin name's counters) and the process's table of them, registered
//! as one metrics source.
//!
//! Never: takes a lock on a call (a supervisor holds its entry; the table's lock is taken when a
//! supervisor starts and at a scrape), or labels by anything but the plugin's name (a built-in
//! name or a file's stem, never its path) and a failure's kind.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::PluginError;
use crate::metrics::{AtomicHistogram, Samples, Source, Unit};

/// Upper bounds of the call latency histogram, in seconds.
static CALL_BOUNDS: [f64; 10] = [0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 1.0];

/// The kinds a failure is counted under.
const KINDS: [&str; 6] = ["trap", "deadline", "memory", "invalid-output", "load", "other"];

/// One plugin name's counters.
pub(crate) struct PluginCounters {
    calls: AtomicU64,
    latency: AtomicHistogram,
    /// By `KINDS`.
    failures: [AtomicU64; 6],
    fallback_calls: AtomicU64,
    quarantines: AtomicU64,
}

impl PluginCounters {
    fn new() -> Self {
        Self {
            calls: AtomicU64::new(0),
            latency: AtomicHistogram::new(&CALL_BOUNDS),
            failures: Default::default(),
            fallback_calls: AtomicU64::new(0),
            quarantines: AtomicU64::new(0),
        }
    }

    /// A call that returned (with an answer or a failure), and how long it took.
    pub(crate) fn called(&self, took: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.latency.observe(took.as_secs_f64());
    }

    pub(crate) fn failed(&self, error: &PluginError) {
        let kind = match error {
            PluginError::Trap { .. } | PluginError::StackOverflow { .. } => 0,
            PluginError::Deadline { .. } | PluginError::OutOfFuel { .. } => 1,
            PluginError::MemoryLimit { .. } => 2,
            PluginError::InvalidOutput { .. } => 3,
            PluginError::Load { .. } => 4,
            _ => 5,
        };
        self.failures[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// A call the fallback answered instead of this plugin.
    pub(crate) fn fell_back(&self) {
        self.fallback_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn quarantined(&self) {
        self.quarantines.fetch_add(1, Ordering::Relaxed);
    }
}

/// Every plugin name's counters in this process.
#[derive(Default)]
struct Table(Mutex<BTreeMap<String, Arc<PluginCounters>>>);

static TABLE: OnceLock<Arc<Table>> = OnceLock::new();

/// The table. Its initialisation takes no lock: a fork that catches it half done leaves the
/// child nothing to wait for.
fn table() -> &'static Arc<Table> {
    TABLE.get_or_init(Default::default)
}

/// In a forked child: the parent's counts are the parent's (a sum over parent and children
/// would count them twice). A table the fork caught locked is left as it is.
fn start_child_at_zero() {
    if let Some(table) = TABLE.get().and_then(|table| table.0.try_lock()) {
        for counters in table.values() {
            counters.calls.store(0, Ordering::Relaxed);
            counters.latency.reset();
            for count in &counters.failures {
                count.store(0, Ordering::Relaxed);
            }
            counters.fallback_calls.store(0, Ordering::Relaxed);
            counters.quarantines.store(0, Ordering::Relaxed);
        }
    }
}

/// Registers the table with the process's registry, if not yet done: called where no lock of
/// the caller's is held (`PolicyHost::new`), so that registering never waits on a scrape
/// while holding a lock a scrape needs.
pub(crate) fn init() {
    let table = table();
    crate::metrics::global().register_once("granary-plugins", || Arc::clone(table) as Arc<dyn Source>);
    crate::metrics::on_fork_in_child(start_child_at_zero);
}

/// The counters of plugin `name`.
pub(crate) fn counters(name: &str) -> Arc<PluginCounters> {
    Arc::clone(table().0.lock().entry(name.to_owned()).or_insert_with(|| Arc::new(PluginCounters::new())))
}

impl Source for Table {
    fn survives_fork(&self) -> bool {
        true
    }

    fn collect(&self, out: &mut Samples) {
        for (name, counters) in self.0.lock().iter() {
            let plugin = || vec![("plugin", name.clone())];
            let get = |v: &AtomicU64| v.load(Ordering::Relaxed) as f64;
            out.counter(
                "granary_plugin_calls",
                "Calls made to a policy plugin.",
                Unit::None,
                plugin(),
                get(&counters.calls),
            );
            out.histogram(
                "granary_plugin_call",
                "How long a plugin's calls took.",
                Unit::Seconds,
                plugin(),
                counters.latency.value(),
            );
            for (kind, count) in KINDS.iter().zip(&counters.failures) {
                out.counter(
                    "granary_plugin_failures",
                    "A plugin's failures by kind (traps, deadlines, memory, invalid output, load).",
                    Unit::None,
                    vec![("plugin", name.clone()), ("kind", (*kind).to_owned())],
                    get(count),
                );
            }
            out.counter(
                "granary_plugin_fallback_calls",
                "Calls the fallback answered while this plugin was failing or quarantined.",
                Unit::None,
                plugin(),
                get(&counters.fallback_calls),
            );
            out.counter(
                "granary_plugin_quarantines",
                "Times the plugin was quarantined.",
                Unit::None,
                plugin(),
                get(&counters.quarantines),
            );
        }
    }
}
