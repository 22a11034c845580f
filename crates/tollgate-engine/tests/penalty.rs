//! The penalty box and denies on the in-memory backend, with exact figures.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tollgate_engine::{
    Admin, Check, ConfigError, FakeClock, KeyState, Lease, Limit, MemoryBackend, Micros, Penalty,
    Quota, Standing, Status,
};

const S: Micros = 1_000_000;

fn login() -> Limit {
    Limit::gcra("login", Quota::per_minute(5).unwrap())
        .unwrap()
        .penalty(
            Penalty::after(3)
                .within(Duration::from_secs(60))
                .block_for(Duration::from_secs(600)),
        )
        .unwrap()
}

fn memory(clock: &FakeClock) -> MemoryBackend<FakeClock> {
    MemoryBackend::builder().clock(clock.clone()).build()
}

fn status(backend: &MemoryBackend<FakeClock>, limit: &Limit, key: &[u8]) -> Status {
    backend.check_now(&[Check::new(limit, key)]).unwrap()[0].status
}

/// Runs a future that is ready at once (the memory backend's).
fn now<T>(f: impl Future<Output = T>) -> T {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(t) => t,
        Poll::Pending => panic!("a memory backend's answer is ready at once"),
    }
}

#[test]
fn a_block_starts_at_exactly_the_nth_refusal_and_holds_for_its_length() {
    let clock = FakeClock::new(1_000 * S);
    let backend = memory(&clock);
    let limit = login();
    for _ in 0..5 {
        assert_eq!(status(&backend, &limit, b"ip"), Status::Allowed);
    }
    for _ in 0..2 {
        assert!(matches!(
            status(&backend, &limit, b"ip"),
            Status::Denied { .. }
        ));
    }
    assert_eq!(
        status(&backend, &limit, b"ip"),
        Status::Blocked {
            retry_after: 600 * S
        }
    );
    // Another key is not blocked.
    assert_eq!(status(&backend, &limit, b"other"), Status::Allowed);
    // The quota would be whole after a minute; the block still stands.
    clock.advance(Duration::from_secs(120));
    assert_eq!(
        status(&backend, &limit, b"ip"),
        Status::Blocked {
            retry_after: 480 * S
        }
    );
    clock.advance(Duration::from_secs(480));
    assert_eq!(status(&backend, &limit, b"ip"), Status::Allowed);
}

