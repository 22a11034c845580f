use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::time::Duration;

use crate::algorithm;
use crate::clock::Micros;
use crate::limit::{Algorithm, Limit, Quota};

/// The answer of [`Backend::peek`] and [`Backend::reset`]: boxed, since operators call them
/// rarely and a backend can then answer with any future.
pub type AdminFuture<T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'static>>;

/// The most limits one request can be checked against in one call.
pub const MAX_CHECKS: usize = 8;

/// One limit to check for one request: which limit, which key, what it costs.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// The key's bytes, as extracted from the request (never stored as they are).
    pub key: &'a [u8],
    /// Units of the quota the request takes.
    pub cost: u32,
    /// The quota this check is counted against: the limit's default, or the quota of the
    /// request's plan ([`Check::with_quota`]). Backends read it, never `limit.quota()`.
    pub quota: Quota,
    /// Whether a denial by this limit refuses the batch. `false` for shadow limits: they
    /// consume when they admit and report when they would deny, but never refuse.
    pub enforce: bool,
    /// The request's slot, for a concurrency limit: an id unique among the requests in flight
    /// on every replica (the layer draws 128 random bits per request), under which a backend
    /// whose slots expire (Redis) records, renews and releases it. 0 from [`Check::new`]; the
    /// in-memory backend only counts slots.
    pub slot: u128,
}

impl<'a> Check<'a> {
    /// A check of `key` against `limit`, with the limit's cost and shadow setting.
    pub fn new(limit: &'a Limit, key: &'a [u8]) -> Self {
        Self {
            limit,
            key,
            cost: limit.cost(),
            enforce: !limit.is_shadow(),
            quota: *limit.quota(),
            slot: 0,
        }
    }

    /// This check, holding slot `slot` of a concurrency limit.
    pub fn with_slot(mut self, slot: u128) -> Self {
        self.slot = slot;
        self
    }

    /// This check counted against `quota` instead of the limit's default (one of the limit's
    /// [plan quotas](Limit::plan)).
    #[inline]
    pub fn with_quota(mut self, quota: Quota) -> Self {
        self.quota = quota;
        self
    }
    /// This check with a cost of its own, for this request only (a cost read from the
    /// request, or the estimate a later [`Settlement`] corrects).
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = cost;
        self
    }
}

/// Where an admitted check's units went, as the backend that took them recorded it: what a
/// later [`Settlement`] of the same check needs to find them again.
///
/// `at` is the backend's time of the check (for a sliding log, the time its units were
/// recorded at); `mark` is the algorithm's: the end of a fixed window's window, the last
/// sequence number of a sliding log's units on Redis, 0 otherwise.
///
/// A GCRA check's receipt has no mark. A [`Settlement`] whose GCRA receipt has one is
/// *guarded*: it applies only while the key's TAT is exactly `mark` (the TAT its check left),
/// and changes nothing otherwise. A quota lease's give-back is such a settle (see
/// [`Leased`](crate::leased::Leased)): a backend under `Leased` must honour the guard, as the
/// in-memory backend does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Receipt {
    /// The backend's time of the check, in microseconds since the Unix epoch.
    pub at: Micros,
    /// What the algorithm needs besides the time (see above).
    pub mark: u64,
}

/// The settle of one check admitted earlier: it reserved `reserved` units, and should have
/// cost `actual`.
///
/// A settle gives back `reserved - actual` units, or consumes `actual - reserved` more, at
/// once and whether or not the quota has them (the key then goes into debt). Per algorithm:
///
/// - **GCRA** moves the key's theoretical arrival time (TAT) back by the refund's emission
///   intervals, never before now (a refund never makes a bucket fuller than full), or forward
///   by the charge's. A charge never puts the TAT more than twice the burst's refill time ahead
///   of now: the debt is at most one whole burst, paid back at the quota's rate, and the
///   key's next request waits until it is paid.
/// - **A fixed window** settles in the window of the check only: a refund decrements its count
///   (never below zero), a charge increments it past the limit if need be, by at most twice
///   the limit at a time. Once that window has
///   ended, a settle changes nothing: its debt, like its count, ends with the window.
/// - **A sliding log** removes the refunded units among those the check recorded, or records
///   the charge's units at the time of the settle. A log holds at most twice the quota's
///   limit: a charge past that is cut to it. The debt leaves with its entries, a period later.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    /// The limit, as in the check.
    pub limit: &'a Limit,
    /// The key's bytes, as in the check.
    pub key: &'a [u8],
    /// The units the check took.
    pub reserved: u32,
    /// The units the request should have cost.
    pub actual: u32,
    /// Where the check's units went, from its [`Verdicts`].
    pub receipt: Receipt,
    /// The quota the check was counted against ([`Check::quota`]: the limit's default or the
    /// request's plan). The settle is applied under it, never under the limit's default.
    pub quota: Quota,
}

