//! The slices one [`Leased`](super::Leased) holds: by limit name, then by key, each with
//! the figures to size the next one, and what goes back to the inner backend when a slice
//! ends.

use std::collections::HashMap;
use std::sync::Arc;

use crate::algorithm;
use crate::check::{Check, Receipt, Settlement};
use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::lease::{Lease, Sizing, Slice};
use crate::limit::Limit;
use crate::quota::Quota;
use crate::sip::BytesKeyed;
use crate::verdict::{Status, Verdict};

/// Keys with a slice (or the figures to size one) that one `Leased` keeps, at most. Past
/// that, new keys are checked without a lease.
pub(super) const MAX_LEASED_KEYS: usize = 10_000;

/// One leased limit's keys, hashed in one pass (a leased hot key is looked up on every
/// check).
type Keys = HashMap<Box<[u8]>, Holding, BytesKeyed>;

/// Slices by limit name (a short list: few limits are leased), then by key: exact keys, so
/// that no two keys ever share a slice.
#[derive(Default)]
pub(super) struct Table {
    limits: Vec<(Arc<str>, Keys)>,
    /// Entries over every limit.
    count: usize,
    /// When expired slices are next looked for among keys nobody checks.
    next_sweep: Micros,
}

/// One leased key.
pub(super) struct Holding {
    limit: Limit,
    key: Box<[u8]>,
    pub(super) lease: Lease,
    pub(super) quota: Quota,
    pub(super) slice: Slice,
    /// Where the slice's units went in the inner backend, for their give-back.
    pub(super) receipt: Receipt,
    /// A check of this key asks the inner backend for a slice now.
    pub(super) taking: bool,
    /// How large the next slice is, from how the last ones ended.
    pub(super) sizing: Sizing,
    /// The inner backend's figures as last seen: when (its time), units left, time until full.
    seen_at: Micros,
    seen_remaining: u64,
    seen_reset: Micros,
}

/// Units to give back to the inner backend: a refund of `units` under the quota the slice
/// was taken under.
pub(super) struct GiveBack {
    limit: Limit,
    key: Box<[u8]>,
    units: u32,
    receipt: Receipt,
    quota: Quota,
    /// GCRA: the TAT the slice's take left; the refund applies only while it is still the
    /// key's. Other replicas' slices are paced by the TATs of their takes, which count these
    /// units: once anything moved the TAT on, taking them back could let those slices run
    /// ahead of the quota's rate. The units then come back as the TAT refills.
    only_at: Micros,
}

impl GiveBack {
    /// The refund as a settle: a GCRA one guarded by its TAT alone (a receipt with no time,
    /// see [`Receipt`]).
    pub(super) fn settlement(&self) -> Settlement<'_> {
        let receipt = match self.limit.algorithm() {
            Algorithm::Gcra => Receipt::guarded(self.only_at),
            _ => self.receipt,
        };
        Settlement {
            limit: &self.limit,
            key: &self.key,
            reserved: self.units,
            actual: 0,
            receipt,
            quota: self.quota,
        }
    }
}

impl Holding {
    pub(super) fn new(c: &Check<'_>, lease: Lease) -> Self {
        Self {
            limit: c.limit.clone(),
            key: c.key.into(),
            lease,
            quota: c.quota,
            slice: Slice::default(),
            receipt: Receipt::default(),
            taking: false,
            sizing: Sizing::default(),
            seen_at: 0,
            seen_remaining: full(c.limit.algorithm(), &c.quota),
            seen_reset: 0,
        }
    }

    pub(super) fn algorithm(&self) -> Algorithm {
        self.limit.algorithm()
    }

    /// Whether this entry's slices are `c`'s: taken under its quota and lease (a reload can
    /// change either).
    pub(super) fn serves(&self, c: &Check<'_>) -> bool {
        self.quota == c.quota && c.limit.lease() == Some(&self.lease)
    }

    /// The units the inner backend likely has left at `now`, from what it said last.
    pub(super) fn estimate(&self, now: Micros) -> u64 {
        let full = full(self.algorithm(), &self.quota);
        if self.seen_at == 0 {
            return full;
        }
        match self.algorithm() {
            Algorithm::FixedWindow => {
                if algorithm::window_index(&self.quota, now)
                    == algorithm::window_index(&self.quota, self.seen_at)
                {
                    self.seen_remaining
                } else {
                    full
                }
            }
            _ => {
                let refilled = now.saturating_sub(self.seen_at) / self.quota.emission_interval();
                self.seen_remaining.saturating_add(refilled).min(full)
            }
        }
    }

    pub(super) fn saw(&mut self, verdict: &Verdict, at: Micros) {
        self.seen_at = at;
        self.seen_remaining = verdict.remaining;
        self.seen_reset = verdict.reset;
    }

    /// The answer to a check admitted from the slice at `now`.
    pub(super) fn local_verdict(&self, now: Micros) -> Verdict {
        Verdict {
            status: Status::Allowed,
            remaining: u64::from(self.slice.units()).saturating_add(self.estimate(now)),
            reset: self
                .seen_at
                .saturating_add(self.seen_reset)
                .saturating_sub(now),
        }
    }

