//! Where a request's peer address comes from: axum's and tonic's connection info, a plain
//! `SocketAddr`, or a user's function, in that order.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{MissingKey, RequestView};

static WARNED_NO_PEER: AtomicBool = AtomicBool::new(false);

#[inline]
pub(super) fn peer_ip(
    req: &RequestView<'_>,
    custom: Option<&PeerFn>,
) -> Result<IpAddr, MissingKey> {
    let extensions = req.extensions();
    #[cfg(feature = "axum")]
    {
        use axum::extract::connect_info::{ConnectInfo, MockConnectInfo};
        if let Some(ConnectInfo(addr)) = extensions.get::<ConnectInfo<SocketAddr>>() {
            return Ok(addr.ip());
        }
        // `MockConnectInfo` stores itself rather than a `ConnectInfo`; axum's own extractor
        // falls back to it the same way, so tests written for axum work unchanged.
        if let Some(MockConnectInfo(addr)) = extensions.get::<MockConnectInfo<SocketAddr>>() {
            return Ok(addr.ip());
        }
    }
    #[cfg(feature = "tonic")]
    {
        use tonic::transport::server::TcpConnectInfo;
        if let Some(addr) = extensions
            .get::<TcpConnectInfo>()
            .and_then(TcpConnectInfo::remote_addr)
        {
            return Ok(addr.ip());
        }
    }
    #[cfg(feature = "tonic-tls")]
    {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        if let Some(addr) = extensions
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|info| info.get_ref().remote_addr())
        {
            return Ok(addr.ip());
        }
    }
    if let Some(addr) = extensions.get::<SocketAddr>() {
        return Ok(addr.ip());
    }
    if let Some(ip) = custom.and_then(|f| (f.0)(req)) {
        return Ok(ip);
    }
    // Every request fails the same way until the server is fixed: say it once, not per request.
    if !WARNED_NO_PEER.load(Ordering::Relaxed) && !WARNED_NO_PEER.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "tollgate: ClientIp found no peer address in the request extensions, so no request \
             can be keyed by IP: each gets its limit's missing-key policy (by default 400 \
             \"the client address is unknown\"; logged once). With axum, serve the router \
             with `into_make_service_with_connect_info::<SocketAddr>()` (or add \
             `MockConnectInfo` in tests); with tonic, enable tollgate's `tonic` feature; with \
             another server, put the peer's `SocketAddr` in the request extensions or give \
             `ClientIp::peer_fn` a function that finds it."
        );
    }
    Err(MissingKey::NoPeerAddress)
}

type FindPeer = dyn Fn(&RequestView<'_>) -> Option<IpAddr> + Send + Sync;

/// A user-supplied source of the peer address.
#[derive(Clone)]
pub(super) struct PeerFn(pub(super) Arc<FindPeer>);

impl std::fmt::Debug for PeerFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerFn")
    }
}
