//! The backend trait, where limits are counted, and what a backend answers besides verdicts:
//! a key's state for operators, and why it could not answer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::algorithm;
use crate::check::{Check, Settlement};
use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::quota::Quota;
use crate::reports::Refused;
use crate::verdict::{Status, Verdict};
use crate::verdicts::Verdicts;

/// The answer of [`Admin::peek`] and [`Admin::reset`]: boxed, since operators call them
/// rarely and a backend can then answer with any future.
pub type AdminFuture<T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'static>>;

/// The answer of [`Slots::release_landing`]: resolves once the backend has the release, or
/// has given up on its first attempt (by the backend's deadline).
pub type Landing = Pin<Box<dyn Future<Output = ()> + Send + Sync + 'static>>;

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

    /// Holds `check`'s key back for `micros` microseconds, without waiting: its next
    /// request of one unit conforms no sooner, and later ones are paced from then. For a key
    /// that an upstream API has refused with a `Retry-After` (the layer's
    /// `Metered::pause_from_upstream`), so that every replica sharing this backend waits too.
    ///
    /// GCRA only: the key's TAT moves to at least `now + micros + (burst − 1) × T` under
    /// `check.quota`, never back. Other algorithms, and the default, do nothing.
    fn pause(&self, check: &Check<'_>, micros: Micros) {
        let _ = (check, micros);
    }

    /// A short, fixed name for metrics and logs, such as `memory` or `redis`.
    fn kind(&self) -> &'static str;

    /// This backend's concurrency slots, if it counts them ([`Slots`]): the layer gives a
    /// finished request's slots back through it. The default, `None`, suits a backend without
    /// concurrency limits.
    fn slots(&self) -> Option<&dyn Slots> {
        None
    }

    /// Operators' reads and resets of one key ([`Admin`]), if this backend offers them. The
    /// default, `None`, makes the layer's `peek` and `reset` answer
    /// [`BackendErrorKind::Unsupported`].
    fn admin(&self) -> Option<&dyn Admin> {
        None
    }

    /// What this backend does at a graceful shutdown ([`Lifecycle`]), if anything. The
    /// default, `None`, is right for a backend that holds nothing of a shared quota.
    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        None
    }

    /// The reports of refused identities ([`Reports`]), if this backend keeps them. The
    /// default, `None`, makes the layer's `top_refused` answer
    /// [`BackendErrorKind::Unsupported`].
    fn reports(&self) -> Option<&dyn Reports> {
        None
    }
}

