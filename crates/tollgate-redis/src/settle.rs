//! Settles: the difference between what admitted checks reserved and what they should have
//! cost, given back or consumed, in one `SETTLE` call (one per hash-slot group in a cluster),
//! each in flight until answered (see `pending`).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tollgate_engine::{BackendError, BackendErrorKind, Micros, Settlement};

use crate::deny_cache::RefusedKeys;
use crate::failure::unavailable;
use crate::keys::{self, Keyer};
use crate::pending::{Pending, Ticket};
use crate::scripts::settle::{self, Settling};
use crate::transport::breaker::Permit;
use crate::transport::{Transport, BACKEND};

/// The settles of one backend: encoded for `SETTLE`, queued (standalone Redis) and sent on the
/// transport; a refund clears the deny cache's denial of its key.
pub(crate) struct Settles {
    transport: Arc<Transport>,
    deny: Arc<RefusedKeys>,
    /// How keys are digested (the backend's key secret).
    keyer: Keyer,
    /// Settles waiting for the call in flight to end, sent together next (standalone Redis).
    queue: SettleQueue,
    /// Settles sent in the background and not answered yet.
    pending: Arc<Pending>,
}

/// Settlements waiting, at most; beyond, a settle is dropped (its reservation stays) rather
/// than queue without bound behind a slow Redis.
const MAX_WAITING: usize = 8192;
/// Settlements sent in one call, at most: bounds how long one script holds Redis.
const MAX_PER_CALL: usize = 512;

/// Settles waiting for the `SETTLE` call in flight (standalone Redis): they go together in the
/// next call, sent as soon as that one ends. A settle that finds no call in flight starts the
/// sending task, and is sent at once: nothing waits for a timer or a later request.
#[derive(Default)]
pub(crate) struct SettleQueue {
    queue: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    /// Each with the ticket of the `Backend::settle` call that made it.
    settles: Vec<(Settling, Arc<Ticket>)>,
    sending: bool,
}

impl SettleQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `settles`, in flight under `ticket` until sent; says whether the caller must
    /// start the sending task, or gives them back when too many wait.
    fn push(&self, settles: Vec<Settling>, ticket: Ticket) -> Result<bool, Vec<Settling>> {
        let mut q = self.lock();
        if q.settles.len() + settles.len() > MAX_WAITING {
            return Err(settles);
        }
        let ticket = Arc::new(ticket);
        q.settles
            .extend(settles.into_iter().map(|s| (s, Arc::clone(&ticket))));
        let start = !q.sending;
        q.sending = true;
        Ok(start)
    }

    /// The settles of the next call, with their tickets; empty when none wait, and then the
    /// task must stop.
    fn next_call(&self) -> (Vec<Settling>, Vec<Arc<Ticket>>) {
        let mut q = self.lock();
        if q.settles.is_empty() {
            q.sending = false;
            return (Vec::new(), Vec::new());
        }
        let n = q.settles.len().min(MAX_PER_CALL);
        q.settles.drain(..n).unzip()
    }
}

/// Counts the sending task out if it is dropped before it is done (its runtime shutting
/// down), so that the next settle starts a new one.
struct Sending {
    settles: Arc<Settles>,
    /// Counted out already, by the `next_call` that found nothing.
    done: bool,
}

impl Sending {
    /// The task stops, counted out already.
    fn finish(mut self) {
        self.done = true;
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if !self.done {
            self.settles.queue.lock().sending = false;
        }
    }
}

impl Settles {
    pub(crate) fn new(transport: Arc<Transport>, deny: Arc<RefusedKeys>, keyer: Keyer) -> Self {
        Self {
            transport,
            deny,
            keyer,
            queue: SettleQueue::default(),
            pending: Arc::default(),
        }
    }