impl<'a> Settlement<'a> {
    /// The settle of `check`, admitted with `receipt`, which should have cost `actual` instead
    /// of the check's cost: under the check's limit, key and quota.
    pub fn of(check: &Check<'a>, receipt: Receipt, actual: u32) -> Self {
        Self {
            limit: check.limit,
            key: check.key,
            reserved: check.cost,
            actual,
            receipt,
            quota: check.quota,
        }
    }

    /// Whether this settle gives units back.
    pub fn refunds(&self) -> bool {
        self.actual < self.reserved
    }
}

/// How one limit answered one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// Within the limit. Consumed if the whole batch was admitted.
    Allowed,
    /// Over the limit; the same request could be admitted after `retry_after` microseconds.
    Denied {
        /// Microseconds until the same request would be admitted.
        retry_after: Micros,
    },
    /// The request costs more than the limit can ever admit at once.
    CostTooHigh,
    /// Not evaluated: another check of the batch was refused before this one was looked at
    /// (for example from a local deny cache). Nothing was consumed.
    NotChecked,
    /// The in-memory backend is tracking as many keys as it may and this key is new.
    AtCapacity {
        /// Microseconds until space is likely to have been reclaimed.
        retry_after: Micros,
    },
}

/// The answer of one limit for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Admitted or why not.
    pub status: Status,
    /// Units left in the quota after this request (before it, when it was not admitted).
    pub remaining: u64,
    /// Microseconds until the quota is whole again.
    pub reset: Micros,
}

impl Verdict {
    const EMPTY: Self = Self {
        status: Status::Allowed,
        remaining: 0,
        reset: 0,
    };

    /// Whether this limit admits the request.
    #[inline]
    pub fn is_allowed(&self) -> bool {
        self.status == Status::Allowed
    }

    /// Time until the request could be admitted, if it was refused and can ever be.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.status {
            Status::Denied { retry_after } | Status::AtCapacity { retry_after } => {
                Some(Duration::from_micros(retry_after))
            }
            Status::Allowed | Status::CostTooHigh | Status::NotChecked => None,
        }
    }

    /// Time until the quota is whole again.
    pub fn reset(&self) -> Duration {
        Duration::from_micros(self.reset)
    }
}

/// One key's state under one limit, read without consuming anything ([`Backend::peek`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyState {
    /// Units the key may take now (for a concurrency limit: slots free now).
    pub remaining: u64,
    /// Time until the quota is whole again (0 for a concurrency limit: nothing refills with
    /// time).
    pub reset: Duration,
    /// Time until one more unit can be taken, when none is left now; `None` when one is
    /// left, or when it never can be (a concurrency limit's slots free when requests end).
    pub retry_after: Option<Duration>,
}

impl KeyState {
    /// The state a check of one unit of `check`'s limit saw, from its `verdict`, which the
    /// backend did not consume.
    pub fn from_probe(check: &Check<'_>, verdict: Verdict) -> Self {
        let unconsumed = algorithm::unconsumed(check.limit.algorithm(), &check.quota, verdict, 1);
        let retry_after = match (check.limit.algorithm(), unconsumed.status) {
            (Algorithm::Concurrency, _) => None,
            (_, Status::Allowed) => None,
            _ => unconsumed.retry_after(),
        };
        Self {
            remaining: unconsumed.remaining,
            reset: unconsumed.reset(),
            retry_after,
        }
    }

    /// The state of a key the backend holds nothing for: its whole quota, or for GCRA its
    /// whole burst (what a request could take at once; the burst is the limit unless set).
    pub fn fresh(quota: &Quota) -> Self {
        Self {
            remaining: u64::from(quota.burst()),
            reset: Duration::ZERO,
            retry_after: None,
        }
    }
}

/// How many verdicts a [`Verdicts`] holds without allocating: the one to three limits of most
/// layers (three stacked limits is the common case of a public API: per IP, per tenant, per
/// principal). A batch of more checks keeps its verdicts in one allocation of [`MAX_CHECKS`].
const INLINE: usize = 3;

