//! What an admitted request holds once it is decided, taken from its decision and [`Facts`]:
//! what it owes its metered limits (settled when it is done), what it gives back if it is
//! dropped while it waits for a delayed limit, and the concurrency slots it took.

use tollgate_engine::{Algorithm, Limit, Receipt, MAX_CHECKS};

use super::facts::{Facts, KeptKeys};
use super::settle::{Item, Reservation};
use super::slots::Taken;
use crate::cost::OnDrop;
use crate::decision::{Decision, Outcome, Source};
use crate::key::Key;

/// What an admitted request owes the metered limits that settle: the units each took, where,
/// and under which key and quota (its key moves out of `kept`).
pub(super) fn owed(
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

/// What a request that waits gives back if it is dropped before its time: the units every
/// limit took from the backend (a concurrency limit's slot goes back with its guard). A
/// leased limit's are kept: a refund could let other replicas' slices admit more than the
/// quota (as `ConfigError::LeaseWithSettle` says of settles).
pub(super) fn refund(
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

/// The concurrency slots `decision` says the request took, with their keys (moved out of
/// `kept`): given back when the request is done.
pub(super) fn taken_slots(
    decision: &Decision,
    facts: &Facts,
    kept: &mut KeptKeys,
) -> Option<Taken> {
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
