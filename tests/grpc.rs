//! A real tonic server behind the layer, called by a real tonic client on loopback (and once by
//! a bare HTTP/2 client, to see the frames). The limits count on an injected clock, so every
//! figure is exact however slow the machine is.

#![allow(clippy::unwrap_used)]

#[path = "../examples/grpc/service.rs"]
mod service;

use std::net::SocketAddr;
use std::time::Duration;

use service::{CountdownRequest, DemoClient, DemoServer, HelloRequest};
use tollgate::engine::Backend;
use tollgate::key::{ClientIp, Tenant};
use tollgate::{FakeClock, Limit, MemoryBackend, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::Code;
use tonic_types::StatusExt;

fn memory() -> MemoryBackend<FakeClock> {
    MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build()
}

/// Serves `DemoServer` behind `layer` on a free loopback port.
async fn serve<B>(layer: RateLimitLayer<B>) -> SocketAddr
where
    B: Backend + Send + Sync + 'static,
    B::Future: Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(DemoServer)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    addr
}

async fn client(addr: SocketAddr) -> DemoClient {
    let channel: Channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    DemoClient::new(channel)
}

fn hello(tenant: Option<&str>) -> tonic::Request<HelloRequest> {
    let mut request = tonic::Request::new(HelloRequest {
        name: "test".to_owned(),
    });
    if let Some(tenant) = tenant {
        request
            .metadata_mut()
            .insert("x-tenant", tenant.parse().unwrap());
    }
    request
}

fn per_ip(per_minute: u32) -> Limit {
    Limit::gcra("per-ip", Quota::per_minute(per_minute).unwrap()).unwrap()
}

/// `per_minute` calls per client address, in memory.
fn by_ip(per_minute: u32) -> RateLimitLayer<MemoryBackend<FakeClock>> {
    RateLimitLayer::builder()
        .limit(per_ip(per_minute), ClientIp::peer())
        .backend(memory())
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_sixth_call_of_five_a_minute_is_resource_exhausted_with_a_retry_delay() {
    let layer = by_ip(5);
    let mut client = client(serve(layer).await).await;

    for left in (0..5).rev() {
        let reply = client.hello(hello(None)).await.unwrap().into_inner();
        // The handler read the Decision from the request's extensions: keyed by the peer
        // address that tonic's `TcpConnectInfo` carries.
        assert_eq!(reply.remaining, left);
        assert_eq!(reply.decision, "per-ip=allowed");
    }
    let status = client.hello(hello(None)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        status.message(),
        "rate limit \"per-ip\" exceeded; retry in 12 s"
    );
    let retry = status.get_details_retry_info().unwrap();
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(12)));
    let metadata = status.metadata();
    assert_eq!(metadata.get("retry-after").unwrap(), "12");
    assert_eq!(
        metadata.get("ratelimit-policy").unwrap(),
        "\"per-ip\";q=5;w=60"
    );
    assert_eq!(metadata.get("ratelimit").unwrap(), "\"per-ip\";r=0;t=12");
}

#[tokio::test]
async fn a_fail_closed_limit_with_a_dead_redis_is_unavailable() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.stop();
    let backend = RedisBackend::builder()
        .url(url.as_str())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(per_ip(5).fail_closed(), ClientIp::peer())
        .backend(backend)
        .unavailable_retry_after(Duration::from_secs(3))
        .build()
        .unwrap();
    let mut client = client(serve(layer).await).await;

    let status = client.hello(hello(None)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status.message(),
        "rate limit \"per-ip\" cannot be checked right now"
    );
    assert_eq!(status.metadata().get("retry-after").unwrap(), "3");
    let retry = status.get_details_retry_info().unwrap();
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(3)));
}

#[tokio::test]
async fn a_tenant_comes_from_metadata() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-tenant", Quota::per_minute(2).unwrap()).unwrap(),
            Tenant::header("x-tenant"),
        )
        .backend(memory())
        .build()
        .unwrap();
    let mut client = client(serve(layer).await).await;

    let mut codes = Vec::new();
    for tenant in ["acme", "acme", "acme", "globex"] {
        codes.push(match client.hello(hello(Some(tenant))).await {
            Ok(_) => Code::Ok,
            Err(status) => status.code(),
        });
    }
    assert_eq!(
        codes,
        [Code::Ok, Code::Ok, Code::ResourceExhausted, Code::Ok]
    );
    // No tenant, and the limit rejects keyless calls: INVALID_ARGUMENT, not a transport error.
    let status = client.hello(hello(None)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "missing header \"x-tenant\" (rate limit \"per-tenant\")"
    );
}

#[tokio::test]
async fn a_server_stream_is_checked_once_and_never_cut() {
    let layer = by_ip(1);
    let mut client = client(serve(layer).await).await;

    let mut stream = client
        .countdown(tonic::Request::new(CountdownRequest { from: 200 }))
        .await
        .unwrap()
        .into_inner();
    let mut ticks = Vec::new();
    while let Some(tick) = stream.message().await.unwrap() {
        ticks.push(tick.n);
    }
    assert_eq!(ticks, (1..=200).rev().collect::<Vec<_>>());
    // The whole stream was one call: the next one is refused.
    let status = client
        .countdown(tonic::Request::new(CountdownRequest { from: 1 }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
}

/// What a client other than tonic sees: one HEADERS frame that ends the stream, the status in
/// it, and no DATA or trailers.
#[tokio::test]
async fn a_refusal_is_trailers_only_on_the_wire() {
    let layer = by_ip(1);
    let addr = serve(layer).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut h2 = h2.ready().await.unwrap();

    let mut statuses = Vec::new();
    for _ in 0..2 {
        let request = http::Request::post(format!("http://{addr}/tollgate.demo.Demo/Hello"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, mut send) = h2.send_request(request, false).unwrap();
        // One gRPC message: uncompressed, zero bytes long (an empty `HelloRequest`).
        send.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .unwrap();
        let response = response.await.unwrap();
        h2 = h2.ready().await.unwrap();
        statuses.push(response);
    }
    // Admitted: a normal gRPC response, whose status comes in the trailers.
    let admitted = statuses.remove(0);
    assert_eq!(admitted.status(), 200);
    assert!(admitted.headers().get("grpc-status").is_none());
    assert!(!admitted.body().is_end_stream());

    let refused = statuses.remove(0);
    assert_eq!(refused.status(), 200);
    assert_eq!(refused.headers()["content-type"], "application/grpc");
    assert_eq!(refused.headers()["grpc-status"], "8");
    // END_STREAM was on the HEADERS frame itself.
    let mut body = refused.into_body();
    assert!(body.is_end_stream());
    assert!(body.data().await.is_none());
    assert!(body.trailers().await.unwrap().is_none());
}
