//! The headers that name the client when the peer is a trusted proxy.

use std::net::IpAddr;

use http::header::{HeaderMap, HeaderName};

use super::proxies::TrustedProxies;
use super::MissingKey;

const CF_CONNECTING_IP: HeaderName = HeaderName::from_static("cf-connecting-ip");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The longest textual IP address (`ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255`).
const MAX_IP_TEXT: usize = 45;

/// Bounds on the `X-Forwarded-For` walk: a real proxy chain is a handful of hops, so anything
/// longer is an attempt to make every request expensive.
const MAX_XFF_ENTRIES: usize = 32;
const MAX_XFF_BYTES: usize = 4096;

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

pub(super) fn cf_connecting_ip(headers: &HeaderMap) -> Result<IpAddr, MissingKey> {
    let mut values = headers.get_all(CF_CONNECTING_IP).into_iter();
    let value = values.next().ok_or(MissingKey::Absent)?;
    if values.next().is_some() {
        return Err(MissingKey::Invalid);
    }
    parse_ip(value.as_bytes())
}

pub(super) fn x_forwarded_for(
    headers: &HeaderMap,
    trusted: &TrustedProxies,
) -> Result<IpAddr, MissingKey> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
