//! One batch through [`Leased`]: local units first, then the inner backend's part (slices
//! asked for, asked again smaller when refused), then the slices its answer filled.

use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::bounds::MAX_CHECKS;
use crate::check::Check;
use crate::clock::{Clock, Micros};
use crate::counting::Algorithm;
use crate::lease::Lease;
use crate::limit::Limit;
use crate::quota::Quota;
use crate::verdict::{Status, Verdict};
use crate::verdicts::Verdicts;

use super::table::{leasable, GiveBack, Holding};
use super::{give_back, Leased, LeasedFuture, Shared, State};

/// Where one check of a batch is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// By the inner backend, as it is.
    Inner,
    /// From the slice in hand.
    Local,
    /// By the inner backend, for this many units: the cost, and a slice.
    Take(u32),
}

const NOT_CHECKED: Verdict = Verdict {
    status: Status::NotChecked,
    remaining: 0,
    reset: 0,
};

/// `checks` through `leased` (see the module docs of `leased`).
pub(super) fn check<B: Backend, C: Clock>(
    leased: &Leased<B, C>,
    checks: &[Check<'_>],
) -> LeasedFuture<B::Future> {
    let shared = &leased.shared;
    if checks.len() > MAX_CHECKS || shared.closed() || !checks.iter().any(|c| leasable(c).is_some())
    {
        return LeasedFuture {
            state: State::Inner(shared.backend.check(checks)),
        };
    }
    let t = shared.clock.now();
    let mut sources = [Source::Inner; MAX_CHECKS];
    let mut local = Verdicts::new();
    let mut back = Vec::new();
    {
        let mut table = shared.lock();
        table.sweep(t, &mut back);
        for (i, c) in checks.iter().enumerate() {
            let _ = local.push(NOT_CHECKED);
            let Some(lease) = leasable(c) else {
                continue;
            };
            let Some(entry) = table.entry(c, lease, t, &mut back) else {
                continue;
            };
            back.extend(entry.expire(t));
            if entry.slice.take(c.cost, t) {
                if entry.slice.units() == 0 {
                    entry.sizing.spent();
                }
                sources[i] = Source::Local;
                local.as_mut_slice()[i] = entry.local_verdict(t);
                local.set_receipt(i, entry.receipt);
                local.set_from_lease(i);
                continue;
            }
            if entry.taking {
                continue;
            }
            let units = entry.sizing.units(lease, entry.estimate(t), c.cost);
            if units > c.cost {
                entry.taking = true;
                sources[i] = Source::Take(units);
            }
        }
    }
    leased.give_back(&back);
    if sources[..checks.len()].iter().all(|s| *s == Source::Local) {
        return LeasedFuture::ready(Ok(local));
    }
    let batch = Batch {
        shared: Arc::clone(shared),
        owned: checks.iter().map(Owned::new).collect(),
        sources,
        armed: true,
    };
    LeasedFuture {
        state: State::Taking(Box::pin(batch.inner_part(local, t))),
    }
}

/// A check owned by the future of a leased batch (it may be asked again).
struct Owned {
    limit: Limit,
    key: Box<[u8]>,
    cost: u32,
    quota: Quota,
    enforce: bool,
    slot: u128,
    slice_of: u32,
    delay: Micros,
}

impl Owned {
    fn new(c: &Check<'_>) -> Self {
        Self {
            limit: c.limit.clone(),
            key: c.key.into(),
            cost: c.cost,
            quota: c.quota,
            enforce: c.enforce,
            slot: c.slot,
            slice_of: c.slice_of,
            delay: c.delay,
        }
    }

    fn check(&self) -> Check<'_> {
        Check {
            limit: &self.limit,
            key: &self.key,
            cost: self.cost,
            quota: self.quota,
            enforce: self.enforce,
            slot: self.slot,
            slice_of: self.slice_of,
            delay: self.delay,
        }
    }
}

/// A batch whose inner part is in flight: its local units are put back, and its takes ended,
/// if it is dropped before the answer.
struct Batch<B, C> {
    shared: Arc<Shared<B, C>>,
    owned: Vec<Owned>,
    sources: [Source; MAX_CHECKS],
    armed: bool,
}

impl<B, C> Batch<B, C> {
    /// Puts the local units back and ends the takes in flight.
    fn undo(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        let mut table = self.shared.lock();
        for (o, source) in self.owned.iter().zip(self.sources) {
            let Some(e) = table.get_mut(o.limit.name(), &o.key) else {
                continue;
            };
            match source {
                Source::Local => e.slice.put_back(o.cost),
                Source::Take(_) => e.taking = false,
                Source::Inner => {}
            }
        }
    }
}

impl<B, C> Drop for Batch<B, C> {
    fn drop(&mut self) {
        self.undo();
    }
}

impl<B: Backend, C: Clock> Batch<B, C> {
    /// The part of the batch that the inner backend answers; asked again (at most twice)
    /// when only a slice larger than what remains was refused.
    async fn inner_part(mut self, local: Verdicts, t: Micros) -> Result<Verdicts, BackendError> {
        let mut attempt = 0;
        loop {
            let idx: Vec<usize> = (0..self.owned.len())
                .filter(|&i| self.sources[i] != Source::Local)
                .collect();
            let asked = idx.iter().map(|&i| match self.sources[i] {
                // The slice's units are taken; the request's own cost goes with them.
                Source::Take(units) => Check {
                    cost: units,
                    slice_of: self.owned[i].cost,
                    ..self.owned[i].check()
                },
                _ => self.owned[i].check(),
            });
            let sub: Vec<Check<'_>> = asked.collect();
            let verdicts = match self.shared.backend.check(&sub).await {
                Ok(v) => v,
                Err(e) => {
                    self.undo();
                    return Err(e);
                }
            };
            if attempt < 2 && !verdicts.admits(&sub) && self.ask_again(&idx, &verdicts, attempt, t)
            {
                attempt += 1;
                continue;
            }
            return Ok(self.finish(local, &idx, &verdicts, t));
        }
    }

