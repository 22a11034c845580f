//! The backend: one script call per batch (per slot group in a cluster), with a deadline, a
//! circuit breaker and a local deny cache in front.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::{
    algorithm, Algorithm, Backend, BackendError, BackendErrorKind, Check, Limit, Micros, Status,
    Verdict, Verdicts, MAX_CHECKS,
};

use crate::breaker::{Breaker, CircuitState, Permit};
use crate::builder::RedisBackendBuilder;
use crate::coalesce::{Coalescer, Push, Waiter};
use crate::conn::{breaks_connection, Connector};
use crate::deny_cache::{DenyCache, Lookup};
use crate::keys;
use crate::script::{self, Answer, Prepared, Reply, Script};

const BACKEND: &str = "redis";

/// The Redis and Redis Cluster backend. Cheap to clone: clones share connections, breaker and
/// deny cache.
///
/// See the [crate documentation](crate) for the semantics.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    prefix: String,
    deadline: Duration,
    cluster: bool,
    connector: Arc<Connector>,
    breaker: Breaker,
    deny: DenyCache,
    check_script: Script,
    refund_script: Script,
    /// Merges concurrent requests' batches into one call (standalone Redis only).
    coalescer: Coalescer,
    /// Registered on the first call, like the layer's, so that a recorder installed after the
    /// backend was built still receives them; after that a call only updates them.
    metrics: OnceLock<Metrics>,
}

struct Metrics {
    up: metrics::Gauge,
    duration: metrics::Histogram,
}

/// What a batch came to, before the verdicts are finished.
struct Outcome {
    committed: bool,
    answers: Vec<Answer>,
}

impl From<Reply> for Outcome {
    fn from(reply: Reply) -> Self {
        Self {
            committed: reply.committed,
            answers: reply.answers,
        }
    }
}

impl Inner {
    pub(crate) fn new(
        prefix: String,
        deadline: Duration,
        cluster: bool,
        connector: Arc<Connector>,
        breaker: Breaker,
        deny: DenyCache,
    ) -> Self {
        Self {
            prefix,
            deadline,
            cluster,
            connector,
            breaker,
            deny,
            check_script: Script::new(script::CHECK),
            refund_script: Script::new(script::REFUND),
            coalescer: Coalescer::default(),
            metrics: OnceLock::new(),
        }
    }

    fn metrics(&self) -> &Metrics {
        self.metrics.get_or_init(|| Metrics {
            up: metrics::gauge!("tollgate_backend_up", "backend" => BACKEND),
            duration: metrics::histogram!("tollgate_backend_duration_seconds", "backend" => BACKEND),
        })
    }

    /// Runs a batch under the deadline, and keeps the breaker, metrics and deny cache.
    async fn run(
        self: Arc<Self>,
        batch: Vec<Prepared>,
        now: Option<Micros>,
        permit: Permit,
    ) -> Result<Verdicts, BackendError> {
        let started = Instant::now();
        let result = self.call(batch, now, started + self.deadline).await;
        self.metrics()
            .duration
            .record(started.elapsed().as_secs_f64());
        let (batch, outcome) = match result {
            Ok(answered) => {
                self.answered();
                answered
            }
            Err(CallError::Overloaded(e)) => {
                // Nothing was asked of Redis: its breaker and health gauge must not hear of it.
                tracing::debug!(backend = BACKEND, error = %e, "rate-limit check not sent");
                return Err(e);
            }
            Err(CallError::Redis(e)) => {
                if e.kind() == BackendErrorKind::Protocol {
                    // Redis answered, with something we did not expect: it is up.
                    self.answered();
                } else {
                    if self.breaker.failure(permit) {
                        self.connector.replace();
                    }
                    self.metrics().up.set(0.0);
                }
                tracing::debug!(backend = BACKEND, error = %e, "rate-limit check failed");
                return Err(e);
            }
        };
        let mut verdicts = Verdicts::new();
        for (p, answer) in batch.iter().zip(&outcome.answers) {
            let mut verdict = answer.verdict;
            if !outcome.committed {
                verdict = algorithm::unconsumed(p.algorithm, &p.quota, verdict, p.cost);
            }
            if now.is_none() && p.enforce {
                match foreseen_denial(p.algorithm, &p.quota, p.cost, &verdict) {
                    Some(denial) => {
                        let per_unit = match p.algorithm {
                            Algorithm::Gcra => Some(p.quota.emission_interval()),
                            Algorithm::FixedWindow => Some(0),
                            _ => None,
                        };
                        self.deny
                            .insert(&p.digest, &p.name, p.cost, per_unit, &denial);
                    }
                    // Only the request that held a run-out denial's lease settles it.
                    // An answer that tells nothing of the room left (the check was not
                    // run, or can never pass) ends the wait.
                    None if p.leased => {
                        let room = if verdict.is_allowed() {
                            verdict.remaining
                        } else {
                            u64::MAX
                        };
                        self.deny.settle(&p.digest, p.cost, room);
                    }
                    None => {}
                }
            }
            let _ = verdicts.push(verdict);
        }
        Ok(verdicts)
    }

