//! A Space-Saving summary: the most frequent keys of a stream in a fixed number of counters,
//! whatever the number of distinct keys (Metwally, Agrawal and El Abbadi, 2005).
//!
//! The summary holds at most `k` counters. A key already counted adds to its counter; a new key
//! takes a free counter, or, when all `k` are taken, the smallest one, which it inherits: its
//! count starts at the smallest count plus its own, and that smallest count is its error
//! bound. So a counter never counts less than its key's true count, and over-counts by at most
//! its error; and a key that occurs more than `N / k` times among `N` is always held.
//!
//! The counters stay where they were made; a binary min-heap by count orders their indices,
//! so that finding the smallest counter is free and every update moves an index along one
//! path of the heap without touching a key: `O(log k)` comparisons, and one hash lookup per
//! update (three when a new key takes the smallest counter).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

use crate::clock::Micros;

/// The counters a summary keeps unless told otherwise.
pub const DEFAULT_TOP_K: usize = 100;

/// One key's counter in a [`SpaceSaving`] summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter<K> {
    /// The key.
    pub key: K,
    /// How many times it was counted, over-counted by at most [`error`](Self::error).
    pub count: u64,
    /// The most this count may exceed the key's true count.
    pub error: u64,
    /// When the key was first counted (since it took its counter).
    pub first_seen: Micros,
    /// When it was last counted.
    pub last_seen: Micros,
}

/// A bounded summary of the most frequent keys (see the [module](self) documentation).
///
/// ```
/// use tollgate_engine::topk::SpaceSaving;
///
/// let mut top = SpaceSaving::<String>::new(2);
/// for key in ["a", "b", "a", "c", "a"] {
///     top.add(key, 1, 0);
/// }
/// let best = top.top(1);
/// assert_eq!((best[0].key.as_str(), best[0].count, best[0].error), ("a", 3, 0));
/// assert_eq!(top.len(), 2); // never more than k
/// ```
#[derive(Debug, Clone)]
pub struct SpaceSaving<K> {
    k: usize,
    /// The counters, each at the index it took: they never move, so that the heap's moves
    /// touch no key and no hash.
    counters: Vec<Counter<K>>,
    /// A min-heap by count of indices in `counters`.
    heap: Vec<u32>,
    /// Each index's position in `heap`.
    at: Vec<u32>,
    /// Each key's index in `counters`.
    index: HashMap<K, u32>,
    /// Every count added since the summary was made or drained (`N`).
    total: u64,
    /// The index of the counter counted last: a flood repeats one key, whose count then goes
    /// up without hashing it (its key is compared first).
    last: Option<u32>,
}

impl<K: Hash + Eq + Clone> SpaceSaving<K> {
    /// An empty summary of at most `k` counters (at least one, at most 2^32).
    pub fn new(k: usize) -> Self {
        let k = k.clamp(1, u32::MAX as usize);
        Self {
            k,
            counters: Vec::new(),
            heap: Vec::new(),
            at: Vec::new(),
            index: HashMap::new(),
            total: 0,
            last: None,
        }
    }

    /// The most counters it holds.
    pub fn capacity(&self) -> usize {
        self.k
    }

    /// How many counters it holds now.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Every count added since it was made or drained.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Counts `key` `n` times at `now`.
    pub fn add<Q>(&mut self, key: &Q, n: u64, now: Micros)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.add_counted(key, n, 0, (now, now));
    }

    /// Counts `key` `n` times with an error of `error` already on it, seen from `first` to
    /// `last`: what merging another summary's counter does.
    pub fn add_counted<Q>(&mut self, key: &Q, n: u64, error: u64, (first, last): (Micros, Micros))
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.total = self.total.saturating_add(n);
        let repeated = self.last.filter(|&idx| {
            self.counters
                .get(idx as usize)
                .is_some_and(|c| c.key.borrow() == key)
        });
        if let Some(idx) = repeated.or_else(|| self.index.get(key).copied()) {
            self.last = Some(idx);
            let c = &mut self.counters[idx as usize];
            c.count = c.count.saturating_add(n);
            c.error = c.error.saturating_add(error);
            c.first_seen = c.first_seen.min(first);
            c.last_seen = c.last_seen.max(last);
            self.sift_down(self.at[idx as usize] as usize);
            return;
        }
        let owned = key.to_owned();
        if self.counters.len() < self.k {
            let idx = self.counters.len() as u32;
            self.index.insert(owned.clone(), idx);
            self.counters.push(Counter {
                key: owned,
                count: n,
                error,
                first_seen: first,
                last_seen: last,
            });
            self.heap.push(idx);
            self.at.push(idx);
            self.sift_up(idx as usize);
            self.last = Some(idx);
            return;
        }
        // Full: the new key takes the smallest counter and inherits its count as its error.
        let idx = self.heap[0];
        let min = &mut self.counters[idx as usize];
        let floor = min.count;
        let old = std::mem::replace(
            min,
            Counter {
                key: owned.clone(),
                count: floor.saturating_add(n),
                error: floor.saturating_add(error),
                first_seen: first,
                last_seen: last,
            },
        );
        self.index.remove::<K>(&old.key);
        self.index.insert(owned, idx);
        self.sift_down(0);
        self.last = Some(idx);
    }

    /// The `n` largest counters, largest first (ties: the smaller error, then the earlier
    /// first seen).
    pub fn top(&self, n: usize) -> Vec<Counter<K>> {
        let mut all = self.counters.clone();
        sort_counters(&mut all);
        all.truncate(n);
        all
    }

    /// Takes every counter out, leaving the summary empty (its total at 0).
    pub fn drain(&mut self) -> Vec<Counter<K>> {
        self.index.clear();
        self.heap.clear();
        self.at.clear();
        self.total = 0;
        self.last = None;
        std::mem::take(&mut self.counters)
    }

    /// Adds every counter of `counters` (another summary's, drained).
    pub fn merge(&mut self, counters: impl IntoIterator<Item = Counter<K>>) {
        for c in counters {
            self.add_counted(&c.key, c.count, c.error, (c.first_seen, c.last_seen));
        }
    }

    fn count_at(&self, pos: usize) -> u64 {
        self.counters[self.heap[pos] as usize].count
    }

    fn sift_up(&mut self, mut pos: usize) {
        while pos > 0 {
            let parent = (pos - 1) / 2;
            if self.count_at(parent) <= self.count_at(pos) {
                break;
            }
            self.swap(pos, parent);
            pos = parent;
        }
    }

    fn sift_down(&mut self, mut pos: usize) {
        let len = self.heap.len();
        loop {
            let (left, right) = (2 * pos + 1, 2 * pos + 2);
            let mut least = pos;
            if left < len && self.count_at(left) < self.count_at(least) {
                least = left;
            }
            if right < len && self.count_at(right) < self.count_at(least) {
                least = right;
            }
            if least == pos {
                return;
            }
            self.swap(pos, least);
            pos = least;
        }
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.at[self.heap[a] as usize] = a as u32;
        self.at[self.heap[b] as usize] = b as u32;
    }
}

