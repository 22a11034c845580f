//! Merges the batches of concurrent requests into one script call: on a standalone server all
//! of them ([`Coalescer`]), in a cluster those of one hash slot ([`KeyedCoalescer`]).
//!
//! A request's batch waits in a queue; one task at a time takes batches from it and sends
//! everything waiting, up to [`MAX_REQUESTS_PER_CALL`] requests, in one `CHECK` call. When
//! traffic is light a batch goes out at once, alone; under load the batches that arrive during
//! one round trip share the next one. Nothing waits for a timer: the queue only fills while a
//! call is in flight.
//!
//! Every request stays all-or-nothing on its own (the script runs the batches one after the
//! other), so merging changes nothing a caller can see but the number of calls. A waiting
//! request carries its deadline, and the sending task keeps it: a request whose deadline
//! passed before its batch was sent gets a timeout and is not sent, so it consumes nothing,
//! a call times out at the latest deadline of its requests, and a request whose own deadline
//! passes during the call is answered a timeout then, alone. One timer per call, not one per
//! request. A request whose caller went away is dropped from the queue.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::time::Instant;
use tollgate_engine::BackendError;

use crate::scripts::check::Batch;
use crate::scripts::reply::Reply;
use crate::transport::answer::{self, Pool};
use crate::transport::breaker::Permit;

/// Tasks sending calls at the same time. One: with two, calls carried fewer requests each and
/// tollgate on Redis served fewer requests per second (see `docs/benchmarks.md`).
pub(crate) const MAX_CALLERS: usize = 1;
/// Requests merged into one call, at most: bounds how long one script holds Redis.
pub(crate) const MAX_REQUESTS_PER_CALL: usize = 64;
/// Requests waiting, at most; beyond, a request fails at once (its limits' failure policies
/// apply) rather than queue without bound behind a slow Redis.
pub(crate) const MAX_WAITING: usize = 8192;

/// What a request waiting for a standalone server's call gets back: the script's answer for
/// its batch (the request keeps its batch, and its rider carries a copy).
pub(crate) type Delivery = Result<Reply, BackendError>;

/// What a request waiting for a hash slot's call gets back: its batch and the script's answer.
pub(crate) type SlotDelivery = Result<(Batch, Reply), BackendError>;

/// What a request waiting for a node's call gets back: its batch and the script's answer,
/// or `None` if the call did not run for a hash slot that moved (see `nodes::slot_moved`).
pub(crate) type NodeDelivery = Result<(Batch, Option<Reply>), BackendError>;

/// One request's batch, riding the next merged call (a *rider*: the delay's waiters are the
/// layer's).
pub(crate) struct Rider<D = Delivery> {
    pub(crate) batch: Batch,
    pub(crate) reply: answer::Sender<D>,
    /// When the request's answer is due, a timeout if need be.
    pub(crate) deadline: Instant,
    /// The breaker's permit for the request; the call that carries it reports for it.
    pub(crate) permit: Permit,
}

#[derive(Default)]
pub(crate) struct Coalescer {
    queue: Mutex<Queue>,
    /// The slots of the waiting requests' answers.
    answers: Pool<Delivery>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Rider>,
    callers: usize,
}

/// Where a batch went.
pub(crate) enum Push {
    /// Queued, and no task is free to send it: the caller must start one.
    StartCaller,
    /// Queued; a running task will send it.
    Waits,
    /// The queue is full.
    Full,
}

impl Coalescer {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A channel for a request's answer, to queue its batch with.
    pub(crate) fn channel(&self) -> (answer::Sender<Delivery>, answer::Receiver<Delivery>) {
        self.answers.channel()
    }

    /// Queues a batch.
    pub(crate) fn push(&self, rider: Rider) -> Push {
        let mut q = self.lock();
        if q.waiting.len() >= MAX_WAITING {
            return Push::Full;
        }
        q.waiting.push_back(rider);
        if q.callers < MAX_CALLERS {
            q.callers += 1;
            Push::StartCaller
        } else {
            Push::Waits
        }
    }

    /// Counts a task that was started after [`Push::StartCaller`]; it is counted out when it
    /// is told to stop, or when it is dropped or panics before that (a runtime shutting down),
    /// so that the next batch starts a new one.
    pub(crate) fn caller(&self) -> Caller<'_> {
        Caller {
            coalescer: self,
            stopped: false,
        }
    }

    /// How many batches wait for the next call.
    pub(crate) fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Puts the batches for the next call into `call`, which must be empty (see [`take`]);
    /// `false` when nothing waits, and then the calling task must stop (it has been counted
    /// out).
    fn next_call(&self, now: Instant, call: &mut Call<Delivery>) -> bool {
        let mut q = self.lock();
        take(&mut q.waiting, now, call);
        if call.is_empty() {
            q.callers = q.callers.saturating_sub(1);
            return false;
        }
        true
    }
}

