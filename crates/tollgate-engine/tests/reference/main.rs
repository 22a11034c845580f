//! Property tests of `tollgate_engine::algorithm` (and of what the in-memory backend stores
//! with it: plans, settles, pauses, delays) against references written from the algorithms'
//! definitions (`model.rs`), not from the implementation; and the section of
//! `tests/vectors.txt` those references generate (`generate.rs`).
//!
//! Every figure must agree exactly: the references use the engine's documented rounding (the
//! emission interval is the period divided by the limit, rounded down to whole microseconds;
//! a carry counts a part of a unit as a unit) and nothing else. Time is a number passed in.

#![allow(clippy::unwrap_used)]

mod generate;
mod model;
mod sequences;

use std::time::Duration;

use proptest::prelude::*;
use tollgate_engine::algorithm::{self, WindowState};
use tollgate_engine::{Check, FakeClock, Limit, MemoryBackend, Quota, Status, Verdict};

use model::{Gcra, Log, Windows};

/// Cases per property: the whole suite runs in a few seconds in a debug build.
const CASES: u32 = 512;

/// A GCRA quota: a limit of 1 to 20, a period from a few microseconds (where the limit seldom
/// divides the period, and the interval's rounding is large: a `Limit` would refuse it, the
/// algorithm takes any quota) to two minutes, a burst of 1 to 24.
fn gcra_quota() -> impl Strategy<Value = Quota> {
    let period = prop_oneof![
        1u64..=2_000,
        1_000u64..=120_000_000,
        Just(1_000_000u64),
        Just(60_000_000u64),
    ];
    (1u32..=20, period, 1u32..=24).prop_map(|(limit, period, burst)| {
        let period = Duration::from_micros(period.max(u64::from(limit)));
        Quota::new(limit, period)
            .unwrap()
            .with_burst(burst)
            .unwrap()
    })
}

/// A quota for a window or a log: a limit of 1 to 12 per 1 µs to 90 s, a UTC hour or a UTC
/// day (windows are aligned to the epoch, so these are calendar hours and days).
pub(crate) fn window_quota() -> impl Strategy<Value = Quota> {
    let period = prop_oneof![
        1u64..=50,
        1_000u64..=90_000_000,
        Just(60_000_000u64),
        Just(3_600_000_000u64),
        Just(86_400_000_000u64),
    ];
    (1u32..=12, period).prop_map(|(limit, period)| {
        Quota::new(limit, Duration::from_micros(period.max(u64::from(limit)))).unwrap()
    })
}

