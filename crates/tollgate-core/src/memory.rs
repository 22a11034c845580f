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
//! background thread is needed and the cost is amortised. At the cap, the requests also walk
//! the shards in turn, once per sweep interval, so that expired keys in shards nobody touches
//! give their places back.
//!
//! No check does more than a bounded amount of this work, however many keys are tracked. A
//! full backend holds about [`SHARD_KEYS`] keys per shard (it gets more shards when its cap
//! asks for them), a shard never holds more than twice that (a new key past it is refused as
//! at the cap, which random fingerprints make as good as impossible before the cap itself), and
//! one call sweeps at most one shard's worth of entries: a sweep and a table's growth both
//! stay within a few thousand entries, where sweeping every shard of a million keys inline
//! stalled one request for milliseconds.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::future::{ready, Ready};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockWriteGuard};
use std::time::Duration;

use crate::algorithm::{self, WindowState};
use crate::backend::{AdminFuture, Backend};
use crate::backend_error::{unsupported, BackendError, BackendErrorKind};
use crate::bounds::MAX_CHECKS;
use crate::check::{Check, Receipt, Settlement};
use crate::clock::{micros, Clock, Micros, SystemClock};
use crate::counting::Algorithm;
use crate::key_state::KeyState;
use crate::quota::Quota;
use crate::sip::Sip13;
use crate::verdict::{Status, Verdict};
use crate::verdicts::Verdicts;

const DEFAULT_MAX_KEYS: usize = 1 << 20;
const DEFAULT_SWEEP: Duration = Duration::from_secs(1);

/// The most keys a full backend holds per shard, on average: the shard count is raised to
/// `max_keys / SHARD_KEYS` when that is more. It bounds the entries one sweep visits and one
/// table growth moves, and so the worst time of a check.
const SHARD_KEYS: usize = 4_096;

const MAX_SHARDS: usize = 1 << 16;

/// How many shards a call at the cap looks at, at most, on its turn through the shards.
const ROUND_STEPS: usize = 16;

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
    /// The most entries a shard holds, and the most one call sweeps.
    shard_cap: usize,
    tracked: AtomicUsize,
    /// The next shard of the round through all shards at the cap (taken modulo their number).
    cursor: AtomicUsize,
    /// When the next round may start.
    next_round: AtomicU64,
    /// The most entries one call has swept (read by the tests).
    most_swept: AtomicUsize,
    seed: Sip13,
    sweep_interval: Micros,
}

/// What one call has swept so far: it sweeps a shard only while the total stays within
/// [`Inner::shard_cap`] entries.
struct Sweeps {
    swept: usize,
    cap: usize,
}

impl Sweeps {
    fn fits(&self, entries: usize) -> bool {
        self.swept + entries <= self.cap
    }
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
    gcra: FpMap<GcraSlot>,
    windows: FpMap<WindowState>,
    logs: FpMap<Log>,
    /// Concurrency slots held per key; an entry lives while its count is above 0.
    inflight: FpMap<u32>,
    next_sweep: AtomicU64,
}

/// A map value holding an algorithm's state, read and written under the shard's write lock.
trait Slot {
    type State: Copy;
    fn new(state: Self::State) -> Self;
    fn get(&mut self) -> Self::State;
}

/// A GCRA key: its TAT and the emission interval it was written under, so that a change of
/// quota (a plan, a reload) carries what the key used ([`algorithm::gcra_carry`]). The
/// interval changes only under the write lock; the lone check's compare-and-swap on the TAT
/// under the read lock applies only while it is the check's own.
struct GcraSlot {
    tat: AtomicU64,
    interval: Micros,
}

impl Slot for GcraSlot {
    type State = (Micros, Micros);
    fn new((tat, interval): (Micros, Micros)) -> Self {
        Self {
            tat: AtomicU64::new(tat),
            interval,
        }
    }
    fn get(&mut self) -> (Micros, Micros) {
        (*self.tat.get_mut(), self.interval)
    }
}

