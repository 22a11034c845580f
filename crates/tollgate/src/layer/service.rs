//! [`RateLimit`], the service a [`RateLimitLayer`](crate::RateLimitLayer) wraps around
//! another.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tollgate_engine::{Backend, MemoryBackend};
use tower_service::Service;

use super::body::ResponseBody;
use super::decide::Decided;
use super::future::{ResponseFuture, Svc};
use super::prepare::{KeptKeys, Start};
use super::state::Shared;
use crate::adaptive::{AdaptiveDecision, Admission};

/// The service a [`RateLimitLayer`](crate::RateLimitLayer) wraps around `S`.
///
/// An answer that is ready at once (every in-memory answer, a Redis deny-cache hit) is taken in
/// [`call`](Service::call) itself.
pub struct RateLimit<S, B = MemoryBackend> {
    inner: S,
    shared: Arc<Shared<B>>,
}

impl<S, B> RateLimit<S, B> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<B>>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, without the rate limit.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, B> Clone for RateLimit<S, B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, B, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, B>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    B: Backend,
    ResBody: Body<Data = Bytes>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let Some(guard) = &self.shared.adaptive else {
            return start(
                &self.shared,
                req,
                Svc::Ready(&mut self.inner, S::clone),
                None,
            );
        };
        // The adaptive limit first: a shed request never reaches the backend.
        match guard.admit(&req) {
            Admission::Admitted(permit) => {
                let part = Some(permit.part);
                let svc = Svc::Ready(&mut self.inner, S::clone);
                start(&self.shared, req, svc, part).holding(permit)
            }
            // Waits for its turn with the service that was polled ready; a fresh clone takes
            // its place.
            Admission::Wait(waiting) => {
                let inner = Svc::Ready(&mut self.inner, S::clone).owned();
                ResponseFuture::admitting(waiting, req, inner, Arc::clone(&self.shared))
            }
            Admission::Shed(part) => ResponseFuture::refused(self.shared.refuse_shed(part, &req)),
        }
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
        Start::Ask(check, facts) => {
            ResponseFuture::checking(check, req, inner.owned(), (facts, kept), shared)
        }
        Start::Refuse(response) => ResponseFuture::refused(response),
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

impl<S: std::fmt::Debug, B: Backend> std::fmt::Debug for RateLimit<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("layer", &self.shared)
            .finish()
    }
}
