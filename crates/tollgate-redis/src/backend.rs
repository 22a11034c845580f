//! The public backend: the quota leases over the Redis layers below them, and the public API.
//!
//! [`RedisBackend`] runs leased limits through `tollgate_engine::leased::Leased`, timed by the
//! server's clock, over [`Inner`] (see `inner`), which makes the calls; every other check goes
//! to `Inner` as it is.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tollgate_engine::leased::Leased;
use tollgate_engine::{
    Admin, AdminFuture, Backend, BackendError, Check, KeyState, Lifecycle, Limit, Micros, Refused,
    Reports, Settlement, Slots,
};

use crate::future::CheckFuture;
use crate::inner::{Config, Inner};
use crate::keys;
use crate::reports::Reports as ReportCalls;
use crate::time::Time;
use crate::transport::breaker::CircuitState;
use crate::transport::BACKEND;

/// The Redis and Redis Cluster backend. Cheap to clone: clones share connections, breaker,
/// deny cache and leased slices.
///
/// See the [crate documentation](crate) for the semantics.
#[derive(Clone)]
pub struct RedisBackend {
    leased: Leased<Arc<Inner>, Time>,
}

impl RedisBackend {
    /// The backend `config` describes. No connection is made here.
    pub(crate) fn new(config: Config) -> Self {
        let inner = Arc::new(Inner::new(config));
        let time = inner.time().clone();
        Self {
            leased: Leased::new(inner, time),
        }
    }

    fn inner(&self) -> &Arc<Inner> {
        self.leased.inner()
    }

    fn report_calls(&self) -> ReportCalls {
        let inner = self.inner();
        ReportCalls::new(Arc::clone(inner.transport()), inner.prefix().to_owned())
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
        now: Option<tollgate_engine::Micros>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send + 'static {
        self.inner().settles().now_or_at(settlements, now)
    }

    /// Checks a batch in Redis at `now` (microseconds since the Unix epoch) instead of the
    /// Redis server's `TIME`, leases aside: a leased limit is checked at its cost, as if it
    /// had no lease.
    ///
    /// **For tests only**: it lets a test replay exact figures (the shared vectors) without
    /// waiting for time to pass. Production code must use [`Backend::check`], so that every
    /// replica reads the same clock, the server's. Calls made this way neither read nor fill
    /// the local deny cache, whose time is the local clock. To run leases at a fixed time,
    /// build the backend with [`RedisBackendBuilder::clock`](crate::RedisBackendBuilder::clock).
    ///
    /// Available with the `testing` feature.
    #[cfg(any(feature = "testing", doc))]
    pub fn check_at(
        &self,
        checks: &[Check<'_>],
        now: tollgate_engine::Micros,
    ) -> impl Future<Output = Result<tollgate_engine::Verdicts, BackendError>> + Send + Unpin + 'static
    {
        self.inner().checks().dispatch(checks, Some(now))
    }

    /// The Redis key that holds `limit`'s state for `key`. All of them start with the base
    /// key `<prefix>:<limit name>:{<digest>}`: GCRA's state is at `<base>:v3`, a sliding log
    /// at `<base>:log`, a concurrency limit's slots at `<base>:slots`; for a fixed window this
    /// is the base, to which `:<window index>` is appended.
    pub fn key_for(&self, limit: &Limit, key: &[u8]) -> String {
        let digest = self.inner().checks().digest(limit.name(), key);
        let base = keys::base_key(self.inner().prefix(), limit.name(), &digest);
        match limit.algorithm() {
            tollgate_engine::Algorithm::Gcra => base + ":v3",
            tollgate_engine::Algorithm::SlidingLog => base + ":log",
            tollgate_engine::Algorithm::Concurrency => base + ":slots",
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
        self.inner().transport().ping().await?;
        Ok(started.elapsed())
    }

    /// Where the circuit breaker stands.
    pub fn circuit_state(&self) -> CircuitState {
        self.inner().transport().circuit_state()
    }

    /// Entries in the local deny cache (expired ones included until they are dropped).
    pub fn deny_cache_len(&self) -> usize {
        self.inner().checks().deny().len()
    }

    /// Whether this backend talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner().transport().is_cluster()
    }

    /// Units this backend holds in leased slices now (admitted by Redis, not yet used here).
    pub fn leased_units(&self) -> u64 {
        self.leased.leased_units()
    }
}

impl Backend for RedisBackend {
    type Future = CheckFuture;

    /// Checks and consumes a batch in one script call (one per hash slot in a cluster).
    ///
    /// The key digests are computed before this returns; the future owns what it needs. A
    /// batch the deny cache refuses, or one the open circuit breaker fails, is answered
    /// without I/O or allocation.
    ///
    /// A check of a leased limit is answered from the slice this backend holds when it can
    /// (see [`tollgate_engine::Lease`]): at once, without I/O.
    fn check(&self, checks: &[Check<'_>]) -> CheckFuture {
        CheckFuture::new(self.leased.check(checks))
    }

    /// Sends the settlements from a task and returns at once: on a standalone server in one
    /// `SETTLE` call with every settle that waits for the call in flight to end (at once when
    /// none is), in a cluster in one call per hash slot. A failure is logged at debug level,
    /// and the reservations stay as they were. Outside a Tokio runtime nothing is sent.
    ///
    /// A GCRA refund moves the TAT back only as
    /// [`gcra_refund`](tollgate_engine::algorithm::gcra_refund) says (see
    /// [`Receipt`](tollgate_engine::Receipt)).
    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.leased.settle(settlements);
    }

