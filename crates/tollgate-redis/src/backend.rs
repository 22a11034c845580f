//! The backend: the components a call goes through, put together, and the public API.
//!
//! [`RedisBackend`] holds the layers (see `docs/architecture.md`): the transport (connections,
//! breaker, merged calls), and over it the checks (with the deny cache, the digests and the
//! cluster's split), the concurrency slots, the settles, operators' calls and quota leases.
//! Each is a component of its own; this file only hands each call to the one it is for.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::{
    AdminFuture, Backend, BackendError, Check, KeyState, Lifecycle, Limit, Micros, Settlement,
    MAX_CHECKS,
};

use crate::admin::{Admin, OwnedCheck};
use crate::checks::Checks;
use crate::deny_cache::DenyCache;
use crate::future::ResponseFuture;
use crate::keys;
use crate::lease::Leases;
use crate::settle::Settles;
use crate::slots::Slots;
use crate::transport::breaker::{BreakerConfig, CircuitState};
use crate::transport::conn::Target;
use crate::transport::{Transport, TransportConfig};

pub(crate) use crate::scripts::reply::NOT_CHECKED;
pub(crate) use crate::transport::BACKEND;

/// The Redis and Redis Cluster backend. Cheap to clone: clones share connections, breaker and
/// deny cache.
///
/// See the [crate documentation](crate) for the semantics.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

/// The components of one backend, shared by its clones.
pub(crate) struct Inner {
    prefix: String,
    transport: Arc<Transport>,
    checks: Arc<Checks>,
    settles: Arc<Settles>,
    admin: Admin,
    /// Slices of leased quotas held here (see `lease`).
    pub(crate) leases: Leases,
}

/// What a backend is made of, checked by the builder.
pub(crate) struct Config {
    pub(crate) prefix: String,
    pub(crate) deadline: Duration,
    pub(crate) target: Target,
    pub(crate) connect_timeout: Duration,
    pub(crate) breaker_threshold: u32,
    pub(crate) breaker_open_for: Duration,
    pub(crate) breaker_max_open_for: Duration,
    pub(crate) deny_cache_capacity: usize,
    pub(crate) deny_cache_ttl: Duration,
}

