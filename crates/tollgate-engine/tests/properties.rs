//! Property tests: each algorithm of the in-memory backend against a simple model of what it
//! must admit, over random sequences of costs and times.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use tollgate_engine::{Check, FakeClock, Limit, MemoryBackend, Quota, Status};

const START: u64 = 1_700_000_000_000_000;

/// A step of a sequence: time passes by `gap` microseconds, then a request of `cost`. Half
/// the gaps are whole quarters of a second, so that times land exactly on the edges of
/// windows and periods (whole seconds), where off-by-one errors live.
fn steps() -> impl Strategy<Value = Vec<(u64, u32)>> {
    let gap = prop_oneof![(0u64..12).prop_map(|n| n * 250_000), 0u64..3_000_000];
    prop::collection::vec((gap, 1u32..6), 1..60)
}

fn quota() -> impl Strategy<Value = (u32, u64)> {
    // (limit, period in seconds)
    (1u32..8, 1u64..10)
}

/// What the in-memory backend answers for `limit`, request after request.
fn run(limit: &Limit, steps: &[(u64, u32)]) -> Vec<(bool, Option<u64>, bool)> {
    let clock = FakeClock::new(START);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    steps
        .iter()
        .map(|&(gap, cost)| {
            clock.advance(Duration::from_micros(gap));
            let check = Check::new(limit, b"key").with_cost(cost);
            let v = backend.check_now(&[check]).unwrap()[0];
            let remaining = v.is_allowed().then_some(v.remaining);
            (v.is_allowed(), remaining, v.status == Status::CostTooHigh)
        })
        .collect()
}

/// A token bucket of `burst × interval` microseconds of credit that fills by one a microsecond:
/// what GCRA must admit, written the other way round.
fn bucket_model(limit: u32, period: u64, steps: &[(u64, u32)]) -> Vec<(bool, Option<u64>, bool)> {
    let interval = period / u64::from(limit);
    let capacity = interval * u64::from(limit);
    let mut credit = capacity;
    steps
        .iter()
        .map(|&(gap, cost)| {
            credit = (credit + gap).min(capacity);
            if cost > limit {
                return (false, None, true);
            }
            let need = interval * u64::from(cost);
            if need <= credit {
                credit -= need;
                (true, Some(credit / interval), false)
            } else {
                (false, None, false)
            }
        })
        .collect()
}

/// A count per window of the epoch.
fn window_model(limit: u32, period: u64, steps: &[(u64, u32)]) -> Vec<(bool, Option<u64>, bool)> {
    let mut now = START;
    let mut counts: HashMap<u64, u64> = HashMap::new();
    steps
        .iter()
        .map(|&(gap, cost)| {
            now += gap;
            if cost > limit {
                return (false, None, true);
            }
            let count = counts.entry(now / period).or_insert(0);
            if *count + u64::from(cost) <= u64::from(limit) {
                *count += u64::from(cost);
                (true, Some(u64::from(limit) - *count), false)
            } else {
                (false, None, false)
            }
        })
        .collect()
}

/// Every admitted unit's time; those younger than a period count.
fn log_model(limit: u32, period: u64, steps: &[(u64, u32)]) -> Vec<(bool, Option<u64>, bool)> {
    let mut now = START;
    let mut admitted: Vec<u64> = Vec::new();
    steps
        .iter()
        .map(|&(gap, cost)| {
            now += gap;
            if cost > limit {
                return (false, None, true);
            }
            let alive = admitted.iter().filter(|&&t| t + period > now).count() as u64;
            if alive + u64::from(cost) <= u64::from(limit) {
                admitted.extend(std::iter::repeat_n(now, cost as usize));
                (
                    true,
                    Some(u64::from(limit) - alive - u64::from(cost)),
                    false,
                )
            } else {
                (false, None, false)
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn gcra_admits_what_a_token_bucket_admits((limit, secs) in quota(), steps in steps()) {
        let period = secs * 1_000_000;
        let l = Limit::gcra("gcra", Quota::new(limit, Duration::from_secs(secs)).unwrap()).unwrap();
        prop_assert_eq!(run(&l, &steps), bucket_model(limit, period, &steps));
    }

    #[test]
    fn a_fixed_window_admits_what_a_count_per_window_admits(
        (limit, secs) in quota(),
        steps in steps(),
    ) {
        let period = secs * 1_000_000;
        let q = Quota::new(limit, Duration::from_secs(secs)).unwrap();
        let l = Limit::fixed_window("fixed", q).unwrap();
        prop_assert_eq!(run(&l, &steps), window_model(limit, period, &steps));
    }

    #[test]
    fn a_sliding_log_admits_what_a_list_of_admissions_admits(
        (limit, secs) in quota(),
        steps in steps(),
    ) {
        let period = secs * 1_000_000;
        let q = Quota::new(limit, Duration::from_secs(secs)).unwrap();
        let l = Limit::sliding_log("sliding", q).unwrap();
        prop_assert_eq!(run(&l, &steps), log_model(limit, period, &steps));
    }
}
