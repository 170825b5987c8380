//! A hostile evictor for the host's tests. Option `behave`:
//! `loop` (spins forever), `grow` (allocates until stopped), `trap` (panics), `recurse`
//! (recurses until the stack runs out), `bad-hits` (a hit list of the wrong length),
//! `bad-evict` (evicts a key that was never inserted), `overfill` (never evicts),
//! `trap-on-key=K` (panics on batches holding key K, behaves otherwise), `fifo` (behaves as
//! FIFO), `bad-snapshot` (FIFO whose snapshot lists nothing), `trap-restore` (FIFO whose restore
//! panics). Without the option it answers with too many hit flags, so it fails `plugin check`.
//! Misbehaviour starts at the first `access` call.
#![cfg(target_arch = "wasm32")]

use std::cell::RefCell;
use std::collections::VecDeque;

use granary_policy_sdk::evictor_bindings::exports::granary::policy::evictor as wit;
use granary_policy_sdk::evictor_bindings::granary::policy::types::PolicyError;

struct Hostile {
    behave: String,
    capacity: u64,
    /// Resident keys with their sizes, oldest first.
    queue: RefCell<VecDeque<(u64, u32)>>,
}

struct Plugin;

impl wit::Guest for Plugin {
    type Policy = Hostile;
}

#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let pad = std::hint::black_box([depth; 64]);
    if pad[depth as usize % 64] == u64::MAX { 0 } else { recurse(depth + 1) + pad[3] }
}

impl wit::GuestPolicy for Hostile {
    fn create(capacity: u64, options: Vec<(String, String)>) -> Result<wit::Policy, PolicyError> {
        let behave =
            options.iter().find(|(k, _)| k == "behave").map_or_else(|| "bad-hits".to_owned(), |(_, v)| v.clone());
        Ok(wit::Policy::new(Hostile { behave, capacity, queue: RefCell::new(VecDeque::new()) }))
    }

    fn access(&self, batch: wit::Accesses) -> Result<wit::Outcome, PolicyError> {
        match self.behave.as_str() {
            "loop" => loop {
                std::hint::black_box(());
            },
            "grow" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "trap" => panic!("hostile evictor traps on purpose"),
            "recurse" => {
                std::hint::black_box(recurse(0));
            }
            "bad-hits" => return Ok(wit::Outcome { hits: vec![false; batch.keys.len() + 1], evictions: vec![] }),
            "bad-evict" => {
                return Ok(wit::Outcome {
                    hits: vec![false; batch.keys.len()],
                    evictions: vec![wit::Eviction { before: 0, key: 0xdead_beef }],
                });
            }
            "overfill" => return Ok(wit::Outcome { hits: vec![false; batch.keys.len()], evictions: vec![] }),
            behave if behave.starts_with("trap-on-key=") => {
                let key: u64 = behave["trap-on-key=".len()..].parse().unwrap_or(u64::MAX);
                assert!(!batch.keys.contains(&key), "hostile evictor traps on key {key}");
            }
            _ => {}
        }
        // FIFO by bytes; an object larger than the cache is not inserted.
        let mut queue = self.queue.borrow_mut();
        let mut hits = Vec::with_capacity(batch.keys.len());
        let mut evictions = Vec::new();
        for (i, (&key, &size)) in batch.keys.iter().zip(&batch.sizes).enumerate() {
            if queue.iter().any(|&(k, _)| k == key) {
                hits.push(true);
                continue;
            }
            hits.push(false);
            if u64::from(size) > self.capacity {
                continue;
            }
            while queue.iter().map(|&(_, s)| u64::from(s)).sum::<u64>() + u64::from(size) > self.capacity {
                let Some((victim, _)) = queue.pop_front() else { break };
                evictions.push(wit::Eviction { before: i as u32, key: victim });
            }
            queue.push_back((key, size));
        }
        Ok(wit::Outcome { hits, evictions })
    }

    fn evict(&self, bytes: u64) -> Vec<u64> {
        let mut queue = self.queue.borrow_mut();
        let (mut freed, mut victims) = (0, Vec::new());
        while freed < bytes {
            let Some((victim, size)) = queue.pop_front() else { break };
            freed += u64::from(size);
            victims.push(victim);
        }
        victims
    }

    fn remove(&self, keys: Vec<u64>) {
        self.queue.borrow_mut().retain(|(k, _)| !keys.contains(k));
    }

    fn snapshot(&self) -> wit::Snapshot {
        let resident = if self.behave == "bad-snapshot" {
            Vec::new()
        } else {
            self.queue.borrow().iter().map(|&(key, size)| wit::Entry { key, size }).collect()
        };
        wit::Snapshot { policy: "hostile".into(), resident, state: vec![] }
    }

    fn restore(&self, snapshot: wit::Snapshot) -> Result<(), PolicyError> {
        assert!(self.behave != "trap-restore", "hostile evictor traps in restore on purpose");
        *self.queue.borrow_mut() = snapshot.resident.iter().map(|e| (e.key, e.size)).collect();
        Ok(())
    }
}

granary_policy_sdk::evictor_bindings::__export_evictor_world!(Plugin with_types_in granary_policy_sdk::evictor_bindings);
