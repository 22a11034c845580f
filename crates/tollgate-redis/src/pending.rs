//! Settles sent in the background and not answered yet, numbered in the order they were made,
//! so that a shutdown can wait for those made before it.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// The settles of one backend that are in flight.
#[derive(Default)]
pub(crate) struct Pending {
    open: Mutex<Open>,
    /// Woken whenever a settle is answered (or given up).
    answered: Notify,
}

#[derive(Default)]
struct Open {
    /// The number of the next settle.
    next: u64,
    /// The numbers of the settles not answered yet.
    numbers: BTreeSet<u64>,
}

/// One settle in flight, answered (or given up) when its ticket is dropped.
pub(crate) struct Ticket {
    pending: Arc<Pending>,
    number: u64,
}

impl Pending {
    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ticket of a settle made now.
    pub(crate) fn open(self: &Arc<Self>) -> Ticket {
        let mut open = self.lock();
        let number = open.next;
        open.next += 1;
        open.numbers.insert(number);
        Ticket {
            pending: Arc::clone(self),
            number,
        }
    }

    /// Resolves once every settle made before this call is answered or given up (a settle
    /// has the backend's deadline, so this waits for at most about one).
    pub(crate) fn answered(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let this = Arc::clone(self);
        let before = this.lock().next;
        async move {
            loop {
                let mut answered = std::pin::pin!(this.answered.notified());
                answered.as_mut().enable();
                let first = this.lock().numbers.first().copied();
                if first.is_none_or(|n| n >= before) {
                    return;
                }
                answered.await;
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.pending.lock().numbers.remove(&self.number);
        self.pending.answered.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll, Waker};

    use super::*;

    fn poll(f: &mut (impl Future<Output = ()> + Unpin)) -> Poll<()> {
        std::pin::Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn only_the_settles_made_before_are_waited_for() {
        let pending = Arc::new(Pending::default());
        let first = pending.open();
        let second = pending.open();
        let mut waiting = Box::pin(pending.answered());
        let later = pending.open();
        assert_eq!(poll(&mut waiting), Poll::Pending);
        drop(second);
        assert_eq!(poll(&mut waiting), Poll::Pending);
        drop(first);
        assert_eq!(poll(&mut waiting), Poll::Ready(()));
        // Nothing made before: answered at once, whatever is in flight since.
        let mut none_before = Box::pin(Arc::new(Pending::default()).answered());
        assert_eq!(poll(&mut none_before), Poll::Ready(()));
        drop(later);
    }
}
