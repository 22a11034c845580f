//! [`ResponseFuture`]: a request's way from its backend call to the inner service's answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tollgate_engine::Backend;
use tower_service::Service;

use super::body::{Both, Hold, ResponseBody};
use super::decide::{Decided, Wait};
use super::facts::{Facts, KeptKeys};
use super::limits::LimitSet;
use super::prepare::Start;
use super::queued::Queued;
use super::refusal::shed;
use super::settle::{Owed, Refund, SetSink, Settler};
use super::slots::HeldSlots;
use super::state::Shared;
pub(crate) use super::svc::Svc;
use super::wait::WaitSeats;
use crate::adaptive::{AdaptiveDecision, Permit, PermitWait};
use crate::cost::Settle;
use crate::decision::Decision;

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    pub struct ResponseFuture<S, B, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        B: Backend,
    {
        #[pin]
        state: State<S, B, ReqBody>,
        // The adaptive limit's permit: given back when the request is refused, when this
        // future is dropped unanswered, or with the response body. Boxed: the future of a
        // layer without one stays as small as it was.
        permit: Option<Box<Permit>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        B: Backend,
    {
        // Waiting for a backend that did not answer at once. Boxed: a networked call costs far
        // more than the allocation, and the future that every admitted request moves around
        // stays small.
        Checking {
            checking: Option<Box<Checking<S, B, ReqBody>>>,
        },
        // Waits in the adaptive limit's queue for a permit, before anything else. Boxed: only
        // such requests pay for the room.
        Admitting {
            admitting: Option<Box<Admitting<S, B, ReqBody>>>,
        },
        // Refused by a queued limit's full key: waits in the key's line for its turn, then
        // is checked again. Boxed: only such requests pay for the room.
        Queued {
            queued: Option<Box<Queued<S, B, ReqBody>>>,
        },
        // Admitted ahead of its time by a delayed limit: waits for it before the inner service
        // is called. Boxed: only such requests pay for the room.
        Waiting {
            waiting: Option<Box<Waiting<S, B, ReqBody>>>,
        },
        Calling {
            #[pin]
            call: S::Future,
            finish: Option<(Decision, Arc<Shared<B>>)>,
            // What the request owes its metered limits: settled when dropped, so a request
            // dropped before its answer follows their drop policy.
            owed: Option<Box<Owed>>,
            // Given back when this future is dropped unanswered, or when the body ends.
            slots: Option<HeldSlots<B>>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

/// A request whose backend call is pending, with the service that will answer it.
struct Checking<S, B: Backend, ReqBody> {
    check: B::Future,
    req: Request<ReqBody>,
    inner: S,
    facts: Facts,
    kept: KeptKeys,
    shared: Arc<Shared<B>>,
}

/// A request waiting in the adaptive limit's queue, with the service that will answer it.
struct Admitting<S, B, ReqBody> {
    waiting: PermitWait,
    req: Request<ReqBody>,
    inner: S,
    shared: Arc<Shared<B>>,
}

/// A request admitted ahead of its time, with everything its call needs once the time comes.
struct Waiting<S, B: Backend, ReqBody> {
    sleep: Pin<Box<Sleep>>,
    req: Request<ReqBody>,
    inner: S,
    finish: Option<(Decision, Arc<Shared<B>>)>,
    /// Gives the request's units back if it is dropped while it waits; what it owes its
    /// metered limits when its time comes.
    owed: Refund,
    slots: Option<HeldSlots<B>>,
    /// Its seats among the waiters: given back when the wait ends or is dropped.
    seats: Option<WaitSeats>,
}

impl<S, B, ReqBody> ResponseFuture<S, B, ReqBody>
where
    S: Service<Request<ReqBody>>,
    B: Backend,
{
    pub(crate) fn checking(
        check: B::Future,
        req: Request<ReqBody>,
        inner: S,
        (facts, kept): (Facts, KeptKeys),
        shared: Arc<Shared<B>>,
    ) -> Self {
        Self {
            permit: None,
            state: State::Checking {
                checking: Some(Box::new(Checking {
                    check,
                    req,
                    inner,
                    facts,
                    kept,
                    shared,
                })),
            },
        }
    }

    /// A request that waits in the adaptive limit's queue before anything else.
    pub(crate) fn admitting(
        waiting: PermitWait,
        req: Request<ReqBody>,
        inner: S,
        shared: Arc<Shared<B>>,
    ) -> Self {
        Self {
            permit: None,
            state: State::Admitting {
                admitting: Some(Box::new(Admitting {
                    waiting,
                    req,
                    inner,
                    shared,
                })),
            },
        }
    }

    /// This future, holding the adaptive limit's `permit` until the response ends (given back
    /// at once if the request is refused).
    pub(crate) fn holding(mut self, permit: Permit) -> Self {
        if !matches!(self.state, State::Refused { .. }) {
            self.permit = Some(Box::new(permit));
        }
        self
    }

    /// A request that waits in a queued limit's line (`facts.queueing`) before its check.
    pub(crate) fn queued(
        req: Request<ReqBody>,
        inner: S,
        parts: (Facts, KeptKeys),
        shared: Arc<Shared<B>>,
    ) -> Self {
        Self {
            permit: None,
            state: State::Queued {
                queued: Some(Box::new(Queued::new(req, inner, parts, shared))),
            },
        }
    }

    /// What follows the backend's answer: an admitted request goes to `inner` with the
    /// decision in its extensions; a refused one gets its response.
    pub(crate) fn decided(
        decided: Decided,
        mut req: Request<ReqBody>,
        inner: Svc<'_, S>,
        shared: Arc<Shared<B>>,
        checked: Option<(&Arc<LimitSet>, u128)>,
        part: Option<AdaptiveDecision>,
    ) -> Self {
        match decided {
            Decided::Admit(decision, owed, slots, wait) => {
                let decision = match part {
                    Some(part) => decision.with_adaptive(part),
                    None => decision,
                };
                let slots = match (slots, checked) {
                    (Some(taken), Some(checked)) => Some(HeldSlots::hold(&shared, taken, checked)),
                    _ => None,
                };
                // A copy stays for the response, unless the layer adds nothing to it.
                let for_response = shared
                    .respond
                    .adds_to_response(&decision)
                    .then(|| decision.clone());
                // Under an outer `RateLimitLayer`, the handler sees both layers' limits.
                if let Some(outer) = req.extensions_mut().insert(decision) {
                    let both = req.extensions().get::<Decision>().map(|d| outer.then(d));
                    if let Some(both) = both {
                        req.extensions_mut().insert(both);
                    }
                }
                // The limits the request was checked under, even if a reload has replaced them
                // since.
                let sink = |set: &Arc<LimitSet>| -> Arc<dyn Settler> {
                    Arc::new(SetSink {
                        shared: Arc::clone(&shared),
                        set: Arc::clone(set),
                    })
                };
                let mut owed = match (owed, checked) {
                    (Some(items), Some((set, _))) => Some(Box::new(Owed::new(sink(set), items))),
                    _ => None,
                };
                if let Some(owed) = owed.as_mut() {
                    match req.extensions().get::<Settle>() {
                        // Under an outer layer charged by the handler too: one handle for both.
                        Some(outer) => owed.share(outer),
                        None => {
                            if let Some(handle) = owed.handle() {
                                req.extensions_mut().insert(handle.clone());
                            }
                        }
                    }
                }
                if let Some(wait) = wait {
                    let Wait {
                        wait,
                        seats,
                        refund,
                    } = *wait;
                    let refund = match checked {
                        Some((set, _)) if !refund.is_empty() => Some(Owed::new(sink(set), refund)),
                        _ => None,
                    };
                    let finish = for_response.map(|decision| (decision, shared));
                    return Self {
                        permit: None,
                        state: State::Waiting {
                            waiting: Some(Box::new(Waiting {
                                sleep: Box::pin(tokio::time::sleep_until(Instant::now() + wait)),
                                req,
                                inner: inner.owned(),
                                finish,
                                owed: Refund::new(refund, owed),
                                slots,
                                seats,
                            })),
                        },
                    };
                }
                Self {
                    permit: None,
                    state: State::Calling {
                        call: inner.call(req),
                        finish: for_response.map(|decision| (decision, shared)),
                        owed,
                        slots,
                    },
                }
            }
            Decided::Refuse(response) => Self::refused(response),
        }
    }

    pub(crate) fn refused(response: Response<Bytes>) -> Self {
        Self {
            permit: None,
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<S, B, ReqBody, ResBody> Future for ResponseFuture<S, B, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    B: Backend,
    ResBody: Body<Data = Bytes>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        const DONE: &str = "ResponseFuture polled after completion";
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Admitting { admitting } => {
                    let Some(a) = admitting.as_mut() else {
                        panic!("{DONE}");
                    };
                    let turn = ready!(a.waiting.poll_turn(cx));
                    let Some(a) = admitting.take() else {
                        panic!("{DONE}");
                    };
                    let Admitting {
                        req, inner, shared, ..
                    } = *a;
                    let next = match turn {
                        Ok(permit) => {
                            let part = Some(permit.part);
                            start(&shared, req, Svc::Owned(inner), part).holding(permit)
                        }
                        Err(part) => Self::refused(shed(&shared, part, &req)),
                    };
                    *this.permit = next.permit;
                    this.state.set(next.state);
                }
                StateProj::Checking { checking } => {
                    let Some(waiting) = checking.as_mut() else {
                        panic!("{DONE}");
                    };
                    let result = ready!(Pin::new(&mut waiting.check).poll(cx));
                    let Some(mut waiting) = checking.take() else {
                        panic!("{DONE}");
                    };
                    let decided = {
                        let w = &mut *waiting;
                        w.shared.decide(&result, &w.req, &mut w.facts, &mut w.kept)
                    };
                    let Checking {
                        req,
                        inner,
                        facts,
                        kept,
                        shared,
                        ..
                    } = *waiting;
                    let Some(decided) = decided else {
                        let queued = Self::queued(req, inner, (facts, kept), shared);
                        this.state.set(queued.state);
                        continue;
                    };
                    let part = this.permit.as_ref().map(|p| p.part);
                    this.state.set(
                        Self::decided(
                            decided,
                            req,
                            Svc::Owned(inner),
                            shared,
                            Some((&facts.set, facts.slot)),
                            part,
                        )
                        .state,
                    );
                }
                StateProj::Queued { queued } => {
                    let Some(q) = queued.as_mut() else {
                        panic!("{DONE}");
                    };
                    let decided = ready!(q.poll_turn(cx));
                    let Some(q) = queued.take() else {
                        panic!("{DONE}");
                    };
                    let Queued {
                        req,
                        inner,
                        facts,
                        shared,
                        ..
                    } = *q;
                    // Its place goes back with its facts, once it holds what it was given.
                    let part = this.permit.as_ref().map(|p| p.part);
                    this.state.set(
                        Self::decided(
                            decided,
                            req,
                            Svc::Owned(inner),
                            shared,
                            Some((&facts.set, facts.slot)),
                            part,
                        )
                        .state,
                    );
                }
                StateProj::Waiting { waiting } => {
                    let Some(w) = waiting.as_mut() else {
                        panic!("{DONE}");
                    };
                    ready!(w.sleep.as_mut().poll(cx));
                    let Some(w) = waiting.take() else {
                        panic!("{DONE}");
                    };
                    let Waiting {
                        req,
                        mut inner,
                        finish,
                        owed,
                        slots,
                        seats,
                        ..
                    } = *w;
                    // Its time has come: the units stay taken, and its seats go back.
                    let owed = owed.release();
                    drop(seats);
                    this.state.set(State::Calling {
                        call: inner.call(req),
                        finish,
                        owed,
                        slots,
                    });
                }
                StateProj::Calling {
                    call,
                    finish,
                    owed,
                    slots,
                } => {
                    if let Some(permit) = this.permit.as_mut() {
                        permit.start();
                    }
                    let mut response = match ready!(call.poll(cx)) {
                        Ok(response) => response,
                        Err(error) => {
                            if let Some(mut permit) = this.permit.take() {
                                permit.answered(true);
                            }
                            // No response: `count_if` judges the error as the 500 a server
                            // makes of it, and the reservations settle now.
                            if let Some(mut owed) = owed.take() {
                                owed.failed();
                            }
                            return Poll::Ready(Err(error));
                        }
                    };
                    // The slots and the permit stay held until the body ends or is dropped.
                    let permit = this.permit.take().map(|mut permit| {
                        permit.answered(response.status().is_server_error());
                        permit as Box<dyn Hold>
                    });
                    let hold = Both::of(slots.take().map(|s| Box::new(s) as Box<dyn Hold>), permit);
                    let Some(mut owed) = owed.take() else {
                        if let Some((decision, shared)) = finish.take() {
                            shared.respond.finish(&shared.set, &mut response, decision);
                        }
                        return Poll::Ready(Ok(
                            response.map(|b| ResponseBody::inner(b).holding(hold))
                        ));
                    };
                    owed.responded(&response);
                    if let Some((decision, shared)) = finish.take() {
                        // The response's decision and fields show the settled state when
                        // the actual cost is known with the head.
                        shared
                            .respond
                            .finish(&shared.set, &mut response, owed.settled(decision));
                    }
                    if owed.waits_for_body() {
                        return Poll::Ready(Ok(
                            response.map(|b| ResponseBody::settling(b, owed).holding(hold))
                        ));
                    }
                    // Everything is known with the head: settle now (the backend does not
                    // wait for its answer).
                    drop(owed);
                    return Poll::Ready(Ok(response.map(|b| ResponseBody::inner(b).holding(hold))));
                }
                StateProj::Refused { response } => {
                    let Some(response) = response.take() else {
                        panic!("{DONE}");
                    };
                    // Refused by another limit: no sample, and the permit goes back now.
                    drop(this.permit.take());
                    return Poll::Ready(Ok(response.map(ResponseBody::refusal)));
                }
            }
        }
    }
}

impl<S, B, ReqBody> std::fmt::Debug for ResponseFuture<S, B, ReqBody>
where
    S: Service<Request<ReqBody>>,
    B: Backend,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// A request's way through the layer's limits once the adaptive limit (if any) admitted it
/// (`part`): its facts, its check, and then the service (`inner`) or its refusal.
pub(crate) fn start<S, B, ReqBody>(
    shared: &Arc<Shared<B>>,
    req: Request<ReqBody>,
    inner: Svc<'_, S>,
    part: Option<AdaptiveDecision>,
) -> ResponseFuture<S, B, ReqBody>
where
    S: Service<Request<ReqBody>>,
    B: Backend,
{
    // The prepared check (its answer inline) is a few hundred bytes: it is answered in
    // place, and only a pending answer moves it, into the future.
    let mut kept = KeptKeys::default();
    let mut start = shared.prepare(&req, &mut kept);
    if let Start::Ask(check, facts) = &mut start {
        // The in-memory backend, and a networked one's local deny cache, answer at once.
        // Then the request goes straight to the service that was polled ready: no clone of
        // it, and no trip of the request through the future.
        let answer = Pin::new(check).poll(&mut Context::from_waker(Waker::noop()));
        if let Poll::Ready(result) = &answer {
            if let Some(decided) = shared.decide(result, &req, facts, &mut kept) {
                let checked = Some((&facts.set, facts.slot));
                let shared = Arc::clone(shared);
                return ResponseFuture::decided(decided, req, inner, shared, checked, part);
            }
        }
    }
    let shared = Arc::clone(shared);
    match start {
        // Refused by a queued limit's full key, or behind others in its line: waits for
        // its turn with the service that was polled ready; a fresh clone takes its place.
        Start::Ask(_, facts) if facts.queueing.is_some() => {
            ResponseFuture::queued(req, inner.owned(), (facts, kept), shared)
        }
        Start::Queue(facts) => ResponseFuture::queued(req, inner.owned(), (facts, kept), shared),
        // Pending: polled again, with the task's waker, by the future. The service that
        // was polled ready is called later; a fresh clone takes its place.
        Start::Ask(check, facts) | Start::Asked(check, facts) => {
            ResponseFuture::checking(check, req, inner.owned(), (facts, kept), shared)
        }
        Start::Refuse(response) => ResponseFuture::refused(response),
        // Nothing it holds is given back or settled against the limits it was checked under.
        Start::Decided(decided) => ResponseFuture::decided(decided, req, inner, shared, None, part),
        Start::Admit(decision) => ResponseFuture::decided(
            Decided::Admit(decision, None, None, None),
            req,
            inner,
            shared,
            None,
            part,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::settle::Item;
    use http_body_util::Full;
    use tollgate_engine::MemoryBackend;

    type Handler = tower::util::ServiceFn<
        fn(Request<Full<Bytes>>) -> std::future::Ready<Result<Response<Full<Bytes>>, ()>>,
    >;

    /// What one waiting request of one delayed limit holds, in bytes, on a 64-bit target
    /// (written in docs/benchmarks.md): the boxed state (the request's head and the service
    /// included) and its timer, one seat's entry, and the limit's refund; besides, its key's
    /// bytes twice (the seat's copy, and the refund's key, inline when short).
    #[test]
    fn a_waiter_holds_under_a_kilobyte() {
        let state = std::mem::size_of::<Waiting<Handler, MemoryBackend, Full<Bytes>>>();
        let sleep = std::mem::size_of::<Sleep>();
        // One seat: its entry in the request's `WaitSeats` (and the key's copy, beside the
        // waiters' map's entry, which is per key).
        let seat = std::mem::size_of::<(usize, u64, Box<[u8]>)>();
        // The refund of one limit: its `Item` and the settle sink's `Arc` (two counts, two
        // pointers).
        let refund = std::mem::size_of::<Item>() + 2 * 8 + 2 * 8;
        let total = state + sleep + seat + refund;
        println!("waiter: state {state} + sleep {sleep} + seat {seat} + refund {refund} = {total} bytes, plus its key");
        assert!(total < 1024, "{total}");
    }
}
