//! Client IP keys: the socket peer, or a forwarded header when the peer is a trusted proxy.

use std::net::IpAddr;
use std::sync::Arc;

use tollgate_engine::ConfigError;

use super::forwarded::{cf_connecting_ip, x_forwarded_for, ForwardedHeader};
use super::peer::{peer_ip, PeerFn};
use super::proxies::{canonical, mask_v4, mask_v6, TrustedProxies};
use super::{Identity, Key, KeyExtractor, MissingKey, RequestView};

const DEFAULT_V4_PREFIX: u8 = 32;
const DEFAULT_V6_PREFIX: u8 = 64;

/// Keys requests by client IP address.
///
/// The address comes from the socket peer, or from a forwarded header ([`ForwardedHeader`]) —
/// but the header is read **only when the peer itself is in the [`TrustedProxies`]**. From any other peer the header is ignored and the peer is the key:
/// otherwise every client could pick its own key and escape its limit.
///
/// Addresses are grouped before they become keys: an IPv4-mapped IPv6 address
/// (`::ffff:1.2.3.4`) counts as the IPv4 address, IPv4 is kept whole (`/32`) and IPv6 is cut to
/// its `/64` network by default, since one IPv6 host usually owns a whole `/64`. See
/// [`ipv4_prefix`](Self::ipv4_prefix) and [`ipv6_prefix`](Self::ipv6_prefix). A key is a version
/// tag, the masked address and the prefix length, stored inline (no allocation), so keys made
/// with different prefix settings never coincide.
///
/// Forwarded addresses must be plain IP addresses, as Cloudflare and nginx send them:
/// `1.2.3.4` or `2001:db8::1`, with surrounding spaces allowed. Ports (`1.2.3.4:5678`),
/// brackets (`[::1]`), zone ids and `unknown` are rejected as [`MissingKey::Invalid`].
///
/// # Where the peer address comes from
///
/// The first of these in the request's extensions, in this order:
///
/// 1. axum's `ConnectInfo<SocketAddr>` (feature `axum`, on by default): serve the router with
///    `into_make_service_with_connect_info::<SocketAddr>()`; or axum's
///    `MockConnectInfo<SocketAddr>` in tests;
/// 2. tonic's `TcpConnectInfo` (feature `tonic`), which tonic's server always inserts, and
///    `TlsConnectInfo<TcpConnectInfo>` (feature `tonic-tls`) behind tonic's TLS;
/// 3. a plain [`SocketAddr`](std::net::SocketAddr), for any other server (a hyper service inserts it itself);
/// 4. the function given to [`peer_fn`](Self::peer_fn).
///
/// With none of them, every request gets [`MissingKey::NoPeerAddress`] (and the limit's
/// missing-key policy), and one error is logged.
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
///
/// use tollgate::key::{ClientIp, KeyExtractor, RequestView, TrustedProxies};
///
/// let by_ip = ClientIp::cf_connecting_ip(TrustedProxies::cloudflare());
///
/// // Through Cloudflare: the peer is a Cloudflare address, so the header names the client.
/// let mut via_cf = http::Request::get("/")
///     .header("cf-connecting-ip", "203.0.113.7")
///     .body(())
///     .unwrap();
/// via_cf
///     .extensions_mut()
///     .insert(SocketAddr::from(([173, 245, 48, 5], 443)));
///
/// // The same client connecting directly and sending a made-up header: the header is ignored.
/// let mut direct = http::Request::get("/")
///     .header("cf-connecting-ip", "198.51.100.1")
///     .body(())
///     .unwrap();
/// direct
///     .extensions_mut()
///     .insert(SocketAddr::from(([203, 0, 113, 7], 50000)));
///
/// assert_eq!(
///     by_ip.extract(&RequestView::new(&via_cf)).unwrap(),
///     by_ip.extract(&RequestView::new(&direct)).unwrap(),
/// );
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    source: Source,
    v4_prefix: u8,
    v6_prefix: u8,
    peer_fn: Option<PeerFn>,
    reveal: bool,
}

#[derive(Debug, Clone)]
enum Source {
    Peer,
    Forwarded {
        header: ForwardedHeader,
        trusted: TrustedProxies,
    },
}

