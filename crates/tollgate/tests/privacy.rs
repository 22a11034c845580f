//! No identity's text reaches Redis unless the layer was told it may: after refusals, denies
//! and reports on limits keyed by API key, tenant and client address, every key and every
//! value and member in a real redis-server is free of them, and the report of refused clients
//! (what `tollgate top` prints) shows fingerprints only.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use tollgate::engine::{Backend, Clock, FakeClock};
use tollgate::key::{fingerprint, ApiKey, ClientIp, Identity, KeyExtractor, Tenant};
use tollgate::{Limit, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::redis::{self, Value};
use tollgate_testsupport::RedisServer;
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// 2025-01-01T00:00:10Z: ten seconds into a report bucket.
const T0: u64 = 1_735_689_610_000_000;

/// Three clients: an API key, a tenant, an address each.
const CLIENTS: [(&str, &str, &str); 3] = [
    (
        "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
        "Acme-Shop",
        "203.0.113.7",
    ),
    (
        "sk_live_9xQ2mNbV7cZ1kLpR3sT5wYu8",
        "globex.example",
        "198.51.100.23",
    ),
    ("q83vEjRWeJq83vEjRWeJ+/8xYz==", "initech", "192.0.2.200"),
];

fn per_minute(name: &str) -> Limit {
    Limit::gcra(name, Quota::per_minute(1).unwrap()).unwrap()
}

fn request(api_key: &str, shop: &str, ip: &str) -> Request<Body> {
    let mut req = Request::get("/")
        .header("x-api-key", api_key)
        .header("x-shop", shop)
        .body(Body::empty())
        .unwrap();
    let ip: IpAddr = ip.parse().unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(ip, 4000)));
    req
}

/// Every key in the server, with the text of its value: a string's bytes, a hash's fields
/// and values, a set's or a list's members, a sorted set's members and scores.
fn dump(server: &RedisServer) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut con = server.client();
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query(&mut con)
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query(&mut con).unwrap();
        let value: Value = match kind.as_str() {
            "string" => redis::cmd("GET").arg(&key).query(&mut con).unwrap(),
            "hash" => redis::cmd("HGETALL").arg(&key).query(&mut con).unwrap(),
            "set" => redis::cmd("SMEMBERS").arg(&key).query(&mut con).unwrap(),
            "zset" => redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query(&mut con)
                .unwrap(),
            "list" => redis::cmd("LRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .query(&mut con)
                .unwrap(),
            other => panic!("a key of type {other} that this dump cannot read"),
        };
        let mut text = Vec::new();
        flatten(&value, &mut text);
        out.push((key, text));
    }
    out
}

fn flatten(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::BulkString(bytes) => out.extend_from_slice(bytes),
        Value::SimpleString(s) => out.extend_from_slice(s.as_bytes()),
        Value::Int(n) => out.extend_from_slice(n.to_string().as_bytes()),
        Value::Double(d) => out.extend_from_slice(d.to_string().as_bytes()),
        Value::Array(items) | Value::Set(items) => {
            for item in items {
                flatten(item, out);
                out.push(b'\n');
            }
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                flatten(k, out);
                out.push(b'\n');
                flatten(v, out);
                out.push(b'\n');
            }
        }
        Value::Nil | Value::Okay => {}
        other => panic!("a reply this dump cannot read: {other:?}"),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test]
