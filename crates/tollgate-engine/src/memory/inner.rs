//! What every clone of a memory backend shares: the shards, the cap on tracked keys, and the
//! sweeping that gives expired keys' room under the cap back.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock, RwLockWriteGuard};

use crate::check::Check;
use crate::clock::Micros;
use crate::memory::fingerprint::{fingerprint, Fp};
use crate::memory::shard::Shard;
use crate::reports::Board;
use crate::sip::Sip13;
use crate::verdict::Status;

/// How many shards a call at the cap looks at, at most, on its turn through the shards.
const ROUND_STEPS: usize = 16;

/// What every clone of a [`MemoryBackend`](crate::MemoryBackend) shares.
pub(super) struct Inner<C> {
    pub(super) shards: Box<[RwLock<Shard>]>,
    pub(super) clock: C,
    /// The reports of refused identities, shared by the process.
    pub(super) reports: Board,
    /// The secret key of the fingerprints.
    pub(super) seed: Sip13,
    pub(super) key_cap: KeyCap,
    pub(super) sweeping: Sweeping,
}

/// The cap on tracked keys: the cap over all shards, the cap of one shard, and how many
/// are taken.
pub(super) struct KeyCap {
    pub(super) max_keys: usize,
    /// The most entries a shard holds, and the most one call sweeps.
    pub(super) shard_cap: usize,
    pub(super) tracked: AtomicUsize,
}

impl KeyCap {
    /// Takes room for one key under `max_keys`, if one is free.
    #[inline]
    pub(super) fn reserve(&self) -> bool {
        self.tracked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back room for `n` keys.
    #[inline]
    pub(super) fn free(&self, n: usize) {
        self.tracked.fetch_sub(n, Ordering::Relaxed);
    }

    /// How many keys hold room.
    #[inline]
    pub(super) fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Relaxed)
    }

    /// Whether every place is taken.
    #[inline]
    pub(super) fn full(&self) -> bool {
        self.tracked() >= self.max_keys
    }
}

/// When shards are swept: each shard's interval, and the round through all shards at the cap.
pub(super) struct Sweeping {
    /// How often a shard drops its expired state (and the `Retry-After` of a refusal at the
    /// cap).
    pub(super) interval: Micros,
    /// The next shard of the round through all shards at the cap (taken modulo their number).
    pub(super) cursor: AtomicUsize,
    /// When the next round may start.
    pub(super) next_round: AtomicU64,
    /// The most entries one call has swept (read by the tests).
    pub(super) most_swept: AtomicUsize,
}

/// What one call has swept so far: it sweeps a shard only while the total stays within
/// [`KeyCap::shard_cap`] entries.
pub(super) struct Sweeps {
    pub(super) swept: usize,
    pub(super) cap: usize,
}

impl Sweeps {
    /// Nothing swept yet, `cap` entries at most.
    #[inline]
    pub(super) fn new(cap: usize) -> Self {
        Self { swept: 0, cap }
    }

    #[inline]
    pub(super) fn fits(&self, entries: usize) -> bool {
        self.swept + entries <= self.cap
    }
}

impl<C> Inner<C> {
    /// Write-locks shard `s`, first dropping its expired state if its sweep is due and fits
    /// in what the call may still sweep.
    #[inline]
    pub(super) fn lock(
        &self,
        s: usize,
        now: Micros,
        sweeps: &mut Sweeps,
    ) -> RwLockWriteGuard<'_, Shard> {
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
    pub(super) fn sweep_if_due(&self, shard: &mut Shard, now: Micros, sweeps: &mut Sweeps) -> bool {
        if now < *shard.next_sweep.get_mut() {
            return true;
        }
        let entries = shard.len();
        if !sweeps.fits(entries) {
            return false;
        }
        *shard.next_sweep.get_mut() = now.saturating_add(self.sweeping.interval);
        sweeps.swept += entries;
        let freed = shard.sweep(now);
        self.key_cap.free(freed);
        true
    }

    /// The refusal of a new key while every place is taken.
    #[inline]
    pub(super) fn at_capacity(&self) -> Status {
        Status::AtCapacity {
            retry_after: self.sweeping.interval,
        }
    }

    /// The fingerprint of `check`'s key in this backend.
    #[inline]
    pub(super) fn fingerprint(&self, check: &Check<'_>) -> Fp {
        fingerprint(&self.seed, check)
    }

    /// `check`'s key's fingerprint and its shard, locked for writing (no sweep: for the
    /// operators' and the settling calls that touch one key).
    pub(super) fn key_shard(&self, check: &Check<'_>) -> (Fp, RwLockWriteGuard<'_, Shard>) {
        let fp = self.fingerprint(check);
        let shard = self.shards[fp.shard(self.shards.len() - 1)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        (fp, shard)
    }

    /// At the cap, expired keys in shards nobody touches would hold room forever: each call
    /// at the cap takes the next few shards of a round through all of them, sweeping those whose
    /// sweep is due within the call's budget, one lock at a time. A round starts at most once
    /// per sweep interval.
    pub(super) fn sweep_round(&self, now: Micros, mask: usize, sweeps: &mut Sweeps) {
        if now < self.sweeping.next_round.load(Ordering::Relaxed) {
            return;
        }
        for _ in 0..ROUND_STEPS {
            let at = self.sweeping.cursor.load(Ordering::Relaxed);
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
                .sweeping
                .cursor
                .compare_exchange(at, at.wrapping_add(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
            if moved && s == mask {
                self.sweeping.next_round.store(
                    now.saturating_add(self.sweeping.interval),
                    Ordering::Relaxed,
                );
                return;
            }
        }
    }
}
