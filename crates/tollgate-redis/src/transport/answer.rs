//! The channel that brings a waiting request its merged call's answer: a oneshot whose shared
//! slot is taken from a pool and given back once both ends are done with it, so that a request
//! allocates no channel of its own (a process that serves N requests at once keeps about N
//! slots, at most [`SPARE`] of them idle).
//!
//! The sending task answers through [`Sender::send`]; a request awaits its [`Receiver`], and a
//! request that goes away (its caller gave up) closes the channel, which the sending task
//! sees ([`Sender::is_closed`]) and does not send its batch.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Idle slots a pool keeps, at most: beyond, a slot given back is freed.
const SPARE: usize = 1024;

/// The slots of one kind of answer, for the channels of one queue.
pub(crate) struct Pool<T> {
    free: Arc<Mutex<Vec<Arc<Slot<T>>>>>,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Self {
            free: Arc::default(),
        }
    }
}

struct Slot<T> {
    state: Mutex<State<T>>,
}

struct State<T> {
    value: Option<T>,
    waker: Option<Waker>,
    /// The sender was dropped (having sent, or not).
    sent: bool,
    /// The receiver was dropped.
    closed: bool,
}

impl<T> State<T> {
    const fn new() -> Self {
        Self {
            value: None,
            waker: None,
            sent: false,
            closed: false,
        }
    }
}

impl<T> Slot<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T> Pool<T> {
    /// A new channel, on an idle slot if there is one.
    pub(crate) fn channel(&self) -> (Sender<T>, Receiver<T>) {
        let slot = lock(&self.free).pop().unwrap_or_else(|| {
            Arc::new(Slot {
                state: Mutex::new(State::new()),
            })
        });
        (
            Sender {
                slot: Arc::clone(&slot),
            },
            Receiver {
                slot: Some(slot),
                free: Arc::clone(&self.free),
            },
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The answering end: sends once.
pub(crate) struct Sender<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Sender<T> {
    /// Sends `value`; `Err(value)` if the receiver has gone.
    pub(crate) fn send(self, value: T) -> Result<(), T> {
        let waker = {
            let mut state = self.slot.lock();
            if state.closed {
                return Err(value);
            }
            state.value = Some(value);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Whether the receiver has gone (its caller gave up).
    pub(crate) fn is_closed(&self) -> bool {
        self.slot.lock().closed
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.slot.lock();
            state.sent = true;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The sender went away without sending.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Dropped;

/// The waiting end: resolves to the value sent, or [`Dropped`].
pub(crate) struct Receiver<T> {
    /// `None` once dropped.
    slot: Option<Arc<Slot<T>>>,
    free: Arc<Mutex<Vec<Arc<Slot<T>>>>>,
}

impl<T> Future for Receiver<T> {
    type Output = Result<T, Dropped>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(slot) = &self.slot else {
            return Poll::Ready(Err(Dropped));
        };
        let mut state = slot.lock();
        if let Some(value) = state.value.take() {
            return Poll::Ready(Ok(value));
        }
        if state.sent {
            return Poll::Ready(Err(Dropped));
        }
        match &state.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            _ => state.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let (value, waker) = {
            let mut state = slot.lock();
            state.closed = true;
            // Taken only if there is one: an answer received has been taken already, and
            // taking it would copy the empty place.
            let value = if state.value.is_some() {
                state.value.take()
            } else {
                None
            };
            (value, state.waker.take())
        };
        // Dropped outside the lock: a value may hold anything.
        drop((value, waker));
        // The sender is done with the slot too (it holds no reference): it can serve again.
        // Nothing else can reach it, so it is put back as new (its value and waker are gone).
        if Arc::strong_count(&slot) == 1 {
            {
                let mut state = slot.lock();
                state.sent = false;
                state.closed = false;
            }
            let mut free = lock(&self.free);
            if free.len() < SPARE {
                free.push(slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll<T>(rx: &mut Receiver<T>) -> Poll<Result<T, Dropped>> {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(rx).poll(&mut cx)
    }

    #[test]
    fn a_value_sent_is_received_and_the_slot_serves_again() {
        let pool = Pool::default();
        let (tx, mut rx) = pool.channel();
        assert!(poll(&mut rx).is_pending());
        assert!(!tx.is_closed());
        assert_eq!(tx.send(7), Ok(()));
        assert_eq!(poll(&mut rx), Poll::Ready(Ok(7)));
        drop(rx);
        assert_eq!(lock(&pool.free).len(), 1);
        // The next channel takes that slot, as new.
        let (tx, mut rx) = pool.channel();
        assert!(lock(&pool.free).is_empty());
        assert!(poll(&mut rx).is_pending());
        assert_eq!(tx.send(8), Ok(()));
        assert_eq!(poll(&mut rx), Poll::Ready(Ok(8)));
    }

    #[test]
    fn a_sender_dropped_unsent_is_seen_by_its_receiver() {
        let pool = Pool::<u8>::default();
        let (tx, mut rx) = pool.channel();
        drop(tx);
        assert_eq!(poll(&mut rx), Poll::Ready(Err(Dropped)));
    }

    #[test]
    fn a_receiver_gone_closes_the_channel() {
        let pool = Pool::default();
        let (tx, rx) = pool.channel();
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(1), Err(1));
        // The sender held the slot when the receiver went: it is freed, not kept.
        assert!(lock(&pool.free).is_empty());
    }

    #[test]
    fn a_value_never_received_is_dropped_with_the_receiver() {
        let pool = Pool::default();
        let (tx, rx) = pool.channel();
        let value = Arc::new(());
        tx.send(Arc::clone(&value)).unwrap();
        drop(rx);
        assert_eq!(Arc::strong_count(&value), 1);
        assert_eq!(lock(&pool.free).len(), 1);
    }
}
