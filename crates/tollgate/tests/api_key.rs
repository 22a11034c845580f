//! Limits per API key through the layer: keys are case-sensitive, base64 keys are keys, a
//! missing key follows the limit's policy while an invalid one is a 400 that says why, and
//! no key ever shows (in a `Debug`, a refusal's body, or the report of refused clients).

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::engine::{FakeClock, MemoryBackend, MissingKeyPolicy};
use tollgate::key::{ApiKey, KeyExtractor, RequestView};
use tollgate::{Limit, Quota, RateLimitLayer};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// 2025-01-01T00:00:10Z.
const T0: u64 = 1_735_689_610_000_000;

/// A live key (32 bytes) and the same key with its letters in the other case.
const KEY: &str = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
const KEY_OTHER_CASE: &str = "SK_LIVE_4Ec39hQlYJwdARJTt1ZDP7DC";

fn layer(limit: Limit, key: ApiKey) -> RateLimitLayer<MemoryBackend<FakeClock>> {
    let clock = FakeClock::new(T0);
    RateLimitLayer::builder()
        .backend(MemoryBackend::builder().clock(clock.clone()).build())
        .fallback_clock(clock)
        .limit(limit, key)
        .build()
        .unwrap()
}

/// One request a minute per key.
fn per_key() -> Limit {
    Limit::gcra("per-key", Quota::per_minute(1).unwrap()).unwrap()
}

fn app(layer: &RateLimitLayer<MemoryBackend<FakeClock>>) -> Svc {
    let handler =
        service_fn(|_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) });
    tower::util::BoxCloneService::new(
        layer
            .clone()
            .layer(handler)
            .map_response(|r| r.map(Body::new)),
    )
}

