//! Cache traces in libCacheSim's `oracleGeneral` format, and generators of them.
//!
//! A record is 24 bytes, little-endian: `timestamp u32 | object id u64 | size u32 |
//! next access i64`, where the next access is the (0-based) index of the object's next request,
//! or -1 when there is none. The same file runs in `granary plugin sim evict` and in libCacheSim,
//! so miss counts can be compared.
//!
//! Owns: `Request`, `read` and `write` of the format, `annotate_next_use`, the seeded generators
//! `zipf` and `epoch_shuffled`, `min` (Belady's MIN, the engine's one simulation of the optimum:
//! `plugin sim`, `bench cache` and `bench loader` measure against it; `belady_misses` on a trace),
//! and the bounds
//! `REQUESTS_MAX` and `OBJECTS_MAX`. Never: runs a plugin (`sim` does), or holds more than
//! `REQUESTS_MAX` requests (a longer trace is refused before it is read).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use crate::error::{Error, Result};
use crate::plan::{EpochPlan, Order};

/// Bytes of one record.
pub const RECORD_BYTES: usize = 24;

/// Requests in a trace held in memory (about 2 GiB of them, and as much again to annotate):
/// a generator or a reader asked for more refuses rather than allocate without bound.
pub const REQUESTS_MAX: u64 = 1 << 26;

/// Distinct objects of a generated trace (the Zipf table holds one `f64` each).
pub const OBJECTS_MAX: u64 = 1 << 26;

fn check_count(what: &str, n: u64, max: u64) -> Result<()> {
    if n == 0 || n > max {
        return Err(Error::invalid_input(format!("{what} must be in 1..={max}, not {n}")));
    }
    Ok(())
}

/// One request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Timestamp (seconds; not used by the simulator).
    pub time: u32,
    /// Object id.
    pub key: u64,
    /// Object size in bytes.
    pub size: u32,
    /// Index of the next request of this object, `u64::MAX` if none.
    pub next_use: u64,
}

/// Reads a whole trace.
pub fn read(path: &Path) -> Result<Vec<Request>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    if len % RECORD_BYTES as u64 != 0 {
        return Err(Error::invalid_input(format!(
            "{}: {len} bytes is not a whole number of {RECORD_BYTES}-byte oracleGeneral records",
            path.display()
        )));
    }
    if len / RECORD_BYTES as u64 > REQUESTS_MAX {
        return Err(Error::invalid_input(format!(
            "{}: {} requests; a trace of at most {REQUESTS_MAX} is simulated in memory",
            path.display(),
            len / RECORD_BYTES as u64
        )));
    }
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut requests = Vec::with_capacity(usize::try_from(len / RECORD_BYTES as u64).unwrap_or(0));
    let mut record = [0u8; RECORD_BYTES];
    for _ in 0..len / RECORD_BYTES as u64 {
        reader.read_exact(&mut record).map_err(|e| Error::io("read", path, e))?;
        let next = i64::from_le_bytes(record[16..24].try_into().expect("8 bytes"));
        requests.push(Request {
            time: u32::from_le_bytes(record[0..4].try_into().expect("4 bytes")),
            key: u64::from_le_bytes(record[4..12].try_into().expect("8 bytes")),
            size: u32::from_le_bytes(record[12..16].try_into().expect("4 bytes")),
            next_use: u64::try_from(next).ok().filter(|&n| n != i64::MAX as u64).unwrap_or(u64::MAX),
        });
    }
    Ok(requests)
}

