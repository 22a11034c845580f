//! The backend: one script call per batch (per slot group in a cluster), with a deadline, a
//! circuit breaker and a local deny cache in front.

use std::fmt;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::{
    AdminFuture, Backend, BackendError, BackendErrorKind, Check, KeyState, Limit, Micros,
    Settlement, Status, Verdict, Verdicts,
};

use crate::admin::OwnedCheck;
use crate::breaker::{Breaker, BreakerConfig, CircuitState, Permit};
use crate::coalesce::{Coalescer, SlotCoalescer};
use crate::conn::{breaks_connection, Connector, Target};
use crate::deny_cache::DenyCache;
use crate::digests::DigestCache;
use crate::direct::Direct;
use crate::failure::map_error;
use crate::future::ResponseFuture;
use crate::keys;
use crate::lease::Leases;
use crate::script::{self, Answer, Prepared, Reply, Script};
use crate::settle::SettleQueue;
use crate::slots::{self, Held, Unclaimed};

pub(crate) const BACKEND: &str = "redis";

/// The Redis and Redis Cluster backend. Cheap to clone: clones share connections, breaker and
/// deny cache.
///
/// See the [crate documentation](crate) for the semantics.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) prefix: String,
    pub(crate) deadline: Duration,
    pub(crate) cluster: bool,
    pub(crate) connector: Arc<Connector>,
    /// The `CHECK` calls' own connection, for a plain TCP standalone server.
    pub(crate) direct: Option<Arc<Direct>>,
    pub(crate) breaker: Breaker,
    pub(crate) deny: DenyCache,
    /// The digests of recently checked (limit, key) pairs.
    pub(crate) digests: DigestCache,
    pub(crate) check_script: Script,
    pub(crate) refund_script: Script,
    pub(crate) settle_script: Script,
    /// Moves a concurrency slot's deadline.
    pub(crate) renew_script: Script,
    /// Slot releases sent and not answered yet: a concurrency check waits for them.
    pub(crate) releases: slots::Releases,
    /// Merges concurrent requests' batches into one call (standalone Redis only).
    pub(crate) coalescer: Coalescer,
    /// The same in a Redis Cluster, one queue per hash slot.
    pub(crate) slot_coalescer: SlotCoalescer,
    /// Settles waiting for the call in flight to end, sent together next (standalone Redis).
    pub(crate) settles: SettleQueue,
    /// The server's `TIME` minus the local clock, in microseconds, as last seen.
    pub(crate) skew: AtomicI64,
    /// Slices of leased quotas held here (see `lease`).
    pub(crate) leases: Leases,
    /// Registered on the first call, like the layer's, so that a recorder installed after the
    /// backend was built still receives them; after that a call only updates them.
    metrics: OnceLock<Metrics>,
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

struct Metrics {
    up: metrics::Gauge,
    duration: metrics::Histogram,
}

/// What a batch came to, before the verdicts are finished.
pub(crate) struct Outcome {
    pub(crate) committed: bool,
    pub(crate) answers: Vec<Answer>,
}

impl From<Reply> for Outcome {
    fn from(reply: Reply) -> Self {
        Self {
            committed: reply.committed,
            answers: reply.answers,
        }
    }
}

impl RedisBackend {
    /// The backend `config` describes. No connection is made here.
    pub(crate) fn new(config: Config) -> Self {
        let breaker = Breaker::new(BreakerConfig {
            threshold: config.breaker_threshold,
            open_for: config.breaker_open_for,
            max_open_for: config.breaker_max_open_for.max(config.breaker_open_for),
            // A probe whose caller gave up frees its place once its deadline has surely passed.
            probe_timeout: config.deadline * 2,
        });
        let cluster = matches!(config.target, Target::Cluster(_));
        let direct = match &config.target {
            Target::Single(client) => {
                Direct::for_client(client, config.connect_timeout).map(Arc::new)
            }
            _ => None,
        };
        let inner = Inner {
            prefix: config.prefix,
            deadline: config.deadline,
            cluster,
            connector: Arc::new(Connector::new(config.target, config.connect_timeout)),
            direct,
            breaker,
            deny: DenyCache::new(
                config.deny_cache_capacity,
                config.deadline,
                config.deny_cache_ttl,
            ),
            digests: DigestCache::default(),
            check_script: Script::new(script::CHECK),
            refund_script: Script::new(script::REFUND),
            settle_script: Script::new(script::SETTLE),
            renew_script: slots::renew_script(),
            releases: slots::Releases::default(),
            coalescer: Coalescer::default(),
            slot_coalescer: SlotCoalescer::default(),
            settles: SettleQueue::default(),
            skew: AtomicI64::new(0),
            leases: Leases::default(),
            metrics: OnceLock::new(),
        };
        Self {
            inner: Arc::new(inner),
        }
    }
}