    /// What [`Backend::settle`](tollgate_engine::Backend::settle) does (see there), at `now` (a
    /// test's clock) or at the server's time: in flight until answered.
    pub(crate) fn later(self: &Arc<Self>, settlements: &[Settlement<'_>], now: Option<Micros>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!(backend = BACKEND, "rate-limit settle outside a runtime");
            return;
        };
        if self.transport.is_cluster() || now.is_some() {
            let ticket = self.pending.open();
            let call = self.now_or_at(settlements, now);
            runtime.spawn(async move {
                let _ = call.await;
                drop(ticket);
            });
            return;
        }
        let settles = match settle::encode(settlements, &self.keyer) {
            Ok(settles) => settles,
            Err(e) => {
                tracing::debug!(backend = BACKEND, error = %e, "rate-limit settle not sent");
                return;
            }
        };
        if settles.is_empty() {
            return;
        }
        // A denial foreseen while these units were held no longer stands once they are back:
        // forgotten now, so that a request in the meantime asks Redis instead of being
        // refused here, and again when the settle is answered (a check answered in between
        // may have foreseen it anew).
        self.forget_refunded(&settles);
        match self.queue.push(settles, self.pending.open()) {
            Err(settles) => dropped(&settles, "queue_full"),
            Ok(false) => {}
            Ok(true) => {
                let sending = Sending {
                    settles: Arc::clone(self),
                    done: false,
                };
                runtime.spawn(async move {
                    loop {
                        // The tickets are dropped once the call is answered.
                        let (batch, _tickets) = sending.settles.queue.next_call();
                        if batch.is_empty() {
                            return sending.finish();
                        }
                        // A settle needs the breaker's permit like a check: while it is
                        // open none goes out, and in half-open one may be the probe.
                        match sending.settles.transport.admit() {
                            None => dropped(&batch, "circuit_open"),
                            Some(permit) => {
                                let _ = sending.settles.send(&batch, None, permit).await;
                            }
                        }
                    }
                });
            }
        }
    }

    /// Resolves once every settle made before this call (through [`Settles::later`]) is
    /// answered, or given up.
    pub(crate) fn answered(&self) -> impl Future<Output = ()> + Send + 'static {
        self.pending.answered()
    }

    /// Settles `settlements` at `now` (tests), or at the server's `TIME`, and answers once
    /// Redis has.
    pub(crate) fn now_or_at(
        self: &Arc<Self>,
        settlements: &[Settlement<'_>],
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        let this = Arc::clone(self);
        let encoded = settle::encode(settlements, &this.keyer);
        async move {
            let batch = encoded?;
            if batch.is_empty() {
                return Ok(());
            }
            let Some(permit) = this.transport.admit() else {
                dropped(&batch, "circuit_open");
                return Err(BackendError::new(
                    BackendErrorKind::CircuitOpen,
                    "Redis failed recently; the circuit breaker is open",
                ));
            };
            if !this.transport.is_cluster() {
                return this.send(&batch, now, permit).await;
            }
            // One call per hash slot, concurrently.
            let mut groups: Vec<(u16, Vec<Settling>)> = Vec::new();
            for s in batch {
                let hash_slot = keys::digest_hash_slot(&s.check.digest);
                match groups.iter_mut().find(|(g, _)| *g == hash_slot) {
                    Some((_, group)) => group.push(s),
                    None => groups.push((hash_slot, vec![s])),
                }
            }
            let tasks: Vec<_> = groups
                .into_iter()
                .map(|(_, group)| {
                    let this = Arc::clone(&this);
                    tokio::spawn(async move { this.send(&group, now, permit).await })
                })
                .collect();
            let mut result = Ok(());
            for task in tasks {
                let one = task
                    .await
                    .unwrap_or_else(|e| Err(unavailable(format!("rate-limit task failed: {e}"))));
                result = result.and(one);
            }
            result
        }
    }

    /// One `SETTLE` call for settlements whose keys share a hash slot (or a standalone
    /// server).
    async fn send(
        &self,
        group: &[Settling],
        now: Option<Micros>,
        permit: Permit,
    ) -> Result<(), BackendError> {
        let keys = group
            .iter()
            .flat_map(|s| s.suffixes.iter().flatten().map(move |&x| (&s.check, x)));
        let mut call = self
            .transport
            .script_call(settle::script(), keys, now, 7 * group.len());
        for s in group {
            call.arg(&s.args);
        }
        let sent = self.transport.invoke(settle::script(), &call);
        let sent = self.transport.within_deadline(sent, "to settle").await;
        self.transport.report(sent.as_ref().map(|_| ()), permit);
        if let Err(e) = sent {
            // Not sent again: a call that timed out may have been applied, and a second one
            // would apply it twice.
            tracing::debug!(backend = BACKEND, error = %e, "rate-limit settle failed");
            dropped(group, "failed");
            return Err(e);
        }
        self.forget_refunded(group);
        Ok(())
    }

    /// Drops the deny cache's denials of the keys `settles` give units back to: a denial seen
    /// while these units were held no longer stands.
    fn forget_refunded(&self, settles: &[Settling]) {
        for s in settles.iter().filter(|s| s.refunds) {
            self.deny.forget(&s.check.digest);
        }
    }
}

/// Counts settles that will not be applied, in `tollgate_settles_dropped_total{limit, reason}`:
/// their reservations stay as they were taken.
fn dropped(settles: &[Settling], reason: &'static str) {
    for s in settles {
        metrics::counter!(
            "tollgate_settles_dropped_total",
            "limit" => std::sync::Arc::clone(&s.check.name),
            "reason" => reason,
        )
        .increment(1);
    }
}
