//! Static deny lists: a denylisted request is refused with 403 (gRPC `PERMISSION_DENIED`)
//! before any backend call, consumes nothing, and loses to the allowlist; a reload and a
//! limits file change the list.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use support::clients::{app, from, Svc};
use support::{Flaky, Recorder};
use tollgate::key::{ClientIp, Tenant, TrustedProxies};
use tollgate::{
    Allowlist, Decision, Denylist, Limit, Limits, LimitsFile, MissingKeyPolicy, Outcome, Quota,
    RateLimitLayer,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::{Service, ServiceExt};

/// What a response says: its status, its body, and its headers and Decision.
struct Answer {
    status: StatusCode,
    body: String,
    headers: http::HeaderMap,
    decision: Option<Decision>,
}

async fn send(svc: &mut Svc, req: Request<Body>) -> Answer {
    let response = svc.ready().await.unwrap().call(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, 4096).await.unwrap();
    Answer {
        status: parts.status,
        body: String::from_utf8(body.to_vec()).unwrap(),
        decision: parts.extensions.get::<Decision>().cloned(),
        headers: parts.headers,
    }
}

const DENIED_BODY: &str = r#"{"type":"about:blank","title":"Forbidden","status":403,"detail":"The request is refused by a deny list."}"#;

/// Asserts that `a` is the default refusal of a denylisted request under the limits `names`.
fn assert_denied(a: &Answer, names: &[&str]) {
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.body);
    assert_eq!(a.body, DENIED_BODY);
    assert_eq!(a.headers["content-type"], "application/problem+json");
    // A static deny has no end, and says nothing of a quota.
    for field in ["retry-after", "ratelimit", "ratelimit-policy"] {
        assert!(!a.headers.contains_key(field), "{field}");
    }
    let d = a.decision.as_ref().unwrap();
    assert!(d.is_denylisted() && !d.is_admitted() && !d.is_allowlisted());
    assert_eq!(d.retry_after(), None);
    let parts: Vec<(&str, &str)> = d.limits().iter().map(|l| (l.name(), l.label())).collect();
    let want: Vec<(&str, &str)> = names.iter().map(|n| (*n, "denylisted")).collect();
    assert_eq!(parts, want);
    assert!(d
        .limits()
        .iter()
        .all(|l| *l.outcome() == Outcome::Denylisted { retry_after: None }));
}

fn per_ip(per_minute: u32) -> Limit {
    Limit::gcra("per-ip", Quota::per_minute(per_minute).unwrap()).unwrap()
}

fn per_shop(per_minute: u32) -> Limit {
    Limit::gcra("per-shop", Quota::per_minute(per_minute).unwrap()).unwrap()
}

fn deny_networks() -> Denylist {
    Denylist::new().networks(
        ClientIp::peer(),
        [
            "198.51.100.0/24".parse().unwrap(),
            "2001:db8:bad:1::/64".parse().unwrap(),
        ],
    )
}

/// Denylisted addresses (IPv4 and an IPv6 /64) are refused with 403 every time and never
/// counted: their keys keep the whole quota. Their neighbours are counted.
#[tokio::test]
async fn a_denylisted_address_gets_403_and_its_key_is_never_counted() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(3), ClientIp::peer())
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let denied = [
        "198.51.100.7",
        "2001:db8:bad:1::99",
        "2001:db8:bad:1:ffff::1",
    ];
    for _ in 0..10 {
        for ip in denied {
            assert_denied(&send(&mut svc, from(ip, None, None)).await, &["per-ip"]);
        }
    }
    for ip in denied {
        assert_eq!(layer.peek("per-ip", ip).await.unwrap().remaining, 3, "{ip}");
    }
    assert_eq!(layer.backend().stats().tracked_keys, 0);
    // The next /24 and the next /64 are counted: exactly 3 of 5 admitted each.
    for ip in ["198.51.101.7", "2001:db8:bad:2::99"] {
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(send(&mut svc, from(ip, None, None)).await.status);
        }
        let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
        let refused = statuses
            .iter()
            .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
            .count();
        assert_eq!((admitted, refused), (3, 2), "{ip}");
        assert_eq!(layer.peek("per-ip", ip).await.unwrap().remaining, 0, "{ip}");
    }
}