impl Inner {
    fn metrics(&self) -> &Metrics {
        self.metrics.get_or_init(|| Metrics {
            up: metrics::gauge!("tollgate_backend_up", "backend" => BACKEND),
            duration: metrics::histogram!("tollgate_backend_duration_seconds", "backend" => BACKEND),
        })
    }

    /// Runs a batch under the deadline, and keeps the metrics and deny cache.
    pub(crate) async fn run(
        self: Arc<Self>,
        batch: Vec<Prepared>,
        now: Option<Micros>,
        permit: Permit,
    ) -> Result<Verdicts, BackendError> {
        let started = Instant::now();
        let unclaimed = self.unclaimed(&batch);
        let result = self.call(batch, now, started + self.deadline, permit).await;
        self.answered_at(started, unclaimed, result, now)
    }

    /// The slots `batch` may take: given back unless the call is answered (see `slots`).
    pub(crate) fn unclaimed(self: &Arc<Self>, batch: &[Prepared]) -> Option<Unclaimed> {
        batch
            .iter()
            .any(|p| p.algorithm == tollgate_core::Algorithm::Concurrency)
            .then(|| Unclaimed::new(self, Held::from_batch(&self.prefix, batch)))
    }

    /// The verdicts of a call started at `started` that came to `result`, with its duration
    /// recorded and its slots, once answered, the caller's.
    pub(crate) fn answered_at(
        &self,
        started: Instant,
        unclaimed: Option<Unclaimed>,
        result: Result<(Vec<Prepared>, Outcome), BackendError>,
        now: Option<Micros>,
    ) -> Result<Verdicts, BackendError> {
        self.metrics()
            .duration
            .record(started.elapsed().as_secs_f64());
        match result {
            Ok((batch, outcome)) => {
                if let Some(unclaimed) = unclaimed {
                    unclaimed.disarm();
                }
                Ok(self.verdicts(&batch, &outcome, now))
            }
            Err(e) => {
                if e.is_overloaded() {
                    // Never sent: nothing was taken.
                    if let Some(unclaimed) = unclaimed {
                        unclaimed.disarm();
                    }
                    tracing::debug!(backend = BACKEND, error = %e, "rate-limit check not sent");
                } else {
                    tracing::debug!(backend = BACKEND, error = %e, "rate-limit check failed");
                }
                Err(e)
            }
        }
    }

    /// Tells the breaker and the health gauge how one call to Redis went: once per call,
    /// however many requests it carried. A check that was not sent (`Overloaded`) says
    /// nothing of Redis and is never reported.
    pub(crate) fn report(&self, result: Result<(), &BackendError>, permit: Permit) {
        match result {
            Ok(()) => self.answered(permit),
            // Redis answered, with something we did not expect: it is up.
            Err(e) if e.kind() == BackendErrorKind::Protocol => self.answered(permit),
            Err(e) if e.is_overloaded() => {}
            Err(_) => {
                if self.breaker.failure(permit) {
                    self.connector.replace();
                    if let Some(direct) = &self.direct {
                        direct.replace();
                    }
                }
                self.metrics().up.set(0.0);
            }
        }
    }

    fn answered(&self, permit: Permit) {
        self.breaker.success(permit);
        self.metrics().up.set(1.0);
    }

    /// `batch`'s answer by `deadline`, or a timeout; the call is reported to the breaker.
    async fn call(
        self: &Arc<Self>,
        batch: Vec<Prepared>,
        now: Option<Micros>,
        deadline: Instant,
        permit: Permit,
    ) -> Result<(Vec<Prepared>, Outcome), BackendError> {
        if now.is_none() {
            // In a cluster, each slot's merged call: a batch waits for that of each slot it
            // touches. (A standalone server's merged call is awaited by `Merged`, not here.)
            return Box::pin(self.call_cluster(batch, None, deadline, Some(permit))).await;
        }
        // Boxed: the future of a direct call is large (over 1 KiB with the connection's), and
        // kept inline it would make every request's future as large, and its allocation one
        // that the allocator's per-thread cache does not serve.
        let call = self.until(
            deadline,
            self.call_direct(batch, now, deadline),
            "from Redis",
        );
        let result = Box::pin(call).await;
        self.report(result.as_ref().map(|_| ()), permit);
        result
    }

