//! The merged-call senders: on a standalone server, the batches of concurrent requests share
//! one `CHECK` call; in a cluster, those whose keys share a hash slot do (see `coalesce`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::sync::oneshot;
use tokio::time::Instant;

use tollgate_core::{BackendError, BackendErrorKind, Verdicts};

use crate::backend::Inner;
use crate::breaker::Permit;
use crate::coalesce::{Answer, Call, Push, Waiter};
use crate::failure::{overloaded, unavailable};
use crate::script::{Prepared, Reply};
use crate::slots::Unclaimed;

/// A standalone server's check, waiting for the merged call that carries it: queued on its
/// first poll, then answered by the task sending merged calls, which keeps the deadline (one
/// timer per call, not one per request) and reports each call once. Written out rather than
/// an `async fn`, so that a request's wait is part of the backend's future instead of a boxed
/// future of its own.
pub(crate) struct Merged {
    inner: Arc<Inner>,
    started: Instant,
    unclaimed: Option<Unclaimed>,
    step: Step,
}

enum Step {
    Queue {
        batch: Vec<Prepared>,
        permit: Permit,
    },
    Wait(oneshot::Receiver<Answer>),
    Done,
}

impl Merged {
    pub(crate) fn new(inner: Arc<Inner>, batch: Vec<Prepared>, permit: Permit) -> Self {
        Self {
            unclaimed: inner.unclaimed(&batch),
            inner,
            started: Instant::now(),
            step: Step::Queue { batch, permit },
        }
    }

    fn answered(
        &mut self,
        result: Result<(Vec<Prepared>, Reply), BackendError>,
    ) -> Result<Verdicts, BackendError> {
        self.step = Step::Done;
        let result = result.map(|(batch, reply)| (batch, reply.into()));
        self.inner
            .answered_at(self.started, self.unclaimed.take(), result, None)
    }
}

impl Future for Merged {
    type Output = Result<Verdicts, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match &mut this.step {
                Step::Queue { .. } => {
                    let Step::Queue { batch, permit } =
                        std::mem::replace(&mut this.step, Step::Done)
                    else {
                        unreachable!("matched above");
                    };
                    let (reply, answer) = oneshot::channel();
                    let waiter = Waiter {
                        batch,
                        reply,
                        deadline: this.started + this.inner.deadline,
                        permit,
                    };
                    match this.inner.coalescer.push(waiter) {
                        Push::Waits => {}
                        Push::StartCaller => {
                            let task = Unstarted(Some(Arc::clone(&this.inner)));
                            tokio::spawn(async move { task.start().send_merged().await });
                        }
                        Push::Full => {
                            return Poll::Ready(this.answered(Err(overloaded(
                                "too many rate-limit checks are waiting for Redis",
                            ))))
                        }
                    }
                    this.step = Step::Wait(answer);
                }
                Step::Wait(answer) => {
                    let answer = ready!(Pin::new(answer).poll(cx));
                    let answer = answer
                        .unwrap_or_else(|_| Err(unavailable("the rate-limit call was dropped")));
                    return Poll::Ready(this.answered(answer));
                }
                Step::Done => {
                    return Poll::Ready(Err(BackendError::new(
                        BackendErrorKind::Protocol,
                        "ResponseFuture polled after completion",
                    )))
                }
            }
        }
    }
}

impl Inner {
    /// Sends what waits in the coalescer, one merged call after the other, until nothing does.
    ///
    /// Every request gets its answer by its deadline: one whose deadline passed while it
    /// waited is not sent (so it consumes nothing) and is answered `Overloaded`, a process
    /// that could not send its checks in time, which says nothing of Redis; and a call times
    /// out at the earliest deadline of the requests it carries. Each call is reported to the
    /// breaker once, as a probe if any of its requests holds the probe's permit.
    async fn send_merged(self: Arc<Self>) {
        let mut caller = self.coalescer.caller();
        while let Some(call) = caller.next_call(Instant::now()) {
            self.send_call(call).await;
        }
    }

    /// As [`coalesced`](Self::coalesced), in a cluster: `batch`'s keys are all in `slot`, and
    /// it waits for that slot's next merged call.
    pub(crate) async fn coalesced_in_slot(
        self: &Arc<Self>,
        slot: u16,
        batch: Vec<Prepared>,
        deadline: Instant,
        permit: Permit,
    ) -> Result<(Vec<Prepared>, Reply), BackendError> {
        self.queue_in_slot(slot, batch, deadline, permit).await
    }

