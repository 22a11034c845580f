//! Trusted proxies: IP networks ([`Cidr`]) and the list of proxies whose forwarded headers are
//! believed ([`TrustedProxies`]), with Cloudflare's published ranges shipped as data.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

/// `::ffff:a.b.c.d` is how dual-stack sockets report IPv4 clients: the same client as `a.b.c.d`.
pub(super) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

pub(super) fn mask_v4(addr: Ipv4Addr, bits: u8) -> Ipv4Addr {
    let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
    Ipv4Addr::from(u32::from(addr) & mask)
}

pub(super) fn mask_v6(addr: Ipv6Addr, bits: u8) -> Ipv6Addr {
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
#[derive(Clone, PartialEq, Eq)]
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

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong.
impl fmt::Debug for InvalidCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
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
    pub(crate) fn from_cidrs<I: IntoIterator<Item = Cidr>>(cidrs: I) -> Self {
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
    use super::*;

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
            // What `main() -> Result<(), Box<dyn Error>>` prints says the same.
            assert_eq!(format!("{err:?}"), message);
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
}