/// Sends a request with `header: value` (none when `value` is `None`); the status and body.
async fn send(svc: &mut Svc, header: &str, value: Option<&str>) -> (StatusCode, String) {
    let mut req = Request::get("/");
    if let Some(value) = value {
        req = req.header(header, value);
    }
    let response = svc
        .ready()
        .await
        .unwrap()
        .call(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn status(svc: &mut Svc, value: &str) -> StatusCode {
    send(svc, "x-api-key", Some(value)).await.0
}

/// `sk_live_…` and `SK_LIVE_…` are two keys with a request a minute each: both first
/// requests are admitted, both second ones refused. (A tenant key would lowercase them into
/// one bucket and admit exactly one of the four.)
#[tokio::test]
async fn keys_that_differ_only_in_case_are_counted_apart() {
    let layer = layer(per_key(), ApiKey::header("x-api-key"));
    let mut svc = app(&layer);
    assert_eq!(status(&mut svc, KEY).await, StatusCode::OK);
    assert_eq!(status(&mut svc, KEY_OTHER_CASE).await, StatusCode::OK);
    assert_eq!(status(&mut svc, KEY).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        status(&mut svc, KEY_OTHER_CASE).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Base64 (`+/=`) and base64url (`-_`) keys of a valid length are keys, each its own bucket.
#[tokio::test]
async fn base64_keys_are_admitted() {
    let layer = layer(per_key(), ApiKey::header("x-api-key"));
    let mut svc = app(&layer);
    for key in [
        "abc+/defGHIJklmnopQR==",
        "abc-_defGHIJklmnopQR8=",
        "0123456789abcdef",
    ] {
        assert_eq!(status(&mut svc, key).await, StatusCode::OK, "{key}");
        assert_eq!(
            status(&mut svc, key).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{key}"
        );
    }
}

/// A missing key follows the limit's policy (400 by default, the limit skipped with
/// `Skip`); an invalid key is a 400 whatever the policy, whose body names the header and what
/// is wrong, and never the key.
#[tokio::test]
async fn missing_and_invalid_keys_are_told_apart() {
    let layer_ = layer(per_key(), ApiKey::header("x-api-key"));
    let mut svc = app(&layer_);
    let (code, body) = send(&mut svc, "x-api-key", None).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    assert!(
        body.contains(r#""detail":"missing header \"x-api-key\""#),
        "{body}"
    );

    let skip = per_key().on_missing_key(MissingKeyPolicy::Skip);
    let layer_ = layer(skip, ApiKey::header("x-api-key"));
    let mut svc = app(&layer_);
    for _ in 0..3 {
        assert_eq!(send(&mut svc, "x-api-key", None).await.0, StatusCode::OK);
    }
    let too_long = format!("{KEY}{}", "x".repeat(300));
    let cases = [
        (
            "sk_live_4eC39Hq:yjWDarjtT1zdp7dc",
            r#"header \"x-api-key\" has a character outside the key alphabet"#,
        ),
        ("sk_live_4eC39Hq", r#"header \"x-api-key\" too short"#),
        (too_long.as_str(), r#"header \"x-api-key\" too long"#),
        ("  ", r#"invalid header \"x-api-key\""#),
    ];
    for (key, why) in cases {
        let (code, body) = send(&mut svc, "x-api-key", Some(key)).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{key}");
        assert!(body.contains(why), "{body}");
        let trimmed = key.trim();
        assert!(trimmed.is_empty() || !body.contains(trimmed), "{body}");
        assert!(!body.contains("sk_live_4eC39Hq"), "{body}");
    }
}

/// Neither the extractor's nor a key's `Debug` holds the key; a report of refused keys
/// names it by its fingerprint.
#[tokio::test]
async fn a_key_is_never_shown() {
    let ex = ApiKey::header("x-api-key");
    let req = Request::get("/").header("x-api-key", KEY).body(()).unwrap();
    let key = ex.extract(&RequestView::new(&req)).unwrap();
    for debug in [
        format!("{ex:?}"),
        format!("{key:?}"),
        format!("{:?}", ex.clone()),
    ] {
        assert!(!debug.contains("4eC39"), "{debug}");
        assert!(!debug.contains("p7dc"), "{debug}");
    }
    assert_eq!(format!("{key:?}"), "Key(32 bytes)");

    let layer = layer(per_key(), ex);
    let mut svc = app(&layer);
    for _ in 0..3 {
        status(&mut svc, KEY).await;
    }
    let top = layer.top_refused("per-key", 10).await.unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!(top[0].identity, "sk_live_…p7dc");
    assert_eq!(top[0].count, 2);
    assert!(!format!("{top:?}").contains("4eC39"));
}

/// `Authorization: Bearer <token>`: two tokens are two buckets, the scheme in any case;
/// another scheme is a missing key, a bearer without a token an invalid one.
#[tokio::test]
async fn bearer_tokens_are_keys() {
    let layer = layer(per_key(), ApiKey::bearer());
    let mut svc = app(&layer);
    let bearer = |token: &str| format!("Bearer {token}");
    let auth = "authorization";
    let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl";
    assert_eq!(
        send(&mut svc, auth, Some(&bearer(KEY))).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut svc, auth, Some(&bearer(jwt))).await.0,
        StatusCode::OK
    );
    let lower = format!("bearer {KEY}");
    assert_eq!(
        send(&mut svc, auth, Some(&lower)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&mut svc, auth, Some(&bearer(jwt))).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let (code, body) = send(&mut svc, auth, Some("Basic dXNlcjpwYXNzd29yZA==")).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    assert!(body.contains("missing bearer token"), "{body}");
    let (code, body) = send(&mut svc, auth, Some("Bearer")).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    assert!(body.contains("invalid bearer token"), "{body}");
}

/// A limits file keys on an API key (`key = { api_key = "x-api-key" }`, bounds with
/// `min_len`/`max_len`) or a bearer token (`key = "bearer"`), as `ApiKey` does.
#[tokio::test]
async fn a_limits_file_keys_on_an_api_key_or_a_bearer_token() {
    let file = |key: &str| {
        format!(
            "[[limit]]\nname = \"per-key\"\nalgorithm = \"gcra\"\nquota = 1\nperiod = \"1m\"\nkey = {key}\n"
        )
    };
    let from_file = |key: &str| {
        let limits = tollgate::LimitsFile::new().parse(&file(key)).unwrap();
        let layer = RateLimitLayer::builder()
            .backend(MemoryBackend::builder().clock(FakeClock::new(T0)).build())
            .limits(limits)
            .build()
            .unwrap();
        app(&layer)
    };
    let mut svc = from_file(r#"{ api_key = "x-api-key", min_len = 8, max_len = 40 }"#);
    assert_eq!(status(&mut svc, KEY).await, StatusCode::OK);
    assert_eq!(status(&mut svc, KEY_OTHER_CASE).await, StatusCode::OK);
    assert_eq!(status(&mut svc, KEY).await, StatusCode::TOO_MANY_REQUESTS);
    // 8 bytes is the file's minimum (the extractor's default is 16): a key; 7 is too short.
    assert_eq!(status(&mut svc, "abcd+/==").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "abcd+/=").await, StatusCode::BAD_REQUEST);

    let mut svc = from_file(r#""bearer""#);
    let bearer = format!("Bearer {KEY}");
    assert_eq!(
        send(&mut svc, "authorization", Some(&bearer)).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut svc, "authorization", Some(&bearer)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    let bad = tollgate::LimitsFile::new()
        .parse(&file(r#"{ api_key = "x-api-key", min_len = 0 }"#))
        .unwrap_err()
        .to_string();
    assert!(bad.contains("line 6"), "{bad}");
}