    /// `units` of a slice paced by `only_at` (0: none) to give back at `now`, if the inner
    /// backend still counts them.
    pub(super) fn give_back(&self, units: u32, only_at: Micros, now: Micros) -> Option<GiveBack> {
        // A fixed window's units end with their window: nothing to give back after it.
        let counted = match self.algorithm() {
            Algorithm::FixedWindow => now < self.receipt.window_end(),
            _ => true,
        };
        (units > 0 && counted).then(|| GiveBack {
            limit: self.limit.clone(),
            key: self.key.clone(),
            units,
            receipt: self.receipt,
            quota: self.quota,
            only_at,
        })
    }

    /// Empties the slice: what to give back at `now`.
    pub(super) fn drain(&mut self, now: Micros) -> Option<GiveBack> {
        let only_at = self.slice.horizon();
        let units = self.slice.drain();
        self.give_back(units, only_at, now)
    }

    /// Ends the slice if it is no longer live at `now` (a slice that ends with units left
    /// makes the next ones smaller): what to give back.
    pub(super) fn expire(&mut self, now: Micros) -> Option<GiveBack> {
        let only_at = self.slice.horizon();
        let units = self.slice.expire(now);
        if units > 0 {
            self.sizing.wasted();
        }
        self.give_back(units, only_at, now)
    }
}

/// A quota's units when nothing is used: a GCRA burst, a window's limit.
fn full(algorithm: Algorithm, quota: &Quota) -> u64 {
    match algorithm {
        Algorithm::Gcra => u64::from(quota.burst()),
        _ => u64::from(quota.limit()),
    }
}

/// `c`'s lease, if it may be answered from a slice: an enforced check of a cost, under its
/// limit's default quota (a plan's quota is checked as without a lease), without a delay (a
/// delayed check reserves a time beyond the burst, which no slice holds: it goes to the inner
/// backend as it is).
pub(super) fn leasable<'a>(c: &Check<'a>) -> Option<&'a Lease> {
    let lease = c.limit.lease()?;
    (c.enforce
        && c.cost > 0
        && c.delay == 0
        && Lease::supports(c.limit.algorithm())
        && c.quota == *c.limit.quota())
    .then_some(lease)
}

impl Table {
    /// Units held in slices now, over every key.
    pub(super) fn held(&self) -> u64 {
        self.limits
            .iter()
            .flat_map(|(_, keys)| keys.values())
            .map(|e| u64::from(e.slice.units()))
            .sum()
    }

    /// Empties every slice and forgets every key: what to give back at `now`.
    pub(super) fn drain(&mut self, now: Micros) -> Vec<GiveBack> {
        let back = self
            .limits
            .iter_mut()
            .flat_map(|(_, keys)| keys.values_mut())
            .filter_map(|e| e.drain(now))
            .collect();
        self.limits.clear();
        self.count = 0;
        back
    }

    /// `c`'s entry, made if there is room (`None` otherwise); a changed quota or lease starts
    /// afresh, its old slice given back.
    pub(super) fn entry(
        &mut self,
        c: &Check<'_>,
        lease: &Lease,
        now: Micros,
        back: &mut Vec<GiveBack>,
    ) -> Option<&mut Holding> {
        let room = self.count < MAX_LEASED_KEYS;
        let at = match self.limits.iter().position(|(n, _)| **n == *c.limit.name()) {
            Some(at) => at,
            None if room => {
                self.limits.push((
                    Arc::clone(c.limit.name_arc()),
                    HashMap::with_hasher(BytesKeyed::random()),
                ));
                self.limits.len() - 1
            }
            None => return None,
        };
        let keys = &mut self.limits[at].1;
        if !keys.contains_key(c.key) {
            if !room {
                return None;
            }
            keys.insert(c.key.into(), Holding::new(c, *lease));
            self.count += 1;
        }
        let e = keys.get_mut(c.key)?;
        if !e.serves(c) {
            // The limit was reloaded under another quota or lease.
            back.extend(e.drain(now));
            *e = Holding::new(c, *lease);
        }
        Some(e)
    }

    pub(super) fn get_mut(&mut self, name: &str, key: &[u8]) -> Option<&mut Holding> {
        self.limits
            .iter_mut()
            .find(|(n, _)| **n == *name)?
            .1
            .get_mut(key)
    }

    /// Gives back expired slices of keys nobody checked since, once per lifetime at most, and
    /// forgets keys idle for ten lifetimes (so that the table has room for new ones).
    pub(super) fn sweep(&mut self, now: Micros, back: &mut Vec<GiveBack>) {
        if now < self.next_sweep {
            return;
        }
        let mut shortest = Lease::DEFAULT_LIFETIME.as_micros() as Micros;
        let mut count = 0;
        self.limits.retain_mut(|(_, keys)| {
            keys.retain(|_, e| {
                let life = e.lease.lifetime().as_micros() as Micros;
                shortest = shortest.min(life);
                back.extend(e.expire(now));
                e.taking || e.seen_at.saturating_add(10 * life) > now
            });
            count += keys.len();
            !keys.is_empty()
        });
        self.count = count;
        self.next_sweep = now.saturating_add(shortest);
    }
}
