//! Cache traces in libCacheSim's `oracleGeneral` format, and generators of them.
//!
//! A record is 24 bytes, little-endian: `timestamp u32 | object id u64 | size u32 |
//! next access i64`, where the next access is the (0-based) index of the object's next request,
//! or -1 when there is none. The same file runs in `granary plugin sim evict` and in libCacheSim,
//! so miss counts can be compared.
//!
//! Owns: `Request`, `read` and `write` of the format, `annotate_next_use`, the seeded generators
//! `zipf` and `epoch_shuffled`, `belady_misses` (the optimum for objects of size 1), and the bounds
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

/// Belady's MIN on a trace with objects of size 1 (the optimum for that case): the misses of a
/// cache of `capacity` objects that always evicts the object used furthest in the future.
pub fn belady_misses(requests: &[Request], capacity: u64) -> u64 {
    let mut resident: std::collections::BTreeSet<(u64, u64)> = std::collections::BTreeSet::new();
    let mut next_of: HashMap<u64, u64> = HashMap::new();
    let mut misses = 0;
    for request in requests {
        match next_of.get(&request.key) {
            Some(&old) => {
                resident.remove(&(old, request.key));
            }
            None => {
                misses += 1;
                if capacity == 0 {
                    continue;
                }
                if resident.len() as u64 >= capacity
                    && let Some((_, victim)) = resident.pop_last()
                {
                    next_of.remove(&victim);
                }
            }
        }
        resident.insert((request.next_use, request.key));
        next_of.insert(request.key, request.next_use);
    }
    misses
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