/// The requests waiting for merged calls: on a standalone server in one queue, in a cluster
/// in one per node (or per hash slot, where a node's call cannot be made).
#[derive(Default)]
pub(crate) struct Coalescers {
    pub(crate) all: Coalescer,
    pub(crate) by_hash_slot: KeyedCoalescer<SlotDelivery>,
    /// A cluster's calls per node, in the cross-slot form.
    pub(crate) by_node: KeyedCoalescer<NodeDelivery>,
}

/// Puts the batches for the next call from `waiting` into `call`, oldest first, skipping those
/// whose caller gave up and setting apart those whose deadline is not after `now`. `call`'s
/// vectors are a sending task's, kept from one call to the next: what they can hold already
/// is not allocated again.
fn take<D>(waiting: &mut VecDeque<Rider<D>>, now: Instant, call: &mut Call<D>) {
    call.send.reserve(waiting.len().min(MAX_REQUESTS_PER_CALL));
    while call.send.len() < MAX_REQUESTS_PER_CALL {
        let Some(w) = waiting.pop_front() else {
            break;
        };
        if w.reply.is_closed() {
            continue;
        }
        if w.deadline <= now {
            call.late.push(w);
        } else {
            call.send.push(w);
        }
    }
}

/// The queues of a Redis Cluster, by a number: a hash slot's (calls of one hash slot) or a
/// node's (calls in the cross-slot form, `NodeDelivery`). Described here by hash slot: one per hash slot, each with at most one task sending its
/// merged calls, so that concurrent requests whose keys share a hash slot share one `CHECK` call
/// (a script can touch the keys of one hash slot only), and calls for different hash slots go out side
/// by side. A hash slot has an entry only while requests wait for it or its task runs.
pub(crate) struct KeyedCoalescer<D = Delivery> {
    hash_slots: Mutex<HashSlots<D>>,
    /// The slots of the waiting requests' answers.
    answers: Pool<D>,
}

impl<D> Default for KeyedCoalescer<D> {
    fn default() -> Self {
        Self {
            hash_slots: Mutex::new(HashSlots {
                queues: HashMap::new(),
                waiting: 0,
            }),
            answers: Pool::default(),
        }
    }
}

struct HashSlots<D> {
    queues: HashMap<u16, HashSlotQueue<D>>,
    /// Requests waiting over every hash slot, bounded by [`MAX_WAITING`].
    waiting: usize,
}

struct HashSlotQueue<D> {
    waiting: VecDeque<Rider<D>>,
    /// Whether a task sends this hash slot's calls.
    sending: bool,
}

impl<D> KeyedCoalescer<D> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSlots<D>> {
        self.hash_slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A channel for a request's answer, to queue its batch with.
    pub(crate) fn channel(&self) -> (answer::Sender<D>, answer::Receiver<D>) {
        self.answers.channel()
    }

    /// Queues a batch whose keys are all in `hash_slot`.
    pub(crate) fn push(&self, hash_slot: u16, rider: Rider<D>) -> Push {
        let mut s = self.lock();
        if s.waiting >= MAX_WAITING {
            return Push::Full;
        }
        s.waiting += 1;
        let q = s.queues.entry(hash_slot).or_insert_with(|| HashSlotQueue {
            waiting: VecDeque::new(),
            sending: false,
        });
        q.waiting.push_back(rider);
        if q.sending {
            Push::Waits
        } else {
            q.sending = true;
            Push::StartCaller
        }
    }

    /// Counts a task that was started for `hash_slot` after [`Push::StartCaller`]; as
    /// [`Coalescer::caller`].
    pub(crate) fn caller(&self, hash_slot: u16) -> KeyedCaller<'_, D> {
        KeyedCaller {
            coalescer: self,
            hash_slot,
            stopped: false,
        }
    }

    /// How many batches wait for `hash_slot`'s next call.
    pub(crate) fn waiting(&self, hash_slot: u16) -> usize {
        self.lock()
            .queues
            .get(&hash_slot)
            .map_or(0, |q| q.waiting.len())
    }

    fn next_call(&self, hash_slot: u16, now: Instant, call: &mut Call<D>) -> bool {
        let mut s = self.lock();
        let Some(q) = s.queues.get_mut(&hash_slot) else {
            return false;
        };
        let before = q.waiting.len();
        take(&mut q.waiting, now, call);
        let taken = before - q.waiting.len();
        if call.is_empty() {
            // Nothing waits (those skipped gave up): the hash slot is idle again.
            s.queues.remove(&hash_slot);
            s.waiting = s.waiting.saturating_sub(taken);
            return false;
        }
        s.waiting = s.waiting.saturating_sub(taken);
        true
    }

    /// A task of `hash_slot` that stops without being told to: the next batch starts another.
    fn stopped(&self, hash_slot: u16) {
        let mut s = self.lock();
        if let Some(q) = s.queues.get_mut(&hash_slot) {
            q.sending = false;
            if q.waiting.is_empty() {
                s.queues.remove(&hash_slot);
            }
        }
    }

    /// Slots with an entry: requests waiting or a task sending.
    #[cfg(test)]
    fn busy_hash_slots(&self) -> usize {
        self.lock().queues.len()
    }
}

