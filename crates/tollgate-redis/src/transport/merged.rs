//! The merged-call senders: on a standalone server, the batches of concurrent requests share
//! one `CHECK` call; in a cluster, those bound for one node do (in the script's cross-slot
//! form, on the node's own connection), or those whose keys share a hash slot where a node's
//! call cannot be made (see `coalesce`, `nodes`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::time::Instant;

use tollgate_engine::{BackendError, BackendErrorKind};

use crate::failure::{overloaded, unavailable};
use crate::scripts::check::{Batch, Form};
use crate::scripts::reply::Reply;
use crate::transport::answer;
use crate::transport::breaker::Permit;
use crate::transport::coalesce::{
    Call, Coalescers, Delivery, KeyedCoalescer, NodeDelivery, Push, Rider, SlotDelivery,
};
use crate::transport::{nodes, CheckError, Transport};

/// A standalone server's check, waiting for the merged call that carries it: queued on its
/// first poll, then answered by the task sending merged calls, which keeps the deadline (one
/// timer per call, not one per request) and reports each call once. Written out rather than
/// an `async fn`, so that a request's wait is part of the backend's future instead of a boxed
/// future of its own; it holds no transport of its own, but is polled with one.
pub(crate) struct Merged {
    deadline: Instant,
    /// The request's batch: the call carries a copy, and the answer is read with this one.
    batch: Batch,
    step: Step,
}

enum Step {
    Queue { permit: Permit },
    Wait(answer::Receiver<Delivery>),
    Done,
}

impl Merged {
    /// `batch`'s wait for the merged call that will carry it, due by `deadline`.
    pub(crate) fn new(batch: Batch, permit: Permit, deadline: Instant) -> Self {
        Self {
            deadline,
            batch,
            step: Step::Queue { permit },
        }
    }

    /// The batch waiting.
    pub(crate) fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Polls the wait: on the first poll, queues the batch on `transport` (starting its
    /// sending task if none runs).
    pub(crate) fn poll_on(
        &mut self,
        cx: &mut Context<'_>,
        transport: &Arc<Transport>,
    ) -> Poll<Delivery> {
        loop {
            match &mut self.step {
                &mut Step::Queue { permit } => {
                    // Queued once: a refusal below leaves the wait done.
                    self.step = Step::Done;
                    let (reply, answer) = transport.coalescers().all.channel();
                    let rider = Rider {
                        batch: self.batch.clone(),
                        reply,
                        deadline: self.deadline,
                        permit,
                    };
                    match transport.coalescers().all.push(rider) {
                        Push::Waits => {}
                        Push::StartCaller => {
                            let task = Unstarted(Some(Arc::clone(transport)));
                            tokio::spawn(async move { send_merged(task.start()).await });
                        }
                        Push::Full => {
                            return Poll::Ready(Err(overloaded(
                                "too many rate-limit checks are waiting for Redis",
                            )))
                        }
                    }
                    self.step = Step::Wait(answer);
                }
                Step::Wait(answer) => {
                    let answer = ready!(Pin::new(answer).poll(cx));
                    self.step = Step::Done;
                    return Poll::Ready(
                        answer.unwrap_or_else(|_| {
                            Err(unavailable("the rate-limit call was dropped"))
                        }),
                    );
                }
                Step::Done => {
                    return Poll::Ready(Err(BackendError::new(
                        BackendErrorKind::Protocol,
                        "CheckFuture polled after completion",
                    )))
                }
            }
        }
    }
}

/// Sends what waits in the standalone queue, one merged call after the other, until nothing
/// does.
///
/// Every request gets its answer by its deadline: one whose deadline passed while it waited is
/// not sent (so it consumes nothing) and is answered `Overloaded`, a process that could not
/// send its checks in time, which says nothing of Redis; a call times out at the latest
/// deadline of the requests it carries, and a request whose own deadline passes during the
/// call is answered a timeout alone, then. Each call is reported to the breaker once, as a probe
/// if any of its requests holds the probe's permit.
async fn send_merged(transport: Arc<Transport>) {
    let mut caller = transport.coalescers().all.caller();
    let mut kept = Kept::default();
    loop {
        gather(|| transport.coalescers().all.waiting()).await;
        if !caller.next_call(Instant::now(), &mut kept.call) {
            break;
        }
        send_call(&transport, &mut kept, |_, reply| reply).await;
    }
}

/// What a sending task keeps from one call to the next: each call's vectors, emptied when it
/// is answered, so that the next call of as many requests allocates none of them.
struct Kept<D> {
    /// The requests taken from the queue.
    call: Call<Result<D, BackendError>>,
    /// The requests sent, as the call carries them.
    carried: Carried<D>,
    /// The script's replies, one per request sent.
    replies: Vec<Option<Reply>>,
    /// The requests due before the call's latest deadline, in the order of their deadlines
    /// (see [`until_each`]).
    order: Vec<usize>,
}

impl<D> Default for Kept<D> {
    fn default() -> Self {
        Self {
            call: Call::default(),
            carried: Carried::default(),
            replies: Vec::new(),
            order: Vec::new(),
        }
    }
}

/// Yields to the runtime while more requests join the queue that `waiting` counts, at most
/// [`GATHER_YIELDS`] times, before a sending task takes its next call: requests whose bytes
/// have arrived but that the runtime has not polled yet join this call rather than wait for
/// the next. A lone request pays one yield: the runtime polls its sockets once more.
async fn gather(waiting: impl Fn() -> usize) {
    let mut last = waiting();
    for _ in 0..GATHER_YIELDS {
        tokio::task::yield_now().await;
        let now = waiting();
        if now == last {
            return;
        }
        last = now;
    }
}

/// The most times a sending task yields for its queue to grow (see [`gather`]).
const GATHER_YIELDS: usize = 8;

/// Queues `batch`, whose keys are all in `hash_slot`, for that hash slot's next merged call
/// now, and returns the wait for its answer: a request in several hash slots queues each group
/// at once, with no task of its own.
pub(crate) fn queue_in_hash_slot(
    transport: &Arc<Transport>,
    hash_slot: u16,
    batch: Batch,
    deadline: Instant,
    permit: Permit,
) -> impl Future<Output = SlotDelivery> + Send + 'static {
    queue_keyed(
        transport,
        by_hash_slot,
        send_hash_slot_merged,
        hash_slot,
        batch,
        deadline,
        permit,
    )
}

