//! Property tests: key extraction over arbitrary header values and query strings. No input
//! panics, and each gives a key, a missing key or an invalid key, as a simple model of the
//! rules says: never a silent default (such as the proxy's own address).

#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::extract::ConnectInfo;
use http::{HeaderValue, Request};
use proptest::prelude::*;
use tollgate::key::{ClientIp, KeyExtractor, MissingKey, RequestView, Tenant, TrustedProxies};

const PROXY: &str = "10.0.0.1";

/// Bytes a header value may hold: visible ASCII, space, tab and any byte from 0x80.
fn header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff],
        0..max,
    )
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o))),
        any::<[u8; 16]>().prop_map(|o| IpAddr::V6(Ipv6Addr::from(o))),
        // Trusted proxies, so that a walk goes on past them.
        (0u8..4).prop_map(|n| IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))),
    ]
}

/// One entry of an `X-Forwarded-For` list: an address with spaces around it, or junk.
fn entry() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (ip(), " {0,2}", " {0,2}").prop_map(|(ip, a, b)| format!("{a}{ip}{b}")),
        1 => "[ -~]{0,12}".prop_filter("no comma", |s| !s.contains(',')),
    ]
}

fn request(peer: &str, header: &str, value: &[u8]) -> Option<Request<()>> {
    let value = HeaderValue::from_bytes(value).ok()?;
    let mut req = Request::get("/").header(header, value).body(()).unwrap();
    let peer: IpAddr = peer.parse().unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(peer, 40_000)));
    Some(req)
}

/// The key `ClientIp::peer()` gives a request from `ip`: what a forwarded address must key as.
fn key_of(ip: IpAddr) -> Vec<u8> {
    let mut req = Request::get("/").body(()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(ip, 1)));
    ClientIp::peer()
        .extract(&RequestView::new(&req))
        .unwrap()
        .as_bytes()
        .to_vec()
}

fn parse(entry: &[u8]) -> Option<IpAddr> {
    std::str::from_utf8(entry.trim_ascii()).ok()?.parse().ok()
}

fn extract(ex: &impl KeyExtractor, req: &Request<()>) -> Result<Vec<u8>, MissingKey> {
    ex.extract(&RequestView::new(req))
        .map(|k| k.as_bytes().to_vec())
}

/// The rules for a tenant value: trimmed, 1 to 255 bytes of `[A-Za-z0-9._:-]`, lowercased.
fn tenant_model(raw: &[u8]) -> Result<Vec<u8>, MissingKey> {
    let v = raw.trim_ascii();
    if v.is_empty() {
        return Err(MissingKey::Invalid);
    }
    if v.len() > 255 {
        return Err(MissingKey::TooLong);
    }
    if !v
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(b))
    {
        return Err(MissingKey::Invalid);
    }
    Ok(v.to_ascii_lowercase())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_tenant_header_is_a_valid_key_or_says_why_not(value in header_bytes(300)) {
        let Some(req) = request("203.0.113.7", "x-shop", &value) else { return Ok(()) };
        let got = extract(&Tenant::header("x-shop"), &req);
        prop_assert_eq!(got, tenant_model(&value));
    }

    #[test]
    fn a_tenant_query_parameter_must_appear_once(
        pairs in prop::collection::vec(
            (
                prop_oneof![Just("shop"), Just("sh%6Fp"), Just("sh%6fp"), Just("Shop"), Just("page")],
                "[A-Za-z0-9._:~%+-]{0,20}",
            ),
            0..5,
        ),
    ) {
        let query: Vec<String> = pairs.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let uri = format!("/orders?{}", query.join("&"));
        let req = Request::get(uri.as_str()).body(()).unwrap();
        let named: Vec<&String> = pairs
            .iter()
            .filter(|(n, _)| matches!(*n, "shop" | "sh%6Fp" | "sh%6fp"))
            .map(|(_, v)| v)
            .collect();
        let want = match named.as_slice() {
            [] => Err(MissingKey::Absent),
            [one] => tenant_model(one.as_bytes()),
            _ => Err(MissingKey::Invalid),
        };
        prop_assert_eq!(extract(&Tenant::query("shop"), &req), want);
    }

    #[test]
    fn cf_connecting_ip_from_a_trusted_proxy_is_the_address_it_names_or_invalid(
        value in prop_oneof![
            header_bytes(80),
            (ip(), " {0,3}").prop_map(|(ip, pad)| format!("{pad}{ip}{pad}").into_bytes()),
        ],
    ) {
        let ex = ClientIp::cf_connecting_ip(TrustedProxies::parse(&["10.0.0.0/8"]).unwrap());
        let Some(req) = request(PROXY, "cf-connecting-ip", &value) else { return Ok(()) };
        let want = parse(&value).map(key_of).ok_or(MissingKey::Invalid);
        prop_assert_eq!(extract(&ex, &req), want);
    }

    #[test]
    fn x_forwarded_for_is_walked_from_the_right_and_never_defaults_to_the_proxy(
        list in prop_oneof![
            prop::collection::vec(entry(), 1..40).prop_map(|e| e.join(",").into_bytes()),
            header_bytes(200),
        ],
    ) {
        let trusted = TrustedProxies::parse(&["10.0.0.0/8"]).unwrap();
        let ex = ClientIp::x_forwarded_for(trusted.clone());
        let Some(req) = request(PROXY, "x-forwarded-for", &list) else { return Ok(()) };
        // The model: from the right, the first address that is not a trusted proxy; an entry
        // that is not an address, or more than 32 entries walked, makes it invalid; a list of
        // proxies only names its leftmost.
        let mut want = Err(MissingKey::Invalid);
        for (walked, e) in list.rsplit(|&b| b == b',').enumerate() {
            if walked == 32 {
                want = Err(MissingKey::Invalid);
                break;
            }
            match parse(e) {
                None => {
                    want = Err(MissingKey::Invalid);
                    break;
                }
                Some(ip) if !trusted.contains(ip) => {
                    want = Ok(key_of(ip));
                    break;
                }
                Some(ip) => want = Ok(key_of(ip)),
            }
        }
        prop_assert_eq!(extract(&ex, &req), want);
    }
}
