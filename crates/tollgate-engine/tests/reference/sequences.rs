//! Sequences of checks, settles and pauses: through the in-memory backend against the
//! reference (plans change the quota under the key), and a bound on GCRA that needs no
//! reference at all.

use std::time::Duration;

use proptest::prelude::*;
use tollgate_engine::algorithm;
use tollgate_engine::{
    Backend, Check, FakeClock, Limit, MemoryBackend, Quota, Receipt, Settlement,
};

use crate::model::{self, Gcra, Micros};

const START: Micros = 1_700_000_000_000_000;

/// Time that passes before a step: none (`kind` 0), under one interval `t` (1), up to two
/// bursts' spans (2), or far ahead, up to a thousand spans (3).
pub(crate) fn gap(kind: u64, r: u64, t: Micros, span: Micros) -> Micros {
    match kind {
        0 => 0,
        1 => r % (t + 1),
        2 => r % (2 * span + 1),
        _ => span + r % (1_000 * span),
    }
}

/// A GCRA quota a limit accepts (its interval rounds by at most 1%): a limit of 1 to 20, an
/// interval of 100 µs to 5 s, a burst of 1 to 24.
fn limit_quota() -> impl Strategy<Value = Quota> {
    (1u32..=20, 100u64..=5_000_000, 0u64..20, 1u32..=24).prop_map(
        |(limit, interval, extra, burst)| {
            let period = u64::from(limit) * interval + extra % u64::from(limit);
            Quota::new(limit, Duration::from_micros(period))
                .unwrap()
                .with_burst(burst)
                .unwrap()
        },
    )
}

#[derive(Debug, Clone)]
enum Op {
    /// A check of `cost` under plan `plan`, with a delay of `delay` half-spans of its quota.
    Check { plan: usize, cost: u32, delay: u64 },
    /// The settle of an earlier admitted check (`which`, modulo their number) at `actual`.
    Settle { which: usize, actual: u32 },
    /// A pause of up to three spans.
    Pause { plan: usize, r: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..3, 1u32..=26, prop_oneof![3 => Just(0u64), 1 => 1u64..4])
            .prop_map(|(plan, cost, delay)| Op::Check { plan, cost, delay }),
        2 => (any::<usize>(), 0u32..=40).prop_map(|(which, actual)| Op::Settle { which, actual }),
        1 => (0usize..3, any::<u64>()).prop_map(|(plan, r)| Op::Pause { plan, r }),
    ]
}

/// The reference's state of the key: its TAT and the interval it was written under.
#[derive(Debug, Clone, Copy, Default)]
struct Key {
    tat: Micros,
    interval: Micros,
}

impl Key {
    /// The TAT under `m`'s interval (the documented carry), as a check or settle reads it.
    fn read(&self, m: &Gcra, now: Micros) -> Micros {
        if self.interval == 0 {
            return self.tat;
        }
        model::carry(self.tat, now, self.interval, m.t)
    }
}

