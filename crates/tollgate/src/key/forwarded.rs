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
/// longer is an attempt to make every request expensive. The bytes are counted from the right
/// end: what lies further left (the client's own entries) is never read, so a client cannot
/// make the header too long to read by writing more of it.
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
    let mut walked = 0;
    let mut leftmost = None;
    // The bytes left to read, from the right end of the values joined with ",".
    let mut budget = MAX_XFF_BYTES;
    for value in values.iter().rev() {
        let bytes = value.as_bytes();
        // Only the value's last `budget` bytes are read; if they start inside an entry, that
        // piece of it is never taken for one.
        let start = bytes.len().saturating_sub(budget);
        let partial = start > 0 && bytes.get(start - 1) != Some(&b',');
        let read = &bytes[start..];
        budget = budget.saturating_sub(read.len() + 1);
        let mut entries = read.rsplit(|&b| b == b',').peekable();
        while let Some(entry) = entries.next() {
            walked += 1;
            if walked > MAX_XFF_ENTRIES || (partial && entries.peek().is_none()) {
                return Err(MissingKey::Invalid);
            }
            let ip = parse_ip(entry)?;
            if !trusted.contains(ip) {
                return Ok(ip);
            }
            leftmost = Some(ip);
        }
        if start > 0 {
            // Entries remain, beyond the bytes read.
            return Err(MissingKey::Invalid);
        }
    }
    // No value: no header. Every value yields at least one entry, so `leftmost` is set once
    // one was walked.
    leftmost.ok_or(MissingKey::Absent)
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