/// Sorts counters largest first: by count, then the smaller error, then the earlier first
/// seen.
pub fn sort_counters<K>(counters: &mut [Counter<K>]) {
    counters.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then(a.error.cmp(&b.error))
            .then(a.first_seen.cmp(&b.first_seen))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key counted again at once, or after another took its counter, is counted where it
    /// is held, never on the counter counted last.
    #[test]
    fn a_repeated_key_counts_on_its_own_counter() {
        let mut top = SpaceSaving::<String>::new(2);
        for key in ["a", "a", "a", "a", "a", "b", "c", "c", "b", "c", "a"] {
            top.add(key, 1, 0);
        }
        let got: Vec<_> = top
            .top(2)
            .into_iter()
            .map(|c| (c.key, c.count, c.error))
            .collect();
        assert_eq!(got, [("a".into(), 6, 0), ("c".into(), 5, 4)]);
    }

    /// A key counted more than N/k times is held, with its exact count when it came first;
    /// the summary never holds more than k counters.
    #[test]
    fn a_heavy_key_survives_a_spray_with_its_exact_count() {
        let mut top = SpaceSaving::<Vec<u8>>::new(100);
        let mut n = 0u64;
        for i in 0..100_000u32 {
            top.add(&i.to_be_bytes()[..], 1, u64::from(i));
            n += 1;
            if i % 40 == 0 {
                top.add(&b"flooder"[..], 1, u64::from(i));
            }
            assert!(top.len() <= 100);
        }
        let best = top.top(3);
        assert_eq!(best[0].key, b"flooder");
        assert_eq!(best[0].count, 2_500);
        assert_eq!(best[0].error, 0);
        assert_eq!(best[0].first_seen, 0);
        assert_eq!(best[0].last_seen, 99_960);
        assert_eq!(top.total(), n + 2_500);
        // Every other counter is the smallest count plus one: each error is what it inherited.
        assert!(best[1].count <= best[1].error + 1);
    }

    #[test]
    fn counts_are_never_below_the_truth_and_errors_bound_them() {
        let mut top = SpaceSaving::<u32>::new(4);
        let stream = [1, 2, 3, 4, 5, 1, 1, 6, 2, 1];
        for k in stream {
            top.add(&k, 1, 0);
        }
        for c in top.top(4) {
            let truth = stream.iter().filter(|&&k| k == c.key).count() as u64;
            assert!(c.count >= truth, "{c:?}");
            assert!(c.count - c.error <= truth, "{c:?}");
        }
        assert_eq!(top.top(1)[0].key, 1);
        assert_eq!(top.top(1)[0].count, 4);
    }

    #[test]
    fn merging_drained_summaries_adds_counts_and_keeps_the_span_seen() {
        let mut a = SpaceSaving::<String>::new(10);
        let mut b = SpaceSaving::<String>::new(10);
        a.add("x", 3, 10);
        b.add("x", 2, 5);
        b.add("x", 1, 30);
        b.add("y", 1, 20);
        a.merge(b.drain());
        assert!(b.is_empty());
        let x = &a.top(1)[0];
        assert_eq!((x.count, x.first_seen, x.last_seen), (6, 5, 30));
        assert_eq!(a.total(), 7);
    }
}