proptest! {
    #![proptest_config(crate::config())]

    /// The in-memory backend through its public API, one key under three plans: checks with
    /// and without a delay, settles under the quota of their check, pauses. A refusal writes
    /// nothing (the key refills at the rate it was written under until its next admission); a
    /// pause writes only when it moves the TAT. Refunds are settled only where the documented
    /// refund rule (`algorithm::gcra_refund`) is the plain one: of the last admission, while
    /// the key's TAT is still the one it left, with all its units still ahead of now, and
    /// nobody waiting (no admitted request's time lies ahead, the TAT at most a burst ahead).
    /// Elsewhere the rule may drop a refund or give back less, never more: the test in
    /// `no_span_of_time_starts_more_than_the_burst_and_the_rate` and the layer's delay tests
    /// hold those cases.
    #[test]
    fn the_memory_backend_follows_the_reference_across_plans_settles_and_pauses(
        quotas in prop::collection::vec(limit_quota(), 3),
        steps in prop::collection::vec(((0u64..4, any::<u64>()), op()), 1..40),
    ) {
        let limit = Limit::gcra("reference", quotas[0]).unwrap()
            .plan("second", quotas[1]).unwrap()
            .plan("third", quotas[2]).unwrap();
        let clock = FakeClock::new(START);
        let backend = MemoryBackend::builder().clock(clock.clone()).build();
        let models: Vec<Gcra> = quotas.iter().map(Gcra::of).collect();
        let mut key = Key::default();
        let mut admitted: Vec<(usize, u32, Receipt)> = Vec::new();
        // The last admission's index and the key it left.
        let mut last: Option<(usize, Key)> = None;
        let (mut now, mut served_until) = (START, START);
        for (i, &((kind, r), ref op)) in steps.iter().enumerate() {
            let m0 = &models[0];
            now += gap(kind, r, m0.t, u64::from(m0.burst) * m0.t);
            clock.set(now);
            match *op {
                Op::Check { plan, cost, delay } => {
                    let (q, m) = (&quotas[plan], &models[plan]);
                    let delay = delay * u64::from(m.burst) * m.t / 2;
                    let want = m.check(key.read(m, now), now, cost, delay);
                    let check = Check::new(&limit, b"k").with_quota(*q).with_cost(cost).with_delay(delay);
                    let verdicts = backend.check_now(&[check]).unwrap();
                    prop_assert_eq!(verdicts[0], want.verdict, "step {}: {:?}", i, op);
                    prop_assert_eq!(algorithm::gcra_wait(q, &verdicts[0]), want.wait, "step {}", i);
                    if let Some(tat) = want.tat {
                        key = Key { tat, interval: m.t };
                        admitted.push((plan, cost, verdicts.receipt(0)));
                        last = Some((admitted.len() - 1, key));
                        served_until = served_until.max(now + want.wait);
                    }
                }
                Op::Settle { which, actual } => {
                    if admitted.is_empty() {
                        continue;
                    }
                    let index = which % admitted.len();
                    let (plan, reserved, receipt) = admitted[index];
                    let (q, m) = (&quotas[plan], &models[plan]);
                    let tat = key.read(m, now);
                    let waiting = now < served_until || tat > now + u64::from(m.burst) * m.t;
                    let plain = last.is_some_and(|(i, left)| {
                        i == index
                            && left.tat == key.tat
                            && left.interval == key.interval
                            && key.tat >= now + u64::from(reserved.saturating_sub(actual)) * m.t
                    });
                    if actual == reserved || (actual < reserved && (waiting || !plain)) {
                        continue;
                    }
                    backend.settle_now(&[Settlement::new(&limit, b"k", reserved, actual, receipt, *q)]);
                    key = Key { tat: m.settle(tat, now, reserved, actual), interval: m.t };
                }
                Op::Pause { plan, r } => {
                    let (q, m) = (&quotas[plan], &models[plan]);
                    let micros = r % (3 * u64::from(m.burst) * m.t + 1);
                    backend.pause(&Check::new(&limit, b"k").with_quota(*q), micros);
                    let tat = key.read(m, now);
                    let paused = m.pause(tat, now, micros);
                    if paused > tat {
                        key = Key { tat: paused, interval: m.t };
                    }
                }
            }
        }
    }

    /// Over any sequence of one GCRA quota, with delays, refunds and charges: in any span of
    /// time `t`, at most `burst + ⌊t / T⌋` units start (a delayed request starts when its
    /// wait ends), plus the units refunded in that span. No reference needed. The rate is
    /// `1 / T`, the emission interval rounded down to whole microseconds: up to 1% above
    /// `limit / period` (a limit whose rounding costs more is refused,
    /// `ConfigError::ImpreciseRate`), so `burst + ⌊t × limit / period⌋` is not a bound.
    #[test]
    fn no_span_of_time_starts_more_than_the_burst_and_the_rate(
        q in limit_quota(),
        steps in prop::collection::vec(((0u64..4, any::<u64>()), 1u32..=26, 0u64..4, 0u32..=40), 1..60),
    ) {
        let t = q.emission_interval();
        let span = u64::from(q.burst()) * t;
        let (mut now, mut tat, mut served_until) = (START, None, START);
        let mut starts: Vec<(Micros, u64)> = Vec::new();
        let mut refunds: Vec<(Micros, u64)> = Vec::new();
        for &((kind, r), cost, delay, actual) in &steps {
            now += gap(kind, r, t, span);
            let (v, next) = algorithm::gcra_delayed(&q, tat, now, cost, delay * span / 2);
            if next.is_none() {
                continue;
            }
            tat = next;
            let start = now + algorithm::gcra_wait(&q, &v);
            starts.push((start, u64::from(cost)));
            served_until = served_until.max(start);
            // The request settles at once, at `actual` (a refund only while nobody waits).
            let waiting = now < served_until || tat.is_some_and(|t| t > now + span);
            if actual < cost && waiting {
                continue;
            }
            if let Some(settled) = algorithm::gcra_settle(&q, tat, now, cost, actual) {
                tat = Some(settled);
            }
            if actual < cost {
                refunds.push((now, u64::from(cost - actual)));
            }
        }
        for &(from, _) in &starts {
            for &(to, _) in starts.iter().filter(|&&(s, _)| s >= from) {
                let within = |&&(s, _): &&(Micros, u64)| s >= from && s <= to;
                let started: u64 = starts.iter().filter(within).map(|&(_, n)| n).sum();
                let refunded: u64 = refunds.iter().filter(within).map(|&(_, n)| n).sum();
                let bound = u64::from(q.burst()) + (to - from) / t + refunded;
                prop_assert!(
                    started <= bound,
                    "{} units started in [{}, {}], bound {}", started, from, to, bound
                );
            }
        }
    }
}