/// A backend's concurrency slots: what a concurrency limit's admitted requests hold until
/// they finish. A backend that counts them returns itself from [`Backend::slots`].
pub trait Slots: Send + Sync {
    /// Gives back the slots that `checks` took: the concurrency checks of an admitted batch
    /// whose request has finished (its response body ended or was dropped). Called exactly once
    /// per admitted request that holds slots, with the same checks (and slot ids) as the
    /// check. Returns at once; a networked backend sends the release in the background.
    fn release(&self, checks: &[Check<'_>]);

    /// Gives back the slots as [`release`](Self::release) does, and tells when the backend
    /// has the release: `None` when it had it before this returned (a backend in the process),
    /// else a future that resolves once the release has landed or its first attempt failed
    /// (by the backend's deadline; a slot whose release failed expires with its lifetime).
    /// The layer holds a response's end until then, so that a client that read the end of
    /// its response never finds its own slot still taken, on any replica. The default calls
    /// `release` and answers `None`.
    fn release_landing(&self, checks: &[Check<'_>]) -> Option<Landing> {
        self.release(checks);
        None
    }

    /// Extends the life of the slots `checks` hold, for a backend whose slots expire
    /// ([`expire`](Self::expire)): the layer calls it every third of a slot's lifetime while a
    /// response streams. Returns at once. The default does nothing.
    fn renew(&self, checks: &[Check<'_>]) {
        let _ = checks;
    }

    /// Whether slots expire unless renewed (Redis: so that a crashed replica cannot hold them
    /// forever). The default, `false`, is right for a backend in the process, whose slots die
    /// with it.
    fn expire(&self) -> bool {
        false
    }
}

/// Operators' reads and resets of one key. A backend that offers them returns itself from
/// [`Backend::admin`].
pub trait Admin: Send + Sync {
    /// Reads `check`'s key (under `check.quota`) without consuming anything: what a request
    /// of one unit would find now. `check.cost` is ignored.
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState>;

    /// Forgets what `check`'s key has used, so that its next request finds the whole quota,
    /// and drops whatever this process remembers of its denials. A concurrency limit's slots
    /// are not reset (they are requests still in flight, given back when they end): that
    /// answers [`BackendErrorKind::Unsupported`].
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()>;

    /// Refuses `check`'s key under its limit for `duration`, on every replica that shares
    /// this backend ([`Status::Denylisted`], whatever the request's cost or quota), until the
    /// deny ends or [`undeny`](Self::undeny) lifts it. A reset leaves a deny in place. A
    /// replica that answers the key without asking the backend (a deny cache, a leased slice)
    /// refuses it once that answer runs out. A `duration` past [`MAX_DENY`](crate::MAX_DENY)
    /// is refused, nothing written ([`deny_micros`]'s error). The default answers
    /// [`BackendErrorKind::Unsupported`].
    fn deny(&self, check: &Check<'_>, duration: Duration) -> AdminFuture<()> {
        let _ = (check, duration);
        Box::pin(std::future::ready(Err(BackendError::new(
            BackendErrorKind::Unsupported,
            "this backend cannot deny keys",
        ))))
    }

    /// Lifts a deny of `check`'s key (nothing if it has none).
    fn undeny(&self, check: &Check<'_>) -> AdminFuture<()> {
        let _ = check;
        Box::pin(std::future::ready(Err(BackendError::new(
            BackendErrorKind::Unsupported,
            "this backend cannot deny keys",
        ))))
    }
}

/// What a backend does at a graceful shutdown. A backend that holds something of a shared
/// quota (leased slices) returns itself from [`Backend::lifecycle`].
pub trait Lifecycle: Send + Sync {
    /// Gives back what this process holds of shared quotas, for a graceful shutdown; resolves
    /// once the backend has them back (or could not be reached). Checks made after it are
    /// checked without leases.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
}

/// A backend's reports of refused identities. A backend that keeps them returns itself from
/// [`Backend::reports`].
pub trait Reports: Send + Sync {
    /// Adds `refused` (one replica's counters since its last merge) to `limit`'s report for
    /// the bucket of `now`, which keeps the `keep` largest identities. A networked backend's
    /// future does the I/O: the caller may spawn it and not wait.
    fn merge(
        &self,
        limit: &str,
        keep: usize,
        refused: Vec<Refused>,
        now: Micros,
    ) -> AdminFuture<()>;

    /// The `n` most-refused identities of `limit` in the bucket of `now` and the one before,
    /// most refused first.
    fn top(&self, limit: &str, n: usize, now: Micros) -> AdminFuture<Vec<Refused>>;
}

impl<B: Backend> Backend for std::sync::Arc<B> {
    type Future = B::Future;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        (**self).check(checks)
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        (**self).settle(settlements)
    }

    fn pause(&self, check: &Check<'_>, micros: Micros) {
        (**self).pause(check, micros)
    }

    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn slots(&self) -> Option<&dyn Slots> {
        (**self).slots()
    }

    fn admin(&self) -> Option<&dyn Admin> {
        (**self).admin()
    }

    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        (**self).lifecycle()
    }

    fn reports(&self) -> Option<&dyn Reports> {
        (**self).reports()
    }
}

/// One key's state under one limit, read without consuming anything
/// ([`Admin::peek`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyState {
    /// Units the key may take now (for a concurrency limit: slots free now).
    pub remaining: u64,
    /// Time until the quota is whole again (0 for a concurrency limit: nothing refills with
    /// time).
    pub reset: Duration,
    /// Time until one more unit can be taken, when none is left now; `None` when one is
    /// left, or when it never can be (a concurrency limit's slots free when requests end).
    pub retry_after: Option<Duration>,
    /// A refusal that stands on the key whatever its quota has left (a deny, a block), until
    /// `retry_after` has passed; `None` when the quota alone decides.
    pub standing: Option<Standing>,
}

/// A refusal that stands on a key whatever its quota has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Standing {
    /// Denied by hand ([`Admin::deny`]).
    Denied,
    /// In the penalty box ([`Penalty`](crate::Penalty)).
    Blocked,
}

impl KeyState {
    /// A key with `remaining` units left and its quota whole again in `reset`, that may take
    /// a unit now and has no refusal standing on it.
    pub fn new(remaining: u64, reset: Duration) -> Self {
        Self {
            remaining,
            reset,
            retry_after: None,
            standing: None,
        }
    }

