//! The backend trait: where limits are counted.

use std::future::Future;
use std::pin::Pin;

use crate::backend_error::{unsupported, BackendError};
use crate::check::{Check, Settlement};
use crate::key_state::KeyState;
use crate::verdicts::Verdicts;

/// The answer of [`Backend::peek`] and [`Backend::reset`]: boxed, since operators call them
/// rarely and a backend can then answer with any future.
pub type AdminFuture<T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'static>>;

/// Where limits are counted.
///
/// A backend checks every limit of one request in one call, and the call is all-or-nothing:
/// the request consumes from every limit if every enforced check admits it, and from none
/// otherwise (shadow checks, `enforce == false`, never refuse the batch; they consume only what
/// they admit). A denied check never consumes.
///
/// `check` does all the work it can synchronously and returns a `'static` future: an in-memory
/// backend answers with a ready future and pays for no allocation or boxing, a networked one
/// copies what it needs before it returns.
///
/// The future is `Unpin` (a networked backend boxes its I/O), so a caller can poll it once in
/// place and act at once on an answer that is already there, which is every in-memory answer.
pub trait Backend: Send + Sync + 'static {
    /// The answer to one batch.
    type Future: Future<Output = Result<Verdicts, BackendError>> + Send + Unpin + 'static;

    /// Checks and, if admitted, consumes every check of one request.
    ///
    /// `checks` holds at most [`MAX_CHECKS`](crate::MAX_CHECKS) entries with distinct limit names.
    fn check(&self, checks: &[Check<'_>]) -> Self::Future;

    /// Settles checks admitted earlier (see [`Settlement`] for what each algorithm does),
    /// without waiting: a networked backend sends the call and returns. The settlements of one
    /// call are independent of each other (no all-or-nothing).
    ///
    /// The default does nothing: a backend that does not implement it keeps every reservation
    /// as it was taken.
    fn settle(&self, settlements: &[Settlement<'_>]) {
        let _ = settlements;
    }

    /// Gives back the slots that `checks` took: the concurrency checks of an admitted batch
    /// whose request has finished (its response body ended or was dropped). Called exactly once
    /// per admitted request that holds slots, with the same checks (and slot ids) as the
    /// check. Returns at once; a networked backend sends the release in the background. The
    /// default does nothing: a backend without concurrency limits has nothing to give back.
    fn release(&self, checks: &[Check<'_>]) {
        let _ = checks;
    }

    /// Extends the life of the slots `checks` hold, for a backend whose slots expire
    /// ([`slots_expire`](Self::slots_expire)): the layer calls it every third of a slot's
    /// lifetime while a response streams. Returns at once. The default does nothing.
    fn renew(&self, checks: &[Check<'_>]) {
        let _ = checks;
    }

    /// Whether this backend's concurrency slots expire unless renewed (Redis: so that a crashed
    /// replica cannot hold them forever). The default, `false`, is right for a backend in the
    /// process, whose slots die with it.
    fn slots_expire(&self) -> bool {
        false
    }

    /// A short, fixed name for metrics and logs, such as `memory` or `redis`.
    fn kind(&self) -> &'static str;

    /// Drops whatever this process remembers of `limit`'s denials (a local deny cache), so
    /// that a raised quota is seen at once. Called when the limit's quotas change at run time.
    /// Backends without such a cache do nothing (the default).
    fn forget_denials(&self, limit: &str) {
        let _ = limit;
    }

    /// Reads `check`'s key (under `check.quota`) without consuming anything: what a request
    /// of one unit would find now. `check.cost` is ignored.
    ///
    /// The default answers [`BackendErrorKind::Unsupported`](crate::BackendErrorKind::Unsupported).
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        let _ = check;
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "peek"))))
    }

    /// Forgets what `check`'s key has used, so that its next request finds the whole quota,
    /// and drops whatever this process remembers of its denials. A concurrency limit's slots
    /// are not reset (they are requests still in flight, given back when they end): that
    /// answers [`BackendErrorKind::Unsupported`](crate::BackendErrorKind::Unsupported).
    ///
    /// The default answers [`BackendErrorKind::Unsupported`](crate::BackendErrorKind::Unsupported).
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        let _ = check;
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "reset"))))
    }

    /// Gives back what this process holds of shared quotas (leased slices), for a graceful
    /// shutdown; resolves once the backend has them back (or could not be reached). Checks
    /// made after it are checked without leases. The default, for a backend that holds
    /// nothing, is ready at once.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        Box::pin(std::future::ready(()))
    }
}

impl<B: Backend> Backend for std::sync::Arc<B> {
    type Future = B::Future;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        (**self).check(checks)
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        (**self).settle(settlements)
    }

    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn release(&self, checks: &[Check<'_>]) {
        (**self).release(checks)
    }

    fn renew(&self, checks: &[Check<'_>]) {
        (**self).renew(checks)
    }

    fn slots_expire(&self) -> bool {
        (**self).slots_expire()
    }

    fn forget_denials(&self, limit: &str) {
        (**self).forget_denials(limit);
    }

    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        (**self).peek(check)
    }

    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        (**self).reset(check)
    }

    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        (**self).shutdown()
    }
}
