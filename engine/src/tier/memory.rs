//! What the node's memory looks like to the tier: total, available (`/proc/meminfo`) and the
//! cgroup's limit and use, looked at no more than once per `MEMORY_LOOK_TTL`.
//!
//! Owns `Memory` and the cgroup look (v1 and v2). Never: holds a lock a forked child could
//! inherit held, or decides what the tier keeps (the budget does, from these figures).

use std::path::Path;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a look at the node's memory serves the budget's checks: the fillers ask at every
/// replan and fill, and each look reads `/proc/meminfo` and the cgroup's files (3 % of a warm
/// epoch's CPU when read each time); pressure is still met within a fraction of a second.
pub(super) const MEMORY_LOOK_TTL: Duration = Duration::from_millis(250);

/// What the node's memory looks like now.
#[derive(Clone, Copy)]
pub(super) struct Memory {
    pub(super) total: u64,
    pub(super) available: u64,
    pub(super) cgroup_limit: Option<u64>,
    pub(super) cgroup_headroom: Option<u64>,
}

impl Memory {
    /// The node's memory as looked at within `MEMORY_LOOK_TTL` (in this process), or now. Never
    /// waits for the last look: a child forked while another thread held it would wait forever
    /// (CI hung a forked child's loader so); a look under way elsewhere means a look of its own.
    pub(super) fn recent() -> Self {
        static LAST: Mutex<Option<(Instant, Memory)>> = Mutex::new(None);
        let Some(mut last) = LAST.try_lock() else { return Self::read() };
        if let Some((at, memory)) = *last
            && at.elapsed() < MEMORY_LOOK_TTL
        {
            return memory;
        }
        let memory = Self::read();
        *last = Some((Instant::now(), memory));
        memory
    }

    pub(super) fn read() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| {
            meminfo
                .lines()
                .find_map(|line| line.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
                .map(|kib| kib << 10)
        };
        let total = field("MemTotal:").unwrap_or(u64::MAX);
        let available = field("MemAvailable:").unwrap_or(total);
        let (cgroup_limit, cgroup_headroom) = cgroup_memory().unzip();
        Self { total, available, cgroup_limit, cgroup_headroom }
    }
}

/// This process's cgroup memory limit and the room left under it (v2 or v1), if it has one:
/// the tightest of its cgroup and every ancestor's, with the page cache the kernel can drop
/// (`inactive_file`) counted as room. The tier's own pages are shared memory, which the kernel
/// cannot drop: they count as used.
pub(super) fn cgroup_memory() -> Option<(u64, u64)> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |path: &Path| std::fs::read_to_string(path).ok()?.trim().parse::<u64>().ok();
    let stat = |path: &Path, key: &str| {
        std::fs::read_to_string(path).ok()?.lines().find_map(|line| {
            let (name, value) = line.split_once(' ')?;
            (name == key).then(|| value.trim().parse::<u64>().ok()).flatten()
        })
    };
    let mut tightest: Option<(u64, u64)> = None;
    let mut consider = |limit: Option<u64>, usage: Option<u64>, reclaimable: Option<u64>| {
        // "max" (v2) does not parse; v1 says "no limit" with a number near 2^63.
        if let (Some(limit), Some(usage)) = (limit, usage)
            && limit < 1 << 60
        {
            let room = limit.saturating_sub(usage.saturating_sub(reclaimable.unwrap_or(0)));
            tightest = Some(tightest.map_or((limit, room), |(l, r)| (l.min(limit), r.min(room))));
        }
    };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = Path::new(path.trim_start_matches('/'));
        if controllers.is_empty() {
            // v2: this cgroup and each ancestor up to the root of this namespace's view.
            for level in path.ancestors() {
                let base = Path::new("/sys/fs/cgroup").join(level);
                consider(
                    read(&base.join("memory.max")),
                    read(&base.join("memory.current")),
                    stat(&base.join("memory.stat"), "inactive_file"),
                );
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            // v1: memory.stat's hierarchical limit is already the tightest of the ancestors'.
            let base = Path::new("/sys/fs/cgroup/memory").join(path);
            let own = read(&base.join("memory.limit_in_bytes"));
            let hierarchical = stat(&base.join("memory.stat"), "hierarchical_memory_limit");
            let limit = match (own, hierarchical) {
                (Some(own), Some(up)) => Some(own.min(up)),
                (own, up) => own.or(up),
            };
            consider(
                limit,
                read(&base.join("memory.usage_in_bytes")),
                stat(&base.join("memory.stat"), "total_inactive_file"),
            );
        }
    }
    tightest
}
