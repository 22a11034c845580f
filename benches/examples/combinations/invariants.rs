//! Invariants judged from outside: what the handler saw, held against the quotas as the
//! docs define them, with no code of the layer nor of the engine's algorithms.
//!
//! The handler records each request that reaches it (its key, its units, the quotas it was
//! counted under, written by the harness from the numbers it drew) and when its response
//! ended; the harness records resets, reloads, restarts, denies, blocks it was told of, and
//! waiters it dropped. Times are in the limiter's frame: in memory the backend's clock (plus
//! the wait the layer slept on Tokio's paused clock while that clock stood); on Redis real
//! time (the server's `TIME`), where a request is only known to have been checked between
//! its sending and its arrival, so a start is an interval.
//!
//! The oracles:
//! - **GCRA conformance**: in any window `[s, e]` of a key's starts under one quota, at most
//!   `burst + ⌊(e − s) / T⌋` units, plus the units refunded inside the window;
//! - **fixed-window conformance**: in each window, by the window in which they *run*, at most
//!   the limit, plus the units refunded inside it;
//! - **concurrency**: never more requests holding a key's slot in the handler, across
//!   replicas, than its most slots; and a client that waited for the end of its response is
//!   never refused for its own slot (`alternating`);
//! - **sanctions**: a key denied by hand or blocked never reaches the handler before the end
//!   it was given; a statically denylisted key never does; an allowlisted key is never
//!   counted;
//! - **nothing raw in Redis**: no identity text in any key, value or member;
//! - **conservation**: after quiescence, what the handler saw admitted, net of refunds and
//!   charges, is what `peek` shows for keys whose whole usage the harness saw.
//! - **metrics**: every request sent is counted once by `tollgate_decisions_total` at the
//!   rate limit, and its admissions are the requests the handler saw counted there.
//!
//! Each allowance is a named rule below, with the bound it comes from.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tollgate::{Decision, Outcome};
use tollgate_engine::{Clock, Micros};

/// A quota as the harness drew it: `limit` per `period` µs, GCRA's `burst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) gcra: bool,
    pub(crate) limit: u32,
    pub(crate) burst: u32,
    pub(crate) period: Micros,
}

impl Spec {
    pub(crate) fn gcra(limit: u32, burst: u32, period: Micros) -> Self {
        Self {
            gcra: true,
            limit,
            burst,
            period,
        }
    }

    pub(crate) fn window(limit: u32, period: Micros) -> Self {
        Self {
            gcra: false,
            limit,
            burst: limit,
            period,
        }
    }

    /// Rule *whole-microsecond interval*: GCRA's emission interval is the period divided by
    /// the limit in whole microseconds (`Quota::emission_interval`), so the long-run rate may
    /// exceed `limit / period` by that rounding.
    fn interval(&self) -> Micros {
        (self.period / u64::from(self.limit)).max(1)
    }
}

/// What the harness says of a request it sends (a request extension the handler reads).
#[derive(Clone, Debug)]
pub(crate) struct Sent {
    /// The limiter's time when it was sent.
    pub(crate) at: Micros,
    /// Tokio's time when it was sent (the layer's waits run on it).
    pub(crate) tokio: tokio::time::Instant,
    /// Each rate limit it passes through, by name: its quota (for its plan and reload
    /// generation) and the units it costs there.
    pub(crate) rates: Vec<(&'static str, Spec, u32)>,
    /// The concurrency limit's most slots of its key, over every plan.
    pub(crate) slots: Option<u32>,
    /// The units a response refunds to the rate limits: known before it is sent (a refund
    /// on `500`, a charge below the cost).
    pub(crate) refund: u32,
    /// The units a charge above the cost adds.
    pub(crate) extra: u32,
    /// Statically denylisted when sent.
    pub(crate) denylisted: bool,
    /// A client that sends its next request only once this one's response ended.
    pub(crate) alternating: bool,
}

/// How the limiter's time is read.
pub(crate) enum Frame {
    /// The in-memory backend's clock; `delays`: Tokio's clock is paused while a request waits
    /// in the layer and the backend's clock stands, so its start is the time it was sent plus
    /// the wait Tokio's clock ran.
    Memory { clock: Arc<dyn Clock>, delays: bool },
    /// Real time: the server's `TIME` on the same host.
    Real,
}

/// Rule *deadline*: on Redis a settle or a release sent without waiting lands within the
/// backend's deadline (`RedisBackendBuilder::deadline`, 2 s in the harness) or is abandoned.
pub(crate) const REAL_SLACK: Micros = 2_000_000;

pub(crate) fn sys_now() -> Micros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as Micros)
}

