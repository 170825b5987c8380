//! The sandbox a plugin runs in: what its store holds and which imports its linker offers.
//!
//! A plugin gets no filesystem, network, clock or environment. Rust's standard library makes
//! even a pure guest import a few WASI interfaces (command-line environment and exit, stdio
//! streams, random seeds for `HashMap`); those are linked against an empty, deterministic
//! context: no arguments or variables, clocks frozen at zero, randomness from a fixed seed,
//! stdout discarded, stderr captured in memory (where a guest's panic message lands). Filesystem
//! and socket interfaces are not linked at all, so a component importing them is refused when it
//! is loaded. Memory is capped per plugin; a denied grow traps.
//!
//! Owns: `Sandbox` (a plugin's store data: that context, its resource table, its stderr, kept up to
//! `STDERR_BYTES_MAX` bytes), `MemoryCap`, the frozen clock, and `linker` with `offers` (the import
//! namespaces offered). Never: links a filesystem or socket interface (TCP, UDP and name lookup are
//! off in the context too), or gives a plugin a clock that moves or randomness other than the fixed
//! seeds'.

use wasmtime::component::{Linker, ResourceTable};
use wasmtime_wasi::p2::bindings::{cli, clocks, random};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// Bytes of guest stderr kept (the end of a panic message is enough to name the cause).
const STDERR_BYTES_MAX: usize = 16 << 10;

/// What a plugin's store holds.
pub(crate) struct Sandbox {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) memory: MemoryCap,
    stderr: MemoryOutputPipe,
}

impl Sandbox {
    /// A fresh sandbox with a memory cap.
    pub(crate) fn new(memory_bytes_max: usize) -> Self {
        let stderr = MemoryOutputPipe::new(STDERR_BYTES_MAX);
        let wasi = WasiCtx::builder()
            .stderr(stderr.clone())
            .secure_random(wasmtime_wasi::Deterministic::new(b"granary-policy-sandbox-seed".to_vec()))
            .insecure_random(wasmtime_wasi::Deterministic::new(b"granary-policy-insecure-seed".to_vec()))
            .insecure_random_seed(0x6772_616e_6172_795f_706f_6c69_6379_0001)
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        Self {
            wasi,
            table: ResourceTable::new(),
            memory: MemoryCap { bytes_max: memory_bytes_max, denied: false },
            stderr,
        }
    }

    /// What the guest wrote to stderr, lossily decoded, last line first trimmed.
    pub(crate) fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.contents()).trim().to_owned()
    }
}

impl WasiView for Sandbox {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Caps a plugin's linear memory; a grow past the cap is denied and traps, and is remembered so
/// the error can say so.
pub(crate) struct MemoryCap {
    pub(crate) bytes_max: usize,
    pub(crate) denied: bool,
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.bytes_max {
            self.denied = true;
            return Err(wasmtime::Error::msg(format!("memory cap of {} bytes reached", self.bytes_max)));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 16)
    }
}

/// A clock that never moves: a plugin cannot tell time, so its decisions cannot depend on it.
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }

    fn now(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }

    fn now(&self) -> u64 {
        0
    }
}

/// Import namespaces `linker` offers; a plugin importing anything else is refused at load.
const OFFERED: [&str; 5] = ["wasi:cli/", "wasi:clocks/", "wasi:random/", "wasi:io/", "granary:policy/"];

/// Whether the sandbox offers import `name` (an interface such as `wasi:filesystem/types@0.2.3`).
pub(crate) fn offers(name: &str) -> bool {
    OFFERED.iter().any(|prefix| name.starts_with(prefix))
}

/// The linker every plugin is instantiated with: the deterministic WASI subset above, and the
/// (type-only) shared interface of the policy package.
pub(crate) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<Sandbox>> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
    use wasmtime_wasi::random::WasiRandom;

    let mut linker = Linker::new(engine);
    let l = &mut linker;
    wasmtime_wasi_io_links(l)?;
    cli::exit::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::environment::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::stdin::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::stdout::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::stderr::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::terminal_input::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::terminal_output::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::terminal_stdin::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::terminal_stdout::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    cli::terminal_stderr::add_to_linker::<Sandbox, WasiCli>(l, Sandbox::cli)?;
    clocks::wall_clock::add_to_linker::<Sandbox, WasiClocks>(l, Sandbox::clocks)?;
    clocks::monotonic_clock::add_to_linker::<Sandbox, WasiClocks>(l, Sandbox::clocks)?;
    random::random::add_to_linker::<Sandbox, WasiRandom>(l, |t| t.ctx().ctx.random())?;
    random::insecure::add_to_linker::<Sandbox, WasiRandom>(l, |t| t.ctx().ctx.random())?;
    random::insecure_seed::add_to_linker::<Sandbox, WasiRandom>(l, |t| t.ctx().ctx.random())?;
    // The policy package's shared interface defines types only; an empty instance satisfies it.
    linker.instance("granary:policy/types@0.1.0")?;
    Ok(linker)
}

fn wasmtime_wasi_io_links(linker: &mut Linker<Sandbox>) -> wasmtime::Result<()> {
    use wasmtime_wasi::p2::bindings::sync::io;
    struct HasIo;
    impl wasmtime::component::HasData for HasIo {
        type Data<'a> = &'a mut ResourceTable;
    }
    io::error::add_to_linker::<Sandbox, HasIo>(linker, |t| &mut t.table)?;
    io::poll::add_to_linker::<Sandbox, HasIo>(linker, |t| &mut t.table)?;
    io::streams::add_to_linker::<Sandbox, HasIo>(linker, |t| &mut t.table)?;
    Ok(())
}
