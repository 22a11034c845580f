//! The references: each algorithm written from its definition, by brute force where that is
//! clearer, without `tollgate_engine::algorithm`.
//!
//! - GCRA is ITU-T I.371's virtual scheduling: a cell arriving at `t` conforms iff
//!   `t ≥ TAT − L`, and then `TAT = max(TAT, t) + T`. A quota of `limit` per `period` has
//!   `T = period / limit` rounded down to whole microseconds (the documented rounding of
//!   `Quota::emission_interval`); a burst of `b` is `L = (b − 1) × T`, and a delay of `d`
//!   widens it to `L + d`. A request of `n` units is `n` cells at the same instant, admitted
//!   only if every one conforms. Every other figure (remaining, reset, retry-after, wait) is
//!   found by asking that question again, cell by cell and instant by instant.
//! - A fixed window is a count per window index `⌊t / period⌋` (windows aligned to the epoch).
//! - A sliding log is the list of the times of admitted units; a unit counts while
//!   `time + period > now`.
//!
//! The figures the engine reports by convention are taken from its documentation:
//! `remaining` is counted before the request when it is refused; a fixed window's `reset` is the
//! end of the current window (the `RateLimit` field's `t`); a sliding log's is when its newest
//! counted unit leaves.

use std::collections::BTreeMap;

use tollgate_engine::{Quota, Status, Verdict, MAX_PERIOD};

/// Microseconds.
pub(crate) type Micros = u64;

/// A GCRA quota as virtual scheduling sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gcra {
    /// The emission interval `T`.
    pub t: Micros,
    /// The burst `b`.
    pub burst: u32,
}

impl Gcra {
    /// `T = ⌊period / limit⌋` (whole microseconds, rounded down), `b` the quota's burst.
    pub(crate) fn of(q: &Quota) -> Self {
        Self {
            t: q.period_micros() / u64::from(q.limit()),
            burst: q.burst(),
        }
    }

    /// The limit `L` of a check with `delay`: `(b − 1) × T + delay`.
    fn limit(&self, delay: Micros) -> Micros {
        u64::from(self.burst - 1) * self.t + delay
    }

    /// `n` cells arriving at `at` one after another, each tested against `TAT − L`: the TAT
    /// after them if every one conforms.
    pub(crate) fn cells(&self, tat: Micros, at: Micros, n: u32, delay: Micros) -> Option<Micros> {
        let limit = self.limit(delay);
        let mut tat = tat;
        for _ in 0..n {
            if at + limit < tat {
                return None;
            }
            tat = tat.max(at) + self.t;
        }
        Some(tat)
    }

    /// How many more single cells would conform at `at` (without a delay), one after another.
    pub(crate) fn room(&self, tat: Micros, at: Micros) -> u64 {
        let mut tat = tat;
        let mut n = 0;
        while let Some(next) = self.cells(tat, at, 1, 0) {
            tat = next;
            n += 1;
        }
        n
    }

    /// The first instant at or after `from` at which a whole burst would conform.
    fn whole_at(&self, tat: Micros, from: Micros) -> Micros {
        first(from, |s| self.cells(tat, s, self.burst, 0).is_some())
    }

    /// What a check of `cost` units with `delay` at `now` answers on the stored `tat` (0 for a
    /// key never seen), and the TAT to store when it admits.
    pub(crate) fn check(&self, tat: Micros, now: Micros, cost: u32, delay: Micros) -> GcraAnswer {
        let before = self.room(tat, now);
        let reset_before = self.whole_at(tat, now) - now;
        if cost > self.burst {
            // Documented: more than the burst is refused as too costly, with or without a delay.
            return GcraAnswer::refused(Status::CostTooHigh, before, reset_before);
        }
        if self.cells(tat, now, cost, delay).is_none() {
            let at = first(now, |s| self.cells(tat, s, cost, delay).is_some());
            let status = Status::Denied {
                retry_after: at - now,
            };
            return GcraAnswer::refused(status, before, reset_before);
        }
        // The request is served at the first instant at which it conforms without a delay:
        // its cells arrive then.
        let served = first(now, |s| self.cells(tat, s, cost, 0).is_some());
        let after = self.cells(tat, served, cost, 0).unwrap_or(tat);
        GcraAnswer {
            verdict: Verdict::new(
                Status::Allowed,
                self.room(after, now),
                self.whole_at(after, now) - now,
            ),
            wait: served - now,
            tat: Some(after),
        }
    }