#[derive(Clone, Debug)]
enum Ev {
    Start {
        id: u64,
        key: String,
        sent: Sent,
        lo: Micros,
        hi: Micros,
        /// Counted by these rate limits (a backend admitted it there).
        counted: Vec<(&'static str, Spec, u32)>,
        /// Holds one of its key's slots.
        slot: bool,
        allowlisted: bool,
        /// The rate limit was a shadow one for it (its key outside the enforced share).
        shadow: bool,
        /// Admitted by that shadow rate limit (consuming there, not bound by it).
        shadow_counted: bool,
    },
    End {
        id: u64,
    },
    /// Units given back to `key`'s rate limits, landing some time within `[lo, hi]`.
    Refund {
        /// The start it settles (0 for a waiter dropped before it started).
        id: u64,
        key: String,
        units: u32,
        lo: Micros,
        hi: Micros,
    },
    /// Units a charge added to `key`'s rate limits, landed by the end of its response.
    Extra {
        id: u64,
        key: String,
        units: u32,
    },
    /// A new epoch: a reset of one key, or (`None`) a reload or a restart; `zero`: the
    /// usage is forgotten (not by a reload, which carries it to the new quotas).
    Break {
        key: Option<String>,
        zero: bool,
    },
    /// Every slot and sanction forgotten: a restart of Redis without persistence.
    Forget,
    /// A deny by hand of `key`, asked at `asked`, standing from `from` (the call returned)
    /// to `until`; it replaces the key's earlier deny.
    Deny {
        key: String,
        asked: Micros,
        from: Micros,
        until: Micros,
    },
    Undeny {
        key: String,
        at: Micros,
    },
    /// A refusal that said `key` is blocked until at least `until`, answered at `from`.
    Block {
        key: String,
        from: Micros,
        until: Micros,
    },
    /// A reset lifts a block (not a deny).
    Lift {
        key: String,
    },
    /// A one-request-at-a-time client was refused for its full slots.
    RefusedOwnSlot {
        key: String,
        at: Micros,
    },
}

/// The metrics the layers record, read back by the metrics invariant.
static METRICS: OnceLock<metrics_util::debugging::Snapshotter> = OnceLock::new();

/// When a sequence last stopped early: it may leave waiters on tasks of their own, whose
/// decisions later sequences' counters would count.
static LAST_EARLY_STOP: Mutex<Option<std::time::Instant>> = Mutex::new(None);

/// Notes whether this sequence came to quiescence; whether every waiter an earlier one left
/// is surely done: a queue's longest wait (0.6 s) and the backend's deadline (2 s) later,
/// with room to spare.
pub(crate) fn quiet_before(quiet: bool) -> bool {
    let mut last = LAST_EARLY_STOP.lock().unwrap();
    let clean = last.is_none_or(|t| t.elapsed() > std::time::Duration::from_secs(5));
    if !quiet {
        *last = Some(std::time::Instant::now());
    }
    clean && quiet
}

/// Installs a recorder of every metric as the process's (before any layer sees a request).
pub(crate) fn record_metrics() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    if recorder.install().is_ok() {
        let _ = METRICS.set(snapshotter);
    }
}

/// `tollgate_decisions_total` of `limit` by outcome since the last call (a snapshot of the
/// recorder takes its counters back to 0).
pub(crate) fn decisions(limit: &str) -> Option<HashMap<String, u64>> {
    let snapshot = METRICS.get()?.snapshot();
    let mut out = HashMap::new();
    for (key, _, _, value) in snapshot.into_vec() {
        let key = key.key();
        let labels = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
        };
        if key.name() != "tollgate_decisions_total" || labels("limit").as_deref() != Some(limit) {
            continue;
        }
        if let (Some(outcome), metrics_util::debugging::DebugValue::Counter(n)) =
            (labels("outcome"), value)
        {
            *out.entry(outcome).or_default() += n;
        }
    }
    Some(out)
}

/// The record of one sequence, shared by every replica's handler.
pub(crate) struct Trace {
    frame: Frame,
    /// A lease's slices: on another replica a slice may admit a denied key until it runs
    /// out (rule *lease slice*): the replicas times the most units of a slice.
    lease_units: Option<u32>,
    state: Mutex<(u64, Vec<Ev>)>,
    /// Requests sent with what the invariants know of them.
    sends: Mutex<u64>,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Trace")
    }
}

/// Counts a request out of the handler when its response body is dropped.
#[derive(Debug)]
pub(crate) struct Exit {
    trace: Arc<Trace>,
    id: u64,
    key: String,
    refund: u32,
    extra: u32,
    sent_at: Micros,
    start_hi: Micros,
    /// Its `Ev::End` already recorded, by `ended`.
    ended: bool,
}

