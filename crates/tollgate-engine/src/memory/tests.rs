//! The in-memory backend's own tests.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::{FakeClock, Limit, Quota, Status, MAX_LOG_UNITS};

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

/// Plans of 1 a day and 10,000 a second share a log kept for a day: three seconds of the
/// second's plan are 30,000 units, of which the log keeps the newest 20,000. The day's plan
/// still answers as if it had them all: refused, its wait the newest unit's day.
#[test]
fn a_log_shared_by_plans_keeps_at_most_twice_the_largest_quota() {
    let (b, clock) = backend(10);
    let day = Quota::per_day(1).unwrap();
    let burst = Quota::new(MAX_LOG_UNITS, Duration::from_secs(1)).unwrap();
    let l = Limit::sliding_log("log", day)
        .unwrap()
        .plan("burst", burst)
        .unwrap();
    for _ in 0..3 {
        let check = Check::new(&l, b"k")
            .with_quota(burst)
            .with_cost(MAX_LOG_UNITS);
        let v = b.check_now(&[check]).unwrap()[0];
        assert_eq!((v.status, v.remaining), (Status::Allowed, 0));
        clock.advance(Duration::from_secs(1));
    }
    let entries: usize = b
        .inner
        .shards
        .iter()
        .map(|s| {
            let shard = s.read().unwrap();
            shard.logs.values().map(|l| l.entries.len()).sum::<usize>()
        })
        .sum();
    assert_eq!(entries, 20_000);
    clock.advance(Duration::from_micros(1));
    let v = b
        .check_now(&[Check::new(&l, b"k").with_quota(day)])
        .unwrap()[0];
    let wait = 86_400_000_000 - 1_000_001;
    assert_eq!(
        (v.status, v.remaining, v.reset),
        (Status::Denied { retry_after: wait }, 0, wait)
    );
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
    assert_eq!(b.inner.key_cap.shard_cap, 8_192);
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
    // Every key has expired: the next ones take their room, and no call sweeps the whole
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
    assert_eq!(b.inner.key_cap.shard_cap, 8_192);
    let b = MemoryBackend::builder().max_keys(1 << 20).build();
    assert_eq!(b.inner.shards.len(), 256);
    let b = MemoryBackend::builder().max_keys(1 << 30).build();
    assert_eq!(b.inner.shards.len(), 1 << 16);
    assert_eq!(b.inner.key_cap.shard_cap, 32_768);
}

#[test]
fn a_full_shard_refuses_new_keys_as_the_cap_does() {
    let mut b1 = MemoryBackend::builder()
        .max_keys(100)
        .shards(1)
        .clock(FakeClock::new(1_000_000_000))
        .build();
    Arc::get_mut(&mut b1.inner).unwrap().key_cap.shard_cap = 2;
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
