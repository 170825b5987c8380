//! One piece of work per key at a time: a second caller for the same key waits for the first
//! one's outcome instead of doing the work again (pulls of one object, fetch requests of one
//! object to one node).
//!
//! Owns: `InFlight` (the work in flight, by key) and `Flight` (whether a caller did the work or
//! joined another's). Never: does the work twice for one key at a time, or keeps a key once its
//! work has ended or been dropped (its joiners then see it abandoned).

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::error::Result;

/// Where a caller that joined another's work finds its outcome (`None` until there is one).
type Outcome<T> = watch::Receiver<Option<std::result::Result<T, String>>>;

/// Work in flight, by key.
pub(crate) struct InFlight<K, T> {
    flights: Mutex<HashMap<K, Outcome<T>>>,
}

/// How a caller's work went.
pub(crate) enum Flight<T> {
    /// This caller did the work.
    Led(Result<T>),
    /// Another caller did it; its outcome (an error as text: errors are not `Clone`).
    Joined(std::result::Result<T, String>),
}

impl<K: Eq + Hash + Clone, T: Clone> InFlight<K, T> {
    pub(crate) fn new() -> Self {
        Self { flights: Mutex::new(HashMap::new()) }
    }

    fn table(&self) -> parking_lot::MutexGuard<'_, HashMap<K, Outcome<T>>> {
        self.flights.lock()
    }

    /// Whether work for `key` is in flight.
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.table().contains_key(key)
    }

    /// Work in flight.
    pub(crate) fn len(&self) -> usize {
        self.table().len()
    }

    /// Runs `work` for `key`, unless work for `key` is in flight: then waits for its outcome.
    pub(crate) async fn run(&self, key: K, work: impl Future<Output = Result<T>>) -> Flight<T> {
        let (mut rx, leader) = {
            let mut table = self.table();
            match table.get(&key) {
                Some(rx) => (rx.clone(), None),
                None => {
                    let (tx, rx) = watch::channel(None);
                    table.insert(key.clone(), rx.clone());
                    (rx, Some(tx))
                }
            }
        };
        let Some(tx) = leader else {
            return Flight::Joined(match rx.wait_for(Option::is_some).await {
                Ok(outcome) => outcome.clone().expect("waited for Some"),
                Err(_) => Err("the work it waited for was abandoned".to_owned()),
            });
        };
        // Removed from the table even when this future is dropped midway (its joiners then
        // see the channel close).
        struct Leave<'a, K: Eq + Hash, T> {
            flights: &'a Mutex<HashMap<K, Outcome<T>>>,
            key: Option<K>,
        }
        impl<K: Eq + Hash, T> Drop for Leave<'_, K, T> {
            fn drop(&mut self) {
                if let Some(key) = self.key.take() {
                    self.flights.lock().remove(&key);
                }
            }
        }
        let leave = Leave { flights: &self.flights, key: Some(key) };
        let outcome = work.await;
        drop(leave);
        let _ = tx.send(Some(outcome.as_ref().map(Clone::clone).map_err(ToString::to_string)));
        Flight::Led(outcome)
    }
}
