//! Policies as sandboxed WebAssembly components: partitioners, evictors and replicators that
//! users write, test with the plugin kit, and swap while the engine runs.
//!
//! Owns: the wasmtime engine (component model, no async/concurrency support, epoch interruption
//! driven by a ticker thread, a pooling allocator, an optional fuel meter), compiled-plugin
//! caching (`cache`), the sandbox (`sandbox`), and one supervised host type per policy kind
//! (`Partitioner`, `Evictor`, `Replicator`) that calls the plugin in bulk, validates every
//! output and recovers from failures. Invariants: a plugin cannot crash, hang or exhaust the
//! host, nor touch files, the network, clocks or the environment; every failure is a
//! `PluginError`, counted; the caller keeps getting decisions from the last good policy while a
//! failed plugin is rebuilt with backoff, and a plugin that keeps failing is quarantined.
//! Never: on the per-sample path (calls are per batch, per epoch or per topology change).

mod bindings;
pub mod builtin;
mod cache;
pub mod conformance;
mod evictor;
mod keyed_cache;
mod metrics;
mod partitioner;
mod replicator;
mod sandbox;
pub mod sim;
mod supervise;
pub mod trace;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmtime::component::Linker;
use wasmtime::{Engine, Store};

pub use cache::CompiledFrom;
pub use evictor::{AccessOutcome, Evictor, EvictorStats, ResidentSet};
#[cfg(feature = "replication")]
pub(crate) use keyed_cache::ShardCache;
pub(crate) use keyed_cache::{CacheKey, KeyedCache};
pub use partitioner::{
    EpochSpec, NodeInfo, Partitioner, RankInfo, RankMeasure, RankPlan, RebalancePoint, ShardInfo, WEIGHT_MAX,
};
pub use replicator::{
    Holding, NodeSpace, Placement, ReplicationMode, Replicator, ShardGoal, ShardHeat, Transfer, shard_key,
};
pub use supervise::{PolicyStatus, SwapHandle};

use crate::error::{Error, PluginError};
use crate::id::ObjectId;
use sandbox::Sandbox;

/// What each plugin may use, and how failures are handled.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Linear memory a plugin may grow to.
    pub memory_bytes_max: usize,
    /// Native stack a plugin may use.
    pub stack_bytes_max: usize,
    /// The epoch ticker's period: deadlines are counted in ticks.
    pub tick: Duration,
    /// Deadline of a partitioner's `plan`.
    pub deadline_plan: Duration,
    /// Deadline of an evictor's batch.
    pub deadline_evict: Duration,
    /// Deadline of a replicator's `place` or `repair`.
    pub deadline_replicate: Duration,
    /// Deadline of creating, snapshotting or restoring a policy.
    pub deadline_setup: Duration,
    /// Meter fuel (costs speed; used to measure a plugin's cost in tests and benchmarks).
    pub fuel: bool,
    /// Consecutive failures after which a plugin is quarantined.
    pub quarantine_after: u32,
    /// The first backoff before rebuilding a failed plugin; it doubles per consecutive failure.
    pub backoff_base: Duration,
    /// The longest backoff.
    pub backoff_max: Duration,
    /// An evictor is snapshotted every this many batches (its state survives a trap).
    pub snapshot_every: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes_max: 256 << 20,
            stack_bytes_max: 512 << 10,
            tick: Duration::from_millis(1),
            deadline_plan: Duration::from_secs(10),
            deadline_evict: Duration::from_millis(200),
            deadline_replicate: Duration::from_secs(10),
            deadline_setup: Duration::from_secs(2),
            fuel: false,
            quarantine_after: 5,
            backoff_base: Duration::from_millis(10),
            backoff_max: Duration::from_secs(1),
            snapshot_every: 64,
        }
    }
}

/// The three kinds of policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    /// `granary:policy/partitioner`.
    Partitioner,
    /// `granary:policy/evictor`.
    Evictor,
    /// `granary:policy/replicator`.
    Replicator,
}

impl PolicyKind {
    fn export(self, version: WitVersion) -> String {
        format!("granary:policy/{}@{}", self.name(), version.name())
    }

    /// The lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Partitioner => "partitioner",
            Self::Evictor => "evictor",
            Self::Replicator => "replicator",
        }
    }
}

