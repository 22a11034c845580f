//! Configuration of a [`RedisBackend`].

use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::FakeClock;

use crate::backend::RedisBackend;
use crate::error::BuildError;
use crate::inner::Config;
use crate::keys::{self, Keyer};
use crate::tls::{blot, is_tls_url, redact_url, secrets_of, TlsFiles};
use crate::transport::conn::Target;
use crate::transport::direct::Login;
use clients::{certificates, client, sentinel_client};

mod clients;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";
/// The default deadline of one check.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(50);
/// The default number of entries of the local deny cache.
pub const DEFAULT_DENY_CACHE_CAPACITY: usize = 10_000;
/// How long, by default, the local deny cache answers a denial before Redis is asked again.
pub const DEFAULT_DENY_CACHE_TTL: Duration = Duration::from_secs(1);
/// The shortest [`key_secret`](RedisBackendBuilder::key_secret), in bytes.
pub const MIN_KEY_SECRET_LEN: usize = 16;
/// The longest [`deadline`](RedisBackendBuilder::deadline) a backend is built with: an hour.
/// A longer one is refused at build ([`BuildError::TooLong`]), not shortened: times are taken
/// from it while requests are served.
pub const MAX_DEADLINE: Duration = Duration::from_secs(3_600);
/// The longest [`deny_cache_ttl`](RedisBackendBuilder::deny_cache_ttl) a backend is built
/// with: an hour. A longer one is refused at build ([`BuildError::TooLong`]).
pub const MAX_DENY_CACHE_TTL: Duration = Duration::from_secs(3_600);

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_BREAKER_THRESHOLD: u32 = 3;
const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_millis(250);
const DEFAULT_BREAKER_MAX_OPEN_FOR: Duration = Duration::from_secs(5);

#[derive(Clone)]
enum Servers {
    None,
    Standalone(String),
    Cluster(Vec<String>),
    Sentinel {
        master: String,
        sentinels: Vec<String>,
    },
}

impl Servers {
    /// Every URL given.
    fn urls(&self) -> Vec<&str> {
        match self {
            Self::None => Vec::new(),
            Self::Standalone(url) => vec![url.as_str()],
            Self::Cluster(urls)
            | Self::Sentinel {
                sentinels: urls, ..
            } => urls.iter().map(String::as_str).collect(),
        }
    }
}

impl std::fmt::Debug for Servers {
    /// The URLs without their passwords.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        match self {
            Self::None => f.write_str("None"),
            Self::Standalone(url) => f.debug_tuple("Standalone").field(&redact_url(url)).finish(),
            Self::Cluster(urls) => f.debug_tuple("Cluster").field(&redacted(urls)).finish(),
            Self::Sentinel { master, sentinels } => f
                .debug_struct("Sentinel")
                .field("master", master)
                .field("sentinels", &redacted(sentinels))
                .finish(),
        }
    }
}

/// Configures a [`RedisBackend`]; made by [`RedisBackend::builder`].
///
/// Its `Debug` output shows the URLs with their passwords replaced by `***`, and not the
/// certificates.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate_redis::RedisBackend;
///
/// let backend = RedisBackend::builder()
///     .url("redis://127.0.0.1:6379/")
///     .prefix("myapp-rl")
///     .deadline(Duration::from_millis(20))
///     .breaker_threshold(5)
///     .deny_cache_capacity(50_000)
///     .build()?; // connects lazily: Redis need not be up
/// # drop(backend);
/// # Ok::<(), tollgate_redis::BuildError>(())
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisBackendBuilder {
    servers: Servers,
    prefix: String,
    deadline: Duration,
    connect_timeout: Duration,
    breaker_threshold: u32,
    breaker_open_for: Duration,
    breaker_max_open_for: Duration,
    deny_cache_capacity: usize,
    deny_cache_ttl: Duration,
    tls: TlsFiles,
    /// A test's clock, for every call's time.
    clock: Option<FakeClock>,
    /// Whether calls that fit it use the lean `CHECK` script (a test turns it off).
    lean: bool,
    /// The key secret's length and digests (its `Debug` never shows the secret).
    keyer: Option<(usize, Keyer)>,
}

