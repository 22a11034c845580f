use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tollgate_core::Backend;
use tower_service::Service;

use super::{Decided, Plan, Shared};
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
        shared: Option<Arc<Shared<B>>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        B: Backend,
    {
        Checking {
            #[pin]
            check: B::Future,
            req: Option<Request<ReqBody>>,
            inner: Option<S>,
            plan: Plan,
        },
        Calling {
            #[pin]
            call: S::Future,
            decision: Option<Decision>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
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
        plan: Plan,
        shared: Arc<Shared<B>>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                req: Some(req),
                inner: Some(inner),
                plan,
            },
            shared: Some(shared),
        }
    }

    pub(crate) fn refused(response: Response<Bytes>) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
            shared: None,
        }
    }
}

impl<S, B, ReqBody, ResBody> Future for ResponseFuture<S, B, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    B: Backend,
    ResBody: From<Bytes>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        const DONE: &str = "ResponseFuture polled after completion";
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking {
                    check,
                    req,
                    inner,
                    plan,
                } => {
                    let result = ready!(check.poll(cx));
                    let (Some(mut req), Some(mut inner), Some(shared)) =
                        (req.take(), inner.take(), this.shared.as_ref())
                    else {
                        panic!("{DONE}");
                    };
                    match shared.decide(result, &req, plan) {
                        Decided::Admit(decision) => {
                            req.extensions_mut().insert(decision.clone());
                            let call = inner.call(req);
                            this.state.set(State::Calling {
                                call,
                                decision: Some(decision),
                            });
                        }
                        Decided::Refuse(response) => this.state.set(State::Refused {
                            response: Some(response),
                        }),
                    }
                }
                StateProj::Calling { call, decision } => {
                    let mut response = ready!(call.poll(cx))?;
                    if let (Some(decision), Some(shared)) = (decision.take(), this.shared.as_ref())
                    {
                        shared.finish(&mut response, decision);
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Refused { response } => {
                    let Some(response) = response.take() else {
                        panic!("{DONE}");
                    };
                    return Poll::Ready(Ok(response.map(ResBody::from)));
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
