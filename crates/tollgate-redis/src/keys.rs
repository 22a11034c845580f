//! Redis key names: `<prefix>:<limit name>:{<digest>}`.
//!
//! The digest is SHA-256 over a domain-separated encoding of (limit name, key bytes), or
//! HMAC-SHA256 of it under the backend's key secret ([`Keyer`]), cut to 16 bytes: raw
//! identities never reach Redis, every key of a limit has the same length, and one limit's key
//! can never be another's. The hash tag wraps the digest, not the prefix, so a cluster spreads
//! identities over its hash slots.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tollgate_engine::MAX_NAME_LEN;

/// The domain separator of version 1 of the key encoding.
const DOMAIN: &[u8] = b"tollgate/v1\0";

/// Bytes of SHA-256 kept.
pub(crate) const DIGEST_LEN: usize = 16;

/// The most bytes of a key prefix.
pub(crate) const MAX_PREFIX_LEN: usize = 64;

pub(crate) type KeyDigest = [u8; DIGEST_LEN];

/// The digest of one (limit, key) pair, unkeyed (a backend without a key secret).
#[cfg(test)]
pub(crate) fn digest(limit_name: &str, key: &[u8]) -> KeyDigest {
    Keyer::default().digest(limit_name, key)
}

/// How a backend digests (limit, key) pairs: SHA-256, or HMAC-SHA256 under its key secret.
/// Cheap to clone: the keyed states are shared.
#[derive(Clone, Default)]
pub(crate) struct Keyer {
    hmac: Option<Arc<Hmac>>,
}

/// HMAC-SHA256 (RFC 2104) under one secret: the hash states after the secret's inner and
/// outer pads, so that a digest costs two hashes of the message's length, not four.
struct Hmac {
    inner: Sha256,
    outer: Sha256,
}

/// SHA-256's block size, in bytes.
const BLOCK: usize = 64;

impl Hmac {
    fn new(secret: &[u8]) -> Self {
        // A secret longer than a block is hashed first; a shorter one is padded with zeros.
        let mut block = [0u8; BLOCK];
        if secret.len() > BLOCK {
            block[..32].copy_from_slice(&Sha256::digest(secret));
        } else {
            block[..secret.len()].copy_from_slice(secret);
        }
        let pad = |byte: u8| {
            let mut h = Sha256::new();
            h.update(block.map(|b| b ^ byte));
            h
        };
        Self {
            inner: pad(0x36),
            outer: pad(0x5c),
        }
    }

    fn finish(&self, inner: Sha256) -> [u8; 32] {
        let mut outer = self.outer.clone();
        outer.update(inner.finalize());
        outer.finalize().into()
    }
}

impl Keyer {
    /// Digests keyed by `secret`; an empty secret keys nothing (plain SHA-256).
    pub(crate) fn new(secret: &[u8]) -> Self {
        Self {
            hmac: (!secret.is_empty()).then(|| Arc::new(Hmac::new(secret))),
        }
    }

    /// Whether a secret keys the digests.
    pub(crate) fn is_keyed(&self) -> bool {
        self.hmac.is_some()
    }

    /// The digest of one (limit, key) pair.
    pub(crate) fn digest(&self, limit_name: &str, key: &[u8]) -> KeyDigest {
        let mut h = match &self.hmac {
            Some(hmac) => hmac.inner.clone(),
            None => Sha256::new(),
        };
        h.update(DOMAIN);
        h.update(len_be(limit_name.len()));
        h.update(limit_name.as_bytes());
        h.update(len_be(key.len()));
        h.update(key);
        let full: [u8; 32] = match &self.hmac {
            Some(hmac) => hmac.finish(h),
            None => h.finalize().into(),
        };
        let mut out = [0u8; DIGEST_LEN];
        out.copy_from_slice(&full[..DIGEST_LEN]);
        out
    }
}

impl fmt::Debug for Keyer {
    /// Whether the digests are keyed, never the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyer")
            .field("keyed", &self.is_keyed())
            .finish()
    }
}

fn len_be(len: usize) -> [u8; 4] {
    // Longer inputs saturate; both the name (64 bytes at most) and realistic keys fit.
    u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes()
}

/// The base key of a limit's state for one identity: `<prefix>:<name>:{<hex digest>}`.
pub(crate) fn base_key(prefix: &str, limit_name: &str, digest: &KeyDigest) -> String {
    String::from_utf8_lossy(BaseKey::new(prefix, limit_name, digest).as_bytes()).into_owned()
}