/// The version of the `granary:policy` package a plugin was built against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WitVersion {
    /// `@0.1.0`: decisions from static inputs only (no `rebalance`, no `adapt`).
    V0_1,
    /// `@0.2.0`: adds the measured inputs (`rebalance`, `adapt`).
    V0_2,
}

impl WitVersion {
    /// "0.1.0" or "0.2.0".
    pub fn name(self) -> &'static str {
        match self {
            Self::V0_1 => "0.1.0",
            Self::V0_2 => "0.2.0",
        }
    }
}

/// Runs policy plugins. Cheap to clone; one per process is enough.
#[derive(Clone)]
pub struct PolicyHost {
    inner: Arc<HostInner>,
}

struct HostInner {
    engine: Engine,
    linker: Linker<Sandbox>,
    limits: Limits,
    cache: cache::ComponentCache,
    /// Held for its `Drop`, which stops the thread.
    _ticker: Ticker,
}

impl PolicyHost {
    /// A host with these limits; compiled plugins are cached in `cache_dir` when given.
    pub fn new(limits: Limits, cache_dir: Option<PathBuf>) -> Result<Self, Error> {
        metrics::init();
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        // Measured here: a component call costs 191 ns with concurrency support off, 534 ns on.
        config.concurrency_support(false);
        config.epoch_interruption(true);
        config.consume_fuel(limits.fuel);
        config.max_wasm_stack(limits.stack_bytes_max);
        // `perf` can name the plugins' functions: compiled code goes into /tmp/perf-PID.map.
        if std::env::var_os("GRANARY_WASM_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let mut pool = wasmtime::PoolingAllocationConfig::default();
        pool.total_component_instances(256);
        pool.total_core_instances(512);
        pool.total_memories(512);
        pool.total_tables(512);
        pool.max_memory_size(limits.memory_bytes_max);
        config.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(|e| host_error(&e))?;
        let linker = sandbox::linker(&engine).map_err(|e| host_error(&e))?;
        let ticker = Ticker::start(engine.clone(), limits.tick)?;
        let cache = cache::ComponentCache::new(cache_dir);
        Ok(Self { inner: Arc::new(HostInner { engine, linker, limits, cache, _ticker: ticker }) })
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Loads a plugin from a `.wasm` component file.
    pub fn load_file(&self, path: &Path) -> Result<Plugin, Error> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("read", path, e))?;
        let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        self.load_bytes(&name, &bytes)
    }

    /// Loads a plugin built into the engine (`lru`, `elastic`, ...), see [`builtin`].
    pub fn load_builtin(&self, name: &str) -> Result<Plugin, Error> {
        let bytes = builtin::bytes(name).ok_or_else(|| Error::NotFound {
            what: format!("built-in plugin {name:?} (built in: {})", builtin::NAMES.join(", ")),
        })?;
        self.load_bytes(name, bytes)
    }

    /// Loads a built-in plugin by name, or a component file by path. A name that is neither
    /// says so, lists the built-ins, and names the one it was probably meant to be
    /// (`s3fifo` for `s3-fifo`).
    pub fn load(&self, name_or_path: &str) -> Result<Plugin, Error> {
        if builtin::bytes(name_or_path).is_some() {
            return self.load_builtin(name_or_path);
        }
        let path = Path::new(name_or_path);
        // Only a path that surely names nothing is "not found"; one that cannot be looked at
        // (a directory without permission) goes on to the read, which says why.
        if matches!(path.try_exists(), Ok(false)) {
            let squashed = |name: &str| name.replace(['-', '_', ' '], "").to_ascii_lowercase();
            let meant = builtin::NAMES.iter().find(|name| squashed(name) == squashed(name_or_path));
            return Err(Error::NotFound {
                what: format!(
                    "plugin {name_or_path:?}: no such file, and no built-in of that name (built in: {}){}",
                    builtin::NAMES.join(", "),
                    meant.map(|name| format!("; did you mean {name:?}?")).unwrap_or_default()
                ),
            });
        }
        self.load_file(path)
    }

