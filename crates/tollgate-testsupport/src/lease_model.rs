//! A model of quota leases: Redis' state for one limit in process (the arithmetic of
//! `tollgate_core::algorithm`, which the Redis scripts are held to by the shared vectors), and
//! replicas that take, spend and give back slices the way the Redis backend does, one request
//! at a time, with `tollgate_core`'s own [`Lease`] and [`Slice`].
//!
//! The accuracy simulation (`lease-sim`) runs it at scale; a test replays one trace against a
//! real Redis and checks that the backend answers exactly as the model does.

use std::collections::HashMap;

use tollgate_core::algorithm::{self, WindowState};
use tollgate_core::{Algorithm, Lease, Limit, Micros, Quota, Sizing, Slice, Status, Verdict};

/// Redis' state of one limit's keys.
#[derive(Debug)]
pub struct RedisModel {
    algorithm: Algorithm,
    quota: Quota,
    gcra: HashMap<Vec<u8>, Micros>,
    windows: HashMap<Vec<u8>, WindowState>,
    /// Calls made (`CHECK` and `SETTLE`).
    pub calls: u64,
}

impl RedisModel {
    /// Redis with nothing stored, for `limit` (GCRA or a fixed window).
    pub fn new(limit: &Limit) -> Self {
        Self {
            algorithm: limit.algorithm(),
            quota: *limit.quota(),
            gcra: HashMap::new(),
            windows: HashMap::new(),
            calls: 0,
        }
    }

    /// One `CHECK` of `cost` units at `now`: consumed if admitted.
    pub fn check(&mut self, key: &[u8], cost: u32, now: Micros) -> Verdict {
        self.calls += 1;
        match self.algorithm {
            Algorithm::Gcra => {
                let (v, tat) = algorithm::gcra(&self.quota, self.gcra.get(key).copied(), now, cost);
                if let Some(tat) = tat {
                    self.gcra.insert(key.to_vec(), tat);
                }
                v
            }
            _ => {
                let (v, state) =
                    algorithm::fixed_window(&self.quota, self.windows.get(key).copied(), now, cost);
                if let Some(state) = state {
                    self.windows.insert(key.to_vec(), state);
                }
                v
            }
        }
    }

    /// A refund of `units` taken in the window that ends at `window_end` (fixed windows), as
    /// `SETTLE` does it at `now`; a GCRA refund only while the TAT is `only_at` (if above 0).
    fn refund(&mut self, key: &[u8], units: u32, window_end: Micros, only_at: Micros, now: Micros) {
        match self.algorithm {
            Algorithm::Gcra => {
                let tat = self.gcra.get(key).copied();
                if only_at > 0 && tat != Some(only_at) {
                    return;
                }
                if let Some(tat) = algorithm::gcra_settle(&self.quota, tat, now, units, 0) {
                    self.gcra.insert(key.to_vec(), tat);
                }
            }
            _ => {
                let state = self.windows.get(key).copied();
                if let Some(s) = algorithm::fixed_window_settle(state, window_end, units, 0) {
                    self.windows.insert(key.to_vec(), s);
                }
            }
        }
    }

    /// One `SETTLE` call of every give-back in `back`, if any.
    fn give_back(&mut self, back: &[GiveBack], now: Micros) {
        if back.is_empty() {
            return;
        }
        self.calls += 1;
        for g in back {
            self.refund(&g.key, g.units, g.mark, g.only_at, now);
        }
    }
}

/// Units a replica gives back: key, units, the end of their window, the TAT they require.
struct GiveBack {
    key: Vec<u8>,
    units: u32,
    mark: Micros,
    only_at: Micros,
}

/// One request's answer from a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// Admitted.
    pub allowed: bool,
    /// Admitted from a slice this replica held.
    pub from_lease: bool,
    /// Units left, as the answer says.
    pub remaining: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    slice: Slice,
    sizing: Sizing,
    /// The end of the window the slice was taken in (fixed windows).
    mark: Micros,
    seen_at: Micros,
    seen_remaining: u64,
    seen_reset: Micros,
}