impl RedisBackend {
    /// The backend `config` describes. No connection is made here.
    pub(crate) fn new(config: Config) -> Self {
        let transport = Arc::new(Transport::new(TransportConfig {
            prefix: config.prefix.clone(),
            deadline: config.deadline,
            target: config.target,
            connect_timeout: config.connect_timeout,
            breaker: BreakerConfig {
                threshold: config.breaker_threshold,
                open_for: config.breaker_open_for,
                max_open_for: config.breaker_max_open_for.max(config.breaker_open_for),
                // A probe whose caller gave up frees its place once its deadline has surely
                // passed.
                probe_timeout: config.deadline * 2,
            },
        }));
        let deny = Arc::new(DenyCache::new(
            config.deny_cache_capacity,
            config.deadline,
            config.deny_cache_ttl,
        ));
        let slots = Arc::new(Slots::new(Arc::clone(&transport), config.prefix.clone()));
        let inner = Inner {
            checks: Arc::new(Checks::new(
                Arc::clone(&transport),
                Arc::clone(&deny),
                slots,
            )),
            settles: Arc::new(Settles::new(Arc::clone(&transport), deny)),
            admin: Admin::new(Arc::clone(&transport), config.prefix.clone()),
            prefix: config.prefix,
            transport,
            leases: Leases::default(),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Checks `checks` at `now` (a test's), or at the server's time, leases aside.
    pub(crate) fn dispatch(&self, checks: &[Check<'_>], now: Option<Micros>) -> ResponseFuture {
        self.dispatch_slices(checks, now, &[0; MAX_CHECKS])
    }

    /// As `dispatch`, with `slices[i]` units (when above 0) taken in Redis for the `i`-th
    /// check instead of its cost: a quota lease's slice. The deny cache is asked with the
    /// checks' own costs.
    pub(crate) fn dispatch_slices(
        &self,
        checks: &[Check<'_>],
        now: Option<Micros>,
        slices: &[u32; MAX_CHECKS],
    ) -> ResponseFuture {
        self.inner.checks.dispatch(checks, now, slices)
    }

    /// Sends `settlements` in the background (see [`Backend::settle`]); the `i`-th GCRA refund
    /// applies only while its key's TAT is `only_at[i]` (when given and above 0).
    pub(crate) fn settle_later_at(&self, settlements: &[Settlement<'_>], only_at: &[Micros]) {
        self.inner.settles.later(settlements, only_at);
    }

    /// As `settle_at`; the `i`-th GCRA refund applies only while its key's TAT is
    /// `only_at[i]` (when given and above 0).
    pub(crate) fn settle_guarded(
        &self,
        settlements: &[Settlement<'_>],
        only_at: &[Micros],
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        self.inner.settles.now_or_at(settlements, only_at, now)
    }

    /// Settles `settlements` at `now` (tests), or at the server's `TIME`; answers once Redis
    /// has. [`Backend::settle`] sends the same call without waiting for it.
    ///
    /// A settlement that gives units back clears this replica's cached denial of its key.
    /// While the circuit breaker is open, nothing is sent and reservations stay as they are.
    ///
    /// **For tests only**; available with the `testing` feature.
    ///
    /// # Errors
    ///
    /// As [`Backend::check`]: the call failed, timed out, or the breaker is open.
    #[cfg(any(feature = "testing", doc))]
    pub fn settle_at(
        &self,
        settlements: &[Settlement<'_>],
        now: Option<Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        self.settle_guarded(settlements, &[], now)
    }

    /// Checks a batch at `now` (microseconds since the Unix epoch) instead of the Redis server's
    /// `TIME`.
    ///
    /// **For tests only**: it lets a test replay exact figures (the shared vectors) without
    /// waiting for time to pass. Production code must use [`Backend::check`], so that every
    /// replica reads the same clock, the server's. Calls made this way neither read nor fill
    /// the local deny cache, whose time is the local clock.
    ///
    /// Leased limits are leased at that time too: slices expire and are given back by it.
    ///
    /// Available with the `testing` feature.
    #[cfg(any(feature = "testing", doc))]
    pub fn check_at(&self, checks: &[Check<'_>], now: Micros) -> ResponseFuture {
        if checks.iter().any(|c| c.limit.lease().is_some()) {
            return self.check_leased(checks, Some(now));
        }
        self.dispatch(checks, Some(now))
    }

    /// The Redis key that holds `limit`'s state for `key`. All of them start with the base
    /// key `<prefix>:<limit name>:{<digest>}`: GCRA's state is at `<base>:v2`, a sliding log
    /// at `<base>:log`, a concurrency limit's slots at `<base>:slots`; for a fixed window this
    /// is the base, to which `:<window index>` is appended.
    pub fn key_for(&self, limit: &Limit, key: &[u8]) -> String {
        let digest = keys::digest(limit.name(), key);
        let base = keys::base_key(&self.inner.prefix, limit.name(), &digest);
        match limit.algorithm() {
            tollgate_core::Algorithm::Gcra => base + ":v2",
            tollgate_core::Algorithm::SlidingLog => base + ":log",
            tollgate_core::Algorithm::Concurrency => base + ":slots",
            _ => base,
        }
    }

    /// Sends `PING` within the deadline, whatever the circuit breaker says, and reports the
    /// round trip. It sets the `tollgate_backend_up{backend="redis"}` gauge; a canary or a
    /// health endpoint can call it.
    ///
    /// # Errors
    ///
    /// As [`Backend::check`], except that it never reports `CircuitOpen`.
    pub async fn ping(&self) -> Result<Duration, BackendError> {
        let started = Instant::now();
        self.inner.transport.ping().await?;
        Ok(started.elapsed())
    }

    /// Where the circuit breaker stands.
    pub fn circuit_state(&self) -> CircuitState {
        self.inner.transport.circuit_state()
    }

    /// Entries in the local deny cache (expired ones included until they are dropped).
    pub fn deny_cache_len(&self) -> usize {
        self.inner.checks.deny().len()
    }

    /// Whether this backend talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.transport.is_cluster()
    }
}

impl Inner {
    /// The client's estimate of the server's `TIME` (see `transport::clock`).
    pub(crate) fn server_time(&self) -> Micros {
        self.transport.server_time()
    }

    /// Forgets `check`'s key: this replica's slice of it, the key in Redis, and this
    /// replica's cached denial of it.
    async fn reset(&self, check: OwnedCheck) -> Result<(), BackendError> {
        if check.limit.algorithm() == tollgate_core::Algorithm::Concurrency {
            return Err(tollgate_core::unsupported("redis", "reset"));
        }
        // This replica's slice of the key is dropped first, so that it admits nothing the
        // reset state does not count; other replicas' slices end with their lifetime.
        self.leases.forget(check.limit.name(), &check.key);
        self.admin.reset(&check).await?;
        self.checks
            .deny()
            .forget(&keys::digest(check.limit.name(), &check.key));
        Ok(())
    }
}

impl Backend for RedisBackend {
    type Future = ResponseFuture;

    /// Checks and consumes a batch in one script call (one per hash slot in a cluster).
    ///
    /// The key digests are computed before this returns; the future owns what it needs. A
    /// batch the deny cache refuses, or one the open circuit breaker fails, is answered
    /// without I/O or allocation.
    ///
    /// A check of a leased limit is answered from the slice this backend holds when it can
    /// (see [`tollgate_core::Lease`]): at once, without I/O.
    fn check(&self, checks: &[Check<'_>]) -> ResponseFuture {
        if checks.iter().any(|c| c.limit.lease().is_some()) {
            return self.check_leased(checks, None);
        }
        self.dispatch(checks, None)
    }

    /// Sends the settlements from a task and returns at once: on a standalone server in one
    /// `SETTLE` call with every settle that waits for the call in flight to end (at once when
    /// none is), in a cluster in one call per hash slot. A failure is logged at debug level,
    /// and the reservations stay as they were. Outside a Tokio runtime nothing is sent.
    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.settle_later_at(settlements, &[]);
    }

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn slots(&self) -> Option<&dyn tollgate_core::Slots> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn tollgate_core::Admin> {
        Some(self)
    }

    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        Some(self)
    }
}

impl tollgate_core::Slots for RedisBackend {
    /// `ZREM`s each slot in the background (retried while Redis fails, until the slot would
    /// have expired anyway).
    fn release(&self, checks: &[Check<'_>]) {
        let checker = &self.inner.checks;
        let held = checker
            .slots()
            .of_checks(checks, |n, k| checker.digest(n, k));
        checker.slots().release(held);
    }

    fn renew(&self, checks: &[Check<'_>]) {
        let checker = &self.inner.checks;
        let held = checker
            .slots()
            .of_checks(checks, |n, k| checker.digest(n, k));
        checker.slots().renew(held);
    }

    /// Slots expire one slot lifetime (the concurrency limit's period) after they were taken
    /// or last renewed, so that a crashed replica cannot hold them.
    fn expire(&self) -> bool {
        true
    }
}

impl tollgate_core::Admin for RedisBackend {
    /// One `EVAL` that reads the key with the server's `TIME`; writes nothing.
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        let inner = Arc::clone(&self.inner);
        let check = OwnedCheck::of(check);
        Box::pin(async move { inner.admin.peek(&check).await })
    }

    /// One `EVAL` that deletes the key's state (a fixed window's current and next window),
    /// then drops this replica's cached denial of it. Other replicas' deny caches keep theirs
    /// until it expires (at most the deny cache's TTL).
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        let inner = Arc::clone(&self.inner);
        let check = OwnedCheck::of(check);
        Box::pin(async move { inner.reset(check).await })
    }
}

impl Lifecycle for RedisBackend {
    /// Gives back the unused units of every leased slice (one `SETTLE` refund each) and takes
    /// no more slices; resolves when Redis has answered, or could not.
    fn shutdown(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let sent = self.shutdown_at(None);
        Box::pin(async move {
            if let Err(e) = sent.await {
                tracing::debug!(backend = BACKEND, error = %e, "lease give-back at shutdown failed");
            }
        })
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.inner.prefix)
            .field("deadline", &self.inner.transport.deadline())
            .field("cluster", &self.is_cluster())
            .field("connection", &self.inner.transport)
            .field("circuit", &self.circuit_state())
            .field("deny_cache_len", &self.deny_cache_len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tollgate_core::{Backend, Check, Limit, Quota};
    use tollgate_testsupport::RedisServer;

    use crate::RedisBackend;

    /// The estimate of the server's time is never behind it: the server read its `TIME` after
    /// the call was sent, and the estimate counts from the sending.
    #[tokio::test]
    async fn the_servers_time_is_estimated_at_or_after_it() {
        let server = RedisServer::start();
        let backend = RedisBackend::builder().url(server.url()).build().unwrap();
        let limit = Limit::gcra("clock", Quota::per_minute(100).unwrap()).unwrap();
        let mut conn = server.client();
        for _ in 0..20 {
            backend.check(&[Check::new(&limit, b"k")]).await.unwrap();
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
            let estimate = backend.inner.server_time();
            assert!(
                estimate >= secs * 1_000_000 + micros,
                "{estimate} behind the server"
            );
        }
    }

    #[tokio::test]
    async fn a_call_for_the_wrong_window_writes_nothing_and_is_made_again_for_the_right_one() {
        let server = RedisServer::start();
        let backend = RedisBackend::builder()
            .url(server.url())
            .deadline(std::time::Duration::from_secs(5))
            .build()
            .unwrap();
        let limit = Limit::fixed_window("w", Quota::per_minute(10).unwrap()).unwrap();
        let check = || backend.check(&[Check::new(&limit, b"k")]);
        assert_eq!(check().await.unwrap()[0].remaining, 9);
        server.reset_stats();
        // The client believes the server an hour behind: the windows it declares are not the
        // server's, which refuses the call, says its time, and the call is made again.
        backend.inner.transport.clock().set_skew(-3_600_000_000);
        assert_eq!(check().await.unwrap()[0].remaining, 8);
        assert_eq!(server.calls("evalsha"), 2);
        // The server's time is known again: one call.
        assert_eq!(check().await.unwrap()[0].remaining, 7);
        assert_eq!(server.calls("evalsha"), 3);
        // Only the window of the server's time was written.
        assert_eq!(server.dbsize(), 1);
    }
}