impl Exit {
    /// The handler's body ended (its last chunk was taken): the request no longer holds its
    /// slot, which the layer gives back before the response's body ends to the client.
    pub(crate) fn ended(&mut self) {
        if !std::mem::replace(&mut self.ended, true) {
            self.trace.push(Ev::End { id: self.id });
        }
    }
}

impl Drop for Exit {
    fn drop(&mut self) {
        let at = self.trace.now();
        let slack = self.trace.slack();
        let mut state = self.trace.state.lock().unwrap();
        if !self.ended {
            state.1.push(Ev::End { id: self.id });
        }
        if self.extra > 0 {
            state.1.push(Ev::Extra {
                id: self.id,
                key: self.key.clone(),
                units: self.extra,
            });
        }
        if self.refund > 0 {
            // The settle is sent once the cost is known, at the head or at the body's end,
            // and lands by then plus the deadline. In memory with delays the backend's clock
            // stood while the layer waited: the refund may land at the time it was sent.
            state.1.push(Ev::Refund {
                id: self.id,
                key: self.key.clone(),
                units: self.refund,
                lo: self.sent_at,
                hi: at.max(self.start_hi) + slack,
            });
        }
    }
}

impl Trace {
    pub(crate) fn new(frame: Frame, lease_units: Option<u32>) -> Arc<Self> {
        Arc::new(Self {
            frame,
            lease_units,
            state: Mutex::new((0, Vec::new())),
            sends: Mutex::new(0),
        })
    }

    /// The limiter's time now (in memory with delays, of the backend's clock alone).
    pub(crate) fn now(&self) -> Micros {
        match &self.frame {
            Frame::Memory { clock, .. } => clock.now(),
            Frame::Real => sys_now(),
        }
    }

    fn slack(&self) -> Micros {
        match self.frame {
            Frame::Memory { .. } => 0,
            Frame::Real => REAL_SLACK,
        }
    }

    /// What the harness records of a request it sends now.
    pub(crate) fn sent(&self) -> Sent {
        *self.sends.lock().unwrap() += 1;
        Sent {
            at: self.now(),
            tokio: tokio::time::Instant::now(),
            rates: Vec::new(),
            slots: None,
            refund: 0,
            extra: 0,
            denylisted: false,
            alternating: false,
        }
    }

    fn push(&self, ev: Ev) {
        self.state.lock().unwrap().1.push(ev);
    }

    /// A request reached the handler of `key` with `decision`; the guard records its exit.
    pub(crate) fn enter(
        self: &Arc<Self>,
        key: &str,
        sent: Option<&Sent>,
        decision: Option<&Decision>,
    ) -> Option<Exit> {
        let sent = sent?.clone();
        let (lo, hi) = match &self.frame {
            Frame::Memory { clock, delays } => {
                let waited = if *delays {
                    (tokio::time::Instant::now() - sent.tokio).as_micros() as Micros
                } else {
                    0
                };
                let at = clock.now() + waited;
                // Rule *timer resolution*: Tokio's timers fire on whole milliseconds
                // (`tokio::time::sleep`: "millisecond granularity"), rounded up, so a wait
                // may end a tick after its time: up to 2 ms here.
                (at.saturating_sub(2_000), at)
            }
            // Checked at or after it was sent; a delayed admission was reserved that far
            // ahead of its check (`Decision::delayed`, which the layer sleeps before calling
            // the service), and the handler is reached at or after its reserved time.
            Frame::Real => {
                let wait = decision
                    .and_then(Decision::delayed)
                    .map_or(0, |d| d.as_micros() as Micros);
                let hi = sys_now();
                ((sent.at + wait).min(hi), hi)
            }
        };
        // Rule *shadow*: a limit in shadow mode for this request (`enforce_percent`, the key
        // outside the enforced share) refuses nothing, never makes a request wait and stands
        // no block: what it admits is bound by nothing, so it is not counted against it.
        let allowed = |name: &str| {
            decision
                .and_then(|d| d.get(name))
                .is_some_and(|l| matches!(l.outcome(), Outcome::Allowed { .. }) && !l.is_shadow())
        };
        let shadow = decision
            .and_then(|d| d.get("rate"))
            .is_some_and(tollgate::LimitDecision::is_shadow);
        // Admitted by the rate limit as a shadow one: counted by the metrics all the same.
        let shadow_counted = shadow
            && decision
                .and_then(|d| d.get("rate"))
                .is_some_and(|l| matches!(l.outcome(), Outcome::Allowed { .. }));
        let counted: Vec<_> = sent
            .rates
            .iter()
            .copied()
            .filter(|(name, _, _)| allowed(name))
            .collect();
        let slot = sent.slots.is_some() && allowed("slots");
        let allowlisted = decision.is_some_and(Decision::is_allowlisted);
        let mut state = self.state.lock().unwrap();
        state.0 += 1;
        let id = state.0;
        let (refund, extra) = if counted.is_empty() {
            (0, 0)
        } else {
            (sent.refund, sent.extra)
        };
        let sent_at = sent.at;
        state.1.push(Ev::Start {
            id,
            key: key.to_owned(),
            sent,
            lo,
            hi,
            counted,
            slot,
            allowlisted,
            shadow,
            shadow_counted,
        });
        drop(state);
        Some(Exit {
            trace: Arc::clone(self),
            id,
            key: key.to_owned(),
            refund,
            extra,
            sent_at,
            start_hi: hi,
            ended: false,
        })
    }

