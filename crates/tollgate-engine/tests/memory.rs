//! The in-memory backend's bounds and exactness, at scale.

#![allow(clippy::unwrap_used)]

use std::sync::Barrier;
use std::time::Duration;

use tollgate_engine::{Check, FakeClock, Limit, MemoryBackend, Quota, Status};

#[test]
fn a_spray_of_a_million_unique_keys_stays_under_the_cap() {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder()
        .max_keys(10_000)
        .clock(clock.clone())
        .build();
    let limit = Limit::gcra("login", Quota::per_hour(5).unwrap()).unwrap();
    // A key tracked before the spray: 2 of 5 used.
    for _ in 0..2 {
        backend.check_now(&[Check::new(&limit, b"victim")]).unwrap();
    }
    let mut refused = 0u32;
    for i in 0u32..1_000_000 {
        let key = i.to_le_bytes();
        let v = backend.check_now(&[Check::new(&limit, &key)]).unwrap()[0];
        refused += u32::from(matches!(v.status, Status::AtCapacity { .. }));
        if i % 100_000 == 0 {
            assert!(backend.stats().tracked_keys <= 10_000);
        }
        // Time moves, but less than the quota's period: nothing expires.
        if i % 1_000 == 0 {
            clock.advance(Duration::from_millis(1));
        }
    }
    assert_eq!(backend.stats().tracked_keys, 10_000);
    assert_eq!(refused, 1_000_000 - 9_999);
    // The victim kept its count: 3 more, then refused.
    for left in [2, 1, 0] {
        let v = backend.check_now(&[Check::new(&limit, b"victim")]).unwrap()[0];
        assert_eq!((v.status, v.remaining), (Status::Allowed, left));
    }
    assert!(!backend.check_now(&[Check::new(&limit, b"victim")]).unwrap()[0].is_allowed());
}

#[test]
fn expired_keys_are_reclaimed_without_a_thread() {
    let clock = FakeClock::new(0);
    let backend = MemoryBackend::builder()
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    let limit = Limit::fixed_window("minute", Quota::per_minute(1).unwrap()).unwrap();
    for i in 0u32..1_000 {
        backend
            .check_now(&[Check::new(&limit, &i.to_le_bytes())])
            .unwrap();
    }
    assert_eq!(backend.stats().tracked_keys, 1_000);
    clock.advance(Duration::from_secs(60));
    // The next request finds the backend full of expired windows and sweeps them.
    let v = backend.check_now(&[Check::new(&limit, b"new")]).unwrap()[0];
    assert!(v.is_allowed());
    assert_eq!(backend.stats().tracked_keys, 1);
}

