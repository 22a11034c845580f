//! [`RateLimit`], the service a [`RateLimitLayer`](crate::RateLimitLayer) wraps around
//! another.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tollgate_engine::{Backend, MemoryBackend};
use tower_service::Service;

use super::body::ResponseBody;
use super::future::{start, ResponseFuture};
use super::refusal::shed;
use super::state::Shared;
use super::svc::Svc;
use crate::adaptive::Admission;

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
            Admission::Shed(part) => ResponseFuture::refused(shed(&self.shared, part, &req)),
        }
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
