//! The backend's answer about a request's [`Facts`], made a [`Decision`]: admitted (with what
//! it owes its metered limits and the slots it holds), or refused.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::{
    Algorithm, Backend, BackendError, BackendErrorKind, Receipt, Verdicts, MAX_CHECKS,
};

use super::limits::LimitSet;
use super::prepare::Facts;
use super::settle::{Item, Reservation};
use super::slots::Taken;
use super::state::Shared;
use crate::decision::{Decision, Outcome, SkipReason, Source};
use crate::metrics as obs;

/// What follows a request's decision.
pub(crate) enum Decided {
    /// Admitted: the request goes on to the inner service.
    Admit(Admitted),
    /// Refused, with its response.
    Refuse(Response<Bytes>),
}

/// An admitted request's decision, and what it holds until its answer.
pub(crate) struct Admitted {
    pub(crate) decision: Decision,
    /// What the request owes its metered limits, and the limits it was checked under (it
    /// settles against them even if a reload replaced them since).
    pub(crate) owed: Option<(Vec<Item>, Arc<LimitSet>)>,
    /// The concurrency slots it took.
    pub(crate) slots: Option<Taken>,
}

impl Admitted {
    /// Admitted with nothing owed and no slot (allowlisted).
    pub(crate) fn bare(decision: Decision) -> Self {
        Self {
            decision,
            owed: None,
            slots: None,
        }
    }
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
        facts: &mut Facts,
    ) -> Decided {
        // Warnings about bypasses and capacity are logged inside the request's span.
        let span = std::mem::replace(&mut facts.span, tracing::Span::none());
        let _entered = span.enter();
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
                self.decide_failure(&error, facts, &mut receipts)
            }
            Err(error) => self.decide_failure(error, facts, &mut receipts),
        };
        let admitted = decision.is_admitted();
        for (entry, d) in facts.set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted);
        }
        obs::record_span(&span, &decision);
        if admitted {
            let owed = if facts.set.settles {
                owed(&decision, facts, &receipts)
            } else {
                None
            };
            let slots = if facts.set.has_slots {
                taken_slots(&decision, facts)
            } else {
                None
            };
            return Decided::Admit(Admitted {
                decision,
                owed,
                slots,
            });
        }
        Decided::Refuse(self.refuse_decision(decision, req, &facts.set))
    }
}

/// What an admitted request owes the metered limits that settle: the units each took, where,
/// and under which key and quota (its key moves out of `facts`).
fn owed(
    decision: &Decision,
    facts: &mut Facts,
    receipts: &[Receipt; MAX_CHECKS],
) -> Option<(Vec<Item>, Arc<LimitSet>)> {
    let mut items = Vec::new();
    let set = Arc::clone(&facts.set);
    for (i, (entry, d)) in set.limits.iter().zip(decision.limits()).enumerate() {
        let Some(metered) = entry.metered.as_ref().filter(|m| m.settles()) else {
            continue;
        };
        if !matches!(d.outcome(), Outcome::Allowed { .. }) {
            continue;
        }
        // A concurrency limit's slot gives its key back too: it keeps a copy.
        let key = if entry.limit.algorithm() == Algorithm::Concurrency {
            facts.keys[i].clone()
        } else {
            facts.keys[i].take()
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
    (set.charged_by_handler || !items.is_empty()).then_some((items, set))
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
/// `facts`): given back when the request is done.
fn taken_slots(decision: &Decision, facts: &mut Facts) -> Option<Taken> {
    let mut items = Vec::new();
    for (i, (entry, d)) in facts.set.limits.iter().zip(decision.limits()).enumerate() {
        let took = entry.limit.algorithm() == Algorithm::Concurrency
            && matches!(d.outcome(), Outcome::Allowed { .. });
        if let (true, Some(key)) = (took, facts.keys[i].take()) {
            items.push((i, key, d.source()));
        }
    }
    (!items.is_empty()).then(|| Taken {
        set: Arc::clone(&facts.set),
        slot: facts.slot,
        items,
    })
}
