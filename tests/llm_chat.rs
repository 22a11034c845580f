//! examples/llm_chat.rs's router on a real Redis: what its bodies cost. A body that is not
//! JSON (400) or JSON without a string `message` (422) consumes nothing, from the requests a
//! minute or from the token budget; the shop's count and budget are whole after them.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
#[path = "../examples/llm_chat.rs"]
mod llm_chat;

use std::num::NonZeroU32;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use tollgate::RateLimitLayer;
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::ServiceExt;

const SHOP: &str = "demo.myshopify.com";

fn settings(url: &str, tokens_per_hour: u32) -> llm_chat::Settings {
    llm_chat::Settings {
        redis: llm_chat::Redis::Url(url.to_owned()),
        ca: None,
        tokens_per_hour,
        replicas: NonZeroU32::new(2).unwrap(),
        in_flight: 4,
        port: 0,
    }
}

/// The example's limits and router, on a backend whose deadline a loaded machine meets (a
/// check that times out fails open and would spoil an exact count).
fn replica(server: &RedisServer, tokens_per_hour: u32) -> (RateLimitLayer<RedisBackend>, Router) {
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let limits = llm_chat::limits(backend, &settings(&server.url(), tokens_per_hour)).unwrap();
    (limits.clone(), llm_chat::chat_routes(limits))
}

/// POSTs `body` (none when `None`) for the shop; the status and the reply's body.
async fn post(app: &Router, body: Option<&str>) -> (StatusCode, String) {
    let req = Request::post("/api/chat").header("x-shop-domain", SHOP);
    let req = match body {
        Some(b) => req
            .header("content-length", b.len())
            .body(Body::from(b.to_owned())),
        None => req.body(Body::empty()),
    }
    .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// Bodies the handler refuses, with the status each gets.
fn refused_bodies(pad: usize) -> Vec<(String, StatusCode)> {
    let a = "a".repeat(pad);
    vec![
        (format!("not json {a}"), StatusCode::BAD_REQUEST),
        (
            format!("{{\"x\":\"{a}\"}}"),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        ("{\"x\":1}".to_owned(), StatusCode::UNPROCESSABLE_ENTITY),
        ("[1]".to_owned(), StatusCode::UNPROCESSABLE_ENTITY),
        ("\"hi\"".to_owned(), StatusCode::UNPROCESSABLE_ENTITY),
        (
            format!("{{\"message\":5,\"x\":\"{a}\"}}"),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            format!("{{\"message\":\"{a}\",\"delay_ms\":-1}}"),
            StatusCode::BAD_REQUEST,
        ),
    ]
}

/// What a limit has left for the shop, once the refunds sent after the responses landed
/// (they are sent without waiting; the count stops at the first answer equal to `want`).
async fn remaining(limits: &RateLimitLayer<RedisBackend>, limit: &str, want: u64) -> u64 {
    let mut seen = 0;
    for _ in 0..500 {
        seen = limits.peek(limit, SHOP).await.unwrap().remaining;
        if seen == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen
}

#[tokio::test]
async fn refused_bodies_consume_no_request_and_no_token() {
    let server = RedisServer::start();
    let (limits, app) = replica(&server, 1_000);
    // Twice each: 14 refusals, each having reserved up to ~310 tokens and one request.
    for _ in 0..2 {
        for (body, want) in refused_bodies(300) {
            let (status, reply) = post(&app, Some(&body)).await;
            assert_eq!(status, want, "{body} -> {reply}");
            assert!(reply.starts_with("{\"error\":"), "{reply}");
        }
    }
    assert_eq!(remaining(&limits, "chat-per-shop", 30).await, 30);
    assert_eq!(remaining(&limits, "tokens-per-shop", 1_000).await, 1_000);
    // The whole budget is there: a message of exactly 1,000 tokens (its estimate, the
    // content-length, capped at the budget) is admitted and takes all of it.
    let big = format!("{{\"message\":\"{}\"}}", "b".repeat(1_000));
    let (status, reply) = post(&app, Some(&big)).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(
        reply.contains("\"remaining\":29,\"tokens\":1000"),
        "{reply}"
    );
    assert_eq!(remaining(&limits, "tokens-per-shop", 0).await, 0);
    let (status, _) = post(&app, Some("{\"message\":\"\"}")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn after_refused_bodies_a_shop_still_gets_exactly_30_requests() {
    let server = RedisServer::start();
    let (limits, app) = replica(&server, 20_000);
    for (body, want) in refused_bodies(10) {
        assert_eq!(post(&app, Some(&body)).await.0, want, "{body}");
    }
    assert_eq!(remaining(&limits, "chat-per-shop", 30).await, 30);
    let mut codes = Vec::new();
    for i in 0..35 {
        let (status, reply) = post(&app, None).await;
        if i == 0 {
            // This request's own unit is taken: 29 left.
            assert!(reply.contains("\"remaining\":29,"), "{reply}");
        }
        codes.push(status.as_u16());
    }
    assert_eq!(codes.iter().filter(|c| **c == 200).count(), 30, "{codes:?}");
    assert_eq!(codes[..30], [200; 30]);
    assert_eq!(codes[30..], [429; 5]);
}

#[tokio::test]
async fn a_message_uses_its_bytes_and_a_bodyless_request_none() {
    let server = RedisServer::start();
    let (limits, app) = replica(&server, 1_000);
    let (status, reply) = post(&app, Some("{\"message\":\"héllo\",\"delay_ms\":0}")).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply.ends_with("\"tokens\":6}"), "{reply}");
    assert_eq!(remaining(&limits, "tokens-per-shop", 994).await, 994);
    let (status, reply) = post(&app, None).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply.ends_with("\"tokens\":0}"), "{reply}");
    assert_eq!(remaining(&limits, "tokens-per-shop", 994).await, 994);
}
