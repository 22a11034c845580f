//! Concurrency slots on a real redis-server and a real Redis Cluster: taken all-or-nothing,
//! given back by id, renewed, expired, and released after a lost answer.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{cluster, gcra, standalone, DEADLINE};
use tollgate_engine::{Backend, Check, Limit, Quota, Slots, Status};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{until, RedisCluster, RedisServer};

fn server_now(conn: &mut redis::Connection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn).unwrap();
    secs * 1_000_000 + micros
}

/// The same figures on any deployment: `conn` reaches the node that holds the limit's key.
async fn slots_are_taken_released_renewed_and_expire(
    backend: &RedisBackend,
    conn: impl Fn() -> redis::Connection,
) {
    let slots = Limit::concurrency("slots", 2).unwrap();
    let rate = gcra("rate", 100);
    let key = backend.key_for(&slots, b"client");
    let held = |conn: &mut redis::Connection| -> u64 {
        redis::cmd("ZCARD").arg(&key).query(conn).unwrap()
    };
    let t0 = server_now(&mut conn());
    let check = |slot: u128| {
        [
            Check::new(&rate, b"client"),
            Check::new(&slots, b"client").with_slot(slot),
        ]
    };

    let v = backend.check_at(&check(1), t0).await.unwrap();
    assert_eq!((v[1].is_allowed(), v[1].remaining), (true, 1));
    let v = backend.check_at(&check(2), t0).await.unwrap();
    assert_eq!((v[1].is_allowed(), v[1].remaining), (true, 0));
    // Full: refused with the busy Retry-After, and the rate limit beside it consumed nothing.
    let v = backend.check_at(&check(3), t0).await.unwrap();
    assert_eq!(
        v[1].status,
        Status::Denied {
            retry_after: 1_000_000
        }
    );
    assert_eq!(v[0].remaining, 98, "two admissions counted, not three");
    assert_eq!(held(&mut conn()), 2);
    // The same refusal again is asked of Redis, not a deny cache: slots free at any moment.
    backend.release(&[check(1)[1]]);
    assert_eq!(until(1, || held(&mut conn())).await, 1);
    let v = backend.check_at(&check(4), t0).await.unwrap();
    assert!(v[1].is_allowed());

    // Renewing moves a held slot's deadline; a released one is not brought back.
    // A slot is held under its id's three parts (42, 43 and 43 bits) in decimal.
    let score = |conn: &mut redis::Connection, slot: u64| -> Option<u64> {
        redis::cmd("ZSCORE")
            .arg(&key)
            .arg(format!("0-0-{slot}"))
            .query(conn)
            .unwrap()
    };
    let before = score(&mut conn(), 4).unwrap();
    assert_eq!(before, t0 + 30_000_000);
    backend.renew(&[check(4)[1], check(1)[1]]);
    let renewed = until(1, || u64::from(score(&mut conn(), 4).unwrap() > before)).await;
    assert_eq!(renewed, 1);
    assert_eq!(score(&mut conn(), 1), None);

    // A slot nobody renews is gone one lifetime after it was taken (a crashed replica's):
    // slot 2 was taken at t0 and expires at t0 + 30 s; the renewed slot 4 is still held.
    let v = backend.check_at(&check(5), t0 + 30_000_001).await.unwrap();
    assert_eq!((v[1].is_allowed(), v[1].remaining), (true, 0));
    assert_eq!(held(&mut conn()), 2);
    backend.release(&[check(4)[1], check(5)[1]]);
    assert_eq!(until(0, || held(&mut conn())).await, 0);
}

#[tokio::test]
async fn slots_on_a_standalone_server() {
    let server = RedisServer::start();
    let backend = standalone(&server.url()).build().unwrap();
    slots_are_taken_released_renewed_and_expire(&backend, || server.client()).await;
}

#[tokio::test]
async fn slots_on_a_cluster() {
    let cluster_ = RedisCluster::start(3);
    let backend = cluster(cluster_.urls()).build().unwrap();
    let key = backend.key_for(&Limit::concurrency("slots", 2).unwrap(), b"client");
    let node = cluster_.node_of_key(&key);
    slots_are_taken_released_renewed_and_expire(&backend, || cluster_.nodes()[node].client()).await;
}

