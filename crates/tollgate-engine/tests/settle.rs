//! Settling admitted checks in memory: refunds, charges and debts, with exact figures.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tollgate_engine::{Check, FakeClock, Limit, MemoryBackend, Quota, Settlement, Status, Verdict};

const T0: u64 = 1_700_000_000_000_000;

fn backend() -> (MemoryBackend<FakeClock>, FakeClock) {
    let clock = FakeClock::new(T0);
    (MemoryBackend::builder().clock(clock.clone()).build(), clock)
}

/// Reserves `reserved` units of `limit` for `key`, then settles them at `actual`; answers the
/// reservation's verdict.
fn reserve_then_settle(
    backend: &MemoryBackend<FakeClock>,
    limit: &Limit,
    key: &[u8],
    reserved: u32,
    actual: u32,
) -> Verdict {
    let verdicts = backend
        .check_now(&[Check::new(limit, key).with_cost(reserved)])
        .unwrap();
    assert!(verdicts[0].is_allowed());
    backend.settle_now(&[Settlement::new(
        limit,
        key,
        reserved,
        actual,
        verdicts.receipt(0),
        *limit.quota(),
    )]);
    verdicts[0]
}

fn one(backend: &MemoryBackend<FakeClock>, limit: &Limit, key: &[u8], cost: u32) -> Verdict {
    backend
        .check_now(&[Check::new(limit, key).with_cost(cost)])
        .unwrap()[0]
}

