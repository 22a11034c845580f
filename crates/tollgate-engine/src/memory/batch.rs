//! Checking a batch against the shards: a lone check, the common case, without the batch's
//! arrays (a lone GCRA check of a tracked key under the read lock only), and a batch of more
//! under every shard it touches at once, all-or-nothing.

use std::sync::atomic::Ordering;
use std::sync::{PoisonError, RwLockWriteGuard};

use crate::algorithm::{self, GcraState};
use crate::bounds::MAX_CHECKS;
use crate::check::{Check, Receipt};
use crate::clock::{Clock, Micros};
use crate::counting::Algorithm;
use crate::memory::fingerprint::{Fp, FpMap};
use crate::memory::inner::{Inner, Sweeps};
use crate::memory::shard::{carried, Pending, Record, Shard};
use crate::verdict::Verdict;
use crate::verdicts::Verdicts;

impl<C: Clock> Inner<C> {
    /// Checks a batch of at most [`MAX_CHECKS`] checks, and records each admitted check's
    /// receipt.
    pub(super) fn check(&self, checks: &[Check<'_>]) -> Verdicts {
        let now = self.clock.now();
        let mask = self.shards.len() - 1;
        let mut sweeps = Sweeps::new(self.key_cap.shard_cap);
        if self.key_cap.full() {
            self.sweep_round(now, mask, &mut sweeps);
        }
        let mut verdicts = match checks {
            [check] => self.check_one(check, now, mask, &mut sweeps),
            _ => self.check_batch(checks, now, mask, &mut sweeps),
        };
        if sweeps.swept > 0 {
            self.sweeping
                .most_swept
                .fetch_max(sweeps.swept, Ordering::Relaxed);
        }
        for (i, check) in checks.iter().enumerate() {
            if let Some(v) = verdicts.get(i).copied().filter(Verdict::is_allowed) {
                let receipt = match check.limit.algorithm() {
                    // The end of the window; the TAT the reservation left.
                    Algorithm::FixedWindow => Receipt::window(now, now + v.reset),
                    Algorithm::Gcra => Receipt::gcra(now, now + v.reset),
                    // The time its units were recorded at, set by the commit (`now` or later).
                    Algorithm::SlidingLog => Receipt::new(verdicts.receipt(i).at.max(now)),
                    Algorithm::Concurrency => Receipt::new(now),
                };
                verdicts.set_receipt(i, receipt);
            }
        }
        verdicts
    }
}

impl<C> Inner<C> {
    /// A batch of two or more checks: every shard it touches write-locked at once.
    #[inline]
    fn check_batch(
        &self,
        checks: &[Check<'_>],
        now: Micros,
        mask: usize,
        sweeps: &mut Sweeps,
    ) -> Verdicts {
        let n = checks.len();

        let mut fps = [Fp::default(); MAX_CHECKS];
        let mut shard_of = [0usize; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            fps[i] = self.fingerprint(check);
            shard_of[i] = fps[i].shard(mask);
        }

        // Lock each shard the batch touches once, in ascending order.
        let mut order = shard_of;
        order[..n].sort_unstable();
        let mut locked = [0usize; MAX_CHECKS];
        let mut guards: [Option<RwLockWriteGuard<'_, Shard>>; MAX_CHECKS] = Default::default();
        let mut held = 0;
        for &s in &order[..n] {
            if held > 0 && locked[held - 1] == s {
                continue;
            }
            locked[held] = s;
            guards[held] = Some(self.lock(s, now, sweeps));
            held += 1;
        }
        let lock_of = |i: usize| {
            locked[..held]
                .iter()
                .position(|&s| s == shard_of[i])
                .unwrap_or(0)
        };

        let mut verdicts = Verdicts::new();
        let mut pending = [Pending::None; MAX_CHECKS];
        let mut reserved = [false; MAX_CHECKS];
        // New keys the batch has placed in each locked shard, not yet inserted.
        let mut added = [0usize; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            let at = lock_of(i);
            let Some(shard) = guards[at].as_mut() else {
                continue;
            };
            let (mut verdict, p, new) = shard.evaluate(check, &fps[i], now);
            if verdict.is_allowed() && new {
                if shard.len() + added[at] < self.key_cap.shard_cap && self.key_cap.reserve() {
                    reserved[i] = true;
                    added[at] += 1;
                } else {
                    verdict.status = self.at_capacity();
                }
            }
            if verdict.is_allowed() {
                pending[i] = p;
            }
            let _ = verdicts.push(verdict);
        }

        if verdicts.admits(checks) {
            for (i, check) in checks.iter().enumerate() {
                if let Some(shard) = guards[lock_of(i)].as_mut() {
                    let at = shard.commit(check, fps[i], pending[i], now);
                    if at != now {
                        verdicts.set_receipt(i, Receipt::new(at));
                    }
                }
            }
        } else {
            for (i, check) in checks.iter().enumerate() {
                if reserved[i] {
                    self.key_cap.free(1);
                }
                let v = &mut verdicts.as_mut_slice()[i];
                *v = algorithm::unconsumed(check.limit.algorithm(), &check.quota, *v, check.cost);
                if let Some(shard) = guards[lock_of(i)].as_mut() {
                    self.count_refusal(shard, check, fps[i], now, v);
                }
            }
        }
        verdicts
    }

    /// A lone GCRA check of a tracked key under shard `s`'s read lock: the new TAT goes in with
    /// a compare-and-swap against the one the verdict was computed from, and the verdict is
    /// computed again from the newer TAT if another check got there first. `None` when the
    /// check needs the write lock: the key is new, or the shard's sweep is due.
    #[inline]
    fn gcra_shared(&self, s: usize, fp: Fp, check: &Check<'_>, now: Micros) -> Option<Verdict> {
        let guard = self.shards[s]
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if now >= guard.next_sweep.load(Ordering::Relaxed) {
            return None;
        }
        if !guard.sanctions.is_empty() && guard.sanctions.contains_key(&fp) {
            // Sanctions are read and counted under the write lock.
            return None;
        }
        let record = guard.gcra.get(&fp)?;
        let quota = &check.quota;
        if record.interval != quota.emission_interval() {
            // Written under another quota: carried under the write lock.
            return None;
        }
        let tat = &record.tat;
        let mut current = tat.load(Ordering::Relaxed);
        loop {
            let (verdict, next) =
                algorithm::gcra_delayed(quota, Some(current), now, check.cost, check.delay);
            let Some(next) = next else {
                return Some(verdict);
            };
            match tat.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    if current <= now {
                        // A full bucket: the key's run begins (GcraState::moved).
                        record.since.store(now, Ordering::Relaxed);
                    }
                    return Some(verdict);
                }
                Err(newer) => current = newer,
            }
        }
    }