/// The verdicts of one batch, in the order of its checks.
///
/// Up to three are stored inline, so that the answer of a batch of up to three limits allocates
/// nothing and stays small to move; more are stored in one allocation.
#[derive(Clone)]
pub struct Verdicts {
    len: u8,
    /// Bit `i`: the `i`-th check was admitted from a leased slice held locally.
    from_lease: u8,
    store: Store,
}

#[derive(Clone)]
enum Store {
    Inline {
        items: [Verdict; INLINE],
        receipts: [Receipt; INLINE],
    },
    Spilled(Box<Spilled>),
}

#[derive(Clone)]
struct Spilled {
    items: [Verdict; MAX_CHECKS],
    receipts: [Receipt; MAX_CHECKS],
}

impl Verdicts {
    /// No verdicts.
    #[inline]
    pub const fn new() -> Self {
        Self {
            len: 0,
            from_lease: 0,
            store: Store::Inline {
                items: [Verdict::EMPTY; INLINE],
                receipts: [Receipt { at: 0, mark: 0 }; INLINE],
            },
        }
    }

    #[inline]
    fn parts(&self) -> (&[Verdict], &[Receipt]) {
        let len = usize::from(self.len);
        match &self.store {
            Store::Inline { items, receipts } => (&items[..len], &receipts[..len]),
            Store::Spilled(s) => (&s.items[..len], &s.receipts[..len]),
        }
    }

    #[inline]
    fn parts_mut(&mut self) -> (&mut [Verdict], &mut [Receipt]) {
        let len = usize::from(self.len);
        match &mut self.store {
            Store::Inline { items, receipts } => (&mut items[..len], &mut receipts[..len]),
            Store::Spilled(s) => (&mut s.items[..len], &mut s.receipts[..len]),
        }
    }

    /// Whether the `i`-th check was admitted from a slice of a leased quota held by this
    /// process, without asking the shared backend (see [`Lease`](crate::Lease)).
    #[inline]
    pub fn from_lease(&self, i: usize) -> bool {
        i < usize::from(self.len) && self.from_lease & (1 << i) != 0
    }

    /// Marks the `i`-th check as admitted from a leased slice; ignored past the end.
    #[inline]
    pub fn set_from_lease(&mut self, i: usize) {
        if i < usize::from(self.len) {
            self.from_lease |= 1 << i;
        }
    }

    /// Where the `i`-th check's units went, for a later settle (the default receipt if the
    /// backend records none, or past the end).
    #[inline]
    pub fn receipt(&self, i: usize) -> Receipt {
        self.parts().1.get(i).copied().unwrap_or_default()
    }

    /// Records where the `i`-th check's units went; ignored past the end.
    #[inline]
    pub fn set_receipt(&mut self, i: usize, receipt: Receipt) {
        if let Some(slot) = self.parts_mut().1.get_mut(i) {
            *slot = receipt;
        }
    }

    /// Appends a verdict.
    ///
    /// # Errors
    ///
    /// Gives the verdict back when [`MAX_CHECKS`] are already held.
    #[inline]
    pub fn push(&mut self, verdict: Verdict) -> Result<(), Verdict> {
        let len = usize::from(self.len);
        if let Store::Inline { items, receipts } = &self.store {
            if len == INLINE {
                let mut spilled = Box::new(Spilled {
                    items: [Verdict::EMPTY; MAX_CHECKS],
                    receipts: [Receipt::default(); MAX_CHECKS],
                });
                spilled.items[..INLINE].copy_from_slice(items);
                spilled.receipts[..INLINE].copy_from_slice(receipts);
                self.store = Store::Spilled(spilled);
            }
        }
        let slot = match &mut self.store {
            Store::Inline { items, .. } => items.get_mut(len),
            Store::Spilled(s) => s.items.get_mut(len),
        };
        *slot.ok_or(verdict)? = verdict;
        self.len += 1;
        Ok(())
    }

    /// The verdicts as a mutable slice.
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [Verdict] {
        self.parts_mut().0
    }

    /// Whether every enforced check of `checks` was admitted.
    #[inline]
    pub fn admits(&self, checks: &[Check<'_>]) -> bool {
        self.iter()
            .zip(checks)
            .all(|(v, c)| v.is_allowed() || !c.enforce)
    }
}

impl Default for Verdicts {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for Verdicts {
    type Target = [Verdict];

