//! Metrics: the process's registry of metric sources, and their exposition in the
//! OpenMetrics text format that Prometheus scrapes (`/metrics`, see `http`).
//!
//! Each part of the engine that counts something (a loader, a replication node) registers a
//! `Source` once, at its start. A source keeps its counters the way its hot path likes them
//! (relaxed atomics, never a lock or an allocation per batch). Nothing is copied into the
//! registry until a scrape: then every source writes its samples into one `Samples` set, the
//! samples of sources with the same labels add up, and `prometheus-client` encodes the result.
//! A source that has ended (a loader dropped between two epochs) is folded into the registry's
//! retired totals at the next scrape, so its counters stay monotonic for the process.
//!
//! Names start with `granary_` and carry their unit (`_bytes`, `_seconds`; counters get
//! `_total` from the encoder). Labels are bounded: a rank, a peer, a plugin's name; never a
//! shard or a record (the hottest shards are a top-k gauge).
//!
//! Owns: `Registry` and the process's own (`global`), the `Source` trait, `Samples` and their
//! encoding, `AtomicHistogram`, `Setting`, `Format`, `Kind`, `Unit`, the process's own source (its
//! open descriptors), and the fork hooks (`before_fork`, `after_fork_in_parent`,
//! `after_fork_in_child`, `on_fork_in_child`).
//!
//! Never: blocks a source's hot path (a scrape takes only the registry's own lock and whatever
//! a source's `collect` takes), or exposes a secret (sources give counts, never keys).

#[cfg(feature = "metrics-http")]
pub mod http;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

// std's mutex, not parking_lot's: a child forked while another thread waits for it gets it
// unlocked (`before_fork`), where parking_lot's would be handed to the waiter, a thread the child
// does not have.
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::sync::{Mutex, MutexGuard, PoisonError};

#[cfg(feature = "metrics-http")]
pub use http::{Endpoint, serve};

/// Something that reports metrics at each scrape.
pub trait Source: Send + Sync + 'static {
    /// Writes this source's samples into `out`.
    fn collect(&self, out: &mut Samples);

    /// Whether the source has ended: its counters are then kept as the registry's retired
    /// totals (its gauges are dropped) and it is not asked again.
    fn ended(&self) -> bool {
        false
    }

    /// Whether a child forked from this process keeps the source (the process's own figures
    /// do; a loader's or a node's belong to the parent, whose threads the child lacks).
    fn survives_fork(&self) -> bool {
        false
    }
}

/// A registry of sources: the process has one (`global`), and tests make their own. Cloning
/// shares it.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// Each with the key it was registered under, if any (`register_once`).
    sources: Vec<(Option<String>, Arc<dyn Source>)>,
    /// Series computed from the others after every source has written, by name.
    derived: BTreeMap<&'static str, fn(&mut Samples)>,
    /// The counters and histograms of sources that have ended.
    retired: Samples,
    /// Run in a child after a fork (`on_fork_in_child`): the process's registry only.
    child_hooks: Vec<fn()>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("sources", &self.lock().sources.len()).finish()
    }
}

/// Where a loader or a node registers its metrics.
#[derive(Clone, Debug, Default)]
pub enum Setting {
    /// The process's registry ([`global`]), which [`serve`] exposes.
    #[default]
    Process,
    /// This registry.
    Registry(Registry),
    /// Nowhere: the counters behind the metrics are not kept either (what `granary bench
    /// loader` measures the metrics' cost against).
    Off,
}

impl Setting {
    /// The registry to register with, if any.
    pub fn registry(&self) -> Option<Registry> {
        match self {
            Setting::Process => Some(global().clone()),
            Setting::Registry(registry) => Some(registry.clone()),
            Setting::Off => None,
        }
    }
}

