//! Quota leases on Redis: a slice of a leased limit's quota taken in one `CHECK` (the
//! request's cost and more) and admitted from locally, given back with a `SETTLE` refund when
//! it expires and at shutdown.
//!
//! The rules (slice sizes, expiry, what a replica holds) are [`tollgate_core::Lease`]'s and
//! [`tollgate_core::Slice`]'s; this module keeps the slices of one backend and runs them
//! against Redis:
//!
//! - A leased check (enforced, under its limit's default quota) is answered from the slice in
//!   hand when it holds the cost, before the deny cache and without I/O, also while Redis is
//!   down or the breaker open. Otherwise the batch goes to Redis, and one leased check per key
//!   at a time asks for a slice instead of its cost; concurrent ones are checked as usual.
//! - A batch that mixes slices and Redis stays all-or-nothing: the local units are taken
//!   first and put back when Redis refuses or fails, or when the caller gives up.
//! - A slice refused because it was larger than what remains (other replicas took it) is
//!   asked again, sized from what Redis said remains, then as the request's cost alone: a
//!   refusal is only ever the request's own.
//! - The deny cache learns nothing from a slice's answer (its cost is not the request's);
//!   a request the slice can serve never reaches it, and a give-back drops its key's denial.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tollgate_core::{
    algorithm, Algorithm, BackendError, Check, Lease, Limit, Micros, Quota, Receipt, Settlement,
    Sizing, Slice, Status, Verdict, Verdicts, MAX_CHECKS,
};

use crate::backend::{Inner, RedisBackend, BACKEND};
use crate::future::ResponseFuture;

/// Keys with a slice (or the figures to size one) that one backend keeps, at most. Past that,
/// new keys are checked without a lease.
pub(crate) const MAX_LEASED_KEYS: usize = 10_000;

/// The slices of one backend.
#[derive(Default)]
pub(crate) struct Leases {
    table: Mutex<Table>,
    /// Set by shutdown: no slice is taken any more.
    closed: AtomicBool,
}

/// One leased limit's keys.
type Keys = HashMap<Box<[u8]>, Entry>;

/// Slices by limit name (a short list: few limits are leased), then by key: exact keys, so
/// that no two keys ever share a slice (the Redis digest would cost a SHA-256 per request;
/// std's keyed hash costs a fraction of it).
#[derive(Default)]
struct Table {
    limits: Vec<(Arc<str>, Keys)>,
    /// Entries over every limit.
    count: usize,
    /// When expired slices are next looked for among keys nobody checks.
    next_sweep: Micros,
}

/// One leased key.
struct Entry {
    limit: Limit,
    key: Box<[u8]>,
    lease: Lease,
    quota: Quota,
    slice: Slice,
    /// Where the slice's units went in Redis, for their give-back.
    receipt: Receipt,
    /// A check of this key asks Redis for a slice now.
    taking: bool,
    /// How large the next slice is, from how the last ones ended.
    sizing: Sizing,
    /// Redis' figures as last seen: when (server time), units left, time until full.
    seen_at: Micros,
    seen_remaining: u64,
    seen_reset: Micros,
}

/// Units to give back to Redis.
pub(crate) struct GiveBack {
    limit: Limit,
    key: Box<[u8]>,
    units: u32,
    receipt: Receipt,
    /// The quota the slice was taken under.
    quota: Quota,
    /// GCRA: the TAT the slice's take left; the refund applies only while it is still the
    /// key's. Other replicas' slices are paced by the TATs of their takes, which count these
    /// units: once anything moved the TAT on, taking them back could let those slices run
    /// ahead of the quota's rate. The units then come back as the TAT refills.
    only_at: Micros,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Checked in Redis as it is.
    Redis,
    /// Taken from the slice in hand.
    Local,
    /// Asks Redis for this many units: the cost, and a slice.
    Slice(u32),
}

