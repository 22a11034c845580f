//! `ClientIp`'s unit tests.

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
    ClientIp::x_forwarded_for(TrustedProxies::parse(&["10.0.0.0/8", "2001:db8:ff::/48"]).unwrap())
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
