//! A request's facts, decided once: the limit set it is checked under, each limit's key,
//! quota and cost, its slot id, and the backend call that asks about them.
//!
//! Every extractor runs here and nowhere else. A key borrows from the request while the
//! checks are made; one that is needed after the check (to settle, to give a slot back, or for
//! the local fallback limiter: [`SetLimit::keeps_key`]) is kept owned in the [`KeptKeys`] beside
//! the [`Facts`], inline when short. The backend's future owns what it needs, so nothing
//! borrows the request once the call has started.
//!
//! A lone limit with nothing to do after its check ([`LimitSet::straight`]) takes a straight
//! line instead: its check, and its decision when the backend answers at once, without facts.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use arc_swap::Guard;
use bytes::Bytes;
use http::{Request, Response};
use tollgate_engine::{Algorithm, Backend, Check, MissingKeyPolicy, MAX_CHECKS};

use super::decide::Decided;
use super::facts::{Facts, KeptKeys};
use super::limits::{LimitSet, SetLimit};
use super::queue::{Queueing, Ticket};
use super::slots::next_id;
use super::state::Shared;
use super::wait::WaitSeats;
use crate::decision::{Decision, Outcome, Source};
use crate::key::{Key, MissingKey, RequestView};
use crate::plan::Plan;
use crate::span::CheckSpan;

/// The key of the one bucket shared by keyless requests ([`MissingKeyPolicy::SharedBucket`]).
/// Extracted keys cannot take this value: IP keys start with a 4 or 6 byte, tenants are ASCII.
const SHARED_BUCKET: &[u8] = b"\xffshared-bucket";

/// How a request starts.
pub(crate) enum Start<F> {
    /// The backend is asked (`F` is its answer) about the request's [`Facts`].
    Ask(F, Facts),
    /// Not checked yet: it waits in a queued limit's line behind others (`facts.queueing`).
    Queue(Facts),
    /// Admitted without asking the backend (allowlisted).
    Admit(Decision),
    /// Refused before asking (denylisted, a missing key, a cost that is none).
    Refuse(Response<Bytes>),
    /// Asked on the straight line ([`LimitSet::straight`]), which polled the answer once: it
    /// is pending.
    Asked(F, Facts),
    /// Decided already: the straight line's answer came at once.
    Decided(Decided),
}

/// One limit's key as extracted, and whether it is kept.
#[derive(Default)]
enum Extracted<'r> {
    /// The limit is skipped (no key, and its policy skips).
    #[default]
    None,
    /// Borrowed from the request, for the check only.
    Borrowed(Key<'r>),
    /// Kept in the [`Facts`] at the limit's index.
    Kept,
}

impl Extracted<'_> {
    /// The key's bytes (the kept key of the limit at `i` in `kept`); `None` when skipped.
    #[inline]
    fn key<'a>(&'a self, kept: &'a KeptKeys, i: usize) -> Option<&'a [u8]> {
        match self {
            Extracted::None => None,
            Extracted::Borrowed(key) => Some(key.as_bytes()),
            Extracted::Kept => kept.get(i).map(Key::as_bytes),
        }
    }
}

