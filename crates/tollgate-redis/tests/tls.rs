//! `rediss://`: exact counts over TLS against real `redis-server --tls-port` processes, for a
//! standalone server, a Redis Cluster and Sentinel, with certificates made at run time; and
//! what is refused: a server whose certificate the backend cannot verify, a client without the
//! certificate the server asks for, certificates that cannot be read.

#![allow(clippy::unwrap_used)]

mod support;

use support::{admitted, concurrent_admissions, gcra};
use tollgate_redis::{BuildError, RedisBackend, RedisBackendBuilder};
use tollgate_testsupport::{RedisCluster, RedisServer, Sentinel, TestCerts, SENTINEL_MASTER};

/// Admissions of `n` checks of a limit of 5 a minute for one key, alternating between
/// `backends`.
async fn admitted_of(backends: &[&RedisBackend], n: usize) -> usize {
    let limit = gcra("five", 5);
    let mut count = 0;
    for i in 0..n {
        if admitted(backends[i % backends.len()], &[&limit], b"shop").await {
            count += 1;
        }
    }
    count
}

fn tls(url: &str, certs: &TestCerts) -> RedisBackendBuilder {
    support::standalone(url).tls_ca_pem(certs.ca_pem())
}

#[tokio::test]
async fn a_limit_of_5_admits_exactly_5_of_7_over_tls() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    assert!(server.url().starts_with("rediss://"));
    let backend = tls(&server.url(), &certs).build().unwrap();
    assert_eq!(admitted_of(&[&backend], 7).await, 5);
    // The count is in the server, as over plain TCP.
    assert_eq!(server.dbsize(), 1);
}

#[tokio::test]
async fn two_backends_on_one_tls_server_share_the_count() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    let a = tls(&server.url(), &certs).build().unwrap();
    let b = tls(&server.url(), &certs).build().unwrap();
    assert_eq!(admitted_of(&[&a, &b], 7).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_concurrent_checks_over_tls_admit_exactly_the_limit() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    let backends = [
        tls(&server.url(), &certs).build().unwrap(),
        tls(&server.url(), &certs).build().unwrap(),
    ];
    assert_eq!(
        concurrent_admissions(&backends, &gcra("ten", 10), 100).await,
        10
    );
}

#[tokio::test]
async fn an_acl_user_in_a_rediss_url_logs_in() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    let _: () = tollgate_testsupport::redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">tls-pass", "~*", "+@all"])
        .query(&mut server.client())
        .unwrap();
    let url = format!("rediss://app:tls-pass@127.0.0.1:{}/", server.port());
    let backend = tls(&url, &certs).build().unwrap();
    assert_eq!(admitted_of(&[&backend], 7).await, 5);
    let wrong = format!("rediss://app:wrong-pass@127.0.0.1:{}/", server.port());
    let refused = tls(&wrong, &certs).build().unwrap();
    let e = refused.ping().await.unwrap_err();
    assert!(!e.to_string().contains("wrong-pass"), "{e}");
    assert!(!format!("{e:?}").contains("wrong-pass"), "{e:?}");
}

#[tokio::test]
async fn a_server_signed_by_another_ca_is_refused() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    let other = TestCerts::generate();
    let backend = tls(&server.url(), &other).build().unwrap();
    let e = backend.ping().await.unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
    // A check fails (its limit's failure policy applies) and counts nothing.
    let limit = gcra("five", 5);
    let check =
        tollgate_engine::Backend::check(&backend, &[tollgate_engine::Check::new(&limit, b"shop")])
            .await;
    assert!(check.is_err());
    assert_eq!(server.dbsize(), 0);
}

#[tokio::test]
async fn without_a_ca_only_the_webpki_roots_are_trusted() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    // The test CA is no public root: the server's certificate is not trusted.
    let backend = support::standalone(&server.url()).build().unwrap();
    let e = backend.ping().await.unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
}

