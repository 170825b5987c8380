//! S3-FIFO (Yang et al., SOSP '23), following libCacheSim's `S3FIFO`: a small FIFO (10% of the
//! cache) filters one-hit wonders, a main FIFO with a 2-bit clock keeps the rest, and a ghost
//! FIFO of recently evicted keys (90% of the cache) sends returning objects straight to main.
//! An object leaving the small queue moves to main if it was hit at least twice there. Until the
//! first eviction, new objects that find the small queue full go to main (libCacheSim's
//! current `S3FIFO`, not the paper's original). Unlike libCacheSim, an object at least as large
//! as the small queue is still admitted.

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::list::KeyList;
use granary_policy_sdk::{Error, Options};

/// The three queues; values are (hit counter, size) in small and main, the size in ghost.
pub struct S3Fifo {
    small: KeyList<(u8, u32)>,
    main: KeyList<(u8, u32)>,
    small_bytes: u64,
    main_bytes: u64,
    small_capacity: u64,
    main_capacity: u64,
    has_evicted: bool,
    ghost: KeyList<u32>,
    ghost_bytes: u64,
    ghost_capacity: u64,
    move_to_main_threshold: u8,
}

impl S3Fifo {
    fn ghost_insert(&mut self, key: u64, size: u32) {
        if u64::from(size) > self.ghost_capacity || self.ghost.contains(key) {
            return;
        }
        while self.ghost_bytes + u64::from(size) > self.ghost_capacity {
            let Some((_, old_size)) = self.ghost.pop_tail() else { break };
            self.ghost_bytes -= u64::from(old_size);
        }
        self.ghost.push_head(key, size);
        self.ghost_bytes += u64::from(size);
    }

    /// One pass over the small queue: moves frequently hit objects to main and evicts the first
    /// other one (into the ghost queue). Returns the evicted key, if any.
    fn evict_small(&mut self) -> Option<u64> {
        while let Some((key, (freq, size))) = self.small.pop_tail() {
            self.small_bytes -= u64::from(size);
            if freq >= self.move_to_main_threshold {
                self.main.push_head(key, (0, size));
                self.main_bytes += u64::from(size);
            } else {
                self.ghost_insert(key, size);
                return Some(key);
            }
        }
        None
    }

    /// The main queue's clock: objects hit since their last pass go around again with one hit
    /// fewer; the first one without hits is evicted.
    fn evict_main(&mut self) -> Option<u64> {
        while let Some((key, (freq, size))) = self.main.pop_tail() {
            if freq >= 1 {
                self.main.push_head(key, (freq.min(3) - 1, size));
            } else {
                self.main_bytes -= u64::from(size);
                return Some(key);
            }
        }
        None
    }
}

impl Evictor for S3Fifo {
    const NAME: &'static str = "s3-fifo";

    fn new(capacity: u64, options: &Options) -> Result<Self, Error> {
        options.allow_only(&["small-ratio", "ghost-ratio", "move-to-main-threshold"])?;
        let small_ratio: f64 = options.parse("small-ratio", 0.10)?;
        let ghost_ratio: f64 = options.parse("ghost-ratio", 0.90)?;
        let threshold: u8 = options.parse("move-to-main-threshold", 2)?;
        if !(0.0..1.0).contains(&small_ratio) || !(0.0..=10.0).contains(&ghost_ratio) {
            return Err(Error::InvalidInput("small-ratio must be in [0, 1), ghost-ratio in [0, 10]".into()));
        }
        let small_capacity = (capacity as f64 * small_ratio) as u64;
        Ok(Self {
            small: KeyList::default(),
            main: KeyList::default(),
            small_bytes: 0,
            main_bytes: 0,
            small_capacity,
            main_capacity: capacity - small_capacity,
            has_evicted: false,
            ghost: KeyList::default(),
            ghost_bytes: 0,
            ghost_capacity: (capacity as f64 * ghost_ratio) as u64,
            move_to_main_threshold: threshold,
        })
    }

    fn insert(&mut self, key: u64, size: u32, _next_use: u64) {
        let from_ghost =
            self.ghost.remove(key).inspect(|&ghost_size| self.ghost_bytes -= u64::from(ghost_size)).is_some();
        if from_ghost || (!self.has_evicted && self.small_bytes >= self.small_capacity) {
            self.main.push_head(key, (0, size));
            self.main_bytes += u64::from(size);
        } else {
            self.small.push_head(key, (0, size));
            self.small_bytes += u64::from(size);
        }
    }