#[test]
fn reserve_100_charge_250_consumes_250_for_every_algorithm() {
    for limit in [
        Limit::gcra("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
        Limit::fixed_window("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
        Limit::sliding_log("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
    ] {
        let (backend, _) = backend();
        let v = reserve_then_settle(&backend, &limit, b"shop", 100, 250);
        assert_eq!(v.remaining, 900, "{:?}", limit.algorithm());
        // 250 consumed: 750 left, so a check of 1 leaves 749.
        assert_eq!(
            one(&backend, &limit, b"shop", 1).remaining,
            749,
            "{:?}",
            limit.algorithm()
        );
    }
}

#[test]
fn reserve_315_settle_300_refunds_15_for_every_algorithm() {
    for limit in [
        Limit::gcra("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
        Limit::fixed_window("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
        Limit::sliding_log("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
    ] {
        let (backend, _) = backend();
        for _ in 0..3 {
            reserve_then_settle(&backend, &limit, b"shop", 315, 300);
        }
        // 900 consumed: 100 left, and 315 more do not fit.
        let v = one(&backend, &limit, b"shop", 315);
        assert!(
            matches!(v.status, Status::Denied { .. }),
            "{:?}",
            limit.algorithm()
        );
        assert_eq!(v.remaining, 100, "{:?}", limit.algorithm());
        assert_eq!(one(&backend, &limit, b"shop", 100).remaining, 0);
    }
}

#[test]
fn a_refund_of_everything_gives_the_whole_reservation_back() {
    let limit = Limit::gcra("login", Quota::per_minute(5).unwrap()).unwrap();
    let (backend, _) = backend();
    for _ in 0..10 {
        reserve_then_settle(&backend, &limit, b"alice", 1, 0);
    }
    assert_eq!(one(&backend, &limit, b"alice", 1).remaining, 4);
    assert_eq!(backend.stats().tracked_keys, 1);
}

#[test]
fn a_gcra_debt_is_at_most_one_burst_and_the_next_request_waits_for_it() {
    // 10 a minute: one unit every 6 s, a burst of 10 (60 s to refill).
    let limit = Limit::gcra("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    reserve_then_settle(&backend, &limit, b"shop", 10, 30);
    // 30 units would put the TAT 180 s ahead; the debt stops at twice the refill, 120 s.
    let v = one(&backend, &limit, b"shop", 1);
    assert_eq!(
        v.status,
        Status::Denied {
            retry_after: 66_000_000
        }
    );
    clock.advance(Duration::from_secs(66));
    let v = one(&backend, &limit, b"shop", 1);
    assert_eq!((v.status, v.remaining), (Status::Allowed, 0));
}

#[test]
fn a_gcra_refund_never_fills_the_bucket_past_full() {
    let limit = Limit::gcra("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    let v = backend
        .check_now(&[Check::new(&limit, b"shop").with_cost(4)])
        .unwrap();
    // A minute later the bucket is full again; the refund of 4 gives nothing more.
    clock.advance(Duration::from_secs(60));
    backend.settle_now(&[Settlement::new(
        &limit,
        b"shop",
        4,
        0,
        v.receipt(0),
        *limit.quota(),
    )]);
    assert_eq!(one(&backend, &limit, b"shop", 1).remaining, 9);
}

#[test]
fn a_fixed_window_settles_only_in_the_window_of_its_check() {
    let limit = Limit::fixed_window("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    clock.set(T0 - T0 % 60_000_000 + 30_000_000);
    let v = backend
        .check_now(&[Check::new(&limit, b"shop").with_cost(8)])
        .unwrap();
    clock.advance(Duration::from_secs(30));
    // The next window: the refund of 8 and the charge of 5 are both void.
    for actual in [0, 13] {
        backend.settle_now(&[Settlement::new(
            &limit,
            b"shop",
            8,
            actual,
            v.receipt(0),
            *limit.quota(),
        )]);
    }
    assert_eq!(one(&backend, &limit, b"shop", 1).remaining, 9);
}

#[test]
fn a_fixed_window_debt_refuses_until_the_window_ends() {
    let limit = Limit::fixed_window("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    clock.set(T0 - T0 % 60_000_000 + 30_000_000);
    reserve_then_settle(&backend, &limit, b"shop", 2, 15);
    let v = one(&backend, &limit, b"shop", 1);
    assert_eq!(
        (v.status, v.remaining),
        (
            Status::Denied {
                retry_after: 30_000_000
            },
            0
        )
    );
    clock.advance(Duration::from_secs(30));
    assert_eq!(one(&backend, &limit, b"shop", 1).remaining, 9);
}

#[test]
fn a_sliding_log_refund_removes_the_checks_own_units() {
    let limit = Limit::sliding_log("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    // 3 units at T0, then 5 reserved at T0 + 20 s and settled at 2.
    one(&backend, &limit, b"shop", 3);
    clock.advance(Duration::from_secs(20));
    reserve_then_settle(&backend, &limit, b"shop", 5, 2);
    assert_eq!(one(&backend, &limit, b"shop", 5).remaining, 0);
    // At T0 + 60 s the first 3 leave: the 2 kept at T0 + 20 s and the 5 stay.
    clock.set(T0 + 60_000_000);
    let v = one(&backend, &limit, b"shop", 4);
    assert_eq!(
        v.status,
        Status::Denied {
            retry_after: 20_000_000
        }
    );
    assert_eq!(v.remaining, 3);
}

#[test]
fn a_sliding_log_debt_is_at_most_twice_the_limit() {
    let limit = Limit::sliding_log("tokens", Quota::per_minute(10).unwrap()).unwrap();
    let (backend, clock) = backend();
    reserve_then_settle(&backend, &limit, b"shop", 1, u32::MAX);
    let v = one(&backend, &limit, b"shop", 1);
    assert_eq!(
        (v.status, v.remaining),
        (
            Status::Denied {
                retry_after: 60_000_000
            },
            0
        )
    );
    clock.advance(Duration::from_secs(60));
    assert_eq!(one(&backend, &limit, b"shop", 1).remaining, 9);
}

#[test]
fn huge_charges_and_refunds_never_overflow() {
    for limit in [
        Limit::gcra(
            "tokens",
            Quota::new(1, Duration::from_secs(100 * 365 * 86_400)).unwrap(),
        )
        .unwrap(),
        Limit::fixed_window("tokens", Quota::per_day(u32::MAX).unwrap()).unwrap(),
    ] {
        let (backend, _) = backend();
        reserve_then_settle(&backend, &limit, b"shop", 1, u32::MAX);
        reserve_then_settle(&backend, &limit, b"other", 1, u32::MAX);
        backend.settle_now(&[Settlement::new(
            &limit,
            b"shop",
            u32::MAX,
            0,
            Default::default(),
            *limit.quota(),
        )]);
    }
}
