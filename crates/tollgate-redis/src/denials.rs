//! What a batch and Redis' answers mean to the deny cache: a batch refused locally before
//! Redis is asked, and the denials an answer foretells.

use tollgate_engine::{Algorithm, Check, Status, Verdict, Verdicts, MAX_CHECKS};

use crate::deny_cache::{Lookup, RefusedKeys};
use crate::keys::KeyDigest;
use crate::scripts::check::EncodedCheck;
use crate::scripts::reply::NOT_CHECKED;

impl RefusedKeys {
    /// The batch's verdicts if an enforced check is in the cache; otherwise `asks` says which
    /// checks took the turn to ask Redis after a denial ran out.
    pub(crate) fn refuse(
        &self,
        checks: &[Check<'_>],
        digests: &[KeyDigest; MAX_CHECKS],
        asks: &mut [bool; MAX_CHECKS],
    ) -> Option<Verdicts> {
        // Every cached denial of the batch, not only the first: the refusal's Retry-After is
        // the longest of their waits, and each refusing limit is reported as refusing.
        let mut hits = [None; MAX_CHECKS];
        for (i, c) in checks.iter().enumerate().filter(|(_, c)| c.enforce) {
            // A lease's slice is looked up at the request's own cost.
            let cost = if c.slice_of > 0 { c.slice_of } else { c.cost };
            match self.lookup_delayed(&digests[i], cost, &c.quota, c.delay) {
                Lookup::Miss => {}
                Lookup::Asks => asks[i] = true,
                Lookup::Denied(verdict) => hits[i] = Some(verdict),
            }
        }
        if hits.iter().all(Option::is_none) {
            return None;
        }
        // Turns taken for a refused batch would hold their keys back for nothing.
        for (taken, digest) in asks.iter_mut().zip(digests) {
            if std::mem::take(taken) {
                self.pass_turn(digest);
            }
        }
        Some(
            (0..checks.len())
                .map(|i| hits[i].unwrap_or(NOT_CHECKED))
                .collect(),
        )
    }

    /// What Redis' `verdict` for the enforced check `p` tells the cache: a denial (or one it
    /// foretells) to hold, or the end of the turn `p` held. Slots free at any moment: a
    /// concurrency refusal is never kept.
    pub(crate) fn learn(&self, p: &EncodedCheck, verdict: &Verdict) {
        if !p.enforce || p.algorithm == Algorithm::Concurrency {
            return;
        }
        let sanctioned = matches!(
            verdict.status,
            Status::Blocked { .. } | Status::Denylisted { .. }
        );
        let foreseen = if sanctioned {
            Some(*verdict)
        } else if p.slice || p.penalty[0] > 0 {
            // A limit with a penalty counts every refusal in Redis: its denials are not held.
            None
        } else {
            foreseen_denial(p.algorithm, (&p.quota, p.delay), p.cost, verdict)
        };
        match foreseen {
            Some(denial) => {
                let per_unit = match p.algorithm {
                    Algorithm::Gcra => Some(p.quota.emission_interval()),
                    Algorithm::FixedWindow => Some(0),
                    _ => None,
                };
                self.insert_delayed(
                    &p.digest,
                    &p.name,
                    (&p.quota, p.delay),
                    p.cost,
                    per_unit,
                    &denial,
                );
            }
            // Only the request whose turn it was to ask ends the turn. An answer that tells
            // nothing of the room left (the check was not run, or can never pass) ends the
            // wait.
            None if p.asks => {
                let room = if verdict.is_allowed() {
                    verdict.remaining
                } else {
                    u64::MAX
                };
                self.end_turn(&p.digest, p.cost, room);
            }
            None => {}
        }
    }
}

/// The denial the deny cache should hold after Redis answered `verdict` for one check.
///
/// A denial stands until its `retry_after`, and only for checks under the same quota and
/// delay (a delayed check may be admitted where one without a delay is refused). An admission that left less than the check's cost
/// foretells one: under GCRA the next such request fits once the theoretical arrival time minus
/// the tolerance is reached, in a fixed window once the window turns. A sliding log's next free
/// unit depends on the whole log, so it foretells nothing. `None`: nothing to hold.
fn foreseen_denial(
    algorithm: Algorithm,
    (quota, delay): (&tollgate_engine::Quota, tollgate_engine::Micros),
    cost: u32,
    verdict: &Verdict,
) -> Option<Verdict> {
    let retry_after = match verdict.status {
        Status::Denied { retry_after } => retry_after,
        Status::Allowed if verdict.remaining < u64::from(cost) => match algorithm {
            Algorithm::Gcra => {
                let interval = quota.emission_interval();
                // reset = new TAT - now; the next admission needs TAT + cost × T - τ <= then,
                // where a delayed check's τ is the burst's span and its delay.
                (verdict.reset + interval * u64::from(cost))
                    .saturating_sub(interval * u64::from(quota.burst()) + delay)
            }
            Algorithm::FixedWindow => verdict.reset,
            _ => return None,
        },
        _ => return None,
    };
    (retry_after > 0).then_some(Verdict::new(
        Status::Denied { retry_after },
        verdict.remaining,
        verdict.reset,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_engine::{algorithm, Quota};

    /// Runs `step` (the engine's maths on its stored state) until it refuses; returns the last
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
            let foreseen = foreseen_denial(Algorithm::Gcra, (&q, 0), cost, &last).unwrap();
            assert_eq!(foreseen.status, next.status, "GCRA, cost {cost}");
        }
        let q = Quota::per_second(10).unwrap();
        let (last, next) =
            last_admission_then_refusal(|w| algorithm::fixed_window(&q, w, 1_250_000, 1));
        let foreseen = foreseen_denial(Algorithm::FixedWindow, (&q, 0), 1, &last).unwrap();
        assert_eq!(foreseen.status, next.status, "fixed window");
    }

    #[test]
    fn room_left_or_a_sliding_log_foretells_nothing() {
        let q = Quota::per_second(10).unwrap();
        let (v, _) = algorithm::gcra(&q, None, 0, 1);
        assert_eq!(foreseen_denial(Algorithm::Gcra, (&q, 0), 1, &v), None);
        let full = Verdict::new(Status::Allowed, 0, 1_000_000);
        assert_eq!(
            foreseen_denial(Algorithm::SlidingLog, (&q, 0), 1, &full),
            None
        );
        // A denial stands as Redis gave it.
        let denied = Verdict::new(
            Status::Denied { retry_after: 5 },
            full.remaining,
            full.reset,
        );
        assert_eq!(
            foreseen_denial(Algorithm::SlidingLog, (&q, 0), 1, &denied),
            Some(denied)
        );
    }
}
