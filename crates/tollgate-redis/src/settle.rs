//! Settles: the difference between what admitted checks reserved and what they should have
//! cost, given back or consumed, in one `SETTLE` call (one per slot group in a cluster).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tollgate_core::{Algorithm, BackendError, Check, Micros, Settlement};

use crate::backend::{Inner, RedisBackend, BACKEND};
use crate::breaker::Permit;
use crate::keys::{self, Suffix};
use crate::script::Prepared;

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
    settles: Vec<Settling>,
    sending: bool,
}

impl SettleQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `settles`; says whether the caller must start the sending task, or gives them
    /// back when too many wait.
    fn push(&self, settles: Vec<Settling>) -> Result<bool, Vec<Settling>> {
        let mut q = self.lock();
        if q.settles.len() + settles.len() > MAX_WAITING {
            return Err(settles);
        }
        q.settles.extend(settles);
        let start = !q.sending;
        q.sending = true;
        Ok(start)
    }

    /// The settles of the next call; empty when none wait, and then the task must stop.
    fn next_call(&self) -> Vec<Settling> {
        let mut q = self.lock();
        if q.settles.is_empty() {
            q.sending = false;
            return Vec::new();
        }
        let n = q.settles.len().min(MAX_PER_CALL);
        q.settles.drain(..n).collect()
    }
}

/// Counts the sending task out if it is dropped before it is done (its runtime shutting
/// down), so that the next settle starts a new one.
struct Sending {
    inner: Arc<Inner>,
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
            self.inner.settles.lock().sending = false;
        }
    }
}

/// One settlement, ready for `SETTLE`.
#[derive(Debug, Clone)]
struct Settling {
    check: Prepared,
    suffixes: [Option<Suffix>; 2],
    args: [u64; 7],
    refunds: bool,
}

impl Settling {
    /// `s` encoded; a GCRA refund with `only_at` above 0 applies only while the key's TAT is
    /// exactly `only_at` (a lease's give-back: see `lease`).
    fn new(s: &Settlement<'_>, only_at: Micros) -> Result<Option<Self>, BackendError> {
        // A concurrency slot is one request: nothing to settle.
        if s.actual == s.reserved || s.limit.algorithm() == Algorithm::Concurrency {
            return Ok(None);
        }
        let digest = keys::digest(s.limit.name(), s.key);
        let check = Prepared::new(
            &Check::new(s.limit, s.key)
                .with_cost(s.reserved)
                .with_quota(s.quota),
            digest,
        )?;
        // The quota the check was made under (its plan's), never the limit's default.
        let quota = &s.quota;
        let refund = u64::from(s.reserved.saturating_sub(s.actual));
        let charge = u64::from(s.actual.saturating_sub(s.reserved));
        let (suffixes, args) = match s.limit.algorithm() {
            Algorithm::Gcra => {
                // Past twice the burst, a refund empties any TAT and a charge meets the cap:
                // cut there, every product in the script stays exact.
                let most = 2 * u64::from(quota.burst());
                let interval = quota.emission_interval();
                let cap = 2 * interval * u64::from(quota.burst());
                (
                    [Some(Suffix::Tat), None],
                    [
                        1,
                        refund.min(most),
                        charge.min(most),
                        interval,
                        cap,
                        only_at,
                        0,
                    ],
                )
            }
            Algorithm::FixedWindow => {
                let period = quota.period_micros();
                let Some(index) = (s.receipt.mark / period).checked_sub(1) else {
                    return Ok(None);
                };
                let most = u64::from(quota.limit()).saturating_mul(2);
                (
                    [Some(Suffix::Window(index)), None],
                    [2, refund, charge.min(most), s.receipt.mark, 0, 0, 0],
                )
            }
            _ => {
                let limit = u64::from(quota.limit());
                (
                    [Some(Suffix::Log), Some(Suffix::Seq)],
                    [
                        3,
                        refund.min(u64::from(s.reserved)),
                        charge.min(2 * limit),
                        s.receipt.at,
                        s.receipt.mark,
                        quota.period_micros(),
                        2 * limit,
                    ],
                )
            }
        };
        Ok(Some(Self {
            check,
            suffixes,
            args,
            refunds: refund > 0,
        }))
    }
}