/// The process's registry: loaders and nodes register here unless given another, and
/// `serve` exposes it.
pub fn global() -> &'static Registry {
    static GLOBAL: OnceLock<Registry> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let registry = Registry::default();
        registry.register(Arc::new(Process));
        registry
    })
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every change to `Inner` is whole before the lock is let go: a panic elsewhere while
        // holding it leaves nothing half done.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a source; it is asked at every scrape until it says it has ended.
    pub fn register(&self, source: Arc<dyn Source>) {
        let mut inner = self.lock();
        // Sources that ended are folded in here too, so a process that makes many loaders and
        // is never scraped keeps only the live ones.
        inner.retire_ended();
        inner.sources.push((None, source));
    }

    /// Adds the source `make` builds unless a live source was registered under `key` (one
    /// source of a dataset's hot shards, however many loaders read it); returns whether it did.
    pub fn register_once(&self, key: &str, make: impl FnOnce() -> Arc<dyn Source>) -> bool {
        let mut inner = self.lock();
        inner.retire_ended();
        if inner.sources.iter().any(|(have, _)| have.as_deref() == Some(key)) {
            return false;
        }
        inner.sources.push((Some(key.to_owned()), make()));
        true
    }

    /// The samples of every source, with those of ended sources folded into the retired
    /// totals first.
    pub fn gather(&self) -> Samples {
        let mut inner = self.lock();
        inner.retire_ended();
        let Inner { sources, derived, retired, .. } = &*inner;
        let mut out = retired.clone();
        for (_, source) in sources.iter() {
            source.collect(&mut out);
        }
        for derive in derived.values() {
            derive(&mut out);
        }
        out
    }

    /// Adds a series computed from the samples of all sources (the skew across ranks, say),
    /// once per `name` however often it is asked for.
    pub fn derive(&self, name: &'static str, derive: fn(&mut Samples)) {
        self.lock().derived.entry(name).or_insert(derive);
    }

    /// The exposition in `format`.
    pub fn encode(&self, format: Format) -> String {
        let samples = self.gather();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(samples));
        let mut text = String::new();
        // Writing into a String cannot fail, and every value the collector writes is a number
        // or a label the encoder escapes.
        let encoded = match format {
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut text, &registry),
            Format::Prometheus => prometheus_client::encoding::prometheus_text::encode(&mut text, &registry),
        };
        if encoded.is_err() {
            text.clear();
            if format == Format::OpenMetrics {
                text.push_str("# EOF\n");
            }
        }
        text
    }
}

impl Inner {
    /// Folds the counters and histograms of sources that have ended into `retired`, and lets
    /// the sources go.
    fn retire_ended(&mut self) {
        let Inner { sources, retired, .. } = self;
        sources.retain(|(_, source)| {
            if !source.ended() {
                return true;
            }
            let mut last = Samples::default();
            source.collect(&mut last);
            last.families.retain(|_, family| family.kind != Kind::Gauge);
            retired.merge(last);
            false
        });
    }
}

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text (`application/openmetrics-text`), ending with `# EOF`: what
    /// Prometheus asks for.
    OpenMetrics,
    /// Prometheus text 0.0.4 (`text/plain`): what a scraper gets that does not ask for
    /// OpenMetrics, and what `promtool check metrics` reads.
    Prometheus,
}

impl Format {
    /// The content type of the format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// What a family's samples are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (while the process runs).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations counted into buckets.
    Histogram,
}

/// The unit a family's name ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// A count: no unit in the name.
    None,
    /// `_bytes`.
    Bytes,
    /// `_seconds`.
    Seconds,
    /// `_ratio`.
    Ratio,
}

/// Label pairs of one sample, in the order given.
pub type Labels = Vec<(&'static str, String)>;

/// One sample's value.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Number(f64),
    Histogram(HistogramValue),
}

/// A histogram's buckets (the observations in each, by upper bound, `+Inf` last: the encoder
/// makes them cumulative), sum and count.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramValue {
    /// `(upper bound, observations above the previous bound and at or below this one)`,
    /// ascending, ending with `f64::INFINITY`.
    pub buckets: Vec<(f64, u64)>,
    /// Sum of the observations.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

#[derive(Clone, Debug)]
struct Family {
    help: &'static str,
    unit: Unit,
    kind: Kind,
    samples: BTreeMap<Labels, Value>,
}

/// Samples of a scrape, by family name. Samples with the same name and labels add up (two
/// loaders of one rank in one process, or a retired loader and its successor).
#[derive(Clone, Debug, Default)]
pub struct Samples {
    families: BTreeMap<&'static str, Family>,
}

impl Samples {
    /// Adds `value` to counter `name` (without `_total` or the unit: the encoder adds them).
    pub fn counter(&mut self, name: &'static str, help: &'static str, unit: Unit, labels: Labels, value: f64) {
        self.add(name, help, unit, Kind::Counter, labels, Value::Number(value));
    }

    /// Adds `value` to gauge `name` (without the unit).
    pub fn gauge(&mut self, name: &'static str, help: &'static str, unit: Unit, labels: Labels, value: f64) {
        self.add(name, help, unit, Kind::Gauge, labels, Value::Number(value));
    }