/// Writes a trace.
pub fn write(path: &Path, requests: &[Request]) -> Result<()> {
    let file = std::fs::File::create(path).map_err(|e| Error::io("create", path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    for request in requests {
        let next = i64::try_from(request.next_use).unwrap_or(-1);
        out.write_all(&request.time.to_le_bytes())
            .and_then(|()| out.write_all(&request.key.to_le_bytes()))
            .and_then(|()| out.write_all(&request.size.to_le_bytes()))
            .and_then(|()| out.write_all(&next.to_le_bytes()))
            .map_err(|e| Error::io("write", path, e))?;
    }
    out.flush().map_err(|e| Error::io("write", path, e))
}

/// Fills in every request's `next_use` from the trace itself.
pub fn annotate_next_use(requests: &mut [Request]) {
    let mut next: HashMap<u64, u64> = HashMap::new();
    for (i, request) in requests.iter_mut().enumerate().rev() {
        request.next_use = next.insert(request.key, i as u64).unwrap_or(u64::MAX);
    }
}

/// `n_requests` requests to `n_objects` objects of size 1 with Zipf(`alpha`) popularity. Both
/// counts are at least 1 and at most `OBJECTS_MAX` and `REQUESTS_MAX`; `alpha` is finite and
/// not negative.
pub fn zipf(n_objects: u64, n_requests: u64, alpha: f64, seed: u64) -> Result<Vec<Request>> {
    check_count("the number of objects", n_objects, OBJECTS_MAX)?;
    check_count("the number of requests", n_requests, REQUESTS_MAX)?;
    if !(alpha.is_finite() && alpha >= 0.0) {
        return Err(Error::invalid_input(format!("the Zipf skew must be finite and not negative, not {alpha}")));
    }
    let mut cumulative = Vec::with_capacity(usize::try_from(n_objects).unwrap_or(0));
    let mut total = 0.0;
    for rank in 1..=n_objects {
        total += 1.0 / (rank as f64).powf(alpha);
        cumulative.push(total);
    }
    // Popularity rank -> object id through a permutation, so popular ids are not small numbers.
    let ids = EpochPlan::new(n_objects, seed ^ 0x5a5a, 0, Order::Shuffled);
    let mut state = seed;
    let mut requests: Vec<Request> = (0..n_requests)
        .map(|i| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let unit = (mix(state) >> 11) as f64 / (1u64 << 53) as f64;
            let rank = cumulative.partition_point(|&c| c < unit * total).min(cumulative.len() - 1);
            Request { time: (i / 1000) as u32, key: ids.record_at(rank as u64), size: 1, next_use: u64::MAX }
        })
        .collect();
    annotate_next_use(&mut requests);
    Ok(requests)
}

/// `epochs` passes over `n_objects` objects, each pass in a fresh seeded order: what a training
/// loop that shuffles every epoch asks of a cache. Both are at least 1, and the requests
/// (`n_objects * epochs`) at most `REQUESTS_MAX`.
pub fn epoch_shuffled(n_objects: u64, epochs: u64, seed: u64) -> Result<Vec<Request>> {
    check_count("the number of objects", n_objects, REQUESTS_MAX)?;
    check_count("the number of epochs", epochs, REQUESTS_MAX)?;
    if n_objects.saturating_mul(epochs) > REQUESTS_MAX {
        return Err(Error::invalid_input(format!(
            "{epochs} epochs over {n_objects} objects is more than {REQUESTS_MAX} requests"
        )));
    }
    let mut requests = Vec::with_capacity(usize::try_from(n_objects * epochs).unwrap_or(0));
    for epoch in 0..epochs {
        let plan = EpochPlan::new(n_objects, seed, epoch, Order::Shuffled);
        for position in 0..n_objects {
            let i = requests.len() as u64;
            requests.push(Request {
                time: (i / 1000) as u32,
                key: plan.record_at(position),
                size: 1,
                next_use: u64::MAX,
            });
        }
    }
    annotate_next_use(&mut requests);
    Ok(requests)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One access of a trace that `min` replays: the object, its size, and the group it is read in
/// (a batch: the objects of the group being read are never evicted for each other).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// The object.
    pub key: u64,
    /// Its size, in the unit of the capacity (1 for a count of objects).
    pub bytes: u64,
    /// The group (batch) the access belongs to; groups come in order.
    pub group: u64,
}

/// What Belady's MIN did on a trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MinOutcome {
    /// Accesses that found their object held.
    pub hits: u64,
    /// Accesses that did not.
    pub misses: u64,
    /// Objects loaded (a miss not read through).
    pub loads: u64,
    /// Their size, summed.
    pub bytes_loaded: u64,
}

/// Belady's MIN, the engine's one simulation of the optimum: a cache of `capacity` (bytes, or
/// objects when each is of size 1) that makes room by evicting the object next used farthest
/// ahead (by the group of its next access), never one of the group being read. With `bypass`,
/// an object next used no sooner than every object it would push out is read through, not
/// loaded (a cache that may decline an admission, as the tier does); without it, every miss
/// loads, over the capacity if only the group's own objects are left to evict. Exact for
/// objects of one size; for mixed sizes, the rule's answer.
pub fn min(accesses: &[Access], capacity: u64, bypass: bool) -> MinOutcome {
    // next[i]: the group of the next access to the object of access i (MAX: none).
    let mut next = vec![u64::MAX; accesses.len()];
    let mut seen: HashMap<u64, u64> = HashMap::new();
    for (i, access) in accesses.iter().enumerate().rev() {
        next[i] = seen.get(&access.key).copied().unwrap_or(u64::MAX);
        seen.insert(access.key, access.group);
    }
    // Each held object: its next use, the group it was last read in, its size.
    let mut held: HashMap<u64, (u64, u64, u64)> = HashMap::new();
    let mut by_next: std::collections::BTreeSet<(u64, u64)> = std::collections::BTreeSet::new();
    let (mut used, mut outcome) = (0u64, MinOutcome::default());
    for (i, access) in accesses.iter().enumerate() {
        if let Some(entry) = held.get_mut(&access.key) {
            outcome.hits += 1;
            by_next.remove(&(entry.0, access.key));
            (entry.0, entry.1) = (next[i], access.group);
            by_next.insert((next[i], access.key));
        } else {
            outcome.misses += 1;
            if capacity == 0 || (bypass && reads_through(&held, &by_next, access, next[i], used, capacity)) {
                if !bypass {
                    outcome.loads += 1;
                    outcome.bytes_loaded += access.bytes;
                }
                continue;
            }
            held.insert(access.key, (next[i], access.group, access.bytes));
            by_next.insert((next[i], access.key));
            used += access.bytes;
            outcome.loads += 1;
            outcome.bytes_loaded += access.bytes;
        }
        // Back within the capacity, the group's own objects aside: the farthest next use goes.
        while used > capacity {
            let Some(&(far, victim)) =
                by_next.iter().rev().find(|(_, key)| held.get(key).is_some_and(|&(_, group, _)| group != access.group))
            else {
                break;
            };
            by_next.remove(&(far, victim));
            if let Some((_, _, bytes)) = held.remove(&victim) {
                used -= bytes;
            }
        }
    }
    outcome
}