async fn no_identity_reaches_redis_and_reports_show_fingerprints() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let backend = RedisBackend::builder()
        .url(server.url())
        .prefix("privacy")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let (by_key, by_shop, by_ip) = (
        ApiKey::header("x-api-key"),
        Tenant::header("x-shop"),
        ClientIp::peer(),
    );
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .fallback_clock(clock.clone())
        .limit(per_minute("per-key"), by_key.clone())
        .limit(per_minute("per-shop"), by_shop.clone())
        .limit(per_minute("per-ip"), by_ip.clone())
        .build()
        .unwrap();
    let handler =
        service_fn(|_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) });
    let mut svc: Svc = tower::util::BoxCloneService::new(
        layer
            .clone()
            .layer(handler)
            .map_response(|r| r.map(Body::new)),
    );
    // Each client: one admitted, then refused by all three limits, twice.
    let mut codes = Vec::new();
    for _ in 0..3 {
        for (key, shop, ip) in CLIENTS {
            let res = svc.ready().await.unwrap().call(request(key, shop, ip));
            codes.push(res.await.unwrap().status().as_u16());
        }
    }
    assert_eq!(codes, [200, 200, 200, 429, 429, 429, 429, 429, 429]);
    // An operator denies and peeks by identity: their state lives under digests too.
    let (key, shop, ip) = CLIENTS[0];
    layer
        .deny("per-key", key, Duration::from_secs(60))
        .await
        .unwrap();
    layer
        .deny("per-shop", shop, Duration::from_secs(60))
        .await
        .unwrap();
    layer
        .deny("per-ip", ip, Duration::from_secs(60))
        .await
        .unwrap();
    layer.peek("per-key", key).await.unwrap();

    // The reports, as each replica and `tollgate top` read them: fingerprints only.
    let mut shown = Vec::new();
    for (limit, ex) in [
        ("per-key", &by_key as &dyn KeyExtractor),
        ("per-shop", &by_shop),
        ("per-ip", &by_ip),
    ] {
        let mut top = layer.top_refused(limit, 10).await.unwrap();
        let mut in_redis = layer
            .backend()
            .reports()
            .unwrap()
            .top(limit, 10, clock.now())
            .await
            .unwrap();
        // Equal counts come in either order.
        top.sort_by(|a, b| a.identity.cmp(&b.identity));
        in_redis.sort_by(|a, b| a.identity.cmp(&b.identity));
        assert_eq!(in_redis, top, "{limit}");
        let mut want: Vec<String> = CLIENTS
            .iter()
            .map(|&(key, shop, ip)| {
                let identity = match limit {
                    "per-key" => key,
                    "per-shop" => shop,
                    _ => ip,
                };
                let k = ex.key_of(&Identity::from(identity)).unwrap();
                ex.identity_of(k.as_bytes())
            })
            .collect();
        let mut got: Vec<String> = top.iter().map(|r| r.identity.clone()).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want, "{limit}");
        assert!(top.iter().all(|r| r.count == 2), "{top:?}");
        shown.extend(got);
    }
    let shop_key = by_shop.key_of(&Identity::from("Acme-Shop")).unwrap();
    assert!(shown.contains(&"sk_live_…p7dc".to_owned()));
    assert!(shown.contains(&"…Yz==".to_owned()));
    assert!(shown.contains(&fingerprint(shop_key.as_bytes())));

    // Nothing in Redis holds a key's text, in a key's name, a value or a member.
    let dump = dump(&server);
    assert!(dump.len() >= 10, "{} keys", dump.len());
    let mut secrets: Vec<Vec<u8>> = Vec::new();
    for (key, shop, ip) in CLIENTS {
        secrets.push(key.as_bytes().to_vec());
        // Any 12 characters of a key's secret part.
        secrets.push(key.as_bytes()[8..20].to_vec());
        secrets.push(shop.as_bytes().to_vec());
        secrets.push(shop.to_ascii_lowercase().into_bytes());
        secrets.push(ip.as_bytes().to_vec());
        let ip_key = by_ip.key_of(&Identity::from(ip)).unwrap();
        secrets.push(ip_key.as_bytes().to_vec());
    }
    for (name, value) in &dump {
        for secret in &secrets {
            let shown = String::from_utf8_lossy(secret);
            assert!(!contains(name, secret), "{shown} in a key's name");
            assert!(
                !contains(value, secret),
                "{shown} in the value of {}",
                String::from_utf8_lossy(name)
            );
        }
    }
    // The reports are there, under their fingerprints.
    let reports: Vec<_> = dump
        .iter()
        .filter(|(name, _)| name.starts_with(b"privacy:top:"))
        .collect();
    assert_eq!(reports.len(), 6, "a count and a seen hash per limit");
    assert!(reports
        .iter()
        .any(|(_, value)| contains(value, "sk_live_…p7dc".as_bytes())));
}

/// Told to, a limit's reports name its clients as they are: here a tenant's name and an
/// address reach Redis, an API key still does not.
#[tokio::test]
async fn revealed_identities_are_shown_and_keys_never_are() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let backend = RedisBackend::builder()
        .url(server.url())
        .prefix("shown")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .fallback_clock(clock.clone())
        .limit(per_minute("per-key"), ApiKey::header("x-api-key"))
        .limit(
            per_minute("per-shop"),
            Tenant::header("x-shop").reveal_identities(),
        )
        .limit(per_minute("per-ip"), ClientIp::peer().reveal_identities())
        .build()
        .unwrap();
    let handler =
        service_fn(|_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) });
    let mut svc = layer.clone().layer(handler);
    let (key, shop, ip) = CLIENTS[0];
    for want in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let res = svc.ready().await.unwrap().call(request(key, shop, ip));
        assert_eq!(res.await.unwrap().status(), want);
    }
    let identity = |limit: &'static str| {
        let layer = layer.clone();
        async move {
            layer.top_refused(limit, 1).await.unwrap()[0]
                .identity
                .clone()
        }
    };
    assert_eq!(identity("per-key").await, "sk_live_…p7dc");
    assert_eq!(identity("per-shop").await, "acme-shop");
    assert_eq!(identity("per-ip").await, "203.0.113.7");
    let dump = dump(&server);
    assert!(dump.iter().any(|(_, v)| contains(v, b"acme-shop")));
    assert!(dump.iter().all(|(n, v)| !contains(n, key.as_bytes())
        && !contains(v, key.as_bytes())
        && !contains(v, &key.as_bytes()[8..20])));
}