/// Not even asked: a counting backend sees no call for 20 denylisted requests.
#[tokio::test]
async fn a_denylisted_request_makes_no_backend_call() {
    let backend = Flaky::new();
    let layer = RateLimitLayer::builder()
        .backend(backend.clone())
        .limit(per_ip(3), ClientIp::peer())
        .limit(per_shop(3), Tenant::header("x-shop-domain"))
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for _ in 0..20 {
        let a = send(&mut svc, from("198.51.100.7", Some("a.example"), None)).await;
        assert_denied(&a, &["per-ip", "per-shop"]);
    }
    assert_eq!(backend.calls(), 0);
    let a = send(&mut svc, from("192.0.2.1", Some("a.example"), None)).await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "counted"));
    assert_eq!(backend.calls(), 1);
}

/// On Redis too, nothing is written for a denylisted request.
#[tokio::test]
async fn a_denylisted_request_writes_nothing_to_redis() {
    let server = RedisServer::start();
    let backend = RedisBackend::builder()
        .url(server.url())
        .prefix("deny")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .limit(per_ip(3), ClientIp::peer())
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for _ in 0..10 {
        assert_denied(
            &send(&mut svc, from("198.51.100.7", None, None)).await,
            &["per-ip"],
        );
    }
    assert_eq!(server.dbsize(), 0);
    assert_eq!(
        layer
            .peek("per-ip", "198.51.100.7")
            .await
            .unwrap()
            .remaining,
        3
    );
    assert_eq!(
        send(&mut svc, from("192.0.2.1", None, None)).await.status,
        StatusCode::OK
    );
    assert_eq!(server.dbsize(), 1);
}

/// A tenant on the list is refused from any address, as its extractor normalises it; another
/// tenant from the same address is counted.
#[tokio::test]
async fn a_denylisted_tenant_is_refused_from_any_address() {
    let layer = RateLimitLayer::builder()
        .limit(per_shop(2), Tenant::header("x-shop-domain"))
        .denylist(
            Denylist::new()
                .keys(Tenant::header("x-shop-domain"), ["Spam.example"])
                .unwrap(),
        )
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for ip in ["192.0.2.1", "192.0.2.2", "2001:db8::1"] {
        let a = send(&mut svc, from(ip, Some("spam.EXAMPLE"), None)).await;
        assert_denied(&a, &["per-shop"]);
    }
    assert_eq!(
        layer
            .peek("per-shop", "spam.example")
            .await
            .unwrap()
            .remaining,
        2
    );
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            send(&mut svc, from("192.0.2.1", Some("shop.example"), None))
                .await
                .status,
        );
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

/// A request both allowlisted and denylisted is admitted as allowlisted, and not counted;
/// the rest of the denied network is refused.
#[tokio::test]
async fn the_allowlist_wins_over_the_denylist() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(1), ClientIp::peer())
        .allowlist(
            Allowlist::new().networks(ClientIp::peer(), ["198.51.100.8/29".parse().unwrap()]),
        )
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for _ in 0..5 {
        let a = send(&mut svc, from("198.51.100.9", None, None)).await;
        assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "allowlisted"));
        assert_denied(
            &send(&mut svc, from("198.51.100.7", None, None)).await,
            &["per-ip"],
        );
    }
    assert_eq!(layer.backend().stats().tracked_keys, 0);
}

/// A reload that adds an entry refuses its client from the next request on; one that removes
/// it counts the client again, from a whole quota.
#[tokio::test]
async fn a_reload_adds_then_removes_an_entry() {
    let limits = || Limits::new().limit(per_ip(2), ClientIp::peer());
    let layer = RateLimitLayer::builder().limits(limits()).build().unwrap();
    let mut svc = app(&layer);
    let ip = "198.51.100.7";
    assert_eq!(
        send(&mut svc, from(ip, None, None)).await.status,
        StatusCode::OK
    );
    assert_eq!(layer.peek("per-ip", ip).await.unwrap().remaining, 1);

    layer
        .reloader()
        .reload(limits().with_denylist(deny_networks()))
        .unwrap();
    for _ in 0..5 {
        assert_denied(&send(&mut svc, from(ip, None, None)).await, &["per-ip"]);
    }
    // Refused without being counted: still the one unit left.
    assert_eq!(layer.peek("per-ip", ip).await.unwrap().remaining, 1);

    layer.reloader().reload(limits()).unwrap();
    let statuses = [
        send(&mut svc, from(ip, None, None)).await.status,
        send(&mut svc, from(ip, None, None)).await.status,
    ];
    assert_eq!(statuses, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
}

/// A gRPC call from a denylisted client gets `PERMISSION_DENIED` (7), trailers-only, with no
/// retry delay.
#[tokio::test]
async fn a_denylisted_grpc_call_gets_permission_denied() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(5), ClientIp::peer())
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let mut req = from("2001:db8:bad:1::5", None, None);
    req.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let a = send(&mut svc, req).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers["content-type"], "application/grpc");
    assert_eq!(a.headers["grpc-status"], "7");
    assert_eq!(
        a.headers["grpc-message"],
        "the call is refused by a deny list"
    );
    assert!(a.body.is_empty());
    for field in [
        "retry-after",
        "grpc-status-details-bin",
        "ratelimit",
        "ratelimit-policy",
    ] {
        assert!(!a.headers.contains_key(field), "{field}");
    }
}

