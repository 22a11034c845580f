//! The gate: one mutex over everything a decision reads and writes (the controller, the
//! requests in flight, per key, and the queue), so that counting across classes is one
//! critical section: in flight never exceeds the limit, whatever the interleaving.

use std::collections::hash_map::RandomState;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::time::Duration;

use http::HeaderName;
use tokio::time::Instant;

use super::classes::{share, Priority};
use super::controller::{Controller, Sample};
use super::fairness::{self, Keys};
use super::line::{Line, Place, Turn};
use super::metrics::{Levels, Metrics};
use super::outcome::{AdaptiveDecision, ShedReason};

/// The adaptive limit's settings besides the controller's.
#[derive(Debug, Clone)]
pub(crate) struct GateSettings {
    pub(crate) reserve_percent: u8,
    /// The queue's size (percent of the current limit) and longest wait.
    pub(crate) queue: Option<(u16, Duration)>,
    pub(crate) monitor_only: bool,
    pub(crate) retry_after: Duration,
    pub(crate) header: Option<HeaderName>,
    pub(crate) timeout: Duration,
}

/// The state every request of the limit reads and writes under the gate's mutex.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) ctl: Controller,
    pub(crate) in_flight: u32,
    pub(crate) keys: Keys,
    pub(crate) line: Line,
}

/// An adaptive concurrency limit's shared state.
pub(crate) struct Gate {
    pub(crate) name: Arc<str>,
    pub(crate) s: GateSettings,
    start: Instant,
    state: Mutex<State>,
    metrics: Metrics,
    hasher: RandomState,
}

/// What the gate answered a request.
pub(crate) enum Answer {
    /// Admitted, counted in flight in `epoch` under the key `fp` (under monitor-only, perhaps
    /// one it would have refused: `part` says so).
    Admitted {
        fp: u64,
        epoch: u64,
        part: AdaptiveDecision,
    },
    /// Waits in the queue at `place`, at most `wait`.
    Wait {
        place: Place,
        fp: u64,
        level: Priority,
        wait: Duration,
    },
    /// Shed.
    Shed(AdaptiveDecision),
}

impl State {
    /// Why a request of `level` and key `fp` may not start now, if it may not.
    fn refusal(&self, level: Priority, fp: u64, reserve: u8) -> Option<ShedReason> {
        let limit = self.ctl.limit();
        let share = share(limit, reserve, level);
        if self.in_flight >= share {
            return Some(ShedReason::Limit);
        }
        if !self.keys.fair(fp, share, self.in_flight) {
            return Some(ShedReason::KeyShare);
        }
        None
    }

    fn take(&mut self, fp: u64) -> u64 {
        self.in_flight += 1;
        self.keys.add(fp);
        self.ctl.admitted(self.in_flight);
        self.ctl.epoch()
    }
}

impl Gate {
    pub(crate) fn new(
        name: Arc<str>,
        s: GateSettings,
        ctl: impl FnOnce(u64) -> Controller,
    ) -> Self {
        let start = Instant::now();
        Self {
            metrics: Metrics::new(Arc::clone(&name), s.monitor_only),
            name,
            s,
            start,
            state: Mutex::new(State {
                ctl: ctl(0),
                in_flight: 0,
                keys: Keys::default(),
                line: Line::default(),
            }),
            hasher: RandomState::new(),
        }
    }

    /// Microseconds since the gate was made, on Tokio's clock (which tests pause).
    pub(crate) fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while the lock is held; a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The fingerprint of a request's key.
    pub(crate) fn fingerprint(&self, key: Option<&[u8]>) -> u64 {
        fairness::fingerprint(&self.hasher, key)
    }

    /// Admits, queues or sheds a request of `level` whose key's fingerprint is `fp`.
    pub(crate) fn admit(&self, level: Priority, fp: u64) -> Answer {
        let now = self.now();
        let mut wake = Vec::new();
        let mut st = self.lock();
        if st.ctl.tick(now) {
            self.dispatch(&mut st, &mut wake);
        }
        let refusal = st.refusal(level, fp, self.s.reserve_percent);
        let answer = match refusal {
            None => Answer::Admitted {
                fp,
                epoch: st.take(fp),
                part: AdaptiveDecision::new(level, None, self.s.monitor_only),
            },
            Some(reason) => {
                st.ctl.demanded();
                self.refused(&mut st, level, fp, reason, &mut wake)
            }
        };
        self.show(&st);
        drop(st);
        wake.into_iter().for_each(Waker::wake);
        answer
    }

