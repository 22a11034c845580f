//! Quota leases in process: replicas, each a `tollgate_engine::leased::Leased`, over one shared
//! `MemoryBackend` that counts every slice before any of its units is admitted. Each replica
//! reaches the shared backend through its own [`Link`], which counts the calls it makes and
//! the units its slices took, and can be cut.
//!
//! The leases' tests, the accuracy simulation (`lease-sim`) and the combination harness run
//! this very code; a test holds the Redis backend's leases to the same answers.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::leased::Leased;
use tollgate_engine::{
    Admin, AdminFuture, Backend, BackendError, BackendErrorKind, Check, FakeClock, KeyState, Lease,
    Limit, MemoryBackend, Quota, Settlement, Verdicts,
};

/// The backend every replica shares.
pub type Memory = Arc<MemoryBackend<FakeClock>>;

/// One replica: leases over its link to the shared backend.
pub type Replica = Leased<Link, FakeClock>;

/// A shared in-memory backend on `clock`.
pub fn memory(clock: &FakeClock) -> Memory {
    Arc::new(MemoryBackend::builder().clock(clock.clone()).build())
}

/// A replica over `memory`, deciding on `clock` when its slices end (the shared backend's
/// clock: time is one in process).
pub fn replica(memory: &Memory, clock: &FakeClock) -> Replica {
    Leased::new(Link::new(Arc::clone(memory)), clock.clone())
}

/// The shared backend as one replica reaches it.
#[derive(Clone, Debug)]
pub struct Link {
    memory: Memory,
    checks: Arc<AtomicU64>,
    settles: Arc<AtomicU64>,
    sliced: Arc<AtomicU64>,
    down: Arc<AtomicBool>,
}

impl Link {
    /// A link to `memory`, up, with nothing counted.
    pub fn new(memory: Memory) -> Self {
        Self {
            memory,
            checks: Arc::default(),
            settles: Arc::default(),
            sliced: Arc::default(),
            down: Arc::default(),
        }
    }

    /// The shared backend.
    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// Calls made: checks, and settles of at least one settlement (as a Redis backend makes
    /// one script call for each).
    pub fn calls(&self) -> u64 {
        self.checks.load(Ordering::Relaxed) + self.settles.load(Ordering::Relaxed)
    }

    /// Units that admitted slices took for later requests: each admitted slice's cost beyond
    /// the request's own ([`Check::slice_of`]).
    pub fn sliced(&self) -> u64 {
        self.sliced.load(Ordering::Relaxed)
    }

    /// Cuts the link (every check fails as `Unavailable`) or mends it.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }
}

impl Backend for Link {
    type Future = Ready<Result<Verdicts, BackendError>>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        self.checks.fetch_add(1, Ordering::Relaxed);
        if self.down.load(Ordering::Relaxed) {
            return ready(Err(BackendError::new(
                BackendErrorKind::Unavailable,
                "the link is down",
            )));
        }
        let answer = self.memory.check_now(checks);
        if let Ok(verdicts) = &answer {
            if verdicts.admits(checks) {
                let sliced: u64 = checks
                    .iter()
                    .filter(|c| c.slice_of > 0)
                    .map(|c| u64::from(c.cost.saturating_sub(c.slice_of)))
                    .sum();
                self.sliced.fetch_add(sliced, Ordering::Relaxed);
            }
        }
        ready(answer)
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        if settlements.is_empty() {
            return;
        }
        self.settles.fetch_add(1, Ordering::Relaxed);
        self.memory.settle_now(settlements);
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }
}

impl Admin for Link {
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        Box::pin(ready(Ok(self.memory.peek_now(check))))
    }

    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        Box::pin(ready(self.memory.reset_now(check)))
    }
}

/// The limits of the leases' trace tests, each as it is and leased: GCRA and a fixed window of
/// 20 per 2 s, slices of at most 6 units and half of what remains, living 300 ms (so that a
/// trace of a few hundred requests crosses expiries, window turns and refills).
pub fn trace_limits() -> [(Limit, Limit); 2] {
    let quota = Quota::new(20, Duration::from_secs(2)).expect("a valid quota");
    let lease = Lease::new(6)
        .and_then(|l| l.with_divisor(2))
        .and_then(|l| l.with_lifetime(Duration::from_millis(300)))
        .expect("a valid lease");
    [
        Limit::gcra("trace-gcra", quota).expect("a valid limit"),
        Limit::fixed_window("trace-fixed", quota).expect("a valid limit"),
    ]
    .map(|plain| {
        let leased = plain.clone().with_lease(lease).expect("a leasable limit");
        (plain, leased)
    })
}

/// The next number of a seeded SplitMix64 sequence: the traces' and the simulation's draws.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
