//! Sanctions in memory: a refusal counted toward its limit's penalty, and an operator's
//! deny, undeny and lift of one key.

use std::collections::hash_map::Entry;
use std::sync::PoisonError;

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
        let room = shard.len() < self.places.shard_cap;
        let record = match shard.sanctions.entry(fp) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                if !(room && self.places.reserve()) {
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
        let fp = self.fingerprint(check);
        let mask = self.shards.len() - 1;
        let mut shard = self.shards[fp.shard(mask)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let room = shard.len() < self.places.shard_cap;
        match shard.sanctions.entry(fp) {
            Entry::Occupied(mut e) => {
                f(e.get_mut(), now);
                if !e.get().live(now) {
                    e.remove();
                    self.places.free(1);
                }
            }
            Entry::Vacant(e) => {
                if !create {
                    return true;
                }
                if !(room && self.places.reserve()) {
                    return false;
                }
                let mut record = Sanction::default();
                f(&mut record, now);
                if record.live(now) {
                    e.insert(record);
                } else {
                    self.places.free(1);
                }
            }
        }
        true
    }
}
