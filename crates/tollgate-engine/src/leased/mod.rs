//! Quota leases over any [`Backend`]: [`Leased`] takes a slice of a leased limit's quota from
//! the backend it wraps in one check (the request's cost and more) and admits from it
//! locally, and gives the unused units back with a refund ([`Backend::settle`]) when the slice
//! ends and at [`Lifecycle::shutdown`].
//!
//! The rules (slice sizes, expiry, pace, what a replica holds) are [`Lease`]'s (see the
//! [`lease`](crate::lease) module); this module keeps the slices of one replica and runs them
//! against the inner backend, which counts every slice's units before any of them is admitted:
//!
//! - A leased check (enforced, of a cost, under its limit's default quota) is answered from
//!   the slice in hand when it holds the cost, without asking the inner backend. Otherwise
//!   the batch goes to the inner backend, and one leased check per key at a time asks for a
//!   slice instead of its cost (a check of a larger cost, whose [`Check::slice_of`] is the
//!   request's own cost); concurrent ones are checked as they are.
//! - A batch that mixes slices and the inner backend stays all-or-nothing: the local units
//!   are taken first and put back when the inner backend refuses or fails, or when the
//!   caller drops the answer's future first.
//! - A slice refused because it was larger than what remains (other replicas took it) is
//!   asked again, sized from what the refusal said remains, then as the request's cost
//!   alone: a refusal is only ever the request's own.
//! - Unused units go back when a slice ends (its lifetime, its window's end, its GCRA pace),
//!   when a reload changes the limit's quota or lease, and at shutdown: a refund of
//!   [`Settlement::refunds`] kind, for GCRA guarded by the TAT the slice's take left (see
//!   [`Receipt`](crate::Receipt) and docs/leases.md for why).
//!
//! Time is the wrapper's [`Clock`] for what a replica decides alone (is the slice live, when
//! to sweep), and the inner backend's time of each take ([`Receipt::at`](crate::Receipt)) for
//! a slice's expiry and pace. Give both the same clock when the inner backend is in process.
//!
//! [`Lease`]: crate::Lease

mod table;
mod take;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use crate::backend::{
    unsupported, Admin, AdminFuture, Backend, BackendError, KeyState, Lifecycle, Slots,
};
use crate::check::{Check, Settlement};
use crate::clock::{Clock, Micros};
use crate::system_clock::SystemClock;
use crate::verdicts::Verdicts;

use table::{GiveBack, Table};

/// A backend that leases its limits' quotas ([`Limit::with_lease`](crate::Limit::with_lease))
/// to this process in slices, over any inner backend `B` (see the [module docs](self)).
///
/// Checks of limits without a lease go to `B` as they are. Cloning is cheap and every clone
/// holds the same slices; each replica of a service has its own `Leased` over the shared
/// backend.
///
/// # Examples
///
/// ```
/// use std::future::Future;
/// use std::sync::Arc;
/// use std::task::{Context, Poll, Waker};
/// use tollgate_engine::leased::Leased;
/// use tollgate_engine::{Backend, Check, FakeClock, Lease, Limit, MemoryBackend, Quota, Verdicts};
///
/// // Over the in-memory backend, every answer is ready on its first poll.
/// fn check(backend: &impl Backend, check: Check<'_>) -> Verdicts {
///     let mut answer = std::pin::pin!(backend.check(&[check]));
///     match answer.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
///         Poll::Ready(verdicts) => verdicts.expect("memory does not fail"),
///         Poll::Pending => unreachable!("memory answers at once"),
///     }
/// }
///
/// let clock = FakeClock::new(1_000_000);
/// let shared = Arc::new(MemoryBackend::builder().clock(clock.clone()).build());
/// let replica = Leased::new(Arc::clone(&shared), clock.clone());
/// let limit = Limit::fixed_window("daily", Quota::per_day(100)?)?.with_lease(Lease::new(5)?)?;
///
/// let first = check(&replica, Check::new(&limit, b"shop-1"));
/// assert!(first[0].is_allowed() && !first.from_lease(0));
/// assert_eq!(replica.leased_units(), 4); // 5 units taken: the request's and 4 more
/// let second = check(&replica, Check::new(&limit, b"shop-1"));
/// assert!(second.from_lease(0)); // answered without asking `shared`
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
pub struct Leased<B, C: Clock = SystemClock> {
    shared: Arc<Shared<B, C>>,
}

