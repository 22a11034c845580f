//! Client IP keys: the socket peer, or a forwarded header when the peer is a trusted proxy.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::extract::connect_info::MockConnectInfo;
use axum::extract::ConnectInfo;
use http::header::{HeaderMap, HeaderName};
use tollgate_core::ConfigError;

use super::{Key, KeyExtractor, MissingKey, RequestView};

const CF_CONNECTING_IP: HeaderName = HeaderName::from_static("cf-connecting-ip");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The longest textual IP address (`ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255`).
const MAX_IP_TEXT: usize = 45;

/// Bounds on the `X-Forwarded-For` walk: a real proxy chain is a handful of hops, so anything
/// longer is an attempt to make every request expensive.
const MAX_XFF_ENTRIES: usize = 32;
const MAX_XFF_BYTES: usize = 4096;

const DEFAULT_V4_PREFIX: u8 = 32;
const DEFAULT_V6_PREFIX: u8 = 64;

/// Keys requests by client IP address.
///
/// The address comes from the socket peer (axum's [`ConnectInfo<SocketAddr>`](ConnectInfo), or
/// [`MockConnectInfo<SocketAddr>`] in tests), or from a forwarded header
/// ([`ForwardedHeader`]) — but the header is read **only when the peer itself is in the
/// [`TrustedProxies`]**. From any other peer the header is ignored and the peer is the key:
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
/// The server must record peer addresses: serve the router with
/// `into_make_service_with_connect_info::<SocketAddr>()`. Without them every request gets
/// [`MissingKey::NoPeerAddress`] and one error is logged.
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
///
/// use axum::extract::ConnectInfo;
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
///     .insert(ConnectInfo(SocketAddr::from(([173, 245, 48, 5], 443))));
///
/// // The same client connecting directly and sending a made-up header: the header is ignored.
/// let mut direct = http::Request::get("/")
///     .header("cf-connecting-ip", "198.51.100.1")
///     .body(())
///     .unwrap();
/// direct
///     .extensions_mut()
///     .insert(ConnectInfo(SocketAddr::from(([203, 0, 113, 7], 50000))));
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
    /// never looked at, since anyone can write them. An entry that is not an IP address met on
    /// the way, more than 32 entries walked or more than 4096 bytes of header are
    /// [`MissingKey::Invalid`]; no header is [`MissingKey::Absent`].
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
        }
    }

    /// Groups IPv4 clients by their `/bits` network (default 32: each address on its own).
    ///
    /// `ipv4_prefix(24)` makes all of `192.0.2.0/24` share one key.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Other`] when `bits` is above 32.
    pub fn ipv4_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        self.v4_prefix = check_prefix("IPv4", bits, 32)?;
        Ok(self)
    }

    /// Groups IPv6 clients by their `/bits` network (default 64).
    ///
    /// A single subscriber usually gets at least a `/64`, so keying by whole addresses would let
    /// one host rotate through 2⁶⁴ keys.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Other`] when `bits` is above 128.
    pub fn ipv6_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        self.v6_prefix = check_prefix("IPv6", bits, 128)?;
        Ok(self)
    }

    fn client(&self, req: &RequestView<'_>) -> Result<IpAddr, MissingKey> {
        let peer = peer_ip(req)?;
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

fn check_prefix(version: &str, bits: u8, max: u8) -> Result<u8, ConfigError> {
    if bits > max {
        return Err(ConfigError::Other(format!(
            "{version} prefix /{bits} is invalid: it must be between 0 and {max}"
        )));
    }
    Ok(bits)
}

impl KeyExtractor for ClientIp {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        self.client(req).and_then(|ip| self.key(ip))
    }
}

/// Which header names the client when the peer is a trusted proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `cf-connecting-ip`, set by Cloudflare to the one address that connected to it.
    CfConnectingIp,
    /// `X-Forwarded-For`, a list each proxy appends the address it saw to.
    XForwardedFor,
}

impl ForwardedHeader {
    /// The header's name, lowercase: `cf-connecting-ip` or `x-forwarded-for`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::CfConnectingIp => "cf-connecting-ip",
            Self::XForwardedFor => "x-forwarded-for",
        }
    }
}

static WARNED_NO_PEER: AtomicBool = AtomicBool::new(false);