/// Runs `body(i)` on 64 threads, `i` in `0..64`, released together; their answers.
fn on_64_threads<T: Send>(body: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let barrier = Barrier::new(64);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..64)
            .map(|i| {
                let (barrier, body) = (&barrier, &body);
                s.spawn(move || {
                    barrier.wait();
                    body(i)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[test]
fn sixty_four_threads_against_a_limit_of_ten_admit_exactly_ten() {
    for round in 0..100 {
        let backend = MemoryBackend::new();
        let burst = Limit::gcra("burst", Quota::per_hour(10).unwrap()).unwrap();
        let daily = Limit::fixed_window("daily", Quota::per_day(1_000).unwrap()).unwrap();
        let admitted: usize = on_64_threads(|_| {
            let checks = [Check::new(&burst, b"k"), Check::new(&daily, b"shop")];
            usize::from(backend.check_now(&checks).unwrap().admits(&checks))
        })
        .into_iter()
        .sum();
        assert_eq!(admitted, 10, "round {round}");
        let checks = [Check::new(&daily, b"shop")];
        assert_eq!(backend.check_now(&checks).unwrap()[0].remaining, 1_000 - 11);
    }
}

#[test]
fn lone_checks_of_a_tracked_key_racing_batches_admit_exactly_the_quota() {
    // A lone GCRA check of a tracked key updates it under the shard's read lock with a
    // compare-and-swap; a batch holds the write lock. Half the threads send each.
    for round in 0..100 {
        let clock = FakeClock::new(1_700_000_000_000_000);
        let backend = MemoryBackend::builder().clock(clock).build();
        let burst = Limit::gcra("burst", Quota::per_hour(10).unwrap()).unwrap();
        let daily = Limit::fixed_window("daily", Quota::per_day(1_000).unwrap()).unwrap();
        // Tracks the key (a new key takes the write lock): 9 of 10 left.
        assert!(backend.check_now(&[Check::new(&burst, b"k")]).unwrap()[0].is_allowed());
        let (lone, batched) = on_64_threads(|i| {
            let (mut lone, mut batched) = (0, 0);
            for _ in 0..4 {
                if i % 2 == 0 {
                    let v = backend.check_now(&[Check::new(&burst, b"k")]).unwrap();
                    lone += usize::from(v[0].is_allowed());
                } else {
                    let checks = [Check::new(&burst, b"k"), Check::new(&daily, b"shop")];
                    let v = backend.check_now(&checks).unwrap();
                    batched += usize::from(v.admits(&checks));
                }
            }
            (lone, batched)
        })
        .into_iter()
        .fold((0, 0), |(a, b), (l, m)| (a + l, b + m));
        assert_eq!(lone + batched, 9, "round {round}");
        // Each admitted batch took exactly one of the daily quota, and no refused one did.
        let v = backend.check_now(&[Check::new(&daily, b"shop")]).unwrap()[0];
        assert_eq!(v.remaining, 1_000 - batched as u64 - 1, "round {round}");
        // The burst is used up for lone checks too.
        let v = backend.check_now(&[Check::new(&burst, b"k")]).unwrap()[0];
        assert!(!v.is_allowed(), "round {round}");
    }
}

// A check reads the clock before it takes its shard's lock, so under load a check whose `now`
// is a little older than the state it finds can commit after it. Setting the fake clock back
// replays that order deterministically.

#[test]
fn a_check_with_an_older_now_does_not_reset_a_later_fixed_window() {
    let boundary = 28_333_334 * 60 * 1_000_000; // a minute boundary, in microseconds
    let clock = FakeClock::new(boundary);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limit = Limit::fixed_window("per-minute", Quota::per_minute(2).unwrap()).unwrap();
    let check = |now| {
        clock.set(now);
        backend.check_now(&[Check::new(&limit, b"k")]).unwrap()[0].is_allowed()
    };
    let in_window = [boundary, boundary, boundary];
    let mut admitted: usize = in_window.iter().map(|&t| usize::from(check(t))).sum();
    // Read 1 µs before the boundary, committed after the new window's two admissions: it is
    // counted in the new window (refused, which is full), and the window keeps its count.
    assert!(!check(boundary - 1));
    for _ in 0..3 {
        admitted += usize::from(check(boundary + 1_000_000));
    }
    assert_eq!(
        admitted, 2,
        "the window starting at the boundary admits exactly 2"
    );
}

#[test]
fn a_check_with_an_older_now_keeps_a_sliding_log_exact() {
    let t = 1_000_000_000;
    let period = 10_000_000;
    let clock = FakeClock::new(t);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let quota = Quota::new(2, Duration::from_micros(period)).unwrap();
    let limit = Limit::sliding_log("log", quota).unwrap();
    let mut admitted_at = Vec::new();
    for now in [t, t - 1, t - 1 + period, t - 1 + period, t + period] {
        clock.set(now);
        if backend.check_now(&[Check::new(&limit, b"k")]).unwrap()[0].is_allowed() {
            admitted_at.push(now);
        }
    }
    // The late check is recorded at t, not t - 1: the log admits again only at t + period,
    // and never more than 2 in any period.
    assert_eq!(admitted_at, [t, t - 1, t + period]);
}

/// A late check's units are recorded at the newest entry's time, and its receipt says so: its
/// refund finds them there.
#[test]
fn a_late_checks_refund_finds_its_units() {
    let t = 1_000_000_000;
    let clock = FakeClock::new(t);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let quota = Quota::new(2, Duration::from_secs(10)).unwrap();
    let limit = Limit::sliding_log("log", quota).unwrap();
    let check = Check::new(&limit, b"k");
    assert!(backend.check_now(&[check]).unwrap()[0].is_allowed());
    clock.set(t - 1);
    let late = backend.check_now(&[check]).unwrap();
    assert_eq!(late.receipt(0).at, t);
    backend.settle_now(&[tollgate_engine::Settlement::of(&check, late.receipt(0), 0)]);
    clock.set(t);
    let v = backend.check_now(&[check]).unwrap()[0];
    assert_eq!(
        (v.status, v.remaining),
        (tollgate_engine::Status::Allowed, 0)
    );
}

#[test]
fn a_sliding_log_refused_by_another_limit_reports_its_untouched_reset() {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock).build();
    let log = Limit::sliding_log("log", Quota::per_minute(5).unwrap()).unwrap();
    let shut = Limit::gcra("shut", Quota::per_minute(1).unwrap()).unwrap();
    assert!(backend.check_now(&[Check::new(&shut, b"x")]).unwrap()[0].is_allowed());
    let v = backend
        .check_now(&[Check::new(&log, b"k"), Check::new(&shut, b"x")])
        .unwrap();
    assert!(matches!(v[1].status, Status::Denied { .. }));
    // Nothing was consumed: the empty log's quota is whole now.
    assert_eq!(
        (v[0].status, v[0].remaining, v[0].reset),
        (Status::Allowed, 5, 0)
    );
}

#[test]
fn the_longest_periods_admit_once_and_survive_sweeps() {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let quota = Quota::new(1, tollgate_engine::MAX_PERIOD).unwrap();
    let limits = [
        Limit::gcra("once", quota).unwrap(),
        Limit::fixed_window("once-window", quota).unwrap(),
        Limit::sliding_log("once-log", quota).unwrap(),
    ];
    for limit in &limits {
        let mut admitted = 0;
        for _ in 0..5 {
            let v = backend.check_now(&[Check::new(limit, b"k")]).unwrap()[0];
            admitted += usize::from(v.is_allowed());
            clock.advance(Duration::from_secs(2)); // past the sweep interval
        }
        assert_eq!(admitted, 1, "{}", limit.name());
    }
}
