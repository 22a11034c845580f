//! Delayed GCRA checks on a real Redis server and a real 3-master cluster: the same
//! admissions, waits and refusals as the in-memory backend, in one call per check, and a
//! deny cache that never answers a check under another delay than the one it learned from.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use tollgate_engine::{
    algorithm, Backend, Check, FakeClock, Limit, MemoryBackend, Quota, Receipt, Settlement, Verdict,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};

const NOW: u64 = 1_700_000_000_000_000;

/// One a second, burst 2, delay 3.5 s.
fn chat() -> Limit {
    Limit::gcra("chat", Quota::per_second(1).unwrap().with_burst(2).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_millis(3_500))
        .unwrap()
}

fn delayed<'a>(limit: &'a Limit, key: &'a [u8]) -> Check<'a> {
    Check::new(limit, key).with_delay(limit.delay_micros())
}

/// Ten delayed checks of one key at `NOW`, one after the other, on `backend`, with the
/// receipts of the admitted.
async fn ten_at_once(backend: &RedisBackend, limit: &Limit) -> (Vec<Verdict>, Vec<Receipt>) {
    let (mut out, mut receipts) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let v = backend
            .check_at(&[delayed(limit, b"k")], NOW)
            .await
            .unwrap();
        out.push(v[0]);
        if v[0].is_allowed() {
            receipts.push(v.receipt(0));
        }
    }
    (out, receipts)
}

/// The same on the in-memory backend.
async fn in_memory(limit: &Limit) -> Vec<Verdict> {
    let memory = MemoryBackend::builder().clock(FakeClock::new(NOW)).build();
    let mut out = Vec::new();
    for _ in 0..10 {
        out.push(memory.check(&[delayed(limit, b"k")]).await.unwrap()[0]);
    }
    out
}

/// What the model says: 2 + ⌊3.5 / 1⌋ = 5 admitted, waiting 0, 0, 1, 2 and 3 s; the rest
/// refused until they would be admitted with the delay (0.5 s).
fn assert_model(limit: &Limit, verdicts: &[Verdict]) {
    let waits: Vec<u64> = verdicts
        .iter()
        .map(|v| algorithm::gcra_wait(limit.quota(), v))
        .collect();
    assert_eq!(
        waits,
        [0, 0, 1_000_000, 2_000_000, 3_000_000, 0, 0, 0, 0, 0]
    );
    assert_eq!(verdicts.iter().filter(|v| v.is_allowed()).count(), 5);
    for v in &verdicts[5..] {
        assert_eq!(v.retry_after(), Some(Duration::from_millis(500)));
    }
}

#[tokio::test]
async fn a_server_admits_the_burst_and_the_delay_s_intervals_as_memory_does() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = chat();
    let (got, _) = ten_at_once(&backend, &limit).await;
    assert_model(&limit, &got);
    assert_eq!(got, in_memory(&limit).await);
}

#[tokio::test]
async fn a_cluster_admits_the_burst_and_the_delay_s_intervals_as_memory_does() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let limit = chat();
    let (got, receipts) = ten_at_once(&backend, &limit).await;
    assert_model(&limit, &got);
    assert_eq!(got, in_memory(&limit).await);
    // The refund of a waiter's unit (a request dropped while it waited, as the layer settles
    // it) lets the next one in, to wait the dropped one's 3 s.
    let check = delayed(&limit, b"k");
    assert!(!backend.check_at(&[check], NOW).await.unwrap()[0].is_allowed());
    backend
        .settle_at(&[Settlement::of(&check, receipts[4], 0)], Some(NOW))
        .await
        .unwrap();
    let v = backend.check_at(&[check], NOW).await.unwrap()[0];
    assert_eq!(algorithm::gcra_wait(limit.quota(), &v), 3_000_000);
}

#[tokio::test]
async fn the_deny_cache_answers_only_checks_under_the_delay_it_learned_from() {
    // The cache learns only from checks at the server's time (not `check_at`'s): one every
    // 100 s, so that the test's own run time (well under a second) cannot change a verdict;
    // waits are read to within it.
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let plain = Limit::gcra("l", Quota::new(1, Duration::from_secs(100)).unwrap()).unwrap();
    let d100 = plain.clone().delay_up_to(Duration::from_secs(100)).unwrap();
    let d200 = plain.clone().delay_up_to(Duration::from_secs(200)).unwrap();
    let at = |limit: &Limit| {
        let f = backend.check(&[delayed(limit, b"k")]);
        async move { f.await.unwrap()[0] }
    };
    let wait_s = |v: &Verdict| {
        assert!(v.is_allowed(), "{v:?}");
        algorithm::gcra_wait(plain.quota(), v).div_ceil(1_000_000)
    };
    assert!(at(&plain).await.is_allowed());
    // Refused without a delay: the cache holds that denial...
    assert!(!at(&plain).await.is_allowed());
    assert_eq!(backend.deny_cache_len(), 1);
    // ... which does not answer a check with a delay: Redis admits it, to wait 100 s.
    assert_eq!(wait_s(&at(&d100).await), 100);
    // Refused with 100 s (it would wait 200 s), and that denial is learned under 100 s; it
    // does not answer a check with 200 s, which Redis admits.
    assert!(!at(&d100).await.is_allowed());
    assert!(!at(&d100).await.is_allowed());
    assert_eq!(wait_s(&at(&d200).await), 200);
    // Without a delay, refused until the key's three intervals beyond the burst have passed.
    let retry = at(&plain).await.retry_after().unwrap();
    assert!(retry > Duration::from_secs(299) && retry <= Duration::from_secs(300));
}

#[tokio::test]
async fn a_leased_limit_s_delayed_checks_reach_the_server() {
    use tollgate_engine::Lease;
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = Limit::gcra("leased", Quota::per_minute(600).unwrap())
        .unwrap()
        .with_lease(Lease::new(4).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_secs(1))
        .unwrap();
    // Without a delay, the second check is answered from the slice the first one took.
    let plain = || backend.check(&[Check::new(&limit, b"k")]);
    plain().await.unwrap();
    assert!(plain().await.unwrap().from_lease(0));
    // A delayed check never is, and it holds no slice.
    for _ in 0..3 {
        let v = backend.check(&[delayed(&limit, b"k")]).await.unwrap();
        assert!(v[0].is_allowed());
        assert!(!v.from_lease(0));
    }
}
