//! An intrusive doubly-linked list of keys in a slab, with O(1) insert, remove and move by key:
//! the queue that LRU, FIFO, SIEVE and S3-FIFO are built from. Head is the newest end.

use crate::hash::KeyMap;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node<T> {
    key: u64,
    prev: u32,
    next: u32,
    value: T,
}

/// A list of distinct keys, each with a small value (a visited bit, a frequency).
#[derive(Clone, Debug)]
pub struct KeyList<T> {
    nodes: Vec<Node<T>>,
    free: Vec<u32>,
    index: KeyMap<u32>,
    head: u32,
    tail: u32,
}

impl<T: Copy> Default for KeyList<T> {
    fn default() -> Self {
        Self { nodes: Vec::new(), free: Vec::new(), index: KeyMap::default(), head: NIL, tail: NIL }
    }
}

/// A position in a [`KeyList`], valid until that key is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor(u32);

impl<T: Copy> KeyList<T> {
    /// Keys in the list.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Whether `key` is in the list.
    pub fn contains(&self, key: u64) -> bool {
        self.index.contains_key(key)
    }

    /// Inserts `key` (not in the list) at the head.
    pub fn push_head(&mut self, key: u64, value: T) {
        debug_assert!(!self.contains(key));
        let node = Node { key, prev: NIL, next: NIL, value };
        let at = match self.free.pop() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.link_head(at);
        self.index.insert(key, at);
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<T> {
        let at = self.index.remove(key)?;
        self.unlink(at);
        self.free.push(at);
        Some(self.nodes[at as usize].value)
    }

    /// Moves `key` to the head (one lookup; the node stays where it is stored).
    pub fn move_to_head(&mut self, key: u64) {
        if let Some(at) = self.index.get(key)
            && at != self.head
        {
            self.unlink(at);
            self.link_head(at);
        }
    }

    /// Moves `key` to the head and returns its value, in one lookup; `None` if it is not in the
    /// list.
    pub fn touch(&mut self, key: u64) -> Option<T> {
        let at = self.index.get(key)?;
        if at != self.head {
            self.unlink(at);
            self.link_head(at);
        }
        Some(self.nodes[at as usize].value)
    }

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Option<T> {
        self.index.get(key).map(|at| self.nodes[at as usize].value)
    }

    /// The value of `key`, mutably.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut T> {
        let at = self.index.get(key)?;
        Some(&mut self.nodes[at as usize].value)
    }

    /// The newest key.
    pub fn head(&self) -> Option<Cursor> {
        (self.head != NIL).then_some(Cursor(self.head))
    }

    /// The oldest key.
    pub fn tail(&self) -> Option<Cursor> {
        (self.tail != NIL).then_some(Cursor(self.tail))
    }

    /// The key and value at `cursor`.
    pub fn at(&self, cursor: Cursor) -> (u64, T) {
        let node = &self.nodes[cursor.0 as usize];
        (node.key, node.value)
    }

    /// The value at `cursor`, mutably.
    pub fn value_at(&mut self, cursor: Cursor) -> &mut T {
        &mut self.nodes[cursor.0 as usize].value
    }

    /// The next newer position (towards the head), if any.
    pub fn newer(&self, cursor: Cursor) -> Option<Cursor> {
        let prev = self.nodes[cursor.0 as usize].prev;
        (prev != NIL).then_some(Cursor(prev))
    }

    /// The cursor of `key`.
    pub fn cursor(&self, key: u64) -> Option<Cursor> {
        self.index.get(key).map(Cursor)
    }

    /// Removes and returns the oldest key and its value.
    pub fn pop_tail(&mut self) -> Option<(u64, T)> {
        let (key, _) = self.at(self.tail()?);
        self.remove(key).map(|value| (key, value))
    }

    /// Keys from the oldest to the newest.
    pub fn keys_oldest_first(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        let mut at = self.tail;
        while at != NIL {
            out.push(self.nodes[at as usize].key);
            at = self.nodes[at as usize].prev;
        }
        out
    }

    /// Links the stored node `at` in at the head.
    fn link_head(&mut self, at: u32) {
        self.nodes[at as usize].prev = NIL;
        self.nodes[at as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = at;
        } else {
            self.tail = at;
        }
        self.head = at;
    }

    /// Unlinks the stored node `at` from its neighbours (it stays stored).
    fn unlink(&mut self, at: u32) {
        let Node { prev, next, .. } = self.nodes[at as usize];
        if prev != NIL {
            self.nodes[prev as usize].next = next
        } else {
            self.head = next
        }
        if next != NIL { self.nodes[next as usize].prev = prev } else { self.tail = prev }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_and_removals_keep_the_order_and_the_index() {
        let mut list = KeyList::<u8>::default();
        for key in 1..=5 {
            list.push_head(key, key as u8);
        }
        assert_eq!(list.keys_oldest_first(), [1, 2, 3, 4, 5]);
        list.move_to_head(1);
        list.move_to_head(3);
        list.move_to_head(3);
        assert_eq!(list.keys_oldest_first(), [2, 4, 5, 1, 3]);
        assert_eq!(list.remove(5), Some(5));
        assert_eq!(list.remove(5), None);
        list.move_to_head(5);
        assert_eq!(list.pop_tail(), Some((2, 2)));
        list.push_head(6, 6);
        assert_eq!(list.keys_oldest_first(), [4, 1, 3, 6]);
        assert_eq!(list.get_mut(1).copied(), Some(1));
        assert_eq!(list.at(list.tail().expect("not empty")), (4, 4));
        assert_eq!(list.at(list.head().expect("not empty")), (6, 6));
        assert_eq!(list.len(), 4);
        while list.pop_tail().is_some() {}
        assert!(list.is_empty() && list.head().is_none() && list.tail().is_none());
    }
}