/// One replica's slices of one limit, and the rules by which it takes and gives them back.
#[derive(Debug)]
pub struct ReplicaModel {
    algorithm: Algorithm,
    quota: Quota,
    lease: Option<Lease>,
    entries: HashMap<Vec<u8>, Entry>,
    next_sweep: Micros,
    closed: bool,
    taken: u64,
}

impl ReplicaModel {
    /// Units taken into slices so far, beyond the cost of the requests that took them.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// A replica checking `limit` (leased if the limit has a lease).
    pub fn new(limit: &Limit) -> Self {
        Self {
            algorithm: limit.algorithm(),
            quota: *limit.quota(),
            lease: limit.lease().copied(),
            entries: HashMap::new(),
            next_sweep: 0,
            closed: false,
            taken: 0,
        }
    }

    fn full(&self) -> u64 {
        match self.algorithm {
            Algorithm::Gcra => u64::from(self.quota.burst()),
            _ => u64::from(self.quota.limit()),
        }
    }

    fn estimate(&self, e: &Entry, now: Micros) -> u64 {
        let full = self.full();
        if e.seen_at == 0 {
            return full;
        }
        match self.algorithm {
            Algorithm::FixedWindow => {
                if algorithm::window_index(&self.quota, now)
                    == algorithm::window_index(&self.quota, e.seen_at)
                {
                    e.seen_remaining
                } else {
                    full
                }
            }
            _ => {
                let refilled = now.saturating_sub(e.seen_at) / self.quota.emission_interval();
                e.seen_remaining.saturating_add(refilled).min(full)
            }
        }
    }

    fn counted(&self, mark: Micros, now: Micros) -> bool {
        self.algorithm != Algorithm::FixedWindow || now < mark
    }

    /// Units held in slices now.
    pub fn held(&self) -> u64 {
        self.entries
            .values()
            .map(|e| u64::from(e.slice.units()))
            .sum()
    }

    /// Units held in slices that can still be used at `now`.
    pub fn live(&self, now: Micros) -> u64 {
        self.entries
            .values()
            .filter(|e| e.slice.live(now))
            .map(|e| u64::from(e.slice.units()))
            .sum()
    }

    fn sweep(&mut self, now: Micros, back: &mut Vec<GiveBack>) {
        let Some(lease) = self.lease else { return };
        if now < self.next_sweep {
            return;
        }
        let life = lease.lifetime().as_micros() as Micros;
        let shortest = if self.entries.is_empty() {
            Lease::DEFAULT_LIFETIME.as_micros() as Micros
        } else {
            (Lease::DEFAULT_LIFETIME.as_micros() as Micros).min(life)
        };
        let fixed = self.algorithm == Algorithm::FixedWindow;
        self.entries.retain(|key, e| {
            let units = e.slice.expire(now);
            if units > 0 {
                e.sizing.wasted();
            }
            if units > 0 && (!fixed || now < e.mark) {
                back.push(GiveBack {
                    key: key.clone(),
                    units,
                    mark: e.mark,
                    only_at: e.slice.horizon(),
                });
            }
            e.seen_at.saturating_add(10 * life) > now
        });
        self.next_sweep = now.saturating_add(shortest);
    }