#[tokio::test]
async fn a_server_that_asks_for_a_client_certificate_gets_one() {
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls_requiring_client_cert(&certs);
    let without = tls(&server.url(), &certs).build().unwrap();
    assert!(without.ping().await.is_err());
    let with = tls(&server.url(), &certs)
        .tls_client_cert_pem(certs.client_cert_pem(), certs.client_key_pem())
        .build()
        .unwrap();
    assert_eq!(admitted_of(&[&with], 7).await, 5);
    let debug = format!(
        "{:?}",
        tls(&server.url(), &certs)
            .tls_client_cert_pem(certs.client_cert_pem(), certs.client_key_pem())
    );
    assert!(!debug.contains("PRIVATE KEY"), "{debug}");
    assert!(!debug.contains("BEGIN"), "{debug}");
}

#[tokio::test]
async fn a_cluster_over_tls_admits_exactly_the_limit() {
    let certs = TestCerts::generate();
    let cluster = RedisCluster::start_tls(3, &certs);
    assert!(cluster.urls().iter().all(|u| u.starts_with("rediss://")));
    let build = || {
        support::cluster(cluster.urls())
            .tls_ca_pem(certs.ca_pem())
            .build()
            .unwrap()
    };
    let (a, b) = (build(), build());
    assert_eq!(admitted_of(&[&a, &b], 7).await, 5);
    assert_eq!(cluster.dbsize(), 1);
}

#[tokio::test]
async fn sentinel_over_tls_reaches_the_master_and_admits_exactly_the_limit() {
    let certs = TestCerts::generate();
    let setup = Sentinel::start_tls(&certs);
    assert!(setup
        .sentinel_urls()
        .iter()
        .all(|u| u.starts_with("rediss://")));
    let backend = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .deadline(support::DEADLINE)
        .tls_ca_pem(certs.ca_pem())
        .build()
        .unwrap();
    assert_eq!(admitted_of(&[&backend], 7).await, 5);
    assert_eq!(setup.master().dbsize(), 1);
}

#[test]
fn certificates_that_cannot_be_used_are_build_errors() {
    let certs = TestCerts::generate();
    let url = "rediss://127.0.0.1:6380/";
    let no_ca = RedisBackend::builder()
        .url(url)
        .tls_ca_pem("not a certificate")
        .build()
        .unwrap_err();
    assert!(matches!(no_ca, BuildError::Tls { .. }), "{no_ca:?}");
    assert_eq!(
        no_ca.to_string(),
        "Redis TLS settings: the CA PEM holds no certificate"
    );
    let bad_key = RedisBackend::builder()
        .url(url)
        .tls_client_cert_pem(
            certs.client_cert_pem(),
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .build()
        .unwrap_err();
    assert!(matches!(bad_key, BuildError::Tls { .. }), "{bad_key:?}");
    // A real key, but not the certificate's.
    let other = TestCerts::generate();
    let mismatched = RedisBackend::builder()
        .url(url)
        .tls_client_cert_pem(certs.client_cert_pem(), other.client_key_pem())
        .build()
        .unwrap_err();
    assert!(
        matches!(mismatched, BuildError::Tls { .. }),
        "{mismatched:?}"
    );
    assert!(!mismatched.to_string().contains("PRIVATE"), "{mismatched}");
    // Certificates for a plain URL would be ignored: refused, so TLS is never silently off.
    let plain = RedisBackend::builder()
        .url("redis://127.0.0.1:6379/")
        .tls_ca_pem(certs.ca_pem())
        .build()
        .unwrap_err();
    assert_eq!(
        plain,
        BuildError::Tls {
            reason: "certificates were given for a URL that is not rediss://".to_owned()
        }
    );
    let mixed = RedisBackend::builder()
        .cluster(["rediss://127.0.0.1:7000/", "redis://127.0.0.1:7001/"])
        .build()
        .unwrap_err();
    assert!(matches!(mixed, BuildError::InvalidUrl { .. }), "{mixed:?}");
    let insecure = RedisBackend::builder()
        .url("rediss://127.0.0.1:6380/#insecure")
        .build()
        .unwrap_err();
    assert!(matches!(insecure, BuildError::Tls { .. }), "{insecure:?}");
    let insecure_seed = RedisBackend::builder()
        .cluster(["rediss://127.0.0.1:7000/#insecure"])
        .build()
        .unwrap_err();
    assert_eq!(insecure_seed, insecure);
}