impl RedisBackend {
    /// What [`Backend::settle`](tollgate_core::Backend::settle) does (see there).
    pub(crate) fn settle_later(&self, settlements: &[Settlement<'_>]) {
        self.settle_later_at(settlements, &[]);
    }

    /// As `settle_later`; the `i`-th GCRA refund applies only while its key's TAT is
    /// `only_at[i]` (when given and above 0).
    pub(crate) fn settle_later_at(&self, settlements: &[Settlement<'_>], only_at: &[Micros]) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!(backend = BACKEND, "rate-limit settle outside a runtime");
            return;
        };
        if self.inner.cluster {
            let call = self.settle_guarded(settlements, only_at, None);
            runtime.spawn(async move {
                let _ = call.await;
            });
            return;
        }
        let settles: Vec<Settling> = match settlements
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Settling::new(s, guard(only_at, i)).transpose())
            .collect()
        {
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
        self.inner.forget_refunded(&settles);
        match self.inner.settles.push(settles) {
            Err(settles) => dropped(&settles, "queue_full"),
            Ok(false) => {}
            Ok(true) => {
                let sending = Sending {
                    inner: Arc::clone(&self.inner),
                    done: false,
                };
                runtime.spawn(async move {
                    loop {
                        let batch = sending.inner.settles.next_call();
                        if batch.is_empty() {
                            return sending.finish();
                        }
                        // A settle needs the breaker's permit like a check: while it is
                        // open none goes out, and in half-open one may be the probe.
                        match sending.inner.breaker.admit() {
                            None => dropped(&batch, "circuit_open"),
                            Some(permit) => {
                                let _ = sending.inner.settle_group(&batch, None, permit).await;
                            }
                        }
                    }
                });
            }
        }
    }

    /// Settles `settlements` at `now` (tests), or at the server's `TIME`; answers once Redis
    /// has. [`Backend::settle`](tollgate_core::Backend::settle) sends the same call without
    /// waiting for it.
    ///
    /// A settlement that gives units back clears this replica's cached denial of its key.
    /// While the circuit breaker is open, nothing is sent and reservations stay as they are.
    ///
    /// # Errors
    ///
    /// As [`Backend::check`](tollgate_core::Backend::check): the call failed, timed out, or
    /// the breaker is open.
    pub fn settle_at(
        &self,
        settlements: &[Settlement<'_>],
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        self.settle_guarded(settlements, &[], now)
    }

    /// As `settle_at`; the `i`-th GCRA refund applies only while its key's TAT is
    /// `only_at[i]` (when given and above 0).
    pub(crate) fn settle_guarded(
        &self,
        settlements: &[Settlement<'_>],
        only_at: &[Micros],
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        let prepared: Result<Vec<Settling>, BackendError> = settlements
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Settling::new(s, guard(only_at, i)).transpose())
            .collect();
        async move {
            let batch = prepared?;
            if batch.is_empty() {
                return Ok(());
            }
            let Some(permit) = inner.breaker.admit() else {
                dropped(&batch, "circuit_open");
                return Err(BackendError::new(
                    tollgate_core::BackendErrorKind::CircuitOpen,
                    "Redis failed recently; the circuit breaker is open",
                ));
            };
            if !inner.cluster {
                return inner.settle_group(&batch, now, permit).await;
            }
            // One call per slot, concurrently.
            let mut groups: Vec<(u16, Vec<Settling>)> = Vec::new();
            for s in batch {
                let slot = keys::digest_slot(&s.check.digest);
                match groups.iter_mut().find(|(g, _)| *g == slot) {
                    Some((_, group)) => group.push(s),
                    None => groups.push((slot, vec![s])),
                }
            }
            let tasks: Vec<_> = groups
                .into_iter()
                .map(|(_, group)| {
                    let inner = Arc::clone(&inner);
                    tokio::spawn(async move { inner.settle_group(&group, now, permit).await })
                })
                .collect();
            let mut result = Ok(());
            for task in tasks {
                let one = task.await.unwrap_or_else(|e| {
                    Err(crate::failure::unavailable(format!(
                        "rate-limit task failed: {e}"
                    )))
                });
                result = result.and(one);
            }
            result
        }
    }
}

impl Inner {
    /// One `SETTLE` call for settlements whose keys share a slot (or a standalone server).
    async fn settle_group(
        &self,
        group: &[Settling],
        now: Option<Micros>,
        permit: Permit,
    ) -> Result<(), BackendError> {
        let keys = group
            .iter()
            .flat_map(|s| s.suffixes.iter().flatten().map(move |&x| (&s.check, x)));
        let mut call = self.script_call(&self.settle_script, keys, now, 7 * group.len());
        for s in group {
            call.arg(&s.args);
        }
        let sent = self
            .within_deadline(self.invoke(&self.settle_script, &call), "to settle")
            .await;
        self.report(sent.as_ref().map(|_| ()), permit);
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

fn guard(only_at: &[Micros], i: usize) -> Micros {
    only_at.get(i).copied().unwrap_or(0)
}