    /// The answer to a request that may not start now.
    fn refused(
        &self,
        st: &mut State,
        level: Priority,
        fp: u64,
        reason: ShedReason,
        wake: &mut Vec<Waker>,
    ) -> Answer {
        if self.s.monitor_only {
            self.metrics.shed(level, reason);
            return Answer::Admitted {
                fp,
                epoch: st.take(fp),
                part: AdaptiveDecision::new(level, Some(reason), true),
            };
        }
        let shed = |reason| {
            self.metrics.shed(level, reason);
            Answer::Shed(AdaptiveDecision::new(level, Some(reason), false))
        };
        let Some((percent, wait)) = self.s.queue.filter(|_| reason == ShedReason::Limit) else {
            return shed(reason);
        };
        let room = (u64::from(st.ctl.limit()) * u64::from(percent) / 100).max(1);
        if st.line.len() as u64 >= room {
            match st.line.evict_below(level) {
                Some(waker) => wake.extend(waker),
                None => return shed(ShedReason::QueueFull),
            }
        }
        Answer::Wait {
            place: st.line.join(level, fp),
            fp,
            level,
            wait,
        }
    }

    /// Admits the waiters that may start now, in the order of service.
    fn dispatch(&self, st: &mut State, wake: &mut Vec<Waker>) {
        if st.line.len() == 0 {
            return;
        }
        for (place, fp) in st.line.in_order() {
            if st.in_flight >= st.ctl.limit() {
                break;
            }
            if st.refusal(place.0 .0, fp, self.s.reserve_percent).is_none() {
                let epoch = st.take(fp);
                wake.extend(st.line.decide(place, Turn::Admitted(epoch)));
            }
        }
    }

    /// What a request admitted in `epoch` says of the service.
    pub(crate) fn sample(&self, epoch: u64, sample: Sample) {
        let now = self.now();
        let mut wake = Vec::new();
        let mut st = self.lock();
        if st.ctl.sample(epoch, sample, now) {
            self.dispatch(&mut st, &mut wake);
        }
        self.show(&st);
        drop(st);
        wake.into_iter().for_each(Waker::wake);
    }

    /// A permit of key `fp` given back, with what its request says, if anything.
    pub(crate) fn release(&self, fp: u64, epoch: u64, sample: Option<Sample>) {
        let now = self.now();
        let mut wake = Vec::new();
        let mut st = self.lock();
        st.in_flight = st.in_flight.saturating_sub(1);
        st.keys.remove(fp);
        match sample {
            Some(sample) => st.ctl.sample(epoch, sample, now),
            None => st.ctl.tick(now),
        };
        self.dispatch(&mut st, &mut wake);
        self.show(&st);
        drop(st);
        wake.into_iter().for_each(Waker::wake);
    }

    /// The turn of a waiter at `place`, if it has one; else keeps `waker` to tell it.
    pub(crate) fn turn(&self, place: Place, waker: &Waker) -> Option<Turn> {
        let mut st = self.lock();
        let turn = st.line.turn(place);
        if turn.is_none() {
            st.line.wait(place, waker);
        }
        turn
    }

    /// A waiter at `place` leaves (its wait is over, or it was dropped): `None` if it left
    /// the line, else the turn it was given and had not seen.
    pub(crate) fn leave(&self, place: Place) -> Option<Turn> {
        let mut st = self.lock();
        if st.line.leave(place) {
            self.show(&st);
            return None;
        }
        st.line.turn(place)
    }

    /// Counts a request of `level` shed from the queue.
    pub(crate) fn count_shed(&self, level: Priority, reason: ShedReason) {
        self.metrics.shed(level, reason);
    }

    fn show(&self, st: &State) {
        self.metrics.show(&Levels {
            limit: st.ctl.limit(),
            in_flight: st.in_flight,
            min_rtt_micros: st.ctl.baseline().unwrap_or(0),
            queue: st.line.len(),
        });
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adaptive")
            .field("name", &self.name)
            .field("settings", &self.s)
            .finish_non_exhaustive()
    }
}
