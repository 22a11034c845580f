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
mod tests {
    use std::net::SocketAddr;

    use http::HeaderValue;

    use super::super::Repr;
    use super::*;

    fn v4(octets: [u8; 4], prefix: u8) -> Vec<u8> {
        let mut key = vec![4];
        key.extend_from_slice(&octets);
        key.push(prefix);
        key
    }

    fn v6(addr: &str, prefix: u8) -> Vec<u8> {
        let addr: std::net::Ipv6Addr = addr.parse().unwrap();
        let mut key = vec![6];
        key.extend_from_slice(&addr.octets());
        key.push(prefix);
        key
    }

    fn request(peer: Option<&str>, headers: &[(&str, HeaderValue)]) -> http::Request<()> {
        let mut builder = http::Request::get("/");
        for (name, value) in headers {
            builder = builder.header(*name, value.clone());
        }
        let mut req = builder.body(()).unwrap();
        if let Some(peer) = peer {
            let ip: IpAddr = peer.parse().unwrap();
            req.extensions_mut().insert(SocketAddr::new(ip, 40000));
        }
        req
    }

    fn extract(ex: &ClientIp, req: &http::Request<()>) -> Result<Vec<u8>, MissingKey> {
        ex.extract(&RequestView::new(req))
            .map(|key| key.as_bytes().to_vec())
    }

    fn h(value: &str) -> HeaderValue {
        HeaderValue::from_str(value).unwrap()
    }

    fn cf() -> ClientIp {
        ClientIp::cf_connecting_ip(TrustedProxies::cloudflare())
    }

    fn xff() -> ClientIp {
        ClientIp::x_forwarded_for(
            TrustedProxies::parse(&["10.0.0.0/8", "2001:db8:ff::/48"]).unwrap(),
        )
    }

    const CF_PEER: &str = "173.245.48.5";
    const CLIENT: [u8; 4] = [203, 0, 113, 7];