    /// Adds a histogram's observations to `name` (without the unit).
    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        unit: Unit,
        labels: Labels,
        value: HistogramValue,
    ) {
        self.add(name, help, unit, Kind::Histogram, labels, Value::Histogram(value));
    }

    /// The value of counter or gauge `name` with `labels`, if there is one (for tests and
    /// `granary top`).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let family = self.families.get(name)?;
        family.samples.iter().find_map(|(have, value)| match value {
            Value::Number(v) if same_labels(have, labels) => Some(*v),
            _ => None,
        })
    }

    /// The samples of counter or gauge `name`: each label set and its value.
    pub fn values(&self, name: &str) -> impl Iterator<Item = (&Labels, f64)> + '_ {
        self.families.get(name).into_iter().flat_map(|family| {
            family.samples.iter().filter_map(|(labels, value)| match value {
                Value::Number(v) => Some((labels, *v)),
                Value::Histogram(_) => None,
            })
        })
    }

    /// The histogram `name` with `labels`, if there is one.
    pub fn histogram_value(&self, name: &str, labels: &[(&str, &str)]) -> Option<&HistogramValue> {
        let family = self.families.get(name)?;
        family.samples.iter().find_map(|(have, value)| match value {
            Value::Histogram(h) if same_labels(have, labels) => Some(h),
            _ => None,
        })
    }

    fn add(&mut self, name: &'static str, help: &'static str, unit: Unit, kind: Kind, labels: Labels, value: Value) {
        let family = self.families.entry(name).or_insert_with(|| Family { help, unit, kind, samples: BTreeMap::new() });
        if family.kind != kind || family.unit != unit {
            // Two sources disagree on a family: a programming error; the first one's stands,
            // and the exposition stays valid.
            debug_assert!(false, "metric {name} registered as two kinds");
            return;
        }
        match family.samples.entry(labels) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(value);
            }
            std::collections::btree_map::Entry::Occupied(mut slot) => add_value(slot.get_mut(), value),
        }
    }

    fn merge(&mut self, more: Samples) {
        for (name, family) in more.families {
            for (labels, value) in family.samples {
                self.add(name, family.help, family.unit, family.kind, labels, value);
            }
        }
    }
}

fn same_labels(have: &Labels, want: &[(&str, &str)]) -> bool {
    have.len() == want.len() && have.iter().zip(want).all(|((k, v), (wk, wv))| k == wk && v == wv)
}

fn add_value(to: &mut Value, more: Value) {
    match (to, more) {
        (Value::Number(a), Value::Number(b)) => *a += b,
        (Value::Histogram(a), Value::Histogram(b)) if a.buckets.len() == b.buckets.len() => {
            for (have, (_, add)) in a.buckets.iter_mut().zip(b.buckets) {
                have.1 += add;
            }
            a.sum += b.sum;
            a.count += b.count;
        }
        _ => debug_assert!(false, "samples of one family disagree in shape"),
    }
}

impl prometheus_client::collector::Collector for Samples {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, family) in &self.families {
            let unit = match family.unit {
                Unit::None => None,
                Unit::Bytes => Some(prometheus_client::registry::Unit::Bytes),
                Unit::Seconds => Some(prometheus_client::registry::Unit::Seconds),
                Unit::Ratio => Some(prometheus_client::registry::Unit::Other("ratio".to_owned())),
            };
            let kind = match family.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
                Kind::Histogram => MetricType::Histogram,
            };
            let mut metric = encoder.encode_descriptor(name, family.help, unit.as_ref(), kind)?;
            for (labels, value) in &family.samples {
                let labels: Vec<(Cow<'static, str>, Cow<'_, str>)> =
                    labels.iter().map(|(k, v)| (Cow::Borrowed(*k), Cow::Borrowed(v.as_str()))).collect();
                let sample = metric.encode_family(&labels)?;
                match (family.kind, value) {
                    (Kind::Counter, Value::Number(v)) => {
                        let v = v.max(0.0);
                        // Counts print as integers, durations as decimals.
                        if v.fract() == 0.0 && v < 9.0e15 {
                            ConstCounter::new(v as u64).encode(sample)?
                        } else {
                            ConstCounter::new(v).encode(sample)?
                        }
                    }
                    (Kind::Gauge, Value::Number(v)) => ConstGauge::new(*v).encode(sample)?,
                    (Kind::Histogram, Value::Histogram(h)) => {
                        let mut sample = sample;
                        sample.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// A histogram a hot path observes into with relaxed atomics only: fixed bounds, a count per
/// bucket, the sum in nanounits.
#[derive(Debug)]
pub struct AtomicHistogram {
    bounds: &'static [f64],
    /// One per bound, then the overflow bucket.
    counts: Box<[AtomicU64]>,
    /// Sum of the observations, in billionths of the unit.
    sum_nanos: AtomicU64,
}

impl AtomicHistogram {
    /// A histogram with these upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_nanos: AtomicU64::new(0) }
    }

    /// Starts over from no observation.
    pub fn reset(&self) {
        for count in self.counts.iter() {
            count.store(0, Ordering::Relaxed);
        }
        self.sum_nanos.store(0, Ordering::Relaxed);
    }

    /// Counts one observation.
    pub fn observe(&self, value: f64) {
        let bucket = self.bounds.iter().position(|bound| value <= *bound).unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add((value.max(0.0) * 1e9) as u64, Ordering::Relaxed);
    }

    /// The observations so far.
    pub fn value(&self) -> HistogramValue {
        let mut total = 0;
        let mut buckets = Vec::with_capacity(self.counts.len());
        for (i, count) in self.counts.iter().enumerate() {
            let count = count.load(Ordering::Relaxed);
            total += count;
            buckets.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), count));
        }
        HistogramValue { buckets, sum: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9, count: total }
    }
}

