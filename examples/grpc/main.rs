//! Run with: cargo run --example grpc
//!
//! A tonic gRPC server behind tollgate: `tollgate.demo.Demo` on 127.0.0.1:`PORT` (default
//! 50051), limited to 5 calls a minute per client IP and 20 a minute per tenant, the tenant
//! taken from the `x-tenant` metadata entry (calls without one skip that limit). A refused call
//! gets the gRPC status `RESOURCE_EXHAUSTED` with a `google.rpc.RetryInfo` delay, not an HTTP 429.
//!
//! `cargo run --example grpc -- call` runs a tonic client against it (`PORT`, or `ADDR` for a
//! whole URL), waiting up to 30 s for the server to listen: 6 `Hello` calls as tenant `acme`,
//! printing each call's status. The first 5 are
//! `OK`, the 6th `RESOURCE_EXHAUSTED` with its retry delay. No grpcurl needed.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `info`).

mod service;
#[path = "../support/mod.rs"]
mod support;

use std::process::ExitCode;
use std::time::Duration;

use service::{DemoClient, DemoServer, HelloRequest};
use tollgate::key::{ClientIp, Tenant};
use tollgate::{Limit, MissingKeyPolicy, Quota, RateLimitLayer};
use tonic::transport::Server;
use tonic_types::StatusExt;

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(50051)?;
    if std::env::args().nth(1).as_deref() == Some("call") {
        let addr = std::env::var("ADDR").unwrap_or_else(|_| format!("http://127.0.0.1:{port}"));
        return call(addr).await;
    }

    let limits = RateLimitLayer::builder()
        // tonic puts the peer in `TcpConnectInfo`, which the `tonic` feature reads.
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(5)?)?,
            ClientIp::peer(),
        )
        // gRPC metadata are HTTP headers: a header tenant reads them.
        .limit(
            Limit::gcra("per-tenant", Quota::per_minute(20)?)?
                .on_missing_key(MissingKeyPolicy::Skip),
            Tenant::header("x-tenant"),
        )
        .build()?;

    let listener = support::listen(port).await?;
    tracing::info!(
        "grpc listening on http://{}: 5 calls a minute per client address, 20 per x-tenant",
        listener.local_addr()?
    );
    Server::builder()
        .layer(limits)
        .add_service(DemoServer)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

/// Six calls as tenant `acme`, each call's status printed.
async fn call(addr: String) -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = tonic::transport::Endpoint::from_shared(addr.clone())
        .map_err(|e| format!("ADDR={addr:?} is not a URL such as http://127.0.0.1:50051: {e}"))?
        .connect_timeout(Duration::from_secs(5));
    // A server started just before (`cargo run --example grpc &`) may not listen yet.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let channel = loop {
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(e) if refused(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                let why = support::chain(&e);
                return Err(format!(
                    "cannot connect to {addr} (is `cargo run --example grpc` running?): {why}"
                )
                .into());
            }
        }
    };
    let mut client = DemoClient::new(channel);
    for i in 1..=6 {
        let mut request = tonic::Request::new(HelloRequest {
            name: "acme".to_owned(),
        });
        request.metadata_mut().insert("x-tenant", "acme".parse()?);
        match client.hello(request).await {
            Ok(reply) => {
                let reply = reply.into_inner();
                println!(
                    "call {i}: OK {:?} remaining={} decision={}",
                    reply.message, reply.remaining, reply.decision
                );
            }
            Err(status) => {
                let delay = status
                    .get_details_retry_info()
                    .and_then(|info| info.retry_delay);
                println!(
                    "call {i}: {:?} {:?} retry_delay={delay:?}",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    Ok(())
}

/// Whether nothing listens at the address yet.
fn refused(e: &tonic::transport::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = cause.source();
    }
    false
}
