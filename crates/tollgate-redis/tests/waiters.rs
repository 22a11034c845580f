//! GCRA refunds while delayed requests wait, and settles under a smaller plan, on a real
//! Redis server, a real 3-master cluster and in memory: the same exact figures everywhere.
//!
//! A delayed request starts at its check's time plus its wait (`algorithm::gcra_wait`), as
//! the layer serves it. A refund (a waiter dropped, a response `count_if` does not count)
//! moves the TAT back only when it frees the last reservation or nobody waits, and only in
//! its check's run: no later request ever starts beside one that still waits, and a refund
//! after a reset gives nothing to the reset key. Each check and settle is made at a time the
//! test sets.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use tollgate_engine::{
    algorithm, Check, FakeClock, Limit, MemoryBackend, Micros, Quota, Receipt, Settlement, Status,
    Verdict,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};

const NOW: Micros = 1_700_000_000_000_000;
const S: Micros = 1_000_000;

enum Target {
    Memory(MemoryBackend<FakeClock>, FakeClock),
    Redis(RedisBackend),
}

impl Target {
    fn memory() -> Self {
        let clock = FakeClock::new(NOW);
        Self::Memory(MemoryBackend::builder().clock(clock.clone()).build(), clock)
    }

    async fn check(&self, check: Check<'_>, now: Micros) -> (Verdict, Receipt) {
        let v = match self {
            Self::Memory(backend, clock) => {
                clock.set(now);
                backend.check_now(&[check]).unwrap()
            }
            Self::Redis(backend) => backend.check_at(&[check], now).await.unwrap(),
        };
        (v[0], v.receipt(0))
    }

    async fn settle(&self, settlement: Settlement<'_>, now: Micros) {
        match self {
            Self::Memory(backend, clock) => {
                clock.set(now);
                backend.settle_now(&[settlement]);
            }
            Self::Redis(backend) => backend.settle_at(&[settlement], Some(now)).await.unwrap(),
        }
    }

    async fn reset(&self, check: &Check<'_>) {
        match self {
            Self::Memory(backend, _) => backend.reset_now(check).unwrap(),
            Self::Redis(backend) => {
                use tollgate_engine::Backend;
                backend.admin().unwrap().reset(check).await.unwrap();
            }
        }
    }
}

/// One a second, burst 1, waiting up to 5 s.
fn one_a_second() -> Limit {
    Limit::gcra("wait", Quota::per_second(1).unwrap().with_burst(1).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_secs(5))
        .unwrap()
}

/// A delayed request of `key` checked at `now`: when it starts (µs after `NOW`), and its
/// receipt; `None` if refused.
async fn request(
    target: &Target,
    limit: &Limit,
    key: &[u8],
    now: Micros,
) -> Option<(Micros, Receipt)> {
    let check = Check::new(limit, key).with_delay(limit.delay_micros());
    let (v, receipt) = target.check(check, now).await;
    v.is_allowed()
        .then(|| (now + algorithm::gcra_wait(limit.quota(), &v) - NOW, receipt))
}

/// The refund of a request of one unit that was admitted with `receipt`.
fn refund<'a>(limit: &'a Limit, key: &'a [u8], receipt: Receipt) -> Settlement<'a> {
    Settlement::new(limit, key, 1, 0, receipt, *limit.quota())
}

/// Requests due at 0, 1 and 2 s; the one due at 1 s is dropped (its refund comes at once):
/// the next is due at 3 s, not beside the one due at 2 s. Then the last goes too, and its
/// unit comes back: the next takes its place at 3 s.
async fn a_dropped_waiter(target: &Target) {
    let limit = one_a_second();
    let key = b"dropped";
    let mut starts = Vec::new();
    let mut receipts = Vec::new();
    for _ in 0..3 {
        let (start, receipt) = request(target, &limit, key, NOW).await.unwrap();
        starts.push(start);
        receipts.push(receipt);
    }
    assert_eq!(starts, [0, S, 2 * S]);
    target.settle(refund(&limit, key, receipts[1]), NOW).await;
    let (fourth, last) = request(target, &limit, key, NOW).await.unwrap();
    assert_eq!(fourth, 3 * S, "a later request beside one that waits");
    target.settle(refund(&limit, key, last), NOW).await;
    let (fifth, _) = request(target, &limit, key, NOW).await.unwrap();
    assert_eq!(fifth, 3 * S, "the last reservation's unit comes back");
}