/// A check (`Some(cost)`) or the settle of an earlier admitted check (`None`), at `actual`.
type Step = ((u64, u64), Option<u32>, usize, u32);

fn window_steps() -> impl Strategy<Value = Vec<Step>> {
    let what = prop_oneof![2 => (1u32..=14).prop_map(Some), 1 => Just(None)];
    // Refunds of nearly all, and charges of up to several times the limit.
    let actual = prop_oneof![0u32..=1, 0u32..=30, 20u32..=60];
    prop::collection::vec(
        ((0u64..4, any::<u64>()), what, any::<usize>(), actual),
        1..40,
    )
}

/// Fixed windows and sliding logs through the in-memory backend, checks and settles, against
/// the reference of each. Each admitted check is settled at most once; a sliding log's only
/// while its units count, unless `settle_expired`.
fn windows_with_settles(
    q: Quota,
    sliding: bool,
    steps: &[Step],
    settle_expired: bool,
) -> Result<(), String> {
    let limit = if sliding {
        Limit::sliding_log("reference", q)
    } else {
        Limit::fixed_window("reference", q)
    }
    .unwrap();
    let clock = FakeClock::new(START);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let period = q.period_micros();
    let (mut windows, mut log) = (model::Windows::default(), model::Log::default());
    let mut admitted: Vec<(u32, Receipt)> = Vec::new();
    let mut now = START;
    for (i, &((kind, r), what, which, actual)) in steps.iter().enumerate() {
        now += gap(kind, r, 1, period);
        clock.set(now);
        let Some(cost) = what else {
            if admitted.is_empty() {
                continue;
            }
            let (reserved, receipt) = admitted.remove(which % admitted.len());
            // A log's units that have left the period (see the property below).
            if sliding && !settle_expired && receipt.at + period <= now {
                continue;
            }
            backend.settle_now(&[Settlement::new(&limit, b"k", reserved, actual, receipt, q)]);
            if sliding {
                log.settle(q.limit(), period, now, receipt.at, reserved, actual);
            } else {
                windows.settle(
                    q.limit(),
                    period,
                    now,
                    receipt.window_end(),
                    reserved,
                    actual,
                );
            }
            continue;
        };
        let check = Check::new(&limit, b"k").with_cost(cost);
        let verdicts = backend.check_now(&[check]).map_err(|e| e.to_string())?;
        let want = if sliding {
            log.check(q.limit(), period, now, cost)
        } else {
            windows.check(q.limit(), period, now, cost)
        };
        if verdicts[0] != want {
            return Err(format!(
                "step {i}: got {:?}, the reference {want:?}",
                verdicts[0]
            ));
        }
        if want.is_allowed() {
            admitted.push((cost, verdicts.receipt(0)));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::config())]

    /// A fixed window's settle changes its own window only, while it lasts: a refund takes
    /// units back (never below 0), a charge adds them (at most twice the limit at a time).
    #[test]
    fn fixed_window_settles_follow_the_reference(q in crate::window_quota(), steps in window_steps()) {
        prop_assert_eq!(windows_with_settles(q, false, &steps, true), Ok(()));
    }

    /// A sliding log's settle removes refunded units among those its check recorded, or
    /// records a charge's units at the time of the settle (the log holding at most twice the
    /// limit).
    #[test]
    fn sliding_log_settles_follow_the_reference(q in crate::window_quota(), steps in window_steps()) {
        prop_assert_eq!(windows_with_settles(q, true, &steps, false), Ok(()));
    }

    /// The same, a check settled after its units have left the period too: its refund has
    /// none of its units left to remove, and removes nothing (see
    /// `a_refund_after_the_units_left_removes_nobody_elses` for figures).
    #[test]
    fn sliding_log_settles_after_the_period_follow_the_reference(
        q in crate::window_quota(),
        steps in window_steps(),
    ) {
        prop_assert_eq!(windows_with_settles(q, true, &steps, true), Ok(()));
    }
}

