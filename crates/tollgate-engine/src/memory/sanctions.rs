//! Sanctions in memory: a refusal counted toward its limit's penalty, an operator's deny,
//! undeny and lift of one key, and a pause an upstream asked for.

use std::collections::hash_map::Entry;

use crate::check::Check;
use crate::clock::{Clock, Micros};
use crate::memory::fingerprint::Fp;
use crate::memory::inner::Inner;
use crate::memory::shard::Shard;
use crate::penalty::Sanction;
use crate::verdict::{Status, Verdict};

impl<C> Inner<C> {
    /// Counts `check`'s refusal (`verdict`) toward its limit's penalty, in `shard` (write
    /// locked); a refusal that starts a block becomes `Blocked`. A key with no sanctions yet
    /// takes a place under the key cap: without one (at the cap) the refusal stands, but is
    /// not counted.
    pub(super) fn count_refusal(
        &self,
        shard: &mut Shard,
        check: &Check<'_>,
        fp: Fp,
        now: Micros,
        verdict: &mut Verdict,
    ) {
        let Some(penalty) = check.limit.penalty_box() else {
            return;
        };
        if !check.enforce || !matches!(verdict.status, Status::Denied { .. }) {
            return;
        }
        let room = shard.len() < self.key_cap.shard_cap;
        let record = match shard.sanctions.entry(fp) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                if !(room && self.key_cap.reserve()) {
                    return;
                }
                e.insert(Sanction::default())
            }
        };
        if let Some(block) = record.refused(penalty, now) {
            verdict.status = Status::Blocked { retry_after: block };
            verdict.reset = verdict.reset.max(block);
        }
    }
}

impl<C: Clock> Inner<C> {
    /// Applies `f` to `check`'s key's sanctions under its shard's lock, creating them if
    /// `create` (and a place is free); drops them if nothing is left standing. `false` when
    /// a new record found no place.
    pub(super) fn sanction(
        &self,
        check: &Check<'_>,
        create: bool,
        f: impl FnOnce(&mut Sanction, Micros),
    ) -> bool {
        let now = self.clock.now();
        let (fp, mut shard) = self.key_shard(check);
        let room = shard.len() < self.key_cap.shard_cap;
        match shard.sanctions.entry(fp) {
            Entry::Occupied(mut e) => {
                f(e.get_mut(), now);
                if !e.get().live(now) {
                    e.remove();
                    self.key_cap.free(1);
                }
            }
            Entry::Vacant(e) => {
                if !create {
                    return true;
                }
                if !(room && self.key_cap.reserve()) {
                    return false;
                }
                let mut record = Sanction::default();
                f(&mut record, now);
                if record.live(now) {
                    e.insert(record);
                } else {
                    self.key_cap.free(1);
                }
            }
        }
        true
    }
}

impl<C: Clock> Inner<C> {
    /// [`Backend::pause`](crate::Backend::pause): a GCRA key's TAT moved to at least
    /// `now + micros + (burst − 1) × T`, under the check's quota. A new key takes a place
    /// under the cap; at the cap the pause is not kept.
    pub(super) fn pause(&self, check: &Check<'_>, micros: Micros) {
        if check.limit.algorithm() != crate::counting::Algorithm::Gcra {
            return;
        }
        let now = self.clock.now();
        let quota = &check.quota;
        let interval = quota.emission_interval();
        let target = now
            .saturating_add(micros)
            .saturating_add(interval.saturating_mul(u64::from(quota.burst().saturating_sub(1))));
        let (fp, mut shard) = self.key_shard(check);
        let room = shard.len() < self.key_cap.shard_cap;
        let state = shard
            .gcra
            .get_mut(&fp)
            .map(crate::memory::shard::Record::get);
        let tat = crate::memory::shard::carried(state, quota, now);
        if tat.is_some_and(|t| t >= target) {
            return;
        }
        if tat.is_none() && !(room && self.key_cap.reserve()) {
            return;
        }
        let next = crate::algorithm::GcraState::moved(state, target, interval, now);
        crate::memory::shard::store(&mut shard.gcra, fp, next);
    }
}
