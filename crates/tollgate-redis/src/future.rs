//! The futures of a check: the public one, through the quota leases, and the Redis
//! layers' own below them.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tollgate_engine::leased::LeasedFuture;
use tollgate_engine::{BackendError, BackendErrorKind, Verdicts};

use crate::checks::{Checks, Started};
use crate::transport::merged::Merged;

type Boxed = Pin<Box<dyn Future<Output = Result<Verdicts, BackendError>> + Send + 'static>>;

/// The answer of a [`RedisBackend`](crate::RedisBackend) to one batch.
///
/// Ready at once for a batch answered from leased slices, a deny-cache hit or an open circuit
/// breaker; otherwise a call to Redis bounded by the deadline.
#[must_use = "futures do nothing unless polled"]
pub struct CheckFuture {
    leased: LeasedFuture<InnerFuture>,
}

impl CheckFuture {
    pub(crate) fn new(leased: LeasedFuture<InnerFuture>) -> Self {
        Self { leased }
    }
}

impl Future for CheckFuture {
    type Output = Result<Verdicts, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.get_mut().leased).poll(cx)
    }
}

impl fmt::Debug for CheckFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckFuture")
            .field("leased", &self.leased)
            .finish()
    }
}

/// The answer of the Redis layers below the leases to one batch: ready (a deny-cache hit, an
/// open circuit breaker), a standalone server's merged call, or a call of its own.
#[must_use = "futures do nothing unless polled"]
pub(crate) struct InnerFuture {
    state: State,
}

// The ready answer is stored inline on purpose: a deny-cache hit or an open breaker allocates
// nothing.
#[allow(clippy::large_enum_variant)]
enum State {
    Ready(Option<Result<Verdicts, BackendError>>),
    /// A standalone server's check, waiting for the merged call that carries it.
    Merged {
        checks: Arc<Checks>,
        wait: Merged,
        started: Option<Started>,
    },
    Call(Boxed),
}

impl InnerFuture {
    pub(crate) fn ready(result: Result<Verdicts, BackendError>) -> Self {
        Self {
            state: State::Ready(Some(result)),
        }
    }

    /// A standalone server's check, sent in the next merged call; its answer is finished by
    /// `checks`.
    pub(crate) fn merged(checks: Arc<Checks>, wait: Merged, started: Started) -> Self {
        Self {
            state: State::Merged {
                checks,
                wait,
                started: Some(started),
            },
        }
    }

    pub(crate) fn call(
        call: impl Future<Output = Result<Verdicts, BackendError>> + Send + 'static,
    ) -> Self {
        Self {
            state: State::Call(Box::pin(call)),
        }
    }
}

fn polled_after_completion() -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        "rate-limit check polled after completion",
    )
}

impl Future for InnerFuture {
    type Output = Result<Verdicts, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            State::Ready(result) => Poll::Ready(
                result
                    .take()
                    .unwrap_or_else(|| Err(polled_after_completion())),
            ),
            State::Merged {
                checks,
                wait,
                started,
            } => {
                let answer = ready!(wait.poll_on(cx, checks.transport()));
                let Some(started) = started.take() else {
                    return Poll::Ready(Err(polled_after_completion()));
                };
                Poll::Ready(checks.finish(started, wait.batch(), answer.map(Into::into)))
            }
            State::Call(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for InnerFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Ready(_) => "ready",
            State::Merged { .. } | State::Call(_) => "calling",
        };
        f.debug_struct("InnerFuture")
            .field("state", &state)
            .finish()
    }
}