    /// A partitioner: the plugin `name_or_path` (the built-in default when `None`) run with
    /// `options`, and the built-in default (with its defaults) as the fallback.
    pub fn partitioner(&self, name_or_path: Option<&str>, options: &[(String, String)]) -> Result<Partitioner, Error> {
        let fallback = self.load_builtin(builtin::DEFAULT_PARTITIONER)?;
        let plugin = name_or_path.map_or_else(|| Ok(fallback.clone()), |name| self.load(name))?;
        Partitioner::new(plugin, options, Some(fallback))
    }

    /// An evictor for `capacity`: the plugin `name_or_path` (the built-in default when `None`)
    /// run with `options`, and the built-in default as the fallback.
    pub fn evictor(
        &self,
        name_or_path: Option<&str>,
        options: &[(String, String)],
        capacity: u64,
    ) -> Result<Evictor, Error> {
        let fallback = self.load_builtin(builtin::DEFAULT_EVICTOR)?;
        let plugin = name_or_path.map_or_else(|| Ok(fallback.clone()), |name| self.load(name))?;
        Evictor::new(plugin, options, Some(fallback), capacity)
    }

    /// A replicator: the plugin `name_or_path` (the built-in default when `None`) run with
    /// `options`, and the built-in default as the fallback.
    pub fn replicator(&self, name_or_path: Option<&str>, options: &[(String, String)]) -> Result<Replicator, Error> {
        let fallback = self.load_builtin(builtin::DEFAULT_REPLICATOR)?;
        let plugin = name_or_path.map_or_else(|| Ok(fallback.clone()), |name| self.load(name))?;
        Replicator::new(plugin, options, Some(fallback))
    }

    /// Loads a plugin from component bytes.
    pub fn load_bytes(&self, name: &str, bytes: &[u8]) -> Result<Plugin, Error> {
        let refuse = |detail: String| Error::Plugin(PluginError::Load { plugin: name.to_owned(), detail });
        let started = Instant::now();
        let (id, component, from) =
            self.inner.cache.get(&self.inner.engine, bytes).map_err(|e| refuse(format!("{e:#}")))?;
        let exports: Vec<String> =
            component.component_type().exports(&self.inner.engine).map(|(name, _)| name.to_owned()).collect();
        let mut kinds: Vec<(PolicyKind, WitVersion)> = Vec::new();
        for kind in [PolicyKind::Partitioner, PolicyKind::Evictor, PolicyKind::Replicator] {
            for version in [WitVersion::V0_2, WitVersion::V0_1] {
                if exports.iter().any(|e| *e == kind.export(version)) {
                    kinds.push((kind, version));
                }
            }
        }
        let (kind, version) = match kinds.as_slice() {
            [found] => *found,
            [] => {
                return Err(refuse(format!(
                    "exports no granary policy interface of a version this host runs (0.1.0 or 0.2.0; exports: {})",
                    exports.join(", ")
                )));
            }
            _ => return Err(refuse("exports more than one policy interface".to_owned())),
        };
        // Imports the sandbox does not offer (files, sockets, ...) fail here, before any call,
        // named, rather than as the linker's text.
        let pre = self.inner.linker.instantiate_pre(&component).map_err(|e| {
            let refused: Vec<String> = component
                .component_type()
                .imports(&self.inner.engine)
                .map(|(name, _)| name.to_owned())
                .filter(|name| !sandbox::offers(name))
                .collect();
            if refused.is_empty() {
                return refuse(format!("{e:#}"));
            }
            refuse(format!(
                "it imports {}, which the sandbox refuses: policy plugins get no capabilities (no files, no \
                 sockets, no environment; clocks and randomness are fixed stand-ins so that runs reproduce). \
                 Build it without them (in Rust: no std::fs, std::net or std::env)",
                refused.join(", ")
            ))
        })?;
        let typed = |e: wasmtime::Error| refuse(format!("{e:#}"));
        let pre = match (kind, version) {
            (PolicyKind::Partitioner, WitVersion::V0_2) => {
                PluginPre::Partitioner(bindings::partitioner::PartitionerPluginPre::new(pre).map_err(typed)?)
            }
            (PolicyKind::Partitioner, WitVersion::V0_1) => {
                PluginPre::PartitionerV1(bindings::v1::partitioner::PartitionerPluginPre::new(pre).map_err(typed)?)
            }
            (PolicyKind::Evictor, WitVersion::V0_2) => {
                PluginPre::Evictor(bindings::evictor::EvictorPluginPre::new(pre).map_err(typed)?)
            }
            (PolicyKind::Evictor, WitVersion::V0_1) => {
                PluginPre::EvictorV1(bindings::v1::evictor::EvictorPluginPre::new(pre).map_err(typed)?)
            }
            (PolicyKind::Replicator, WitVersion::V0_2) => {
                PluginPre::Replicator(bindings::replicator::ReplicatorPluginPre::new(pre).map_err(typed)?)
            }
            (PolicyKind::Replicator, WitVersion::V0_1) => {
                PluginPre::ReplicatorV1(bindings::v1::replicator::ReplicatorPluginPre::new(pre).map_err(typed)?)
            }
        };
        Ok(Plugin {
            inner: Arc::new(PluginInner {
                name: name.to_owned(),
                id,
                kind,
                version,
                pre,
                host: self.clone(),
                from,
                load_time: started.elapsed(),
            }),
        })
    }

