//! The backend's answer about a request's [`Facts`], made a [`Decision`]: admitted (with what
//! it owes its metered limits and the slots it holds), or refused.

use bytes::Bytes;
use http::{Request, Response};
use std::time::Duration;

use tollgate_engine::{
    algorithm, Algorithm, Backend, BackendError, BackendErrorKind, Limit, Micros, Receipt,
    Verdicts, MAX_CHECKS,
};

use super::limits::LimitSet;
use super::prepare::{Facts, KeptKeys};
use super::queue::Queueing;
use super::settle::{Item, Reservation};
use super::slots::Taken;
use super::state::Shared;
use super::wait::WaitSeats;
use crate::cost::OnDrop;
use crate::decision::{Decision, DenyReason, Outcome, SkipReason, Source};
use crate::key::Key;
use crate::metrics as obs;

/// What follows a request's decision.
pub(crate) enum Decided {
    /// Admitted: the request goes on to the inner service with its decision, what it owes its
    /// metered limits, and the concurrency slots it took (settled and given back against the
    /// limits it was checked under, even if a reload replaced them since); and its wait, if
    /// a delayed limit admitted it ahead of its time.
    Admit(
        Decision,
        Option<Vec<Item>>,
        Option<Taken>,
        Option<Box<Wait>>,
    ),
    /// Refused, with its response.
    Refuse(Response<Bytes>),
}

/// What a request admitted ahead of its time holds while it waits.
pub(crate) struct Wait {
    /// How long it waits (the latest of its delayed limits' times).
    pub(crate) wait: Duration,
    /// Its seats among the waiters of the limits it waits for.
    pub(crate) seats: Option<WaitSeats>,
    /// What it gives back if it is dropped while it waits: every unit it took (settled with
    /// an actual cost of 0).
    pub(crate) refund: Vec<Item>,
}

