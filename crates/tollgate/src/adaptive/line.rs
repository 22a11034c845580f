//! The adaptive limit's queue: requests that found the limit full wait here, the highest
//! level first and first come, first served within a level. Its state lives in the gate's
//! one mutex.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::task::Waker;

use super::classes::Priority;
use super::outcome::ShedReason;

/// A place in the line: its level first, so that the map's order is the order of service.
pub(crate) type Place = (Reverse<Priority>, u64);

/// One waiting request.
#[derive(Debug)]
pub(crate) struct Waiter {
    pub(crate) fp: u64,
    pub(crate) waker: Option<Waker>,
}

/// What the gate decided for a request that left the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Admitted (counted in flight) in this epoch of the controller.
    Admitted(u64),
    /// Shed from the line.
    Shed(ShedReason),
}

#[derive(Debug, Default)]
pub(crate) struct Line {
    waiting: BTreeMap<Place, Waiter>,
    /// Requests that left the line and have not yet seen why.
    turns: HashMap<Place, Turn>,
    next: u64,
}

impl Line {
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// A place at the back of `level`'s part of the line.
    pub(crate) fn join(&mut self, level: Priority, fp: u64) -> Place {
        self.next += 1;
        let place = (Reverse(level), self.next);
        self.waiting.insert(place, Waiter { fp, waker: None });
        place
    }

    /// Takes the place of the last request of a level below `level`, if any: it is shed,
    /// and the waker to tell it is returned.
    pub(crate) fn evict_below(&mut self, level: Priority) -> Option<Option<Waker>> {
        let (&place, _) = self.waiting.last_key_value()?;
        if place.0 .0 >= level {
            return None;
        }
        let waiter = self.waiting.remove(&place)?;
        self.turns.insert(place, Turn::Shed(ShedReason::QueueFull));
        Some(waiter.waker)
    }

    /// The places in the order of service, with their key's fingerprint.
    pub(crate) fn in_order(&self) -> Vec<(Place, u64)> {
        self.waiting.iter().map(|(p, w)| (*p, w.fp)).collect()
    }

    /// Moves `place` out of the line with its turn; its waker, to tell it.
    pub(crate) fn decide(&mut self, place: Place, turn: Turn) -> Option<Waker> {
        let waiter = self.waiting.remove(&place)?;
        self.turns.insert(place, turn);
        waiter.waker
    }

    /// The turn of `place`, if it has left the line (seen once).
    pub(crate) fn turn(&mut self, place: Place) -> Option<Turn> {
        self.turns.remove(&place)
    }

    /// Keeps `waker` to tell `place` of its turn.
    pub(crate) fn wait(&mut self, place: Place, waker: &Waker) {
        if let Some(waiter) = self.waiting.get_mut(&place) {
            match &waiter.waker {
                Some(w) if w.will_wake(waker) => {}
                _ => waiter.waker = Some(waker.clone()),
            }
        }
    }

    /// Takes `place` out of the line, if it is still in it.
    pub(crate) fn leave(&mut self, place: Place) -> bool {
        self.waiting.remove(&place).is_some()
    }
}