impl ClientIp {
    /// Keys by the socket peer address, ignoring every header.
    ///
    /// Right when clients connect to the server directly.
    pub fn peer() -> Self {
        Self::with_source(Source::Peer)
    }

    /// Keys by `cf-connecting-ip` when the peer is in `trusted`, by the peer otherwise.
    ///
    /// For servers behind Cloudflare; pass [`TrustedProxies::cloudflare()`]. From a trusted
    /// peer the header must hold exactly one address: a missing header is
    /// [`MissingKey::Absent`], several values or anything but one IP address
    /// [`MissingKey::Invalid`].
    pub fn cf_connecting_ip(trusted: TrustedProxies) -> Self {
        Self::forwarded(ForwardedHeader::CfConnectingIp, trusted)
    }

    /// Keys by `X-Forwarded-For` when the peer is in `trusted`, by the peer otherwise.
    ///
    /// All `X-Forwarded-For` values are read as one comma-separated list, from the right: each
    /// entry that is itself a trusted proxy is skipped and the first other one is the client.
    /// If every entry is trusted, the leftmost is the client. Entries left of the client are
    /// never looked at, since anyone can write them, and neither is their length: the walk
    /// reads at most the header's last 4096 bytes (values joined with `,`) and 32 entries,
    /// the ones the trusted proxies appended, so a client behind a trusted proxy cannot make
    /// its key unreadable (and escape a denylist, or a limit that skips requests without a
    /// key) by sending a huge header. An entry that is not an IP address met on the way, or
    /// a walk that reaches 32 entries or the 4096th byte from the right before it finds the
    /// client, is [`MissingKey::Invalid`]; no header is [`MissingKey::Absent`].
    pub fn x_forwarded_for(trusted: TrustedProxies) -> Self {
        Self::forwarded(ForwardedHeader::XForwardedFor, trusted)
    }

    /// Keys by `header` when the peer is in `trusted`, by the peer otherwise.
    ///
    /// The same as [`cf_connecting_ip`](Self::cf_connecting_ip) or
    /// [`x_forwarded_for`](Self::x_forwarded_for), for when the header is chosen by
    /// configuration.
    pub fn forwarded(header: ForwardedHeader, trusted: TrustedProxies) -> Self {
        Self::with_source(Source::Forwarded { header, trusted })
    }

    fn with_source(source: Source) -> Self {
        Self {
            source,
            v4_prefix: DEFAULT_V4_PREFIX,
            v6_prefix: DEFAULT_V6_PREFIX,
            peer_fn: None,
            reveal: false,
        }
    }

    /// Reports of refused clients name them by address, or by the network their key groups
    /// (`2001:db8:1:2::/64`), instead of a [`fingerprint`](super::fingerprint): the addresses
    /// then reach the backend (Redis keeps reports for two minutes) and whoever reads it.
    pub fn reveal_identities(mut self) -> Self {
        self.reveal = true;
        self
    }

    /// Finds the peer address with `f` when none of the built-in sources is in the request's
    /// extensions: for a server that records the peer some other way.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::net::IpAddr;
    ///
    /// use tollgate::key::{ClientIp, KeyExtractor, RequestView};
    ///
    /// #[derive(Clone)]
    /// struct RemoteAddr(IpAddr);
    ///
    /// let by_ip = ClientIp::peer()
    ///     .peer_fn(|req: &RequestView<'_>| req.extensions().get::<RemoteAddr>().map(|r| r.0));
    /// let mut req = http::Request::get("/").body(()).unwrap();
    /// req.extensions_mut().insert(RemoteAddr("192.0.2.1".parse().unwrap()));
    /// assert!(by_ip.extract(&RequestView::new(&req)).is_ok());
    /// ```
    pub fn peer_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&RequestView<'_>) -> Option<IpAddr> + Send + Sync + 'static,
    {
        self.peer_fn = Some(PeerFn(Arc::new(f)));
        self
    }