impl<B: Backend> Shared<B> {
    /// Decides the request's facts (its kept keys into `kept`) and starts the backend call;
    /// or admits an allowlisted request, or refuses a denylisted one (the allowlist wins) or
    /// one without a key or a valid cost.
    pub(crate) fn prepare<T>(&self, req: &Request<T>, kept: &mut KeptKeys) -> Start<B::Future> {
        // Only a subscriber that wants debug spans gets one (`names` is built once, when the
        // layer is). Otherwise the span is `none`: a disabled span still costs, on every
        // request, what `tracing`'s `log` compatibility does when no subscriber is set (its
        // fields formatted, each enter and exit checked against the `log` level).
        let set = self.set.load();
        let span = CheckSpan::new(&set.names);
        let view = RequestView::new(req);
        if set.straight {
            // Its facts, and the count on the set that they hold, only if it goes on.
            return self.straight(&set, span, &view, req, kept);
        }
        let set = Guard::into_inner(set);
        if let Some(allowlist) = &set.allowlist {
            if allowlist.matches(&view) {
                return Start::Admit(allowlisted(&set, &span));
            }
        }
        if let Some(denylist) = &set.denylist {
            if denylist.matches(&view) {
                return Start::Refuse(self.respond.refuse_denylisted(&set, req, &span, None));
            }
        }
        // A layer of an adaptive limit alone (which admitted the request before).
        if set.limits.is_empty() {
            return Start::Admit(Decision::new(Vec::new()));
        }
        // The request's plan is looked up only when some limit has plans: its extension, or
        // what the layer's plan function makes of the request.
        let chosen;
        let plan_name = match (set.plans, req.extensions().get::<Plan>()) {
            (false, _) => None,
            (true, Some(plan)) => Some(plan.as_str()),
            (true, None) => {
                chosen = self.plan_fn.as_ref().and_then(|f| f(&view));
                chosen.as_ref().map(Plan::as_str)
            }
        };
        let slot = if set.has_slots { next_id() } else { 0 };
        // Given back if the request is refused before its check.
        let mut seats = set.delays.then(|| WaitSeats::new(&self.waiters));
        let mut n = 0;
        let mut limit_of = [0; MAX_CHECKS];
        let mut tally = Tally::default();
        // A place behind those who wait for a queued limit's slots of the same key: taken
        // instead of a check, so as not to pass them.
        let mut behind = None;
        // One limit or several (a lone limit with nothing after its check takes the
        // straight line): every key first, so that a missing one refuses before any check.
        let mut extracted: [Extracted<'_>; MAX_CHECKS] = Default::default();
        for (i, entry) in set.limits.iter().enumerate() {
            match extract(entry, &view, kept, i) {
                Ok(key) => extracted[i] = key,
                Err(missing) => {
                    return Start::Refuse(self.respond.refuse_keyless(entry, missing, req, &span))
                }
            }
        }
        let mut checks = [Check::new(&set.limits[0].limit, b""); MAX_CHECKS];
        for (i, entry) in set.limits.iter().enumerate() {
            let Some(key) = extracted[i].key(kept, i) else {
                continue;
            };
            let asked = (plan_name, slot, (&view, req, &*span));
            checks[n] = match self.check_of(entry, i, key, asked, &mut tally, &mut seats) {
                Ok(check) => check,
                Err(refusal) => return Start::Refuse(*refusal),
            };
            if set.queues && behind.is_none() {
                behind = self.behind(&checks[n], i);
            }
            limit_of[n] = i;
            n += 1;
        }
        let check = behind
            .is_none()
            .then(|| ask(&span, || self.backend.check(&checks[..n])));
        let facts = Facts {
            seats: seats.filter(|p| !p.is_empty()),
            queueing: behind.map(|ticket| Box::new(Queueing::new(ticket))),
            ..tally.facts(set, n, limit_of, slot, span)
        };
        match check {
            Some(check) => Start::Ask(check, facts),
            None => Start::Queue(facts),
        }
    }

    /// The common case ([`LimitSet::straight`]: one limit, nothing to settle, hold, wait or
    /// queue for): its check and, when the backend answers at once, its decision, with no
    /// facts to fill and no key kept. A pending answer, or a failed one, goes on as any other
    /// request's, with its facts made then.
    fn straight<T>(
        &self,
        set: &Arc<LimitSet>,
        span: CheckSpan,
        view: &RequestView<'_>,
        req: &Request<T>,
        kept: &mut KeptKeys,
    ) -> Start<B::Future> {
        let entry = &set.limits[0];
        let key = match key_of(entry, view) {
            Ok(key) => key,
            Err(missing) => {
                return Start::Refuse(self.respond.refuse_keyless(entry, missing, req, &span))
            }
        };
        let checks = key.as_ref().map(|key| {
            let (_, quota) = entry.limit.quota_of(None);
            Check::new(&entry.limit, key.as_bytes()).with_quota(*quota)
        });
        let checks = checks.as_slice();
        let shadowed = checks.first().is_some_and(|c| !c.enforce);
        let mut answer = ask(&span, || self.backend.check(checks));
        let result = match Pin::new(&mut answer).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(verdicts)) if verdicts.len() == 1 => verdicts,
            answered => {
                let mut tally = Tally::default();
                if let Some(check) = checks.first() {
                    (tally.cost[0], tally.shadowed) = (check.cost, u8::from(shadowed));
                }
                let set = Arc::clone(set);
                let mut facts = tally.facts(set, checks.len(), [0; MAX_CHECKS], 0, span);
                if let (Some(key), true) = (key, entry.keeps_key) {
                    kept.put(0, key.into_owned());
                }
                let Poll::Ready(result) = answered else {
                    return Start::Asked(answer, facts);
                };
                // Failed, or the limit skipped (no key): decided now, as any request (a
                // failure by the limit's failure policy).
                return match self.decide(&result, req, &mut facts, kept) {
                    Some(decided) => Start::Decided(decided),
                    None => Start::Queue(facts),
                };
            }
        };
        let _entered = (!span.is_none()).then(|| span.enter());
        let outcome = Outcome::from_verdict(&result[0]);
        let decision = Decision::one(
            entry
                .decision(outcome, Source::Backend, 0)
                .shadowed(shadowed)
                .leased(result.from_lease(0)),
        );
        let admitted = decision.is_admitted();
        self.record(set, &decision, admitted, &span);
        if admitted {
            return Start::Decided(Decided::Admit(decision, None, None, None));
        }
        let keys = |_| key.as_ref().map(Key::as_bytes);
        Start::Decided(Decided::Refuse(self.refuse(decision, set, keys, req)))
    }

    /// A place at the back of `check`'s key's line (the limit at `i` of the layer), if it
    /// is a queued limit's and others wait in it, and it has room (a request without one is
    /// checked, and refused at once if the key is full).
    fn behind(&self, check: &Check<'_>, i: usize) -> Option<Ticket> {
        if check.limit.queue_micros() == 0 || !check.enforce {
            return None;
        }
        self.lines.join(check.limit, i, check.key, true)
    }

    /// `entry`'s check (the limit at `i`) of `key` under the request's plan, with the
    /// request's cost for a metered limit and its limit's delay, tallied; or the refusal of a
    /// cost that is not one.
    fn check_of<'k, T>(
        &self,
        entry: &'k SetLimit,
        i: usize,
        key: &'k [u8],
        (plan_name, slot, (view, req, span)): Asked<'_, '_, T>,
        tally: &mut Tally,
        seats: &mut Option<WaitSeats>,
    ) -> Result<Check<'k>, Box<Response<Bytes>>> {
        let (index, quota) = entry.limit.quota_of(plan_name);
        let mut check = Check::new(&entry.limit, key)
            .with_quota(*quota)
            .with_slot(slot);
        if let Some(of) = entry.metered.as_ref().and_then(|m| m.cost.as_ref()) {
            match of(view) {
                // A concurrency slot is a request: none taken would pass a full limit, and
                // its release would free a slot another request holds.
                Ok(0) if entry.limit.algorithm() == Algorithm::Concurrency => {
                    return Err(Box::new(self.respond.refuse_invalid_cost(entry, req, span)))
                }
                Ok(units) => check = check.with_cost(units),
                Err(_) => return Err(Box::new(self.respond.refuse_invalid_cost(entry, req, span))),
            }
        }
        // A limit has at most `MAX_PLANS` plans.
        tally.quota_of[i] = u8::try_from(index).unwrap_or(0);
        tally.cost[i] = check.cost;
        tally.shadowed |= u8::from(!check.enforce) << i;
        Ok(delayed(check, i, seats.as_mut()))
    }
}