    /// A call of its own for `batch` (one per slot group in a cluster), at a fixed time: for
    /// tests.
    async fn call_direct(
        self: &Arc<Self>,
        batch: Vec<Prepared>,
        now: Option<Micros>,
        deadline: Instant,
    ) -> Result<(Vec<Prepared>, Outcome), BackendError> {
        if !self.cluster {
            let reply = self.eval_check(&[batch.as_slice()], now).await?;
            return Ok((batch, reply.into()));
        }
        self.call_cluster(batch, now, deadline, None).await
    }
}

pub(crate) const NOT_CHECKED: Verdict = Verdict {
    status: Status::NotChecked,
    remaining: 0,
    reset: 0,
};

/// The answer of a check that Redis did not evaluate.
pub(crate) const UNANSWERED: Answer = Answer {
    verdict: NOT_CHECKED,
    extra: 0,
    at: 0,
};

impl RedisBackend {
    /// Checks a batch at `now` (microseconds since the Unix epoch) instead of the Redis server's
    /// `TIME`.
    ///
    /// **For tests only**: it lets a test replay exact figures (the shared vectors) without
    /// waiting for time to pass. Production code must use [`Backend::check`], so that every
    /// replica reads the same clock, the server's. Calls made this way neither read nor fill
    /// the local deny cache, whose time is the local clock.
    ///
    /// Leased limits are leased at that time too: slices expire and are given back by it.
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
        let inner = Arc::clone(&self.inner);
        let started = Instant::now();
        let attempt = async {
            let (generation, mut conn) = inner.connector.get().await.map_err(map_error)?;
            match conn.query(&redis::cmd("PING")).await {
                Ok(_) => Ok(()),
                Err(e) => {
                    if breaks_connection(&e) {
                        inner.connector.invalidate(generation);
                    }
                    Err(map_error(e))
                }
            }
        };
        let result = inner.within_deadline(attempt, "to PING").await;
        let up = if result.is_ok() { 1.0 } else { 0.0 };
        inner.metrics().up.set(up);
        result.map(|()| started.elapsed())
    }

    /// Where the circuit breaker stands.
    pub fn circuit_state(&self) -> CircuitState {
        self.inner.breaker.state()
    }

    /// Entries in the local deny cache (expired ones included until they are dropped).
    pub fn deny_cache_len(&self) -> usize {
        self.inner.deny.len()
    }

    /// Whether this backend talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.cluster
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
        self.settle_later(settlements);
    }

    fn kind(&self) -> &'static str {
        BACKEND
    }

    /// Drops the local deny cache's denials of `limit`, so that a raised quota is seen at once.
    fn forget_denials(&self, limit: &str) {
        self.inner.deny.forget_limit(limit);
    }

    /// `ZREM`s each slot in the background (retried while Redis fails, until the slot would
    /// have expired anyway).
    fn release(&self, checks: &[Check<'_>]) {
        slots::release(&self.inner, Held::from_checks(&self.inner, checks));
    }

    fn renew(&self, checks: &[Check<'_>]) {
        slots::renew(&self.inner, Held::from_checks(&self.inner, checks));
    }

    /// Slots expire one slot lifetime (the concurrency limit's period) after they were taken
    /// or last renewed, so that a crashed replica cannot hold them.
    fn slots_expire(&self) -> bool {
        true
    }

    /// One `EVAL` that reads the key with the server's `TIME`; writes nothing.
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        Box::pin(Arc::clone(&self.inner).peek(OwnedCheck::of(check)))
    }

    /// One `EVAL` that deletes the key's state (a fixed window's current and next window),
    /// then drops this replica's cached denial of it. Other replicas' deny caches keep theirs
    /// until it expires (at most the deny cache's lease).
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        Box::pin(Arc::clone(&self.inner).reset(OwnedCheck::of(check)))
    }

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
            .field("deadline", &self.inner.deadline)
            .field("cluster", &self.inner.cluster)
            .field("connection", &self.inner.connector)
            .field("circuit", &self.circuit_state())
            .field("deny_cache_len", &self.deny_cache_len())
            .finish()
    }
}