impl Entry {
    fn new(c: &Check<'_>, lease: Lease) -> Self {
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

    fn algorithm(&self) -> Algorithm {
        self.limit.algorithm()
    }

    /// Whether this entry's slices are `c`'s: taken under its quota and lease (a reload can
    /// change either).
    fn serves(&self, c: &Check<'_>) -> bool {
        self.quota == c.quota && c.limit.lease() == Some(&self.lease)
    }

    /// The units Redis likely has left at `now`, from what it said last.
    fn estimate(&self, now: Micros) -> u64 {
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

    fn saw(&mut self, verdict: &Verdict, at: Micros) {
        self.seen_at = at;
        self.seen_remaining = verdict.remaining;
        self.seen_reset = verdict.reset;
    }

    /// The answer to a check admitted from the slice at `now`.
    fn local_verdict(&self, now: Micros) -> Verdict {
        Verdict {
            status: Status::Allowed,
            remaining: u64::from(self.slice.units()).saturating_add(self.estimate(now)),
            reset: self
                .seen_at
                .saturating_add(self.seen_reset)
                .saturating_sub(now),
        }
    }

    /// The slice's units to give back at `now` (`units` of them, drained from `self.slice`),
    /// if Redis still counts them.
    fn give_back(&self, units: u32, now: Micros) -> Option<GiveBack> {
        // A fixed window's units end with their window: nothing to give back after it.
        let counted = match self.algorithm() {
            Algorithm::FixedWindow => now < self.receipt.mark,
            _ => true,
        };
        (units > 0 && counted).then(|| GiveBack {
            limit: self.limit.clone(),
            key: self.key.clone(),
            units,
            receipt: self.receipt,
            quota: self.quota,
            only_at: self.slice.horizon(),
        })
    }
}

/// A quota's units when nothing is used: a GCRA burst, a window's limit.
fn full(algorithm: Algorithm, quota: &Quota) -> u64 {
    match algorithm {
        Algorithm::Gcra => u64::from(quota.burst()),
        _ => u64::from(quota.limit()),
    }
}

/// `c`'s lease, if it may be answered from a slice.
fn leasable<'a>(c: &Check<'a>) -> Option<&'a Lease> {
    let lease = c.limit.lease()?;
    (c.enforce && c.cost > 0 && Lease::supports(c.limit.algorithm()) && c.quota == *c.limit.quota())
        .then_some(lease)
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Units held in slices now, over every key.
    pub(crate) fn held(&self) -> u64 {
        self.lock()
            .limits
            .iter()
            .flat_map(|(_, keys)| keys.values())
            .map(|e| u64::from(e.slice.units()))
            .sum()
    }

    /// Empties `limit`'s slice of `key` without giving it back: the key was reset in Redis,
    /// whose new state knows nothing of the units, so admitting them would be over the quota.
    pub(crate) fn forget(&self, limit: &str, key: &[u8]) {
        if let Some(e) = self.lock().get_mut(limit, key) {
            e.slice.drain();
        }
    }

    /// Empties every slice and closes: what to give back.
    fn drain(&self, now: Micros) -> Vec<GiveBack> {
        self.closed.store(true, Ordering::Relaxed);
        let mut table = self.lock();
        let mut back = Vec::new();
        for e in table
            .limits
            .iter_mut()
            .flat_map(|(_, keys)| keys.values_mut())
        {
            let units = e.slice.drain();
            back.extend(e.give_back(units, now));
        }
        table.limits.clear();
        table.count = 0;
        back
    }
}

impl Table {
    /// `c`'s entry, made if there is room (`None` otherwise); a changed quota or lease starts
    /// afresh, its old slice given back.
    fn entry(
        &mut self,
        c: &Check<'_>,
        lease: &Lease,
        t: Micros,
        back: &mut Vec<GiveBack>,
    ) -> Option<&mut Entry> {
        let room = self.count < MAX_LEASED_KEYS;
        let at = match self.limits.iter().position(|(n, _)| **n == *c.limit.name()) {
            Some(at) => at,
            None if room => {
                self.limits
                    .push((Arc::clone(c.limit.name_arc()), HashMap::new()));
                self.limits.len() - 1
            }
            None => return None,
        };
        let keys = &mut self.limits[at].1;
        if !keys.contains_key(c.key) {
            if !room {
                return None;
            }
            keys.insert(c.key.into(), Entry::new(c, *lease));
            self.count += 1;
        }
        let e = keys.get_mut(c.key)?;
        if !e.serves(c) {
            // The limit was reloaded under another quota or lease.
            let units = e.slice.drain();
            back.extend(e.give_back(units, t));
            *e = Entry::new(c, *lease);
        }
        Some(e)
    }

    fn get_mut(&mut self, name: &str, key: &[u8]) -> Option<&mut Entry> {
        self.limits
            .iter_mut()
            .find(|(n, _)| **n == *name)?
            .1
            .get_mut(key)
    }

