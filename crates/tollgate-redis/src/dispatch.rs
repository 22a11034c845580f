//! Dispatch: a batch's digests and encoding, then the deny cache, the breaker, and the call.

use std::sync::Arc;

use tollgate_engine::{BackendError, BackendErrorKind, Check, Micros, Verdicts, MAX_CHECKS};

use crate::checks::Checks;
use crate::future::InnerFuture;
use crate::keys;
use crate::scripts::check::{Batch, EncodedCheck};
use crate::transport::breaker::Permit;
use crate::transport::merged::Merged;

impl Checks {
    /// Checks `checks` at `now` (a test's), or at the server's time. A quota lease's slice
    /// ([`Check::slice_of`]) is taken whole; the deny cache is asked with the request's own
    /// cost, and learns nothing from the slice's answer.
    pub(crate) fn dispatch(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        now: Option<Micros>,
    ) -> InnerFuture {
        if checks.len() > MAX_CHECKS {
            return InnerFuture::ready(Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!("at most {MAX_CHECKS} checks per batch"),
            )));
        }
        if checks.is_empty() {
            return InnerFuture::ready(Ok(Verdicts::new()));
        }
        let mut digests = [[0u8; keys::DIGEST_LEN]; MAX_CHECKS];
        for (d, c) in digests.iter_mut().zip(checks) {
            *d = self.digest(c.limit.name(), c.key);
        }
        let mut asks = [false; MAX_CHECKS];
        if now.is_none() {
            if let Some(verdicts) = self.deny().refuse(checks, &digests, &mut asks) {
                return InnerFuture::ready(Ok(verdicts));
            }
        }
        let encode = |i: usize| {
            EncodedCheck::new(&checks[i], digests[i]).map(|mut p| {
                p.asks = asks[i];
                p
            })
        };
        let batch = match checks.len() {
            1 => encode(0).map(Batch::One),
            n => (0..n).map(encode).collect(),
        };
        let batch = match batch {
            Ok(batch) => batch,
            Err(e) => return InnerFuture::ready(Err(e)),
        };
        let Some(permit) = self.transport().admit() else {
            return InnerFuture::ready(Err(BackendError::new(
                BackendErrorKind::CircuitOpen,
                "Redis failed recently; the circuit breaker is open",
            )));
        };
        let releasing = self.slots().releasing(&batch);
        if !releasing.is_empty() {
            // A slot of its key this replica gave back must be free before a check counts the
            // key's slots held (see `slots::Releases`); other keys' releases do not matter.
            let checks = Arc::clone(self);
            let until = tokio::time::Instant::now() + checks.transport().deadline();
            return InnerFuture::call(async move {
                checks.slots().released(&releasing, until).await;
                send(&checks, batch, now, permit).await
            });
        }
        send(self, batch, now, permit)
    }
}

/// `batch`'s call: the next merged call on a standalone server at the server's time, else a
/// call of its own (a cluster's groups, or a test's fixed `now`).
fn send(checks: &Arc<Checks>, batch: Batch, now: Option<Micros>, permit: Permit) -> InnerFuture {
    if now.is_none() && !checks.transport().is_cluster() {
        let started = checks.start(&batch, None);
        let deadline = started.at + checks.transport().deadline();
        let wait = Merged::new(batch, permit, deadline);
        return InnerFuture::merged(Arc::clone(checks), wait, started);
    }
    InnerFuture::call(Arc::clone(checks).run(batch, now, permit))
}