/// The TAT `state` holds, carried to `quota`'s interval.
#[inline]
fn carried(state: Option<(Micros, Micros)>, quota: &Quota, now: Micros) -> Option<Micros> {
    state.map(|(tat, from)| algorithm::gcra_carry(tat, now, from, quota.emission_interval()))
}

impl Slot for u32 {
    type State = u32;
    fn new(held: u32) -> Self {
        held
    }
    fn get(&mut self) -> u32 {
        *self
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
        self.gcra.len() + self.windows.len() + self.logs.len() + self.inflight.len()
    }

    /// Drops every entry whose state equals a fresh key's; returns how many.
    fn sweep(&mut self, now: Micros) -> usize {
        let before = self.len();
        self.gcra.retain(|_, slot| *slot.tat.get_mut() > now);
        self.windows.retain(|_, w| w.window_end > now);
        self.logs
            .retain(|_, log| log.entries.back().is_some_and(|&t| t + log.period > now));
        before - self.len()
    }

    /// The check's verdict, what to write if the batch commits, and whether the key is new
    /// (one lookup: the same answers the capacity check).
    #[inline(always)]
    fn evaluate(&mut self, check: &Check<'_>, fp: &Fp, now: Micros) -> (Verdict, Pending, bool) {
        let quota = &check.quota;
        match check.limit.algorithm() {
            Algorithm::Gcra => {
                let tat = carried(self.gcra.get_mut(fp).map(Slot::get), quota, now);
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
            Algorithm::Concurrency => {
                let held = self.inflight.get(fp).copied();
                let busy = check.limit.busy_retry_after_micros();
                let (v, next) = algorithm::concurrency(quota, held.unwrap_or(0), check.cost, busy);
                (
                    v,
                    next.map_or(Pending::None, Pending::Slots),
                    held.is_none(),
                )
            }
        }
    }

    #[inline(always)]
    fn commit(&mut self, check: &Check<'_>, fp: Fp, pending: Pending, now: Micros) {
        match pending {
            Pending::None => {}
            Pending::Tat(tat) => store(&mut self.gcra, fp, (tat, check.quota.emission_interval())),
            Pending::Window(state) => store(&mut self.windows, fp, state),
            Pending::Slots(held) => store(&mut self.inflight, fp, held),
            Pending::Log { trim } => {
                let period = check.quota.period_micros();
                let log = match self.logs.entry(fp) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => e.insert(Log {
                        entries: VecDeque::new(),
                        period,
                    }),
                };
                // The entries carry across a change of quota; they expire by the latest one.
                log.period = period;
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
    Slots(u32),
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
        let mask = inner.shards.len() - 1;
        let mut sweeps = Sweeps {
            swept: 0,
            cap: inner.shard_cap,
        };
        if inner.tracked.load(Ordering::Relaxed) >= inner.max_keys {
            inner.sweep_round(now, mask, &mut sweeps);
        }
        let mut verdicts = match checks {
            [check] => inner.check_one(check, now, mask, &mut sweeps),
            _ => inner.check_batch(checks, now, mask, &mut sweeps),
        };
        if sweeps.swept > 0 {
            inner.most_swept.fetch_max(sweeps.swept, Ordering::Relaxed);
        }
        for (i, check) in checks.iter().enumerate() {
            if let Some(v) = verdicts.get(i).copied().filter(Verdict::is_allowed) {
                let mark = match check.limit.algorithm() {
                    Algorithm::FixedWindow => now + v.reset,
                    Algorithm::Gcra | Algorithm::SlidingLog | Algorithm::Concurrency => 0,
                };
                verdicts.set_receipt(i, Receipt { at: now, mark });
            }
        }
        Ok(verdicts)
    }

    /// Settles checks admitted earlier, at once (see [`Settlement`] for what each algorithm
    /// does). A settle that would add a key while every place is taken changes nothing.
    pub fn settle_now(&self, settlements: &[Settlement<'_>]) {
        let inner = &*self.inner;
        let now = inner.clock.now();
        let mask = inner.shards.len() - 1;
        let mut sweeps = Sweeps {
            swept: 0,
            cap: inner.shard_cap,
        };
        for s in settlements {
            if s.actual == s.reserved {
                continue;
            }
            // The check's own fingerprint (a fixed window's mixes in its period).
            let fp = inner.fingerprint(&Check::new(s.limit, s.key).with_quota(s.quota));
            let mut guard = inner.lock(fp.shard(mask), now, &mut sweeps);
            let shard = &mut *guard;
            let room = shard.len() < inner.shard_cap;
            // The quota the check was made under (its plan's), never the limit's default.
            let quota = &s.quota;
            match s.limit.algorithm() {
                // A slot is one request: nothing to settle.
                Algorithm::Concurrency => {}
                Algorithm::Gcra => {
                    // The TAT under this quota's interval (carried if another quota wrote it).
                    let tat = carried(shard.gcra.get_mut(&fp).map(Slot::get), quota, now);
                    match algorithm::gcra_settle(quota, tat, now, s.reserved, s.actual) {
                        Some(t) if t <= now && shard.gcra.remove(&fp).is_some() => {
                            inner.tracked.fetch_sub(1, Ordering::Relaxed);
                        }
                        Some(t) if t <= now => {}
                        Some(t) if tat.is_some() || (room && inner.reserve()) => {
                            store(&mut shard.gcra, fp, (t, quota.emission_interval()));
                        }
                        _ => {}
                    }
                }
                Algorithm::FixedWindow => {
                    if s.receipt.mark <= now {
                        continue;
                    }
                    let state = shard.windows.get(&fp).copied();
                    let most = s.reserved.saturating_add(quota.limit().saturating_mul(2));
                    let actual = s.actual.min(most);
                    if let Some(next) =
                        algorithm::fixed_window_settle(state, s.receipt.mark, s.reserved, actual)
                    {
                        if state.is_some() || (room && inner.reserve()) {
                            store(&mut shard.windows, fp, next);
                        }
                    }
                }
                Algorithm::SlidingLog => {
                    let period = quota.period_micros();
                    if s.actual < s.reserved {
                        let Some(log) = shard.logs.get_mut(&fp) else {
                            continue;
                        };
                        // The check's units were recorded at its time, or at the newest
                        // entry's if that was later (by a fraction of a microsecond): the
                        // first entries from its time on. Units recorded at the same time are
                        // the same units.
                        let entries = log.entries.make_contiguous();
                        let from = entries.partition_point(|&t| t < s.receipt.at);
                        let n = (entries.len() - from).min((s.reserved - s.actual) as usize);
                        log.entries.drain(from..from + n);
                    } else {
                        let log = match shard.logs.entry(fp) {
                            Entry::Occupied(e) => e.into_mut(),
                            Entry::Vacant(e) => {
                                if !(room && inner.reserve()) {
                                    continue;
                                }
                                e.insert(Log {
                                    entries: VecDeque::new(),
                                    period,
                                })
                            }
                        };
                        let alive = log
                            .entries
                            .iter()
                            .filter(|&&t| t.saturating_add(period) > now)
                            .count() as u64;
                        let more =
                            algorithm::sliding_log_charge(quota, alive, s.reserved, s.actual);
                        let at = log.entries.back().map_or(now, |&newest| newest.max(now));
                        log.entries.extend(std::iter::repeat_n(at, more as usize));
                    }
                }
            }
        }
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

    /// What a check of one unit of `check`'s limit and key would find now, consuming nothing
    /// and adding no key: [`Backend::peek`], at once.
    pub fn peek_now(&self, check: &Check<'_>) -> KeyState {
        let inner = &*self.inner;
        let now = inner.clock.now();
        let probe = check.with_cost(1);
        let fp = inner.fingerprint(&probe);
        let mask = inner.shards.len() - 1;
        let mut shard = inner.shards[fp.shard(mask)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let (verdict, _, new) = shard.evaluate(&probe, &fp, now);
        if new {
            return KeyState::fresh(&check.quota);
        }
        KeyState::from_probe(&probe, verdict)
    }

    /// Forgets `check`'s key: [`Backend::reset`], at once.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Unsupported`] for a concurrency limit, whose slots are requests
    /// still in flight.
    pub fn reset_now(&self, check: &Check<'_>) -> Result<(), BackendError> {
        let inner = &*self.inner;
        let fp = inner.fingerprint(check);
        let mask = inner.shards.len() - 1;
        let mut shard = inner.shards[fp.shard(mask)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let removed = match check.limit.algorithm() {
            Algorithm::Gcra => shard.gcra.remove(&fp).is_some(),
            Algorithm::FixedWindow => shard.windows.remove(&fp).is_some(),
            Algorithm::SlidingLog => shard.logs.remove(&fp).is_some(),
            Algorithm::Concurrency => return Err(unsupported("memory", "reset")),
        };
        if removed {
            inner.tracked.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Gives back the concurrency slots that `checks` took (their other checks are ignored):
    /// what [`Backend::release`] does, at once. A key whose last slot comes back is no longer
    /// tracked.
    pub fn release_now(&self, checks: &[Check<'_>]) {
        let inner = &*self.inner;
        let mask = inner.shards.len() - 1;
        for check in checks {
            if check.limit.algorithm() != Algorithm::Concurrency {
                continue;
            }
            let fp = inner.fingerprint(check);
            let mut shard = inner.shards[fp.shard(mask)]
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if let Entry::Occupied(mut held) = shard.inflight.entry(fp) {
                let left = held.get().saturating_sub(check.cost);
                if left == 0 {
                    held.remove();
                    inner.tracked.fetch_sub(1, Ordering::Relaxed);
                } else {
                    *held.get_mut() = left;
                }
            }
        }
    }

    /// The most entries one call has swept so far.
    #[cfg(test)]
    fn most_swept(&self) -> usize {
        self.inner.most_swept.load(Ordering::Relaxed)
    }
}

impl<C> Inner<C> {
    /// A batch of two or more checks: every shard it touches write-locked at once.
    #[inline]
    fn check_batch(
        &self,
        checks: &[Check<'_>],
        now: Micros,
        mask: usize,
        sweeps: &mut Sweeps,
    ) -> Verdicts {
        let n = checks.len();

        let mut fps = [Fp::default(); MAX_CHECKS];
        let mut shard_of = [0usize; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            fps[i] = self.fingerprint(check);
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
            guards[held] = Some(self.lock(s, now, sweeps));
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
        // New keys the batch has placed in each locked shard, not yet inserted.
        let mut added = [0usize; MAX_CHECKS];
        for (i, check) in checks.iter().enumerate() {
            let slot = slot_of(i);
            let Some(shard) = guards[slot].as_mut() else {
                continue;
            };
            let (mut verdict, p, new) = shard.evaluate(check, &fps[i], now);
            if verdict.is_allowed() && new {
                if shard.len() + added[slot] < self.shard_cap && self.reserve() {
                    reserved[i] = true;
                    added[slot] += 1;
                } else {
                    verdict.status = self.at_capacity();
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
                    self.tracked.fetch_sub(1, Ordering::Relaxed);
                }
                let v = &mut verdicts.as_mut_slice()[i];
                *v = algorithm::unconsumed(check.limit.algorithm(), &check.quota, *v, check.cost);
            }
        }
        verdicts
    }

    /// Write-locks shard `s`, first dropping its expired state if its sweep is due and fits
    /// in what the call may still sweep.
    #[inline]
    fn lock(&self, s: usize, now: Micros, sweeps: &mut Sweeps) -> RwLockWriteGuard<'_, Shard> {
        let mut guard = self.shards[s]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        self.sweep_if_due(&mut guard, now, sweeps);
        guard
    }

    /// Drops `shard`'s expired state if its sweep is due, unless that would take the call past
    /// its sweeping budget (a later call does it then). `false` when the sweep is due but did
    /// not fit.
    #[inline]
    fn sweep_if_due(&self, shard: &mut Shard, now: Micros, sweeps: &mut Sweeps) -> bool {
        if now < *shard.next_sweep.get_mut() {
            return true;
        }
        let entries = shard.len();
        if !sweeps.fits(entries) {
            return false;
        }
        *shard.next_sweep.get_mut() = now.saturating_add(self.sweep_interval);
        sweeps.swept += entries;
        let freed = shard.sweep(now);
        self.tracked.fetch_sub(freed, Ordering::Relaxed);
        true
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
        let slot = guard.gcra.get(&fp)?;
        let quota = &check.quota;
        if slot.interval != quota.emission_interval() {
            // Written under another quota: carried under the write lock.
            return None;
        }
        let tat = &slot.tat;
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
    /// one lookup for a tracked key; a new key takes a place under the cap (if its shard has
    /// `room`), or is refused.
    #[inline]
    fn step<S: Slot>(
        &self,
        map: &mut FpMap<S>,
        room: bool,
        fp: Fp,
        algorithm: impl FnOnce(Option<S::State>) -> (Verdict, Option<S::State>),
    ) -> Verdict {
        let mut slot = map.get_mut(&fp);
        let (mut verdict, next) = algorithm(slot.as_deref_mut().map(Slot::get));
        match (slot, next) {
            (Some(slot), Some(next)) => *slot = S::new(next),
            (None, Some(next)) => {
                if room && self.reserve() {
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
    fn check_one(
        &self,
        check: &Check<'_>,
        now: Micros,
        mask: usize,
        sweeps: &mut Sweeps,
    ) -> Verdicts {
        let fp = self.fingerprint(check);
        let s = fp.shard(mask);
        let shared = match check.limit.algorithm() {
            Algorithm::Gcra => self.gcra_shared(s, fp, check, now),
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::Concurrency => None,
        };
        let verdict = match shared {
            Some(verdict) => verdict,
            None => self.check_locked(check, fp, s, now, sweeps),
        };
        let mut verdicts = Verdicts::new();
        let _ = verdicts.push(verdict);
        verdicts
    }

    /// A lone check under the shard's write lock.
    #[inline]
    fn check_locked(
        &self,
        check: &Check<'_>,
        fp: Fp,
        s: usize,
        now: Micros,
        sweeps: &mut Sweeps,
    ) -> Verdict {
        let mut guard = self.lock(s, now, sweeps);
        let shard = &mut *guard;
        let quota = &check.quota;
        let room = shard.len() < self.shard_cap;
        // GCRA and fixed window read and write a tracked key's state through one lookup.
        match check.limit.algorithm() {
            Algorithm::Gcra => self.step(&mut shard.gcra, room, fp, |state| {
                let (v, next) = algorithm::gcra(quota, carried(state, quota, now), now, check.cost);
                (v, next.map(|tat| (tat, quota.emission_interval())))
            }),
            Algorithm::FixedWindow => self.step(&mut shard.windows, room, fp, |state| {
                algorithm::fixed_window(quota, state, now, check.cost)
            }),
            Algorithm::SlidingLog | Algorithm::Concurrency => {
                let (mut verdict, pending, new) = shard.evaluate(check, &fp, now);
                if verdict.is_allowed() && new && !(room && self.reserve()) {
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
        // A fixed window's count belongs to its period: a limit whose period changes at run
        // time starts empty rather than reading a day's count as a minute's.
        let id = match check.limit.algorithm() {
            Algorithm::FixedWindow => {
                check.limit.id()
                    ^ check
                        .quota
                        .period_micros()
                        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            }
            Algorithm::Gcra | Algorithm::SlidingLog | Algorithm::Concurrency => check.limit.id(),
        };
        Fp(self.seed.hash(id, check.key))
    }

    /// At the cap, expired keys in shards nobody touches would hold places forever: each call
    /// at the cap takes the next few shards of a round through all of them, sweeping those whose
    /// sweep is due within the call's budget, one lock at a time. A round starts at most once
    /// per sweep interval.
    fn sweep_round(&self, now: Micros, mask: usize, sweeps: &mut Sweeps) {
        if now < self.next_round.load(Ordering::Relaxed) {
            return;
        }
        for _ in 0..ROUND_STEPS {
            let at = self.cursor.load(Ordering::Relaxed);
            let s = at & mask;
            let mut guard = self.shards[s]
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if !self.sweep_if_due(&mut guard, now, sweeps) {
                // This shard is the next call's turn.
                return;
            }
            drop(guard);
            let moved = self
                .cursor
                .compare_exchange(at, at.wrapping_add(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
            if moved && s == mask {
                self.next_round
                    .store(now.saturating_add(self.sweep_interval), Ordering::Relaxed);
                return;
            }
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

    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.settle_now(settlements);
    }

    fn release(&self, checks: &[Check<'_>]) {
        self.release_now(checks);
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        Box::pin(ready(Ok(self.peek_now(check))))
    }

    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        Box::pin(ready(self.reset_now(check)))
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

    /// How many shards, at least (rounded up to a power of two; default eight per core, at
    /// least 16). A backend whose cap would put more than 4,096 keys in a shard gets more
    /// shards, so that a sweep or a table's growth never holds up a check for long.
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
            .max(self.max_keys.div_ceil(SHARD_KEYS))
            .clamp(1, MAX_SHARDS)
            .next_power_of_two();
        // Twice a full shard's mean: with random fingerprints, no shard reaches it before the
        // cap does.
        let shard_cap = self.max_keys.div_ceil(shards).max(SHARD_KEYS) * 2;
        MemoryBackend {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| RwLock::default()).collect(),
                clock: self.clock,
                max_keys: self.max_keys,
                shard_cap,
                tracked: AtomicUsize::new(0),
                cursor: AtomicUsize::new(0),
                next_round: AtomicU64::new(0),
                most_swept: AtomicUsize::new(0),
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
    fn concurrency_slots_are_taken_all_or_nothing_and_given_back() {
        let (b, clock) = backend(100);
        let slots = Limit::concurrency("in-flight", 2).unwrap();
        let rate = Limit::gcra("rate", Quota::per_minute(3).unwrap()).unwrap();
        let both = |key: &'static [u8]| [Check::new(&rate, key), Check::new(&slots, key)];

        let admitted: Vec<bool> = (0..3)
            .map(|_| b.check_now(&both(b"a")).unwrap().admits(&both(b"a")))
            .collect();
        assert_eq!(admitted, [true, true, false]);
        // Refused for lack of a slot: the rate limit consumed nothing (1 of 3 left, as after
        // two admissions), and the refusal says to come back in a second.
        let v = b.check_now(&both(b"a")).unwrap();
        assert_eq!(v[0].remaining, 1);
        assert_eq!(v[1].retry_after(), Some(Duration::from_secs(1)));
        assert_eq!(v[1].remaining, 0);

        // One slot back: one more request fits; the rate limit then refuses the next one
        // (3 a minute), and that refusal takes no slot.
        b.release_now(&both(b"a"));
        assert!(b.check_now(&both(b"a")).unwrap().admits(&both(b"a")));
        b.release_now(&both(b"a"));
        let v = b.check_now(&both(b"a")).unwrap();
        assert!(!v.admits(&both(b"a")));
        assert!(v[1].is_allowed(), "the slot was free");
        clock.advance(Duration::from_secs(20));
        let v = b.check_now(&[Check::new(&slots, b"a")]).unwrap();
        assert_eq!((v[0].is_allowed(), v[0].remaining), (true, 0));

        // Every slot back: the key is no longer tracked; another key has slots of its own.
        assert_eq!(b.stats().tracked_keys, 2);
        for _ in 0..2 {
            b.release_now(&[Check::new(&slots, b"a")]);
        }
        assert_eq!(
            b.stats().tracked_keys,
            1,
            "only the rate limit's state is left"
        );
        // A release with nothing held changes nothing.
        b.release_now(&[Check::new(&slots, b"a")]);
        assert_eq!(b.stats().tracked_keys, 1);
        assert!(b.check_now(&[Check::new(&slots, b"b")]).unwrap()[0].is_allowed());
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

    #[test]
    fn no_call_sweeps_more_than_a_shards_worth_and_expired_keys_make_room() {
        let clock = FakeClock::new(1_000_000_000);
        let b = MemoryBackend::builder()
            .max_keys(50_000)
            .shards(16)
            .clock(clock.clone())
            .build();
        assert_eq!(b.inner.shards.len(), 16);
        assert_eq!(b.inner.shard_cap, 8_192);
        // A key's state lasts one second.
        let l = Limit::gcra("l", Quota::per_second(1).unwrap()).unwrap();
        let check = |i: u32| b.check_now(&[Check::new(&l, &i.to_le_bytes())]).unwrap()[0];
        for i in 0..50_000 {
            assert_eq!(check(i).status, Status::Allowed);
        }
        assert_eq!(
            check(50_000).status,
            Status::AtCapacity {
                retry_after: 1_000_000
            }
        );
        assert_eq!(b.stats().tracked_keys, 50_000);
        // Every key has expired: the next ones take their places, and no call sweeps the whole
        // backend to make room.
        clock.advance(Duration::from_secs(2));
        for i in 100_000..110_000 {
            assert_eq!(check(i).status, Status::Allowed);
        }
        assert_eq!(b.stats().tracked_keys, 10_000);
        let most = b.most_swept();
        assert!((3_000..=8_192).contains(&most), "{most}");
    }

    #[test]
    fn the_shard_count_follows_the_cap() {
        let b = MemoryBackend::builder().max_keys(100_000).shards(1).build();
        assert_eq!(b.inner.shards.len(), 32);
        assert_eq!(b.inner.shard_cap, 8_192);
        let b = MemoryBackend::builder().max_keys(1 << 20).build();
        assert_eq!(b.inner.shards.len(), 256);
        let b = MemoryBackend::builder().max_keys(1 << 30).build();
        assert_eq!(b.inner.shards.len(), 1 << 16);
        assert_eq!(b.inner.shard_cap, 32_768);
    }

    #[test]
    fn a_full_shard_refuses_new_keys_as_the_cap_does() {
        let mut b1 = MemoryBackend::builder()
            .max_keys(100)
            .shards(1)
            .clock(FakeClock::new(1_000_000_000))
            .build();
        Arc::get_mut(&mut b1.inner).unwrap().shard_cap = 2;
        let l = Limit::gcra("l", Quota::per_minute(5).unwrap()).unwrap();
        let w = Limit::fixed_window("w", Quota::per_minute(5).unwrap()).unwrap();
        assert!(b1.check_now(&[Check::new(&l, b"a")]).unwrap()[0].is_allowed());
        // A batch of two new keys with one place left in their shard: refused whole.
        let v = b1
            .check_now(&[Check::new(&l, b"b"), Check::new(&w, b"b")])
            .unwrap();
        assert_eq!(v[0].status, Status::Allowed);
        assert_eq!(
            v[1].status,
            Status::AtCapacity {
                retry_after: 1_000_000
            }
        );
        assert_eq!(v[0].remaining, 5);
        assert_eq!(b1.stats().tracked_keys, 1);
        assert!(b1.check_now(&[Check::new(&w, b"b")]).unwrap()[0].is_allowed());
        let v = b1.check_now(&[Check::new(&l, b"c")]).unwrap()[0];
        assert_eq!(
            v.status,
            Status::AtCapacity {
                retry_after: 1_000_000
            }
        );
        assert_eq!(b1.stats().tracked_keys, 2);
    }
}
