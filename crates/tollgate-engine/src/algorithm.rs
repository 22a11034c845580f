//! The maths of each algorithm, as pure functions of (stored state, now, cost).
//!
//! These functions are the single definition of what tollgate admits. The in-memory backend
//! calls them directly; the Redis scripts implement the same arithmetic on the same integers
//! (microseconds), and the shared vector file `tests/vectors.txt` holds both to it.
//!
//! A denied request never changes state: each function returns the state to store only when it
//! admits.

mod gcra_state;

pub use gcra_state::{gcra_carry, gcra_refund, gcra_settle, gcra_settled, GcraState};

use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::quota::Quota;
use crate::verdict::{Status, Verdict};

/// GCRA on the stored theoretical arrival time `tat` (`None` for a key never seen).
///
/// Returns the verdict and, when admitted, the new `tat`.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{algorithm, Quota};
///
/// let q = Quota::per_minute(5)?; // one request every 12 s, burst of 5
/// let (v, tat) = algorithm::gcra(&q, None, 0, 1);
/// assert!(v.is_allowed());
/// assert_eq!(v.remaining, 4);
/// assert_eq!(tat, Some(12_000_000));
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[inline]
pub fn gcra(
    quota: &Quota,
    tat: Option<Micros>,
    now: Micros,
    cost: u32,
) -> (Verdict, Option<Micros>) {
    gcra_delayed(quota, tat, now, cost, 0)
}

/// GCRA with its tolerance widened by `delay` µs: a request that would conform within `delay`
/// is admitted, its time reserved at once (the TAT moves as for any admission); its caller
/// waits [`gcra_wait`] before serving it. With `delay` 0 this is [`gcra`].
///
/// Admitted iff `new_tat − now ≤ burst × interval + delay`. The verdict shows the quota after
/// the reservation (`reset` is `new_tat − now`; `remaining` is 0 for a request that waits); a
/// refusal's `retry_after` is the time until it would be admitted with the same delay.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{algorithm, Quota};
///
/// let q = Quota::per_minute(5)?.with_burst(1)?; // one every 12 s, a burst of one
/// let (mut tat, mut waits) = (None, vec![]);
/// for _ in 0..3 {
///     let (v, next) = algorithm::gcra_delayed(&q, tat, 0, 1, 30_000_000);
///     (tat, waits) = (next, [waits, vec![algorithm::gcra_wait(&q, &v)]].concat());
/// }
/// assert_eq!(waits, [0, 12_000_000, 24_000_000]);
/// // The fourth would wait 36 s > 30 s: refused, until 6 s later.
/// let (v, _) = algorithm::gcra_delayed(&q, tat, 0, 1, 30_000_000);
/// assert_eq!(v.retry_after(), Some(std::time::Duration::from_secs(6)));
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[inline]
pub fn gcra_delayed(
    quota: &Quota,
    tat: Option<Micros>,
    now: Micros,
    cost: u32,
    delay: Micros,
) -> (Verdict, Option<Micros>) {
    let interval = quota.emission_interval();
    let burst_span = interval * u64::from(quota.burst());
    let tolerance = burst_span + delay;
    let base = tat.map_or(now, |t| t.max(now));
    if cost > quota.burst() {
        return (
            too_costly(remaining_of(burst_span, base - now, interval), base - now),
            None,
        );
    }
    let new_tat = base + interval * u64::from(cost);
    if new_tat - now > tolerance {
        let verdict = Verdict {
            status: Status::Denied {
                retry_after: new_tat - tolerance - now,
            },
            remaining: remaining_of(burst_span, base - now, interval),
            reset: base - now,
        };
        return (verdict, None);
    }
    let verdict = Verdict {
        status: Status::Allowed,
        remaining: remaining_of(burst_span, new_tat - now, interval),
        reset: new_tat - now,
    };
    (verdict, Some(new_tat))
}

