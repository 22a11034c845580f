//! Delayed limits' waiters: how many requests wait per (limit, key), bounded, and what a
//! request that waits holds until its time comes.
//!
//! A request takes a seat among its key's waiters before its check (`prepare.rs`): only a
//! request that holds one is checked with the limit's delay, so a key never has more than
//! its limit's `max_waiting` requests waiting, nor a limit more than
//! [`MAX_WAITERS_PER_LIMIT`], whatever the backend answers and however many replicas ask it.
//! A request that the check admits without a wait, or refuses, gives its seat back at once
//! (`decide.rs`); one that waits gives it back when its wait ends or it is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tollgate_engine::{Limit, MAX_CHECKS, MAX_WAITERS_PER_LIMIT};

/// The waiters of one limit.
#[derive(Debug, Default)]
struct PerLimit {
    /// Seats taken over every key.
    total: u32,
    /// Seats taken per key; a key leaves when its count drops to 0.
    keys: HashMap<Box<[u8]>, u32>,
}

/// The seats taken among every delayed limit's waiters, by limit id (the limit's name: so a
/// reload that keeps the name keeps counting the requests that wait under the old set).
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    limits: Mutex<HashMap<u64, PerLimit>>,
}

impl Waiters {
    /// Takes a seat for a request of `key` under `limit`, if the key and the limit have room.
    fn enter(&self, limit: &Limit, key: &[u8]) -> bool {
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        let per = limits.entry(limit.id()).or_default();
        if per.total >= MAX_WAITERS_PER_LIMIT {
            return false;
        }
        let taken = per.keys.get(key).copied().unwrap_or(0);
        if taken >= limit.waiting_bound() {
            return false;
        }
        match per.keys.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                per.keys.insert(key.into(), 1);
            }
        }
        per.total += 1;
        true
    }

    /// Gives back a seat of `key` under the limit `id`.
    fn leave(&self, id: u64, key: &[u8]) {
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(per) = limits.get_mut(&id) else {
            return;
        };
        if let Some(n) = per.keys.get_mut(key) {
            *n -= 1;
            per.total -= 1;
            if *n == 0 {
                per.keys.remove(key);
            }
        }
        if per.total == 0 {
            limits.remove(&id);
        }
    }

    /// Requests waiting (or holding a seat for their check) under the limit `id`, and under
    /// its `key`.
    #[cfg(test)]
    pub(crate) fn count(&self, id: u64, key: &[u8]) -> (u32, u32) {
        let limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        limits.get(&id).map_or((0, 0), |per| {
            (per.total, per.keys.get(key).copied().unwrap_or(0))
        })
    }
}

/// The seats one request holds, by the index of their limit in the layer; given back when
/// dropped.
#[derive(Debug)]
pub(crate) struct WaitSeats {
    waiters: Arc<Waiters>,
    held: Vec<(usize, u64, Box<[u8]>)>,
}

impl WaitSeats {
    pub(crate) fn new(waiters: &Arc<Waiters>) -> Self {
        Self {
            waiters: Arc::clone(waiters),
            held: Vec::new(),
        }
    }

    /// Takes a seat for the limit at `entry` (of the layer) and `key`, if there is room.
    pub(crate) fn enter(&mut self, entry: usize, limit: &Limit, key: &[u8]) -> bool {
        if !self.waiters.enter(limit, key) {
            return false;
        }
        // Most requests take one seat: room for one, not the vector's default four.
        self.held.reserve_exact(1);
        self.held.push((entry, limit.id(), key.into()));
        true
    }

    /// Keeps only the seats of the limits whose `waits[entry]` is not 0; gives back the rest.
    /// `None` when nothing is left to hold.
    pub(crate) fn keep_waiting(mut self, waits: &[u64; MAX_CHECKS]) -> Option<Self> {
        let waiters = Arc::clone(&self.waiters);
        self.held.retain(|(entry, id, key)| {
            let waits = waits.get(*entry).is_some_and(|&w| w > 0);
            if !waits {
                waiters.leave(*id, key);
            }
            waits
        });
        (!self.held.is_empty()).then_some(self)
    }

    /// Whether a seat is held for the limit at `entry` (of the layer).
    pub(crate) fn holds(&self, entry: usize) -> bool {
        self.held.iter().any(|(e, _, _)| *e == entry)
    }

    /// Whether no seat is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl Drop for WaitSeats {
    fn drop(&mut self) {
        for (_, id, key) in &self.held {
            self.waiters.leave(*id, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_engine::Quota;

    #[test]
    fn a_key_holds_at_most_its_bound_and_leaves_when_its_last_place_is_given_back() {
        let limit = Limit::gcra("l", Quota::per_second(1).unwrap())
            .unwrap()
            .delay_up_to(std::time::Duration::from_secs(5))
            .unwrap()
            .max_waiting(2)
            .unwrap();
        let waiters = Arc::new(Waiters::default());
        let mut a = WaitSeats::new(&waiters);
        let mut b = WaitSeats::new(&waiters);
        assert!(a.enter(0, &limit, b"k"));
        assert!(b.enter(0, &limit, b"k"));
        let mut c = WaitSeats::new(&waiters);
        assert!(!c.enter(0, &limit, b"k"));
        assert!(c.enter(0, &limit, b"other"));
        assert_eq!(waiters.count(limit.id(), b"k"), (3, 2));
        // `a` waits for nothing: its seat goes back.
        assert!(a.keep_waiting(&[0; MAX_CHECKS]).is_none());
        assert_eq!(waiters.count(limit.id(), b"k"), (2, 1));
        let b = b.keep_waiting(&[1, 0, 0, 0, 0, 0, 0, 0]);
        assert!(b.is_some());
        drop((b, c));
        assert_eq!(waiters.count(limit.id(), b"k"), (0, 0));
        assert!(waiters
            .limits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty());
    }
}