#[test]
fn refusals_spread_wider_than_the_window_never_block() {
    let clock = FakeClock::new(1_000 * S);
    let backend = memory(&clock);
    let limit = Limit::gcra("slow", Quota::per_minute(1).unwrap())
        .unwrap()
        .penalty(Penalty::after(2).within(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(status(&backend, &limit, b"k"), Status::Allowed);
    let mut blocked = 0;
    for _ in 0..5 {
        blocked += u32::from(matches!(
            status(&backend, &limit, b"k"),
            Status::Blocked { .. }
        ));
        clock.advance(Duration::from_secs(11));
    }
    assert_eq!(blocked, 0);
}

#[test]
fn escalation_doubles_the_block_up_to_its_longest() {
    let clock = FakeClock::new(1_000 * S);
    let backend = memory(&clock);
    let limit = Limit::fixed_window("w", Quota::per_hour(1).unwrap())
        .unwrap()
        .penalty(
            Penalty::after(1)
                .block_for(Duration::from_secs(10))
                .escalating_up_to(Duration::from_secs(25)),
        )
        .unwrap();
    assert_eq!(status(&backend, &limit, b"k"), Status::Allowed);
    let mut blocks = Vec::new();
    for _ in 0..3 {
        let Status::Blocked { retry_after } = status(&backend, &limit, b"k") else {
            panic!("the refusal blocks");
        };
        blocks.push(retry_after / S);
        clock.advance(Duration::from_micros(retry_after));
    }
    assert_eq!(blocks, [10, 20, 25]);
}

#[test]
fn a_reset_lifts_a_block_and_a_blocked_batch_consumes_nothing() {
    let clock = FakeClock::new(1_000 * S);
    let backend = memory(&clock);
    let limit = login();
    let other = Limit::gcra("other", Quota::per_minute(10).unwrap()).unwrap();
    for _ in 0..8 {
        status(&backend, &limit, b"ip");
    }
    let batch = backend
        .check_now(&[Check::new(&limit, b"ip"), Check::new(&other, b"ip")])
        .unwrap();
    assert!(matches!(batch[0].status, Status::Blocked { .. }));
    assert_eq!(backend.peek_now(&Check::new(&other, b"ip")).remaining, 10);
    // A peek says the key is blocked, not only that nothing is left.
    let blocked = backend.peek_now(&Check::new(&limit, b"ip"));
    assert_eq!(blocked.standing, Some(Standing::Blocked));
    assert_eq!(blocked.retry_after, Some(Duration::from_secs(600)));
    backend.reset_now(&Check::new(&limit, b"ip")).unwrap();
    assert_eq!(status(&backend, &limit, b"ip"), Status::Allowed);
}

#[test]
fn a_deny_refuses_every_request_until_undenied_and_survives_a_reset() {
    let clock = FakeClock::new(1_000 * S);
    let backend = memory(&clock);
    // No penalty: any limit can be denied; a tracked GCRA key (the lock-free path).
    let limit = Limit::gcra("api", Quota::per_minute(100).unwrap()).unwrap();
    assert_eq!(status(&backend, &limit, b"k"), Status::Allowed);
    now(backend.deny(&Check::new(&limit, b"k"), Duration::from_secs(3600))).unwrap();
    assert_eq!(
        status(&backend, &limit, b"k"),
        Status::Denylisted {
            retry_after: 3600 * S
        }
    );
    // A peek says the key is denied, and for how long.
    assert_eq!(
        backend.peek_now(&Check::new(&limit, b"k")),
        KeyState::new(0, Duration::from_secs(3600))
            .with_retry_after(Duration::from_secs(3600))
            .with_standing(Standing::Denied)
    );
    backend.reset_now(&Check::new(&limit, b"k")).unwrap();
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        status(&backend, &limit, b"k"),
        Status::Denylisted {
            retry_after: 3540 * S
        }
    );
    now(backend.undeny(&Check::new(&limit, b"k"))).unwrap();
    assert_eq!(status(&backend, &limit, b"k"), Status::Allowed);
    // A deny ends by itself, and its place is given back.
    now(backend.deny(&Check::new(&limit, b"k"), Duration::from_secs(1))).unwrap();
    clock.advance(Duration::from_secs(2));
    assert_eq!(status(&backend, &limit, b"k"), Status::Allowed);
}

#[test]
fn a_penalty_is_refused_where_no_refusal_would_be_counted() {
    let lease = Lease::new(4).unwrap();
    let p = Penalty::after(3);
    assert!(matches!(
        Limit::concurrency("c", 2).unwrap().penalty(p),
        Err(ConfigError::PenaltyUnsupported(_))
    ));
    let leased = Limit::gcra("g", Quota::per_second(10).unwrap())
        .unwrap()
        .with_lease(lease)
        .unwrap();
    assert!(matches!(
        leased.penalty(p),
        Err(ConfigError::PenaltyUnsupported(_))
    ));
    let boxed = Limit::gcra("g", Quota::per_second(10).unwrap())
        .unwrap()
        .penalty(p)
        .unwrap();
    assert!(matches!(
        boxed.with_lease(lease),
        Err(ConfigError::PenaltyUnsupported(_))
    ));
    assert!(matches!(
        Limit::gcra("g", Quota::per_second(10).unwrap())
            .unwrap()
            .penalty(Penalty::after(0)),
        Err(ConfigError::InvalidPenalty(_))
    ));
}