    #[inline]
    fn deref(&self) -> &[Verdict] {
        self.parts().0
    }
}

impl fmt::Debug for Verdicts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl FromIterator<Verdict> for Verdicts {
    /// Collects at most [`MAX_CHECKS`] verdicts; further ones are dropped.
    fn from_iter<I: IntoIterator<Item = Verdict>>(iter: I) -> Self {
        let mut out = Self::new();
        for v in iter.into_iter().take(MAX_CHECKS) {
            let _ = out.push(v);
        }
        out
    }
}

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
    /// `checks` holds at most [`MAX_CHECKS`] entries with distinct limit names.
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
    /// The default answers [`BackendErrorKind::Unsupported`].
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        let _ = check;
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "peek"))))
    }

    /// Forgets what `check`'s key has used, so that its next request finds the whole quota,
    /// and drops whatever this process remembers of its denials. A concurrency limit's slots
    /// are not reset (they are requests still in flight, given back when they end): that
    /// answers [`BackendErrorKind::Unsupported`].
    ///
    /// The default answers [`BackendErrorKind::Unsupported`].
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

/// The error of an operation `backend` does not offer.
pub fn unsupported(backend: &str, what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Unsupported,
        format!("the {backend} backend cannot {what} this key"),
    )
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
    /// The backend does not offer what was asked (see [`Backend::peek`] and
    /// [`Backend::reset`]).
    Unsupported,
}

/// A backend that could not answer a batch.
#[derive(Debug, Clone)]
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

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate-limit backend {}: {}", self.reason(), self.message)
    }
}

impl std::error::Error for BackendError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(remaining: u64) -> Verdict {
        Verdict {
            status: Status::Allowed,
            remaining,
            reset: 0,
        }
    }

    #[test]
    fn an_answer_stays_small_to_move() {
        // An answer the size of eight verdicts (400 bytes) was copied several times per request;
        // three inline verdicts and their receipts keep it under 160.
        assert!(std::mem::size_of::<Result<Verdicts, BackendError>>() <= 160);
    }

    #[test]
    fn verdicts_past_the_inline_ones_keep_their_order_receipts_and_lease_marks() {
        let mut v = Verdicts::new();
        for i in 0..2 {
            v.push(allowed(i)).unwrap();
            v.set_receipt(
                usize::try_from(i).unwrap(),
                Receipt {
                    at: 10 + i,
                    mark: i,
                },
            );
        }
        v.set_from_lease(1);
        for i in 2..MAX_CHECKS as u64 {
            v.push(allowed(i)).unwrap();
        }
        assert_eq!(v.push(allowed(99)), Err(allowed(99)));
        assert_eq!(v.len(), MAX_CHECKS);
        let remaining: Vec<u64> = v.iter().map(|x| x.remaining).collect();
        assert_eq!(remaining, (0..MAX_CHECKS as u64).collect::<Vec<_>>());
        assert_eq!(v.receipt(1), Receipt { at: 11, mark: 1 });
        assert_eq!(v.receipt(5), Receipt::default());
        v.set_receipt(7, Receipt { at: 7, mark: 7 });
        assert_eq!(v.receipt(7), Receipt { at: 7, mark: 7 });
        assert!(v.from_lease(1) && !v.from_lease(0) && !v.from_lease(7));
        v.as_mut_slice()[6].remaining = 60;
        let copy = v.clone();
        assert_eq!(copy[6].remaining, 60);
        assert_eq!(copy.receipt(0), Receipt { at: 10, mark: 0 });
    }

    #[test]
    fn past_the_end_reads_the_default_and_writes_nothing() {
        let mut v = Verdicts::new();
        v.push(allowed(3)).unwrap();
        v.set_receipt(1, Receipt { at: 1, mark: 1 });
        v.set_from_lease(1);
        assert_eq!(v.receipt(1), Receipt::default());
        assert!(!v.from_lease(1));
        assert_eq!(v.len(), 1);
        let collected: Verdicts = (0..20).map(allowed).collect();
        assert_eq!(collected.len(), MAX_CHECKS);
    }

    #[test]
    fn a_fresh_gcra_key_has_its_burst_left() {
        let quota = Quota::per_minute(60).unwrap().with_burst(10).unwrap();
        assert_eq!(KeyState::fresh(&quota).remaining, 10);
        // One unit later, one less: what the first check of the key answers.
        let (verdict, _) = crate::algorithm::gcra(&quota, None, 0, 1);
        assert_eq!(verdict.remaining, 9);
        assert_eq!(
            KeyState::fresh(&Quota::per_minute(60).unwrap()).remaining,
            60
        );
    }
}
