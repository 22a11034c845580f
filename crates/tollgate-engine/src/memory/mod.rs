//! The bounded, sharded in-memory backend.
//!
//! State lives in shards, each a read-write lock over four hash maps (one per algorithm). A
//! key is stored as a 64-bit keyed fingerprint of (limit, key bytes) (SipHash-1-3 with random
//! per-process keys), never as the key itself, so every entry has the same small size whatever
//! the key. Two tracked keys share a fingerprint with a probability of about n²/2⁶⁵ (three in a
//! hundred million at a million keys), and nobody who does not know the process's random keys
//! can aim a collision; a collision merges two buckets, which errs on the side of limiting.
//!
//! A batch write-locks the shards it touches in ascending order (no deadlock), evaluates every
//! check, and writes only if every enforced check admits: one critical section per request. A
//! lone GCRA check of a tracked key, the most common request, only read-locks its shard and
//! swaps the key's TAT in with a compare-and-swap: lone checks of one hot key never wait for
//! each other, and a batch, which holds the write lock, still sees and writes every key of the
//! batch at one instant.
//!
//! Memory is bounded by a hard cap on tracked keys. A new key past the cap is refused
//! ([`Status::AtCapacity`](crate::Status::AtCapacity)) while tracked keys keep their state: a
//! spray of unique keys can neither grow memory nor evict someone's counter. Expired state is
//! reclaimed by the requests themselves: a shard touched after its sweep interval first drops
//! its expired entries, so no background thread is needed and the cost is amortised. At the
//! cap, the requests also walk the shards in turn, once per sweep interval, so that expired
//! keys in shards nobody touches give their room back.
//!
//! No check does more than a bounded amount of this work, however many keys are tracked. A
//! full backend holds about 4,096 keys per shard (it gets more shards when its cap
//! asks for them), a shard never holds more than twice that (a new key past it is refused as
//! at the cap, which random fingerprints make as good as impossible before the cap itself), and
//! one call sweeps at most one shard's worth of entries: a sweep and a table's growth both
//! stay within a few thousand entries, however many keys are tracked.

use std::collections::hash_map::Entry;
use std::future::{ready, Ready};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{
    unsupported, Admin, AdminFuture, Backend, BackendError, BackendErrorKind, KeyState, Reports,
    Slots,
};
use crate::bounds::MAX_CHECKS;
use crate::check::{Check, Settlement};
use crate::clock::{Clock, Micros};
use crate::counting::Algorithm;
use crate::reports::Refused;
use crate::system_clock::SystemClock;
use crate::verdicts::Verdicts;

mod batch;
mod builder;
mod fingerprint;
mod inner;
mod sanctions;
mod settle;
mod shard;
#[cfg(test)]
mod tests;

pub use builder::MemoryBackendBuilder;
use inner::Inner;

/// The in-memory backend: exact, bounded, shared by clones.
///
/// Cloning is cheap and every clone counts in the same state.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{Check, Limit, MemoryBackend, Quota};
///
/// let backend = MemoryBackend::builder().max_keys(10_000).build();
/// let limit = Limit::fixed_window("daily", Quota::per_day(100)?)?;
/// let verdicts = backend.check_now(&[Check::new(&limit, b"shop-1")]).unwrap();
/// assert_eq!(verdicts[0].remaining, 99);
/// assert_eq!(backend.stats().tracked_keys, 1);
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct MemoryBackend<C: Clock = SystemClock> {
    inner: Arc<Inner<C>>,
}