/// The queues of hash slots' calls.
fn by_hash_slot(coalescers: &Coalescers) -> &KeyedCoalescer<SlotDelivery> {
    &coalescers.by_hash_slot
}

/// The queues of nodes' calls.
fn by_node(coalescers: &Coalescers) -> &KeyedCoalescer<NodeDelivery> {
    &coalescers.by_node
}

/// Queues `batch` in the keyed queue that `queue` picks, under `key`, starting `send` for that
/// key if no task sends its calls; and returns the wait for the answer.
fn queue_keyed<T: Send + 'static, F>(
    transport: &Arc<Transport>,
    queue: fn(&Coalescers) -> &KeyedCoalescer<Result<T, BackendError>>,
    send: fn(Arc<Transport>, u16) -> F,
    key: u16,
    batch: Batch,
    deadline: Instant,
    permit: Permit,
) -> impl Future<Output = Result<T, BackendError>> + Send + 'static
where
    F: Future<Output = ()> + Send + 'static,
{
    let (reply, answer) = queue(transport.coalescers()).channel();
    let rider = Rider {
        batch,
        reply,
        deadline,
        permit,
    };
    let queued = match queue(transport.coalescers()).push(key, rider) {
        Push::Waits => Ok(()),
        Push::StartCaller => {
            let task = UnstartedKeyed {
                transport: Some(Arc::clone(transport)),
                queue,
                key,
            };
            tokio::spawn(async move {
                let transport = task.start();
                send(transport, key).await
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

/// Sends what waits for `hash_slot`, one merged call after the other, until nothing does; as
/// [`send_merged`]. The cluster client routes each call by its keys' hash slot and follows
/// `MOVED` and `ASK` for it alone (a redirected script did not run), and the calls of all hash
/// slots bound for one node share its connection: those sent while the connection writes go
/// out in one write, and their answers come back in one read.
async fn send_hash_slot_merged(transport: Arc<Transport>, hash_slot: u16) {
    let mut caller = transport.coalescers().by_hash_slot.caller(hash_slot);
    let mut kept = Kept::default();
    loop {
        gather(|| transport.coalescers().by_hash_slot.waiting(hash_slot)).await;
        if !caller.next_call(Instant::now(), &mut kept.call) {
            break;
        }
        send_call(&transport, &mut kept, |batch, reply| (batch, reply)).await;
    }
}

/// Queues `batch`, whose keys are all served by node `node`, for that node's next merged call
/// in the cross-slot form, and returns the wait for its answer: `None` for a call that ran
/// nothing because a hash slot of its keys is not (or not wholly) the node's any more.
pub(crate) fn queue_on_node(
    transport: &Arc<Transport>,
    node: u16,
    batch: Batch,
    deadline: Instant,
    permit: Permit,
) -> impl Future<Output = NodeDelivery> + Send + 'static {
    queue_keyed(
        transport,
        by_node,
        send_node_merged,
        node,
        batch,
        deadline,
        permit,
    )
}

/// Sends what waits for `node`, one merged call after the other, on the node's own
/// connection, until nothing does; as [`send_merged`].
async fn send_node_merged(transport: Arc<Transport>, node: u16) {
    let mut caller = transport.coalescers().by_node.caller(node);
    let mut kept = Kept::default();
    loop {
        gather(|| transport.coalescers().by_node.waiting(node)).await;
        if !caller.next_call(Instant::now(), &mut kept.call) {
            break;
        }
        send_node_call(&transport, node, &mut kept).await;
    }
}

/// One merged call of a node, as [`send_call`]. A request whose key the node does not serve
/// (its hash slot moved, or is moving) was not run: it is told so, to send its checks again
/// by hash slot, and the slot map is read again. The lean script runs the call's other
/// requests; the general one, and a node that cannot run the cross-slot form, run none.
async fn send_node_call(
    transport: &Arc<Transport>,
    node: u16,
    kept: &mut Kept<(Batch, Option<Reply>)>,
) {
    answer_late(transport, &mut kept.call.late);
    let call = &mut kept.carried;
    if !call.load(&mut kept.call.send) {
        return;
    }
    let carried = call.batches.len();
    let Some(direct) = transport.node(node) else {
        call.answer(|batch| Ok((batch, None)));
        return;
    };
    let replies = &mut kept.replies;
    let eval =
        transport.eval_checks_on(&call.batches, None, Some(&direct), Form::CrossSlot, replies);
    let result = until_each(transport, &mut call.answers, &mut kept.order, async {
        Ok(eval.await)
    })
    .await
    .map_err(CheckError::Backend)
    .and_then(|r| r);
    let result = match result {
        Ok(()) => {
            if replies.iter().any(Option::is_none) {
                transport.refresh_nodes();
            }
            Ok(true)
        }
        Err(CheckError::Redis(e)) if nodes::slot_moved(&e) || direct.refuses_script() => {
            transport.refresh_nodes();
            Ok(false)
        }
        Err(e) => Err(e.into_backend()),
    };
    transport.report(result.as_ref().map(|_| ()), call.permit);
    match result {
        Ok(true) => {
            let mut replies = replies.drain(..);
            call.answer(|batch| Ok((batch, replies.next().flatten())));
        }
        Ok(false) => call.answer(|batch| Ok((batch, None))),
        Err(e) => {
            // The node may have failed over, or left: the map is read again.
            transport.refresh_nodes();
            call.answer(|_| Err(e.clone()));
        }
    }
    replies.clear();
    if carried > 1 {
        tokio::task::yield_now().await;
    }
}

/// The requests one merged call carries, in order: their batches, what answers each (its
/// sender, taken once answered, and its deadline), and the breaker's permit for the call.
/// Empty between calls: a sending task keeps it for its vectors.
struct Carried<D> {
    batches: Vec<Batch>,
    answers: Vec<Answer<D>>,
    permit: Permit,
}

/// Where one carried request's answer goes, and by when.
struct Answer<D> {
    reply: Option<answer::Sender<Result<D, BackendError>>>,
    deadline: Instant,
}

impl<D> Default for Carried<D> {
    fn default() -> Self {
        Self {
            batches: Vec::new(),
            answers: Vec::new(),
            permit: Permit::default(),
        }
    }
}

impl<D> Carried<D> {
    /// Takes the call of `riders` (emptied); `false` for none.
    fn load(&mut self, riders: &mut Vec<Rider<Result<D, BackendError>>>) -> bool {
        if riders.is_empty() {
            return false;
        }
        self.permit = Permit::any(riders.iter().map(|w| w.permit));
        self.batches.reserve(riders.len());
        self.answers.reserve(riders.len());
        for w in riders.drain(..) {
            self.batches.push(w.batch);
            self.answers.push(Answer {
                reply: Some(w.reply),
                deadline: w.deadline,
            });
        }
        true
    }

    /// Answers each request not answered yet (one whose own deadline passed during the call
    /// was) with what `answer` makes of its batch, in order; the call is empty after.
    fn answer(&mut self, mut answer: impl FnMut(Batch) -> Result<D, BackendError>) {
        for (batch, to) in self.batches.drain(..).zip(self.answers.drain(..)) {
            let answered = answer(batch);
            if let Some(reply) = to.reply {
                let _ = reply.send(answered);
            }
        }
    }
}

/// `call`'s answer, or a timeout at the latest of the requests' deadlines: a request whose
/// own deadline passes first is answered a timeout then, through its sender in `answers`, and
/// fails alone. One timer for the call, moved from one deadline to the next.
async fn until_each<T, D>(
    transport: &Transport,
    answers: &mut [Answer<D>],
    order: &mut Vec<usize>,
    call: impl Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    let Some(latest) = answers.iter().map(|a| a.deadline).max() else {
        return call.await;
    };
    // Only the requests due before the latest deadline have a timer of their own (a lone
    // request has none). `order` is the sending task's, emptied here.
    order.clear();
    order.extend((0..answers.len()).filter(|&i| answers[i].deadline < latest));
    order.sort_by_key(|&i| answers[i].deadline);
    let call = transport.until(latest, call, "from Redis");
    let mut call = std::pin::pin!(call);
    let mut next = 0;
    let mut timer = std::pin::pin!(tokio::time::sleep_until(
        order.first().map_or(latest, |&i| answers[i].deadline)
    ));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(answer) = call.as_mut().poll(cx) {
            return Poll::Ready(answer);
        }
        while let Some(&i) = order.get(next) {
            ready!(timer.as_mut().poll(cx));
            if let Some(reply) = answers[i].reply.take() {
                let _ = reply.send(Err(BackendError::new(
                    BackendErrorKind::Timeout,
                    format!("no answer from Redis within {:?}", transport.deadline()),
                )));
            }
            next += 1;
            if let Some(&j) = order.get(next) {
                timer.as_mut().reset(answers[j].deadline);
            }
        }
        Poll::Pending
    })
    .await
}

/// Answers the requests whose deadline passed while they waited for a call: `Overloaded`, a
/// process that could not send its checks in time, which says nothing of Redis.
fn answer_late<T>(transport: &Transport, late: &mut Vec<Rider<Result<T, BackendError>>>) {
    for late in late.drain(..) {
        let _ = late.reply.send(Err(overloaded(format!(
            "the rate-limit check waited {:?} for a call to Redis, and was not sent",
            transport.deadline()
        ))));
    }
}

/// One merged call: its late requests answered `Overloaded`, the others sent together by the
/// latest of their deadlines (a request whose own deadline passes first fails alone, and
/// counts nothing toward the breaker), and the call reported once.
async fn send_call<D>(
    transport: &Transport,
    kept: &mut Kept<D>,
    delivery: impl Fn(Batch, Reply) -> D,
) {
    answer_late(transport, &mut kept.call.late);
    let call = &mut kept.carried;
    if !call.load(&mut kept.call.send) {
        return;
    }
    let carried = call.batches.len();
    let replies = &mut kept.replies;
    let eval = transport.eval_checks(&call.batches, None, replies);
    let result = until_each(transport, &mut call.answers, &mut kept.order, eval).await;
    transport.report(result.as_ref().map(|_| ()), call.permit);
    match result {
        Ok(()) => {
            let mut replies = replies.drain(..).flatten();
            call.answer(|batch| match replies.next() {
                Some(reply) => Ok(delivery(batch, reply)),
                None => Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "a merged call's reply has fewer answers than requests",
                )),
            });
        }
        Err(e) => call.answer(|_| Err(e.clone())),
    }
    replies.clear();
    // Under concurrent load (this call carried several requests), let the tasks that are
    // ready run before the next call is taken: the requests that arrived during the round
    // trip join it instead of following one by one. A lone request never waits for this.
    if carried > 1 {
        tokio::task::yield_now().await;
    }
}

