//! Keyed digests (`key_secret`) on a real `redis-server`: a secret moves every key of an
//! identity, replicas with the same secret share exact counts, settles and denies, replicas
//! with another secret (or none) count apart, and the secret never shows.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{admitted, check_at, gcra};
use tollgate_engine::{Backend, Check, Settlement, Status};
use tollgate_redis::{BuildError, RedisBackend, MIN_KEY_SECRET_LEN};
use tollgate_testsupport::RedisServer;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const OTHER: &[u8] = b"fedcba9876543210fedcba9876543210";

/// 2024-10-04T00:00:00Z, in microseconds.
const T0: u64 = 1_728_000_000_000_000;

#[tokio::test]
async fn replicas_with_one_secret_share_counts_and_others_count_apart() {
    let server = RedisServer::start();
    let keyed = |secret: &[u8]| {
        support::standalone(&server.url())
            .key_secret(secret)
            .build()
            .unwrap()
    };
    let (a, b, c) = (keyed(SECRET), keyed(SECRET), keyed(OTHER));
    let plain = support::standalone(&server.url()).build().unwrap();
    let limit = gcra("keyed", 3);

    // The key of one identity: the same under one secret, another under another or none.
    let key = |backend: &RedisBackend| backend.key_for(&limit, b"visitor");
    assert_eq!(key(&a), key(&b));
    assert_ne!(key(&a), key(&plain));
    assert_ne!(key(&a), key(&c));
    assert_ne!(key(&c), key(&plain));
    assert_eq!(key(&a).len(), key(&plain).len());

    // A and B share 3 a minute: exactly 3 of 10 admitted, whichever takes them.
    let mut count = 0;
    for i in 0..10 {
        let backend = if i % 2 == 0 { &a } else { &b };
        if admitted(backend, &[&limit], b"visitor").await {
            count += 1;
        }
    }
    assert_eq!(count, 3);
    // C and the unkeyed backend each find a fresh bucket: exactly 3 more each.
    for backend in [&c, &plain] {
        let mut count = 0;
        for _ in 0..10 {
            if admitted(backend, &[&limit], b"visitor").await {
                count += 1;
            }
        }
        assert_eq!(count, 3);
    }
    // Redis holds each secret's key, and nothing under the identity's text.
    let mut con = server.client();
    for backend in [&a, &c, &plain] {
        let exists: u64 = tollgate_testsupport::redis::cmd("EXISTS")
            .arg(key(backend))
            .query(&mut con)
            .unwrap();
        assert_eq!(exists, 1);
    }
    assert_eq!(server.dbsize(), 3);
}

/// A settle and a deny reach the key of the secret's digest: B gets back what A settled, and
/// refuses whom A denied; an unkeyed replica sees neither.
#[tokio::test]
async fn settles_and_denies_go_to_the_keyed_digest() {
    let server = RedisServer::start();
    let keyed = || {
        support::standalone(&server.url())
            .key_secret(SECRET)
            .build()
            .unwrap()
    };
    let (a, b) = (keyed(), keyed());
    let plain = support::standalone(&server.url()).build().unwrap();
    let limit = gcra("settled", 3);
    // A reserves the whole quota and settles at 1: 2 units come back, for B to take.
    let v = a
        .check_at(&[Check::new(&limit, b"shop").with_cost(3)], T0)
        .await
        .unwrap();
    assert!(v[0].is_allowed(), "{v:?}");
    let settlement = Settlement::new(&limit, b"shop", 3, 1, v.receipt(0), *limit.quota());
    a.settle_at(&[settlement], Some(T0)).await.unwrap();
    let mut count = 0;
    for _ in 0..5 {
        if check_at(&b, &[&limit], b"shop", T0)
            .await
            .iter()
            .all(|v| v.is_allowed())
        {
            count += 1;
        }
    }
    assert_eq!(count, 2);

    // A denies; B refuses the identity with a deny, the unkeyed replica does not know it.
    let deny = gcra("denied", 100);
    a.admin()
        .unwrap()
        .deny(&Check::new(&deny, b"shop"), Duration::from_secs(60))
        .await
        .unwrap();
    let v = check_at(&b, &[&deny], b"shop", T0).await;
    assert!(
        matches!(v[0].status, Status::Denylisted { .. }),
        "{:?}",
        v[0]
    );
    let v = check_at(&plain, &[&deny], b"shop", T0).await;
    assert!(v[0].is_allowed(), "{:?}", v[0]);
}

/// A secret shorter than 16 bytes is refused when the backend is built; no `Debug` shows
/// one.
#[test]
fn short_secrets_are_refused_and_secrets_never_show() {
    let short = support::standalone("redis://127.0.0.1:1")
        .key_secret(&SECRET[..MIN_KEY_SECRET_LEN - 1])
        .build()
        .unwrap_err();
    assert_eq!(short, BuildError::KeySecretTooShort { len: 15 });
    assert_eq!(
        short.to_string(),
        "the Redis key secret is 15 bytes long: it needs at least 16 random bytes"
    );
    let builder = support::standalone("redis://127.0.0.1:1").key_secret(SECRET);
    let debug = format!("{builder:?}");
    assert!(!debug.contains("0123456789abcdef"), "{debug}");
    assert!(debug.contains("keyed: true"), "{debug}");
    let backend = builder.build().unwrap();
    assert!(!format!("{backend:?}").contains("0123456789abcdef"));
}
