//! The backend's answer about a request's [`Facts`], made a [`Decision`]: admitted (with what
//! it owes its metered limits and the slots it holds), or refused.

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::{
    Algorithm, Backend, BackendError, BackendErrorKind, Receipt, Verdicts, MAX_CHECKS,
};

use super::prepare::{Facts, KeptKeys};
use super::settle::{Item, Reservation};
use super::slots::Taken;
use super::state::Shared;
use crate::decision::{Decision, Outcome, SkipReason, Source};
use crate::metrics as obs;

/// What follows a request's decision.
pub(crate) enum Decided {
    /// Admitted: the request goes on to the inner service with its decision, what it owes its
    /// metered limits, and the concurrency slots it took (settled and given back against the
    /// limits it was checked under, even if a reload replaced them since).
    Admit(Decision, Option<Vec<Item>>, Option<Taken>),
    /// Refused, with its response.
    Refuse(Response<Bytes>),
}

impl<B: Backend> Shared<B> {
    /// Turns the backend's answer about `facts` into a decision, or a refusal.
    ///
    /// The answer is borrowed: the verdicts of a batch are a few hundred bytes, and this runs
    /// on every request.
    pub(crate) fn decide<T>(
        &self,
        result: &Result<Verdicts, BackendError>,
        req: &Request<T>,
        facts: &Facts,
        kept: &mut KeptKeys,
    ) -> Decided {
        // Warnings about bypasses and capacity are logged inside the request's span.
        let _entered = facts.span.enter();
        // Where each limit's units went, in the layer's order, for a settle.
        let mut receipts = [Receipt::default(); MAX_CHECKS];
        let decision = match result {
            Ok(verdicts) if verdicts.len() == facts.n => {
                if facts.set.settles {
                    for (j, &i) in facts.limit_of[..facts.n].iter().enumerate() {
                        receipts[i] = verdicts.receipt(j);
                    }
                }
                // One limit, checked (most layers): its verdict is the decision.
                if let ([entry], [verdict]) = (&*facts.set.limits, &verdicts[..]) {
                    let outcome = Outcome::from_verdict(verdict);
                    Decision::one(
                        entry
                            .decision(outcome, Source::Backend, facts.quota_of[0])
                            .leased(verdicts.from_lease(0)),
                    )
                } else {
                    decision_of(verdicts, facts)
                }
            }
            Ok(verdicts) => {
                let error = BackendError::new(
                    BackendErrorKind::Protocol,
                    format!("{} verdicts for {} checks", verdicts.len(), facts.n),
                );
                self.decide_failure(&error, facts, kept, &mut receipts)
            }
            Err(error) => self.decide_failure(error, facts, kept, &mut receipts),
        };
        let admitted = decision.is_admitted();
        for (entry, d) in facts.set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted);
        }
        obs::record_span(&facts.span, &decision);
        if admitted {
            let owed = if facts.set.settles {
                owed(&decision, facts, kept, &receipts)
            } else {
                None
            };
            let slots = if facts.set.has_slots {
                taken_slots(&decision, facts, kept)
            } else {
                None
            };
            return Decided::Admit(decision, owed, slots);
        }
        Decided::Refuse(self.refuse_decision(decision, req, &facts.set))
    }
}

/// What an admitted request owes the metered limits that settle: the units each took, where,
/// and under which key and quota (its key moves out of `kept`).
fn owed(
    decision: &Decision,
    facts: &Facts,
    kept: &mut KeptKeys,
    receipts: &[Receipt; MAX_CHECKS],
) -> Option<Vec<Item>> {
    let mut items = Vec::new();
    let set = &facts.set;
    for (i, (entry, d)) in set.limits.iter().zip(decision.limits()).enumerate() {
        let Some(metered) = entry.metered.as_ref().filter(|m| m.settles()) else {
            continue;
        };
        if !matches!(d.outcome(), Outcome::Allowed { .. }) {
            continue;
        }
        // A concurrency limit's slot gives its key back too: it keeps a copy.
        let key = if entry.limit.algorithm() == Algorithm::Concurrency {
            kept.get(i).cloned()
        } else {
            kept.take(i)
        };
        let Some(key) = key else {
            continue;
        };
        let fallback = d.source() == Source::Fallback;
        // The quota the check was made under: the request's plan's, in the limiter that
        // counted it.
        let counted_by = match (&entry.local, fallback) {
            (Some(local), true) => local,
            _ => &entry.limit,
        };
        items.push(Item {
            reservation: Reservation {
                entry: i,
                key,
                units: facts.cost[i],
                receipt: receipts[i],
                quota: *counted_by.quota_at(usize::from(facts.quota_of[i])),
                fallback,
            },
            by_handler: metered.by_handler,
            on_drop: metered.on_drop,
            counted: true,
        });
    }
    // A limit charged by the handler gives every admitted request a `Settle` handle, even
    // one whose reservation nothing counts (a bypass, a missing key): the handler that
    // takes it must find it.
    (set.charged_by_handler || !items.is_empty()).then_some(items)
}

/// The decision of every verdict: each limit's outcome is its verdict, or a skip for a
/// limit that had no key, in the layer's order.
fn decision_of(verdicts: &Verdicts, facts: &Facts) -> Decision {
    let mut checked = facts.limit_of[..facts.n].iter().zip(verdicts.iter());
    let mut next = checked.next();
    let mut j = 0;
    facts
        .set
        .limits
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let (outcome, leased) = match next {
                Some((&at, verdict)) if at == i => {
                    next = checked.next();
                    j += 1;
                    (Outcome::from_verdict(verdict), verdicts.from_lease(j - 1))
                }
                _ => {
                    let reason = SkipReason::MissingKey;
                    (Outcome::Skipped { reason }, false)
                }
            };
            entry
                .decision(outcome, Source::Backend, facts.quota_of[i])
                .leased(leased)
        })
        .collect()
}

/// The concurrency slots `decision` says the request took, with their keys (moved out of
/// `kept`): given back when the request is done.
fn taken_slots(decision: &Decision, facts: &Facts, kept: &mut KeptKeys) -> Option<Taken> {
    let mut items = Vec::new();
    for (i, (entry, d)) in facts.set.limits.iter().zip(decision.limits()).enumerate() {
        let took = entry.limit.algorithm() == Algorithm::Concurrency
            && matches!(d.outcome(), Outcome::Allowed { .. });
        if let (true, Some(key)) = (took, kept.take(i)) {
            items.push((i, key, d.source()));
        }
    }
    (!items.is_empty()).then_some(Taken { items })
}
