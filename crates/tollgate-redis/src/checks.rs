//! The checks of a batch on their way to Redis and back: the components they go through, the
//! call (merged on a standalone server, per hash slot in a cluster, or of its own at a fixed
//! time), and the verdicts made of its answer. What sends a batch is in `dispatch`.

use std::sync::Arc;

use tokio::time::Instant;
use tollgate_engine::{algorithm, Algorithm, BackendError, Micros, Receipt, Verdicts};

use crate::cluster::Cluster;
use crate::deny_cache::RefusedKeys;
use crate::digests::DigestCache;
use crate::keys::{KeyDigest, Keyer};
use crate::scripts::check::{Batch, EncodedCheck};
use crate::scripts::reply::Answered;
use crate::slots::{SlotKeeper, Unclaimed};
use crate::transport::breaker::Permit;
use crate::transport::{Transport, BACKEND};

/// What a batch of checks goes through: the digests of its keys, the deny cache, the
/// concurrency slots it may take, and the transport (through the cluster's split when the
/// server is a cluster).
pub(crate) struct Checks {
    transport: Arc<Transport>,
    deny: Arc<RefusedKeys>,
    /// The digests of recently checked (limit, key) pairs.
    digests: DigestCache,
    slots: Arc<SlotKeeper>,
    cluster: Arc<Cluster>,
}

/// What finishing an answered call needs of the request that made it.
pub(crate) struct Started {
    pub(crate) at: Instant,
    pub(crate) unclaimed: Option<Unclaimed>,
    /// A test's fixed time, or `None` for the server's.
    pub(crate) now: Option<Micros>,
}

impl Checks {
    pub(crate) fn new(
        transport: Arc<Transport>,
        deny: Arc<RefusedKeys>,
        slots: Arc<SlotKeeper>,
        keyer: Keyer,
    ) -> Self {
        let cluster = Arc::new(Cluster::new(
            Arc::clone(&transport),
            Arc::clone(&deny),
            Arc::clone(&slots),
        ));
        Self {
            transport,
            deny,
            digests: DigestCache::new(keyer),
            slots,
            cluster,
        }
    }

    pub(crate) fn transport(&self) -> &Arc<Transport> {
        &self.transport
    }

    pub(crate) fn deny(&self) -> &RefusedKeys {
        &self.deny
    }

    pub(crate) fn slots(&self) -> &Arc<SlotKeeper> {
        &self.slots
    }

    /// The digest of (`limit_name`, `key`), remembered for the identities that come back.
    pub(crate) fn digest(&self, limit_name: &str, key: &[u8]) -> KeyDigest {
        self.digests.digest(limit_name, key)
    }

    /// What a request that sends `batch` now keeps until its answer.
    pub(crate) fn start(&self, batch: &[EncodedCheck], now: Option<Micros>) -> Started {
        Started {
            at: Instant::now(),
            unclaimed: self.slots.unclaimed(batch),
            now,
        }
    }

    /// Runs a batch under the deadline: a call of its own (a cluster's groups, or a test's
    /// fixed `now`), reported to the breaker.
    pub(crate) async fn run(
        self: Arc<Self>,
        batch: Batch,
        now: Option<Micros>,
        permit: Permit,
    ) -> Result<Verdicts, BackendError> {
        let started = self.start(&batch, now);
        let deadline = started.at + self.transport.deadline();
        match self.call(batch, now, deadline, permit).await {
            Ok((batch, answered)) => self.finish(started, &batch, Ok(answered)),
            Err(e) => self.finish(started, &[], Err(e)),
        }
    }

    /// `batch`'s answer by `deadline`, or a timeout; the call is reported to the breaker.
    async fn call(
        &self,
        batch: Batch,
        now: Option<Micros>,
        deadline: Instant,
        permit: Permit,
    ) -> Result<(Batch, Answered), BackendError> {
        if now.is_none() {
            // In a cluster, each hash slot's merged call: a batch waits for that of each hash
            // slot it touches. (A standalone server's merged call is awaited by `Merged`, not
            // here.)
            return Box::pin(self.cluster.call(batch, None, deadline, Some(permit))).await;
        }
        // Boxed: the future of a direct call is large (the connection's included), and kept
        // inline it would make every request's future as large, and its allocation one that
        // the allocator's per-thread cache does not serve.
        let call = self
            .transport
            .until(deadline, self.call_at(batch, now, deadline), "from Redis");
        let result = Box::pin(call).await;
        self.transport.report(result.as_ref().map(|_| ()), permit);
        result
    }

    /// A call of its own for `batch` (one per hash-slot group in a cluster), at a fixed time:
    /// for tests.
    async fn call_at(
        &self,
        batch: Batch,
        now: Option<Micros>,
        deadline: Instant,
    ) -> Result<(Batch, Answered), BackendError> {
        if !self.transport.is_cluster() {
            let reply = self.transport.eval_check(&batch, now).await?;
            return Ok((batch, reply.into()));
        }
        self.cluster.call(batch, now, deadline, None).await
    }

    /// The verdicts of `batch`, whose call `started` came to `result`, with its duration
    /// recorded and its slots, once answered, the caller's.
    pub(crate) fn finish(
        &self,
        started: Started,
        batch: &[EncodedCheck],
        result: Result<Answered, BackendError>,
    ) -> Result<Verdicts, BackendError> {
        self.transport.record_duration(started.at);
        match result {
            Ok(answered) => {
                if let Some(unclaimed) = started.unclaimed {
                    unclaimed.disarm();
                }
                Ok(self.verdicts(batch, &answered, started.now))
            }
            Err(e) => {
                if e.is_overloaded() {
                    // Never sent: nothing was taken.
                    if let Some(unclaimed) = started.unclaimed {
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

    /// The verdicts of an answered batch; an enforced check's answer updates the deny cache
    /// (not for a check at a fixed `now`, whose time is not the local clock's).
    fn verdicts(
        &self,
        batch: &[EncodedCheck],
        answered: &Answered,
        now: Option<Micros>,
    ) -> Verdicts {
        let mut verdicts = Verdicts::new();
        for (p, answer) in batch.iter().zip(answered.answers.iter()) {
            let mut verdict = answer.verdict;
            if !answered.committed {
                verdict = algorithm::unconsumed(p.algorithm, &p.quota, verdict, p.cost);
            }
            if now.is_none() {
                self.deny.learn(p, &verdict);
            }
            let _ = verdicts.push(verdict);
            if verdict.is_allowed() {
                let receipt = match p.algorithm {
                    // The end of the window, as the in-memory backend records it.
                    Algorithm::FixedWindow => Receipt::window(
                        answer.at,
                        answer
                            .extra
                            .saturating_add(1)
                            .saturating_mul(p.quota.period_micros()),
                    ),
                    // The TAT the reservation left, which its refund compares (as the
                    // in-memory backend records it).
                    Algorithm::Gcra => {
                        Receipt::gcra(answer.at, answer.at.saturating_add(verdict.reset))
                    }
                    Algorithm::SlidingLog => Receipt::log(answer.at, answer.extra),
                    _ => Receipt::new(answer.at),
                };
                verdicts.set_receipt(verdicts.len() - 1, receipt);
            }
        }
        verdicts
    }
}
