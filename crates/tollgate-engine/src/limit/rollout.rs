//! A limit rolled out to a share of its keys: which keys it enforces, decided by a fixed hash
//! of the key so that every replica, every run and every version agrees.

use crate::error::ConfigError;
use crate::limit::Limit;
use crate::sip::SipKey;

/// The hash of a key's share: SipHash-2-4 under a fixed, public key. It must never change:
/// replicas of two versions in one deployment would split a client's requests otherwise.
const SHARE_HASH: SipKey<2, 4> = SipKey::new(0x746f_6c6c_6761_7465, 0x726f_6c6c_6f75_7421);

/// The share `key` belongs to, 0 to 99: a limit enforced on `p` percent of its keys enforces
/// the keys whose share is below `p`. The same key has the same share on every replica, in
/// every run, under every limit, so raising `p` only adds keys to the enforced part.
///
/// It is not a secret: a client that can choose its key (an API key it makes up, not an
/// address) could choose one outside a partial rollout.
pub fn rollout_share(key: &[u8]) -> u8 {
    // The high bits of the hash times 100, without the bias of a remainder.
    ((u128::from(SHARE_HASH.hash(0, key)) * 100) >> 64) as u8
}

impl Limit {
    /// This limit enforced on `percent` of its keys and shadow for the rest: 0 is
    /// [shadow](Self::shadow), 100 (the default) is enforced. A key's side is decided by a
    /// fixed hash of its bytes ([`rollout_share`]), so a client is in or out consistently, on every
    /// replica; a request outside the share is checked and counted as under a shadow limit
    /// (consumes when admitted, reported, never refused). A request without a key is in no
    /// share: below 100 it skips the limit as a shadow limit's would.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidEnforcePercent`] above 100.
    pub fn enforce_percent(mut self, percent: u32) -> Result<Self, ConfigError> {
        self.enforce_percent = match u8::try_from(percent) {
            Ok(p) if p <= 100 => p,
            _ => return Err(ConfigError::InvalidEnforcePercent(percent)),
        };
        Ok(self)
    }

    /// The share of keys the limit enforces, in percent (0: shadow, 100: enforced).
    pub fn enforced_percent(&self) -> u8 {
        self.enforce_percent
    }

    /// Whether the limit refuses `key`'s requests when they are over it: `key` lies in the
    /// enforced share.
    #[inline]
    pub fn enforces(&self, key: &[u8]) -> bool {
        match self.enforce_percent {
            100 => true,
            0 => false,
            p => rollout_share(key) < p,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Quota;

    fn limit() -> Limit {
        Limit::gcra("l", Quota::per_minute(1).unwrap()).unwrap()
    }

    #[test]
    fn shares_never_change() {
        // Pinned: a change would move clients across the line between two versions.
        let shares: Vec<u8> = [&b""[..], b"a", b"tenant-1", b"\x04\x0a\x00\x00\x01"]
            .iter()
            .map(|k| rollout_share(k))
            .collect();
        assert_eq!(shares, PINNED);
    }

    const PINNED: [u8; 4] = [92, 23, 37, 74];

    #[test]
    fn the_percent_is_bounded_and_zero_is_shadow() {
        assert!(matches!(
            limit().enforce_percent(101),
            Err(ConfigError::InvalidEnforcePercent(101))
        ));
        assert!(limit().enforce_percent(0).unwrap().is_shadow());
        assert!(!limit().enforce_percent(1).unwrap().is_shadow());
        assert_eq!(limit().shadow().enforced_percent(), 0);
        assert_eq!(limit().enforced_percent(), 100);
    }

    #[test]
    fn keys_split_by_share_and_a_higher_percent_only_adds_keys() {
        let keys: Vec<[u8; 4]> = (0u32..10_000).map(u32::to_be_bytes).collect();
        let count = |p| {
            let l = limit().enforce_percent(p).unwrap();
            keys.iter().filter(|k| l.enforces(&k[..])).count()
        };
        assert_eq!([count(0), count(30), count(100)], [0, 3_021, 10_000]);
        let (l30, l60) = (
            limit().enforce_percent(30).unwrap(),
            limit().enforce_percent(60).unwrap(),
        );
        assert!(keys.iter().all(|k| !l30.enforces(k) || l60.enforces(k)));
    }
}
