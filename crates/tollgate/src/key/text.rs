//! Keys shown to operators: the text of the identity a key was made from
//! ([`KeyExtractor::identity_of`](super::KeyExtractor::identity_of)).

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr};

/// A key's text when it is UTF-8, else `0x` and its bytes in hex.
pub(crate) fn key_text(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) => text.to_owned(),
        Err(_) => hex(key),
    }
}

/// `0x` and the bytes in hex.
pub(crate) fn hex(key: &[u8]) -> String {
    let mut out = String::with_capacity(2 + 2 * key.len());
    out.push_str("0x");
    for b in key {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// A client address key (`ClientIp`'s: a version byte, the masked address, its prefix
/// length) as the address, or as its network when the prefix groups several; `None` for
/// bytes of another shape.
pub(crate) fn ip_key_text(key: &[u8]) -> Option<String> {
    let (ip, prefix, full) = match key {
        [4, a, b, c, d, prefix] => (Ipv4Addr::new(*a, *b, *c, *d).to_string(), *prefix, 32),
        [6, rest @ ..] if rest.len() == 17 => {
            let mut octets = [0; 16];
            octets.copy_from_slice(&rest[..16]);
            (Ipv6Addr::from(octets).to_string(), rest[16], 128)
        }
        _ => return None,
    };
    Some(if prefix >= full {
        ip
    } else {
        format!("{ip}/{prefix}")
    })
}
