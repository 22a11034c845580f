//! Queued concurrency limits' lines: per limit and key, the requests that wait for a free
//! slot, first come first served.
//!
//! A request that a full key refused (and nothing else did) takes a place at the back of the
//! key's line (`decide.rs`); a request that finds the line not empty takes one without a
//! check (`prepare.rs`), so that it never passes those ahead of it in this process. Only the
//! request at the front checks again: when a slot of its key is given back here
//! (`slots.rs` calls [`Lines::wake`]), when it has just come to the front, or when its poll
//! of a shared backend is due (`queued.rs`). A place holds nothing but itself: no slot and no
//! unit of any limit. Lines are bounded per key (the limit's `max_waiting`) and per limit
//! ([`MAX_WAITERS_PER_LIMIT`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};

use tollgate_engine::{Limit, Micros, MAX_WAITERS_PER_LIMIT};

/// One request's place in a line.
#[derive(Debug)]
struct Place {
    number: u64,
    /// Slots of the key given back since the place last looked (only the front's count:
    /// it is handed on to the next front with whatever its holder did not take).
    woken: u32,
    waker: Option<Waker>,
}

/// The requests waiting for one key's slots, oldest first.
#[derive(Debug, Default)]
struct Line {
    places: VecDeque<Place>,
}

impl Line {
    /// Wakes the place at the front; its waker, to be called once the lock is let go.
    fn wake_front(&mut self) -> Option<Waker> {
        self.hand_on(1)
    }

    /// Hands `wakes` (slots given back that nobody took) to the place at the front; its
    /// waker, to be called once the lock is let go (a place that comes to the front looks
    /// at its turn even with nothing handed on: it starts polling).
    fn hand_on(&mut self, wakes: u32) -> Option<Waker> {
        let front = self.places.front_mut()?;
        front.woken = front.woken.saturating_add(wakes);
        front.waker.take()
    }
}

/// The lines of one limit.
#[derive(Debug, Default)]
struct PerLimit {
    /// Places taken over every key.
    total: u32,
    lines: HashMap<Box<[u8]>, Line>,
}

/// Every queued limit's lines, by limit id (its name: a reload that keeps the name keeps the
/// lines), shared by the layer's clones.
#[derive(Debug, Default)]
pub(crate) struct Lines {
    limits: Mutex<HashMap<u64, PerLimit>>,
    /// Numbers places in the order they are taken.
    next: std::sync::atomic::AtomicU64,
}

/// What a place finds when it looks at its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turn {
    /// Whether it is at the front of its line (only the front checks again).
    pub(crate) front: bool,
    /// How many slots of its key were given back since it last looked.
    pub(crate) woken: u32,
}

impl Lines {
    /// Takes a place at the back of `key`'s line under `limit` (the limit at `entry` of the
    /// layer), if the key and the limit have room; with `behind`, only if the line has
    /// someone in it already.
    pub(crate) fn join(
        self: &Arc<Self>,
        limit: &Limit,
        entry: usize,
        key: &[u8],
        behind: bool,
    ) -> Option<Ticket> {
        let number = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        if behind && !limits.get(&limit.id())?.lines.contains_key(key) {
            return None;
        }
        let per = limits.entry(limit.id()).or_default();
        if per.total >= MAX_WAITERS_PER_LIMIT {
            return None;
        }
        let taken = per.lines.get(key).map_or(0, |l| l.places.len());
        if taken >= limit.waiting_bound() as usize {
            return None;
        }
        let place = Place {
            number,
            woken: 0,
            waker: None,
        };
        match per.lines.get_mut(key) {
            Some(line) => line.places.push_back(place),
            None => {
                let mut line = Line::default();
                line.places.push_back(place);
                per.lines.insert(key.into(), line);
            }
        }
        per.total += 1;
        drop(limits);
        Some(Ticket {
            lines: Arc::clone(self),
            id: limit.id(),
            key: key.into(),
            number,
            entry,
            carry: 0,
        })
    }