    /// Queues `batch` for `slot`'s next merged call now, and returns the wait for its answer:
    /// a request in several slots queues each group at once, with no task of its own.
    pub(crate) fn queue_in_slot(
        self: &Arc<Self>,
        slot: u16,
        batch: Vec<Prepared>,
        deadline: Instant,
        permit: Permit,
    ) -> impl Future<Output = Result<(Vec<Prepared>, Reply), BackendError>> + Send + 'static {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let waiter = Waiter {
            batch,
            reply,
            deadline,
            permit,
        };
        let queued = match self.slot_coalescer.push(slot, waiter) {
            Push::Waits => Ok(()),
            Push::StartCaller => {
                let task = UnstartedSlot(Some(Arc::clone(self)), slot);
                tokio::spawn(async move {
                    let (inner, slot) = task.start();
                    inner.send_slot_merged(slot).await
                });
                Ok(())
            }
            Push::Full => Err(overloaded(
                "too many rate-limit checks are waiting for Redis",
            )),
        };
        async move {
            queued?;
            let answer = answer.await;
            answer.unwrap_or_else(|_| Err(unavailable("the rate-limit call was dropped")))
        }
    }

    /// Sends what waits for `slot`, one merged call after the other, until nothing does; as
    /// [`send_merged`](Self::send_merged). The cluster client routes each call by its keys'
    /// slot and follows `MOVED` and `ASK` for it alone (a redirected script did not run), and
    /// the calls of all slots bound for one node share its connection: those sent while the
    /// connection writes go out in one write, and their answers come back in one read.
    async fn send_slot_merged(self: Arc<Self>, slot: u16) {
        let mut caller = self.slot_coalescer.caller(slot);
        while let Some(call) = caller.next_call(Instant::now()) {
            self.send_call(call).await;
        }
    }

    /// One merged call: its late requests answered `Overloaded`, the others sent together by
    /// the earliest of their deadlines, and the call reported once.
    async fn send_call(&self, call: Call) {
        for late in call.late {
            let _ = late.reply.send(Err(overloaded(format!(
                "the rate-limit check waited {:?} for a call to Redis, and was not sent",
                self.deadline
            ))));
        }
        let waiters = call.send;
        let carried = waiters.len();
        let Some(deadline) = waiters.iter().map(|w| w.deadline).min() else {
            return;
        };
        let permit = Permit::any(waiters.iter().map(|w| w.permit));
        let batches: Vec<&[Prepared]> = waiters.iter().map(|w| w.batch.as_slice()).collect();
        let call = self.eval_checks(&batches, None);
        let result = self.until(deadline, call, "from Redis").await;
        self.report(result.as_ref().map(|_| ()), permit);
        match result {
            Ok(replies) => {
                for (w, reply) in waiters.into_iter().zip(replies) {
                    let _ = w.reply.send(Ok((w.batch, reply)));
                }
            }
            Err(e) => {
                for w in waiters {
                    let _ = w.reply.send(Err(e.clone()));
                }
            }
        }
        // Under concurrent load (this call carried several requests), let the tasks that are
        // ready run before the next call is taken: the requests that arrived during the round
        // trip join it instead of following one by one. A lone request never waits for this.
        if carried > 1 {
            tokio::task::yield_now().await;
        }
    }
}

/// A sending task that has not run yet. [`Push::StartCaller`] counted it as started; dropped
/// before it first runs (its runtime shutting down), it counts itself out, so that the next
/// request starts a new one instead of waiting, unanswered, for one that never runs.
struct Unstarted(Option<Arc<Inner>>);

impl Unstarted {
    fn start(mut self) -> Arc<Inner> {
        match self.0.take() {
            Some(inner) => inner,
            None => unreachable!("a task starts once"),
        }
    }
}

/// As [`Unstarted`], for the task of one slot.
struct UnstartedSlot(Option<Arc<Inner>>, u16);

impl UnstartedSlot {
    fn start(mut self) -> (Arc<Inner>, u16) {
        match self.0.take() {
            Some(inner) => (inner, self.1),
            None => unreachable!("a task starts once"),
        }
    }
}

impl Drop for UnstartedSlot {
    fn drop(&mut self) {
        if let Some(inner) = self.0.take() {
            drop(inner.slot_coalescer.caller(self.1));
        }
    }
}

impl Drop for Unstarted {
    fn drop(&mut self) {
        if let Some(inner) = self.0.take() {
            // A caller dropped before it is told to stop counts itself out.
            drop(inner.coalescer.caller());
        }
    }
}
