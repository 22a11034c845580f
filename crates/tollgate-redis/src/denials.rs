//! Deny-cache lookups: a batch refused locally before Redis is asked, and what Redis' answers
//! tell the cache.

use tollgate_core::{
    algorithm, Algorithm, Check, Micros, Receipt, Status, Verdict, Verdicts, MAX_CHECKS,
};

use crate::backend::{Inner, Outcome, RedisBackend, NOT_CHECKED};
use crate::deny_cache::Lookup;
use crate::keys;
use crate::script::Prepared;

impl Inner {
    /// The verdicts of an answered batch; an enforced check's answer updates the deny cache
    /// (not for a check at a fixed `now`, whose time is not the local clock's).
    pub(crate) fn verdicts(
        &self,
        batch: &[Prepared],
        outcome: &Outcome,
        now: Option<Micros>,
    ) -> Verdicts {
        let mut verdicts = Verdicts::new();
        for (p, answer) in batch.iter().zip(&outcome.answers) {
            let mut verdict = answer.verdict;
            if !outcome.committed {
                verdict = algorithm::unconsumed(p.algorithm, &p.quota, verdict, p.cost);
            }
            // Slots free at any moment: a concurrency refusal is never kept.
            if now.is_none() && p.enforce && p.algorithm != Algorithm::Concurrency {
                let foreseen = if p.slice {
                    None
                } else {
                    foreseen_denial(p.algorithm, &p.quota, p.cost, &verdict)
                };
                match foreseen {
                    Some(denial) => {
                        let per_unit = match p.algorithm {
                            Algorithm::Gcra => Some(p.quota.emission_interval()),
                            Algorithm::FixedWindow => Some(0),
                            _ => None,
                        };
                        self.deny
                            .insert(&p.digest, &p.name, &p.quota, p.cost, per_unit, &denial);
                    }
                    // Only the request that held a run-out denial's lease settles it.
                    // An answer that tells nothing of the room left (the check was not
                    // run, or can never pass) ends the wait.
                    None if p.leased => {
                        let room = if verdict.is_allowed() {
                            verdict.remaining
                        } else {
                            u64::MAX
                        };
                        self.deny.settle(&p.digest, p.cost, room);
                    }
                    None => {}
                }
            }
            let _ = verdicts.push(verdict);
            if verdict.is_allowed() {
                let mark = match p.algorithm {
                    // The end of the window, as the in-memory backend marks it.
                    Algorithm::FixedWindow => answer
                        .extra
                        .saturating_add(1)
                        .saturating_mul(p.quota.period_micros()),
                    _ => answer.extra,
                };
                verdicts.set_receipt(
                    verdicts.len() - 1,
                    Receipt {
                        at: answer.at,
                        mark,
                    },
                );
            }
        }
        verdicts
    }
}

impl RedisBackend {
    /// The batch's verdicts if an enforced check is in the deny cache; otherwise `leased` says
    /// which checks took the lease of a denial that ran out.
    pub(crate) fn cached_denial(
        &self,
        checks: &[Check<'_>],
        digests: &[keys::KeyDigest; MAX_CHECKS],
        leased: &mut [bool; MAX_CHECKS],
    ) -> Option<Verdicts> {
        // Every cached denial of the batch, not only the first: the refusal's Retry-After is
        // the longest of their waits, and each refusing limit is reported as refusing.
        let mut hits = [None; MAX_CHECKS];
        for (i, c) in checks.iter().enumerate().filter(|(_, c)| c.enforce) {
            match self.inner.deny.lookup(&digests[i], c.cost, &c.quota) {
                Lookup::Miss => {}
                Lookup::Leased => leased[i] = true,
                Lookup::Denied(verdict) => hits[i] = Some(verdict),
            }
        }
        if hits.iter().all(Option::is_none) {
            return None;
        }
        // Leases taken for a refused batch would hold their keys back for nothing.
        for (taken, digest) in leased.iter_mut().zip(digests) {
            if std::mem::take(taken) {
                self.inner.deny.release(digest);
            }
        }
        Some(
            (0..checks.len())
                .map(|i| hits[i].unwrap_or(NOT_CHECKED))
                .collect(),
        )
    }
}

/// The denial the deny cache should hold after Redis answered `verdict` for one check.
///
/// A denial stands until its `retry_after`. An admission that left less than the check's cost
/// foretells one: under GCRA the next such request fits once the theoretical arrival time minus
/// the tolerance is reached, in a fixed window once the window turns. A sliding log's next free
/// unit depends on the whole log, so it foretells nothing. `None`: nothing to hold.
fn foreseen_denial(
    algorithm: Algorithm,
    quota: &tollgate_core::Quota,
    cost: u32,
    verdict: &Verdict,
) -> Option<Verdict> {
    let retry_after = match verdict.status {
        Status::Denied { retry_after } => retry_after,
        Status::Allowed if verdict.remaining < u64::from(cost) => match algorithm {
            Algorithm::Gcra => {
                let interval = quota.emission_interval();
                // reset = new TAT - now; the next admission needs TAT + cost × T - τ <= then.
                (verdict.reset + interval * u64::from(cost))
                    .saturating_sub(interval * u64::from(quota.burst()))
            }
            Algorithm::FixedWindow => verdict.reset,
            _ => return None,
        },
        _ => return None,
    };
    (retry_after > 0).then_some(Verdict {
        status: Status::Denied { retry_after },
        ..*verdict
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::Quota;

    /// Runs `step` (the core's maths on its stored state) until it refuses; returns the last
    /// admission and the refusal that followed.
    fn last_admission_then_refusal<S: Copy>(
        step: impl Fn(Option<S>) -> (Verdict, Option<S>),
    ) -> (Verdict, Verdict) {
        let (mut state, mut last) = (None, None);
        loop {
            let (verdict, next) = step(state);
            if !verdict.is_allowed() {
                return (last.unwrap(), verdict);
            }
            (state, last) = (next, Some(verdict));
        }
    }

    #[test]
    fn an_admission_that_used_the_last_unit_foretells_the_exact_denial() {
        let q = Quota::per_second(10).unwrap().with_burst(4).unwrap(); // T = 100 ms
        for cost in [1, 2] {
            let (last, next) =
                last_admission_then_refusal(|tat| algorithm::gcra(&q, tat, 1_000_000, cost));
            let foreseen = foreseen_denial(Algorithm::Gcra, &q, cost, &last).unwrap();
            assert_eq!(foreseen.status, next.status, "GCRA, cost {cost}");
        }
        let q = Quota::per_second(10).unwrap();
        let (last, next) =
            last_admission_then_refusal(|w| algorithm::fixed_window(&q, w, 1_250_000, 1));
        let foreseen = foreseen_denial(Algorithm::FixedWindow, &q, 1, &last).unwrap();
        assert_eq!(foreseen.status, next.status, "fixed window");
    }

    #[test]
    fn room_left_or_a_sliding_log_foretells_nothing() {
        let q = Quota::per_second(10).unwrap();
        let (v, _) = algorithm::gcra(&q, None, 0, 1);
        assert_eq!(foreseen_denial(Algorithm::Gcra, &q, 1, &v), None);
        let full = Verdict {
            status: Status::Allowed,
            remaining: 0,
            reset: 1_000_000,
        };
        assert_eq!(foreseen_denial(Algorithm::SlidingLog, &q, 1, &full), None);
        // A denial stands as Redis gave it.
        let denied = Verdict {
            status: Status::Denied { retry_after: 5 },
            ..full
        };
        assert_eq!(
            foreseen_denial(Algorithm::SlidingLog, &q, 1, &denied),
            Some(denied)
        );
    }
}