    /// Drops this replica's leased slice of the key, then one `EVAL` (from a task, without
    /// waiting) moves the key's TAT in Redis: every replica's next check of it waits.
    fn pause(&self, check: &Check<'_>, micros: tollgate_engine::Micros) {
        self.leased.pause(check, micros);
    }

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn slots(&self) -> Option<&dyn Slots> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        Some(self)
    }

    fn reports(&self) -> Option<&dyn Reports> {
        Some(self)
    }
}

/// One `EVAL` per merge (a replica makes at most one per limit and tick) and per read; see
/// the crate documentation for the keys.
impl Reports for RedisBackend {
    fn merge(
        &self,
        limit: &str,
        keep: usize,
        refused: Vec<Refused>,
        now: Micros,
    ) -> AdminFuture<()> {
        let calls = self.report_calls();
        let limit = limit.to_owned();
        Box::pin(async move { calls.merge(&limit, keep, &refused, now).await })
    }

    fn top(&self, limit: &str, n: usize, now: Micros) -> AdminFuture<Vec<Refused>> {
        let calls = self.report_calls();
        let limit = limit.to_owned();
        Box::pin(async move { calls.top(&limit, n, now).await })
    }
}

impl Slots for RedisBackend {
    /// `ZREM`s each slot in the background (retried while Redis fails, until the slot would
    /// have expired anyway).
    fn release(&self, checks: &[Check<'_>]) {
        self.inner().release(checks);
    }

    /// As [`release`](Self::release); resolves once each slot's first `ZREM` is answered
    /// (or failed, by the deadline).
    fn release_landing(&self, checks: &[Check<'_>]) -> Option<tollgate_engine::Landing> {
        self.inner().release_landing(checks)
    }

    fn renew(&self, checks: &[Check<'_>]) {
        self.inner().renew(checks);
    }

    /// Slots expire one slot lifetime (the concurrency limit's period) after they were taken
    /// or last renewed, so that a crashed replica cannot hold them.
    fn expire(&self) -> bool {
        true
    }
}

impl Admin for RedisBackend {
    /// One `EVAL` that reads the key with the server's `TIME`; writes nothing.
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        self.leased.peek(check)
    }

    /// Drops this replica's leased slice of the key (it admits nothing the reset state does
    /// not count; other replicas' slices end with their lifetime), then one `EVAL` deletes the
    /// key's state (a fixed window's current and next window), then this replica's cached
    /// denial of it is dropped. Other replicas' deny caches keep theirs until it expires (at
    /// most the deny cache's TTL).
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        self.leased.reset(check)
    }

    /// Drops this replica's leased slice of the key, then one `EVAL` sets the deny in the
    /// key's sanctions (`<base>:pb`), which every replica's next `CHECK` of the key reads.
    /// Replicas that answer the key from their deny cache or a slice refuse it once that
    /// answer runs out (the cache's TTL, the lease's lifetime).
    fn deny(&self, check: &Check<'_>, duration: std::time::Duration) -> AdminFuture<()> {
        self.leased.deny(check, duration)
    }

    /// One `EVAL` lifts the deny, then this replica's cached refusal is dropped; other
    /// replicas' end within the deny cache's TTL.
    fn undeny(&self, check: &Check<'_>) -> AdminFuture<()> {
        self.leased.undeny(check)
    }
}

impl Lifecycle for RedisBackend {
    /// Gives back the unused units of every leased slice (one `SETTLE` refund each) and takes
    /// no more slices; resolves when Redis has answered, or could not.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        self.leased.shutdown()
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = self.inner().transport();
        f.debug_struct("RedisBackend")
            .field("prefix", &self.inner().prefix())
            .field("deadline", &transport.deadline())
            .field("cluster", &self.is_cluster())
            .field("connection", transport)
            .field("circuit", &self.circuit_state())
            .field("deny_cache_len", &self.deny_cache_len())
            .field("leased_units", &self.leased_units())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tollgate_engine::{Backend, Check, Limit, Quota};
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
            let estimate = backend.inner().transport().server_time();
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
        backend.inner().transport().clock().set_skew(-3_600_000_000);
        assert_eq!(check().await.unwrap()[0].remaining, 8);
        assert_eq!(server.calls("evalsha"), 2);
        // The server's time is known again: one call.
        assert_eq!(check().await.unwrap()[0].remaining, 7);
        assert_eq!(server.calls("evalsha"), 3);
        // Only the window of the server's time was written.
        assert_eq!(server.dbsize(), 1);
    }
}
