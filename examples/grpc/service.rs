//! A small gRPC service, written by hand so that nothing needs `protoc`:
//!
//! ```proto
//! package tollgate.demo;
//! service Demo {
//!   rpc Hello(HelloRequest) returns (HelloReply);          // says what the limiter decided
//!   rpc Countdown(CountdownRequest) returns (stream Tick);  // `from` ticks, one per message
//! }
//! ```
//!
//! The messages derive `prost::Message`; the server and the client calls are what tonic's code
//! generator would write, with `tower::service_fn` handlers.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use tollgate::Decision;
use tonic::server::NamedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

/// `tollgate.demo.HelloRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct HelloRequest {
    /// Who says hello.
    #[prost(string, tag = "1")]
    pub(crate) name: String,
}

/// `tollgate.demo.HelloReply`: what the rate limiter decided, read from the request.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct HelloReply {
    /// A greeting.
    #[prost(string, tag = "1")]
    pub(crate) message: String,
    /// The fewest units left among the call's limits (the `Decision`'s `remaining`).
    #[prost(uint64, tag = "2")]
    pub(crate) remaining: u64,
    /// Each limit's outcome, `name=label`, comma-separated.
    #[prost(string, tag = "3")]
    pub(crate) decision: String,
}

/// `tollgate.demo.CountdownRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CountdownRequest {
    /// How many ticks to stream.
    #[prost(uint32, tag = "1")]
    pub(crate) from: u32,
}

/// `tollgate.demo.Tick`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Tick {
    /// Counts down to 1.
    #[prost(uint32, tag = "1")]
    pub(crate) n: u32,
}

const HELLO: &str = "/tollgate.demo.Demo/Hello";
const COUNTDOWN: &str = "/tollgate.demo.Demo/Countdown";

/// The `tollgate.demo.Demo` server.
#[derive(Debug, Clone, Default)]
pub(crate) struct DemoServer;

impl NamedService for DemoServer {
    const NAME: &'static str = "tollgate.demo.Demo";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Ticks = tokio_stream::Iter<std::vec::IntoIter<Result<Tick, Status>>>;

async fn hello(request: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
    // The layer put its decision in the request's extensions; tonic keeps them.
    let decision = request.extensions().get::<Decision>().cloned();
    let name = request.into_inner().name;
    let (remaining, decision) = match decision {
        Some(d) => (
            d.remaining().unwrap_or(0),
            d.limits()
                .iter()
                .map(|l| format!("{}={}", l.name(), l.label()))
                .collect::<Vec<_>>()
                .join(","),
        ),
        None => (0, "none".to_owned()),
    };
    Ok(Response::new(HelloReply {
        message: format!("hello, {name}"),
        remaining,
        decision,
    }))
}

async fn countdown(request: Request<CountdownRequest>) -> Result<Response<Ticks>, Status> {
    let from = request.into_inner().from.min(1_000);
    let ticks: Vec<_> = (1..=from).rev().map(|n| Ok(Tick { n })).collect();
    Ok(Response::new(tokio_stream::iter(ticks)))
}

impl<B> tower::Service<http::Request<B>> for DemoServer
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match req.uri().path() {
            HELLO => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
                Ok(grpc.unary(tower::service_fn(hello), req).await)
            }),
            COUNTDOWN => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
                Ok(grpc
                    .server_streaming(tower::service_fn(countdown), req)
                    .await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// A client of `tollgate.demo.Demo`.
#[derive(Debug, Clone)]
pub(crate) struct DemoClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl DemoClient {
    /// A client on `channel`.
    pub(crate) fn new(channel: Channel) -> Self {
        Self {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    /// Calls `Hello`.
    pub(crate) async fn hello(
        &mut self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        self.ready().await?;
        let path = PathAndQuery::from_static(HELLO);
        self.grpc.unary(request, path, ProstCodec::default()).await
    }

    /// Calls `Countdown` (the example calls only `Hello`; the tests stream with this).
    #[allow(dead_code)]
    pub(crate) async fn countdown(
        &mut self,
        request: Request<CountdownRequest>,
    ) -> Result<Response<tonic::codec::Streaming<Tick>>, Status> {
        self.ready().await?;
        let path = PathAndQuery::from_static(COUNTDOWN);
        self.grpc
            .server_streaming(request, path, ProstCodec::default())
            .await
    }

    async fn ready(&mut self) -> Result<(), Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("not ready: {e}")))
    }
}