/// A custom responder sees the deny as `RejectionKind::Denylisted`, with no retry delay.
#[tokio::test]
async fn a_custom_responder_sees_the_deny() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(5), ClientIp::peer())
        .denylist(deny_networks())
        .on_rejection(|r| {
            let mut response = Response::new(Bytes::from(format!(
                "{:?} {} {:?} {}",
                r.kind(),
                r.status().as_u16(),
                r.retry_after(),
                r.grpc_code()
            )));
            *response.status_mut() = r.status();
            response
        })
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let a = send(&mut svc, from("198.51.100.1", None, None)).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert_eq!(a.body, "Denylisted 403 None 7");
    assert!(!a.headers.contains_key("retry-after"));
    assert_eq!(
        a.decision.map(|d| d.is_denylisted()),
        Some(true),
        "the refusal carries its decision"
    );
}

/// A deny is the operator's, not a limit's: a layer whose only limit is in shadow mode
/// refuses a denylisted request all the same.
#[tokio::test]
async fn a_deny_refuses_under_a_shadow_limit_too() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(1).shadow(), ClientIp::peer())
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let a = send(&mut svc, from("198.51.100.1", None, None)).await;
    assert_denied(&a, &["per-ip"]);
    assert!(a.decision.unwrap().limits()[0].is_shadow());
    // The shadow limit lets its over-limit requests through.
    for _ in 0..3 {
        assert_eq!(
            send(&mut svc, from("192.0.2.1", None, None)).await.status,
            StatusCode::OK
        );
    }
}

/// N denylisted requests under two limits: exactly N `denylisted` decisions per limit and
/// nothing else, and no address in any label.
#[tokio::test]
async fn denylisted_requests_are_counted_as_denylisted_and_nothing_else() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(per_ip(1), ClientIp::peer())
        .limit(per_shop(1), Tenant::header("x-shop-domain"))
        .denylist(deny_networks())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    const N: u64 = 7;
    for _ in 0..N {
        let a = send(&mut svc, from("198.51.100.77", Some("a.example"), None)).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN);
    }
    let snap = metrics.snapshot();
    assert_eq!(snap.decisions("per-ip", "denylisted"), N);
    assert_eq!(snap.decisions("per-shop", "denylisted"), N);
    assert_eq!(snap.total("tollgate_decisions_total"), 2 * N);
    assert_eq!(snap.total("tollgate_bypass_total"), 0);
    for value in snap.label_values() {
        assert!(
            !value.contains("198.51") && !value.contains("a.example"),
            "{value:?} carries an identity"
        );
    }
}

const LIMIT: &str = r#"
[[limit]]
name = "per-ip"
period = "1m"
key = "ip"
[limit.quota]
default = 2
"#;

/// `[[denylist]]` tables read as `[[allowlist]]` ones: networks for an ip key, values for
/// any key.
#[tokio::test]
async fn a_limits_file_denylist_refuses_its_entries() {
    let text = format!(
        r#"{LIMIT}
[[denylist]]
key = "ip"
networks = ["198.51.100.0/24", "2001:db8:bad:1::/64"]

[[denylist]]
key = {{ header = "x-shop-domain" }}
values = ["spam.example", "scam.example"]
"#
    );
    let limits = LimitsFile::new().parse(&text).unwrap();
    assert_eq!(
        limits.denylist().describe(),
        [
            "networks 198.51.100.0/24, 2001:db8:bad:1::/64",
            "keys spam.example, scam.example"
        ]
    );
    assert!(limits.allowlist().is_empty());
    let layer = RateLimitLayer::builder().limits(limits).build().unwrap();
    let mut svc = app(&layer);
    assert_denied(
        &send(&mut svc, from("2001:db8:bad:1::1", None, None)).await,
        &["per-ip"],
    );
    let a = send(&mut svc, from("192.0.2.1", Some("Scam.Example"), None)).await;
    assert_denied(&a, &["per-ip"]);
    let a = send(&mut svc, from("192.0.2.1", Some("shop.example"), None)).await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "counted"));

    // A file without `[[denylist]]` has none: reloaded, the tenant is counted.
    layer
        .reloader()
        .reload(LimitsFile::new().parse(LIMIT).unwrap())
        .unwrap();
    let a = send(&mut svc, from("192.0.2.1", Some("scam.example"), None)).await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "counted"));
}