    pub(crate) fn reset(&self, key: &str) {
        self.push(Ev::Break {
            key: Some(key.to_owned()),
            zero: true,
        });
        self.push(Ev::Lift {
            key: key.to_owned(),
        });
    }

    pub(crate) fn reload(&self) {
        self.push(Ev::Break {
            key: None,
            zero: false,
        });
    }

    pub(crate) fn restart(&self) {
        self.push(Ev::Break {
            key: None,
            zero: true,
        });
        self.push(Ev::Forget);
    }

    /// A deny of `key` for `micros`, asked at `asked` and answered now.
    pub(crate) fn deny(&self, key: &str, asked: Micros, micros: Micros) {
        let from = self.now();
        self.push(Ev::Deny {
            key: key.to_owned(),
            asked,
            from,
            until: asked.saturating_add(micros),
        });
    }

    /// An undeny of `key`, asked at `asked`.
    pub(crate) fn undeny(&self, key: &str, asked: Micros) {
        self.push(Ev::Undeny {
            key: key.to_owned(),
            at: asked,
        });
    }

    /// A refusal of `key` sent at `sent` said it is blocked for `retry_after` s more.
    pub(crate) fn blocked(&self, key: &str, sent: Micros, retry_after: u64) {
        // `Retry-After` is the block's rest rounded up to whole seconds, counted from its
        // check, which came after the request was sent.
        let until = sent.saturating_add(retry_after.saturating_sub(1) * 1_000_000);
        let from = self.now();
        self.push(Ev::Block {
            key: key.to_owned(),
            from,
            until,
        });
    }

    /// A waiter of `key` dropped now: its reservation of `units` may be given back
    /// (`OnDrop::Refund`) by the deadline.
    pub(crate) fn dropped(&self, key: &str, units: u32) {
        let lo = self.now();
        self.push(Ev::Refund {
            id: 0,
            key: key.to_owned(),
            units,
            lo,
            hi: lo + self.slack(),
        });
    }

    /// A one-request-at-a-time client of `key` was refused for its full slots.
    pub(crate) fn refused_own_slot(&self, key: &str) {
        let at = self.now();
        self.push(Ev::RefusedOwnSlot {
            key: key.to_owned(),
            at,
        });
    }

    /// The oracles, over everything recorded; one line per violation.
    pub(crate) fn judge(&self) -> Vec<String> {
        let events = self.state.lock().unwrap().1.clone();
        let mut out = Vec::new();
        conformance(&events, &mut out);
        concurrency(&events, &mut out);
        sanctions(&events, self.lease_units, &mut out);
        out.dedup();
        out
    }

    /// What the handler saw of `key`'s rate limit `name` since its usage was last
    /// forgotten, if every start was under the one quota `spec` and every start and refund
    /// is known to lie in `[from, to]`: the level its admissions, refunds (never below 0)
    /// and charges leave.
    pub(crate) fn level(&self, key: &str, name: &str) -> Option<(Spec, u64, Micros, Micros)> {
        let state = self.state.lock().unwrap();
        let mut level: Option<(Spec, u64)> = None;
        let (mut mixed, mut from, mut to) = (false, Micros::MAX, 0);
        // The starts of this epoch: a settle of an earlier one, sent without waiting, may
        // land on either side of the epoch's start.
        let mut ours: Vec<u64> = Vec::new();
        for ev in &state.1 {
            match ev {
                Ev::Break { key: k, zero } if k.as_deref().is_none_or(|k| k == key) => {
                    // After a reload the usage carried is not known here.
                    (level, mixed, from, to) = (None, !zero, Micros::MAX, 0);
                    ours.clear();
                }
                Ev::Refund { id, key: k, .. } | Ev::Extra { id, key: k, .. }
                    if k == key && !ours.contains(id) =>
                {
                    mixed = true;
                }
                Ev::Start {
                    id,
                    key: k,
                    counted,
                    lo,
                    hi,
                    ..
                } if k == key => {
                    ours.push(*id);
                    for (n, spec, units) in counted {
                        if *n != name {
                            continue;
                        }
                        (from, to) = (from.min(*lo), to.max(*hi));
                        match &mut level {
                            Some((s, total)) if s == spec => *total += u64::from(*units),
                            Some(_) => mixed = true,
                            None => level = Some((*spec, u64::from(*units))),
                        }
                    }
                }
                Ev::Refund {
                    key: k,
                    units,
                    lo,
                    hi,
                    ..
                } if k == key => {
                    (from, to) = (from.min(*lo), to.max(*hi));
                    if let Some((_, total)) = &mut level {
                        *total = total.saturating_sub(u64::from(*units));
                    }
                }
                Ev::Extra { key: k, units, .. } if k == key => {
                    if let Some((_, total)) = &mut level {
                        *total += u64::from(*units);
                    }
                }
                _ => {}
            }
        }
        level
            .filter(|_| !mixed)
            .map(|(spec, level)| (spec, level, from, to))
    }