impl Default for RedisBackendBuilder {
    fn default() -> Self {
        Self {
            servers: Servers::None,
            prefix: DEFAULT_PREFIX.to_owned(),
            deadline: DEFAULT_DEADLINE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            breaker_threshold: DEFAULT_BREAKER_THRESHOLD,
            breaker_open_for: DEFAULT_BREAKER_OPEN_FOR,
            breaker_max_open_for: DEFAULT_BREAKER_MAX_OPEN_FOR,
            deny_cache_capacity: DEFAULT_DENY_CACHE_CAPACITY,
            deny_cache_ttl: DEFAULT_DENY_CACHE_TTL,
            tls: TlsFiles::default(),
            clock: None,
            lean: true,
            keyer: None,
        }
    }
}

impl RedisBackendBuilder {
    /// Talks to one standalone Redis (or Valkey) server, such as `redis://127.0.0.1:6379/`.
    ///
    /// The URL may carry an ACL user and password, `redis://user:password@host:6379/` (or a
    /// password alone, `redis://:password@host/`; percent-encode `@`, `:` and `/` in them),
    /// and a database number, `redis://host/2`. Nothing this crate prints or logs shows the
    /// password: `Debug` and errors show `redis://user:***@host:6379/`.
    ///
    /// `rediss://` reaches the server over TLS; it needs the `tls` feature (see
    /// [`RedisBackendBuilder::tls_ca_pem`]), and without it [`build`](Self::build) fails with
    /// [`BuildError::TlsNotEnabled`].
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.servers = Servers::Standalone(url.into());
        self
    }

    /// Talks to a Redis Cluster, discovered from these seed nodes.
    ///
    /// `rediss://` seeds (all of them, then) reach every node over TLS, with the same
    /// certificates; the nodes must announce their TLS ports (`tls-cluster yes`).
    pub fn cluster<I, S>(mut self, urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.servers = Servers::Cluster(urls.into_iter().map(Into::into).collect());
        self
    }

    /// Talks to the master that Redis Sentinel knows as `master`, asking these sentinels
    /// (URLs such as `redis://127.0.0.1:26379/`) where it is.
    ///
    /// The master is looked up when a connection is made, and again whenever the connection
    /// breaks or the server answers `READONLY` (a master demoted to a replica by a failover):
    /// the next call asks the sentinels for the new master. Until a failover is over, checks
    /// fail and each limit applies its failure policy.
    ///
    /// `rediss://` sentinel URLs reach the sentinels over TLS, and then the master too, with
    /// the same certificates (a deployment with `tls-replication yes`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_redis::RedisBackend;
    ///
    /// let backend = RedisBackend::builder()
    ///     .sentinel(
    ///         "mymaster",
    ///         ["redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/", "redis://10.0.0.3:26379/"],
    ///     )
    ///     .build()?;
    /// # drop(backend);
    /// # Ok::<(), tollgate_redis::BuildError>(())
    /// ```
    pub fn sentinel<I, S>(mut self, master: impl Into<String>, sentinels: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.servers = Servers::Sentinel {
            master: master.into(),
            sentinels: sentinels.into_iter().map(Into::into).collect(),
        };
        self
    }

    /// The first part of every key (default `tollgate`): 1 to 64 characters of
    /// `[A-Za-z0-9_.:-]`. Keys are `<prefix>:<limit name>:{<digest>}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Digests keys with HMAC-SHA256 under `secret` instead of plain SHA-256 (at least
    /// [`MIN_KEY_SECRET_LEN`](crate::MIN_KEY_SECRET_LEN) bytes; 32 random bytes are right).
    ///
    /// Without a secret, anyone who reads Redis can find which key a digest is by trying
    /// candidates: every IPv4 address is 2^32 digests, a list of tenants or user ids fewer.
    /// With one, a digest says nothing without the secret. Every replica sharing the limits
    /// must be given the same secret (and the `tollgate` command too, with
    /// `--key-secret-env`), or each counts on keys of its own; changing it starts every count
    /// afresh. Read it from a secret store or the environment, not from source code. The
    /// builder's `Debug` never shows it.
    pub fn key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        let secret = secret.as_ref();
        self.keyer = Some((secret.len(), Keyer::new(secret)));
        self
    }

    /// How long a check may take from when it is made, waiting for a merged call and connecting
    /// included (default 50 ms). A slower answer is a failure:
    /// [`tollgate_engine::BackendErrorKind::Timeout`]. At most [`MAX_DEADLINE`] (an hour): a
    /// longer one is refused at build.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How long one connection attempt may take (default 1 s). Attempts run in the background,
    /// so a slow handshake is not cut short by the per-call deadline.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Consecutive failures that open the circuit breaker (default 3); 0 disables it.
    pub fn breaker_threshold(mut self, failures: u32) -> Self {
        self.breaker_threshold = failures;
        self
    }

    /// How long the breaker first stays open (default 250 ms); each failed probe doubles it,
    /// up to [`RedisBackendBuilder::breaker_max_open_for`].
    pub fn breaker_open_for(mut self, interval: Duration) -> Self {
        self.breaker_open_for = interval;
        self
    }

    /// The longest the breaker stays open between probes (default 5 s).
    pub fn breaker_max_open_for(mut self, interval: Duration) -> Self {
        self.breaker_max_open_for = interval;
        self
    }

    /// Entries of the local deny cache (default 10,000); 0 disables it.
    pub fn deny_cache_capacity(mut self, entries: usize) -> Self {
        self.deny_cache_capacity = entries;
        self
    }

    /// How long a denial is answered from the local deny cache before one request asks Redis
    /// again, however long the denial lasts (default [`DEFAULT_DENY_CACHE_TTL`], 1 s). It bounds
    /// how long another replica's [`reset`](tollgate_engine::Admin::reset), or a quota raised
    /// there, goes unseen here; a denial refused locally still says when it truly ends. A flood
    /// on one key costs Redis about one call per `ttl` per replica. At most
    /// [`MAX_DENY_CACHE_TTL`] (an hour): a longer one is refused at build.
    pub fn deny_cache_ttl(mut self, ttl: Duration) -> Self {
        self.deny_cache_ttl = ttl;
        self
    }

    /// Makes every call at `clock`'s time instead of the Redis server's `TIME`, and times
    /// quota leases' slices by it: checks (without the deny cache, whose time is the local
    /// clock), settles and give-backs. A check waits for the settles made before it to be
    /// answered, so that a test's calls reach Redis in the order it made them.
    ///
    /// **For tests only**: it lets a test replay exact figures at times it sets, leases
    /// included. Production code must let every replica read the same clock, the server's.
    /// Available with the `testing` feature.
    #[cfg(any(feature = "testing", doc))]
    pub fn clock(mut self, clock: FakeClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Sends every check with the general script, never the lean one that the commonest
    /// calls use (one GCRA check per request, each on its own key): for tests that hold both
    /// scripts to the same figures. Available with the `testing` feature.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn general_script_only(mut self) -> Self {
        self.lean = false;
        self
    }

    /// Trusts the CA certificates in `pem` (one or more `BEGIN CERTIFICATE` blocks) for the
    /// servers of `rediss://` URLs, instead of the webpki roots (Mozilla's list, built in),
    /// which are trusted when no CA is given. The server's certificate must name the host of
    /// the URL (a DNS name, or an IP address for a URL such as `rediss://10.0.0.5:6380/`).
    ///
    /// The URLs must be `rediss://`, which needs the `tls` feature. The PEM is checked by
    /// [`build`](Self::build): one that holds no certificate is a [`BuildError::Tls`], and so
    /// is a CA given for `redis://` URLs (the connection would not be encrypted).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tollgate_redis::RedisBackend;
    ///
    /// let ca = std::fs::read("/etc/redis/tls/ca.crt")?;
    /// let backend = RedisBackend::builder()
    ///     .url("rediss://app:secret@redis.internal:6380/")
    ///     .tls_ca_pem(ca)
    ///     .build()?;
    /// # drop(backend);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate (PEM: the certificate, then any intermediates) and
    /// its private key (PEM: PKCS#8, PKCS#1 or SEC1) to `rediss://` servers that ask for one
    /// (`tls-auth-clients yes`). The key is never printed, not even by `Debug`.
    ///
    /// The URLs must be `rediss://`, which needs the `tls` feature. The PEMs are checked by
    /// [`build`](Self::build): a certificate or key that cannot be read, or a key that is not
    /// the certificate's, is a [`BuildError::Tls`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tollgate_redis::RedisBackend;
    ///
    /// let backend = RedisBackend::builder()
    ///     .url("rediss://redis.internal:6380/")
    ///     .tls_ca_pem(std::fs::read("/etc/redis/tls/ca.crt")?)
    ///     .tls_client_cert_pem(
    ///         std::fs::read("/etc/myapp/redis-client.crt")?,
    ///         std::fs::read("/etc/myapp/redis-client.key")?,
    ///     )
    ///     .build()?;
    /// # drop(backend);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tls_client_cert_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Builds the backend. No connection is made: the first call connects, in the background,
    /// so an application starts even while Redis is down.
    ///
    /// # Errors
    ///
    /// [`BuildError`] when no server was given (no seed, no sentinel, no master name), a URL
    /// cannot be parsed, a `rediss://` URL is given without the `tls` feature, the
    /// certificates cannot be read, the prefix is invalid, the deadline or connect timeout
    /// is zero, or the deadline or the deny cache's TTL is longer than an hour
    /// ([`MAX_DEADLINE`], [`MAX_DENY_CACHE_TTL`]).
    pub fn build(self) -> Result<RedisBackend, BuildError> {
        if !keys::valid_prefix(&self.prefix) {
            return Err(BuildError::InvalidPrefix {
                prefix: self.prefix.chars().take(80).collect(),
            });
        }
        if self.deadline.is_zero() {
            return Err(BuildError::ZeroDeadline);
        }
        if self.connect_timeout.is_zero() {
            return Err(BuildError::ZeroConnectTimeout);
        }
        if self.deadline > MAX_DEADLINE {
            return Err(BuildError::TooLong {
                setting: "deadline",
                max: MAX_DEADLINE,
            });
        }
        if self.deny_cache_ttl > MAX_DENY_CACHE_TTL {
            return Err(BuildError::TooLong {
                setting: "deny_cache_ttl",
                max: MAX_DENY_CACHE_TTL,
            });
        }
        let keyer = match self.keyer {
            Some((len, _)) if len < crate::MIN_KEY_SECRET_LEN => {
                return Err(BuildError::KeySecretTooShort { len });
            }
            Some((_, keyer)) => keyer,
            None => Keyer::default(),
        };
        let urls = self.servers.urls();
        if let Some(reason) = urls.iter().find_map(|url| crate::url::mistake(url)) {
            return Err(BuildError::InvalidUrl { reason });
        }
        // A message from the client never shows a password, even one that quotes the URL.
        let secrets: Vec<String> = urls.iter().flat_map(|u| secrets_of(u)).collect();
        let bad_url = |e: redis::RedisError| BuildError::InvalidUrl {
            reason: blot(e.to_string(), &secrets),
        };
        let tls = !urls.is_empty() && urls.iter().all(|u| is_tls_url(u));
        if !tls && urls.iter().any(|u| is_tls_url(u)) {
            return Err(BuildError::InvalidUrl {
                reason: "some URLs are rediss:// and some are not: use one scheme for all"
                    .to_owned(),
            });
        }
        if tls && !cfg!(feature = "tls") {
            return Err(BuildError::TlsNotEnabled);
        }
        if !tls && !self.tls.is_empty() {
            return Err(BuildError::Tls {
                reason: "certificates were given for a URL that is not rediss://".to_owned(),
            });
        }
        // A URL redis-rs would connect to without checking the certificate: refused here, as
        // redis-rs refuses it when it connects (its `tls-rustls-insecure` feature is off).
        let insecure = |url: &&str| {
            redis::IntoConnectionInfo::into_connection_info(*url).is_ok_and(|info| {
                matches!(
                    info.addr(),
                    redis::ConnectionAddr::TcpTls { insecure: true, .. }
                )
            })
        };
        if urls.iter().any(insecure) {
            return Err(BuildError::Tls {
                reason: "#insecure (no certificate check) is not supported: give the server's \
                         CA to .tls_ca_pem(..) instead"
                    .to_owned(),
            });
        }
        let certs = certificates(&self.tls, tls)?;
        let target = match self.servers {
            Servers::None => return Err(BuildError::NoServer),
            Servers::Standalone(url) => {
                Target::Single(Box::new(client(&url, certs.as_ref(), bad_url)?))
            }
            Servers::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(BuildError::NoClusterSeeds);
                }
                let login = urls.first().and_then(|url| Login::of_url(url));
                let builder = redis::cluster::ClusterClient::builder(urls)
                    .connection_timeout(self.connect_timeout);
                #[cfg(feature = "tls")]
                let builder = match &certs {
                    Some(certs) => builder.certs(certs.clone()),
                    None => builder,
                };
                let client = builder.build().map_err(bad_url)?;
                Target::Cluster(Box::new(client), login)
            }
            Servers::Sentinel { master, sentinels } => {
                if sentinels.is_empty() {
                    return Err(BuildError::NoSentinels);
                }
                if master.is_empty() {
                    return Err(BuildError::NoMasterName);
                }
                let client = sentinel_client(&sentinels, &master, tls, certs.as_ref(), bad_url)?;
                Target::Sentinel(Arc::new(tokio::sync::Mutex::new(client)))
            }
        };
        Ok(RedisBackend::new(Config {
            prefix: self.prefix,
            deadline: self.deadline,
            target,
            connect_timeout: self.connect_timeout,
            breaker_threshold: self.breaker_threshold,
            breaker_open_for: self.breaker_open_for,
            breaker_max_open_for: self.breaker_max_open_for,
            deny_cache_capacity: self.deny_cache_capacity,
            deny_cache_ttl: self.deny_cache_ttl,
            clock: self.clock,
            lean: self.lean,
            keyer,
        }))
    }
}

