//! Operators' tools on every backend: allowlists (never counted), and `peek` / `reset` by
//! the identity requests are counted as.

#![allow(clippy::unwrap_used)]

mod support;

use std::net::IpAddr;
use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use support::clients::{app, from, Svc};
use tollgate::engine::{Backend, BackendErrorKind, KeyState, MAX_DENY};
use tollgate::key::{ClientIp, MissingKey, Principal, Tenant};
use tollgate::{
    AdminError, Allowlist, Decision, Limit, Limits, LimitsFile, Outcome, Quota, RateLimitLayer,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::{Service, ServiceExt};

/// The status, the handler's body, and whether the response has a `RateLimit` field.
async fn send(svc: &mut Svc, req: Request<Body>) -> (StatusCode, String, bool) {
    let response = svc.ready().await.unwrap().call(req).await.unwrap();
    let status = response.status();
    let fields = response.headers().contains_key("ratelimit");
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap(), fields)
}

fn redis(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix("ops")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn cluster(urls: Vec<String>) -> RedisBackend {
    RedisBackend::builder()
        .cluster(urls)
        .prefix("ops")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn per_ip_limits() -> Limits {
    Limits::new().limit(
        Limit::gcra("per-ip", Quota::per_minute(2).unwrap()).unwrap(),
        ClientIp::peer(),
    )
}

fn allowlist() -> Allowlist {
    Allowlist::new()
        .networks(
            ClientIp::peer(),
            [
                "10.0.0.0/8".parse().unwrap(),
                "2001:db8:1::/48".parse().unwrap(),
            ],
        )
        .keys(Tenant::header("x-shop-domain"), ["Internal.example"])
        .unwrap()
        .keys(Principal::<String>::new(), ["ops-bot"])
        .unwrap()
}

/// Allowlisted requests by network, tenant and principal are all admitted, say so, carry no
/// fields and consume nothing; everyone else has the limit of 2.
async fn allowlisted_requests_are_never_counted<B: Backend + Clone>(backend: B) -> B {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .limits(per_ip_limits())
        .allowlist(allowlist())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let allowed = (StatusCode::OK, "allowlisted".to_owned(), false);
    for _ in 0..20 {
        assert_eq!(send(&mut svc, from("10.1.2.3", None, None)).await, allowed);
        assert_eq!(
            send(&mut svc, from("2001:db8:1:ff::9", None, None)).await,
            allowed
        );
        // The tenant is matched as the extractor normalises it.
        let shop = from("203.0.113.5", Some("internal.EXAMPLE"), None);
        assert_eq!(send(&mut svc, shop).await, allowed);
        assert_eq!(
            send(&mut svc, from("203.0.113.5", None, Some("ops-bot"))).await,
            allowed
        );
    }
    // None of them was counted: their keys are whole.
    for ip in ["10.1.2.3", "2001:db8:1:ff::9", "203.0.113.5"] {
        assert_eq!(layer.peek("per-ip", ip).await.unwrap().remaining, 2, "{ip}");
    }
    // Others are counted, including the network's neighbour and another tenant.
    for ip in ["11.0.0.1", "2001:db8:2::1"] {
        let counted = (StatusCode::OK, "counted".to_owned(), true);
        assert_eq!(
            send(&mut svc, from(ip, Some("shop.example"), None)).await,
            counted
        );
        assert_eq!(
            send(&mut svc, from(ip, None, Some("someone"))).await,
            counted
        );
        let refused = send(&mut svc, from(ip, None, None)).await;
        assert_eq!(refused.0, StatusCode::TOO_MANY_REQUESTS, "{ip}");
    }
    layer.backend().clone()
}

#[tokio::test]
async fn an_allowlisted_client_is_never_counted_in_memory() {
    let backend = allowlisted_requests_are_never_counted(tollgate::MemoryBackend::new()).await;
    // Only the four counted clients' keys (2 addresses, per-ip) are tracked.
    assert_eq!(backend.stats().tracked_keys, 2);
}

#[tokio::test]
async fn an_allowlisted_client_is_never_counted_on_redis() {
    let server = RedisServer::start();
    allowlisted_requests_are_never_counted(redis(&server.url())).await;
    // Two keys, the two counted addresses': the 80 allowlisted requests wrote nothing.
    assert_eq!(server.dbsize(), 2);
}

#[tokio::test]
async fn an_allowlist_changes_with_a_reload() {
    let layer = RateLimitLayer::builder()
        .limits(per_ip_limits())
        .allowlist(allowlist())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for _ in 0..5 {
        assert_eq!(
            send(&mut svc, from("10.0.0.7", None, None)).await.0,
            StatusCode::OK
        );
    }
    // The new limits have no allowlist: 10.0.0.7 is counted from now on.
    layer.reloader().reload(per_ip_limits()).unwrap();
    assert_eq!(
        send(&mut svc, from("10.0.0.7", None, None)).await.1,
        "counted"
    );
    assert_eq!(
        send(&mut svc, from("10.0.0.7", None, None)).await.1,
        "counted"
    );
    assert_eq!(
        send(&mut svc, from("10.0.0.7", None, None)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // And a file brings one back.
    let text = r#"
[[limit]]
name = "per-ip"
period = "1m"
key = "ip"
[limit.quota]
default = 2

[[allowlist]]
key = "ip"
networks = ["10.0.0.0/24"]
"#;
    layer
        .reloader()
        .reload(LimitsFile::new().parse(text).unwrap())
        .unwrap();
    let (status, body, _) = send(&mut svc, from("10.0.0.7", None, None)).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "allowlisted"));
    assert_eq!(
        send(&mut svc, from("10.0.1.7", None, None)).await.1,
        "counted"
    );
}

#[test]
fn limits_file_allowlists_name_their_mistakes() {
    // Each at the value that is wrong; a rule without what it admits at its `[[allowlist]]`.
    let cases = [
        (
            "[[allowlist]]\nkey = \"ip\"\nnetworks = [\"10.0.0.1/8\"]\n",
            "line 3 column 13: allowlist: invalid CIDR \"10.0.0.1/8\"",
        ),
        (
            "[[allowlist]]\nkey = { header = \"x-shop\" }\nnetworks = [\"10.0.0.0/8\"]\n",
            "line 2 column 7: allowlist `networks` need an ip key",
        ),
        (
            "[[allowlist]]\nkey = { header = \"x-shop\" }\nvalues = [\"bad shop!\"]\n",
            "line 3 column 11: allowlist: allowlist entry \"bad shop!\" is not a key",
        ),
        (
            "[[allowlist]]\nkey = \"ip\"\n",
            "line 1 column 1: an allowlist needs `networks`",
        ),
    ];
    let limit =
        "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\n[limit.quota]\ndefault = 1\n\n";
    for (allow, want) in cases {
        let text = format!("{allow}\n{limit}");
        let err = LimitsFile::new().parse(&text).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
    }
}

/// GCRA per IP (5 a minute), a fixed window per shop (10 a day), a sliding log per IP (10 an
/// hour); peeked and reset by the identities requests carry.
async fn peek_and_reset<B: Backend>(backend: B) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(5).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .limit(
            Limit::fixed_window("per-shop", Quota::per_day(10).unwrap()).unwrap(),
            Tenant::header("x-shop-domain"),
        )
        .limit(
            Limit::sliding_log("hourly", Quota::per_hour(10).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let whole = |n| KeyState::new(n, Duration::ZERO);
    assert_eq!(layer.peek("per-ip", "2001:db8::1").await.unwrap(), whole(5));
    assert_eq!(
        layer.peek("per-shop", "a.example").await.unwrap(),
        whole(10)
    );
    assert_eq!(
        layer.peek("hourly", "2001:db8::1").await.unwrap(),
        whole(10)
    );

    for _ in 0..3 {
        let req = from("2001:db8::1", Some("a.example"), None);
        assert_eq!(send(&mut svc, req).await.0, StatusCode::OK);
    }
    // Any address of the /64 is the same client; a shop is named as requests name it. Peeking
    // twice consumes nothing.
    for _ in 0..2 {
        let ip: IpAddr = "2001:db8::ffff".parse().unwrap();
        let s = layer.peek("per-ip", ip).await.unwrap();
        assert_eq!((s.remaining, s.retry_after), (2, None));
        assert!(
            s.reset > Duration::from_secs(35) && s.reset <= Duration::from_secs(36),
            "{s:?}"
        );
        let s = layer.peek("per-shop", " A.Example ").await.unwrap();
        assert_eq!(s.remaining, 7);
        assert_eq!(layer.peek("hourly", ip).await.unwrap().remaining, 7);
    }
    assert_eq!(
        layer.peek("per-ip", "2001:db8:0:1::1").await.unwrap(),
        whole(5)
    );

    // Use up the GCRA: refused (and, on Redis, the denial cached in this replica).
    for _ in 0..2 {
        let req = from("2001:db8::1", Some("a.example"), None);
        assert_eq!(send(&mut svc, req).await.0, StatusCode::OK);
    }
    let req = from("2001:db8::1", Some("a.example"), None);
    assert_eq!(send(&mut svc, req).await.0, StatusCode::TOO_MANY_REQUESTS);
    let s = layer.peek("per-ip", "2001:db8::1").await.unwrap();
    assert_eq!(s.remaining, 0);
    let after = s.retry_after.unwrap();
    assert!(
        after > Duration::from_secs(11) && after <= Duration::from_secs(12),
        "{s:?}"
    );
    assert_eq!(
        layer.peek("per-shop", "a.example").await.unwrap().remaining,
        5
    );

    // Reset: the next request is admitted at once (no cached denial stands in the way).
    layer.reset("per-ip", "2001:db8::1").await.unwrap();
    assert_eq!(layer.peek("per-ip", "2001:db8::1").await.unwrap(), whole(5));
    let req = from("2001:db8::1", Some("a.example"), None);
    assert_eq!(send(&mut svc, req).await.0, StatusCode::OK);
    assert_eq!(
        layer.peek("per-ip", "2001:db8::1").await.unwrap().remaining,
        4
    );
    assert_eq!(
        layer.peek("per-shop", "a.example").await.unwrap().remaining,
        4
    );
    layer.reset("per-shop", "A.EXAMPLE").await.unwrap();
    layer.reset("hourly", "2001:db8::1").await.unwrap();
    assert_eq!(
        layer.peek("per-shop", "a.example").await.unwrap(),
        whole(10)
    );
    assert_eq!(
        layer.peek("hourly", "2001:db8::1").await.unwrap(),
        whole(10)
    );

    // What cannot be a key is said so, and nothing is asked of the backend.
    assert!(matches!(
        layer.peek("nope", "1.2.3.4").await,
        Err(AdminError::UnknownLimit(name)) if name == "nope"
    ));
    match layer.peek("per-ip", "shop.example").await {
        Err(AdminError::Identity(e)) => {
            assert_eq!(e.missing(), MissingKey::NotAnAddress);
            assert_eq!(e.limit(), "per-ip");
            assert_eq!(
                e.to_string(),
                r#""shop.example" is not an IP address: expected an IP address for rate limit "per-ip""#
            );
        }
        other => panic!("{other:?}"),
    }
    match layer.reset("per-ip", "abc").await {
        Err(e @ AdminError::Identity(_)) => assert_eq!(
            e.to_string(),
            r#""abc" is not an IP address: expected an IP address for rate limit "per-ip""#
        ),
        other => panic!("{other:?}"),
    }
    match layer.reset("per-shop", "bad shop!").await {
        Err(AdminError::Identity(e)) => {
            assert_eq!(e.missing(), MissingKey::Invalid);
            assert_eq!(
                e.to_string(),
                r#""bad shop!" is not a key of rate limit "per-shop": the rate-limit key is invalid"#
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn peek_and_reset_in_memory() {
    peek_and_reset(tollgate::MemoryBackend::new()).await;
}

#[tokio::test]
async fn peek_and_reset_on_redis() {
    let server = RedisServer::start();
    peek_and_reset(redis(&server.url())).await;
}

#[tokio::test]
async fn peek_and_reset_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    peek_and_reset(self::cluster(cluster.urls())).await;
}

#[tokio::test]
async fn a_concurrency_limit_is_peeked_but_not_reset() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::concurrency("in-flight", 3).unwrap(),
            ClientIp::peer(),
        )
        .build()
        .unwrap();
    assert_eq!(
        layer.peek("in-flight", "10.0.0.1").await.unwrap().remaining,
        3
    );
    match layer.reset("in-flight", "10.0.0.1").await {
        Err(AdminError::Backend(e)) => assert_eq!(e.kind(), BackendErrorKind::Unsupported),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn the_decision_of_an_allowlisted_request_says_so_for_every_limit() {
    let layer = RateLimitLayer::builder()
        .limits(per_ip_limits())
        .limit(
            Limit::fixed_window("per-shop", Quota::per_day(1).unwrap()).unwrap(),
            Tenant::header("x-shop-domain"),
        )
        .allowlist(allowlist())
        .build()
        .unwrap();
    let response = app(&layer)
        .oneshot(from("10.9.9.9", None, None))
        .await
        .unwrap();
    let d = response.extensions().get::<Decision>().cloned().unwrap();
    let labels: Vec<_> = d
        .limits()
        .iter()
        .map(|l| (l.name().to_owned(), l.label()))
        .collect();
    assert_eq!(
        labels,
        [
            ("per-ip".to_owned(), "allowlisted"),
            ("per-shop".to_owned(), "allowlisted")
        ]
    );
    assert!(d
        .limits()
        .iter()
        .all(|l| *l.outcome() == Outcome::Allowlisted));
    assert!(d.is_admitted() && d.is_allowlisted());
}

/// A deny longer than `MAX_DENY` (100 years) is refused with an error that names the bound,
/// and nothing is denied; one of exactly `MAX_DENY` is taken. The memory backend refuses the
/// longer one too.
#[tokio::test]
async fn a_deny_past_its_bound_is_refused() {
    let layer = RateLimitLayer::builder()
        .limits(per_ip_limits())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let too_long = MAX_DENY + Duration::from_secs(1);
    let e = layer
        .deny("per-ip", "192.0.2.1", too_long)
        .await
        .unwrap_err();
    assert!(
        matches!(e, AdminError::DenyTooLong(d) if d == too_long),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "a deny lasts at most 3155760000 s (100 years, MAX_DENY), not 3155760001 s"
    );
    assert_eq!(
        send(&mut svc, from("192.0.2.1", None, None)).await.0,
        StatusCode::OK
    );
    let e = layer
        .backend()
        .deny_now(
            &tollgate::engine::Check::new(
                &Limit::gcra("x", Quota::per_minute(1).unwrap()).unwrap(),
                b"k",
            ),
            too_long,
        )
        .unwrap_err();
    assert_eq!(e.kind(), BackendErrorKind::Unsupported);

    layer.deny("per-ip", "192.0.2.1", MAX_DENY).await.unwrap();
    assert_eq!(
        send(&mut svc, from("192.0.2.1", None, None)).await.0,
        StatusCode::FORBIDDEN
    );
}

/// Sends a request of shop `x` and one of shop `y` at once (one merged call when they meet),
/// three times, and answers each one's statuses.
async fn at_once(svc: &Svc, x: &str, y: &str) -> [Vec<StatusCode>; 2] {
    let mut statuses = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        let (mut a, mut b) = (svc.clone(), svc.clone());
        let (ra, rb) = (
            from("192.0.2.1", Some(x), None),
            from("192.0.2.1", Some(y), None),
        );
        let (sa, sb) = tokio::join!(send(&mut a, ra), send(&mut b, rb));
        statuses[0].push(sa.0);
        statuses[1].push(sb.0);
    }
    statuses
}

/// On Redis, a deny of exactly `MAX_DENY` keeps its client refused (403) while another client
/// whose request travels in the same merged call is admitted and counted. A deny's end stored
/// further ahead than the bound (by a version that did not bound it: 10^17 µs) reads as the
/// bound: it refuses its client and fails no one else's request, until an undeny lifts it.
/// Both for a lone GCRA limit (the lean script) and for two limits (the general one).
#[tokio::test]
async fn a_deny_at_its_bound_on_redis_refuses_its_client_and_counts_the_others() {
    let server = RedisServer::start();
    let per_shop = || Limit::gcra("per-shop", Quota::per_minute(10).unwrap()).unwrap();
    let lone = Limits::new().limit(per_shop(), Tenant::header("x-shop-domain"));
    let stacked = Limits::new()
        .limit(per_shop(), Tenant::header("x-shop-domain"))
        .limit(
            Limit::gcra("all", Quota::per_minute(100).unwrap()).unwrap(),
            tollgate::key::Global,
        );
    for (prefix, limits) in [("lean", lone), ("general", stacked)] {
        let backend = RedisBackend::builder()
            .url(server.url())
            .prefix(prefix)
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder()
            .backend(backend.clone())
            .limits(limits)
            .build()
            .unwrap();
        let svc = app(&layer);
        // The backend itself refuses a second more, and writes nothing.
        let shop = per_shop();
        let e = tollgate::engine::Admin::deny(
            &backend,
            &tollgate::engine::Check::new(&shop, b"a.example"),
            MAX_DENY + Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), BackendErrorKind::Unsupported, "{prefix}");
        let pb = format!(
            "{}:pb",
            backend
                .key_for(&shop, b"a.example")
                .strip_suffix(":v3")
                .unwrap()
        );
        let exists: u64 = tollgate_testsupport::redis::cmd("EXISTS")
            .arg(&pb)
            .query(&mut server.client())
            .unwrap();
        assert_eq!(exists, 0, "{prefix}");
        layer.deny("per-shop", "a.example", MAX_DENY).await.unwrap();
        let statuses = at_once(&svc, "a.example", "b.example").await;
        assert_eq!(statuses[0], [StatusCode::FORBIDDEN; 3], "{prefix}");
        assert_eq!(statuses[1], [StatusCode::OK; 3], "{prefix}");
        let b = layer.peek("per-shop", "b.example").await.unwrap();
        assert_eq!(b.remaining, 7, "{prefix}");

        // An end of 10^17 µs stored for `c.example`, as an unbounded deny once wrote it (in the
        // value's older form, which still reads).
        let key = backend.key_for(&per_shop(), b"c.example");
        let base = key.strip_suffix(":v3").unwrap();
        let far = "100000000000000000";
        let mut conn = server.client();
        tollgate_testsupport::redis::cmd("SET")
            .arg(format!("{base}:pb"))
            .arg(format!("0:0:0:0:0:{far}"))
            .query::<()>(&mut conn)
            .unwrap();
        tollgate_testsupport::redis::cmd("SET")
            .arg(&key)
            .arg(format!("0:0:{far}"))
            .query::<()>(&mut conn)
            .unwrap();
        let statuses = at_once(&svc, "c.example", "b.example").await;
        assert_eq!(statuses[0], [StatusCode::FORBIDDEN; 3], "{prefix}");
        assert_eq!(statuses[1], [StatusCode::OK; 3], "{prefix}");
        let b = layer.peek("per-shop", "b.example").await.unwrap();
        assert_eq!(b.remaining, 4, "{prefix}");
        // Lifted, the client is counted again.
        layer.undeny("per-shop", "c.example").await.unwrap();
        let statuses = at_once(&svc, "c.example", "b.example").await;
        assert_eq!(statuses[0], [StatusCode::OK; 3], "{prefix}");
        assert_eq!(statuses[1], [StatusCode::OK; 3], "{prefix}");
        let c = layer.peek("per-shop", "c.example").await.unwrap();
        assert_eq!(c.remaining, 7, "{prefix}");
    }
}