    /// Gives back expired slices of keys nobody checked since, once per lifetime at most, and
    /// forgets keys idle for ten lifetimes (so that the table has room for new ones).
    fn sweep(&mut self, now: Micros, back: &mut Vec<GiveBack>) {
        if now < self.next_sweep {
            return;
        }
        let mut shortest = Lease::DEFAULT_LIFETIME.as_micros() as Micros;
        let mut count = 0;
        self.limits.retain_mut(|(_, keys)| {
            keys.retain(|_, e| {
                let life = e.lease.lifetime().as_micros() as Micros;
                shortest = shortest.min(life);
                let units = e.slice.expire(now);
                if units > 0 {
                    e.sizing.wasted();
                }
                back.extend(e.give_back(units, now));
                e.taking || e.seen_at.saturating_add(10 * life) > now
            });
            count += keys.len();
            !keys.is_empty()
        });
        self.count = count;
        self.next_sweep = now.saturating_add(shortest);
    }
}

/// What a batch holds while its Redis part is in flight: put back if it is dropped first.
struct Holding {
    inner: Arc<Inner>,
    /// Each check's limit name and key.
    ids: Vec<(Arc<str>, Box<[u8]>)>,
    plan: [Plan; MAX_CHECKS],
    costs: [u32; MAX_CHECKS],
    len: usize,
    armed: bool,
}

impl Holding {
    /// Puts the local units back and ends the takes in flight.
    fn undo(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        let mut table = self.inner.leases.lock();
        for i in 0..self.len {
            let (name, key) = &self.ids[i];
            let Some(e) = table.get_mut(name, key) else {
                continue;
            };
            match self.plan[i] {
                Plan::Local => e.slice.put_back(self.costs[i]),
                Plan::Slice(_) => e.taking = false,
                Plan::Redis => {}
            }
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.undo();
    }
}

/// A check owned by the future of a leased batch (it may be asked again).
struct Owned {
    limit: Limit,
    key: Box<[u8]>,
    cost: u32,
    quota: tollgate_core::Quota,
    enforce: bool,
    slot: u128,
}

impl Owned {
    fn check(&self) -> Check<'_> {
        Check {
            limit: &self.limit,
            key: &self.key,
            cost: self.cost,
            quota: self.quota,
            enforce: self.enforce,
            slot: self.slot,
        }
    }
}

