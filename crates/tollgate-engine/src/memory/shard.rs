//! One shard: the state of the keys whose fingerprints fall in it, one map per algorithm, and
//! how a check reads and writes it under the shard's lock.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;

use crate::algorithm::{self, GcraState, WindowState};
use crate::bounds::MAX_LOG_UNITS;
use crate::check::Check;
use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::memory::fingerprint::{Fp, FpMap};
use crate::penalty::Sanction;
use crate::quota::Quota;
use crate::verdict::Verdict;

pub(super) struct Log {
    pub(super) entries: VecDeque<Micros>,
    /// How long the log keeps an entry: the longest period of its limit's quotas.
    pub(super) period: Micros,
}

/// The most entries a log keeps: twice the largest quota a sliding log may have. Only a log
/// whose plans differ in period can reach it (a plan of a short period admits many units
/// over a longer one's); it keeps the newest, at least twice any quota's limit, which still
/// answer every check exactly (past that many counted units, a check is refused whatever the
/// older ones, and its wait depends on the newest only).
pub(super) const MOST_LOG_ENTRIES: usize = 2 * MAX_LOG_UNITS as usize;

impl Log {
    /// Records `n` units at `now`, or at the newest entry's time if that is later (a check
    /// that read the clock before another wrote: the log stays ascending, which the search and
    /// the sweep rely on, and errs toward limiting by the difference), and drops the entries
    /// past [`MOST_LOG_ENTRIES`], the oldest first. Returns the time they were recorded at,
    /// by which a refund finds them.
    pub(super) fn record(&mut self, now: Micros, n: usize) -> Micros {
        let at = self.entries.back().map_or(now, |&newest| newest.max(now));
        self.entries.extend(std::iter::repeat_n(at, n));
        let over = self.entries.len().saturating_sub(MOST_LOG_ENTRIES);
        self.entries.drain(..over);
        at
    }
}

/// Aligned (and so sized) to 128 bytes, the span the adjacent-line prefetcher pulls in: two
/// threads on neighbouring shards do not bounce one cache line between their cores.
///
/// GCRA's TATs and the time of the next sweep are atomics, so that a lone GCRA check can read
/// and update them under the read lock; under the write lock they are plain values.
#[derive(Default)]
#[repr(align(128))]
pub(super) struct Shard {
    pub(super) gcra: FpMap<GcraRecord>,
    pub(super) windows: FpMap<WindowState>,
    pub(super) logs: FpMap<Log>,
    /// Concurrency slots held per key; an entry lives while its count is above 0.
    pub(super) inflight: FpMap<u32>,
    /// Keys with sanctions (refusals counted toward a block, a block, a deny), whatever
    /// their algorithm.
    pub(super) sanctions: FpMap<Sanction>,
    pub(super) next_sweep: AtomicU64,
}

/// A map value holding an algorithm's state, read and written under the shard's write lock.
pub(super) trait Record {
    type State: Copy;
    fn new(state: Self::State) -> Self;
    fn get(&mut self) -> Self::State;
}

/// A GCRA key ([`GcraState`]): its TAT, the emission interval it was written under, so that
/// a change of quota (a plan, a reload) carries what the key used ([`algorithm::gcra_carry`]),
/// and when its run began. The interval changes only under the write lock; the lone check's
/// compare-and-swap on the TAT under the read lock applies only while it is the check's own,
/// and a check that begins a run (its TAT was at or before its time) then writes `since`
/// (settles, which read it, take the write lock).
pub(super) struct GcraRecord {
    pub(super) tat: AtomicU64,
    pub(super) interval: Micros,
    pub(super) since: AtomicU64,
}

impl Record for GcraRecord {
    type State = GcraState;
    fn new(state: GcraState) -> Self {
        Self {
            tat: AtomicU64::new(state.tat),
            interval: state.interval,
            since: AtomicU64::new(state.since),
        }
    }
    fn get(&mut self) -> GcraState {
        GcraState {
            tat: *self.tat.get_mut(),
            interval: self.interval,
            since: *self.since.get_mut(),
        }
    }
}

/// The TAT `state` holds, carried to `quota`'s interval.
#[inline]
pub(super) fn carried(state: Option<GcraState>, quota: &Quota, now: Micros) -> Option<Micros> {
    state.map(|s| s.tat_under(quota.emission_interval(), now))
}