    /// The metrics invariant: every request sent is counted once at `limit`
    /// (`tollgate_decisions_total`, whatever its outcome), and its admissions (`allowed`,
    /// `delayed`, `queued`) are the requests that reached the handler counted there.
    /// `decided`: the counters since the sequence began.
    ///
    /// Rule *shed*: a request the adaptive limit shed (`shed` of them) asked no limit: it is
    /// counted once, as `skipped`, at every limit, and never reaches the handler.
    pub(crate) fn metrics(
        &self,
        limit: &str,
        decided: &HashMap<String, u64>,
        shed: u64,
    ) -> Vec<String> {
        let sent = *self.sends.lock().unwrap();
        let reached = self
            .state
            .lock()
            .unwrap()
            .1
            .iter()
            .filter(|ev| {
                matches!(ev, Ev::Start { counted, shadow_counted, .. }
                    if counted.iter().any(|c| c.0 == limit) || (limit == "rate" && *shadow_counted))
            })
            .count() as u64;
        let total: u64 = decided.values().sum();
        let admitted: u64 = ["allowed", "delayed", "queued"]
            .iter()
            .filter_map(|o| decided.get(*o))
            .sum();
        let skipped = decided.get("skipped").copied().unwrap_or(0);
        let mut out = Vec::new();
        if skipped < shed {
            out.push(format!(
                "invariant metrics: {limit}: tollgate_decisions_total counted {skipped} \
                 skipped ({decided:?}); the adaptive limit shed {shed}"
            ));
        }
        if total != sent || admitted != reached {
            out.push(format!(
                "invariant metrics: {limit}: tollgate_decisions_total counted {total} requests, \
                 {admitted} of them admitted ({decided:?}); the client sent {sent} and the \
                 handler saw {reached} counted there"
            ));
        }
        out
    }

    /// Whether `key` was ever denied by hand or blocked in this sequence.
    pub(crate) fn sanctioned(&self, key: &str) -> bool {
        self.state
            .lock()
            .unwrap()
            .1
            .iter()
            .any(|ev| matches!(ev, Ev::Deny { key: k, .. } | Ev::Block { key: k, .. } if k == key))
    }
}

/// One start as the conformance oracles see it.
#[derive(Clone, Copy, Debug)]
struct Point {
    lo: Micros,
    hi: Micros,
    units: u32,
}

/// The refunds to `key` that may land within `[s, e]` (rule *refund in window*: a refund
/// gives its units back when it lands; one that may land inside the window counts).
fn refunds_in(refunds: &[(Micros, Micros, u32)], s: Micros, e: Micros) -> u64 {
    refunds
        .iter()
        .filter(|(lo, hi, _)| *lo <= e && *hi >= s)
        .map(|(_, _, u)| u64::from(*u))
        .sum()
}