    /// This state, able to take one more unit only after `retry_after`.
    #[must_use]
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = Some(retry_after);
        self
    }

    /// This state, with `standing` refusing it whatever its quota has left.
    #[must_use]
    pub fn with_standing(mut self, standing: Standing) -> Self {
        self.standing = Some(standing);
        self
    }

    /// The state a check of one unit of `check`'s limit saw, from its `verdict`, which the
    /// backend did not consume.
    pub fn from_probe(check: &Check<'_>, verdict: Verdict) -> Self {
        let unconsumed = algorithm::unconsumed(check.limit.algorithm(), &check.quota, verdict, 1);
        let retry_after = match (check.limit.algorithm(), unconsumed.status) {
            (Algorithm::Concurrency, _) => None,
            (_, Status::Allowed) => None,
            _ => unconsumed.retry_after(),
        };
        let standing = match unconsumed.status {
            Status::Denylisted { .. } => Some(Standing::Denied),
            Status::Blocked { .. } => Some(Standing::Blocked),
            _ => None,
        };
        Self {
            remaining: unconsumed.remaining,
            reset: unconsumed.reset(),
            retry_after,
            standing,
        }
    }

    /// The state of a key the backend holds nothing for: its whole quota, or for GCRA its
    /// whole burst (what a request could take at once; the burst is the limit unless set).
    pub fn fresh(quota: &Quota) -> Self {
        Self {
            remaining: u64::from(quota.burst()),
            reset: Duration::ZERO,
            retry_after: None,
            standing: None,
        }
    }
}

/// Why a backend could not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// The backend could not be reached or answered with an error.
    Unavailable,
    /// The circuit breaker is open: the backend failed recently and is not being called.
    CircuitOpen,
    /// The backend answered something that could not be understood.
    Protocol,
    /// This process had more checks waiting for the backend than it could send by their
    /// deadline (a full queue, or a deadline that passed before the check was sent): the
    /// backend was not asked, and says nothing about its health.
    Overloaded,
    /// The backend does not offer what was asked (see [`Admin::peek`] and
    /// [`Admin::reset`]).
    Unsupported,
}

/// A backend that could not answer a batch.
#[derive(Clone)]
pub struct BackendError {
    kind: BackendErrorKind,
    message: String,
}

impl BackendError {
    /// An error of `kind`, described by `message`.
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// Whether the deadline passed.
    pub fn is_timeout(&self) -> bool {
        self.kind == BackendErrorKind::Timeout
    }

    /// Whether the circuit breaker refused the call.
    pub fn is_circuit_open(&self) -> bool {
        self.kind == BackendErrorKind::CircuitOpen
    }

    /// Whether the check was not sent because this process had too many waiting.
    pub fn is_overloaded(&self) -> bool {
        self.kind == BackendErrorKind::Overloaded
    }

    /// A fixed label for metrics: `timeout`, `error`, `circuit_open`, `protocol`,
    /// `overloaded` or `unsupported`.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            BackendErrorKind::Timeout => "timeout",
            BackendErrorKind::Unavailable => "error",
            BackendErrorKind::CircuitOpen => "circuit_open",
            BackendErrorKind::Protocol => "protocol",
            BackendErrorKind::Overloaded => "overloaded",
            BackendErrorKind::Unsupported => "unsupported",
        }
    }
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate-limit backend {}: {}", self.reason(), self.message)
    }
}

impl std::error::Error for BackendError {}

/// The error of an operation `backend` does not offer.
pub fn unsupported(backend: &str, what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Unsupported,
        format!("the {backend} backend cannot {what} this key"),
    )
}

/// A deny's `duration` in microseconds, as a backend's [`Admin::deny`] stores it; or, past
/// [`MAX_DENY`](crate::MAX_DENY), the error every backend answers
/// ([`BackendErrorKind::Unsupported`]: no backend keeps a deny that long).
///
/// # Errors
///
/// A `duration` longer than [`MAX_DENY`](crate::MAX_DENY).
pub fn deny_micros(duration: Duration) -> Result<Micros, BackendError> {
    if duration > crate::bounds::MAX_DENY {
        return Err(BackendError::new(
            BackendErrorKind::Unsupported,
            format!(
                "a deny lasts at most {} s (100 years, MAX_DENY), not {} s",
                crate::bounds::MAX_DENY.as_secs(),
                duration.as_secs()
            ),
        ));
    }
    // At most 100 years: a few 10^15 microseconds.
    Ok(u64::try_from(duration.as_micros()).unwrap_or(Micros::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_stays_small_to_move() {
        // An answer moves several times per request: three inline verdicts and their receipts
        // keep it small.
        assert!(std::mem::size_of::<Result<Verdicts, BackendError>>() <= 160);
    }

    #[test]
    fn a_fresh_gcra_key_has_its_burst_left() {
        let quota = Quota::per_minute(60).unwrap().with_burst(10).unwrap();
        assert_eq!(KeyState::fresh(&quota).remaining, 10);
        // One unit later, one less: what the first check of the key answers.
        let (verdict, _) = algorithm::gcra(&quota, None, 0, 1);
        assert_eq!(verdict.remaining, 9);
        assert_eq!(
            KeyState::fresh(&Quota::per_minute(60).unwrap()).remaining,
            60
        );
    }
}