    /// Checks one request of `cost` for `key` at `now` against `redis`.
    pub fn check(&mut self, redis: &mut RedisModel, key: &[u8], cost: u32, now: Micros) -> Answer {
        let lease = match self.lease {
            Some(l) if !self.closed && cost > 0 => l,
            _ => {
                let v = redis.check(key, cost, now);
                return answer(&v, false);
            }
        };
        let mut back = Vec::new();
        self.sweep(now, &mut back);
        let full = self.full();
        let e = self.entries.entry(key.to_vec()).or_insert(Entry {
            slice: Slice::default(),
            sizing: Sizing::default(),
            mark: 0,
            seen_at: 0,
            seen_remaining: full,
            seen_reset: 0,
        });
        let expired = e.slice.expire(now);
        if expired > 0 {
            e.sizing.wasted();
        }
        let (mark, horizon, took) = (e.mark, e.slice.horizon(), e.slice.take(cost, now));
        if took && e.slice.units() == 0 {
            e.sizing.spent();
        }
        if expired > 0 && (self.algorithm != Algorithm::FixedWindow || now < mark) {
            back.push(GiveBack {
                key: key.to_vec(),
                units: expired,
                mark,
                only_at: horizon,
            });
        }
        let e = self.entries.get(key).cloned();
        let Some(e) = e else {
            return answer(&redis.check(key, cost, now), false);
        };
        if took {
            redis.give_back(&back, now);
            let remaining = u64::from(e.slice.units()).saturating_add(self.estimate(&e, now));
            return Answer {
                allowed: true,
                from_lease: true,
                remaining,
            };
        }
        redis.give_back(&back, now);
        let mut units = e.sizing.units(&lease, self.estimate(&e, now), cost);
        for attempt in 0..3 {
            let v = redis.check(key, units, now);
            let slice = units > cost;
            if !v.is_allowed() && slice && attempt < 2 {
                let entry = self.entries.get_mut(key).expect("entry present");
                see(entry, &v, now);
                let again = entry.sizing.units(&lease, v.remaining, cost);
                units = if attempt == 0 && again > cost {
                    again
                } else {
                    cost
                };
                continue;
            }
            let quota = self.quota;
            let algorithm = self.algorithm;
            let counted_old;
            let entry = self.entries.get_mut(key).expect("entry present");
            see(entry, &v, now);
            if !slice {
                return answer(&v, false);
            }
            let extra = units - cost;
            if v.is_allowed() {
                let fresh = lease.slice(algorithm, &quota, extra, now, v.reset);
                let old_mark = entry.mark;
                let old_horizon = entry.slice.horizon();
                let old = entry.slice.refill(fresh);
                self.taken += u64::from(extra);
                entry.mark = algorithm::window_end(&quota, now);
                counted_old = (old, old_mark, old_horizon);
                let remaining = v.remaining.saturating_add(u64::from(extra));
                if counted_old.0 > 0 && self.counted(counted_old.1, now) {
                    let g = GiveBack {
                        key: key.to_vec(),
                        units: counted_old.0,
                        mark: counted_old.1,
                        only_at: counted_old.2,
                    };
                    redis.give_back(&[g], now);
                }
                return Answer {
                    allowed: true,
                    from_lease: false,
                    remaining,
                };
            }
            return answer(&v, false);
        }
        unreachable!("the third attempt always answers")
    }

    /// Gives every slice back at `now` (one call) and takes no more.
    pub fn shutdown(&mut self, redis: &mut RedisModel, now: Micros) {
        self.closed = true;
        let fixed = self.algorithm == Algorithm::FixedWindow;
        let back: Vec<_> = self
            .entries
            .iter_mut()
            .filter_map(|(k, e)| {
                let units = e.slice.drain();
                (units > 0 && (!fixed || now < e.mark)).then(|| GiveBack {
                    key: k.clone(),
                    units,
                    mark: e.mark,
                    only_at: e.slice.horizon(),
                })
            })
            .collect();
        self.entries.clear();
        redis.give_back(&back, now);
    }
}

fn see(e: &mut Entry, v: &Verdict, now: Micros) {
    e.seen_at = now;
    e.seen_remaining = v.remaining;
    e.seen_reset = v.reset;
}

fn answer(v: &Verdict, from_lease: bool) -> Answer {
    Answer {
        allowed: v.status == Status::Allowed,
        from_lease,
        remaining: v.remaining,
    }
}