/// What a calling task takes from the queue at once. The task keeps one, emptied after each
/// call, for the next.
pub(crate) struct Call<D = Delivery> {
    /// The batches to send in one call.
    pub(crate) send: Vec<Rider<D>>,
    /// Requests whose deadline passed while they waited: to be answered with a timeout, and
    /// not sent, so that they consume nothing.
    pub(crate) late: Vec<Rider<D>>,
}

impl<D> Default for Call<D> {
    fn default() -> Self {
        Self {
            send: Vec::new(),
            late: Vec::new(),
        }
    }
}

impl<D> Call<D> {
    pub(crate) fn is_empty(&self) -> bool {
        self.send.is_empty() && self.late.is_empty()
    }
}

/// A task sending merged calls; see [`Coalescer::caller`].
pub(crate) struct Caller<'a> {
    coalescer: &'a Coalescer,
    stopped: bool,
}

impl Caller<'_> {
    /// Puts the batches for the next call, at `now`, into `call` (empty); `false` when
    /// nothing waits, and the task must stop.
    pub(crate) fn next_call(&mut self, now: Instant, call: &mut Call) -> bool {
        let taken = self.coalescer.next_call(now, call);
        self.stopped = !taken;
        taken
    }
}

impl Drop for Caller<'_> {
    fn drop(&mut self) {
        if !self.stopped {
            let mut q = self.coalescer.lock();
            q.callers = q.callers.saturating_sub(1);
        }
    }
}

/// A task sending one hash slot's merged calls; see [`KeyedCoalescer::caller`].
pub(crate) struct KeyedCaller<'a, D = Delivery> {
    coalescer: &'a KeyedCoalescer<D>,
    hash_slot: u16,
    stopped: bool,
}

impl<D> KeyedCaller<'_, D> {
    /// Puts the batches for the hash slot's next call, at `now`, into `call` (empty);
    /// `false` when nothing waits, and the task must stop.
    pub(crate) fn next_call(&mut self, now: Instant, call: &mut Call<D>) -> bool {
        let taken = self.coalescer.next_call(self.hash_slot, now, call);
        self.stopped = !taken;
        taken
    }
}