    /// A slot of `key` under the limit `id` was given back: the request at the front of its
    /// line, if any, checks again.
    pub(crate) fn wake(&self, id: u64, key: &[u8]) {
        let waker = {
            let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
            limits
                .get_mut(&id)
                .and_then(|per| per.lines.get_mut(key))
                .and_then(Line::wake_front)
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Where `ticket` stands; registers the task to wake when that changes.
    fn turn(&self, ticket: &Ticket, cx: &Context<'_>) -> Turn {
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        let line = limits
            .get_mut(&ticket.id)
            .and_then(|per| per.lines.get_mut(&*ticket.key));
        let Some(line) = line else {
            return Turn {
                front: false,
                woken: 0,
            };
        };
        let front = line.places.front().map(|p| p.number) == Some(ticket.number);
        let Some(place) = line.places.iter_mut().find(|p| p.number == ticket.number) else {
            return Turn {
                front: false,
                woken: 0,
            };
        };
        match &mut place.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        let woken = std::mem::take(&mut place.woken);
        Turn { front, woken }
    }

    /// Gives `ticket`'s place back; the next in line, if it comes to the front, gets the
    /// slots given back that this one did not take, and checks at once if there are any.
    fn leave(&self, ticket: &Ticket) {
        let waker = {
            let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(per) = limits.get_mut(&ticket.id) else {
                return;
            };
            let mut waker = None;
            if let Some(line) = per.lines.get_mut(&*ticket.key) {
                if let Some(at) = line.places.iter().position(|p| p.number == ticket.number) {
                    let place = line.places.remove(at);
                    per.total -= 1;
                    if at == 0 {
                        let woken = place.map_or(0, |p| p.woken);
                        waker = line.hand_on(woken.saturating_add(ticket.carry));
                    }
                }
                if line.places.is_empty() {
                    per.lines.remove(&*ticket.key);
                }
            }
            if per.total == 0 {
                limits.remove(&ticket.id);
            }
            waker
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Requests waiting under the limit `id`, and in `key`'s line.
    #[cfg(test)]
    pub(crate) fn count(&self, id: u64, key: &[u8]) -> (u32, usize) {
        let limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        limits.get(&id).map_or((0, 0), |per| {
            (per.total, per.lines.get(key).map_or(0, |l| l.places.len()))
        })
    }
}

/// Where a waiting request stands, read by its decision (`decide.rs`).
#[derive(Debug)]
pub(crate) struct Queueing {
    /// Its place in its line.
    pub(crate) ticket: Ticket,
    /// How long it has waited, at its latest check.
    pub(crate) waited: Micros,
    /// Whether its wait is over: its check refuses rather than waiting again.
    pub(crate) last: bool,
}

impl Queueing {
    pub(crate) fn new(ticket: Ticket) -> Self {
        Self {
            ticket,
            waited: 0,
            last: false,
        }
    }
}

/// One request's place in a line; given back when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    lines: Arc<Lines>,
    id: u64,
    key: Box<[u8]>,
    number: u64,
    /// The index in the layer of the limit whose line this is.
    entry: usize,
    /// Slots given back that this place was woken for and did not take: handed on to the
    /// next front when it leaves.
    carry: u32,
}

impl Ticket {
    /// The index in the layer of the limit whose line this is.
    pub(crate) fn entry(&self) -> usize {
        self.entry
    }

    /// Where this place stands (see [`Turn`]); the task is woken when that changes. The
    /// slots it was woken for are its own to hand on, until it checks again
    /// ([`Ticket::checked`]).
    pub(crate) fn turn(&mut self, cx: &Context<'_>) -> Turn {
        let turn = self.lines.turn(self, cx);
        self.carry = self.carry.saturating_add(turn.woken);
        turn
    }

    /// Its check found what the slots it was woken for had become: taken by others (`None`,
    /// still full: none is left to hand on), or one taken by this request (`Some(true)`),
    /// or none taken (`Some(false)`: refused by something else, they stay free).
    pub(crate) fn checked(&mut self, took: Option<bool>) {
        self.carry = match took {
            None => 0,
            Some(true) => self.carry.saturating_sub(1),
            Some(false) => self.carry,
        };
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.lines.leave(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limit(max_waiting: u32) -> Limit {
        Limit::concurrency("c", 1)
            .unwrap()
            .queue_up_to(Duration::from_secs(1), max_waiting)
            .unwrap()
    }

    #[test]
    fn the_front_is_woken_and_the_next_comes_to_the_front_when_it_leaves() {
        let limit = limit(2);
        let lines = Arc::new(Lines::default());
        // Nobody in line: nothing to wait behind.
        assert!(lines.join(&limit, 0, b"k", true).is_none());
        let mut a = lines.join(&limit, 0, b"k", false).unwrap();
        let mut b = lines.join(&limit, 0, b"k", true).unwrap();
        // Two of two: full.
        assert!(lines.join(&limit, 0, b"k", false).is_none());
        let other = lines.join(&limit, 0, b"other", false).unwrap();
        assert_eq!(lines.count(limit.id(), b"k"), (3, 2));
        let cx = Context::from_waker(Waker::noop());
        let (front, back) = (
            Turn {
                front: true,
                woken: 0,
            },
            Turn {
                front: false,
                woken: 0,
            },
        );
        assert_eq!((a.turn(&cx), b.turn(&cx)), (front, back));
        // A slot comes back: only the front is woken, once.
        lines.wake(limit.id(), b"k");
        assert_eq!(
            (a.turn(&cx), b.turn(&cx)),
            (
                Turn {
                    front: true,
                    woken: 1
                },
                back
            )
        );
        assert_eq!(a.turn(&cx), front);
        // It took the slot it was woken for: nothing to hand on.
        a.checked(Some(true));
        drop(a);
        assert_eq!(b.turn(&cx), front);
        // Two slots come back; the front takes one and hands the other on.
        lines.wake(limit.id(), b"k");
        lines.wake(limit.id(), b"k");
        assert_eq!(b.turn(&cx).woken, 2);
        b.checked(Some(true));
        let mut c = lines.join(&limit, 0, b"k", false).unwrap();
        drop(b);
        assert_eq!(
            c.turn(&cx),
            Turn {
                front: true,
                woken: 1
            }
        );
        drop((c, other));
        assert_eq!(lines.count(limit.id(), b"k"), (0, 0));
        assert!(lines
            .limits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty());
    }

    #[test]
    fn a_place_that_leaves_from_the_middle_wakes_nobody_and_the_front_hands_on_its_slot() {
        let limit = limit(3);
        let lines = Arc::new(Lines::default());
        let mut a = lines.join(&limit, 0, b"k", false).unwrap();
        let b = lines.join(&limit, 0, b"k", false).unwrap();
        let mut c = lines.join(&limit, 0, b"k", false).unwrap();
        let cx = Context::from_waker(Waker::noop());
        drop(b);
        assert_eq!(a.turn(&cx).woken, 0);
        assert_eq!(c.turn(&cx).woken, 0);
        // The front leaves unserved with the slot it was woken for: the next gets it.
        lines.wake(limit.id(), b"k");
        drop(a);
        assert_eq!(
            c.turn(&cx),
            Turn {
                front: true,
                woken: 1
            }
        );
    }
}