impl RedisBackend {
    /// Checks a batch of which some check has a leased limit (see the module docs).
    pub(crate) fn check_leased(&self, checks: &[Check<'_>], now: Option<Micros>) -> ResponseFuture {
        let inner = &self.inner;
        if checks.len() > MAX_CHECKS || inner.leases.closed() {
            return self.dispatch(checks, now);
        }
        let t = now.unwrap_or_else(|| inner.server_time());
        let mut plan = [Plan::Redis; MAX_CHECKS];
        let mut local = Verdicts::new();
        let mut back = Vec::new();
        {
            let mut table = inner.leases.lock();
            table.sweep(t, &mut back);
            for (i, c) in checks.iter().enumerate() {
                let _ = local.push(crate::backend::NOT_CHECKED);
                let Some(lease) = leasable(c) else {
                    continue;
                };
                let Some(entry) = table.entry(c, lease, t, &mut back) else {
                    continue;
                };
                let expired = entry.slice.expire(t);
                if expired > 0 {
                    entry.sizing.wasted();
                }
                back.extend(entry.give_back(expired, t));
                if entry.slice.take(c.cost, t) {
                    if entry.slice.units() == 0 {
                        entry.sizing.spent();
                    }
                    plan[i] = Plan::Local;
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
                    plan[i] = Plan::Slice(units);
                }
            }
        }
        let give_back = self.give_back(back, now);
        if plan[..checks.len()].iter().all(|p| *p == Plan::Local) {
            return match give_back {
                None => ResponseFuture::ready(Ok(local)),
                Some(sent) => ResponseFuture::call(async move {
                    sent.await;
                    Ok(local)
                }),
            };
        }
        let mut holding = Holding {
            inner: Arc::clone(inner),
            ids: checks
                .iter()
                .map(|c| (Arc::clone(c.limit.name_arc()), c.key.into()))
                .collect(),
            plan,
            costs: [0; MAX_CHECKS],
            len: checks.len(),
            armed: true,
        };
        for (cost, c) in holding.costs.iter_mut().zip(checks) {
            *cost = c.cost;
        }
        let owned: Vec<Owned> = checks
            .iter()
            .map(|c| Owned {
                limit: c.limit.clone(),
                key: c.key.into(),
                cost: c.cost,
                quota: c.quota,
                enforce: c.enforce,
                slot: c.slot,
            })
            .collect();
        let backend = self.clone();
        ResponseFuture::call(async move {
            if let Some(sent) = give_back {
                sent.await;
            }
            backend.redis_part(owned, holding, local, now, t).await
        })
    }

    /// The part of a leased batch that Redis answers; asked again (at most twice) when only a
    /// slice larger than what remains was refused.
    async fn redis_part(
        self,
        owned: Vec<Owned>,
        mut holding: Holding,
        local: Verdicts,
        now: Option<Micros>,
        t: Micros,
    ) -> Result<Verdicts, BackendError> {
        for attempt in 0..3 {
            let idx: Vec<usize> = (0..owned.len())
                .filter(|&i| holding.plan[i] != Plan::Local)
                .collect();
            let sub: Vec<Check<'_>> = idx.iter().map(|&i| owned[i].check()).collect();
            let mut slices = [0; MAX_CHECKS];
            for (s, &i) in slices.iter_mut().zip(&idx) {
                if let Plan::Slice(units) = holding.plan[i] {
                    *s = units;
                }
            }
            let answer = self.dispatch_slices(&sub, now, &slices).await;
            let verdicts = match answer {
                Ok(v) => v,
                Err(e) => {
                    holding.undo();
                    return Err(e);
                }
            };
            if !verdicts.admits(&sub) && attempt < 2 {
                // Ask again only if nothing but a slice refused: a refusal of the request's
                // own is final.
                let only_slices = idx.iter().zip(verdicts.iter()).all(|(&i, v)| {
                    v.is_allowed() || !owned[i].enforce || matches!(holding.plan[i], Plan::Slice(_))
                });
                if only_slices {
                    let mut table = self.inner.leases.lock();
                    for (&i, v) in idx.iter().zip(verdicts.iter()) {
                        let Plan::Slice(_) = holding.plan[i] else {
                            continue;
                        };
                        if v.is_allowed() {
                            continue;
                        }
                        let cost = owned[i].cost;
                        let (name, key) = &holding.ids[i];
                        let Some(e) = table.get_mut(name, key) else {
                            holding.plan[i] = Plan::Redis;
                            continue;
                        };
                        e.saw(v, t);
                        let units = e.sizing.units(&e.lease, v.remaining, cost);
                        holding.plan[i] = if attempt == 0 && units > cost {
                            Plan::Slice(units)
                        } else {
                            e.taking = false;
                            Plan::Redis
                        };
                    }
                    continue;
                }
            }
            return Ok(self.finish(&owned, &mut holding, local, &idx, &verdicts, now, t));
        }
        // Unreachable: the third attempt always returns.
        holding.undo();
        Err(crate::failure::unavailable(
            "rate-limit check asked too often",
        ))
    }

    /// The batch's verdicts, and the slices that Redis' answer filled.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        owned: &[Owned],
        holding: &mut Holding,
        local: Verdicts,
        idx: &[usize],
        answered: &Verdicts,
        now: Option<Micros>,
        t: Micros,
    ) -> Verdicts {
        holding.armed = false;
        let admitted = answered.admits(&idx.iter().map(|&i| owned[i].check()).collect::<Vec<_>>());
        let closed = self.inner.leases.closed();
        let mut out = local;
        let mut back = Vec::new();
        {
            let mut table = self.inner.leases.lock();
            for (j, &i) in idx.iter().enumerate() {
                let mut verdict = answered[j];
                let receipt = answered.receipt(j);
                let at = if receipt.at > 0 { receipt.at } else { t };
                let (name, key) = &holding.ids[i];
                let check = owned[i].check();
                // The entry may have been replaced while the take was out (a reload under
                // another quota or lease): the take's slice is then not the entry's, and goes
                // back at once, as the entry it was taken for would give it back.
                let replaced = table.get_mut(name, key).is_some_and(|e| !e.serves(&check));
                if let (Plan::Slice(units), true, Some(lease)) =
                    (holding.plan[i], replaced, check.limit.lease())
                {
                    let mut take = Entry::new(&check, *lease);
                    let extra = units - check.cost;
                    if admitted && verdict.is_allowed() {
                        let fresh =
                            lease.slice(take.algorithm(), &take.quota, extra, at, verdict.reset);
                        take.slice.refill(fresh);
                        take.receipt = receipt;
                        let units = take.slice.drain();
                        back.extend(take.give_back(units, at));
                    } else {
                        verdict = own_cost(take.algorithm(), &take.quota, verdict, extra);
                    }
                } else if let Some(e) = table.get_mut(name, key) {
                    if leasable(&owned[i].check()).is_some() {
                        e.saw(&verdict, at);
                    }
                    if let Plan::Slice(units) = holding.plan[i] {
                        e.taking = false;
                        let cost = owned[i].cost;
                        let extra = units - cost;
                        if admitted && verdict.is_allowed() {
                            let fresh =
                                e.lease
                                    .slice(e.algorithm(), &e.quota, extra, at, verdict.reset);
                            let horizon = e.slice.horizon();
                            let old = e.slice.refill(fresh);
                            back.extend(e.give_back(old, at).map(|g| GiveBack {
                                only_at: horizon,
                                ..g
                            }));
                            e.receipt = receipt;
                            if closed {
                                let units = e.slice.drain();
                                back.extend(e.give_back(units, at));
                            }
                            verdict.remaining = verdict.remaining.saturating_add(u64::from(extra));
                        } else {
                            verdict = own_cost(e.algorithm(), &e.quota, verdict, extra);
                        }
                    }
                }
                out.as_mut_slice()[i] = verdict;
                out.set_receipt(i, receipt);
            }
            if !admitted {
                for (i, o) in owned.iter().enumerate() {
                    if holding.plan[i] != Plan::Local {
                        continue;
                    }
                    let (name, key) = &holding.ids[i];
                    // Into the slice the unit came from only: a slice taken since (another
                    // window's, another quota's) must not gain it.
                    if let Some(e) = table.get_mut(name, key) {
                        if e.receipt == out.receipt(i) && e.quota == o.quota {
                            e.slice.put_back(o.cost);
                        }
                    }
                }
            }
        }
        if let Some(sent) = self.give_back(back, now) {
            tokio::spawn(sent);
        }
        out
    }