/// What every limit's check of one request is asked with: the request's plan, its slot id,
/// and the request (its view, itself, its span) for a cost or a refusal.
type Asked<'a, 'r, T> = (
    Option<&'a str>,
    u128,
    (&'a RequestView<'r>, &'a Request<T>, &'a tracing::Span),
);

/// Per limit, what its check took of the request, kept in the [`Facts`].
#[derive(Default)]
struct Tally {
    quota_of: [u8; MAX_CHECKS],
    cost: [u32; MAX_CHECKS],
    shadowed: u8,
}

impl Tally {
    /// The facts of a request checked under `set`'s limits (`n` of them, the limit of each
    /// check in `limit_of`) with this tally, its slot id and its span; no seat, no place.
    fn facts(
        self,
        set: Arc<LimitSet>,
        n: usize,
        limit_of: [usize; MAX_CHECKS],
        slot: u128,
        span: CheckSpan,
    ) -> Facts {
        Facts {
            set,
            n,
            limit_of,
            quota_of: self.quota_of,
            cost: self.cost,
            shadowed: self.shadowed,
            slot,
            span,
            seats: None,
            queueing: None,
        }
    }
}

/// `call` (the backend's check) inside `span`, unless the span is off (most requests): then
/// without entering it.
#[inline]
fn ask<F>(span: &CheckSpan, call: impl FnOnce() -> F) -> F {
    if span.is_none() {
        call()
    } else {
        span.in_scope(call)
    }
}