    /// `call`'s answer, or a timeout once the deadline has passed; `what` names the answer
    /// awaited, for the error.
    async fn within_deadline<T>(
        &self,
        call: impl Future<Output = Result<T, BackendError>>,
        what: &str,
    ) -> Result<T, BackendError> {
        self.until(Instant::now() + self.deadline, call, what).await
    }

    /// `call`'s answer, or a timeout at `deadline`.
    async fn until<T>(
        &self,
        deadline: Instant,
        call: impl Future<Output = Result<T, BackendError>>,
        what: &str,
    ) -> Result<T, BackendError> {
        tokio::time::timeout_at(deadline, call)
            .await
            .unwrap_or_else(|_| Err(self.timed_out(what)))
    }

    fn timed_out(&self, what: &str) -> BackendError {
        BackendError::new(
            BackendErrorKind::Timeout,
            format!("no answer {what} within {:?}", self.deadline),
        )
    }

    /// An `EVALSHA` of `script` with what both scripts take first: the base keys of `checks`,
    /// then `now` (empty for the server's `TIME`). The caller adds `args` more numbers.
    fn script_call<'p>(
        &self,
        script: &Script,
        checks: impl Iterator<Item = &'p Prepared> + Clone,
        now: Option<Micros>,
        args: usize,
    ) -> redis::Cmd {
        // Room for every argument: each takes about 16 bytes of framing; a key is the prefix,
        // the limit's name and 36 more bytes, a number at most 20 digits.
        const NUMBER: usize = 16 + 20;
        let keys = checks.clone().count();
        let key_bytes: usize = checks
            .clone()
            .map(|p| 16 + self.prefix.len() + p.name.len() + 36)
            .sum();
        let mut call = script.call(keys, keys + 1 + args, key_bytes + NUMBER * (1 + args));
        for p in checks {
            call.arg(keys::BaseKey::new(&self.prefix, &p.name, &p.digest).as_bytes());
        }
        match now {
            Some(now) => call.arg(now),
            None => call.arg(""),
        };
        call
    }

    fn answered(&self) {
        self.breaker.success();
        self.metrics().up.set(1.0);
    }

    /// `batch`'s answer by `deadline`, or a timeout.
    async fn call(
        self: &Arc<Self>,
        batch: Vec<Prepared>,
        now: Option<Micros>,
        deadline: Instant,
    ) -> Result<(Vec<Prepared>, Outcome), CallError> {
        if !self.cluster && now.is_none() {
            // The task sending merged calls keeps the deadline: one timer per call, not one
            // per request.
            let (batch, reply) = self.coalesced(batch, deadline).await?;
            return Ok((batch, reply.into()));
        }
        // Boxed: the future of a direct call is large (over 1 KiB with the connection's), and
        // kept inline it would make every request's future as large, and its allocation one
        // that the allocator's per-thread cache does not serve.
        let call = self.until(
            deadline,
            self.call_direct(batch, now, deadline),
            "from Redis",
        );
        Ok(Box::pin(call).await?)
    }

    /// A call of its own for `batch`: at a fixed time (tests), or in a cluster.
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
        let groups = slot_groups(&batch);
        if groups.len() == 1 {
            let reply = self.eval_check(&[batch.as_slice()], now).await?;
            return Ok((batch, reply.into()));
        }
        // Several slots: the consume and any refund run in a task of their own, so that a
        // caller that gives up at its deadline does not leave a half-consumed batch behind.
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let outcome = this.split(&batch, groups, now, deadline).await?;
            Ok((batch, outcome))
        })
        .await
        .unwrap_or_else(|e| Err(unavailable(format!("rate-limit task failed: {e}"))))
    }

    /// Queues `batch` for the next merged call and waits for its answer, which comes by
    /// `deadline` (see [`send_merged`](Self::send_merged)).
    async fn coalesced(
        self: &Arc<Self>,
        batch: Vec<Prepared>,
        deadline: Instant,
    ) -> Result<(Vec<Prepared>, Reply), CallError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        match self.coalescer.push(Waiter {
            batch,
            reply,
            deadline,
        }) {
            Push::Waits => {}
            Push::StartCaller => {
                let task = Unstarted(Some(Arc::clone(self)));
                tokio::spawn(async move { task.start().send_merged().await });
            }
            Push::Full => {
                return Err(CallError::Overloaded(unavailable(
                    "too many rate-limit checks are waiting for Redis",
                )))
            }
        }
        let answer = answer.await;
        Ok(answer.unwrap_or_else(|_| Err(unavailable("the rate-limit call was dropped")))?)
    }

    /// Sends what waits in the coalescer, one merged call after the other, until nothing does.
    ///
    /// Every request gets its answer by its deadline: one whose deadline passed while it
    /// waited is answered with a timeout and not sent (so it consumes nothing), and a call
    /// times out at the earliest deadline of the requests it carries.
    async fn send_merged(self: Arc<Self>) {
        let mut caller = self.coalescer.caller();
        while let Some(call) = caller.next_call(Instant::now()) {
            for late in call.late {
                let _ = late.reply.send(Err(self.timed_out("from Redis")));
            }
            let waiters = call.send;
            let Some(deadline) = waiters.iter().map(|w| w.deadline).min() else {
                continue;
            };
            let batches: Vec<&[Prepared]> = waiters.iter().map(|w| w.batch.as_slice()).collect();
            let call = self.eval_checks(&batches, None);
            match self.until(deadline, call, "from Redis").await {
                Ok(replies) => {
                    for (w, reply) in waiters.into_iter().zip(replies) {
                        let _ = w.reply.send(Ok((w.batch, reply)));
                    }
                }
                Err(e) => {
                    for w in waiters {
                        let _ = w.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// One `CHECK` call for checks that share a slot (or a standalone server).
    async fn eval_check(
        &self,
        group: &[&[Prepared]],
        now: Option<Micros>,
    ) -> Result<Reply, BackendError> {
        let mut replies = self.eval_checks(group, now).await?;
        replies
            .pop()
            .ok_or_else(|| BackendError::new(BackendErrorKind::Protocol, "empty script reply"))
    }

    /// One `CHECK` call for the batches of several requests, each all-or-nothing on its own.
    async fn eval_checks(
        &self,
        batches: &[&[Prepared]],
        now: Option<Micros>,
    ) -> Result<Vec<Reply>, BackendError> {
        let args = script::CheckArgs::new(batches)?;
        let mut call = self.script_call(
            &self.check_script,
            args.keys.iter().copied(),
            now,
            2 + 4 * args.limits.len(),
        );
        call.arg(args.limits.len());
        for l in &args.limits {
            call.arg(l);
        }
        call.arg(args.packed);
        let value = self.invoke(&self.check_script, &call).await?;
        script::parse_replies(&value, batches)
    }

    /// Sends `call`, an `EVALSHA` of `script`.
    async fn invoke(
        &self,
        script: &Script,
        call: &redis::Cmd,
    ) -> Result<redis::Value, BackendError> {
        let (generation, mut conn) = self.connector.get().await.map_err(map_error)?;
        conn.invoke(script, call).await.map_err(|e| {
            if breaks_connection(&e) {
                self.connector.invalidate(generation);
            }
            map_error(e)
        })
    }

    /// Consumes slot groups concurrently; if any refuses or fails, refunds those that wrote.
    ///
    /// A group made only of shadow checks refuses nothing, so its failure must not fail the
    /// batch: if it fails, or has not answered a tenth of the deadline before the caller's
    /// `deadline`, its checks are reported not checked and the enforced groups' answers stand.
    /// (If its script did run, the shadow limit counted a request it will not see refunded:
    /// its own over-count, which limits nobody.)
    async fn split(
        self: &Arc<Self>,
        batch: &[Prepared],
        groups: Vec<Vec<usize>>,
        now: Option<Micros>,
        deadline: Instant,
    ) -> Result<Outcome, BackendError> {
        let shadow_deadline = deadline.checked_sub(self.deadline / 10).unwrap_or(deadline);
        let tasks: Vec<_> = groups
            .iter()
            .map(|group| {
                let this = Arc::clone(self);
                let sub: Vec<Prepared> = group.iter().map(|&i| batch[i].clone()).collect();
                let shadow = sub.iter().all(|p| !p.enforce);
                tokio::spawn(async move {
                    let one = [sub.as_slice()];
                    let call = this.eval_check(&one, now);
                    let reply = if shadow {
                        let answer = tokio::time::timeout_at(shadow_deadline, call).await;
                        Ok(answer.ok().and_then(Result::ok).unwrap_or_else(|| Reply {
                            committed: true,
                            now: 0,
                            answers: vec![UNANSWERED; sub.len()],
                        }))
                    } else {
                        call.await
                    };
                    (sub, reply)
                })
            })
            .collect();
        let mut results = Vec::with_capacity(tasks.len());
        for task in tasks {
            results.push(
                task.await
                    .map_err(|e| unavailable(format!("rate-limit task failed: {e}")))
                    .and_then(|(sub, reply)| reply.map(|r| (sub, r))),
            );
        }
        let committed = results
            .iter()
            .all(|r| r.as_ref().is_ok_and(|(_, reply)| reply.committed));
        if !committed {
            let refunds: Vec<_> = results
                .iter()
                .filter_map(|r| r.as_ref().ok())
                .filter(|(_, reply)| reply.committed)
                .map(|(sub, reply)| {
                    let this = Arc::clone(self);
                    let (sub, reply) = (sub.clone(), reply.clone());
                    tokio::spawn(async move { this.refund(&sub, &reply, now).await })
                })
                .collect();
            for refund in refunds {
                match refund.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(backend = BACKEND, error = %e, "rate-limit refund failed")
                    }
                    Err(e) => {
                        tracing::warn!(backend = BACKEND, error = %e, "rate-limit refund failed")
                    }
                }
            }
        }
        let mut answers = vec![UNANSWERED; batch.len()];
        for (group, result) in groups.iter().zip(results) {
            let (_, reply) = result?;
            for (&i, answer) in group.iter().zip(reply.answers) {
                answers[i] = answer;
            }
        }
        Ok(Outcome { committed, answers })
    }

    /// Undoes what one committed `CHECK` call wrote.
    async fn refund(
        &self,
        group: &[Prepared],
        reply: &Reply,
        now: Option<Micros>,
    ) -> Result<(), BackendError> {
        let wrote: Vec<(&Prepared, &Answer)> = group
            .iter()
            .zip(&reply.answers)
            .filter(|(_, a)| a.verdict.is_allowed())
            .collect();
        if wrote.is_empty() {
            return Ok(());
        }
        let args = 4 * wrote.len();
        let checks = wrote.iter().map(|(p, _)| *p);
        let mut call = self.script_call(&self.refund_script, checks, now, args);
        for (p, answer) in &wrote {
            call.arg(&p.refund_args(reply.now, answer));
        }
        self.invoke(&self.refund_script, &call).await?;
        // A request that Redis refused (or foresaw refused) while these units were held was
        // refused for units given back now: its cached denial no longer stands. (Another
        // replica's cache keeps such a denial until it runs out; lib.rs bounds it.)
        for (p, _) in &wrote {
            self.deny.forget(&p.digest);
        }
        Ok(())
    }
}

/// Indices of the checks grouped by hash slot, in order of first appearance.
fn slot_groups(batch: &[Prepared]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, p) in batch.iter().enumerate() {
        let slot = keys::digest_slot(&p.digest);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, g)) => g.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

const NOT_CHECKED: Verdict = Verdict {
    status: Status::NotChecked,
    remaining: 0,
    reset: 0,
};

/// The answer of a check that Redis did not evaluate.
const UNANSWERED: Answer = Answer {
    verdict: NOT_CHECKED,
    extra: 0,
};

fn unavailable(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Unavailable, msg)
}

