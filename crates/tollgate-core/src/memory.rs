//! The bounded, sharded in-memory backend.
//!
//! State lives in shards, each a read-write lock over three hash maps (one per algorithm). A
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
//! ([`Status::AtCapacity`]) while tracked keys keep their state: a spray of unique keys can
//! neither grow memory nor evict someone's counter. Expired state is reclaimed by the requests
//! themselves: a shard touched after its sweep interval first drops its expired entries, so no
//! background thread is needed and the cost is amortised.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::future::{ready, Ready};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockWriteGuard};
use std::time::Duration;

use crate::algorithm::{self, WindowState};
use crate::backend::{
    Backend, BackendError, BackendErrorKind, Check, Status, Verdict, Verdicts, MAX_CHECKS,
};
use crate::clock::{micros, Clock, Micros, SystemClock};
use crate::limit::Algorithm;
use crate::sip::Sip13;

const DEFAULT_MAX_KEYS: usize = 1 << 20;
const DEFAULT_SWEEP: Duration = Duration::from_secs(1);

/// The in-memory backend: exact, bounded, shared by clones.
///
/// Cloning is cheap and every clone counts in the same state.
///
/// # Examples
///
/// ```
/// use tollgate_core::{Check, Limit, MemoryBackend, Quota};
///
/// let backend = MemoryBackend::builder().max_keys(10_000).build();
/// let limit = Limit::fixed_window("daily", Quota::per_day(100)?)?;
/// let verdicts = backend.check_now(&[Check::new(&limit, b"shop-1")]).unwrap();
/// assert_eq!(verdicts[0].remaining, 99);
/// assert_eq!(backend.stats().tracked_keys, 1);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct MemoryBackend<C: Clock = SystemClock> {
    inner: Arc<Inner<C>>,
}

struct Inner<C> {
    shards: Box<[RwLock<Shard>]>,
    clock: C,
    max_keys: usize,
    tracked: AtomicUsize,
    next_full_sweep: AtomicU64,
    seed: Sip13,
    sweep_interval: Micros,
}

/// A key's fingerprint: a keyed 64-bit hash of (limit, key). Bits 32.. pick the shard; the
/// map uses the low bits (bucket) and the top 7 (tag), so the two never overlap.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct Fp(u64);

impl Fp {
    fn shard(self, mask: usize) -> usize {
        ((self.0 >> 32) as usize) & mask
    }
}

impl Hash for Fp {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0);
    }
}

/// The fingerprint is already a keyed hash: use it as it is.
#[derive(Default)]
struct FpHasher(u64);

impl Hasher for FpHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type FpMap<V> = HashMap<Fp, V, BuildHasherDefault<FpHasher>>;

struct Log {
    entries: VecDeque<Micros>,
    period: Micros,
}

/// Aligned (and so sized) to 128 bytes, the span the adjacent-line prefetcher pulls in: two
/// threads on neighbouring shards do not bounce one cache line between their cores.
///
/// GCRA's TATs and the time of the next sweep are atomics, so that a lone GCRA check can read
/// and update them under the read lock; under the write lock they are plain values.
#[derive(Default)]
#[repr(align(128))]
struct Shard {
    gcra: FpMap<AtomicU64>,
    windows: FpMap<WindowState>,
    logs: FpMap<Log>,
    next_sweep: AtomicU64,
}

/// A map value holding an algorithm's state, read and written under the shard's write lock.
trait Slot {
    type State: Copy;
    fn new(state: Self::State) -> Self;
    fn get(&mut self) -> Self::State;
}

impl Slot for AtomicU64 {
    type State = Micros;
    fn new(tat: Micros) -> Self {
        AtomicU64::new(tat)
    }
    fn get(&mut self) -> Micros {
        *self.get_mut()
    }
}

impl Slot for WindowState {
    type State = WindowState;
    fn new(state: WindowState) -> Self {
        state
    }
    fn get(&mut self) -> WindowState {
        *self
    }
}

/// Stores `state` for `fp`. Overwriting in place skips `insert`'s growth check and slot search
/// for the common case, a key already tracked.
fn store<S: Slot>(map: &mut FpMap<S>, fp: Fp, state: S::State) {
    match map.get_mut(&fp) {
        Some(slot) => *slot = S::new(state),
        None => {
            map.insert(fp, S::new(state));
        }
    }
}