    #[test]
    fn client_ip_cases() {
        let oversize = "1".repeat(600);
        let many_trusted = vec!["10.0.0.9"; 33].join(", ");
        let long_xff = format!("{}, 203.0.113.7", " ".repeat(4100));
        // The client 21 padded trusted hops (208 bytes each) from the right end: past the
        // bytes the walk reads.
        let padded = format!("{}10.0.0.9", " ".repeat(200));
        let deep_xff = format!("203.0.113.7,{}", vec![padded; 21].join(","));
        // (name, extractor, socket peer, headers, expected key bytes)
        type Case = (&'static str, ClientIp, Option<&'static str>, Headers, Want);
        type Headers = Vec<(&'static str, HeaderValue)>;
        type Want = Result<Vec<u8>, MissingKey>;
        #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            ("peer v4", ClientIp::peer(), Some("203.0.113.7"), vec![], Ok(v4(CLIENT, 32))),
            ("peer ignores headers", ClientIp::peer(), Some("203.0.113.7"),
                vec![("cf-connecting-ip", h("1.1.1.1")), ("x-forwarded-for", h("1.1.1.1"))], Ok(v4(CLIENT, 32))),
            ("spoofed cf-connecting-ip from untrusted peer is ignored", cf(), Some("203.0.113.7"),
                vec![("cf-connecting-ip", h("198.51.100.9"))], Ok(v4(CLIENT, 32))),
            ("loopback is not trusted by default", cf(), Some("127.0.0.1"),
                vec![("cf-connecting-ip", h("198.51.100.9"))], Ok(v4([127, 0, 0, 1], 32))),
            ("cf-connecting-ip from a cloudflare peer is used", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("198.51.100.9"))], Ok(v4([198, 51, 100, 9], 32))),
            ("cf-connecting-ip from a cloudflare ipv6 peer is used", cf(), Some("2400:cb00::1"),
                vec![("cf-connecting-ip", h("198.51.100.9"))], Ok(v4([198, 51, 100, 9], 32))),
            ("cf-connecting-ip from a mapped cloudflare peer is used", cf(), Some("::ffff:173.245.48.5"),
                vec![("cf-connecting-ip", h("198.51.100.9"))], Ok(v4([198, 51, 100, 9], 32))),
            ("cf-connecting-ip surrounding spaces trimmed", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("  198.51.100.9 "))], Ok(v4([198, 51, 100, 9], 32))),
            ("cf-connecting-ip ipv6 grouped to /64", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("2001:db8:1:2:aaaa::1"))], Ok(v6("2001:db8:1:2::", 64))),
            ("cf-connecting-ip absent", cf(), Some(CF_PEER), vec![], Err(MissingKey::Absent)),
            ("cf-connecting-ip garbage", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("not-an-ip"))], Err(MissingKey::Invalid)),
            ("cf-connecting-ip empty", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h(""))], Err(MissingKey::Invalid)),
            ("cf-connecting-ip oversize", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h(&oversize))], Err(MissingKey::Invalid)),
            ("cf-connecting-ip several values", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("198.51.100.9")), ("cf-connecting-ip", h("198.51.100.10"))],
                Err(MissingKey::Invalid)),
            ("cf-connecting-ip list in one value", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("198.51.100.9, 198.51.100.10"))], Err(MissingKey::Invalid)),
            ("cf-connecting-ip non-utf-8", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", HeaderValue::from_bytes(&[0xff, 0xfe, b'1']).unwrap())],
                Err(MissingKey::Invalid)),
            ("cf-connecting-ip with port", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("198.51.100.9:443"))], Err(MissingKey::Invalid)),
            ("cf-connecting-ip bracketed ipv6", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("[2001:db8::1]"))], Err(MissingKey::Invalid)),
            ("ipv6 peer grouped to /64", ClientIp::peer(), Some("2001:db8:1:2::1"), vec![],
                Ok(v6("2001:db8:1:2::", 64))),
            ("other address in the same /64 shares the key", ClientIp::peer(), Some("2001:db8:1:2:ffff:ffff:ffff:ffff"),
                vec![], Ok(v6("2001:db8:1:2::", 64))),
            ("address in the next /64 does not", ClientIp::peer(), Some("2001:db8:1:3::1"), vec![],
                Ok(v6("2001:db8:1:3::", 64))),
            ("ipv6 /48 setting", ClientIp::peer().ipv6_prefix(48).unwrap(), Some("2001:db8:1:2::1"), vec![],
                Ok(v6("2001:db8:1::", 48))),
            ("ipv6 /128 setting", ClientIp::peer().ipv6_prefix(128).unwrap(), Some("2001:db8:1:2::1"), vec![],
                Ok(v6("2001:db8:1:2::1", 128))),
            ("mapped peer equals ipv4", ClientIp::peer(), Some("::ffff:1.2.3.4"), vec![], Ok(v4([1, 2, 3, 4], 32))),
            ("ipv4 peer", ClientIp::peer(), Some("1.2.3.4"), vec![], Ok(v4([1, 2, 3, 4], 32))),
            ("mapped forwarded address equals ipv4", cf(), Some(CF_PEER),
                vec![("cf-connecting-ip", h("::ffff:1.2.3.4"))], Ok(v4([1, 2, 3, 4], 32))),
            ("ipv4 /24 grouping", ClientIp::peer().ipv4_prefix(24).unwrap(), Some("1.2.3.4"), vec![],
                Ok(v4([1, 2, 3, 0], 24))),
            ("ipv4 /24 grouping, same network", ClientIp::peer().ipv4_prefix(24).unwrap(), Some("1.2.3.200"), vec![],
                Ok(v4([1, 2, 3, 0], 24))),
            ("ipv4 /24 grouping, next network", ClientIp::peer().ipv4_prefix(24).unwrap(), Some("1.2.4.4"), vec![],
                Ok(v4([1, 2, 4, 0], 24))),
            ("ipv4 /0 grouping", ClientIp::peer().ipv4_prefix(0).unwrap(), Some("1.2.4.4"), vec![],
                Ok(v4([0, 0, 0, 0], 0))),
            ("mapped peer uses the ipv4 prefix", ClientIp::peer().ipv4_prefix(24).unwrap(), Some("::ffff:1.2.3.4"),
                vec![], Ok(v4([1, 2, 3, 0], 24))),
            ("xff walked from the right, skipping trusted entries", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("198.51.100.1, 203.0.113.7, 10.0.0.2"))], Ok(v4(CLIENT, 32))),
            ("xff skips trusted ipv6 entries", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("198.51.100.1,203.0.113.7,2001:db8:ff:1::1"))], Ok(v4(CLIENT, 32))),
            ("xff values joined in order", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("203.0.113.7")), ("x-forwarded-for", h("10.0.0.3, 10.0.0.2"))],
                Ok(v4(CLIENT, 32))),
            ("xff rightmost untrusted entry is the client", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("10.0.0.3")), ("x-forwarded-for", h("198.51.100.1, 203.0.113.7"))],
                Ok(v4(CLIENT, 32))),
            ("xff all trusted: leftmost", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("10.9.9.9, 10.0.0.2"))], Ok(v4([10, 9, 9, 9], 32))),
            ("xff garbage met during the walk", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("203.0.113.7, garbage, 10.0.0.2"))], Err(MissingKey::Invalid)),
            ("xff garbage left of the client is never read", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("garbage, 203.0.113.7, 10.0.0.2"))], Ok(v4(CLIENT, 32))),
            ("xff empty entry met", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("203.0.113.7,,10.0.0.2"))], Err(MissingKey::Invalid)),
            ("xff entry with port", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h("203.0.113.7:5678"))], Err(MissingKey::Invalid)),
            ("xff non-utf-8", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", HeaderValue::from_bytes(&[0xff, b'1']).unwrap())], Err(MissingKey::Invalid)),
            ("xff more than 32 entries walked", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h(&many_trusted))], Err(MissingKey::Invalid)),
            ("xff over 4096 bytes, the client in its last ones", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h(&long_xff))], Ok(v4(CLIENT, 32))),
            ("xff client further than 4096 bytes from the right", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h(&deep_xff))], Err(MissingKey::Invalid)),
            ("xff absent", xff(), Some("10.0.0.1"), vec![], Err(MissingKey::Absent)),
            ("xff from untrusted peer ignored", xff(), Some("203.0.113.7"),
                vec![("x-forwarded-for", h("198.51.100.1"))], Ok(v4(CLIENT, 32))),
            ("no ConnectInfo, peer", ClientIp::peer(), None, vec![], Err(MissingKey::NoPeerAddress)),
            ("no ConnectInfo, forwarded header present", cf(), None,
                vec![("cf-connecting-ip", h("198.51.100.9"))], Err(MissingKey::NoPeerAddress)),
        ];
        for (name, ex, peer, headers, want) in cases {
            let req = request(peer, &headers);
            assert_eq!(extract(&ex, &req), want, "{name}");
        }
    }

    #[test]
    fn xff_at_the_caps_is_accepted() {
        let ex = xff();
        let mut entries = vec!["10.0.0.9"; 31];
        entries.insert(0, "203.0.113.7");
        let req = request(
            Some("10.0.0.1"),
            &[("x-forwarded-for", h(&entries.join(",")))],
        );
        assert_eq!(extract(&ex, &req), Ok(v4(CLIENT, 32)));

        // The client's entry ends 4096 bytes from the right end (two values and the comma
        // between them, the trusted hop's), then one byte further.
        let hop = format!("{}10.0.0.9", " ".repeat(4096 - 1 - 11 - 8));
        let req = request(
            Some("10.0.0.1"),
            &[
                ("x-forwarded-for", h("garbage,203.0.113.7")),
                ("x-forwarded-for", h(&hop)),
            ],
        );
        assert_eq!(extract(&ex, &req), Ok(v4(CLIENT, 32)));
        let hop = format!(" {hop}");
        let req = request(
            Some("10.0.0.1"),
            &[
                ("x-forwarded-for", h("garbage,203.0.113.7")),
                ("x-forwarded-for", h(&hop)),
            ],
        );
        assert_eq!(extract(&ex, &req), Err(MissingKey::Invalid));
    }

    #[cfg(feature = "axum")]
    #[test]
    fn axum_connect_info_comes_first() {
        use axum::extract::connect_info::{ConnectInfo, MockConnectInfo};

        let mut req = request(None, &[]);
        req.extensions_mut()
            .insert(MockConnectInfo(SocketAddr::from((CLIENT, 1337))));
        assert_eq!(extract(&ClientIp::peer(), &req), Ok(v4(CLIENT, 32)));
        // A `ConnectInfo` wins over a `MockConnectInfo` and a plain `SocketAddr`.
        req.extensions_mut()
            .insert(SocketAddr::from(([192, 0, 2, 9], 1)));
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 1))));
        assert_eq!(extract(&ClientIp::peer(), &req), Ok(v4([192, 0, 2, 1], 32)));
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn tonic_tcp_connect_info_is_a_peer() {
        use tonic::transport::server::TcpConnectInfo;

        let mut req = request(None, &[]);
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: None,
        });
        // No remote address in it: the next source is asked.
        assert_eq!(
            extract(&ClientIp::peer(), &req),
            Err(MissingKey::NoPeerAddress)
        );
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: Some(SocketAddr::from(([127, 0, 0, 1], 50051))),
            remote_addr: Some(SocketAddr::from((CLIENT, 1337))),
        });
        // It wins over a plain `SocketAddr`.
        req.extensions_mut()
            .insert(SocketAddr::from(([192, 0, 2, 9], 1)));
        assert_eq!(extract(&ClientIp::peer(), &req), Ok(v4(CLIENT, 32)));
    }

    #[test]
    fn a_peer_fn_is_asked_last() {
        #[derive(Clone)]
        struct Remote(IpAddr);
        let ex = ClientIp::peer()
            .peer_fn(|req: &RequestView<'_>| req.extensions().get::<Remote>().map(|r| r.0));
        let mut req = request(None, &[]);
        assert_eq!(extract(&ex, &req), Err(MissingKey::NoPeerAddress));
        req.extensions_mut().insert(Remote(IpAddr::from(CLIENT)));
        assert_eq!(extract(&ex, &req), Ok(v4(CLIENT, 32)));
        // A built-in source comes first.
        req.extensions_mut()
            .insert(SocketAddr::from(([192, 0, 2, 9], 1)));
        assert_eq!(extract(&ex, &req), Ok(v4([192, 0, 2, 9], 32)));
        // A function that finds nothing is a missing peer, as without one.
        let none = ClientIp::peer().peer_fn(|_: &RequestView<'_>| None);
        assert_eq!(
            extract(&none, &request(None, &[])),
            Err(MissingKey::NoPeerAddress)
        );
    }

    #[test]
    fn keys_are_inline() {
        for peer in ["203.0.113.7", "2001:db8::1"] {
            let req = request(Some(peer), &[]);
            let key = ClientIp::peer().extract(&RequestView::new(&req)).unwrap();
            assert!(matches!(key.0, Repr::Inline { .. }), "{peer}");
        }
    }

    #[test]
    fn prefix_bounds() {
        assert!(ClientIp::peer().ipv4_prefix(32).is_ok());
        assert_eq!(
            ClientIp::peer().ipv4_prefix(33).unwrap_err(),
            ConfigError::InvalidPrefix { bits: 33, max: 32 }
        );
        assert!(ClientIp::peer().ipv6_prefix(128).is_ok());
        assert_eq!(
            ClientIp::peer().ipv6_prefix(129).unwrap_err(),
            ConfigError::InvalidPrefix {
                bits: 129,
                max: 128
            }
        );
    }
}
