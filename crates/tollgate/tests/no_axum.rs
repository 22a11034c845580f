//! The layer in front of a plain tower service, with no framework: run it as
//! `cargo test -p tollgate --no-default-features --test no_axum` to prove that the layer needs
//! no axum (CI does).

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Full};
use tollgate::key::ClientIp;
use tollgate::{Decision, FakeClock, Limit, MemoryBackend, Quota, RateLimitLayer, ResponseBody};
use tower::{service_fn, Layer, ServiceExt};

fn layer(per_minute: u32) -> RateLimitLayer<MemoryBackend<FakeClock>> {
    let clock = FakeClock::new(1_700_000_000_000_000);
    RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(per_minute).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .backend(MemoryBackend::builder().clock(clock).build())
        .build()
        .unwrap()
}

/// A request from `peer`, as a server that records the peer as a plain `SocketAddr` sends it.
fn from(peer: [u8; 4], content_type: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/").body(Full::new(Bytes::new())).unwrap();
    if let Some(ct) = content_type {
        req.headers_mut()
            .insert("content-type", ct.parse().unwrap());
    }
    req.extensions_mut()
        .insert(SocketAddr::from((peer, 40_000)));
    req
}

async fn text(body: ResponseBody<Full<Bytes>>) -> String {
    String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test]
async fn a_plain_service_is_limited_and_reads_the_decision() {
    let svc = layer(2).layer(service_fn(|req: Request<Full<Bytes>>| async move {
        let remaining = req
            .extensions()
            .get::<Decision>()
            .and_then(Decision::remaining);
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
            "{remaining:?}"
        )))))
    }));

    let mut answers = Vec::new();
    for _ in 0..3 {
        let res = svc
            .clone()
            .oneshot(from([192, 0, 2, 1], None))
            .await
            .unwrap();
        let (parts, body) = res.into_parts();
        answers.push((
            parts.status,
            body.is_refusal(),
            parts.headers,
            text(body).await,
        ));
    }
    let codes: Vec<u16> = answers.iter().map(|a| a.0.as_u16()).collect();
    assert_eq!(codes, [200, 200, 429]);
    assert_eq!(answers[0].3, "Some(1)");
    assert_eq!(answers[1].3, "Some(0)");
    assert!(!answers[0].1);
    // The refusal is the layer's own body, problem+json, with Retry-After and the fields.
    let (_, refusal, headers, body) = &answers[2];
    assert!(refusal);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(headers["ratelimit"], "\"per-ip\";r=0;t=30");
    assert!(body.contains("\"status\":429"), "{body}");

    // Another peer has its own bucket.
    let res = svc.oneshot(from([192, 0, 2, 2], None)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_grpc_call_is_refused_with_a_status_that_ends_the_stream() {
    let svc = layer(1).layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"\0\0\0\0\0"))))
    }));
    let grpc = Some("application/grpc");
    let ok = svc
        .clone()
        .oneshot(from([192, 0, 2, 1], grpc))
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(!ok.body().is_refusal());

    let refused = svc.oneshot(from([192, 0, 2, 1], grpc)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK);
    let headers = refused.headers();
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(
        headers["grpc-message"],
        "rate limit \"per-ip\" exceeded; retry in 60 s"
    );
    assert_eq!(headers["retry-after"], "60");
    assert_eq!(headers["ratelimit-policy"], "\"per-ip\";q=1;w=60");
    assert_eq!(headers["ratelimit"], "\"per-ip\";r=0;t=60");
    // Trailers-only: no body at all, and the body says so before it is polled.
    assert!(refused.body().is_refusal());
    assert!(refused.body().is_end_stream());
    assert_eq!(
        refused
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .len(),
        0
    );
}

#[tokio::test]
async fn without_a_peer_address_the_missing_key_policy_applies() {
    let svc = layer(5).layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let res = svc
        .clone()
        .oneshot(Request::new(Full::new(Bytes::new())))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let mut grpc = Request::new(Full::new(Bytes::new()));
    grpc.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let res = svc.oneshot(grpc).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "3");
}