fn peer_ip(req: &RequestView<'_>) -> Result<IpAddr, MissingKey> {
    let extensions = req.extensions();
    if let Some(ConnectInfo(addr)) = extensions.get::<ConnectInfo<SocketAddr>>() {
        return Ok(addr.ip());
    }
    // `MockConnectInfo` stores itself rather than a `ConnectInfo`; axum's own extractor falls
    // back to it the same way, so tests written for axum work unchanged.
    if let Some(MockConnectInfo(addr)) = extensions.get::<MockConnectInfo<SocketAddr>>() {
        return Ok(addr.ip());
    }
    // Every request fails the same way until the server is fixed: say it once, not per request.
    if !WARNED_NO_PEER.load(Ordering::Relaxed) && !WARNED_NO_PEER.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "tollgate: ClientIp found no peer address in the request extensions, so no request \
             can be keyed by IP. Serve the router with \
             `into_make_service_with_connect_info::<SocketAddr>()` (or add \
             `MockConnectInfo` in tests)."
        );
    }
    Err(MissingKey::NoPeerAddress)
}

fn cf_connecting_ip(headers: &HeaderMap) -> Result<IpAddr, MissingKey> {
    let mut values = headers.get_all(CF_CONNECTING_IP).into_iter();
    let value = values.next().ok_or(MissingKey::Absent)?;
    if values.next().is_some() {
        return Err(MissingKey::Invalid);
    }
    parse_ip(value.as_bytes())
}

fn x_forwarded_for(headers: &HeaderMap, trusted: &TrustedProxies) -> Result<IpAddr, MissingKey> {
    let values = headers.get_all(X_FORWARDED_FOR);
    let mut count = 0;
    let mut joined_len = 0;
    for value in &values {
        count += 1;
        joined_len += value.len();
    }
    if count == 0 {
        return Err(MissingKey::Absent);
    }
    // As if the values were joined with ",".
    if joined_len + (count - 1) > MAX_XFF_BYTES {
        return Err(MissingKey::Invalid);
    }
    let mut walked = 0;
    let mut leftmost = None;
    for value in values.iter().rev() {
        for entry in value.as_bytes().rsplit(|&b| b == b',') {
            walked += 1;
            if walked > MAX_XFF_ENTRIES {
                return Err(MissingKey::Invalid);
            }
            let ip = parse_ip(entry)?;
            if !trusted.contains(ip) {
                return Ok(ip);
            }
            leftmost = Some(ip);
        }
    }
    // Every value yields at least one entry, so `leftmost` is set; `Invalid` is only a fallback.
    leftmost.ok_or(MissingKey::Invalid)
}

fn parse_ip(raw: &[u8]) -> Result<IpAddr, MissingKey> {
    let raw = raw.trim_ascii();
    if raw.len() > MAX_IP_TEXT {
        return Err(MissingKey::Invalid);
    }
    std::str::from_utf8(raw)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or(MissingKey::Invalid)
}

/// `::ffff:a.b.c.d` is how dual-stack sockets report IPv4 clients: the same client as `a.b.c.d`.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

fn mask_v4(addr: Ipv4Addr, bits: u8) -> Ipv4Addr {
    let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
    Ipv4Addr::from(u32::from(addr) & mask)
}

fn mask_v6(addr: Ipv6Addr, bits: u8) -> Ipv6Addr {
    let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
    Ipv6Addr::from(u128::from(addr) & mask)
}