impl Shard {
    fn len(&self) -> usize {
        self.gcra.len() + self.windows.len() + self.logs.len()
    }

    /// Drops every entry whose state equals a fresh key's; returns how many.
    fn sweep(&mut self, now: Micros) -> usize {
        let before = self.len();
        self.gcra.retain(|_, tat| *tat.get_mut() > now);
        self.windows.retain(|_, w| w.window_end > now);
        self.logs
            .retain(|_, log| log.entries.back().is_some_and(|&t| t + log.period > now));
        before - self.len()
    }

    /// The check's verdict, what to write if the batch commits, and whether the key is new
    /// (one lookup: the same answers the capacity check).
    #[inline(always)]
    fn evaluate(&mut self, check: &Check<'_>, fp: &Fp, now: Micros) -> (Verdict, Pending, bool) {
        let quota = check.limit.quota();
        match check.limit.algorithm() {
            Algorithm::Gcra => {
                let tat = self.gcra.get_mut(fp).map(Slot::get);
                let (v, next) = algorithm::gcra(quota, tat, now, check.cost);
                (v, next.map_or(Pending::None, Pending::Tat), tat.is_none())
            }
            Algorithm::FixedWindow => {
                let state = self.windows.get(fp).copied();
                let (v, next) = algorithm::fixed_window(quota, state, now, check.cost);
                (
                    v,
                    next.map_or(Pending::None, Pending::Window),
                    state.is_none(),
                )
            }
            Algorithm::SlidingLog => {
                let log = self.logs.get_mut(fp).map(|l| &*l.entries.make_contiguous());
                let (v, trim) = algorithm::sliding_log(quota, log.unwrap_or(&[]), now, check.cost);
                let pending = if v.is_allowed() {
                    Pending::Log { trim }
                } else {
                    Pending::None
                };
                (v, pending, log.is_none())
            }
        }
    }

    #[inline(always)]
    fn commit(&mut self, check: &Check<'_>, fp: Fp, pending: Pending, now: Micros) {
        match pending {
            Pending::None => {}
            Pending::Tat(tat) => store(&mut self.gcra, fp, tat),
            Pending::Window(state) => store(&mut self.windows, fp, state),
            Pending::Log { trim } => {
                let period = check.limit.quota().period_micros();
                let log = match self.logs.entry(fp) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => e.insert(Log {
                        entries: VecDeque::new(),
                        period,
                    }),
                };
                log.entries.drain(..trim.min(log.entries.len()));
                // The log stays ascending (the algorithm's search and the sweep rely on it):
                // a check that read the clock before the newest entry was written records its
                // units at that entry's time, which errs toward limiting by the difference.
                let at = log.entries.back().map_or(now, |&newest| newest.max(now));
                log.entries
                    .extend(std::iter::repeat_n(at, check.cost as usize));
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Pending {
    None,
    Tat(Micros),
    Window(WindowState),
    Log { trim: usize },
}

impl MemoryBackend<SystemClock> {
    /// A backend with the defaults: about 1M keys, the system clock.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures a backend.
    pub fn builder() -> MemoryBackendBuilder<SystemClock> {
        MemoryBackendBuilder {
            clock: SystemClock::new(),
            max_keys: DEFAULT_MAX_KEYS,
            shards: None,
            sweep_interval: DEFAULT_SWEEP,
        }
    }
}

impl Default for MemoryBackend<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
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
        let inner = &*self.inner;
        let now = inner.clock.now();
        let n = checks.len();
        let mask = inner.shards.len() - 1;
        if inner.tracked.load(Ordering::Relaxed) >= inner.max_keys {
            inner.sweep_all(now);
        }

        if let [check] = checks {
            return Ok(inner.check_one(check, now, mask));
        }

        let mut fps = [Fp::default(); MAX_CHECKS];
        let mut shard_of = [0usize; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            fps[i] = inner.fingerprint(check);
            shard_of[i] = fps[i].shard(mask);
        }

        // Lock each shard the batch touches once, in ascending order.
        let mut order = shard_of;
        order[..n].sort_unstable();
        let mut locked = [0usize; MAX_CHECKS];
        let mut guards: [Option<RwLockWriteGuard<'_, Shard>>; MAX_CHECKS] = Default::default();
        let mut held = 0;
        for &s in &order[..n] {
            if held > 0 && locked[held - 1] == s {
                continue;
            }
            locked[held] = s;
            guards[held] = Some(inner.lock(s, now));
            held += 1;
        }
        let slot_of = |i: usize| {
            locked[..held]
                .iter()
                .position(|&s| s == shard_of[i])
                .unwrap_or(0)
        };

        let mut verdicts = Verdicts::new();
        let mut pending = [Pending::None; MAX_CHECKS];
        let mut reserved = [false; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            let Some(shard) = guards[slot_of(i)].as_mut() else {
                continue;
            };
            let (mut verdict, p, new) = shard.evaluate(check, &fps[i], now);
            if verdict.is_allowed() && new {
                if inner.reserve() {
                    reserved[i] = true;
                } else {
                    verdict.status = inner.at_capacity();
                }
            }
            if verdict.is_allowed() {
                pending[i] = p;
            }
            let _ = verdicts.push(verdict);
        }

        if verdicts.admits(checks) {
            for (i, check) in checks.iter().enumerate() {
                if let Some(shard) = guards[slot_of(i)].as_mut() {
                    shard.commit(check, fps[i], pending[i], now);
                }
            }
        } else {
            for (i, check) in checks.iter().enumerate() {
                if reserved[i] {
                    inner.tracked.fetch_sub(1, Ordering::Relaxed);
                }
                let v = &mut verdicts.as_mut_slice()[i];
                *v = algorithm::unconsumed(
                    check.limit.algorithm(),
                    check.limit.quota(),
                    *v,
                    check.cost,
                );
            }
        }
        Ok(verdicts)
    }

    /// How many keys are tracked, and the cap.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            tracked_keys: self.inner.tracked.load(Ordering::Relaxed),
            max_keys: self.inner.max_keys,
        }
    }