/// How long (µs) a request a GCRA check admitted under `quota` waits for its time: how far its
/// reservation (`verdict.reset`) lies beyond the burst's span; 0 without a wait or refused.
#[inline]
pub fn gcra_wait(quota: &Quota, verdict: &Verdict) -> Micros {
    if !verdict.is_allowed() {
        return 0;
    }
    let burst_span = quota.emission_interval() * u64::from(quota.burst());
    verdict.reset.saturating_sub(burst_span)
}

fn remaining_of(tolerance: Micros, used: Micros, interval: Micros) -> u64 {
    let slack = tolerance.saturating_sub(used);
    // An exhausted bucket (every refusal) answers without a division.
    if slack < interval {
        0
    } else {
        slack / interval
    }
}

/// The stored state of one fixed-window key: the end of its window and the units counted in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WindowState {
    /// When the window that `count` belongs to ends (microseconds since the Unix epoch).
    pub window_end: Micros,
    /// Units admitted in that window.
    pub count: u64,
}

impl WindowState {
    /// `count` units admitted in the window that ends at `window_end`.
    #[inline]
    pub const fn new(window_end: Micros, count: u64) -> Self {
        Self { window_end, count }
    }
}

/// The index of the window that holds `now`; windows are aligned to the Unix epoch.
pub fn window_index(quota: &Quota, now: Micros) -> u64 {
    now / quota.period_micros()
}

/// When the window that holds `now` ends.
pub fn window_end(quota: &Quota, now: Micros) -> Micros {
    (window_index(quota, now) + 1).saturating_mul(quota.period_micros())
}

/// Fixed window. `state` from an older window counts as empty.
///
/// `state` from a later window means that another check read the clock after this one and
/// wrote first (checks read `now` before they take their lock, and threads' clocks may differ
/// by a fraction of a microsecond): this check is counted in that later window. Counting it in
/// its own, older window would overwrite the later window's count with this one, and that
/// window would admit its whole quota again.
///
/// Returns the verdict and, when admitted, the new state.
pub fn fixed_window(
    quota: &Quota,
    state: Option<WindowState>,
    now: Micros,
    cost: u32,
) -> (Verdict, Option<WindowState>) {
    let window_end = window_end(quota, now);
    let (window_end, count) = match state {
        Some(s) if s.window_end >= window_end => (s.window_end, s.count),
        _ => (window_end, 0),
    };
    let limit = u64::from(quota.limit());
    let reset = window_end - now;
    let remaining = limit.saturating_sub(count);
    if cost > quota.limit() {
        return (too_costly(remaining, reset), None);
    }
    let cost = u64::from(cost);
    if count + cost > limit {
        let verdict = Verdict {
            status: Status::Denied { retry_after: reset },
            remaining,
            reset,
        };
        return (verdict, None);
    }
    let verdict = Verdict {
        status: Status::Allowed,
        remaining: limit - count - cost,
        reset,
    };
    (
        verdict,
        Some(WindowState {
            window_end,
            count: count + cost,
        }),
    )
}

/// Exact sliding log over `log`, the ascending times of the admitted units of one key
/// (entries that have left the window may still be in it).
///
/// Returns the verdict and how many leading entries have left this quota's window. When
/// admitted, the caller appends `cost` entries at `now` (a cost of 0 reports the log's reset).
pub fn sliding_log(quota: &Quota, log: &[Micros], now: Micros, cost: u32) -> (Verdict, usize) {
    let period = quota.period_micros();
    // An entry at t counts while t + period > now.
    let expired = log.partition_point(|&t| t.saturating_add(period) <= now);
    let alive = &log[expired..];
    let count = alive.len() as u64;
    let limit = u64::from(quota.limit());
    let remaining = limit.saturating_sub(count);
    let reset = alive.last().map_or(0, |&t| t + period - now);
    if cost > quota.limit() {
        return (too_costly(remaining, reset), expired);
    }
    let cost64 = u64::from(cost);
    if count + cost64 > limit {
        // The (count + cost - limit)-th oldest entry must leave before `cost` more fit.
        let must_leave = (count + cost64 - limit) as usize;
        let verdict = Verdict {
            status: Status::Denied {
                retry_after: alive[must_leave - 1] + period - now,
            },
            remaining,
            reset,
        };
        return (verdict, expired);
    }
    let verdict = Verdict {
        status: Status::Allowed,
        remaining: limit - count - cost64,
        reset: if cost > 0 { period } else { reset },
    };
    (verdict, expired)
}