impl<B, C: Clock> Clone for Leased<B, C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<B, C: Clock> std::fmt::Debug for Leased<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leased")
            .field("leased_units", &self.shared.lock().held())
            .field("closed", &self.shared.closed())
            .finish_non_exhaustive()
    }
}

struct Shared<B, C> {
    backend: B,
    clock: C,
    table: Mutex<Table>,
    /// Set by shutdown: no slice is taken any more.
    closed: AtomicBool,
}

impl<B, C> Shared<B, C> {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

impl<B: Backend, C: Clock> Leased<B, C> {
    /// Leases over `backend`, deciding on `clock` when slices end.
    pub fn new(backend: B, clock: C) -> Self {
        Self {
            shared: Arc::new(Shared {
                backend,
                clock,
                table: Mutex::new(Table::default()),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// The backend the slices are taken from.
    pub fn inner(&self) -> &B {
        &self.shared.backend
    }

    /// Units this replica holds in slices now (counted by the inner backend, not yet admitted
    /// here).
    pub fn leased_units(&self) -> u64 {
        self.shared.lock().held()
    }

    /// Checks a batch and answers at once, when the inner backend answers at once (the
    /// in-memory backend does): the answer of [`Backend::check`], polled once.
    ///
    /// # Errors
    ///
    /// The inner backend's error, or [`BackendErrorKind::Unavailable`] when its answer is
    /// not ready.
    ///
    /// [`BackendErrorKind::Unavailable`]: crate::BackendErrorKind::Unavailable
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn check_now(&self, checks: &[Check<'_>]) -> Result<Verdicts, BackendError> {
        let mut future = self.check(checks);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match Pin::new(&mut future).poll(&mut cx) {
            Poll::Ready(answer) => answer,
            Poll::Pending => Err(BackendError::new(
                crate::BackendErrorKind::Unavailable,
                "the inner backend did not answer at once",
            )),
        }
    }

    /// Sends `back` to the inner backend as refunds.
    fn give_back(&self, back: &[GiveBack]) {
        give_back(&self.shared.backend, back);
    }
}

/// Sends `back` to `backend` as refunds (none when it is empty).
fn give_back<B: Backend>(backend: &B, back: &[GiveBack]) {
    if back.is_empty() {
        return;
    }
    let settlements: Vec<Settlement<'_>> = back.iter().map(GiveBack::settlement).collect();
    backend.settle(&settlements);
}

/// The answer of [`Leased`] to a batch: ready when every check was answered from a slice,
/// the inner backend's own future when no check is leased, a boxed future otherwise.
pub struct LeasedFuture<F> {
    state: State<F>,
}

impl<F> std::fmt::Debug for LeasedFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Ready(_) => "ready",
            State::Inner(_) => "inner",
            State::Taking(_) => "taking",
        };
        f.debug_struct("LeasedFuture")
            .field("state", &state)
            .finish()
    }
}

enum State<F> {
    Ready(Option<Result<Verdicts, BackendError>>),
    Inner(F),
    Taking(Pin<Box<dyn Future<Output = Result<Verdicts, BackendError>> + Send + 'static>>),
}

impl<F> LeasedFuture<F> {
    fn ready(answer: Result<Verdicts, BackendError>) -> Self {
        Self {
            state: State::Ready(Some(answer)),
        }
    }
}

impl<F> Future for LeasedFuture<F>
where
    F: Future<Output = Result<Verdicts, BackendError>> + Unpin,
{
    type Output = Result<Verdicts, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            State::Ready(answer) => match answer.take() {
                Some(answer) => Poll::Ready(answer),
                None => panic!("LeasedFuture polled after it answered"),
            },
            State::Inner(f) => Pin::new(f).poll(cx),
            State::Taking(f) => f.as_mut().poll(cx),
        }
    }
}

impl<B: Backend, C: Clock> Backend for Leased<B, C> {
    type Future = LeasedFuture<B::Future>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        take::check(self, checks)
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.shared.backend.settle(settlements);
    }