impl RedisBackend {
    /// Configures a backend.
    pub fn builder() -> RedisBackendBuilder {
        RedisBackendBuilder::default()
    }
}

/// Without the `tls` feature (with it, `tests/tls.rs` connects).
#[cfg(all(test, not(feature = "tls")))]
mod tests {
    use super::*;

    /// A `rediss://` URL says which feature it needs.
    #[test]
    fn rediss_without_the_feature_names_it() {
        for builder in [
            RedisBackend::builder().url("rediss://:secret@127.0.0.1:6380/"),
            RedisBackend::builder().cluster(["rediss://127.0.0.1:7000/"]),
            RedisBackend::builder().sentinel("m", ["rediss://127.0.0.1:26379/"]),
        ] {
            let e = builder.build().unwrap_err();
            assert_eq!(e, BuildError::TlsNotEnabled);
            assert!(e.is_server());
            // What `main() -> Result<(), Box<dyn Error>>` prints names the fix too.
            let debug = format!("{e:?}");
            assert!(debug.contains("enable the `tls` feature"), "{debug}");
            let shown = e.to_string();
            assert!(shown.contains("enable the `tls` feature"), "{shown}");
            assert!(!shown.contains("secret"), "{shown}");
        }
    }

    /// A URL mistake says what was expected, as `Display` and as `Debug`.
    #[test]
    fn url_mistakes_say_what_was_expected() {
        for (url, said) in [
            (
                "127.0.0.1:6379",
                "invalid Redis URL: no scheme: a Redis URL starts with redis://",
            ),
            (
                "http://127.0.0.1:6379/",
                "invalid Redis URL: http:// is not a Redis scheme",
            ),
            (
                "redis://127.0.0.1:99999/",
                "invalid Redis URL: port 99999 is out of range",
            ),
        ] {
            let e = RedisBackend::builder().url(url).build().unwrap_err();
            assert!(e.to_string().starts_with(said), "{url}: {e}");
            assert!(format!("{e:?}").starts_with(said), "{url}: {e:?}");
        }
    }
}