    /// A settle at `now` of a check that reserved `reserved` and should have cost `actual`
    /// (`Settlement`'s rustdoc): a refund moves the TAT back by its intervals but never
    /// before now; a charge moves it forward by its intervals, but never more than twice the
    /// burst's refill time ahead of now (and never back).
    pub(crate) fn settle(&self, tat: Micros, now: Micros, reserved: u32, actual: u32) -> Micros {
        if actual < reserved {
            let back = u64::from(reserved - actual) * self.t;
            return tat.saturating_sub(back).max(now);
        }
        let base = tat.max(now);
        let cap = now + 2 * u64::from(self.burst) * self.t;
        let forward = base + u64::from(actual - reserved) * self.t;
        base.max(forward.min(cap))
    }

    /// A pause of `micros` at `now` (`Backend::pause`): the next request of one unit conforms
    /// no sooner than `now + micros`, and then; a TAT already later stays.
    pub(crate) fn pause(&self, tat: Micros, now: Micros, micros: Micros) -> Micros {
        // The TAT at which one cell conforms at `now + micros` and at no earlier instant.
        let target = now + micros + self.limit(0);
        tat.max(target)
    }
}

/// What a GCRA check answers, per the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GcraAnswer {
    /// The verdict.
    pub verdict: Verdict,
    /// How long an admitted request waits for its time (0 when refused).
    pub wait: Micros,
    /// The TAT to store when admitted.
    pub tat: Option<Micros>,
}

impl GcraAnswer {
    fn refused(status: Status, remaining: u64, reset: Micros) -> Self {
        Self {
            verdict: Verdict::new(status, remaining, reset),
            wait: 0,
            tat: None,
        }
    }
}

/// The units a TAT stored under the interval `from` says the key has used at `now`, counted in
/// whole units (a part of a unit counts as one): the smallest `u` with `u × from ≥ TAT − now`.
pub(crate) fn used_units(tat: Micros, now: Micros, from: Micros) -> u64 {
    let ahead = tat.saturating_sub(now);
    let mut u = ahead / from;
    if u * from < ahead {
        u += 1;
    }
    u
}

/// The documented carry (`algorithm::gcra_carry`, docs/architecture.md): what the key used,
/// in units, is what it has used under the new interval `to`, at most `MAX_PERIOD` ahead. A
/// TAT in the past, or one under the same interval, stays as it is.
pub(crate) fn carry(tat: Micros, now: Micros, from: Micros, to: Micros) -> Micros {
    if tat <= now || from == to {
        return tat;
    }
    let max = u64::try_from(MAX_PERIOD.as_micros()).unwrap_or(u64::MAX);
    now + (used_units(tat, now, from) * to).min(max)
}

