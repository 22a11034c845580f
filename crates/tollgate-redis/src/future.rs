//! The public future of a check.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tollgate_core::{BackendError, BackendErrorKind, Verdicts};

use crate::merged::Merged;

type Boxed = Pin<Box<dyn Future<Output = Result<Verdicts, BackendError>> + Send + 'static>>;

/// The answer of a [`RedisBackend`](crate::RedisBackend) to one batch.
///
/// Ready at once for a deny-cache hit or an open circuit breaker; otherwise a call to Redis
/// bounded by the deadline.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture {
    state: State,
}

// The ready answer is stored inline on purpose: a deny-cache hit or an open breaker allocates
// nothing.
#[allow(clippy::large_enum_variant)]
enum State {
    Ready(Option<Result<Verdicts, BackendError>>),
    Merged(Merged),
    Call(Boxed),
}

impl ResponseFuture {
    pub(crate) fn ready(result: Result<Verdicts, BackendError>) -> Self {
        Self {
            state: State::Ready(Some(result)),
        }
    }

    /// A standalone server's check, sent in the next merged call.
    pub(crate) fn merged(merged: Merged) -> Self {
        Self {
            state: State::Merged(merged),
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

impl Future for ResponseFuture {
    type Output = Result<Verdicts, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            State::Ready(result) => Poll::Ready(result.take().unwrap_or_else(|| {
                Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "ResponseFuture polled after completion",
                ))
            })),
            State::Merged(merged) => Pin::new(merged).poll(cx),
            State::Call(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Ready(_) => "ready",
            State::Merged(_) | State::Call(_) => "calling",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
