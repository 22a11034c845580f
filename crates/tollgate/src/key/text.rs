//! Keys shown to operators: a fingerprint, or the text of the identity a key was made from
//! ([`KeyExtractor::identity_of`](super::KeyExtractor::identity_of)).

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr};

use sha2::{Digest, Sha256};

/// Hex digits of a [`fingerprint`].
const FINGERPRINT_HEX: usize = 12;

/// How reports name a key by default: `#` and the first 12 hex digits (48 bits) of SHA-256
/// over `"tollgate/fingerprint\0"` and the key's bytes.
///
/// A fingerprint tells keys apart and lets a person who holds an identity check it (compute
/// `identity_of(key_of(identity))`, or call this on the key's bytes), but it hides only what
/// cannot be guessed: a short or well-known identity (an IPv4 address, one of 2^32) is found
/// by trying them all. It is the same in every process and for every limit.
///
/// ```
/// let f = tollgate::key::fingerprint(b"203.0.113.7");
/// assert_eq!(f.len(), 13);
/// assert!(f.starts_with('#'));
/// assert_eq!(f, tollgate::key::fingerprint(b"203.0.113.7"));
/// ```
pub fn fingerprint(key: &[u8]) -> String {
    let mut out = String::with_capacity(1 + FINGERPRINT_HEX);
    out.push('#');
    push_digest(&mut out, key, FINGERPRINT_HEX);
    out
}

/// Appends the first `digits` hex digits of the key's fingerprint digest to `out`.
pub(crate) fn push_digest(out: &mut String, key: &[u8], digits: usize) {
    let digest = Sha256::new()
        .chain_update(b"tollgate/fingerprint\0")
        .chain_update(key)
        .finalize();
    for b in digest.iter().take(digits.div_ceil(2)) {
        let _ = write!(out, "{b:02x}");
    }
    out.truncate(out.len() - digits % 2);
}

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