impl<C: Clock> MemoryBackend<C> {
    /// Checks a batch and answers at once.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Protocol`] for more than [`MAX_CHECKS`] checks.
    pub fn check_now(&self, checks: &[Check<'_>]) -> Result<Verdicts, BackendError> {
        if checks.len() > MAX_CHECKS {
            return Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!("at most {MAX_CHECKS} checks per batch"),
            ));
        }
        Ok(self.inner.check(checks))
    }

    /// Settles checks admitted earlier, at once (see [`Settlement`] for what each algorithm
    /// does). A settle that would add a key while every place is taken changes nothing.
    pub fn settle_now(&self, settlements: &[Settlement<'_>]) {
        self.inner.settle(settlements);
    }

    /// How many keys are tracked, and the cap.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            tracked_keys: self.inner.key_cap.tracked(),
            max_keys: self.inner.key_cap.max_keys,
        }
    }

    /// What a check of one unit of `check`'s limit and key would find now, consuming nothing
    /// and adding no key: [`Admin::peek`](crate::Admin::peek), at once.
    pub fn peek_now(&self, check: &Check<'_>) -> KeyState {
        let inner = &*self.inner;
        let now = inner.clock.now();
        let probe = check.with_cost(1);
        let (fp, mut shard) = inner.key_shard(&probe);
        let (verdict, _, new) = shard.evaluate(&probe, &fp, now);
        if new {
            return KeyState::fresh(&check.quota);
        }
        KeyState::from_probe(&probe, verdict)
    }

    /// Forgets `check`'s key: [`Admin::reset`](crate::Admin::reset), at once.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Unsupported`] for a concurrency limit, whose slots are requests
    /// still in flight.
    pub fn reset_now(&self, check: &Check<'_>) -> Result<(), BackendError> {
        let inner = &*self.inner;
        inner.sanction(check, false, |s, _| s.lift());
        let (fp, mut shard) = inner.key_shard(check);
        let removed = match check.limit.algorithm() {
            Algorithm::Gcra => shard.gcra.remove(&fp).is_some(),
            Algorithm::FixedWindow => shard.windows.remove(&fp).is_some(),
            Algorithm::SlidingLog => shard.logs.remove(&fp).is_some(),
            Algorithm::Concurrency => return Err(unsupported("memory", "reset")),
        };
        if removed {
            inner.key_cap.free(1);
        }
        Ok(())
    }

    /// Denies `check`'s key for `duration`: [`Admin::deny`](crate::Admin::deny), at once.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Overloaded`] when the key has no state and every place under the
    /// key cap is taken.
    pub fn deny_now(&self, check: &Check<'_>, duration: Duration) -> Result<(), BackendError> {
        let micros = crate::backend::deny_micros(duration)?;
        if self.inner.sanction(check, true, |s, now| {
            s.denied_until = now.saturating_add(micros)
        }) {
            Ok(())
        } else {
            Err(BackendError::new(
                BackendErrorKind::Overloaded,
                "the memory backend tracks as many keys as it may",
            ))
        }
    }

    /// Gives back the concurrency slots that `checks` took (their other checks are ignored):
    /// what [`Slots::release`](crate::Slots::release) does, at once. A key whose last slot comes back is no longer
    /// tracked.
    pub fn release_now(&self, checks: &[Check<'_>]) {
        let inner = &*self.inner;
        for check in checks {
            if check.limit.algorithm() != Algorithm::Concurrency {
                continue;
            }
            let (fp, mut shard) = inner.key_shard(check);
            if let Entry::Occupied(mut held) = shard.inflight.entry(fp) {
                let left = held.get().saturating_sub(check.cost);
                if left == 0 {
                    held.remove();
                    inner.key_cap.free(1);
                } else {
                    *held.get_mut() = left;
                }
            }
        }
    }

    /// The most entries one call has swept so far.
    #[cfg(test)]
    fn most_swept(&self) -> usize {
        self.inner
            .sweeping
            .most_swept
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl<C: Clock> Backend for MemoryBackend<C> {
    type Future = Ready<Result<Verdicts, BackendError>>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        ready(self.check_now(checks))
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.settle_now(settlements);
    }

    fn pause(&self, check: &Check<'_>, micros: Micros) {
        self.inner.pause(check, micros);
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn slots(&self) -> Option<&dyn Slots> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    fn reports(&self) -> Option<&dyn Reports> {
        Some(self)
    }
}

/// The reports live in the process: every clone shares them, and both calls answer at once.
impl<C: Clock> Reports for MemoryBackend<C> {
    fn merge(
        &self,
        limit: &str,
        keep: usize,
        refused: Vec<Refused>,
        now: Micros,
    ) -> AdminFuture<()> {
        self.inner.reports.merge(limit, keep, refused, now);
        Box::pin(ready(Ok(())))
    }

    fn top(&self, limit: &str, n: usize, now: Micros) -> AdminFuture<Vec<Refused>> {
        Box::pin(ready(Ok(self.inner.reports.top(limit, n, now))))
    }
}

impl<C: Clock> Slots for MemoryBackend<C> {
    fn release(&self, checks: &[Check<'_>]) {
        self.release_now(checks);
    }
}

impl<C: Clock> Admin for MemoryBackend<C> {
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        Box::pin(ready(Ok(self.peek_now(check))))
    }

    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        Box::pin(ready(self.reset_now(check)))
    }

    fn deny(&self, check: &Check<'_>, duration: Duration) -> AdminFuture<()> {
        Box::pin(ready(self.deny_now(check, duration)))
    }

    fn undeny(&self, check: &Check<'_>) -> AdminFuture<()> {
        self.inner.sanction(check, false, |s, _| s.denied_until = 0);
        Box::pin(ready(Ok(())))
    }
}

impl<C: Clock> std::fmt::Debug for MemoryBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("shards", &self.inner.shards.len())
            .field("stats", &self.stats())
            .finish()
    }
}

/// A snapshot of a [`MemoryBackend`]'s size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Keys with state.
    pub tracked_keys: usize,
    /// The most keys it will track.
    pub max_keys: usize,
}