impl<D> Drop for KeyedCaller<'_, D> {
    fn drop(&mut self) {
        if !self.stopped {
            self.coalescer.stopped(self.hash_slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rider_until(deadline: Instant) -> (Rider, answer::Receiver<Delivery>) {
        let (reply, rx) = Pool::default().channel();
        (
            Rider {
                batch: Batch::Many(Vec::new()),
                reply,
                deadline,
                permit: Permit::default(),
            },
            rx,
        )
    }

    fn rider() -> (Rider, answer::Receiver<Delivery>) {
        rider_until(Instant::now() + std::time::Duration::from_secs(3_600))
    }

    /// What `take` puts in a new call: how many batches to send, or `None` for nothing.
    fn sent(taken: impl FnOnce(&mut Call) -> bool) -> Option<usize> {
        let mut call = Call::default();
        taken(&mut call).then_some(call.send.len())
    }

    fn keyed_sent(caller: &mut KeyedCaller<'_>, now: Instant) -> Option<usize> {
        sent(|call| caller.next_call(now, call))
    }

    #[test]
    fn one_caller_sends_every_waiting_batch_in_merged_calls() {
        let c = Coalescer::default();
        let mut receivers = Vec::new();
        let mut started = 0;
        for _ in 0..100 {
            let (w, rx) = rider();
            receivers.push(rx);
            if matches!(c.push(w), Push::StartCaller) {
                started += 1;
            }
        }
        assert_eq!(started, 1);
        // A caller that gave up is skipped.
        receivers.remove(0);
        let mut caller = c.caller();
        let now = Instant::now();
        assert_eq!(
            sent(|c| caller.next_call(now, c)),
            Some(MAX_REQUESTS_PER_CALL)
        );
        assert_eq!(sent(|c| caller.next_call(now, c)), Some(100 - 1 - 64));
        assert_eq!(sent(|c| caller.next_call(now, c)), None);
        drop(caller);
        // The caller stopped: the next batch starts one again, and only one.
        let (w, _rx) = rider();
        assert!(matches!(c.push(w), Push::StartCaller));
        let (w, _rx) = rider();
        assert!(matches!(c.push(w), Push::Waits));
    }

    #[test]
    fn a_caller_dropped_midway_is_counted_out() {
        let c = Coalescer::default();
        let (w, _rx) = rider();
        assert!(matches!(c.push(w), Push::StartCaller));
        let (w, _rx2) = rider();
        assert!(matches!(c.push(w), Push::Waits));
        let mut caller = c.caller();
        assert!(sent(|c| caller.next_call(Instant::now(), c)).is_some());
        drop(caller); // its task was dropped with a call in flight
        let (w, _rx3) = rider();
        assert!(matches!(c.push(w), Push::StartCaller));
    }

    #[test]
    fn requests_whose_deadline_passed_are_set_apart_not_sent() {
        let c = Coalescer::default();
        let second = std::time::Duration::from_secs(1);
        let now = Instant::now() + second;
        let mut receivers = Vec::new();
        for deadline in [now, now + second, now - second, now + second] {
            let (w, rx) = rider_until(deadline);
            receivers.push(rx);
            c.push(w);
        }
        let mut caller = c.caller();
        let mut call = Call::default();
        assert!(caller.next_call(now, &mut call));
        let deadlines = |ws: &[Rider]| ws.iter().map(|w| w.deadline).collect::<Vec<_>>();
        assert_eq!(deadlines(&call.send), [now + second, now + second]);
        assert_eq!(deadlines(&call.late), [now, now - second]);
        assert_eq!(sent(|c| caller.next_call(now, c)), None);
    }

    #[test]
    fn each_hash_slot_has_one_caller_and_merges_only_its_own_batches() {
        let c = KeyedCoalescer::default();
        let mut receivers = Vec::new();
        let mut started = Vec::new();
        for i in 0..100u16 {
            let (w, rx) = rider();
            receivers.push(rx);
            let hash_slot = i % 2 * 7;
            if matches!(c.push(hash_slot, w), Push::StartCaller) {
                started.push(hash_slot);
            }
        }
        assert_eq!(started, [0, 7]);
        let now = Instant::now();
        let mut zero = c.caller(0);
        assert_eq!(keyed_sent(&mut zero, now), Some(50));
        assert_eq!(keyed_sent(&mut zero, now), None);
        drop(zero);
        // Hash slot 0 is idle again, hash slot 7 still has its caller and waiting batches.
        assert_eq!(c.busy_hash_slots(), 1);
        let (w, _rx) = rider();
        assert!(matches!(c.push(0, w), Push::StartCaller));
        let (w, _rx) = rider();
        assert!(matches!(c.push(7, w), Push::Waits));
        let mut seven = c.caller(7);
        assert_eq!(keyed_sent(&mut seven, now), Some(51));
        assert_eq!(keyed_sent(&mut seven, now), None);
        assert_eq!(c.busy_hash_slots(), 1);
    }

    #[test]
    fn a_hash_slot_caller_dropped_midway_lets_the_next_batch_start_one() {
        let c = KeyedCoalescer::default();
        let (w, _rx) = rider();
        assert!(matches!(c.push(3, w), Push::StartCaller));
        let mut caller = c.caller(3);
        assert!(sent(|c| caller.next_call(Instant::now(), c)).is_some());
        let (w, _rx2) = rider();
        assert!(matches!(c.push(3, w), Push::Waits));
        drop(caller); // its task was dropped with a call in flight
        let (w, _rx3) = rider();
        assert!(matches!(c.push(3, w), Push::StartCaller));
        // The batch that waited behind the dropped caller is still there for the new one.
        let mut caller = c.caller(3);
        assert_eq!(sent(|c| caller.next_call(Instant::now(), c)), Some(2));
    }

    #[test]
    fn a_full_hash_slot_coalescer_refuses_whatever_the_slot() {
        let c = KeyedCoalescer::default();
        let mut receivers = Vec::new();
        for i in 0..MAX_WAITING {
            let (w, rx) = rider();
            receivers.push(rx);
            assert!(!matches!(c.push((i % 16_384) as u16, w), Push::Full));
        }
        let (w, _rx) = rider();
        assert!(matches!(c.push(16_000, w), Push::Full));
        // Sent batches free their places.
        let mut caller = c.caller(0);
        assert!(sent(|c| caller.next_call(Instant::now(), c)).is_some());
        let (w, _rx) = rider();
        assert!(!matches!(c.push(16_000, w), Push::Full));
    }

    #[test]
    fn a_full_queue_refuses() {
        let c = Coalescer::default();
        let mut receivers = Vec::new();
        for _ in 0..MAX_WAITING {
            let (w, rx) = rider();
            receivers.push(rx);
            assert!(!matches!(c.push(w), Push::Full));
        }
        let (w, _rx) = rider();
        assert!(matches!(c.push(w), Push::Full));
    }
}