/// The most bytes of a base key: prefix, `:`, name, `:{`, hex digest, `}`.
const MAX_BASE_KEY_LEN: usize = MAX_PREFIX_LEN + 1 + MAX_NAME_LEN + 2 + 2 * DIGEST_LEN + 1;

/// The most bytes a suffix adds to a base key: `:` and a window index of up to 20 digits.
const MAX_SUFFIX_LEN: usize = 21;

/// What follows the base key in the name of one of its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Suffix {
    /// The base key itself (no state lives there now; tests name it).
    #[cfg(test)]
    None,
    /// `:v3`: a GCRA TAT, the emission interval it was written under, when the key's
    /// sanctions end and when its run began (`<tat>:<interval>:<until>:<since>`, see
    /// `tat.lua`). The TAT alone lived at the base key, then `<tat>:<interval>[:<until>]` at
    /// `:v2`; each new name keeps replicas that still read the older value from taking the
    /// new one for an empty bucket, or failing on it.
    Tat,
    /// `:<index>`: a fixed window's count.
    Window(u64),
    /// `:log`: a sliding log.
    Log,
    /// `:seq`: a sliding log's sequence counter.
    Seq,
    /// `:slots`: a concurrency limit's slots in flight (a sorted set of slot ids by deadline).
    Slots,
    /// `:pb`: the key's sanctions (refusals toward a penalty, a block, a deny), as
    /// `<refusals>:<window end>:<blocked until>:<strikes>:<strikes until>:<denied until>`.
    Sanction,
}

/// `n` in decimal at the end of `digits`; returns where it starts.
pub(crate) fn decimal(mut n: u64, digits: &mut [u8; 20]) -> usize {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return at;
        }
    }
}

/// A key written on the stack: every call writes each check's key, and a `String` per check
/// would be an allocation per check.
#[derive(Clone)]
pub(crate) struct BaseKey {
    buf: [u8; MAX_BASE_KEY_LEN + MAX_SUFFIX_LEN],
    len: usize,
}

impl BaseKey {
    /// `<prefix>:<limit name>:{<hex digest>}`; a prefix or name longer than the checked maximum
    /// (which the builders refuse) is cut.
    pub(crate) fn new(prefix: &str, limit_name: &str, digest: &KeyDigest) -> Self {
        let mut key = Self {
            buf: [0; MAX_BASE_KEY_LEN + MAX_SUFFIX_LEN],
            len: 0,
        };
        key.push(&prefix.as_bytes()[..prefix.len().min(MAX_PREFIX_LEN)]);
        key.push(b":");
        key.push(&limit_name.as_bytes()[..limit_name.len().min(MAX_NAME_LEN)]);
        key.push(b":{");
        key.push(&hex(digest));
        key.push(b"}");
        key
    }

    /// This key with `suffix` appended; all of a base key's keys share its hash tag.
    pub(crate) fn with(mut self, suffix: Suffix) -> Self {
        match suffix {
            #[cfg(test)]
            Suffix::None => {}
            Suffix::Window(index) => {
                let mut digits = [0u8; 20];
                let at = decimal(index, &mut digits);
                self.push(b":");
                self.push(&digits[at..]);
            }
            Suffix::Tat => self.push(b":v3"),
            Suffix::Log => self.push(b":log"),
            Suffix::Seq => self.push(b":seq"),
            Suffix::Slots => self.push(b":slots"),
            Suffix::Sanction => self.push(b":pb"),
        }
        self
    }

    fn push(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        if let Some(dst) = self.buf.get_mut(self.len..end) {
            dst.copy_from_slice(bytes);
            self.len = end;
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// The digest in lowercase hex: the key's hash tag.
fn hex(digest: &KeyDigest) -> [u8; 2 * DIGEST_LEN] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0; 2 * DIGEST_LEN];
    for (pair, b) in out.chunks_exact_mut(2).zip(digest) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 0xf)];
    }
    out
}

/// The cluster hash slot of every key of `digest`: its hash tag is the hex digest.
pub(crate) fn digest_hash_slot(digest: &KeyDigest) -> u16 {
    crc16(&hex(digest)) & 0x3fff
}