/// An IP network such as `173.245.48.0/20` or `2400:cb00::/32`.
///
/// Parsed with [`FromStr`]: an address, optionally `/` and a prefix length; a bare address is a
/// single host (`/32` or `/128`). The address must be the network's first address: host bits set
/// past the prefix (`10.0.0.1/8`) are rejected rather than masked off, because in a list of
/// trusted proxies such a line is more likely a typo than a deliberate network. A network written
/// as IPv4-mapped IPv6 (`::ffff:10.0.0.0/104`) is stored as the IPv4 network (`10.0.0.0/8`).
///
/// # Examples
///
/// ```
/// use tollgate::key::Cidr;
///
/// let net: Cidr = "10.0.0.0/8".parse().unwrap();
/// assert!(net.contains("10.1.2.3".parse().unwrap()));
/// assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
/// assert!(!net.contains("11.0.0.1".parse().unwrap()));
/// assert!("10.0.0.1/8".parse::<Cidr>().is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network `addr/prefix`.
    ///
    /// # Errors
    ///
    /// [`InvalidCidr`] when `prefix` is longer than the address or `addr` has host bits set.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, InvalidCidr> {
        let invalid = |reason| InvalidCidr {
            input: format!("{addr}/{prefix}"),
            reason,
        };
        let (addr, prefix) = match addr {
            IpAddr::V6(v6) if prefix >= 96 => match v6.to_ipv4_mapped() {
                Some(v4) => (IpAddr::V4(v4), prefix - 96),
                None => (addr, prefix),
            },
            _ => (addr, prefix),
        };
        let masked = match addr {
            IpAddr::V4(v4) if prefix <= 32 => IpAddr::V4(mask_v4(v4, prefix)),
            IpAddr::V6(v6) if prefix <= 128 => IpAddr::V6(mask_v6(v6, prefix)),
            _ => return Err(invalid(Reason::Prefix)),
        };
        if masked != addr {
            return Err(invalid(Reason::HostBits));
        }
        Ok(Self { addr, prefix })
    }

    /// The network's first address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length in bits.
    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    /// Whether `ip` is in this network; an IPv4-mapped IPv6 address counts as its IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask_v4(ip, self.prefix) == net,
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask_v6(ip, self.prefix) == net,
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = InvalidCidr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason| InvalidCidr {
            input: s.to_owned(),
            reason,
        };
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| invalid(Reason::Address))?;
        let prefix = match prefix {
            None if addr.is_ipv4() => 32,
            None => 128,
            // Digits only: `u8::from_str` would also take `+8`.
            Some(p) if !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()) => {
                p.parse().map_err(|_| invalid(Reason::Prefix))?
            }
            Some(_) => return Err(invalid(Reason::Prefix)),
        };
        Self::new(addr, prefix).map_err(|e| invalid(e.reason))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl fmt::Debug for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cidr({self})")
    }
}

/// A network that could not be parsed or built; see [`Cidr`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidCidr {
    input: String,
    reason: Reason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reason {
    Address,
    Prefix,
    HostBits,
}

impl InvalidCidr {
    /// The text that was rejected.
    pub fn input(&self) -> &str {
        &self.input
    }
}

impl fmt::Display for InvalidCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.reason {
            Reason::Address => "not an IP address",
            Reason::Prefix => "the prefix length is not a number within the address's bits",
            Reason::HostBits => "bits are set past the prefix (write the network's first address)",
        };
        write!(f, "invalid CIDR {:?}: {why}", self.input)
    }
}

impl std::error::Error for InvalidCidr {}

/// The proxies whose forwarded headers are believed.
///
/// Empty by default ([`none`](Self::none)); loopback and private networks are not trusted unless
/// listed. [`cloudflare`](Self::cloudflare) holds Cloudflare's published ranges, shipped with
/// the crate; combine lists with [`with`](Self::with) and [`extend`](Self::extend). Cloning is
/// cheap (the list is shared).
///
/// # Examples
///
/// ```
/// use tollgate::key::TrustedProxies;
///
/// let trusted = TrustedProxies::cloudflare().extend(TrustedProxies::parse(&["10.0.0.0/8"])?);
/// assert!(trusted.contains("173.245.48.5".parse().unwrap()));
/// assert!(trusted.contains("10.20.30.40".parse().unwrap()));
/// assert!(!trusted.contains("127.0.0.1".parse().unwrap()));
/// # Ok::<(), tollgate::key::InvalidCidr>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    cidrs: Arc<[Cidr]>,
}

impl TrustedProxies {
    /// Trusts no proxy: forwarded headers are never read.
    pub fn none() -> Self {
        Self::default()
    }

    /// Cloudflare's published IP ranges (IPv4 and IPv6), as shipped with this version.
    ///
    /// Cloudflare changes them rarely; to follow a change before a release, pass the current
    /// list to [`parse`](Self::parse) instead.
    pub fn cloudflare() -> Self {
        static CLOUDFLARE: OnceLock<Arc<[Cidr]>> = OnceLock::new();
        let cidrs = CLOUDFLARE.get_or_init(|| {
            // A test proves every line parses; should one ever not, trusting fewer proxies only
            // means their address becomes the key, never that a client picks its own.
            parse_list(include_str!("cloudflare.txt"))
                .filter_map(Result::ok)
                .collect()
        });
        Self {
            cidrs: Arc::clone(cidrs),
        }
    }