    /// The clock this backend reads.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }
}

impl<C> Inner<C> {
    /// Write-locks shard `s`, first dropping its expired state if its sweep is due.
    #[inline]
    fn lock(&self, s: usize, now: Micros) -> RwLockWriteGuard<'_, Shard> {
        let mut guard = self.shards[s]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let next_sweep = guard.next_sweep.get_mut();
        if now >= *next_sweep {
            *next_sweep = now.saturating_add(self.sweep_interval);
            let freed = guard.sweep(now);
            self.tracked.fetch_sub(freed, Ordering::Relaxed);
        }
        guard
    }

    /// A lone GCRA check of a tracked key under shard `s`'s read lock: the new TAT goes in with
    /// a compare-and-swap against the one the verdict was computed from, and the verdict is
    /// computed again from the newer TAT if another check got there first. `None` when the
    /// check needs the write lock: the key is new, or the shard's sweep is due.
    #[inline]
    fn gcra_shared(&self, s: usize, fp: Fp, check: &Check<'_>, now: Micros) -> Option<Verdict> {
        let guard = self.shards[s]
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if now >= guard.next_sweep.load(Ordering::Relaxed) {
            return None;
        }
        let tat = guard.gcra.get(&fp)?;
        let quota = check.limit.quota();
        let mut current = tat.load(Ordering::Relaxed);
        loop {
            let (verdict, next) = algorithm::gcra(quota, Some(current), now, check.cost);
            let Some(next) = next else {
                return Some(verdict);
            };
            match tat.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(verdict),
                Err(newer) => current = newer,
            }
        }
    }

    /// A batch of one check: the same rules without the batch's arrays and lock ordering.
    /// Runs `algorithm` on the state `fp` holds in `map` and stores what it returns, through
    /// one lookup for a tracked key; a new key takes a place under the cap, or is refused.
    #[inline]
    fn step<S: Slot>(
        &self,
        map: &mut FpMap<S>,
        fp: Fp,
        algorithm: impl FnOnce(Option<S::State>) -> (Verdict, Option<S::State>),
    ) -> Verdict {
        let mut slot = map.get_mut(&fp);
        let (mut verdict, next) = algorithm(slot.as_deref_mut().map(Slot::get));
        match (slot, next) {
            (Some(slot), Some(next)) => *slot = S::new(next),
            (None, Some(next)) => {
                if self.reserve() {
                    map.insert(fp, S::new(next));
                } else {
                    verdict.status = self.at_capacity();
                }
            }
            (_, None) => {}
        }
        verdict
    }

    #[inline]
    fn check_one(&self, check: &Check<'_>, now: Micros, mask: usize) -> Verdicts {
        let fp = self.fingerprint(check);
        let s = fp.shard(mask);
        let shared = match check.limit.algorithm() {
            Algorithm::Gcra => self.gcra_shared(s, fp, check, now),
            Algorithm::FixedWindow | Algorithm::SlidingLog => None,
        };
        let verdict = match shared {
            Some(verdict) => verdict,
            None => self.check_locked(check, fp, s, now),
        };
        let mut verdicts = Verdicts::new();
        let _ = verdicts.push(verdict);
        verdicts
    }

    /// A lone check under the shard's write lock.
    #[inline]
    fn check_locked(&self, check: &Check<'_>, fp: Fp, s: usize, now: Micros) -> Verdict {
        let mut guard = self.lock(s, now);
        let shard = &mut *guard;
        let quota = check.limit.quota();
        // GCRA and fixed window read and write a tracked key's state through one lookup.
        match check.limit.algorithm() {
            Algorithm::Gcra => self.step(&mut shard.gcra, fp, |state| {
                algorithm::gcra(quota, state, now, check.cost)
            }),
            Algorithm::FixedWindow => self.step(&mut shard.windows, fp, |state| {
                algorithm::fixed_window(quota, state, now, check.cost)
            }),
            Algorithm::SlidingLog => {
                let (mut verdict, pending, new) = shard.evaluate(check, &fp, now);
                if verdict.is_allowed() && new && !self.reserve() {
                    verdict.status = self.at_capacity();
                }
                if verdict.is_allowed() {
                    shard.commit(check, fp, pending, now);
                }
                verdict
            }
        }
    }

    /// The refusal of a new key while every place is taken.
    fn at_capacity(&self) -> Status {
        Status::AtCapacity {
            retry_after: self.sweep_interval,
        }
    }

    fn fingerprint(&self, check: &Check<'_>) -> Fp {
        Fp(self.seed.hash(check.limit.id(), check.key))
    }

    /// At the cap, expired keys in shards nobody touches would hold places forever: sweep every
    /// shard, at most once per sweep interval, holding one lock at a time.
    fn sweep_all(&self, now: Micros) {
        let due = self.next_full_sweep.load(Ordering::Relaxed);
        let next = now.saturating_add(self.sweep_interval);
        if now < due
            || self
                .next_full_sweep
                .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        for shard in self.shards.iter() {
            let mut guard = shard.write().unwrap_or_else(PoisonError::into_inner);
            let freed = guard.sweep(now);
            self.tracked.fetch_sub(freed, Ordering::Relaxed);
        }
    }

    /// Takes one of the `max_keys` places, if one is free.
    fn reserve(&self) -> bool {
        self.tracked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }
}