/// Whether `prefix` may start keys: 1 to 64 characters of `[A-Za-z0-9_.:-]` (no `{`, which
/// would move the cluster hash tag).
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= MAX_PREFIX_LEN
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// The Redis Cluster hash slot of a key, computed as Redis does: CRC16 (XMODEM) of the hash
/// tag (the part between the first `{` and the next `}`, if not empty) modulo 16384. The
/// backend needs only [`digest_hash_slot`]; this checks it.
#[cfg(test)]
pub(crate) fn hash_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16(tagged) & 0x3fff
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_redis() {
        // The check value of CRC-16/XMODEM, and hash slots from `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(hash_slot("foo"), 12_182);
        assert_eq!(
            hash_slot("{user1000}.following"),
            hash_slot("{user1000}.followers")
        );
        assert_eq!(hash_slot("foo{}{bar}"), hash_slot("foo{}{bar}"));
        assert_eq!(hash_slot("{}x"), crc16(b"{}x") & 0x3fff);
    }

    #[test]
    fn the_hash_slot_of_a_digest_is_that_of_its_keys() {
        let d = digest("login", b"10.0.0.1");
        let key = base_key("tollgate", "login", &d);
        assert_eq!(digest_hash_slot(&d), hash_slot(&key));
        assert_eq!(digest_hash_slot(&d), hash_slot(&format!("{key}:20000")));
    }

    #[test]
    fn every_key_of_a_digest_is_in_its_hash_slot() {
        let d = digest("login", b"10.0.0.1");
        let name = |suffix| {
            let key = BaseKey::new("tollgate", "login", &d).with(suffix);
            String::from_utf8(key.as_bytes().to_vec()).unwrap()
        };
        let base = base_key("tollgate", "login", &d);
        assert_eq!(name(Suffix::None), base);
        assert_eq!(name(Suffix::Window(0)), format!("{base}:0"));
        assert_eq!(
            name(Suffix::Window(u64::MAX)),
            format!("{base}:{}", u64::MAX)
        );
        assert_eq!(name(Suffix::Log), format!("{base}:log"));
        assert_eq!(name(Suffix::Seq), format!("{base}:seq"));
        for suffix in [
            Suffix::None,
            Suffix::Window(480_000),
            Suffix::Log,
            Suffix::Seq,
        ] {
            assert_eq!(hash_slot(&name(suffix)), digest_hash_slot(&d));
        }
    }

    #[test]
    fn keys_have_a_fixed_length_and_a_tag_around_the_digest() {
        let a = base_key("tollgate", "login", &digest("login", b"10.0.0.1"));
        let b = base_key(
            "tollgate",
            "login",
            &digest("login", "x".repeat(500).as_bytes()),
        );
        assert_eq!(a.len(), b.len());
        assert!(a.starts_with("tollgate:login:{") && a.ends_with('}'));
        assert!(!a.contains("10.0.0.1"));
        assert_eq!(a.len(), "tollgate:login:{}".len() + 32);
    }

    #[test]
    fn the_encoding_separates_name_and_key() {
        // Without lengths, ("ab", "c") and ("a", "bc") would hash the same bytes.
        assert_ne!(digest("ab", b"c"), digest("a", b"bc"));
        assert_ne!(digest("a", b""), digest("b", b""));
        assert_eq!(digest("a", b"k"), digest("a", b"k"));
    }

    /// HMAC-SHA256 as RFC 4231 defines it (test cases 1, 2 and 6: a short secret, a short
    /// text secret, a secret longer than a block).
    #[test]
    fn hmac_matches_rfc_4231() {
        let hmac = |secret: &[u8], data: &[u8]| {
            let h = Hmac::new(secret);
            let mut inner = h.inner.clone();
            inner.update(data);
            let out = h.finish(inner);
            out.iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        assert_eq!(
            hmac(&[0x0b; 20], b"Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hmac(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hmac(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            ),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_secret_keys_the_digest() {
        let plain = Keyer::default();
        let a = Keyer::new(b"secret-a");
        let a2 = Keyer::new(b"secret-a");
        let b = Keyer::new(b"secret-b");
        assert_eq!(plain.digest("login", b"k"), digest("login", b"k"));
        assert_eq!(Keyer::new(b"").digest("login", b"k"), digest("login", b"k"));
        assert_ne!(a.digest("login", b"k"), plain.digest("login", b"k"));
        assert_eq!(a.digest("login", b"k"), a2.digest("login", b"k"));
        assert_ne!(a.digest("login", b"k"), b.digest("login", b"k"));
        assert_ne!(a.digest("ab", b"c"), a.digest("a", b"bc"));
        assert_eq!(format!("{a:?}"), "Keyer { keyed: true }");
        assert_eq!(format!("{plain:?}"), "Keyer { keyed: false }");
    }

    #[test]
    fn prefixes_are_validated() {
        assert!(valid_prefix("tollgate"));
        assert!(valid_prefix("app:rl-v2"));
        assert!(!valid_prefix(""));
        assert!(!valid_prefix("a{b}"));
        assert!(!valid_prefix("has space"));
        assert!(!valid_prefix(&"p".repeat(65)));
    }
}
