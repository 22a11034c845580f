//! A failed backend call: each checked limit's failure policy (fail open, fail closed, or
//! the local fallback limiter with its share of the quota).

use std::time::Duration;

use tollgate_engine::{Backend, BackendError, Check, FailurePolicy, Receipt, MAX_CHECKS};

use super::facts::{Facts, KeptKeys};
use super::state::Shared;
use crate::decision::{Decision, DenyReason, Outcome, SkipReason, Source};

impl<B: Backend> Shared<B> {
    /// The decision when the backend failed: each checked limit's failure policy.
    pub(crate) fn decide_failure(
        &self,
        error: &BackendError,
        facts: &Facts,
        kept: &KeptKeys,
        receipts: &mut [Receipt; MAX_CHECKS],
    ) -> Decision {
        let mut outcomes = [(
            Outcome::Skipped {
                reason: SkipReason::MissingKey,
            },
            Source::Backend,
        ); MAX_CHECKS];
        self.on_failure(error, facts, kept, &mut outcomes, receipts);
        // A refused request went nowhere: a fail-open limit beside the one that refused it
        // bypassed nothing, and must not say it did.
        let refused =
            facts
                .set
                .limits
                .iter()
                .zip(&outcomes)
                .enumerate()
                .any(|(i, (entry, (outcome, _)))| {
                    !entry.limit.is_shadow() && !facts.shadowed(i) && !outcome.admits()
                });
        if refused {
            for (outcome, _) in &mut outcomes {
                if let Outcome::Bypassed { .. } = outcome {
                    *outcome = Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    };
                }
            }
        }
        facts
            .set
            .limits
            .iter()
            .zip(outcomes)
            .enumerate()
            .map(|(i, (entry, (outcome, source)))| {
                entry
                    .decision(outcome, source, facts.quota_of[i])
                    .shadowed(facts.shadowed(i))
            })
            .collect()
    }

    /// Applies each checked limit's failure policy.
    fn on_failure(
        &self,
        error: &BackendError,
        facts: &Facts,
        kept: &KeptKeys,
        outcomes: &mut [(Outcome, Source); MAX_CHECKS],
        receipts: &mut [Receipt; MAX_CHECKS],
    ) {
        let limits = &facts.set.limits;
        let mut closed = false;
        let mut fallback = false;
        for &i in &facts.limit_of[..facts.n] {
            outcomes[i].0 = match limits[i].limit.failure_policy() {
                FailurePolicy::FailClosed => {
                    // A shadow limit refuses nothing, so it must not switch off the fallback
                    // of the enforced limits beside it either.
                    closed |= !facts.shadowed(i);
                    Outcome::Denied {
                        retry_after: Some(self.respond.unavailable_retry_after),
                        remaining: 0,
                        reset: Duration::ZERO,
                        reason: DenyReason::BackendUnavailable,
                    }
                }
                FailurePolicy::Fallback { .. } => {
                    fallback = true;
                    Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    }
                }
                _ => Outcome::Bypassed {
                    reason: error.kind().into(),
                },
            };
        }
        if closed || !fallback {
            return;
        }
        // A fallback limit keeps its key (`SetLimit::keeps_key`), so its check is the one the
        // backend was asked, in the local limiter with the quota's local share.
        let mut checks = [Check::new(&limits[0].limit, b""); MAX_CHECKS];
        let mut index = [0usize; MAX_CHECKS];
        let mut n = 0;
        for &i in &facts.limit_of[..facts.n] {
            let entry = &limits[i];
            if let (Some(local), Some(key)) = (&entry.local, kept.get(i)) {
                let quota = *local.quota_at(usize::from(facts.quota_of[i]));
                checks[n] = Check::new(local, key.as_bytes())
                    .with_quota(quota)
                    .with_slot(facts.slot);
                if entry.metered.as_ref().is_some_and(|m| m.cost.is_some()) {
                    checks[n] = checks[n].with_cost(facts.cost[i]);
                }
                index[n] = i;
                n += 1;
            }
        }
        if let Ok(verdicts) = self.fallback.check_now(&checks[..n]) {
            for (j, verdict) in verdicts.iter().enumerate() {
                outcomes[index[j]] = (Outcome::from_verdict(verdict), Source::Fallback);
                receipts[index[j]] = verdicts.receipt(j);
            }
        }
    }
}