/// Whether `min` with `bypass` reads `access` through: making room for it would push out an
/// object (not of its group) next used no later than it, or room cannot be made.
fn reads_through(
    held: &HashMap<u64, (u64, u64, u64)>,
    by_next: &std::collections::BTreeSet<(u64, u64)>,
    access: &Access,
    next: u64,
    used: u64,
    capacity: u64,
) -> bool {
    let mut over = (used + access.bytes).saturating_sub(capacity);
    for &(far, victim) in by_next.iter().rev() {
        if over == 0 {
            return false;
        }
        let Some(&(_, group, bytes)) = held.get(&victim) else { continue };
        if group == access.group {
            continue;
        }
        if far <= next {
            return true;
        }
        over = over.saturating_sub(bytes);
    }
    over > 0
}

/// Belady's misses on a trace of the `oracleGeneral` format, each object of size 1 (the
/// optimum for that case): what `plugin sim evict` compares an evictor with.
pub fn belady_misses(requests: &[Request], capacity: u64) -> u64 {
    let accesses: Vec<Access> =
        requests.iter().enumerate().map(|(i, r)| Access { key: r.key, bytes: 1, group: i as u64 }).collect();
    min(&accesses, capacity, false).misses
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Belady's MIN on a trace with objects of size 1 (the optimum for that case): the misses of a
    /// cache of `capacity` objects that always evicts the object used furthest in the future.

    #[test]
    fn traces_round_trip_and_next_uses_point_forward() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        let trace = zipf(100, 5000, 1.0, 3).unwrap();
        write(&path, &trace).unwrap();
        assert_eq!(read(&path).unwrap(), trace);
        for (i, request) in trace.iter().enumerate() {
            if request.next_use != u64::MAX {
                assert!(request.next_use > i as u64);
                assert_eq!(trace[request.next_use as usize].key, request.key);
            }
        }
        let shuffled = epoch_shuffled(50, 3, 1).unwrap();
        assert_eq!(shuffled.len(), 150);
        let mut first: Vec<u64> = shuffled[..50].iter().map(|r| r.key).collect();
        first.sort_unstable();
        assert_eq!(first, (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn belady_is_a_lower_bound_and_exact_on_small_cases() {
        // Keys 1 2 3 1 2 4 1 2, cache 2: misses on 1, 2, 3 (evicting 2, used last of the two),
        // 2 (evicting 3, never used again), 4 (evicting 2) and 2 again: 6.
        let mut trace: Vec<Request> =
            [1, 2, 3, 1, 2, 4, 1, 2].iter().map(|&k| Request { time: 0, key: k, size: 1, next_use: 0 }).collect();
        annotate_next_use(&mut trace);
        assert_eq!(belady_misses(&trace, 2), 6);
        assert_eq!(belady_misses(&trace, 4), 4);
    }

    #[test]
    fn min_reads_through_under_bypass_and_keeps_a_groups_objects() {
        let access = |key, bytes, group| Access { key, bytes, group };
        // 1 2 3 1 2 4 1 2 at capacity 2 with bypass: 3 and 4 (used never again) are read
        // through, so 1 and 2 stay: hits at 1, 2, 1, 2.
        let flat: Vec<Access> =
            [1, 2, 3, 1, 2, 4, 1, 2].iter().enumerate().map(|(i, &k)| access(k, 1, i as u64)).collect();
        assert_eq!(min(&flat, 2, true), MinOutcome { hits: 4, misses: 4, loads: 2, bytes_loaded: 2 });
        assert_eq!(min(&flat, 2, false).misses, 6);
        assert_eq!(min(&flat, 0, true), MinOutcome { hits: 0, misses: 8, loads: 0, bytes_loaded: 0 });
        // Groups: a batch of three objects of 2 bytes in a cache of 4 holds all three while it
        // is read (none evicted for another of its group), and is back within 4 at the next.
        let grouped = [access(1, 2, 0), access(2, 2, 0), access(3, 2, 0), access(1, 2, 1), access(4, 2, 1)];
        let outcome = min(&grouped, 4, false);
        assert_eq!((outcome.hits, outcome.loads, outcome.bytes_loaded), (1, 4, 8));
    }
}
