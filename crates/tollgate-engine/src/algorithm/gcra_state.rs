//! A GCRA key's stored state, and what moves it besides a check: a change of quota (the
//! carry) and a settle, with the rule that says when a refund may move the TAT back.

use crate::bounds::MAX_PERIOD;
use crate::clock::{micros, Micros};
use crate::quota::Quota;

/// What a backend stores for one GCRA key: its theoretical arrival time, the emission interval
/// it was written under (so that a change of quota carries what the key used), and when the
/// key's *run* began.
///
/// A run is the time during which the key's bucket is never full: it begins with the check
/// (or charge, or pause) that finds no state or a TAT at or before its time, and ends when
/// the TAT falls back to the clock or the key is reset. A refund names the run of its check by
/// the check's time ([`Receipt::at`](crate::Receipt::at)): a reservation made before `since`
/// belongs to an earlier run, which the state no longer counts, so its refund gives nothing
/// back (see [`gcra_refund`]). Runs are told apart by the backend's clock: a run that begins
/// in the very microsecond of an earlier run's check (a clock that stands still, or steps
/// back) takes that check's reservation for its own.
///
/// On Redis the value `<tat>:<interval>:<until>:<since>` at `<base>:v3` holds the same
/// figures (`until`: when the key's sanctions end, 0 for none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GcraState {
    /// The theoretical arrival time, in microseconds since the Unix epoch.
    pub tat: Micros,
    /// The emission interval `tat` is counted in.
    pub interval: Micros,
    /// When the key's run began, in microseconds since the Unix epoch.
    pub since: Micros,
}

impl GcraState {
    /// A key whose TAT is `tat`, counted in the emission interval `interval`, in a run that
    /// began at `since`.
    #[inline]
    pub const fn new(tat: Micros, interval: Micros, since: Micros) -> Self {
        Self {
            tat,
            interval,
            since,
        }
    }

    /// The state written at `now` when a check, a charge or a pause moves the TAT of `old` to
    /// `tat` under `interval`: `old`'s run while its TAT is ahead of `now`, else a run that
    /// begins at `now`.
    #[inline]
    pub fn moved(old: Option<Self>, tat: Micros, interval: Micros, now: Micros) -> Self {
        let since = old.filter(|s| s.tat > now).map_or(now, |s| s.since);
        Self {
            tat,
            interval,
            since,
        }
    }

    /// This state's TAT counted in the emission interval `to` ([`gcra_carry`]).
    #[inline]
    pub fn tat_under(&self, to: Micros, now: Micros) -> Micros {
        gcra_carry(self.tat, now, self.interval, to)
    }
}

/// A GCRA theoretical arrival time stored under the emission interval `from`, carried to a
/// quota whose interval is `to`: what the key has used, counted in units, is what it has used
/// under the new quota.
///
/// `TAT' = now + ⌈(TAT − now) / from⌉ × to`, capped at [`MAX_PERIOD`]
/// ahead: `(TAT − now) × to / from` with the units used rounded up to whole ones, which errs
/// toward limiting by less than one unit and keeps every figure an integer that the Redis
/// scripts' doubles hold exactly. A TAT in the past, or one stored under the same interval, is
/// returned as it is. Every backend carries with exactly this rule (on Redis, `carry` in the
/// scripts' shared `tat.lua`), whatever moves the TAT next: a check, a settle or a pause.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{algorithm, Quota};
///
/// // 5 a minute used up (a TAT a minute ahead), raised to 10 a minute: 5 units used, 30 s.
/// let (five, ten) = (Quota::per_minute(5)?, Quota::per_minute(10)?);
/// let now = 1_000_000_000;
/// let tat = algorithm::gcra_carry(now + 60_000_000, now, five.emission_interval(), ten.emission_interval());
/// assert_eq!(tat, now + 30_000_000);
/// assert_eq!(algorithm::gcra(&ten, Some(tat), now, 1).0.remaining, 4);
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[inline]
pub fn gcra_carry(tat: Micros, now: Micros, from: Micros, to: Micros) -> Micros {
    if tat <= now || from == to || from == 0 {
        return tat;
    }
    let used = (tat - now).div_ceil(from);
    now + used.saturating_mul(to).min(micros(MAX_PERIOD))
}

