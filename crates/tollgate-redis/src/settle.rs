//! Settles: the difference between what admitted checks reserved and what they should have
//! cost, given back or consumed, in one `SETTLE` call (one per slot group in a cluster).

use std::future::Future;
use std::sync::Arc;

use tollgate_core::{Algorithm, BackendError, Check, Micros, Settlement};

use crate::backend::{Inner, RedisBackend, BACKEND};
use crate::breaker::CircuitState;
use crate::keys::{self, Suffix};
use crate::script::Prepared;

/// One settlement, ready for `SETTLE`.
#[derive(Debug, Clone)]
struct Settling {
    check: Prepared,
    suffixes: [Option<Suffix>; 2],
    args: [u64; 7],
    refunds: bool,
}

impl Settling {
    fn new(s: &Settlement<'_>) -> Result<Option<Self>, BackendError> {
        if s.actual == s.reserved {
            return Ok(None);
        }
        let digest = keys::digest(s.limit.name(), s.key);
        let check = Prepared::new(&Check::new(s.limit, s.key).with_cost(s.reserved), digest)?;
        let quota = s.limit.quota();
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
                    [Some(Suffix::None), None],
                    [1, refund.min(most), charge.min(most), interval, cap, 0, 0],
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
        let inner = Arc::clone(&self.inner);
        let prepared: Result<Vec<Settling>, BackendError> = settlements
            .iter()
            .filter_map(|s| Settling::new(s).transpose())
            .collect();
        async move {
            let batch = prepared?;
            if batch.is_empty() {
                return Ok(());
            }
            if inner.breaker.state() == CircuitState::Open {
                return Err(BackendError::new(
                    tollgate_core::BackendErrorKind::CircuitOpen,
                    "Redis failed recently; the circuit breaker is open",
                ));
            }
            if !inner.cluster {
                return inner.settle_group(&batch, now).await;
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
                    tokio::spawn(async move { inner.settle_group(&group, now).await })
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
        if let Err(e) = sent {
            tracing::debug!(backend = BACKEND, error = %e, "rate-limit settle failed");
            return Err(e);
        }
        // A denial seen while these units were held no longer stands.
        for s in group.iter().filter(|s| s.refunds) {
            self.deny.forget(&s.check.digest);
        }
        Ok(())
    }
}