/// The first request is answered at 0.5 s while two wait (due at 1 and 2 s), and `count_if`
/// gives its unit back: dropped, the next request is due at 3 s. Once nobody waits, a refund
/// gives back only what of its reservation is still ahead.
async fn a_count_if_refund_while_requests_wait(target: &Target) {
    let limit = one_a_second();
    let key = b"count-if";
    let (first, receipt) = request(target, &limit, key, NOW).await.unwrap();
    let (second, second_receipt) = request(target, &limit, key, NOW).await.unwrap();
    let (third, _) = request(target, &limit, key, NOW).await.unwrap();
    assert_eq!([first, second, third], [0, S, 2 * S]);
    let half = NOW + S / 2;
    target.settle(refund(&limit, key, receipt), half).await;
    let (fourth, _) = request(target, &limit, key, half).await.unwrap();
    assert_eq!(fourth, 3 * S, "a later request beside one that waits");
    // At 3 s the fourth has started and nobody waits, but the second's time (1 to 2 s) has
    // passed: its refund (answered late) gives nothing back, for the fourth keeps its place
    // after it. The next request starts at 4 s, not beside the fourth.
    target
        .settle(refund(&limit, key, second_receipt), NOW + 3 * S)
        .await;
    let (fifth, _) = request(target, &limit, key, NOW + 3 * S).await.unwrap();
    assert_eq!(
        fifth,
        4 * S,
        "a past reservation's refund gave its unit back"
    );
}

/// A request starts at 0, another is due at 1 s; the key is reset, and 100 ms later a
/// request starts at once. The waiter is dropped: the reset key never counted its unit, so
/// nothing comes back, and the next request waits its second.
async fn a_dropped_waiter_after_a_reset(target: &Target) {
    let limit = one_a_second();
    let key = b"reset";
    let (first, _) = request(target, &limit, key, NOW).await.unwrap();
    let (second, waiter) = request(target, &limit, key, NOW).await.unwrap();
    assert_eq!([first, second], [0, S]);
    target.reset(&Check::new(&limit, key)).await;
    let later = NOW + S / 10;
    let (third, _) = request(target, &limit, key, later).await.unwrap();
    assert_eq!(third, S / 10);
    target.settle(refund(&limit, key, waiter), later).await;
    let (fourth, _) = request(target, &limit, key, later).await.unwrap();
    assert_eq!(
        fourth,
        S / 10 + S,
        "the reset key was given a unit it never counted"
    );
}

/// Free 10 a minute, pro 100 a minute. A free request is checked, then 99 pro units (100
/// used in all); the free request's refund and a charge of one unit, under free, keep the
/// debt: 100 units at free's 6 s are 600 s, and the next free request (6 s more) is refused
/// for 546 s, until it fits within free's 60 s burst.
async fn a_settle_under_a_smaller_plan_keeps_the_debt(target: &Target) {
    let free = Quota::per_minute(10).unwrap();
    let pro = Quota::per_minute(100).unwrap();
    let limit = Limit::gcra("plans", free).unwrap();
    let key = b"tenant";
    let (v, receipt) = target
        .check(Check::new(&limit, key).with_quota(free), NOW)
        .await;
    assert!(v.is_allowed());
    let (v, _) = target
        .check(Check::new(&limit, key).with_quota(pro).with_cost(99), NOW)
        .await;
    assert_eq!((v.status, v.remaining), (Status::Allowed, 0));
    let settled = |actual| Settlement::new(&limit, key, 1, actual, receipt, free);
    let next_free = || target.check(Check::new(&limit, key).with_quota(free), NOW);
    target.settle(settled(0), NOW).await;
    let (v, _) = next_free().await;
    assert_eq!(
        v.retry_after(),
        Some(Duration::from_secs(546)),
        "after a refund"
    );
    target.settle(settled(2), NOW).await;
    let (v, _) = next_free().await;
    assert_eq!(
        v.retry_after(),
        Some(Duration::from_secs(546)),
        "after a charge"
    );
}

/// Runs `scenario` in memory, then on a server through the lean script and through the
/// general one (as a call with more checks or a penalty would send it).
macro_rules! everywhere {
    ($scenario:ident) => {{
        $scenario(&Target::memory()).await;
        let server = RedisServer::start();
        let lean = support::standalone(&server.url()).build().unwrap();
        $scenario(&Target::Redis(lean)).await;
        let server = RedisServer::start();
        let general = support::standalone(&server.url())
            .general_script_only()
            .build()
            .unwrap();
        $scenario(&Target::Redis(general)).await;
    }};
}

#[tokio::test]
async fn a_dropped_waiter_never_lets_a_later_request_start_beside_one_that_waits() {
    everywhere!(a_dropped_waiter);
}

#[tokio::test]
async fn a_count_if_refund_while_requests_wait_never_lets_two_start_together() {
    everywhere!(a_count_if_refund_while_requests_wait);
}

#[tokio::test]
async fn a_waiter_dropped_after_a_reset_gives_nothing_back_to_the_reset_key() {
    everywhere!(a_dropped_waiter_after_a_reset);
}

#[tokio::test]
async fn a_settle_under_a_smaller_plan_keeps_the_whole_debt_on_every_backend() {
    everywhere!(a_settle_under_a_smaller_plan_keeps_the_debt);
}

#[tokio::test]
async fn on_a_cluster_every_scenario_gives_the_same_figures() {
    let cluster = RedisCluster::start(3);
    let target = Target::Redis(support::cluster(cluster.urls()).build().unwrap());
    a_dropped_waiter(&target).await;
    a_count_if_refund_while_requests_wait(&target).await;
    a_dropped_waiter_after_a_reset(&target).await;
    a_settle_under_a_smaller_plan_keeps_the_debt(&target).await;
}
