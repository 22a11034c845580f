//! Dispatch: a batch's digests and encoding, then the deny cache, the breaker, and the call.

use std::sync::Arc;

use tollgate_core::{
    Algorithm, BackendError, BackendErrorKind, Check, Micros, Verdicts, MAX_CHECKS,
};

use crate::checks::Checks;
use crate::future::ResponseFuture;
use crate::keys;
use crate::scripts::check::EncodedCheck;
use crate::transport::breaker::Permit;
use crate::transport::merged::Merged;

impl Checks {
    /// Checks `checks` at `now` (a test's), or at the server's time; `slices[i]` units (when
    /// above 0) are taken in Redis for the `i`-th check instead of its cost: a quota lease's
    /// slice. The deny cache is asked with the checks' own costs.
    pub(crate) fn dispatch(
        self: &Arc<Self>,
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
        let mut digests = [[0u8; keys::DIGEST_LEN]; MAX_CHECKS];
        for (d, c) in digests.iter_mut().zip(checks) {
            *d = self.digest(c.limit.name(), c.key);
        }
        let mut asks = [false; MAX_CHECKS];
        if now.is_none() {
            if let Some(verdicts) = self.deny().refuse(checks, &digests, &mut asks) {
                return ResponseFuture::ready(Ok(verdicts));
            }
        }
        let mut batch = Vec::with_capacity(checks.len());
        for (((c, d), asks), &slice) in checks.iter().zip(&digests).zip(asks).zip(slices) {
            match EncodedCheck::new(c, *d) {
                Ok(p) if slice > 0 => batch.push(EncodedCheck {
                    asks,
                    cost: slice,
                    slice: true,
                    ..p
                }),
                Ok(p) => batch.push(EncodedCheck { asks, ..p }),
                Err(e) => return ResponseFuture::ready(Err(e)),
            }
        }
        let Some(permit) = self.transport().admit() else {
            return ResponseFuture::ready(Err(BackendError::new(
                BackendErrorKind::CircuitOpen,
                "Redis failed recently; the circuit breaker is open",
            )));
        };
        if self.slots().releasing() && batch.iter().any(|p| p.algorithm == Algorithm::Concurrency) {
            // A slot this replica gave back must be free before a check of its limit counts
            // the slots held (see `slots::Releases`).
            let checks = Arc::clone(self);
            let until = tokio::time::Instant::now() + checks.transport().deadline();
            return ResponseFuture::call(async move {
                checks.slots().released(until).await;
                send(&checks, batch, now, permit).await
            });
        }
        send(self, batch, now, permit)
    }
}

/// `batch`'s call: the next merged call on a standalone server at the server's time, else a
/// call of its own (a cluster's groups, or a test's fixed `now`).
fn send(
    checks: &Arc<Checks>,
    batch: Vec<EncodedCheck>,
    now: Option<Micros>,
    permit: Permit,
) -> ResponseFuture {
    if now.is_none() && !checks.transport().is_cluster() {
        let started = checks.start(&batch, None);
        let deadline = started.at + checks.transport().deadline();
        let wait = Merged::new(batch, permit, deadline);
        return ResponseFuture::merged(Arc::clone(checks), wait, started);
    }
    ResponseFuture::call(Arc::clone(checks).run(batch, now, permit))
}