    /// Sizes the refused slices again, if nothing but slices refused (a refusal of the
    /// request's own is final): from what the refusal said remains, then (the second time)
    /// as the request's cost alone.
    fn ask_again(&mut self, idx: &[usize], verdicts: &Verdicts, attempt: u32, t: Micros) -> bool {
        let only_slices = idx.iter().zip(verdicts.iter()).all(|(&i, v)| {
            v.is_allowed() || !self.owned[i].enforce || matches!(self.sources[i], Source::Take(_))
        });
        if !only_slices {
            return false;
        }
        let mut table = self.shared.lock();
        for (&i, v) in idx.iter().zip(verdicts.iter()) {
            if !matches!(self.sources[i], Source::Take(_)) || v.is_allowed() {
                continue;
            }
            let o = &self.owned[i];
            let Some(e) = table.get_mut(o.limit.name(), &o.key) else {
                self.sources[i] = Source::Inner;
                continue;
            };
            e.saw(v, t);
            let units = e.sizing.units(&e.lease, v.remaining, o.cost);
            self.sources[i] = if attempt == 0 && units > o.cost {
                Source::Take(units)
            } else {
                e.taking = false;
                Source::Inner
            };
        }
        true
    }

    /// The batch's verdicts, and the slices that the inner backend's answer filled.
    fn finish(
        &mut self,
        local: Verdicts,
        idx: &[usize],
        answered: &Verdicts,
        t: Micros,
    ) -> Verdicts {
        self.armed = false;
        let asked: Vec<Check<'_>> = idx.iter().map(|&i| self.owned[i].check()).collect();
        let admitted = answered.admits(&asked);
        let mut out = local;
        let mut back = Vec::new();
        {
            let mut table = self.shared.lock();
            for (j, &i) in idx.iter().enumerate() {
                let mut verdict = answered[j];
                let receipt = answered.receipt(j);
                let at = if receipt.at > 0 { receipt.at } else { t };
                let check = self.owned[i].check();
                let entry = table.get_mut(check.limit.name(), check.key);
                match (self.sources[i], entry, check.limit.lease()) {
                    // The entry was replaced while the take was out (a reload under another
                    // quota or lease), or is gone (shut down): the take's slice is not the
                    // entry's, and goes back at once, as the entry it was taken for would give
                    // it back.
                    (Source::Take(units), e, Some(lease))
                        if e.as_ref().is_none_or(|e| !e.serves(&check)) =>
                    {
                        let mut take = Holding::new(&check, *lease);
                        let extra = units - check.cost;
                        if admitted && verdict.is_allowed() {
                            fill(&mut take, lease, extra, at, verdict.reset);
                            take.receipt = receipt;
                            back.extend(take.drain(at));
                        } else {
                            verdict = own_cost(take.algorithm(), &take.quota, verdict, extra);
                        }
                    }
                    (source, Some(e), _) => {
                        if leasable(&check).is_some() {
                            e.saw(&verdict, at);
                        }
                        if let Source::Take(units) = source {
                            e.taking = false;
                            let extra = units - check.cost;
                            if admitted && verdict.is_allowed() {
                                let lease = e.lease;
                                back.extend(fill(e, &lease, extra, at, verdict.reset));
                                e.receipt = receipt;
                                verdict.remaining =
                                    verdict.remaining.saturating_add(u64::from(extra));
                            } else {
                                verdict = own_cost(e.algorithm(), &e.quota, verdict, extra);
                            }
                        }
                    }
                    (_, None, _) => {}
                }
                out.as_mut_slice()[i] = verdict;
                out.set_receipt(i, receipt);
            }
            if !admitted {
                for (i, o) in self.owned.iter().enumerate() {
                    if self.sources[i] != Source::Local {
                        continue;
                    }
                    // Into the slice the units came from only: a slice taken since (another
                    // window's, another quota's) must not gain them.
                    if let Some(e) = table.get_mut(o.limit.name(), &o.key) {
                        if e.receipt == out.receipt(i) && e.quota == o.quota {
                            e.slice.put_back(o.cost);
                        }
                    }
                }
            }
        }
        give_back(&self.shared.backend, &back);
        out
    }
}

/// Replaces `e`'s slice with `extra` units taken at `at` (the inner backend's time), whose
/// answer said the quota is whole `reset` later: the earlier slice's units to give back,
/// under that slice's own pace (the receipt is still the earlier take's).
fn fill(e: &mut Holding, lease: &Lease, extra: u32, at: Micros, reset: Micros) -> Option<GiveBack> {
    let fresh = lease.slice(e.algorithm(), &e.quota, extra, at, reset);
    let horizon = e.slice.horizon();
    let old = e.slice.refill(fresh);
    e.give_back(old, horizon, at)
}

/// A refused slice's verdict, for the request's own cost: `extra` fewer units to wait for.
fn own_cost(algorithm: Algorithm, quota: &Quota, mut verdict: Verdict, extra: u32) -> Verdict {
    if let Status::Denied { retry_after } = verdict.status {
        let sooner = match algorithm {
            Algorithm::Gcra => quota.emission_interval().saturating_mul(u64::from(extra)),
            _ => 0,
        };
        verdict.status = Status::Denied {
            retry_after: retry_after.saturating_sub(sooner),
        };
    }
    verdict
}
