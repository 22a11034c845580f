//! Configuration of a [`RedisBackend`].

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Config, RedisBackend};
use crate::conn::Target;
use crate::error::BuildError;
use crate::keys;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";
/// The default deadline of one check.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(50);
/// The default number of entries of the local deny cache.
pub const DEFAULT_DENY_CACHE_CAPACITY: usize = 10_000;
/// How long, by default, the local deny cache answers a denial before Redis is asked again.
pub const DEFAULT_DENY_CACHE_TTL: Duration = Duration::from_secs(1);

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_BREAKER_THRESHOLD: u32 = 3;
const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_millis(250);
const DEFAULT_BREAKER_MAX_OPEN_FOR: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
enum Servers {
    None,
    Standalone(String),
    Cluster(Vec<String>),
    Sentinel {
        master: String,
        sentinels: Vec<String>,
    },
}

/// Configures a [`RedisBackend`]; made by [`RedisBackend::builder`].
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
        }
    }
}

impl RedisBackendBuilder {
    /// Talks to one standalone Redis (or Valkey) server, such as `redis://127.0.0.1:6379/`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.servers = Servers::Standalone(url.into());
        self
    }

    /// Talks to a Redis Cluster, discovered from these seed nodes.
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

    /// How long a check may take from when it is made, waiting for a merged call and connecting
    /// included (default 50 ms). A slower answer is a failure:
    /// [`tollgate_core::BackendErrorKind::Timeout`].
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
    /// how long another replica's [`reset`](tollgate_core::Backend::reset), or a quota raised
    /// there, goes unseen here; a denial refused locally still says when it truly ends. A flood
    /// on one key costs Redis about one call per `ttl` per replica.
    pub fn deny_cache_ttl(mut self, ttl: Duration) -> Self {
        self.deny_cache_ttl = ttl;
        self
    }

    /// Builds the backend. No connection is made: the first call connects, in the background,
    /// so an application starts even while Redis is down.
    ///
    /// # Errors
    ///
    /// [`BuildError`] when no server was given (no seed, no sentinel, no master name), a URL
    /// cannot be parsed, the prefix is
    /// invalid, or the deadline or connect timeout is zero.
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
        let bad_url = |e: redis::RedisError| BuildError::InvalidUrl {
            reason: e.to_string(),
        };
        let target = match self.servers {
            Servers::None => return Err(BuildError::NoServer),
            Servers::Standalone(url) => {
                Target::Single(redis::Client::open(url.as_str()).map_err(bad_url)?)
            }
            Servers::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(BuildError::NoClusterSeeds);
                }
                let client = redis::cluster::ClusterClient::builder(urls)
                    .connection_timeout(self.connect_timeout)
                    .build()
                    .map_err(bad_url)?;
                Target::Cluster(Box::new(client))
            }
            Servers::Sentinel { master, sentinels } => {
                if sentinels.is_empty() {
                    return Err(BuildError::NoSentinels);
                }
                if master.is_empty() {
                    return Err(BuildError::NoMasterName);
                }
                let client = redis::sentinel::SentinelClient::build(
                    sentinels,
                    master,
                    None,
                    redis::sentinel::SentinelServerType::Master,
                )
                .map_err(bad_url)?;
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
        }))
    }
}

impl RedisBackend {
    /// Configures a backend.
    pub fn builder() -> RedisBackendBuilder {
        RedisBackendBuilder::default()
    }
}