impl Record for u32 {
    type State = u32;
    fn new(held: u32) -> Self {
        held
    }
    fn get(&mut self) -> u32 {
        *self
    }
}

impl Record for WindowState {
    type State = WindowState;
    fn new(state: WindowState) -> Self {
        state
    }
    fn get(&mut self) -> WindowState {
        *self
    }
}

/// Stores `state` for `fp`. Overwriting in place skips `insert`'s growth check and bucket search
/// for the common case, a key already tracked.
#[inline]
pub(super) fn store<S: Record>(map: &mut FpMap<S>, fp: Fp, state: S::State) {
    match map.get_mut(&fp) {
        Some(record) => *record = S::new(state),
        None => {
            map.insert(fp, S::new(state));
        }
    }
}

impl Shard {
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.gcra.len()
            + self.windows.len()
            + self.logs.len()
            + self.inflight.len()
            + self.sanctions.len()
    }

    /// Drops every entry whose state equals a fresh key's; returns how many.
    pub(super) fn sweep(&mut self, now: Micros) -> usize {
        let before = self.len();
        self.gcra.retain(|_, record| *record.tat.get_mut() > now);
        self.windows.retain(|_, w| w.window_end > now);
        self.logs
            .retain(|_, log| log.entries.back().is_some_and(|&t| t + log.period > now));
        self.sanctions.retain(|_, s| s.live(now));
        before - self.len()
    }

    /// The check's verdict, what to write if the batch commits, and whether the key is new
    /// (one lookup: the same answers the capacity check).
    #[inline(always)]
    pub(super) fn evaluate(
        &mut self,
        check: &Check<'_>,
        fp: &Fp,
        now: Micros,
    ) -> (Verdict, Pending, bool) {
        if let Some(refused) = self.standing(fp, now) {
            return (refused, Pending::None, false);
        }
        let quota = &check.quota;
        match check.limit.algorithm() {
            Algorithm::Gcra => {
                let state = self.gcra.get_mut(fp).map(Record::get);
                let tat = carried(state, quota, now);
                let (v, next) = algorithm::gcra_delayed(quota, tat, now, check.cost, check.delay);
                let interval = quota.emission_interval();
                let pending = next.map_or(Pending::None, |t| {
                    Pending::Tat(GcraState::moved(state, t, interval, now))
                });
                (v, pending, tat.is_none())
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
                let (v, _) = algorithm::sliding_log(quota, log.unwrap_or(&[]), now, check.cost);
                let pending = if v.is_allowed() {
                    Pending::Log
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

    /// The refusal a block or a deny of `fp` makes at `now`, if one stands.
    #[inline(always)]
    pub(super) fn standing(&self, fp: &Fp, now: Micros) -> Option<Verdict> {
        if self.sanctions.is_empty() {
            return None;
        }
        let status = self.sanctions.get(fp)?.standing(now)?;
        let reset = match status {
            crate::verdict::Status::Blocked { retry_after }
            | crate::verdict::Status::Denylisted { retry_after } => retry_after,
            _ => 0,
        };
        Some(Verdict {
            status,
            remaining: 0,
            reset,
        })
    }

    /// Writes what `evaluate` found; returns the time a sliding log recorded the check's
    /// units at (`now` otherwise).
    #[inline(always)]
    pub(super) fn commit(
        &mut self,
        check: &Check<'_>,
        fp: Fp,
        pending: Pending,
        now: Micros,
    ) -> Micros {
        match pending {
            Pending::None => {}
            Pending::Tat(state) => store(&mut self.gcra, fp, state),
            Pending::Window(state) => store(&mut self.windows, fp, state),
            Pending::Slots(held) => store(&mut self.inflight, fp, held),
            Pending::Log => {
                // The entries carry across a change of quota and are shared by the limit's
                // plans: they leave after the longest period of its quotas, not the check's.
                let period = check.limit.log_keep_micros(&check.quota);
                let log = match self.logs.entry(fp) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => e.insert(Log {
                        entries: VecDeque::new(),
                        period,
                    }),
                };
                log.period = period;
                let gone = log
                    .entries
                    .partition_point(|&t| t.saturating_add(period) <= now);
                log.entries.drain(..gone);
                return log.record(now, check.cost as usize);
            }
        }
        now
    }
}

#[derive(Clone, Copy)]
pub(super) enum Pending {
    None,
    Tat(GcraState),
    Window(WindowState),
    Log,
    Slots(u32),
}
