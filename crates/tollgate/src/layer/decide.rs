//! The backend's answer about a request's [`Facts`], made a [`Decision`]: admitted (with what
//! it then holds: `held.rs`), waiting in a queued limit's line, or refused (`refusal.rs`).

use bytes::Bytes;
use http::{Request, Response};
use std::time::Duration;

use tollgate_engine::{
    algorithm, Backend, BackendError, BackendErrorKind, Micros, Receipt, Verdicts, MAX_CHECKS,
};

use super::facts::{Facts, KeptKeys};
use super::held::{owed, refund, taken_slots};
use super::limits::LimitSet;
use super::queue::Queueing;
use super::report::count_refused;
use super::settle::Item;
use super::slots::Taken;
use super::state::Shared;
use super::wait::WaitSeats;
use crate::decision::{Decision, DenyReason, Outcome, SkipReason, Source};
use crate::key::Key;
use crate::span::CheckSpan;

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
        self.record(&facts.set, &decision, admitted, &facts.span);
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
        let keys = |i| kept.get(i).map(Key::as_bytes);
        Some(Decided::Refuse(
            self.refuse(decision, &facts.set, keys, req),
        ))
    }

    /// Records `decision` (`admitted` or not), reached after the backend's answer under `set`,
    /// in each limit's metrics and in the request's `span`.
    pub(super) fn record(
        &self,
        set: &LimitSet,
        decision: &Decision,
        admitted: bool,
        span: &CheckSpan,
    ) {
        for (entry, d) in set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted, self.near_limit);
        }
        span.record(decision, true);
    }

    /// The refusal of a request that `decision` refused under `set`, its keys by limit in
    /// `keys`: counted under the limits that refused it, then written.
    pub(super) fn refuse<'k, T>(
        &self,
        decision: Decision,
        set: &LimitSet,
        keys: impl Fn(usize) -> Option<&'k [u8]>,
        req: &Request<T>,
    ) -> Response<Bytes> {
        let reports = self.backend.reports();
        count_refused(&self.refused, reports, &decision, set, keys);
        self.respond.refuse_decision(decision, req, set)
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