#[test]
fn limits_file_denylists_name_their_mistakes() {
    // Each at the value that is wrong; a rule without what it refuses at its `[[denylist]]`.
    let cases = [
        (
            "[[denylist]]\nkey = \"ip\"\nnetworks = [\"198.51.100.1/24\"]\n",
            "line 3 column 13: denylist: invalid CIDR \"198.51.100.1/24\"",
        ),
        (
            "[[denylist]]\nkey = { header = \"x-shop\" }\nnetworks = [\"10.0.0.0/8\"]\n",
            "line 2 column 7: denylist `networks` need an ip key",
        ),
        (
            "[[denylist]]\nkey = { header = \"x-shop\" }\nvalues = [\"a.example\", \"bad shop!\"]\n",
            "line 3 column 24: denylist: denylist entry \"bad shop!\" is not a key that any \
             request could have",
        ),
        (
            "[[denylist]]\nkey = \"ip\"\n",
            "line 1 column 1: a denylist needs `networks` (for an ip key) or `values`",
        ),
        (
            "[[denylist]]\nkey = \"ip\"\nnetwork = [\"10.0.0.0/8\"]\n",
            "line 3 column 1: unknown field `network`",
        ),
    ];
    for (deny, want) in cases {
        let text = format!("{deny}\n{LIMIT}");
        let err = LimitsFile::new().parse(&text).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
    }
}

/// A request from `client` through the trusted proxy 10.0.0.1, whose `X-Forwarded-For` the
/// client padded with 5,000 bytes before the proxy appended the address it saw.
fn padded_through_proxy(client: &str) -> Request<Body> {
    let mut req = from("10.0.0.1", None, None);
    let header = format!("{}, {client}", "7".repeat(5_000));
    req.headers_mut()
        .insert("x-forwarded-for", header.parse().unwrap());
    req
}

fn behind_proxy() -> ClientIp {
    ClientIp::x_forwarded_for(TrustedProxies::parse(&["10.0.0.0/8"]).unwrap())
}

/// A client behind a trusted proxy cannot escape a denylist by sending a huge
/// `X-Forwarded-For`: the address the proxy appended is read, whatever the client wrote
/// before it.
#[tokio::test]
async fn an_oversized_forwarded_header_does_not_escape_the_denylist() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(3), behind_proxy())
        .denylist(Denylist::new().networks(behind_proxy(), ["198.51.100.0/24".parse().unwrap()]))
        .build()
        .unwrap();
    let mut svc = app(&layer);
    for _ in 0..5 {
        let a = send(&mut svc, padded_through_proxy("198.51.100.7")).await;
        assert_denied(&a, &["per-ip"]);
    }
    // Another client's padded requests are counted under its own address: 3 of 5 admitted.
    let mut admitted = 0;
    for _ in 0..5 {
        let a = send(&mut svc, padded_through_proxy("192.0.2.1")).await;
        admitted += usize::from(a.status == StatusCode::OK);
    }
    assert_eq!(admitted, 3);
    assert_eq!(
        layer.peek("per-ip", "192.0.2.1").await.unwrap().remaining,
        0
    );
}

/// Nor a limit that skips requests without a key: the padded requests are counted under the
/// client's address, exactly 3 of 5 admitted.
#[tokio::test]
async fn an_oversized_forwarded_header_does_not_skip_the_limit() {
    let layer = RateLimitLayer::builder()
        .limit(
            per_ip(3).on_missing_key(MissingKeyPolicy::Skip),
            behind_proxy(),
        )
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(
            send(&mut svc, padded_through_proxy("192.0.2.1"))
                .await
                .status,
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429].map(|s| StatusCode::from_u16(s).unwrap())
    );
}