/// Sorts a Redis error into the backend's kinds: the server could not be used
/// (`Unavailable`), did not answer in time (`Timeout`), or answered nonsense (`Protocol`).
fn map_error(e: redis::RedisError) -> BackendError {
    use redis::{ErrorKind, ServerErrorKind};
    let kind = if e.is_timeout() {
        BackendErrorKind::Timeout
    } else if breaks_connection(&e)
        || e.is_cluster_error()
        || matches!(
            e.code(),
            Some("BUSY" | "LOADING" | "MASTERDOWN" | "READONLY")
        )
    {
        BackendErrorKind::Unavailable
    } else {
        match e.kind() {
            ErrorKind::AuthenticationFailed
            | ErrorKind::InvalidClientConfig
            | ErrorKind::Server(
                ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::NoPerm,
            ) => BackendErrorKind::Unavailable,
            _ => BackendErrorKind::Protocol,
        }
    };
    BackendError::new(kind, e.to_string())
}

/// Why a check got no answer.
enum CallError {
    /// From Redis, or on the way to it: the breaker and the health gauge hear of it.
    Redis(BackendError),
    /// Too many checks were already waiting for Redis, which was not asked: a process
    /// overloaded says nothing about Redis' health.
    Overloaded(BackendError),
}

impl From<BackendError> for CallError {
    fn from(e: BackendError) -> Self {
        Self::Redis(e)
    }
}