    /// Trusts the given networks.
    pub fn from_cidrs<I: IntoIterator<Item = Cidr>>(cidrs: I) -> Self {
        Self {
            cidrs: cidrs.into_iter().collect(),
        }
    }

    /// Trusts the networks written in `cidrs` (see [`Cidr`] for the syntax).
    ///
    /// # Errors
    ///
    /// The first entry that is not a valid network.
    pub fn parse(cidrs: &[&str]) -> Result<Self, InvalidCidr> {
        cidrs
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<Cidr>, _>>()
            .map(Self::from_cidrs)
    }

    /// Also trusts `cidr`.
    pub fn with(self, cidr: Cidr) -> Self {
        self.extend(Self::from_cidrs([cidr]))
    }

    /// Also trusts every network of `other`.
    pub fn extend(self, other: TrustedProxies) -> Self {
        Self::from_cidrs(self.cidrs.iter().chain(other.cidrs.iter()).copied())
    }

    /// Whether `ip` is in one of the trusted networks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidrs.iter().any(|cidr| cidr.contains(ip))
    }

    /// The trusted networks.
    pub fn cidrs(&self) -> &[Cidr] {
        &self.cidrs
    }
}

fn parse_list(text: &str) -> impl Iterator<Item = Result<Cidr, InvalidCidr>> + '_ {
    text.lines()
        .map(|line| line.split_once('#').map_or(line, |(data, _)| data).trim())
        .filter(|line| !line.is_empty())
        .map(str::parse)
}

#[cfg(test)]
mod tests {
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
        let addr: Ipv6Addr = addr.parse().unwrap();
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
            req.extensions_mut()
                .insert(ConnectInfo(SocketAddr::new(ip, 40000)));
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
            ("xff over 4096 bytes", xff(), Some("10.0.0.1"),
                vec![("x-forwarded-for", h(&long_xff))], Err(MissingKey::Invalid)),
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