/// A fixed window's settle of a check that reserved `reserved` units in the window that ends
/// at `window_end` and should have cost `actual`.
///
/// Returns the state to store, or `None` to leave it as it is (the window has ended, or
/// nothing changes).
pub fn fixed_window_settle(
    state: Option<WindowState>,
    window_end: Micros,
    reserved: u32,
    actual: u32,
) -> Option<WindowState> {
    let state = match state {
        Some(s) if s.window_end == window_end => s,
        // The check's units were counted in that window: a key without state there has
        // nothing to give back, and a charge makes the window's count.
        None if actual > reserved => WindowState {
            window_end,
            count: 0,
        },
        _ => return None,
    };
    let count = if actual < reserved {
        state.count.saturating_sub(u64::from(reserved - actual))
    } else {
        state.count.saturating_add(u64::from(actual - reserved))
    };
    (count != state.count || actual > reserved).then_some(WindowState { window_end, count })
}

/// The units a sliding log's charge of `actual - reserved` records when the log counts
/// `alive` units: a log holds at most twice the quota's limit.
pub(crate) fn sliding_log_charge(quota: &Quota, alive: u64, reserved: u32, actual: u32) -> u64 {
    let room = (2 * u64::from(quota.limit())).saturating_sub(alive);
    u64::from(actual.saturating_sub(reserved)).min(room)
}

fn too_costly(remaining: u64, reset: Micros) -> Verdict {
    Verdict {
        status: Status::CostTooHigh,
        remaining,
        reset,
    }
}

/// The verdict an admitted check reports when its batch was refused by another limit and it
/// consumed nothing after all.
///
/// A sliding log's admission says only how many units its log held, not when the newest of
/// them leaves: an empty log's quota is whole now (reset 0); otherwise the reset stays the
/// period, the latest the log can be whole again.
pub fn unconsumed(algorithm: Algorithm, quota: &Quota, verdict: Verdict, cost: u32) -> Verdict {
    if !verdict.is_allowed() {
        return verdict;
    }
    let remaining = verdict.remaining + u64::from(cost);
    let reset = match algorithm {
        Algorithm::Gcra => verdict
            .reset
            .saturating_sub(quota.emission_interval() * u64::from(cost)),
        Algorithm::SlidingLog if remaining >= u64::from(quota.limit()) => 0,
        Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::Concurrency => verdict.reset,
    };
    Verdict {
        status: Status::Allowed,
        remaining,
        reset,
    }
}