/// GCRA's settle arithmetic (see [`Settlement`](crate::Settlement)) of a check that reserved
/// `reserved` units and should have cost `actual`, on the stored `tat` (already carried to
/// `quota`) at `now`, without the rule that says whether and how far a refund moves the TAT
/// back: [`gcra_settled`] applies both (a refund as [`gcra_refund`] says).
///
/// Returns the TAT to store, or `None` to leave the state as it is. A TAT at or before `now`
/// is a full bucket, the same as no state.
pub fn gcra_settle(
    quota: &Quota,
    tat: Option<Micros>,
    now: Micros,
    reserved: u32,
    actual: u32,
) -> Option<Micros> {
    let interval = quota.emission_interval();
    if actual < reserved {
        let back = interval.saturating_mul(u64::from(reserved - actual));
        let tat = tat?;
        return Some(tat.saturating_sub(back).max(now));
    }
    if actual == reserved {
        return None;
    }
    let debt_cap = now + 2 * interval * u64::from(quota.burst());
    let base = tat.map_or(now, |t| t.max(now));
    let more = interval.saturating_mul(u64::from(actual - reserved));
    Some(base.saturating_add(more).min(debt_cap.max(base)))
}

/// The TAT a GCRA refund of `units` leaves on `state` at `now`, under `quota`, for a
/// reservation whose check ran at `at` and left the TAT at `left_tat` (its
/// [`Receipt`](crate::Receipt)); `None` when it gives nothing back.
///
/// A delayed request's start is pinned to its reservation's place in the TAT: moving the TAT
/// back under requests that still wait would give a later request the place of one that waits,
/// and both would start together. So a refund moves the TAT back only
///
/// - within the run of its check: `since <= at` (a reset, or a bucket that was full again
///   since, began another run, which never counted the reservation); and
/// - when it frees the *last* reservation (the TAT is still `left_tat`, under the same interval:
///   nothing was reserved after it), or when nobody waits (`TAT − burst × interval <= now`:
///   every reservation has started);
///
/// and by the part of the reservation still ahead of `now` only (`left_tat − now`, at most the
/// refund's intervals): a reservation whose time has passed was refilled by time, and a request
/// that started after it keeps its place. Never before `now`.
///
/// Otherwise the refund is dropped: the key counts the refund's units as used until its TAT
/// reaches them. That errs toward limiting only, by at most the units of the refunds dropped,
/// each back by itself within `burst × interval + delay` (the farthest a TAT runs ahead of the
/// clock when it is dropped).
///
/// A receipt with no time (`at` 0) is guarded by its TAT alone: the refund applies only while
/// the TAT is exactly `left_tat` (a quota lease's give-back, see [`Receipt`](crate::Receipt)).
#[inline]
pub fn gcra_refund(
    quota: &Quota,
    state: &GcraState,
    now: Micros,
    (at, left_tat): (Micros, Micros),
    units: u32,
) -> Option<Micros> {
    let interval = quota.emission_interval();
    let tat = state.tat_under(interval, now);
    if tat <= now {
        return None;
    }
    let last = left_tat != 0 && state.interval == interval && state.tat == left_tat;
    let applies = if at == 0 {
        last
    } else {
        let span = interval.saturating_mul(u64::from(quota.burst()));
        let nobody_waits = tat.saturating_sub(span) <= now;
        state.since <= at && (last || nobody_waits)
    };
    let back = interval
        .saturating_mul(u64::from(units))
        .min(left_tat.saturating_sub(now));
    (applies && back > 0).then(|| tat.saturating_sub(back).max(now))
}