/// The first instant at or after `from` at which `ok` holds; `ok` must become true and stay
/// true from some instant on.
pub(crate) fn first(from: Micros, ok: impl Fn(Micros) -> bool) -> Micros {
    if ok(from) {
        return from;
    }
    let mut step = 1;
    while !ok(from + step) {
        step *= 2;
    }
    // ok(from + step) holds, ok(from + step / 2) does not (or step is 1).
    let (mut lo, mut hi) = (from + step / 2, from + step);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// Fixed windows: a count per window index.
#[derive(Debug, Clone, Default)]
pub(crate) struct Windows {
    /// Units counted per window index.
    pub counts: BTreeMap<u64, u64>,
}

impl Windows {
    /// A check of `cost` units at `now` under `limit` per `period`; counts it when admitted.
    pub(crate) fn check(&mut self, limit: u32, period: Micros, now: Micros, cost: u32) -> Verdict {
        let index = now / period;
        let count = self.counts.get(&index).copied().unwrap_or(0);
        let limit = u64::from(limit);
        let end = (index + 1) * period;
        let verdict = |status, remaining| Verdict::new(status, remaining, end - now);
        if u64::from(cost) > limit {
            return verdict(Status::CostTooHigh, limit.saturating_sub(count));
        }
        if count + u64::from(cost) > limit {
            // The first later instant whose window has room: windows ahead hold nothing yet,
            // but look anyway.
            let mut next = index + 1;
            while self.counts.get(&next).copied().unwrap_or(0) + u64::from(cost) > limit {
                next += 1;
            }
            let status = Status::Denied {
                retry_after: next * period - now,
            };
            return verdict(status, limit.saturating_sub(count));
        }
        self.counts.insert(index, count + u64::from(cost));
        verdict(Status::Allowed, limit - count - u64::from(cost))
    }
}

impl Windows {
    /// The settle at `now` of a check counted in the window that ends at `end`
    /// (`Settlement`'s rustdoc): nothing once that window has ended; otherwise a refund takes
    /// units back (never below 0) and a charge adds them, at most twice the limit at a time.
    pub(crate) fn settle(
        &mut self,
        limit: u32,
        period: Micros,
        now: Micros,
        end: Micros,
        reserved: u32,
        actual: u32,
    ) {
        if end <= now {
            return;
        }
        let count = self.counts.entry(end / period - 1).or_insert(0);
        if actual < reserved {
            *count = count.saturating_sub(u64::from(reserved - actual));
        } else {
            *count += u64::from(actual - reserved).min(2 * u64::from(limit));
        }
    }
}

/// A sliding log: the times of the admitted units.
#[derive(Debug, Clone, Default)]
pub(crate) struct Log {
    /// One time per admitted unit.
    pub units: Vec<Micros>,
}

impl Log {
    /// The units that count at `now` under `period`.
    pub(crate) fn alive(&self, period: Micros, now: Micros) -> u64 {
        self.units.iter().filter(|&&t| t + period > now).count() as u64
    }

    /// A check of `cost` units at `now` under `limit` per `period`; records them when admitted.
    pub(crate) fn check(&mut self, limit: u32, period: Micros, now: Micros, cost: u32) -> Verdict {
        let alive = self.alive(period, now);
        let limit = u64::from(limit);
        let newest = self.units.iter().filter(|&&t| t + period > now).max();
        let reset = newest.map_or(0, |&t| t + period - now);
        let refused = |status| Verdict::new(status, limit.saturating_sub(alive), reset);
        if u64::from(cost) > limit {
            return refused(Status::CostTooHigh);
        }
        if alive + u64::from(cost) > limit {
            // The first instant at which enough units have left: some unit's time + period.
            let at = self
                .units
                .iter()
                .map(|&t| t + period)
                .filter(|&at| at > now && self.alive(period, at) + u64::from(cost) <= limit)
                .min()
                .unwrap_or(now);
            return refused(Status::Denied {
                retry_after: at - now,
            });
        }
        self.units.extend(std::iter::repeat_n(now, cost as usize));
        Verdict::new(
            Status::Allowed,
            limit - alive - u64::from(cost),
            if cost > 0 { period } else { reset },
        )
    }
}

impl Log {
    /// The settle at `now` of a check that recorded its units at `at` (`Settlement`'s
    /// rustdoc): a refund removes refunded units among those the check recorded; a charge
    /// records its units at `now`, the log holding at most twice the limit.
    pub(crate) fn settle(
        &mut self,
        limit: u32,
        period: Micros,
        now: Micros,
        at: Micros,
        reserved: u32,
        actual: u32,
    ) {
        if actual < reserved {
            let mut back = reserved - actual;
            self.units.retain(|&t| {
                let theirs = t == at && back > 0;
                back -= u32::from(theirs);
                !theirs
            });
            return;
        }
        let room = (2 * u64::from(limit)).saturating_sub(self.alive(period, now));
        let more = u64::from(actual - reserved).min(room);
        self.units.extend(std::iter::repeat_n(now, more as usize));
    }
}