/// The example of `sliding_logs_count_the_units_of_each_plans_period`, through the in-memory
/// backend: plans of 10 per 60 s and 10 per 1 s; 5 units under the first, 2 s later 1 under
/// the second, then 1 under the first: 7 units of the last 60 s, 3 left.
#[test]
fn a_short_plans_admission_leaves_a_long_plans_units_counted() {
    let long = Quota::new(10, Duration::from_secs(60)).unwrap();
    let short = Quota::new(10, Duration::from_secs(1)).unwrap();
    let limit = Limit::sliding_log("log", long)
        .unwrap()
        .plan("short", short)
        .unwrap();
    let clock = FakeClock::new(START);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let check = |quota: Quota, cost: u32| {
        let check = Check::new(&limit, b"k").with_quota(quota).with_cost(cost);
        backend.check_now(&[check]).unwrap()[0]
    };
    assert_eq!(check(long, 5).remaining, 5);
    clock.set(START + 2_000_000);
    assert_eq!(check(short, 1).remaining, 9);
    // Not 8: the short plan's admission keeps the 5 units of 2 s ago, which the long counts.
    assert_eq!(check(long, 1).remaining, 3);
}

/// 2 per 10 s. A unit at `t`; at `t + 10 s` (the first has left) another; then the first
/// check is refunded. None of its units is left to give back, so the log still holds the
/// second unit: a request of 2 is refused until `t + 20 s` (not admitted, as it would be if
/// the refund removed the second check's unit).
#[test]
fn a_refund_after_the_units_left_removes_nobody_elses() {
    let q = Quota::new(2, Duration::from_secs(10)).unwrap();
    let limit = Limit::sliding_log("log", q).unwrap();
    let clock = FakeClock::new(START);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let check = |cost: u32| {
        backend
            .check_now(&[Check::new(&limit, b"k").with_cost(cost)])
            .unwrap()
    };
    let first = check(1);
    assert!(first[0].is_allowed());
    clock.set(START + 10_000_000);
    assert!(check(1)[0].is_allowed());
    backend.settle_now(&[Settlement::new(&limit, b"k", 1, 0, first.receipt(0), q)]);
    let v = check(2)[0];
    assert_eq!(
        v.status,
        tollgate_engine::Status::Denied {
            retry_after: 10_000_000
        }
    );
}

/// What the bound above allows and `burst + ⌊t × limit / period⌋` would not: 3 per second has
/// an interval of 333,333 µs, and 6 units start within 999,999 µs (3 at once, then one an
/// interval apart), where `3 + ⌊0.999999 × 3⌋` is 5.
#[test]
fn the_rounded_interval_lets_six_units_of_3_per_second_start_within_999_999_us() {
    let q = Quota::per_second(3).unwrap();
    assert_eq!(q.emission_interval(), 333_333);
    let mut tat = None;
    let mut started = 0;
    for now in [
        START,
        START,
        START,
        START + 333_333,
        START + 666_666,
        START + 999_999,
    ] {
        let (v, next) = algorithm::gcra(&q, tat, now, 1);
        assert!(v.is_allowed(), "at {now}");
        (tat, started) = (next, started + 1);
    }
    assert_eq!(started, 6);
    assert!(!algorithm::gcra(&q, tat, START + 999_999, 1).0.is_allowed());
}