impl<B: Backend> Shared<B> {
    /// Turns the backend's answer about `facts` into a decision, or a refusal; `None` when
    /// a queued limit's full key refused the request (and nothing else did) and it waits in
    /// the key's line (its place is in `facts.queueing`).
    ///
    /// The answer is borrowed: the verdicts of a batch are a few hundred bytes, and this runs
    /// on every request.
    pub(crate) fn decide<T>(
        &self,
        result: &Result<Verdicts, BackendError>,
        req: &Request<T>,
        facts: &mut Facts,
        kept: &mut KeptKeys,
    ) -> Option<Decided> {
        // Warnings about bypasses and capacity are logged inside the request's span.
        let _entered = facts.span.enter();
        // Where each limit's units went, in the layer's order, for a settle.
        let mut receipts = [Receipt::default(); MAX_CHECKS];
        // Per limit, how long its admission lies ahead of its time (delayed limits only).
        let mut waits = [0; MAX_CHECKS];
        let decision = match result {
            Ok(verdicts) if verdicts.len() == facts.n => {
                if facts.set.settles || facts.set.delays {
                    for (j, &i) in facts.limit_of[..facts.n].iter().enumerate() {
                        receipts[i] = verdicts.receipt(j);
                    }
                }
                if facts.set.delays {
                    waits = waits_of(verdicts, facts);
                }
                // One limit, checked (most layers): its verdict is the decision.
                if let ([entry], [verdict]) = (&*facts.set.limits, &verdicts[..]) {
                    let outcome = Outcome::from_verdict(verdict);
                    Decision::one(
                        entry
                            .decision(outcome, Source::Backend, facts.quota_of[0])
                            .shadowed(facts.shadowed(0))
                            .leased(verdicts.from_lease(0))
                            .delayed_by(waits[0])
                            .queued_for(queued_at(facts, 0)),
                    )
                } else {
                    decision_of(verdicts, facts, &waits)
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
        if !admitted
            && facts.set.queues
            && self.queue(&decision, &facts.set, &mut facts.queueing, kept)
        {
            return None;
        }
        for (entry, d) in facts.set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted, self.near_limit);
        }
        obs::record_span(&facts.span, &decision);
        facts.span.record(&decision, true);
        // The seats of the limits the request waits for are kept; the others go back.
        let seats = facts.seats.take();
        if admitted {
            // Only a layer with a delayed limit looks: the others pay for nothing.
            let delayed = if facts.set.delays {
                decision.delayed()
            } else {
                None
            };
            // Boxed: what every admitted request moves stays small.
            let wait = delayed.map(|wait| {
                Box::new(Wait {
                    wait,
                    seats: seats.and_then(|p| p.keep_waiting(&waits)),
                    refund: refund(&decision, facts, kept, &receipts),
                })
            });
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
            return Some(Decided::Admit(decision, owed, slots, wait));
        }
        self.count_refused(&decision, facts, kept);
        Some(Decided::Refuse(
            self.refuse_decision(decision, req, &facts.set),
        ))
    }

    /// Whether the request refused by `decision` waits in a queued limit's line: only a full
    /// key of a queued limit refused it, and it holds a place (taken now, at the back of the
    /// first such limit's line, if there is room), and its wait is not over.
    fn queue(
        &self,
        decision: &Decision,
        set: &LimitSet,
        queueing: &mut Option<Box<Queueing>>,
        kept: &KeptKeys,
    ) -> bool {
        let mut line = None;
        for (i, (entry, d)) in set.limits.iter().zip(decision.limits()).enumerate() {
            if !d.refuses() {
                continue;
            }
            let full = matches!(
                d.outcome(),
                Outcome::Denied {
                    reason: DenyReason::InFlight,
                    ..
                }
            );
            if !full || d.source() != Source::Backend || entry.limit.queue_micros() == 0 {
                return false;
            }
            line = line.or(Some(i));
        }
        let Some(line) = line else {
            return false;
        };
        if let Some(queueing) = queueing {
            return !queueing.last;
        }
        let (entry, key) = (&set.limits[line], kept.get(line));
        let Some(key) = key else {
            return false;
        };
        match self.lines.join(&entry.limit, line, key.as_bytes(), false) {
            Some(ticket) => {
                *queueing = Some(Box::new(Queueing::new(ticket)));
                true
            }
            None => false,
        }
    }
}

/// How long the request waited in the line of the limit at `i`, if it waited in its line.
fn queued_at(facts: &Facts, i: usize) -> Micros {
    match &facts.queueing {
        Some(q) if q.ticket.entry() == i => q.waited,
        _ => 0,
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
        // Counted by the limiter that answered: the local one for a fallback admission.
        let counted_by = match (&entry.local, fallback) {
            (Some(local), true) => local,
            _ => &entry.limit,
        };
        items.push(Item {
            reservation: reservation(facts, i, key, receipts, counted_by, fallback),
            by_handler: metered.by_handler,
            on_drop: metered.on_drop,
            counted: true,
            charged: None,
        });
    }
    // A limit charged by the handler gives every admitted request a `Settle` handle, even
    // one whose reservation nothing counts (a bypass, a missing key): the handler that
    // takes it must find it.
    (set.charged_by_handler || !items.is_empty()).then_some(items)
}

/// Where limit `i`'s units of the request went, to settle them later under the quota the check
/// was made under: the request's plan's, in `counted_by`, the limiter that counted them.
fn reservation(
    facts: &Facts,
    i: usize,
    key: Key<'static>,
    receipts: &[Receipt; MAX_CHECKS],
    counted_by: &Limit,
    fallback: bool,
) -> Reservation {
    Reservation {
        entry: i,
        key,
        units: facts.cost[i],
        receipt: receipts[i],
        quota: *counted_by.quota_at(usize::from(facts.quota_of[i])),
        fallback,
    }
}

/// Per limit (in the layer's order), how far ahead of its time a delayed limit admitted the
/// request: how far its reservation lies beyond the burst of the quota it was checked under.
fn waits_of(verdicts: &Verdicts, facts: &Facts) -> [Micros; MAX_CHECKS] {
    let mut waits = [0; MAX_CHECKS];
    let checked = || verdicts.iter().zip(&facts.limit_of[..facts.n]);
    // A refused request waits for nothing (its admitted limits consumed nothing).
    if checked().any(|(v, &i)| !v.is_allowed() && !facts.shadowed(i)) {
        return waits;
    }
    for (verdict, &i) in checked() {
        let limit = &facts.set.limits[i].limit;
        // Only a GCRA limit has a delay (`Limit::delay_up_to` refuses the others).
        if limit.delay_micros() > 0 {
            let quota = limit.quota_at(usize::from(facts.quota_of[i]));
            waits[i] = algorithm::gcra_wait(quota, verdict);
        }
    }
    waits
}

/// What a request that waits gives back if it is dropped before its time: the units every
/// limit took from the backend (a concurrency limit's slot goes back with its guard). A
/// leased limit's are kept: a refund could let other replicas' slices admit more than the
/// quota (as `ConfigError::LeaseWithSettle` says of settles).
fn refund(
    decision: &Decision,
    facts: &Facts,
    kept: &KeptKeys,
    receipts: &[Receipt; MAX_CHECKS],
) -> Vec<Item> {
    // Sized for the limits: a waiter holds it as long as it waits.
    let mut items = Vec::with_capacity(facts.n);
    for (i, (entry, d)) in facts.set.limits.iter().zip(decision.limits()).enumerate() {
        let took = matches!(d.outcome(), Outcome::Allowed { .. })
            && d.source() == Source::Backend
            && entry.limit.algorithm() != Algorithm::Concurrency
            && entry.limit.lease().is_none();
        let Some(key) = kept.get(i).filter(|_| took) else {
            continue;
        };
        items.push(Item {
            reservation: reservation(facts, i, key.clone(), receipts, &entry.limit, false),
            by_handler: false,
            on_drop: OnDrop::Refund,
            counted: true,
            charged: None,
        });
    }
    items
}

/// The decision of every verdict: each limit's outcome is its verdict, or a skip for a
/// limit that had no key, in the layer's order.
fn decision_of(verdicts: &Verdicts, facts: &Facts, waits: &[Micros; MAX_CHECKS]) -> Decision {
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
                .shadowed(facts.shadowed(i))
                .leased(leased)
                .delayed_by(waits[i])
                .queued_for(queued_at(facts, i))
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