/// The state a GCRA settle writes at `now` (see [`Settlement`](crate::Settlement)), or `None`
/// to leave `state` as it is: a refund moves the TAT back as [`gcra_refund`] says, for a check
/// that ran at `at` and left the TAT at `left_tat`, within its run; a charge moves it on (see
/// [`gcra_settle`]), in a new run if the bucket was full. The TAT is carried to `quota` first,
/// whole. A returned TAT at or before `now` is a full bucket (no state).
///
/// # Examples
///
/// ```
/// use tollgate_engine::{algorithm::{self, GcraState}, Quota};
///
/// // One a second, burst 1: three reservations at 10 s left the TAT at 11, 12 and 13 s; the
/// // second is refunded while the third still waits: dropped, nobody moves ahead.
/// let q = Quota::per_second(1)?.with_burst(1)?;
/// let s = 1_000_000;
/// let state = GcraState::new(13 * s, s, 10 * s);
/// assert_eq!(algorithm::gcra_settled(&q, Some(state), 10 * s, (10 * s, 12 * s), 1, 0), None);
/// // The third's own refund frees the last reservation: the TAT goes back to 12 s.
/// let back = algorithm::gcra_settled(&q, Some(state), 10 * s, (10 * s, 13 * s), 1, 0);
/// assert_eq!(back.map(|b| b.tat), Some(12 * s));
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
pub fn gcra_settled(
    quota: &Quota,
    state: Option<GcraState>,
    now: Micros,
    receipt: (Micros, Micros),
    reserved: u32,
    actual: u32,
) -> Option<GcraState> {
    let interval = quota.emission_interval();
    if actual < reserved {
        let s = state?;
        let tat = gcra_refund(quota, &s, now, receipt, reserved - actual)?;
        return Some(GcraState {
            tat,
            interval,
            since: s.since,
        });
    }
    let tat = state.map(|s| s.tat_under(interval, now));
    let t = gcra_settle(quota, tat, now, reserved, actual)?;
    Some(GcraState::moved(state, t, interval, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    #[test]
    fn gcra_carry_counts_what_was_used_in_the_new_intervals() {
        let now = 1_000 * S;
        // Same interval, or a TAT in the past: unchanged.
        assert_eq!(gcra_carry(now + 7 * S, now, 12 * S, 12 * S), now + 7 * S);
        assert_eq!(gcra_carry(now - S, now, 12 * S, 6 * S), now - S);
        // 5 units at 12 s, now at 6 s; a part of a unit counts as a unit.
        assert_eq!(gcra_carry(now + 60 * S, now, 12 * S, 6 * S), now + 30 * S);
        assert_eq!(gcra_carry(now + 13 * S, now, 12 * S, 6 * S), now + 12 * S);
        // Lowered: more time ahead than the new bucket holds.
        assert_eq!(gcra_carry(now + 60 * S, now, 6 * S, 12 * S), now + 120 * S);
        // Never more than MAX_PERIOD ahead.
        let max = micros(MAX_PERIOD);
        assert_eq!(gcra_carry(now + max, now, 1, max), now + max);
    }

    /// One a second, burst 1.
    fn one() -> Quota {
        Quota::per_second(1).unwrap().with_burst(1).unwrap()
    }

    #[test]
    fn a_refund_under_waiters_applies_only_to_the_last_reservation() {
        let q = one();
        let state = GcraState {
            tat: 3 * S,
            interval: S,
            since: 0,
        };
        let refund =
            |state: &GcraState, now, at, left_tat| gcra_refund(&q, state, now, (at, left_tat), 1);
        // The middle reservation (TAT 2 s) while the last waits: dropped.
        assert_eq!(refund(&state, 0, 0, 2 * S), None);
        assert_eq!(refund(&state, 0, 1, 2 * S), None);
        // The last: back by one interval.
        assert_eq!(refund(&state, 0, 1, 3 * S), Some(2 * S));
        // Once the last has started (at 2 s) nobody waits: any reservation of the run, by its
        // part still ahead. The second's (1 to 2 s) is past: nothing.
        assert_eq!(refund(&state, 2 * S, 1, 2 * S), None);
        assert_eq!(refund(&state, 2 * S + S / 4, 1, 3 * S), Some(2 * S + S / 4));
        let wide = Quota::per_second(1).unwrap().with_burst(3).unwrap();
        let half = S + S / 2;
        assert_eq!(
            gcra_refund(&wide, &state, half, (1, 2 * S), 1),
            Some(3 * S - S / 2)
        );
        // A reservation of an earlier run (a reset, a full bucket since): dropped.
        let later = GcraState { since: 5, ..state };
        assert_eq!(refund(&later, 0, 1, 3 * S), None);
        // Without a time, only the exact TAT (a lease's give-back).
        assert_eq!(refund(&state, 2 * S, 0, 2 * S), None);
        assert_eq!(refund(&later, 0, 0, 3 * S), Some(2 * S));
        // Under another interval, no TAT is the last.
        let other = GcraState {
            interval: S / 2,
            ..state
        };
        assert_eq!(refund(&other, 0, 1, 3 * S), None);
        // A full bucket has nothing to give back.
        assert_eq!(refund(&state, 3 * S, 1, 3 * S), None);
    }

    #[test]
    fn a_charge_keeps_the_run_or_begins_one() {
        let q = one();
        let full = GcraState {
            tat: S,
            interval: S,
            since: 0,
        };
        let after = gcra_settled(&q, Some(full), 2 * S, (2 * S, 0), 1, 2).unwrap();
        assert_eq!(
            after,
            GcraState {
                tat: 3 * S,
                interval: S,
                since: 2 * S
            }
        );
        let ahead = gcra_settled(&q, Some(full), S / 2, (S / 2, 0), 1, 2).unwrap();
        assert_eq!(
            ahead,
            GcraState {
                tat: 2 * S,
                interval: S,
                since: 0
            }
        );
    }
}
