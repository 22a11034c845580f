//! Credentials in the URL: an ACL user and a `requirepass` password log in (on the shared
//! connection and on the direct one of the merged checks), a wrong one is refused, and no
//! `Debug`, `Display` or error shows the password.

#![allow(clippy::unwrap_used)]

mod support;

use support::{admitted, concurrent_admissions, gcra};
use tollgate_redis::{BuildError, RedisBackend};
use tollgate_testsupport::redis;
use tollgate_testsupport::RedisServer;

async fn admitted_of(backend: &RedisBackend, n: usize) -> usize {
    let limit = gcra("five", 5);
    let mut count = 0;
    for _ in 0..n {
        if admitted(backend, &[&limit], b"shop").await {
            count += 1;
        }
    }
    count
}

/// A server whose default user is off: only `app`, with password `p@ss:word`, logs in.
fn server_with_acl_user() -> (RedisServer, redis::Connection) {
    let server = RedisServer::start();
    let mut admin = server.client();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">p@ss:word", "~*", "+@all"])
        .query(&mut admin)
        .unwrap();
    let _: () = redis::cmd("AUTH")
        .arg(&["app", "p@ss:word"])
        .query(&mut admin)
        .unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "off"])
        .query(&mut admin)
        .unwrap();
    (server, admin)
}

#[tokio::test]
async fn an_acl_user_in_the_url_logs_in_and_counts_exactly() {
    let (server, mut admin) = server_with_acl_user();
    // `@` and `:` in the password are percent-encoded in the URL.
    let url = format!("redis://app:p%40ss%3Aword@127.0.0.1:{}/", server.port());
    let a = support::standalone(&url).build().unwrap();
    let b = support::standalone(&url).build().unwrap();
    let limit = gcra("five", 5);
    let mut count = 0;
    for i in 0..7 {
        if admitted(if i % 2 == 0 { &a } else { &b }, &[&limit], b"shop").await {
            count += 1;
        }
    }
    assert_eq!(count, 5);
    let keys: u64 = redis::cmd("DBSIZE").query(&mut admin).unwrap();
    assert_eq!(keys, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_checks_log_in_on_their_own_connection_too() {
    let (server, _admin) = server_with_acl_user();
    let url = format!("redis://app:p%40ss%3Aword@127.0.0.1:{}/", server.port());
    let backends = [
        support::standalone(&url).build().unwrap(),
        support::standalone(&url).build().unwrap(),
    ];
    assert_eq!(
        concurrent_admissions(&backends, &gcra("ten", 10), 100).await,
        10
    );
}

#[tokio::test]
async fn a_requirepass_password_alone_logs_in() {
    let server = RedisServer::start();
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", "hunter2"])
        .query(&mut server.client())
        .unwrap();
    let url = format!("redis://:hunter2@127.0.0.1:{}/", server.port());
    let backend = support::standalone(&url).build().unwrap();
    assert_eq!(admitted_of(&backend, 7).await, 5);
}

#[tokio::test]
async fn a_wrong_password_is_refused_without_being_shown() {
    let (server, mut admin) = server_with_acl_user();
    let url = format!("redis://app:not-the-pass@127.0.0.1:{}/", server.port());
    let backend = support::standalone(&url).build().unwrap();
    let limit = gcra("five", 5);
    let e =
        tollgate_engine::Backend::check(&backend, &[tollgate_engine::Check::new(&limit, b"shop")])
            .await
            .unwrap_err();
    assert_eq!(e.kind(), tollgate_engine::BackendErrorKind::Unavailable);
    let ping = backend.ping().await.unwrap_err();
    for shown in [
        e.to_string(),
        format!("{e:?}"),
        ping.to_string(),
        format!("{backend:?}"),
    ] {
        assert!(!shown.contains("not-the-pass"), "{shown}");
    }
    let keys: u64 = redis::cmd("DBSIZE").query(&mut admin).unwrap();
    assert_eq!(keys, 0);
}

#[test]
fn debug_of_the_builder_hides_passwords() {
    let builder = RedisBackend::builder().url("redis://:secret@127.0.0.1:6379/");
    let debug = format!("{builder:?}");
    assert!(!debug.contains("secret"), "{debug}");
    assert!(debug.contains("redis://:***@127.0.0.1:6379/"), "{debug}");

    let cluster = RedisBackend::builder().cluster([
        "redis://app:one@10.0.0.1:7000/",
        "redis://app:two@10.0.0.2:7000/",
    ]);
    let debug = format!("{cluster:?}");
    assert!(
        !debug.contains("one@") && !debug.contains("two@"),
        "{debug}"
    );
    assert!(debug.contains("redis://app:***@10.0.0.2:7000/"), "{debug}");

    let sentinel = RedisBackend::builder().sentinel("m", ["redis://:s3nt@10.0.0.1:26379/"]);
    let debug = format!("{sentinel:?}");
    assert!(!debug.contains("s3nt"), "{debug}");
}

#[test]
fn errors_about_a_url_never_show_its_password() {
    // An invalid database number: the client's message, with nothing of the URL.
    let e = RedisBackend::builder()
        .url("redis://app:topsecret@127.0.0.1:6379/notanumber")
        .build()
        .unwrap_err();
    assert!(matches!(e, BuildError::InvalidUrl { .. }), "{e:?}");
    for shown in [e.to_string(), format!("{e:?}")] {
        assert!(!shown.contains("topsecret"), "{shown}");
    }
}