/// GCRA and fixed-window conformance of every key and rate limit.
fn conformance(events: &[Ev], out: &mut Vec<String>) {
    // Rule *epoch*: a reset of a key, a reload (the quotas change) or a restart (Redis
    // forgets) starts a new epoch for the keys it touches; and a key's usage carried from
    // another plan or quota is not judged with this one: a run of starts under one quota is
    // judged alone (its level at the start of the run is unknown but never below 0).
    let mut epoch: HashMap<String, u64> = HashMap::new();
    let mut global = 0u64;
    let mut last: HashMap<(String, &'static str), (u64, u64, Spec)> = HashMap::new();
    let mut runs: HashMap<(String, &'static str, u64), (Spec, Vec<Point>)> = HashMap::new();
    let mut run_no = 0u64;
    let mut refunds: HashMap<String, Vec<(Micros, Micros, u32)>> = HashMap::new();
    for ev in events {
        match ev {
            Ev::Break { key: Some(k), .. } => *epoch.entry(k.clone()).or_default() += 1,
            Ev::Break { key: None, .. } => global += 1,
            Ev::Refund {
                key, units, lo, hi, ..
            } => {
                refunds
                    .entry(key.clone())
                    .or_default()
                    .push((*lo, *hi, *units));
            }
            Ev::Start {
                key,
                lo,
                hi,
                counted,
                ..
            } => {
                let e = epoch.get(key).copied().unwrap_or(0);
                for &(name, spec, units) in counted {
                    let slot = last
                        .entry((key.clone(), name))
                        .or_insert((u64::MAX, 0, spec));
                    if slot.0 != global * 1_000_000 + e || slot.2 != spec {
                        run_no += 1;
                        *slot = (global * 1_000_000 + e, run_no, spec);
                    }
                    runs.entry((key.clone(), name, slot.1))
                        .or_insert_with(|| (spec, Vec::new()))
                        .1
                        .push(Point {
                            lo: *lo,
                            hi: *hi,
                            units,
                        });
                }
            }
            _ => {}
        }
    }
    let mut keys: Vec<_> = runs.into_iter().collect();
    keys.sort_by_key(|((k, n, r), _)| (k.clone(), *n, *r));
    for ((key, name, _), (spec, mut points)) in keys {
        let refunds = refunds.get(&key).map_or(&[][..], Vec::as_slice);
        points.sort_by_key(|p| (p.lo, p.hi));
        if spec.gcra {
            gcra_windows(&key, name, spec, &points, refunds, out);
        } else {
            fixed_windows(&key, name, spec, &points, refunds, out);
        }
    }
}

/// At most `burst + ⌊(e − s) / T⌋` units start within `[s, e]`, plus refunds there.
fn gcra_windows(
    key: &str,
    name: &str,
    spec: Spec,
    points: &[Point],
    refunds: &[(Micros, Micros, u32)],
    out: &mut Vec<String>,
) {
    let interval = spec.interval();
    for (i, first) in points.iter().enumerate() {
        let s = first.lo;
        // Every start known to lie in [s, e] for each e: those sent after `first` whose
        // interval ends by e.
        let mut inside: Vec<&Point> = points[i..].iter().filter(|p| p.lo >= s).collect();
        inside.sort_by_key(|p| p.hi);
        let mut units = 0u64;
        for (j, p) in inside.iter().enumerate() {
            units += u64::from(p.units);
            if inside.get(j + 1).is_some_and(|n| n.hi == p.hi) {
                continue;
            }
            let e = p.hi;
            let most = u64::from(spec.burst) + (e - s) / interval + refunds_in(refunds, s, e);
            if units > most {
                let starts: Vec<_> = inside[..=j]
                    .iter()
                    .map(|p| format!("{} units at +{} µs", p.units, p.hi - s))
                    .collect();
                out.push(format!(
                    "invariant gcra-conformance: {key} under {name} ({} per {} µs, burst {}): \
                     {units} units started within {} µs ({}), at most {most} (refunds that \
                     may land there included)",
                    spec.limit,
                    spec.period,
                    spec.burst,
                    e - s,
                    starts.join(", ")
                ));
                return;
            }
        }
    }
}

/// At most the limit per window, by the window in which the requests run.
fn fixed_windows(
    key: &str,
    name: &str,
    spec: Spec,
    points: &[Point],
    refunds: &[(Micros, Micros, u32)],
    out: &mut Vec<String>,
) {
    let mut by_window: HashMap<u64, u64> = HashMap::new();
    for p in points {
        // Rule *straddling start*: on Redis a start known only to lie across a window's end
        // is not counted in either.
        let w = p.lo / spec.period;
        if p.hi / spec.period == w {
            *by_window.entry(w).or_default() += u64::from(p.units);
        }
    }
    let mut windows: Vec<_> = by_window.into_iter().collect();
    windows.sort_unstable();
    for (w, units) in windows {
        let (s, e) = (w * spec.period, (w + 1) * spec.period - 1);
        let most = u64::from(spec.limit) + refunds_in(refunds, s, e);
        if units > most {
            out.push(format!(
                "invariant window-conformance: {key} under {name} ({} per {} µs): {units} \
                 units ran in window {w}, at most {most} (refunds there included)",
                spec.limit, spec.period
            ));
        }
    }
}

/// Never more requests holding a key's slot in the handler than its slots, across
/// replicas; a one-at-a-time client never refused for its own slot.
fn concurrency(events: &[Ev], out: &mut Vec<String>) {
    // The handler counts a request from its entry to its body's drop; the slot is given
    // back after that, so the count never exceeds the slots the backend holds. A restart
    // without persistence forgets every slot (rule *epoch*).
    let mut inside: HashMap<String, u32> = HashMap::new();
    let mut holders: HashMap<u64, String> = HashMap::new();
    let mut reported = false;
    for ev in events {
        match ev {
            Ev::Forget => {
                inside.clear();
                holders.clear();
            }
            Ev::Start {
                id,
                key,
                sent,
                slot: true,
                lo,
                ..
            } => {
                let n = inside.entry(key.clone()).or_default();
                *n += 1;
                holders.insert(*id, key.clone());
                let most = sent.slots.unwrap_or(u32::MAX);
                if *n > most && !reported {
                    reported = true;
                    out.push(format!(
                        "invariant concurrency: {n} requests of {key} in the handler at \
                         {lo}, with {most} slots"
                    ));
                }
            }
            Ev::End { id, .. } => {
                if let Some(key) = holders.remove(id) {
                    if let Some(n) = inside.get_mut(&key) {
                        *n = n.saturating_sub(1);
                    }
                }
            }
            Ev::RefusedOwnSlot { key, at } => out.push(format!(
                "invariant own-slot: a client of {key} that waited for the end of its last \
                 response was refused for its full slots at {at}"
            )),
            _ => {}
        }
    }
}

/// Denied, blocked and denylisted keys never reach the handler before their end.
fn sanctions(events: &[Ev], lease_units: Option<u32>, out: &mut Vec<String>) {
    // Per key: its standing denies and blocks (from, until, units admitted meanwhile).
    let mut denies: HashMap<String, Vec<(Micros, Micros, u64)>> = HashMap::new();
    let mut blocks: HashMap<String, Vec<(Micros, Micros)>> = HashMap::new();
    for ev in events {
        match ev {
            Ev::Forget => {
                denies.clear();
                blocks.clear();
            }
            Ev::Deny {
                key,
                asked,
                from,
                until,
            } => {
                let list = denies.entry(key.clone()).or_default();
                for d in list.iter_mut() {
                    d.1 = d.1.min(*asked);
                }
                list.push((*from, *until, 0));
            }
            Ev::Undeny { key, at } => {
                for d in denies.entry(key.clone()).or_default() {
                    d.1 = d.1.min(*at);
                }
            }
            Ev::Block { key, from, until } => {
                blocks.entry(key.clone()).or_default().push((*from, *until));
            }
            Ev::Lift { key } => {
                blocks.remove(key);
            }
            Ev::Start {
                key,
                sent,
                hi,
                allowlisted,
                shadow,
                ..
            } => {
                // Rule *allowlist first*: the allowlist admits its keys whatever stands
                // against them.
                if *allowlisted {
                    continue;
                }
                // Rule *shadow*: a block is the rate limit's refusal, which a shadow one does
                // not make (a deny by hand still refuses).
                let blocks = if *shadow { None } else { blocks.get(key) };
                if sent.denylisted {
                    out.push(format!(
                        "invariant denylist: {key}, statically denylisted, reached the \
                         handler at {hi}"
                    ));
                }
                // Only requests sent once the sanction stood, and known to start before
                // its end.
                for d in denies.get_mut(key).into_iter().flatten() {
                    if sent.at >= d.0 && *hi < d.1 {
                        let units: u64 =
                            sent.rates.iter().map(|r| u64::from(r.2)).max().unwrap_or(1);
                        d.2 += units;
                        match lease_units {
                            // Rule *lease slice*: a slice another replica holds may admit
                            // a denied key until it runs out.
                            Some(most) if d.2 <= u64::from(most) => {}
                            _ => out.push(format!(
                                "invariant deny: {key}, denied by hand from {} to {}, \
                                 reached the handler at {hi}",
                                d.0, d.1
                            )),
                        }
                    }
                }
                for b in blocks.into_iter().flatten() {
                    if sent.at >= b.0 && *hi < b.1 {
                        out.push(format!(
                            "invariant block: {key}, blocked from {} to at least {}, \
                             reached the handler at {hi}",
                            b.0, b.1
                        ));
                    }
                }
            }
            _ => {}
        }
    }
}

/// Every key of the sequence's prefix in the Redis at `urls` (each a node of a cluster, or
/// the one server): its name and every value and member, searched for `identities`.
pub(crate) fn raw_in_redis(urls: &[String], prefix: &str, identities: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    // Per identity: where it was first seen, and how many keys hold it.
    let mut hits: Vec<(&str, String, String, u64)> = Vec::new();
    let ours = format!("{prefix}:");
    for url in urls {
        let Ok(client) = redis::Client::open(url.as_str()) else {
            out.push(format!("invariant raw-in-redis: cannot open {url}"));
            continue;
        };
        let Ok(mut conn) = client.get_connection() else {
            out.push(format!("invariant raw-in-redis: cannot reach {url}"));
            continue;
        };
        let mut cursor = 0u64;
        loop {
            let Ok((next, keys)): redis::RedisResult<(u64, Vec<Vec<u8>>)> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)
            else {
                out.push(format!("invariant raw-in-redis: SCAN failed on {url}"));
                break;
            };
            for key in keys.iter().filter(|k| k.starts_with(ours.as_bytes())) {
                let mut texts = vec![key.clone()];
                texts.extend(dump(&mut conn, key));
                for id in identities {
                    let Some(text) = texts.iter().find(|t| contains(t, id.as_bytes())) else {
                        continue;
                    };
                    match hits.iter_mut().find(|h| h.0 == *id) {
                        Some(hit) => hit.3 += 1,
                        None => hits.push((
                            id,
                            String::from_utf8_lossy(key).into_owned(),
                            String::from_utf8_lossy(text).into_owned(),
                            1,
                        )),
                    }
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    for (id, key, text, n) in hits {
        out.push(format!(
            "invariant raw-in-redis: the identity {id:?} is in {n} Redis key(s), first at key \
             {key:?}: {text:?}"
        ));
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Every value and member of `key`, whatever its type.
fn dump(conn: &mut redis::Connection, key: &[u8]) -> Vec<Vec<u8>> {
    let kind: String = redis::cmd("TYPE").arg(key).query(conn).unwrap_or_default();
    let read = |cmd: &mut redis::Cmd, conn: &mut redis::Connection| {
        cmd.query::<Vec<Vec<u8>>>(conn).unwrap_or_default()
    };
    match kind.as_str() {
        "string" => redis::cmd("GET")
            .arg(key)
            .query::<Option<Vec<u8>>>(conn)
            .ok()
            .flatten()
            .into_iter()
            .collect(),
        "hash" => read(redis::cmd("HGETALL").arg(key), conn),
        "set" => read(redis::cmd("SMEMBERS").arg(key), conn),
        "zset" => read(redis::cmd("ZRANGE").arg(key).arg(0).arg(-1), conn),
        "list" => read(redis::cmd("LRANGE").arg(key).arg(0).arg(-1), conn),
        other => vec![format!("<a {other} the scan cannot read>").into_bytes()],
    }
}

impl<B: tollgate_engine::Backend> super::Run<'_, B> {
    /// After quiescence: the allowlisted key was never counted, and on Redis each key whose
    /// whole usage the handler saw under one quota has what that usage leaves.
    pub(crate) async fn conservation(&mut self) {
        let generation = self.generation;
        let n_default = self.shape.defaults[generation % 2];
        if self.shape.allowlist && !self.trace.sanctioned(super::VIP) {
            // `Quota::per_day(n)`: a fresh key has n units, as burst or as window.
            let vip = self.replicas[0].layer.peek("rate", super::VIP).await.ok();
            if vip.map(|s| s.remaining) != Some(u64::from(n_default)) {
                self.fail(format!(
                    "invariant allowlist: the allowlisted key was counted: peek says {vip:?}, \
                     {n_default} units were never touched"
                ));
            }
        }
        // Rule *no drain*: the quotas are per day, so a GCRA key's level drains less than one
        // unit while less than an interval passes (on Redis a sequence lasts seconds; in
        // memory the limiter's clock may step by hours, and a key is judged only when less
        // than an interval passed since its first start).
        if !self.shape.exact() {
            return;
        }
        for key in super::KEYS {
            // Rule *shadowed*: a key once outside the enforced share was counted as a shadow
            // limit counts, which the handler does not see.
            // Rule *blocked*: a key blocked by a refusal of a waiter (which the trace does not
            // learn of) peeks 0 left until its block ends.
            if self.trace.sanctioned(key)
                || self.unjudged.contains(key)
                || self.model.standing(key).is_some()
            {
                continue;
            }
            let Some((spec, level, from, _)) = self.trace.level(key, "rate") else {
                continue;
            };
            let pro = self.shape.pro.filter(|n| *n == spec.limit);
            if spec.limit != n_default && pro.is_none() {
                continue;
            }
            let now = self.trace.now();
            let judged = if spec.gcra {
                now.saturating_sub(from) < spec.interval()
            } else {
                // Rule *one window*: a fixed window's count is its window's alone.
                from / spec.period == now / spec.period
            };
            if !judged {
                continue;
            }
            let want = u64::from(spec.burst).saturating_sub(level);
            let plan = pro.and(Some("pro")).filter(|_| spec.limit != n_default);
            let mut seen = None;
            for _ in 0..200 {
                seen = self.replicas[0]
                    .layer
                    .peek_plan("rate", plan, key)
                    .await
                    .ok()
                    .map(|s| s.remaining);
                if seen == Some(want) {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            if seen != Some(want) {
                self.fail(format!(
                    "invariant conservation: {key} (plan {plan:?}): the handler saw a level of \
                     {level} units net of refunds and charges, so {want} left; peek says {seen:?}"
                ));
            }
        }
    }
}