/// `CASES` cases (or `PROPTEST_CASES`, for a longer run by hand), and no files of failures
/// left in the source tree.
pub(crate) fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    ProptestConfig {
        cases: cases.unwrap_or(CASES),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Runs `steps` (a gap's kind and seed, a cost, a plan) under `quotas`, the quotas of one
/// sliding-log limit (the first its default, the others its plans): through
/// `algorithm::sliding_log` on every unit admitted so far, through the in-memory backend
/// (which trims its log), and through the reference; the first step where they differ.
fn sliding(quotas: &[Quota], steps: &[(u64, u64, u32, usize)]) -> Result<(), String> {
    let start = 1_700_000_000_000_000u64;
    let (mut now, mut model) = (start, Log::default());
    let mut limit = Limit::sliding_log("reference", quotas[0]).map_err(|e| e.to_string())?;
    for (i, q) in quotas.iter().enumerate().skip(1) {
        limit = limit
            .plan(&format!("p{i}"), *q)
            .map_err(|e| e.to_string())?;
    }
    let clock = FakeClock::new(start);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let longest = quotas.iter().map(Quota::period_micros).max().unwrap_or(1);
    for (i, &(kind, r, cost, plan)) in steps.iter().enumerate() {
        now += sequences::gap(kind, r, 1, longest);
        clock.set(now);
        let q = &quotas[plan % quotas.len()];
        let (got, _) = algorithm::sliding_log(q, &model.units, now, cost);
        let want = model.check(q.limit(), q.period_micros(), now, cost);
        if got != want {
            return Err(format!("step {i}: got {got:?}, the reference {want:?}"));
        }
        let check = Check::new(&limit, b"k").with_quota(*q).with_cost(cost);
        let stored = backend.check_now(&[check]).map_err(|e| e.to_string())?[0];
        if stored != want {
            return Err(format!(
                "step {i}: the in-memory backend {stored:?}, the reference {want:?}"
            ));
        }
    }
    Ok(())
}

fn denied(v: &Verdict) -> Option<u64> {
    match v.status {
        Status::Denied { retry_after } => Some(retry_after),
        _ => None,
    }
}

proptest! {
    #![proptest_config(config())]

    /// One GCRA check, with or without a delay, on any stored TAT: the verdict, the wait and
    /// the TAT to store are virtual scheduling's.
    #[test]
    fn one_gcra_check_is_virtual_scheduling(
        q in gcra_quota(),
        now in 0u64..(1 << 52),
        mode in 0u8..4,
        r in any::<u64>(),
        cost in 1u32..=26,
        delayed in any::<bool>(),
        d in any::<u64>(),
    ) {
        let m = Gcra::of(&q);
        // The documented rounding: whole microseconds, rounded down.
        prop_assert_eq!(m.t, q.emission_interval());
        let span = u64::from(m.burst) * m.t;
        let delay = if delayed { d % (3 * span + 1) } else { 0 };
        let tat = match mode {
            0 => None,
            1 => Some(now.saturating_sub(r % (2 * span + 1))),
            2 => Some(now + r % (span + 1)),
            _ => Some(now + r % (3 * span + delay + 1)),
        };
        let want = m.check(tat.unwrap_or(0), now, cost, delay);
        let (got, next) = algorithm::gcra_delayed(&q, tat, now, cost, delay);
        prop_assert_eq!(got, want.verdict);
        // A TAT at or before now is a full bucket, however it is written.
        prop_assert_eq!(next.map(|t| t.max(now)), want.tat.map(|t| t.max(now)));
        prop_assert_eq!(algorithm::gcra_wait(&q, &got), want.wait);
        if delay == 0 {
            prop_assert_eq!(algorithm::gcra(&q, tat, now, cost), (got, next));
        }
    }

    /// A TAT carried to another interval leaves the key exactly the units it had used, a part
    /// of a unit counted as one (docs/architecture.md): checked by counting, under the new
    /// quota, the cells that still conform.
    #[test]
    fn a_carry_keeps_the_units_used(
        from in gcra_quota(),
        to in gcra_quota(),
        now in 0u64..(1 << 52),
        r in any::<u64>(),
    ) {
        let (old, new) = (Gcra::of(&from), Gcra::of(&to));
        let tat = now + r % (2 * u64::from(old.burst) * old.t + 1);
        let carried = algorithm::gcra_carry(tat, now, old.t, new.t);
        prop_assert_eq!(carried, model::carry(tat, now, old.t, new.t));
        let used = model::used_units(tat, now, old.t);
        if old.t != new.t {
            prop_assert_eq!(new.room(carried, now), u64::from(new.burst).saturating_sub(used));
        }
    }

    /// A GCRA settle at the algorithm's level (no waiters: the TAT at most a burst ahead).
    #[test]
    fn a_gcra_settle_is_the_documented_move(
        q in gcra_quota(),
        now in 0u64..(1 << 52),
        r in any::<u64>(),
        fresh in any::<bool>(),
        reserved in 1u32..=24,
        actual in 0u32..=60,
    ) {
        let m = Gcra::of(&q);
        let span = u64::from(m.burst) * m.t;
        let tat = (!fresh).then(|| now.saturating_sub(span) + r % (2 * span + 1));
        let want = m.settle(tat.unwrap_or(0), now, reserved, actual);
        let got = algorithm::gcra_settle(&q, tat, now, reserved, actual);
        // `None` leaves the state as it is.
        let got = got.or(tat).unwrap_or(0);
        prop_assert_eq!(got.max(now), want.max(now));
    }

    /// GCRA sequences from a fresh key: every verdict, wait and TAT.
    #[test]
    fn gcra_sequences_are_virtual_scheduling(
        q in gcra_quota(),
        steps in prop::collection::vec((0u64..4, any::<u64>(), 1u32..=26, 0u64..3), 1..40),
    ) {
        let m = Gcra::of(&q);
        let span = u64::from(m.burst) * m.t;
        let (mut now, mut tat, mut model_tat) = (1_700_000_000_000_000u64, None, 0);
        for (i, &(kind, r, cost, delay)) in steps.iter().enumerate() {
            now += sequences::gap(kind, r, m.t, span);
            let delay = delay * span / 2;
            let want = m.check(model_tat, now, cost, delay);
            let (got, next) = algorithm::gcra_delayed(&q, tat, now, cost, delay);
            prop_assert_eq!(got, want.verdict, "step {}", i);
            prop_assert_eq!(algorithm::gcra_wait(&q, &got), want.wait, "step {}", i);
            if let (Some(t), Some(w)) = (next, want.tat) {
                prop_assert_eq!(t, w, "step {}", i);
                (tat, model_tat) = (Some(t), w);
            }
        }
    }

    /// Fixed windows, the quota's limit changed by plans between checks (same period): a count
    /// per window index.
    #[test]
    fn fixed_windows_count_per_window(
        q in window_quota(),
        limits in prop::collection::vec(1u32..=12, 1..4),
        steps in prop::collection::vec((0u64..4, any::<u64>(), 0u32..=14, any::<usize>()), 1..40),
    ) {
        let period = q.period_micros();
        let quotas: Vec<Quota> = limits
            .iter()
            .map(|&l| Quota::new(l.min(u32::try_from(period).unwrap_or(u32::MAX)), q.period()).unwrap())
            .collect();
        let (mut now, mut state, mut model) = (1_699_999_999_999_999u64, None, Windows::default());
        for (i, &(kind, r, cost, plan)) in steps.iter().enumerate() {
            now = match kind {
                // To the next window's boundary, a microsecond before it or after it.
                0 => (now / period + 1) * period - 1 + r % 3,
                _ => now + sequences::gap(kind, r, 1, period),
            };
            let q = &quotas[plan % quotas.len()];
            let want = model.check(q.limit(), period, now, cost);
            let (got, next) = algorithm::fixed_window(q, state, now, cost);
            prop_assert_eq!(got, want, "step {}", i);
            if let Some(next) = next {
                prop_assert_eq!(next.window_end, (now / period + 1) * period);
                state = Some(next);
            }
        }
    }

    /// Sliding logs, the quota's limit changed by plans between checks: a list of times.
    #[test]
    fn sliding_logs_count_the_units_of_the_last_period(
        q in window_quota(),
        limits in prop::collection::vec(1u32..=12, 1..4),
        steps in prop::collection::vec((0u64..4, any::<u64>(), 1u32..=14, any::<usize>()), 1..40),
    ) {
        let period = q.period_micros();
        let quotas: Vec<Quota> = limits
            .iter()
            .map(|&l| Quota::new(l.min(u32::try_from(period).unwrap_or(u32::MAX)), q.period()).unwrap())
            .collect();
        prop_assert_eq!(sliding(&quotas, &steps), Ok(()));
    }

    /// Sliding logs under plans of different periods: a unit counts under each check's own
    /// period, whatever the period of the checks between (docs/limits-file.md: a sliding log
    /// keeps its entries across a change of quota; plans of a sliding log may differ in period).
    /// The in-memory backend keeps a log's entries for the longest period of its limit's plans.
    #[test]
    fn sliding_logs_count_the_units_of_each_plans_period(
        quotas in prop::collection::vec(window_quota(), 1..4),
        steps in prop::collection::vec((0u64..4, any::<u64>(), 1u32..=14, any::<usize>()), 1..40),
    ) {
        prop_assert_eq!(sliding(&quotas, &steps), Ok(()));
    }

    /// A request of no units (a cost read from the request may be 0) admitted by a sliding
    /// log reports the log's own reset: when its newest counted unit leaves, 0 for an empty log.
    #[test]
    fn a_sliding_log_admission_of_no_units_reports_the_logs_reset(
        q in window_quota(),
        now in 1u64..(1 << 52),
        entries in prop::collection::vec(any::<u64>(), 0..4),
    ) {
        let period = q.period_micros();
        let mut log: Vec<u64> = entries.iter().map(|e| now - e % period.min(now)).collect();
        log.sort_unstable();
        let mut model = Log { units: log.clone() };
        let want = model.check(q.limit(), period, now, 0);
        prop_assert_eq!(algorithm::sliding_log(&q, &log, now, 0).0, want);
    }

    /// A refusal's retry-after is never 0 and never a lie, for every algorithm: at
    /// `now + retry_after` the same request is admitted, one microsecond earlier it is not.
    #[test]
    fn retry_after_is_exact(
        g in gcra_quota(),
        w in window_quota(),
        now in 1u64..(1 << 52),
        r in any::<u64>(),
        cost in 1u32..=24,
        d in 0u64..3,
        entries in prop::collection::vec(any::<u64>(), 0..16),
    ) {
        let span = u64::from(g.burst()) * g.emission_interval();
        let delay = d * span / 2;
        let tat = Some(now + r % (span + delay + 1));
        let (v, _) = algorithm::gcra_delayed(&g, tat, now, cost, delay);
        if let Some(ra) = denied(&v) {
            prop_assert!(ra > 0);
            prop_assert!(algorithm::gcra_delayed(&g, tat, now + ra, cost, delay).0.is_allowed());
            prop_assert!(!algorithm::gcra_delayed(&g, tat, now + ra - 1, cost, delay).0.is_allowed());
        }
        let period = w.period_micros();
        let state = Some(WindowState::new((now / period + 1) * period, r % 14));
        if let Some(ra) = denied(&algorithm::fixed_window(&w, state, now, cost).0) {
            prop_assert!(ra > 0);
            prop_assert!(algorithm::fixed_window(&w, state, now + ra, cost).0.is_allowed());
            prop_assert!(!algorithm::fixed_window(&w, state, now + ra - 1, cost).0.is_allowed());
        }
        let mut log: Vec<u64> = entries.iter().map(|e| now - e % period.min(now)).collect();
        log.sort_unstable();
        if let Some(ra) = denied(&algorithm::sliding_log(&w, &log, now, cost).0) {
            prop_assert!(ra > 0);
            prop_assert!(algorithm::sliding_log(&w, &log, now + ra, cost).0.is_allowed());
            prop_assert!(!algorithm::sliding_log(&w, &log, now + ra - 1, cost).0.is_allowed());
        }
    }
}
