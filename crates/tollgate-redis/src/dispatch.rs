//! Dispatch: a batch's digests and encoding, then the deny cache, the breaker, and the call.

use std::sync::Arc;

use tollgate_core::{
    Algorithm, BackendError, BackendErrorKind, Check, Micros, Verdicts, MAX_CHECKS,
};

use crate::backend::{Inner, RedisBackend};
use crate::breaker::Permit;
use crate::future::ResponseFuture;
use crate::keys;
use crate::merged::Merged;
use crate::script::Prepared;

impl RedisBackend {
    pub(crate) fn dispatch(&self, checks: &[Check<'_>], now: Option<Micros>) -> ResponseFuture {
        self.dispatch_slices(checks, now, &[0; MAX_CHECKS])
    }

    /// As `dispatch`, with `slices[i]` units (when above 0) taken in Redis for the `i`-th
    /// check instead of its cost: a quota lease's slice. The deny cache is asked with the
    /// checks' own costs.
    pub(crate) fn dispatch_slices(
        &self,
        checks: &[Check<'_>],
        now: Option<Micros>,
        slices: &[u32; MAX_CHECKS],
    ) -> ResponseFuture {
        if checks.len() > MAX_CHECKS {
            return ResponseFuture::ready(Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!("at most {MAX_CHECKS} checks per batch"),
            )));
        }
        if checks.is_empty() {
            return ResponseFuture::ready(Ok(Verdicts::new()));
        }
        let inner = &self.inner;
        let mut digests = [[0u8; keys::DIGEST_LEN]; MAX_CHECKS];
        for (d, c) in digests.iter_mut().zip(checks) {
            *d = inner.digests.digest(c.limit.name(), c.key);
        }
        let mut leased = [false; MAX_CHECKS];
        if now.is_none() {
            if let Some(verdicts) = self.cached_denial(checks, &digests, &mut leased) {
                return ResponseFuture::ready(Ok(verdicts));
            }
        }
        let mut batch = Vec::with_capacity(checks.len());
        for (((c, d), leased), &slice) in checks.iter().zip(&digests).zip(leased).zip(slices) {
            match Prepared::new(c, *d) {
                Ok(p) if slice > 0 => batch.push(Prepared {
                    leased,
                    cost: slice,
                    slice: true,
                    ..p
                }),
                Ok(p) => batch.push(Prepared { leased, ..p }),
                Err(e) => return ResponseFuture::ready(Err(e)),
            }
        }
        let Some(permit) = inner.breaker.admit() else {
            return ResponseFuture::ready(Err(BackendError::new(
                BackendErrorKind::CircuitOpen,
                "Redis failed recently; the circuit breaker is open",
            )));
        };
        if inner.releases.pending() && batch.iter().any(|p| p.algorithm == Algorithm::Concurrency) {
            // A slot this replica gave back must be free before a check of its limit counts
            // the slots held (see `slots::Releases`).
            let inner = Arc::clone(inner);
            let until = tokio::time::Instant::now() + inner.deadline;
            return ResponseFuture::call(async move {
                inner.releases.answered(until).await;
                send(&inner, batch, now, permit).await
            });
        }
        send(inner, batch, now, permit)
    }
}

/// `batch`'s call: the next merged call on a standalone server at the server's time, else a
/// call of its own (a cluster's groups, or a test's fixed `now`).
fn send(
    inner: &Arc<Inner>,
    batch: Vec<Prepared>,
    now: Option<Micros>,
    permit: Permit,
) -> ResponseFuture {
    if now.is_none() && !inner.cluster {
        return ResponseFuture::merged(Merged::new(Arc::clone(inner), batch, permit));
    }
    ResponseFuture::call(Arc::clone(inner).run(batch, now, permit))
}