    fn new_store(&self) -> Store<Sandbox> {
        let mut store = Store::new(&self.inner.engine, Sandbox::new(self.inner.limits.memory_bytes_max));
        store.limiter(|sandbox| &mut sandbox.memory);
        store.epoch_deadline_trap();
        if self.inner.limits.fuel {
            // Fuel measures cost; the epoch deadline bounds time.
            let _ = store.set_fuel(u64::MAX);
        }
        store
    }
}

fn host_error(error: &wasmtime::Error) -> Error {
    Error::Plugin(PluginError::Load { plugin: "(engine)".to_owned(), detail: format!("{error:#}") })
}

enum PluginPre {
    Partitioner(bindings::partitioner::PartitionerPluginPre<Sandbox>),
    PartitionerV1(bindings::v1::partitioner::PartitionerPluginPre<Sandbox>),
    Evictor(bindings::evictor::EvictorPluginPre<Sandbox>),
    EvictorV1(bindings::v1::evictor::EvictorPluginPre<Sandbox>),
    Replicator(bindings::replicator::ReplicatorPluginPre<Sandbox>),
    ReplicatorV1(bindings::v1::replicator::ReplicatorPluginPre<Sandbox>),
}

/// A loaded (compiled, linked, type-checked) plugin, ready to be instantiated. Cheap to clone.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<PluginInner>,
}

struct PluginInner {
    name: String,
    id: ObjectId,
    kind: PolicyKind,
    version: WitVersion,
    pre: PluginPre,
    host: PolicyHost,
    from: CompiledFrom,
    load_time: Duration,
}

impl Plugin {
    /// The plugin's name (a built-in name, or the file's stem).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The BLAKE3 of the component's bytes.
    pub fn id(&self) -> ObjectId {
        self.inner.id
    }

    /// Which policy it implements.
    pub fn kind(&self) -> PolicyKind {
        self.inner.kind
    }

    /// The version of `granary:policy` it was built against.
    pub fn wit_version(&self) -> WitVersion {
        self.inner.version
    }

    /// Whether this load compiled the plugin or found it compiled.
    pub fn compiled_from(&self) -> CompiledFrom {
        self.inner.from
    }

    /// How long loading took.
    pub fn load_time(&self) -> Duration {
        self.inner.load_time
    }

    fn host(&self) -> &PolicyHost {
        &self.inner.host
    }

    fn expect_kind(&self, kind: PolicyKind) -> Result<(), Error> {
        if self.inner.kind == kind {
            Ok(())
        } else {
            Err(Error::Plugin(PluginError::Load {
                plugin: self.inner.name.clone(),
                detail: format!("it is a {}, not a {}", self.inner.kind.name(), kind.name()),
            }))
        }
    }
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, name, version) = (self.inner.kind.name(), &self.inner.name, self.inner.version.name());
        write!(f, "Plugin({kind} {name}@{version}, {})", self.inner.id.short(12))
    }
}

/// A plugin instance: its store and its bindings.
struct Instance<B> {
    store: Store<Sandbox>,
    bindings: B,
    plugin: Plugin,
    /// Fuel burnt by calls so far (when metered).
    fuel_used: u64,
}