thread_local! {
    /// What the thread about to fork holds across the fork (see `before_fork`).
    static HELD_FOR_FORK: std::cell::RefCell<Option<HeldForFork>> = const { std::cell::RefCell::new(None) };
}

struct HeldForFork {
    registry: MutexGuard<'static, Inner>,
    #[cfg(feature = "metrics-http")]
    endpoints: http::HeldForFork,
}

/// Runs `hook` in a child forked from this process, after the parent's sources are gone (a
/// module that counts for the whole process, the plugins' table say, starts the child at zero);
/// a hook given again is kept once. Hooks must not take the registry or wait for a lock.
pub fn on_fork_in_child(hook: fn()) {
    let mut inner = global().lock();
    if !inner.child_hooks.iter().any(|have| std::ptr::fn_addr_eq(*have, hook)) {
        inner.child_hooks.push(hook);
    }
}

/// To be called by the thread about to `fork` (Python's `os.register_at_fork` does): takes the
/// process's registry and the endpoints' list of sockets, so that no scrape, registration or
/// connection holds them across the fork (a child would inherit them locked, with no thread to
/// unlock them). `after_fork_in_parent` or `after_fork_in_child`, on the same thread, lets them
/// go. A second call before either does nothing.
pub fn before_fork() {
    if HELD_FOR_FORK.with(|held| held.borrow().is_some()) {
        return;
    }
    let registry = global().lock();
    #[cfg(feature = "metrics-http")]
    let endpoints = http::hold_for_fork();
    let held = HeldForFork {
        registry,
        #[cfg(feature = "metrics-http")]
        endpoints,
    };
    HELD_FOR_FORK.with(|slot| *slot.borrow_mut() = Some(held));
}

/// After a `fork`, in the parent (or after a fork that failed): lets go what `before_fork` took.
pub fn after_fork_in_parent() {
    HELD_FOR_FORK.with(|held| drop(held.borrow_mut().take()));
}

/// After a `fork`, in the child: forgets the parent's sources (their loaders and nodes run in
/// the parent; the child's own register afresh) and their retired totals, runs the hooks of
/// `on_fork_in_child`, closes the child's copies of the endpoints' sockets (the parent's
/// endpoints serve on; a copy held here would keep a port bound and a closed connection
/// open), then lets go what `before_fork` took. Only for a child that never drops the parent's
/// `Endpoint`s nor the runtimes they run on (Python's binding leaks them, and runs no node).
pub fn after_fork_in_child() {
    HELD_FOR_FORK.with(|held| {
        let Some(mut held) = held.borrow_mut().take() else { return };
        #[cfg(feature = "metrics-http")]
        http::close_in_child(held.endpoints);
        held.registry.sources.retain(|(_, source)| source.survives_fork());
        held.registry.retired = Samples::default();
        for hook in held.registry.child_hooks.clone() {
            hook();
        }
    });
}

/// The process's own figures: open files.
struct Process;

impl Source for Process {
    fn survives_fork(&self) -> bool {
        true
    }

    fn collect(&self, out: &mut Samples) {
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            // The listing's own descriptor is among them.
            let open = entries.count().saturating_sub(1);
            out.gauge(
                "granary_process_open_fds",
                "File descriptors the process holds open.",
                Unit::None,
                vec![],
                open as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests;