/// A sending task that has not run yet. [`Push::StartCaller`] counted it as started; dropped
/// before it first runs (its runtime shutting down), it counts itself out, so that the next
/// request starts a new one instead of waiting, unanswered, for one that never runs.
struct Unstarted(Option<Arc<Transport>>);

impl Unstarted {
    fn start(mut self) -> Arc<Transport> {
        match self.0.take() {
            Some(transport) => transport,
            None => unreachable!("a task starts once"),
        }
    }
}

impl Drop for Unstarted {
    fn drop(&mut self) {
        if let Some(transport) = self.0.take() {
            // A caller dropped before it is told to stop counts itself out.
            drop(transport.coalescers().all.caller());
        }
    }
}

/// As [`Unstarted`], for the task of one key (a hash slot or a node) of a keyed queue.
struct UnstartedKeyed<D: 'static> {
    transport: Option<Arc<Transport>>,
    queue: fn(&Coalescers) -> &KeyedCoalescer<D>,
    key: u16,
}

impl<D> UnstartedKeyed<D> {
    fn start(mut self) -> Arc<Transport> {
        match self.transport.take() {
            Some(transport) => transport,
            None => unreachable!("a task starts once"),
        }
    }
}

impl<D> Drop for UnstartedKeyed<D> {
    fn drop(&mut self) {
        if let Some(transport) = self.transport.take() {
            drop((self.queue)(transport.coalescers()).caller(self.key));
        }
    }
}