    /// Sends `back` to Redis: queued like any settle (`now` unset), or as a future to await
    /// (at a fixed `now`, for tests). `None` when there is nothing to send or await.
    fn give_back(
        &self,
        back: Vec<GiveBack>,
        now: Option<Micros>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        if back.is_empty() {
            return None;
        }
        let (settlements, only_at) = refunds(&back);
        if now.is_none() {
            self.settle_later_at(&settlements, &only_at);
            return None;
        }
        let sent = self.settle_guarded(&settlements, &only_at, now);
        Some(async move {
            if let Err(e) = sent.await {
                tracing::debug!(backend = BACKEND, error = %e, "lease give-back failed");
            }
        })
    }

    /// Gives every slice back and takes no more: what [`Backend::shutdown`] does, at a fixed
    /// `now` (tests) or at the server's time. Resolves once Redis has answered.
    ///
    /// [`Backend::shutdown`]: tollgate_core::Backend::shutdown
    ///
    /// # Errors
    ///
    /// As [`settle_at`](Self::settle_at): the units stay counted in Redis until they expire
    /// (a fixed window's end; a GCRA slice's refill).
    pub fn shutdown_at(
        &self,
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        let t = now.unwrap_or_else(|| self.inner.server_time());
        let back = self.inner.leases.drain(t);
        let (settlements, only_at) = refunds(&back);
        self.settle_guarded(&settlements, &only_at, now)
    }

    /// Units this backend holds in leased slices now (admitted by Redis, not yet used here).
    pub fn leased_units(&self) -> u64 {
        self.inner.leases.held()
    }
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

/// The refunds of `back`, with the TAT each GCRA refund requires (`GiveBack::only_at`).
fn refunds(back: &[GiveBack]) -> (Vec<Settlement<'_>>, Vec<Micros>) {
    let settlements = back
        .iter()
        .map(|g| Settlement {
            limit: &g.limit,
            key: &g.key,
            reserved: g.units,
            actual: 0,
            receipt: g.receipt,
            quota: g.quota,
        })
        .collect();
    (settlements, back.iter().map(|g| g.only_at).collect())
}