    /// Drops this replica's slice of the key (its units would be admitted during the pause),
    /// then pauses the key in the inner backend.
    fn pause(&self, check: &Check<'_>, micros: Micros) {
        if let Some(e) = self.shared.lock().get_mut(check.limit.name(), check.key) {
            e.slice.drain();
        }
        self.shared.backend.pause(check, micros);
    }

    fn kind(&self) -> &'static str {
        self.shared.backend.kind()
    }

    fn slots(&self) -> Option<&dyn Slots> {
        self.shared.backend.slots()
    }

    /// Present when the inner backend's is: peeks pass through, a reset also drops this
    /// replica's slice of the key.
    fn admin(&self) -> Option<&dyn Admin> {
        self.shared.backend.admin().map(|_| self as &dyn Admin)
    }

    /// Always: a leased backend holds slices to give back.
    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        Some(self)
    }

    /// The inner backend's: leases change nothing of who is refused.
    fn reports(&self) -> Option<&dyn crate::backend::Reports> {
        self.inner().reports()
    }
}

impl<B: Backend, C: Clock> Admin for Leased<B, C> {
    /// The inner backend's state of the key, where every replica's slices were counted when
    /// they were taken: `remaining` is what no slice holds.
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        match self.shared.backend.admin() {
            Some(admin) => admin.peek(check),
            None => Box::pin(std::future::ready(Err(unsupported(self.kind(), "peek")))),
        }
    }

    /// Drops this replica's slice of the key without giving it back (the inner backend's new
    /// state knows nothing of its units: admitting them would be over the quota), then resets
    /// the key in the inner backend.
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        if let Some(e) = self.shared.lock().get_mut(check.limit.name(), check.key) {
            e.slice.drain();
        }
        match self.shared.backend.admin() {
            Some(admin) => admin.reset(check),
            None => Box::pin(std::future::ready(Err(unsupported(self.kind(), "reset")))),
        }
    }

    /// Drops this replica's slice of the key (as [`reset`](Self::reset) does: its next
    /// request asks the inner backend, which refuses it), then denies the key there.
    fn deny(&self, check: &Check<'_>, duration: std::time::Duration) -> AdminFuture<()> {
        // Refused before anything changes: the slice stays.
        if let Err(e) = crate::backend::deny_micros(duration) {
            return Box::pin(std::future::ready(Err(e)));
        }
        if let Some(e) = self.shared.lock().get_mut(check.limit.name(), check.key) {
            e.slice.drain();
        }
        match self.shared.backend.admin() {
            Some(admin) => admin.deny(check, duration),
            None => Box::pin(std::future::ready(Err(unsupported(self.kind(), "deny")))),
        }
    }

    fn undeny(&self, check: &Check<'_>) -> AdminFuture<()> {
        match self.shared.backend.admin() {
            Some(admin) => admin.undeny(check),
            None => Box::pin(std::future::ready(Err(unsupported(self.kind(), "undeny")))),
        }
    }
}

impl<B: Backend, C: Clock> Lifecycle for Leased<B, C> {
    /// Gives every slice back and takes no more, then shuts the inner backend down.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        self.shared.closed.store(true, Ordering::Relaxed);
        let now = self.shared.clock.now();
        let back = self.shared.lock().drain(now);
        self.give_back(&back);
        match self.shared.backend.lifecycle() {
            Some(inner) => inner.shutdown(),
            None => Box::pin(std::future::ready(())),
        }
    }
}