/// A sending task that has not run yet. [`Push::StartCaller`] counted it as started; dropped
/// before it first runs (its runtime shutting down), it counts itself out, so that the next
/// request starts a new one instead of waiting, unanswered, for one that never runs.
struct Unstarted(Option<Arc<Inner>>);

impl Unstarted {
    fn start(mut self) -> Arc<Inner> {
        match self.0.take() {
            Some(inner) => inner,
            None => unreachable!("a task starts once"),
        }
    }
}

impl Drop for Unstarted {
    fn drop(&mut self) {
        if let Some(inner) = self.0.take() {
            // A caller dropped before it is told to stop counts itself out.
            drop(inner.coalescer.caller());
        }
    }
}

impl RedisBackend {
    /// Configures a backend.
    pub fn builder() -> RedisBackendBuilder {
        RedisBackendBuilder::default()
    }

    /// Checks a batch at `now` (microseconds since the Unix epoch) instead of the Redis server's
    /// `TIME`.
    ///
    /// **For tests only**: it lets a test replay exact figures (the shared vectors) without
    /// waiting for time to pass. Production code must use [`Backend::check`], so that every
    /// replica reads the same clock, the server's. Calls made this way neither read nor fill
    /// the local deny cache, whose time is the local clock.
    pub fn check_at(&self, checks: &[Check<'_>], now: Micros) -> ResponseFuture {
        self.dispatch(checks, Some(now))
    }

    /// The Redis key that holds `limit`'s state for `key`: `<prefix>:<limit name>:{<digest>}`
    /// for GCRA, that with `:log` appended for a sliding log; for a fixed window, the stem to
    /// which `:<window index>` is appended.
    pub fn key_for(&self, limit: &Limit, key: &[u8]) -> String {
        let digest = keys::digest(limit.name(), key);
        let base = keys::base_key(&self.inner.prefix, limit.name(), &digest);
        match limit.algorithm() {
            tollgate_core::Algorithm::SlidingLog => base + ":log",
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

    fn dispatch(&self, checks: &[Check<'_>], now: Option<Micros>) -> ResponseFuture {
        if checks.len() > MAX_CHECKS {
            return ResponseFuture::ready(Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!("at most {MAX_CHECKS} checks per batch"),
            )));
        }
        if checks.is_empty() {
            return ResponseFuture::ready(Ok(Verdicts::new()));
        }
        let inner = &self.inner;
        let mut digests = [[0u8; keys::DIGEST_LEN]; MAX_CHECKS];
        for (d, c) in digests.iter_mut().zip(checks) {
            *d = keys::digest(c.limit.name(), c.key);
        }
        let mut leased = [false; MAX_CHECKS];
        if now.is_none() {
            if let Some(verdicts) = self.cached_denial(checks, &digests, &mut leased) {
                return ResponseFuture::ready(Ok(verdicts));
            }
        }
        let mut batch = Vec::with_capacity(checks.len());
        for ((c, d), leased) in checks.iter().zip(&digests).zip(leased) {
            match Prepared::new(c, *d) {
                Ok(p) => batch.push(Prepared { leased, ..p }),
                Err(e) => return ResponseFuture::ready(Err(e)),
            }
        }
        let Some(permit) = inner.breaker.admit() else {
            return ResponseFuture::ready(Err(BackendError::new(
                BackendErrorKind::CircuitOpen,
                "Redis failed recently; the circuit breaker is open",
            )));
        };
        ResponseFuture {
            state: State::Call(Box::pin(Arc::clone(inner).run(batch, now, permit))),
        }
    }

    /// The batch's verdicts if an enforced check is in the deny cache; otherwise `leased` says
    /// which checks took the lease of a denial that ran out.
    fn cached_denial(
        &self,
        checks: &[Check<'_>],
        digests: &[keys::KeyDigest; MAX_CHECKS],
        leased: &mut [bool; MAX_CHECKS],
    ) -> Option<Verdicts> {
        // Every cached denial of the batch, not only the first: the refusal's Retry-After is
        // the longest of their waits, and each refusing limit is reported as refusing.
        let mut hits = [None; MAX_CHECKS];
        for (i, c) in checks.iter().enumerate().filter(|(_, c)| c.enforce) {
            match self.inner.deny.lookup(&digests[i], c.cost) {
                Lookup::Miss => {}
                Lookup::Leased => leased[i] = true,
                Lookup::Denied(verdict) => hits[i] = Some(verdict),
            }
        }
        if hits.iter().all(Option::is_none) {
            return None;
        }
        // Leases taken for a refused batch would hold their keys back for nothing.
        for (taken, digest) in leased.iter_mut().zip(digests) {
            if std::mem::take(taken) {
                self.inner.deny.release(digest);
            }
        }
        Some(
            (0..checks.len())
                .map(|i| hits[i].unwrap_or(NOT_CHECKED))
                .collect(),
        )
    }
}

/// The denial the deny cache should hold after Redis answered `verdict` for one check.
///
/// A denial stands until its `retry_after`. An admission that left less than the check's cost
/// foretells one: under GCRA the next such request fits once the theoretical arrival time minus
/// the tolerance is reached, in a fixed window once the window turns. A sliding log's next free
/// unit depends on the whole log, so it foretells nothing. `None`: nothing to hold.
fn foreseen_denial(
    algorithm: Algorithm,
    quota: &tollgate_core::Quota,
    cost: u32,
    verdict: &Verdict,
) -> Option<Verdict> {
    let retry_after = match verdict.status {
        Status::Denied { retry_after } => retry_after,
        Status::Allowed if verdict.remaining < u64::from(cost) => match algorithm {
            Algorithm::Gcra => {
                let interval = quota.emission_interval();
                // reset = new TAT - now; the next admission needs TAT + cost × T - τ <= then.
                (verdict.reset + interval * u64::from(cost))
                    .saturating_sub(interval * u64::from(quota.burst()))
            }
            Algorithm::FixedWindow => verdict.reset,
            _ => return None,
        },
        _ => return None,
    };
    (retry_after > 0).then_some(Verdict {
        status: Status::Denied { retry_after },
        ..*verdict
    })
}

impl Backend for RedisBackend {
    type Future = ResponseFuture;

    /// Checks and consumes a batch in one script call (one per hash slot in a cluster).
    ///
    /// The key digests are computed before this returns; the future owns what it needs. A
    /// batch the deny cache refuses, or one the open circuit breaker fails, is answered
    /// without I/O or allocation.
    fn check(&self, checks: &[Check<'_>]) -> ResponseFuture {
        self.dispatch(checks, None)
    }

    fn kind(&self) -> &'static str {
        BACKEND
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

type Boxed = Pin<Box<dyn Future<Output = Result<Verdicts, BackendError>> + Send + 'static>>;

/// The answer of a [`RedisBackend`] to one batch.
///
/// Ready at once for a deny-cache hit or an open circuit breaker; otherwise a call to Redis
/// bounded by the deadline.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture {
    state: State,
}

// The ready answer is stored inline on purpose: a deny-cache hit or an open breaker allocates
// nothing.
#[allow(clippy::large_enum_variant)]
enum State {
    Ready(Option<Result<Verdicts, BackendError>>),
    Call(Boxed),
}

impl ResponseFuture {
    fn ready(result: Result<Verdicts, BackendError>) -> Self {
        Self {
            state: State::Ready(Some(result)),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Verdicts, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            State::Ready(result) => Poll::Ready(result.take().unwrap_or_else(|| {
                Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "ResponseFuture polled after completion",
                ))
            })),
            State::Call(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Ready(_) => "ready",
            State::Call(_) => "calling",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::Quota;

    /// Runs `step` (the core's maths on its stored state) until it refuses; returns the last
    /// admission and the refusal that followed.
    fn last_admission_then_refusal<S: Copy>(
        step: impl Fn(Option<S>) -> (Verdict, Option<S>),
    ) -> (Verdict, Verdict) {
        let (mut state, mut last) = (None, None);
        loop {
            let (verdict, next) = step(state);
            if !verdict.is_allowed() {
                return (last.unwrap(), verdict);
            }
            (state, last) = (next, Some(verdict));
        }
    }

    #[test]
    fn an_admission_that_used_the_last_unit_foretells_the_exact_denial() {
        let q = Quota::per_second(10).unwrap().with_burst(4).unwrap(); // T = 100 ms
        for cost in [1, 2] {
            let (last, next) =
                last_admission_then_refusal(|tat| algorithm::gcra(&q, tat, 1_000_000, cost));
            let foreseen = foreseen_denial(Algorithm::Gcra, &q, cost, &last).unwrap();
            assert_eq!(foreseen.status, next.status, "GCRA, cost {cost}");
        }
        let q = Quota::per_second(10).unwrap();
        let (last, next) =
            last_admission_then_refusal(|w| algorithm::fixed_window(&q, w, 1_250_000, 1));
        let foreseen = foreseen_denial(Algorithm::FixedWindow, &q, 1, &last).unwrap();
        assert_eq!(foreseen.status, next.status, "fixed window");
    }

    #[test]
    fn room_left_or_a_sliding_log_foretells_nothing() {
        let q = Quota::per_second(10).unwrap();
        let (v, _) = algorithm::gcra(&q, None, 0, 1);
        assert_eq!(foreseen_denial(Algorithm::Gcra, &q, 1, &v), None);
        let full = Verdict {
            status: Status::Allowed,
            remaining: 0,
            reset: 1_000_000,
        };
        assert_eq!(foreseen_denial(Algorithm::SlidingLog, &q, 1, &full), None);
        // A denial stands as Redis gave it.
        let denied = Verdict {
            status: Status::Denied { retry_after: 5 },
            ..full
        };
        assert_eq!(
            foreseen_denial(Algorithm::SlidingLog, &q, 1, &denied),
            Some(denied)
        );
    }
}