    /// Groups IPv4 clients by their `/bits` network (default 32: each address on its own).
    ///
    /// `ipv4_prefix(24)` makes all of `192.0.2.0/24` share one key.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPrefix`] when `bits` is above 32.
    pub fn ipv4_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        self.v4_prefix = check_prefix(bits, 32)?;
        Ok(self)
    }

    /// Groups IPv6 clients by their `/bits` network (default 64).
    ///
    /// A single subscriber usually gets at least a `/64`, so keying by whole addresses would let
    /// one host rotate through 2⁶⁴ keys.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPrefix`] when `bits` is above 128.
    pub fn ipv6_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        self.v6_prefix = check_prefix(bits, 128)?;
        Ok(self)
    }

    /// The client's address as this extractor finds it in `req` (the socket peer, or what a
    /// trusted proxy names), before grouping: what an allowlist's networks are matched on.
    ///
    /// # Errors
    ///
    /// As [`KeyExtractor::extract`]: no peer address, or a trusted proxy's header that names
    /// no valid client.
    pub fn client_ip(&self, req: &RequestView<'_>) -> Result<IpAddr, MissingKey> {
        self.client(req)
    }

    fn client(&self, req: &RequestView<'_>) -> Result<IpAddr, MissingKey> {
        let peer = peer_ip(req, self.peer_fn.as_ref())?;
        match &self.source {
            Source::Forwarded { header, trusted } if trusted.contains(peer) => match header {
                ForwardedHeader::CfConnectingIp => cf_connecting_ip(req.headers()),
                ForwardedHeader::XForwardedFor => x_forwarded_for(req.headers(), trusted),
            },
            _ => Ok(peer),
        }
    }

    fn key(&self, ip: IpAddr) -> Result<Key<'static>, MissingKey> {
        match canonical(ip) {
            IpAddr::V4(addr) => {
                let mut bytes = [0; 6];
                bytes[0] = 4;
                bytes[1..5].copy_from_slice(&mask_v4(addr, self.v4_prefix).octets());
                bytes[5] = self.v4_prefix;
                Key::copied(&bytes)
            }
            IpAddr::V6(addr) => {
                let mut bytes = [0; 18];
                bytes[0] = 6;
                bytes[1..17].copy_from_slice(&mask_v6(addr, self.v6_prefix).octets());
                bytes[17] = self.v6_prefix;
                Key::copied(&bytes)
            }
        }
    }
}

fn check_prefix(bits: u8, max: u8) -> Result<u8, ConfigError> {
    if bits > max {
        return Err(ConfigError::InvalidPrefix { bits, max });
    }
    Ok(bits)
}

impl KeyExtractor for ClientIp {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        self.client(req).and_then(|ip| self.key(ip))
    }

    /// The key of the address, grouped by this extractor's prefixes; a name that is not an
    /// address is [`MissingKey::NotAnAddress`].
    fn key_of(&self, identity: &Identity) -> Result<Key<'static>, MissingKey> {
        identity
            .ip()
            .ok_or(MissingKey::NotAnAddress)
            .and_then(|ip| self.key(ip))
    }

    /// `ip`, then where the address comes from and how it is grouped when not the defaults:
    /// `ip (cf-connecting-ip from 22 trusted networks, IPv4 /24)`.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Source::Forwarded { header, trusted } = &self.source {
            parts.push(format!(
                "{} from {} trusted networks",
                header.as_str(),
                trusted.cidrs().len()
            ));
        }
        if self.v4_prefix != 32 {
            parts.push(format!("IPv4 /{}", self.v4_prefix));
        }
        if self.v6_prefix != 64 {
            parts.push(format!("IPv6 /{}", self.v6_prefix));
        }
        if parts.is_empty() {
            "ip".to_owned()
        } else {
            format!("ip ({})", parts.join(", "))
        }
    }

    /// A [`fingerprint`](super::fingerprint); once asked to reveal identities
    /// ([`reveal_identities`](Self::reveal_identities)), the address, or the network its
    /// prefix groups (`2001:db8:1:2::/64`).
    fn identity_of(&self, key: &[u8]) -> String {
        if !self.reveal {
            return super::fingerprint(key);
        }
        super::text::ip_key_text(key).unwrap_or_else(|| super::text::hex(key))
    }
}

#[cfg(test)]
mod tests;