/// A call sent to a paused Redis times out, but Redis takes the slot when it resumes: the
/// backend releases it by its id once Redis answers again, instead of leaving it for a whole
/// slot lifetime.
#[tokio::test]
async fn a_slot_whose_answer_was_lost_is_released_when_redis_answers_again() {
    let mut server = RedisServer::start();
    let backend = RedisBackend::builder()
        .url(server.url().as_str())
        .deadline(Duration::from_millis(200))
        .build()
        .unwrap();
    let slots = Limit::concurrency("slots", 1).unwrap();
    let key = backend.key_for(&slots, b"client");
    let url = server.url();
    let held = || -> u64 {
        let mut conn = redis::Client::open(url.as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("ZCARD").arg(&key).query(&mut conn).unwrap()
    };
    // Connected and the script loaded before the pause.
    let v = backend
        .check(&[Check::new(&slots, b"client").with_slot(1)])
        .await
        .unwrap();
    assert!(v[0].is_allowed());
    backend.release(&[Check::new(&slots, b"client").with_slot(1)]);
    assert_eq!(until(0, held).await, 0);

    server.pause();
    let lost = backend
        .check(&[Check::new(&slots, b"client").with_slot(2)])
        .await;
    assert!(lost.unwrap_err().is_timeout());
    server.resume();
    // Redis ran the call when it resumed, and the release by id followed.
    assert_eq!(until(0, held).await, 0);
    let v = RedisBackend::builder()
        .url(server.url().as_str())
        .deadline(DEADLINE)
        .build()
        .unwrap()
        .check(&[Check::new(&slots, b"client").with_slot(3)])
        .await
        .unwrap();
    assert!(v[0].is_allowed(), "the key's one slot is free");
}

/// Slot ids are 128 bits: ids that agree on their low 64 bits (or on any 43-bit part) are two
/// slots, and each release frees its own, whatever the replica.
#[tokio::test]
async fn slot_ids_that_share_low_bits_are_distinct_slots() {
    let server = RedisServer::start();
    let a = standalone(&server.url()).build().unwrap();
    let b = standalone(&server.url()).build().unwrap();
    let slots = Limit::concurrency("slots", 2).unwrap();
    let key = a.key_for(&slots, b"client");
    let mut conn = server.client();
    let mut held = || -> u64 { redis::cmd("ZCARD").arg(&key).query(&mut conn).unwrap() };
    let low = 7u128;
    let high = (u128::from(u64::MAX) << 64) | low;
    let check = |id: u128| [Check::new(&slots, b"client").with_slot(id)];
    assert!(a.check(&check(low)).await.unwrap()[0].is_allowed());
    assert!(b.check(&check(high)).await.unwrap()[0].is_allowed());
    assert!(!a.check(&check(3)).await.unwrap()[0].is_allowed());
    assert_eq!(held(), 2);
    b.release(&check(high));
    assert_eq!(until(1, &mut held).await, 1);
    a.release(&check(low));
    assert_eq!(until(0, &mut held).await, 0);
}

/// A release that cannot reach Redis (the shared connection went silent) holds a check of its
/// own key until its first attempt ends, and no check of another key: the other key's check is
/// answered while the release is still in flight; the own key's check waits for the release's
/// attempt to end, and finds the slot still held (the release never landed).
#[tokio::test]
async fn a_release_in_flight_holds_checks_of_its_own_key_only() {
    let server = RedisServer::start();
    let relay = support::SilentRelay::start(server.port());
    let backend = RedisBackend::builder()
        .url(relay.url())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    // The shared connection (releases), then silence on it.
    backend.ping().await.unwrap();
    assert_eq!(relay.accepted(), 1);
    relay.silence_existing();
    let limit = Limit::concurrency("jobs", 1).unwrap();
    let a = Check::new(&limit, b"a").with_slot(1);
    assert!(backend.check(&[a]).await.unwrap()[0].is_allowed());
    // The checks' own connection, made after the silence.
    assert_eq!(relay.accepted(), 2);
    let landing = backend.slots().unwrap().release_landing(&[a]).unwrap();
    let mut landing = std::pin::pin!(landing);
    let b = backend.check(&[Check::new(&limit, b"b").with_slot(2)]);
    tokio::select! {
        biased;
        v = b => assert!(v.unwrap()[0].is_allowed()),
        () = &mut landing => panic!("the check of another key waited for the release"),
    }
    let again = backend.check(&[Check::new(&limit, b"a").with_slot(3)]);
    let mut again = std::pin::pin!(again);
    tokio::select! {
        biased;
        () = &mut landing => {}
        _ = &mut again => panic!("the check of the released key did not wait for its release"),
    }
    assert!(!again.await.unwrap()[0].is_allowed());
}

/// A plan whose period differs from the limit's slot lifetime: its slots live the limit's
/// lifetime (30 s), by which their renewals are paced (every 10 s), not the plan's second. Two
/// seconds after ten slots were taken, none renewed yet, they are all still held: an eleventh
/// is refused, never more than the plan's 10 in flight.
#[tokio::test]
async fn a_plan_s_slots_live_the_limit_s_slot_lifetime() {
    let server = RedisServer::start();
    let backend = standalone(&server.url()).build().unwrap();
    let pro = Quota::per_second(10).unwrap();
    let slots = Limit::concurrency("slots", 2)
        .unwrap()
        .plan("pro", pro)
        .unwrap();
    let key = backend.key_for(&slots, b"client");
    let t0 = server_now(&mut server.client());
    let take = |slot: u128| {
        [Check::new(&slots, b"client")
            .with_quota(pro)
            .with_slot(slot)]
    };
    for slot in 1..=10 {
        let v = backend.check_at(&take(slot), t0).await.unwrap();
        assert!(v[0].is_allowed(), "slot {slot}");
    }
    let deadlines: Vec<(String, u64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut server.client())
        .unwrap();
    assert_eq!(deadlines.len(), 10);
    assert!(
        deadlines.iter().all(|(_, at)| *at == t0 + 30_000_000),
        "{deadlines:?}"
    );
    let v = backend.check_at(&take(11), t0 + 2_000_000).await.unwrap();
    assert_eq!(
        v[0].status,
        Status::Denied {
            retry_after: 1_000_000
        }
    );
}