    fn hit(&mut self, key: u64, _size: u32, _next_use: u64) {
        if let Some((freq, _)) = self.small.get_mut(key) {
            *freq = freq.saturating_add(1);
        } else if let Some((freq, _)) = self.main.get_mut(key) {
            *freq = freq.saturating_add(1);
        }
    }

    fn evict(&mut self) -> Option<u64> {
        self.has_evicted = true;
        loop {
            let main_over = self.main_bytes > self.main_capacity || self.small.is_empty();
            let evicted = if main_over { self.evict_main() } else { self.evict_small() };
            if evicted.is_some() {
                return evicted;
            }
            if self.small.is_empty() && self.main.is_empty() {
                return None;
            }
        }
    }

    fn remove(&mut self, key: u64) {
        if let Some((_, size)) = self.small.remove(key) {
            self.small_bytes -= u64::from(size);
        } else if let Some((_, size)) = self.main.remove(key) {
            self.main_bytes -= u64::from(size);
        }
    }

    fn order(&self) -> Vec<u64> {
        let mut order = self.small.keys_oldest_first();
        order.extend(self.main.keys_oldest_first());
        order
    }

    /// Everything `order` leaves out, so that a restored S3-FIFO decides as this one would:
    /// whether it has evicted (u8), how many of the resident objects are in the small queue
    /// (u64), each resident object's hit counter in `order`'s order (u8), then the ghost queue
    /// oldest first (u64 count, then key u64 and size u32 each).
    fn state(&self) -> Vec<u8> {
        let mut state = vec![u8::from(self.has_evicted)];
        state.extend_from_slice(&(self.small.len() as u64).to_le_bytes());
        for queue in [&self.small, &self.main] {
            let mut at = queue.tail();
            while let Some(cursor) = at {
                state.push(queue.at(cursor).1.0);
                at = queue.newer(cursor);
            }
        }
        state.extend_from_slice(&(self.ghost.len() as u64).to_le_bytes());
        let mut at = self.ghost.tail();
        while let Some(cursor) = at {
            let (key, size) = self.ghost.at(cursor);
            state.extend_from_slice(&key.to_le_bytes());
            state.extend_from_slice(&size.to_le_bytes());
            at = self.ghost.newer(cursor);
        }
        state
    }

    fn restore(&mut self, resident: &[(u64, u32)], state: Option<&[u8]>) -> Result<(), Error> {
        let Some(state) = state else {
            for &(key, size) in resident {
                self.insert(key, size, u64::MAX);
            }
            return Ok(());
        };
        let bad = || Error::InvalidInput(format!("a malformed S3-FIFO state of {} bytes", state.len()));
        let u64_at = |at: usize| state.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        let n = resident.len();
        let n_small = usize::try_from(u64_at(1).ok_or_else(bad)?).map_err(|_| bad())?;
        let freqs = state.get(9..9 + n).ok_or_else(bad)?;
        let n_ghost = usize::try_from(u64_at(9 + n).ok_or_else(bad)?).map_err(|_| bad())?;
        let ghost_at = 17 + n;
        if state[0] > 1
            || n_small > n
            || n_ghost.checked_mul(12).and_then(|b| b.checked_add(ghost_at)) != Some(state.len())
        {
            return Err(bad());
        }
        self.has_evicted = state[0] == 1;
        for (i, (&(key, size), &freq)) in resident.iter().zip(freqs).enumerate() {
            if i < n_small {
                self.small.push_head(key, (freq, size));
                self.small_bytes += u64::from(size);
            } else {
                self.main.push_head(key, (freq, size));
                self.main_bytes += u64::from(size);
            }
        }
        for g in 0..n_ghost {
            let at = ghost_at + 12 * g;
            let key = u64_at(at).ok_or_else(bad)?;
            let size = u32::from_le_bytes(state[at + 8..at + 12].try_into().map_err(|_| bad())?);
            if !self.small.contains(key) && !self.main.contains(key) && !self.ghost.contains(key) {
                self.ghost.push_head(key, size);
                self.ghost_bytes += u64::from(size);
            }
        }
        Ok(())
    }
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_evictor!(S3Fifo);