        // 4096 bytes once joined (two values and the comma between them), then one more.
        let left = "1".repeat(4096 - 1 - 11);
        let req = request(
            Some("10.0.0.1"),
            &[
                ("x-forwarded-for", h(&left)),
                ("x-forwarded-for", h("203.0.113.7")),
            ],
        );
        assert_eq!(extract(&ex, &req), Ok(v4(CLIENT, 32)));
        let left = format!("{left}1");
        let req = request(
            Some("10.0.0.1"),
            &[
                ("x-forwarded-for", h(&left)),
                ("x-forwarded-for", h("203.0.113.7")),
            ],
        );
        assert_eq!(extract(&ex, &req), Err(MissingKey::Invalid));
    }

    #[test]
    fn mock_connect_info_is_a_peer() {
        let mut req = request(None, &[]);
        req.extensions_mut()
            .insert(MockConnectInfo(SocketAddr::from((CLIENT, 1337))));
        assert_eq!(extract(&ClientIp::peer(), &req), Ok(v4(CLIENT, 32)));
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
            ConfigError::Other("IPv4 prefix /33 is invalid: it must be between 0 and 32".into())
        );
        assert!(ClientIp::peer().ipv6_prefix(128).is_ok());
        assert_eq!(
            ClientIp::peer().ipv6_prefix(129).unwrap_err(),
            ConfigError::Other("IPv6 prefix /129 is invalid: it must be between 0 and 128".into())
        );
    }

    #[test]
    fn cidr_parse() {
        let ok = [
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("10.1.2.3", "10.1.2.3/32"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("2001:db8::/32", "2001:db8::/32"),
            ("2001:db8::1", "2001:db8::1/128"),
            ("::/0", "::/0"),
            ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
            ("::ffff:10.1.2.3", "10.1.2.3/32"),
        ];
        for (input, shown) in ok {
            assert_eq!(input.parse::<Cidr>().unwrap().to_string(), shown, "{input}");
        }
        let bad = [
            ("10.0.0.1/8", "invalid CIDR \"10.0.0.1/8\": bits are set past the prefix (write the network's first address)"),
            ("10.0.0.0/33", "invalid CIDR \"10.0.0.0/33\": the prefix length is not a number within the address's bits"),
            ("2001:db8::/129", "invalid CIDR \"2001:db8::/129\": the prefix length is not a number within the address's bits"),
            ("10.0.0.0/+8", "invalid CIDR \"10.0.0.0/+8\": the prefix length is not a number within the address's bits"),
            ("10.0.0.0/", "invalid CIDR \"10.0.0.0/\": the prefix length is not a number within the address's bits"),
            ("10.0.0.0/0008", "invalid CIDR \"10.0.0.0/0008\": the prefix length is not a number within the address's bits"),
            ("10.0.0.0/999", "invalid CIDR \"10.0.0.0/999\": the prefix length is not a number within the address's bits"),
            ("10.0.0/8", "invalid CIDR \"10.0.0/8\": not an IP address"),
            (" 10.0.0.0/8", "invalid CIDR \" 10.0.0.0/8\": not an IP address"),
            ("[::1]/128", "invalid CIDR \"[::1]/128\": not an IP address"),
            ("", "invalid CIDR \"\": not an IP address"),
        ];
        for (input, message) in bad {
            let err = input.parse::<Cidr>().unwrap_err();
            assert_eq!(err.to_string(), message);
            assert_eq!(err.input(), input);
        }
        assert_eq!(
            Cidr::new("10.0.0.1".parse().unwrap(), 8)
                .unwrap_err()
                .input(),
            "10.0.0.1/8"
        );
    }

    #[test]
    fn cidr_contains() {
        let cases = [
            ("10.0.0.0/8", "10.255.255.255", true),
            ("10.0.0.0/8", "11.0.0.0", false),
            ("10.0.0.0/8", "::ffff:10.0.0.1", true),
            ("10.0.0.0/8", "::a00:1", false),
            ("10.1.2.3", "10.1.2.3", true),
            ("10.1.2.3", "10.1.2.4", false),
            ("0.0.0.0/0", "1.2.3.4", true),
            ("0.0.0.0/0", "2001:db8::1", false),
            ("2001:db8::/32", "2001:db8:ffff::1", true),
            ("2001:db8::/32", "2001:db9::1", false),
            ("2001:db8::/32", "10.0.0.1", false),
            ("::/0", "2001:db8::1", true),
        ];
        for (cidr, ip, want) in cases {
            let cidr: Cidr = cidr.parse().unwrap();
            assert_eq!(cidr.contains(ip.parse().unwrap()), want, "{cidr} {ip}");
        }
    }

    #[test]
    fn cloudflare_list_parses_completely() {
        let parsed: Vec<Cidr> = parse_list(include_str!("cloudflare.txt"))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(parsed.len(), 22);
        assert_eq!(parsed.iter().filter(|c| c.addr().is_ipv4()).count(), 15);
        assert_eq!(TrustedProxies::cloudflare().cidrs(), &parsed[..]);
        let cf = TrustedProxies::cloudflare();
        for ip in [
            "173.245.48.5",
            "104.16.0.1",
            "131.0.75.255",
            "2606:4700::1",
            "2a06:98c7::1",
        ] {
            assert!(cf.contains(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "::1",
            "173.245.64.0",
            "2a06:98c8::1",
        ] {
            assert!(!cf.contains(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn trusted_proxies_combine() {
        assert!(!TrustedProxies::none().contains("10.0.0.1".parse().unwrap()));
        assert!(TrustedProxies::none().cidrs().is_empty());
        let trusted = TrustedProxies::none()
            .with("10.0.0.0/8".parse().unwrap())
            .extend(TrustedProxies::parse(&["192.168.0.0/16", "fd00::/8"]).unwrap());
        assert_eq!(trusted.cidrs().len(), 3);
        for ip in ["10.1.1.1", "192.168.3.4", "fd12::1", "::ffff:192.168.0.1"] {
            assert!(trusted.contains(ip.parse().unwrap()), "{ip}");
        }
        assert!(!trusted.contains("172.16.0.1".parse().unwrap()));
        assert_eq!(
            TrustedProxies::parse(&["10.0.0.0/8", "nope"])
                .unwrap_err()
                .input(),
            "nope"
        );
    }

    #[test]
    fn forwarded_header_names() {
        assert_eq!(
            ForwardedHeader::CfConnectingIp.as_str(),
            CF_CONNECTING_IP.as_str()
        );
        assert_eq!(
            ForwardedHeader::XForwardedFor.as_str(),
            X_FORWARDED_FOR.as_str()
        );
    }
}