/// A concurrency limit on the `in_flight` slots its key holds: admitted while `cost` more fit
/// in the quota's limit. Returns the verdict and, when admitted, the slots then held.
/// A refusal's `retry_after` is `busy` (nobody knows when a slot frees); nothing here resets
/// with time, so `reset` is 0.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{algorithm, Quota};
///
/// let q = Quota::per_minute(2)?;
/// let (v, held) = algorithm::concurrency(&q, 1, 1, 1_000_000);
/// assert!(v.is_allowed());
/// assert_eq!((v.remaining, held), (0, Some(2)));
/// let (v, held) = algorithm::concurrency(&q, 2, 1, 1_000_000);
/// assert_eq!(v.retry_after(), Some(std::time::Duration::from_secs(1)));
/// assert_eq!(held, None);
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[inline]
pub fn concurrency(
    quota: &Quota,
    in_flight: u32,
    cost: u32,
    busy: Micros,
) -> (Verdict, Option<u32>) {
    let limit = quota.limit();
    let free = u64::from(limit.saturating_sub(in_flight));
    if cost > limit {
        return (too_costly(free, 0), None);
    }
    let held = in_flight.saturating_add(cost);
    if held > limit {
        let verdict = Verdict {
            status: Status::Denied { retry_after: busy },
            remaining: free,
            reset: 0,
        };
        return (verdict, None);
    }
    let verdict = Verdict {
        status: Status::Allowed,
        remaining: u64::from(limit - held),
        reset: 0,
    };
    (verdict, Some(held))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_counts_slots() {
        let q = Quota::per_minute(3).unwrap();
        let busy = 1_000_000;
        let (v, held) = concurrency(&q, 0, 1, busy);
        assert_eq!((v.status, v.remaining, held), (Status::Allowed, 2, Some(1)));
        let (v, held) = concurrency(&q, 2, 1, busy);
        assert_eq!((v.status, v.remaining, held), (Status::Allowed, 0, Some(3)));
        let (v, held) = concurrency(&q, 3, 1, busy);
        assert_eq!(
            (v.status, v.remaining, held),
            (Status::Denied { retry_after: busy }, 0, None)
        );
        let (v, held) = concurrency(&q, 0, 4, busy);
        assert_eq!((v.status, held), (Status::CostTooHigh, None));
        // More held than the limit (a limit lowered while slots were out): refused, not wrapped.
        let (v, held) = concurrency(&q, 7, 1, busy);
        assert_eq!((v.remaining, held), (0, None));
        assert!(!v.is_allowed());
    }

    const S: Micros = 1_000_000;

    fn retry(v: Verdict) -> Micros {
        match v.status {
            Status::Denied { retry_after } => retry_after,
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn gcra_admits_the_burst_then_one_per_interval() {
        let q = Quota::per_minute(5).unwrap();
        let now = 1_000 * S;
        let mut tat = None;
        for i in 0..5 {
            let (v, t) = gcra(&q, tat, now, 1);
            assert_eq!(v.status, Status::Allowed, "request {i}");
            assert_eq!(v.remaining, 4 - i);
            tat = t;
        }
        let (v, t) = gcra(&q, tat, now, 1);
        assert_eq!(retry(v), 12 * S);
        assert_eq!(t, None);
        // One microsecond early is still denied, exactly on time is admitted.
        assert!(!gcra(&q, tat, now + 12 * S - 1, 1).0.is_allowed());
        let (v, _) = gcra(&q, tat, now + 12 * S, 1);
        assert_eq!((v.status, v.remaining), (Status::Allowed, 0));
        // After a full period the bucket is full again.
        let (v, _) = gcra(&q, tat, now + 60 * S, 1);
        assert_eq!(v.remaining, 4);
    }

    #[test]
    fn gcra_burst_and_cost() {
        let q = Quota::per_second(10).unwrap().with_burst(3).unwrap();
        let (v, tat) = gcra(&q, None, 0, 3);
        assert_eq!(
            (v.status, v.remaining, v.reset),
            (Status::Allowed, 0, 300_000)
        );
        let (v, _) = gcra(&q, tat, 0, 2);
        assert_eq!(retry(v), 200_000);
        assert_eq!(gcra(&q, None, 0, 4).0.status, Status::CostTooHigh);
    }

    #[test]
    fn fixed_window_counts_within_the_window_and_reopens() {
        let q = Quota::per_minute(3).unwrap();
        let start = 600 * S; // a window boundary
        let mut state = None;
        for i in 0..3 {
            let (v, s) = fixed_window(&q, state, start + i * S, 1);
            assert_eq!(v.remaining, 2 - i);
            state = s;
        }
        let (v, s) = fixed_window(&q, state, start + 59 * S, 1);
        assert_eq!(retry(v), S);
        assert_eq!(s, None);
        let (v, _) = fixed_window(&q, state, start + 60 * S, 1);
        assert_eq!(
            (v.status, v.remaining, v.reset),
            (Status::Allowed, 2, 60 * S)
        );
        assert_eq!(
            fixed_window(&q, None, start, 4).0.status,
            Status::CostTooHigh
        );
    }

    #[test]
    fn day_windows_turn_at_utc_midnight() {
        let q = Quota::per_day(1).unwrap();
        let midnight = 20_000 * 86_400 * S; // 2024-10-04T00:00:00Z
        let (_, s) = fixed_window(&q, None, midnight - 1, 1);
        assert_eq!(fixed_window(&q, s, midnight - 1, 1).0.reset, 1);
        assert!(!fixed_window(&q, s, midnight - 1, 1).0.is_allowed());
        assert!(fixed_window(&q, s, midnight, 1).0.is_allowed());
    }

    #[test]
    fn hour_windows_turn_on_the_hour() {
        let q = Quota::per_hour(2).unwrap();
        let hour = 500_000 * 3_600 * S;
        let (v, _) = fixed_window(&q, None, hour + 1_800 * S, 1);
        assert_eq!(v.reset, 1_800 * S);
    }

    #[test]
    fn sliding_log_is_exact() {
        let q = Quota::new(2, std::time::Duration::from_secs(10)).unwrap();
        let log = [S, 4 * S];
        let (v, trim) = sliding_log(&q, &log, 5 * S, 1);
        assert_eq!((retry(v), trim), (6 * S, 0));
        // The first entry leaves at 11 s exactly.
        assert!(!sliding_log(&q, &log, 11 * S - 1, 1).0.is_allowed());
        let (v, trim) = sliding_log(&q, &log, 11 * S, 1);
        assert_eq!((v.status, v.remaining, trim), (Status::Allowed, 0, 1));
        // Cost 2 must wait for both.
        assert_eq!(retry(sliding_log(&q, &log, 5 * S, 2).0), 9 * S);
        assert_eq!(
            sliding_log(&q, &log, 5 * S, 3).0.status,
            Status::CostTooHigh
        );
    }

    #[test]
    fn unconsumed_restores_the_cost() {
        let q = Quota::per_minute(5).unwrap();
        let (v, _) = gcra(&q, None, 0, 2);
        let u = unconsumed(Algorithm::Gcra, &q, v, 2);
        assert_eq!((u.remaining, u.reset), (5, 0));
    }

    #[test]
    fn unconsumed_sliding_log_reset_is_the_untouched_logs() {
        let q = Quota::per_minute(5).unwrap();
        // An empty log: whole now.
        let (v, _) = sliding_log(&q, &[], 100 * S, 2);
        let u = unconsumed(Algorithm::SlidingLog, &q, v, 2);
        assert_eq!((u.remaining, u.reset), (5, 0));
        // A log holding a unit: whole again at the latest a period from now.
        let (v, _) = sliding_log(&q, &[90 * S], 100 * S, 2);
        let u = unconsumed(Algorithm::SlidingLog, &q, v, 2);
        assert_eq!((u.remaining, u.reset), (4, 60 * S));
    }

    #[test]
    fn a_later_windows_state_is_counted_in_not_wiped() {
        let q = Quota::per_minute(2).unwrap();
        let later = WindowState {
            window_end: 120 * S,
            count: 2,
        };
        // `now` in the window before `later`'s: refused, the later window being full.
        let (v, next) = fixed_window(&q, Some(later), 60 * S - 1, 1);
        assert_eq!((retry(v), v.remaining, next), (60 * S + 1, 0, None));
        let room = WindowState { count: 1, ..later };
        let (v, next) = fixed_window(&q, Some(room), 60 * S - 1, 1);
        assert_eq!((v.status, v.remaining), (Status::Allowed, 0));
        assert_eq!(next, Some(WindowState { count: 2, ..later }));
        // An older window's state still counts as empty.
        let (v, _) = fixed_window(&q, Some(room), 120 * S, 1);
        assert_eq!(v.remaining, 1);
    }

    #[test]
    fn the_last_window_before_the_end_of_time_does_not_overflow() {
        let q = Quota::per_minute(1).unwrap();
        let (v, next) = fixed_window(&q, None, u64::MAX - 1, 1);
        assert!(v.is_allowed());
        assert_eq!(next.map(|s| s.window_end), Some(u64::MAX));
    }
}