impl<B> Instance<B> {
    /// Runs one call under `deadline`, turning every way it can fail into a `PluginError`.
    fn call<T>(
        &mut self,
        call: &'static str,
        deadline: Duration,
        f: impl FnOnce(&B, &mut Store<Sandbox>) -> wasmtime::Result<T>,
    ) -> Result<T, PluginError> {
        let tick = self.plugin.host().inner.limits.tick.as_nanos().max(1);
        let ticks = u64::try_from(deadline.as_nanos().div_ceil(tick)).unwrap_or(u64::MAX).max(1);
        self.store.set_epoch_deadline(ticks);
        let fuel_before = self.store.get_fuel().ok();
        let outcome = f(&self.bindings, &mut self.store);
        if let (Some(before), Ok(after)) = (fuel_before, self.store.get_fuel()) {
            self.fuel_used += before.saturating_sub(after);
        }
        outcome.map_err(|error| self.classify(call, deadline, &error))
    }

    fn classify(&self, call: &'static str, deadline: Duration, error: &wasmtime::Error) -> PluginError {
        let plugin = self.plugin.name().to_owned();
        let sandbox = self.store.data();
        if sandbox.memory.denied {
            return PluginError::MemoryLimit { plugin, call, limit_bytes: sandbox.memory.bytes_max as u64 };
        }
        match error.downcast_ref::<wasmtime::Trap>() {
            Some(wasmtime::Trap::Interrupt) => PluginError::Deadline {
                plugin,
                call,
                deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
            },
            Some(wasmtime::Trap::StackOverflow) => PluginError::StackOverflow { plugin, call },
            Some(wasmtime::Trap::OutOfFuel) => PluginError::OutOfFuel { plugin, call },
            trap => {
                // One line: the trap's cause (not the wasm backtrace), and the guest's last words.
                let mut detail = match trap {
                    Some(trap) => trap.to_string(),
                    None => error.root_cause().to_string().lines().next().unwrap_or("unknown error").to_owned(),
                };
                let stderr = sandbox.stderr();
                if !stderr.is_empty() {
                    let words: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("note: run with")).collect();
                    detail.push_str(&format!(" (guest stderr: {})", words.join(" | ")));
                }
                PluginError::Trap { plugin, call, detail }
            }
        }
    }
}

/// A new instance: a fresh store, instantiated under the setup deadline.
fn instantiate_with<B>(
    plugin: &Plugin,
    instantiate: impl FnOnce(&mut Store<Sandbox>) -> wasmtime::Result<B>,
) -> Result<Instance<B>, PluginError> {
    let host = plugin.host();
    let mut store = host.new_store();
    let deadline = host.limits().deadline_setup;
    let tick = host.limits().tick.as_nanos().max(1);
    store.set_epoch_deadline(u64::try_from(deadline.as_nanos().div_ceil(tick)).unwrap_or(u64::MAX).max(1));
    match instantiate(&mut store) {
        Ok(bindings) => Ok(Instance { store, bindings, plugin: plugin.clone(), fuel_used: 0 }),
        Err(error) => {
            let probe = Instance { store, bindings: (), plugin: plugin.clone(), fuel_used: 0 };
            Err(probe.classify("instantiate", deadline, &error))
        }
    }
}

/// Converts a plugin's own refusal into a `PluginError`.
fn rejected(plugin: &Plugin, call: &'static str, error: bindings::WitPolicyError) -> PluginError {
    let detail = match error {
        bindings::WitPolicyError::InvalidInput(detail) => format!("invalid input: {detail}"),
        bindings::WitPolicyError::Unsupported(detail) => format!("unsupported: {detail}"),
    };
    PluginError::Rejected { plugin: plugin.name().to_owned(), call, detail }
}

fn invalid(plugin: &Plugin, call: &'static str, detail: String) -> PluginError {
    PluginError::InvalidOutput { plugin: plugin.name().to_owned(), call, detail }
}

/// The thread that advances the engine's epoch every tick, which is what interrupts a plugin
/// that overruns its deadline. Stopped and joined when the host is dropped.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: Engine, tick: Duration) -> Result<Self, Error> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("granary-policy-ticker".to_owned())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    engine.increment_epoch();
                }
            })
            .map_err(|e| Error::io("spawn", "the policy ticker thread", e))?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
