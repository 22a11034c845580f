//! The merged-call senders: on a standalone server, the batches of concurrent requests share
//! one `CHECK` call; in a cluster, those whose keys share a hash slot do (see `coalesce`).

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;

use tollgate_core::BackendError;

use crate::backend::Inner;
use crate::breaker::Permit;
use crate::coalesce::{Call, Push, Waiter};
use crate::failure::{overloaded, unavailable};
use crate::script::{Prepared, Reply};

impl Inner {
    /// Queues `batch` for the next merged call and waits for its answer, which comes by
    /// `deadline` (see [`send_merged`](Self::send_merged)).
    pub(crate) async fn coalesced(
        self: &Arc<Self>,
        batch: Vec<Prepared>,
        deadline: Instant,
        permit: Permit,
    ) -> Result<(Vec<Prepared>, Reply), BackendError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        match self.coalescer.push(Waiter {
            batch,
            reply,
            deadline,
            permit,
        }) {
            Push::Waits => {}
            Push::StartCaller => {
                let task = Unstarted(Some(Arc::clone(self)));
                tokio::spawn(async move { task.start().send_merged().await });
            }
            Push::Full => {
                return Err(overloaded(
                    "too many rate-limit checks are waiting for Redis",
                ))
            }
        }
        let answer = answer.await;
        answer.unwrap_or_else(|_| Err(unavailable("the rate-limit call was dropped")))
    }

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