impl<C: Clock> Backend for MemoryBackend<C> {
    type Future = Ready<Result<Verdicts, BackendError>>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        ready(self.check_now(checks))
    }

    fn kind(&self) -> &'static str {
        "memory"
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

/// Configures a [`MemoryBackend`].
#[derive(Debug)]
pub struct MemoryBackendBuilder<C> {
    clock: C,
    max_keys: usize,
    shards: Option<usize>,
    sweep_interval: Duration,
}

impl<C: Clock> MemoryBackendBuilder<C> {
    /// The most keys tracked at once, over all limits (default 1,048,576). Past it, new keys
    /// are refused until expired ones are reclaimed.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// How many shards (rounded up to a power of two; default eight per core, at least 16).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// How often each shard drops its expired state (default one second). Also the
    /// `Retry-After` given to a key refused at capacity.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Reads time from `clock` instead of the system clock.
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryBackendBuilder<C2> {
        MemoryBackendBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
            sweep_interval: self.sweep_interval,
        }
    }

    /// Builds the backend.
    pub fn build(self) -> MemoryBackend<C> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shards = self
            .shards
            .unwrap_or((cores * 8).max(16))
            .clamp(1, 1 << 16)
            .next_power_of_two();
        MemoryBackend {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| RwLock::default()).collect(),
                clock: self.clock,
                max_keys: self.max_keys,
                tracked: AtomicUsize::new(0),
                next_full_sweep: AtomicU64::new(0),
                seed: Sip13::random(),
                sweep_interval: micros(self.sweep_interval).max(1),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FakeClock, Limit, Quota};

    fn backend(max_keys: usize) -> (MemoryBackend<FakeClock>, FakeClock) {
        let clock = FakeClock::new(1_000_000_000);
        let b = MemoryBackend::builder()
            .max_keys(max_keys)
            .clock(clock.clone())
            .build();
        (b, clock)
    }

    #[test]
    fn stacked_limits_consume_all_or_nothing() {
        let (b, _) = backend(100);
        let burst = Limit::gcra("burst", Quota::per_minute(2).unwrap()).unwrap();
        let daily = Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap();
        let mut last = Verdicts::new();
        for _ in 0..50 {
            last = b
                .check_now(&[Check::new(&burst, b"k"), Check::new(&daily, b"k")])
                .unwrap();
        }
        assert!(!last[0].is_allowed());
        assert_eq!(last[1].remaining, 98);
    }

    #[test]
    fn shadow_checks_never_refuse_the_batch() {
        let (b, _) = backend(100);
        let shadow = Limit::gcra("shadow", Quota::per_minute(1).unwrap())
            .unwrap()
            .shadow();
        let real = Limit::gcra("real", Quota::per_minute(10).unwrap()).unwrap();
        for _ in 0..3 {
            b.check_now(&[Check::new(&shadow, b"k"), Check::new(&real, b"k")])
                .unwrap();
        }
        let v = b
            .check_now(&[Check::new(&shadow, b"k"), Check::new(&real, b"k")])
            .unwrap();
        assert!(!v[0].is_allowed());
        assert_eq!(v[1].remaining, 6);
    }

    #[test]
    fn at_capacity_new_keys_are_refused_and_old_keys_keep_their_state() {
        let (b, clock) = backend(3);
        let l = Limit::gcra("l", Quota::per_minute(5).unwrap()).unwrap();
        for key in [b"a", b"b", b"c"] {
            assert!(b.check_now(&[Check::new(&l, key)]).unwrap()[0].is_allowed());
        }
        let v = b.check_now(&[Check::new(&l, b"d")]).unwrap()[0];
        assert_eq!(
            v.status,
            Status::AtCapacity {
                retry_after: 1_000_000
            }
        );
        assert_eq!(
            b.check_now(&[Check::new(&l, b"a")]).unwrap()[0].remaining,
            3
        );
        assert_eq!(b.stats().tracked_keys, 3);
        // Once the state has expired and been swept, new keys fit again.
        clock.advance(Duration::from_secs(61));
        assert!(b.check_now(&[Check::new(&l, b"d")]).unwrap()[0].is_allowed());
        assert_eq!(b.stats().tracked_keys, 1);
    }

    #[test]
    fn a_refused_batch_releases_its_reservations() {
        let (b, _) = backend(10);
        let open = Limit::gcra("open", Quota::per_minute(5).unwrap()).unwrap();
        let shut = Limit::gcra("shut", Quota::per_minute(1).unwrap()).unwrap();
        b.check_now(&[Check::new(&shut, b"x")]).unwrap();
        for key in [b"1", b"2", b"3"] {
            let v = b
                .check_now(&[Check::new(&open, key), Check::new(&shut, b"x")])
                .unwrap();
            assert_eq!(v[0].remaining, 5);
        }
        assert_eq!(b.stats().tracked_keys, 1);
    }

    #[test]
    fn sliding_log_counts_units_and_reclaims() {
        let (b, clock) = backend(10);
        let l = Limit::sliding_log("log", Quota::per_second(3).unwrap())
            .unwrap()
            .with_cost(2)
            .unwrap();
        assert!(b.check_now(&[Check::new(&l, b"k")]).unwrap()[0].is_allowed());
        let v = b.check_now(&[Check::new(&l, b"k")]).unwrap()[0];
        assert_eq!(
            v.status,
            Status::Denied {
                retry_after: 1_000_000
            }
        );
        clock.advance(Duration::from_secs(1));
        assert!(b.check_now(&[Check::new(&l, b"k")]).unwrap()[0].is_allowed());
    }
}