/// `check` with its limit's delay (the limit at `i` of the layer): an unenforced check's always
/// (it reports what its delay would do, and nobody waits for it), an enforced limit's only
/// when the request takes a seat among the key's waiters (checked without it otherwise).
#[inline]
fn delayed<'k>(check: Check<'k>, i: usize, seats: Option<&mut WaitSeats>) -> Check<'k> {
    let delay = check.limit.delay_micros();
    match seats {
        Some(seats) if delay > 0 => {
            if !check.enforce || seats.enter(i, check.limit, check.key) {
                check.with_delay(delay)
            } else {
                check
            }
        }
        _ => check,
    }
}

/// `entry`'s key of the request, under its missing-key policy: kept in `kept` (owned, at
/// `i`) when the entry keeps its key, else borrowed.
#[inline]
fn extract<'r>(
    entry: &SetLimit,
    view: &RequestView<'r>,
    kept: &mut KeptKeys,
    i: usize,
) -> Result<Extracted<'r>, MissingKey> {
    let Some(key) = key_of(entry, view)? else {
        return Ok(Extracted::None);
    };
    if entry.keeps_key {
        kept.put(i, key.into_owned());
        Ok(Extracted::Kept)
    } else {
        Ok(Extracted::Borrowed(key))
    }
}

/// `entry`'s key of the request, under its missing-key policy: `None` when the limit is
/// skipped.
#[inline]
fn key_of<'r>(entry: &SetLimit, view: &RequestView<'r>) -> Result<Option<Key<'r>>, MissingKey> {
    match entry.key.extract(view) {
        Ok(key) => Ok(Some(key)),
        Err(missing) => match entry.limit.missing_key_policy() {
            // A shadow limit never refuses a request, not even one without its key; nor does
            // a partly enforced one (a request without a key is in no share).
            _ if entry.limit.enforced_percent() < 100 => Ok(None),
            // A key that is there but unusable (too long, a bad character) is refused
            // whatever the policy: skipping it or sharing a bucket would let a client leave
            // the limit by sending garbage.
            _ if !missing.is_absent() => Err(missing),
            MissingKeyPolicy::Skip => Ok(None),
            MissingKeyPolicy::SharedBucket => Key::borrowed(SHARED_BUCKET).map(Some),
            _ => Err(missing),
        },
    }
}

/// The decision of a request that `set`'s allowlist matched: every limit `Allowlisted`.
fn allowlisted(set: &LimitSet, span: &CheckSpan) -> Decision {
    let decision: Decision = set
        .limits
        .iter()
        .map(|entry| entry.decision(Outcome::Allowlisted, Source::Backend, 0))
        .collect();
    for (entry, d) in set.limits.iter().zip(decision.limits()) {
        // Allowlisted: never near the limit.
        entry.metrics.record(d, true, 0);
    }
    span.record(&decision, false);
    decision
}