    /// A batch of one check: the same rules without the batch's arrays and lock ordering.
    /// Runs `algorithm` on the state `fp` holds in `map` and stores what it returns, through
    /// one lookup for a tracked key; a new key takes a place under the cap (if its shard has
    /// `room`), or is refused.
    #[inline]
    fn step<S: Record>(
        &self,
        map: &mut FpMap<S>,
        room: bool,
        fp: Fp,
        algorithm: impl FnOnce(Option<S::State>) -> (Verdict, Option<S::State>),
    ) -> Verdict {
        let mut record = map.get_mut(&fp);
        let (mut verdict, next) = algorithm(record.as_deref_mut().map(Record::get));
        match (record, next) {
            (Some(record), Some(next)) => *record = S::new(next),
            (None, Some(next)) => {
                if room && self.key_cap.reserve() {
                    map.insert(fp, S::new(next));
                } else {
                    verdict.status = self.at_capacity();
                }
            }
            (_, None) => {}
        }
        verdict
    }

    #[inline]
    fn check_one(
        &self,
        check: &Check<'_>,
        now: Micros,
        mask: usize,
        sweeps: &mut Sweeps,
    ) -> Verdicts {
        let fp = self.fingerprint(check);
        let s = fp.shard(mask);
        let shared = match check.limit.algorithm() {
            Algorithm::Gcra if check.limit.penalty_box().is_none() => {
                self.gcra_shared(s, fp, check, now)
            }
            Algorithm::Gcra => None,
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::Concurrency => None,
        };
        let (verdict, at) = match shared {
            Some(verdict) => (verdict, now),
            None => self.check_locked(check, fp, s, now, sweeps),
        };
        let mut verdicts = Verdicts::new();
        let _ = verdicts.push(verdict);
        if at != now {
            verdicts.set_receipt(0, Receipt::new(at));
        }
        verdicts
    }

    /// A lone check under the shard's write lock, and the time a sliding log recorded its
    /// units at (`now` otherwise).
    #[inline]
    fn check_locked(
        &self,
        check: &Check<'_>,
        fp: Fp,
        s: usize,
        now: Micros,
        sweeps: &mut Sweeps,
    ) -> (Verdict, Micros) {
        let mut guard = self.lock(s, now, sweeps);
        let shard = &mut *guard;
        let quota = &check.quota;
        if let Some(refused) = shard.standing(&fp, now) {
            return (refused, now);
        }
        let room = shard.len() < self.key_cap.shard_cap;
        let mut at = now;
        // GCRA and fixed window read and write a tracked key's state through one lookup.
        let mut verdict = match check.limit.algorithm() {
            Algorithm::Gcra => self.step(&mut shard.gcra, room, fp, |state| {
                let (v, next) = algorithm::gcra_delayed(
                    quota,
                    carried(state, quota, now),
                    now,
                    check.cost,
                    check.delay,
                );
                let interval = quota.emission_interval();
                (v, next.map(|t| GcraState::moved(state, t, interval, now)))
            }),
            Algorithm::FixedWindow => self.step(&mut shard.windows, room, fp, |state| {
                algorithm::fixed_window(quota, state, now, check.cost)
            }),
            Algorithm::SlidingLog | Algorithm::Concurrency => {
                let (mut verdict, pending, new) = shard.evaluate(check, &fp, now);
                if verdict.is_allowed() && new && !(room && self.key_cap.reserve()) {
                    verdict.status = self.at_capacity();
                }
                if verdict.is_allowed() {
                    at = shard.commit(check, fp, pending, now);
                }
                verdict
            }
        };
        self.count_refusal(shard, check, fp, now, &mut verdict);
        (verdict, at)
    }
}
