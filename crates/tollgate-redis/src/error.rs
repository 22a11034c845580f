//! Why a [`RedisBackend`](crate::RedisBackend) could not be built.

use std::fmt;
use std::time::Duration;

/// A [`RedisBackendBuilder`](crate::RedisBackendBuilder) configuration that cannot be built.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuildError {
    /// None of [`url`](crate::RedisBackendBuilder::url),
    /// [`cluster`](crate::RedisBackendBuilder::cluster) and
    /// [`sentinel`](crate::RedisBackendBuilder::sentinel) was called.
    NoServer,
    /// [`cluster`](crate::RedisBackendBuilder::cluster) was given no seed URL.
    NoClusterSeeds,
    /// [`sentinel`](crate::RedisBackendBuilder::sentinel) was given no sentinel URL.
    NoSentinels,
    /// [`sentinel`](crate::RedisBackendBuilder::sentinel) was given an empty master name.
    NoMasterName,
    /// A URL that the Redis client cannot use.
    InvalidUrl {
        /// What the client said of it. The URL itself is left out: it may hold a password.
        reason: String,
    },
    /// A `rediss://` (or `valkeys://`) URL, in a build without the crate's `tls` feature.
    TlsNotEnabled,
    /// TLS settings that cannot be used: a CA or client certificate PEM that cannot be read or
    /// holds no certificate, certificates given for URLs that are not `rediss://`, or a
    /// `#insecure` URL.
    Tls {
        /// What is wrong. Never the key itself.
        reason: String,
    },
    /// A key prefix that is empty, longer than 64 bytes, or has characters outside
    /// `[A-Za-z0-9_.:-]`.
    InvalidPrefix {
        /// The prefix given, cut to 80 characters.
        prefix: String,
    },
    /// A deadline of zero.
    ZeroDeadline,
    /// A connect timeout of zero.
    ZeroConnectTimeout,
    /// A [`key_secret`](crate::RedisBackendBuilder::key_secret) shorter than
    /// [`MIN_KEY_SECRET_LEN`](crate::MIN_KEY_SECRET_LEN) bytes.
    KeySecretTooShort {
        /// The secret's length in bytes (never the secret).
        len: usize,
    },
    /// A duration longer than its bound: the deadline past
    /// [`MAX_DEADLINE`](crate::MAX_DEADLINE), the deny cache's TTL past
    /// [`MAX_DENY_CACHE_TTL`](crate::MAX_DENY_CACHE_TTL).
    TooLong {
        /// The builder's setting (`deadline`, `deny_cache_ttl`).
        setting: &'static str,
        /// Its bound.
        max: Duration,
    },
}

impl BuildError {
    /// Whether the error is about a server's address (none given, none usable).
    pub fn is_server(&self) -> bool {
        matches!(
            self,
            Self::NoServer
                | Self::NoClusterSeeds
                | Self::NoSentinels
                | Self::NoMasterName
                | Self::InvalidUrl { .. }
                | Self::TlsNotEnabled
        )
    }
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoServer => {
                f.write_str("no Redis server: call .url(..), .cluster(..) or .sentinel(..)")
            }
            Self::NoClusterSeeds => f.write_str("a Redis Cluster needs at least one seed URL"),
            Self::NoSentinels => f.write_str("Redis Sentinel needs at least one sentinel URL"),
            Self::NoMasterName => f.write_str("Redis Sentinel needs the master's name"),
            Self::InvalidUrl { reason } => write!(f, "invalid Redis URL: {reason}"),
            Self::TlsNotEnabled => f.write_str(
                "a rediss:// URL needs TLS: enable the `tls` feature of tollgate-redis \
                 (tollgate-redis = { version = \"..\", features = [\"tls\"] })",
            ),
            Self::Tls { reason } => write!(f, "Redis TLS settings: {reason}"),
            Self::InvalidPrefix { prefix } => write!(
                f,
                "Redis key prefix {prefix:?} must be 1 to {} characters of [A-Za-z0-9_.:-]",
                crate::keys::MAX_PREFIX_LEN
            ),
            Self::ZeroDeadline => f.write_str("the Redis deadline must be longer than zero"),
            Self::ZeroConnectTimeout => {
                f.write_str("the Redis connect timeout must be longer than zero")
            }
            Self::KeySecretTooShort { len } => write!(
                f,
                "the Redis key secret is {len} bytes long: it needs at least {} random bytes",
                crate::MIN_KEY_SECRET_LEN
            ),
            Self::TooLong { setting, max } => write!(
                f,
                "the Redis backend's {setting} must be at most {} s",
                max.as_secs()
            ),
        }
    }
}

impl std::error::Error for BuildError {}
