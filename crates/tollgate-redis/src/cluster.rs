//! Redis Cluster: a batch split by hash slot, one call per hash slot group (merged with the
//! other requests' batches of that hash slot, see `coalesce`), and refunds of the groups that wrote
//! when another refused.

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;
use tollgate_core::{BackendError, Micros};

use crate::deny_cache::DenyCache;
use crate::failure::unavailable;
use crate::keys;
use crate::scripts::check::EncodedCheck;
use crate::scripts::refund;
use crate::scripts::reply::{Answer, Answered, Reply, UNANSWERED};
use crate::slots::Slots;
use crate::transport::breaker::Permit;
use crate::transport::merged::queue_in_hash_slot;
use crate::transport::{Transport, BACKEND};

/// A Redis Cluster's checks: a batch split by hash slot, and refunds.
pub(crate) struct Cluster {
    transport: Arc<Transport>,
    /// Told of the refunds, which reopen keys it may hold denials of.
    deny: Arc<DenyCache>,
    /// Gives back the slots of a late shadow group.
    slots: Arc<Slots>,
}

impl Cluster {
    pub(crate) fn new(transport: Arc<Transport>, deny: Arc<DenyCache>, slots: Arc<Slots>) -> Self {
        Self {
            transport,
            deny,
            slots,
        }
    }

    /// `batch` in a cluster, by `deadline`: one call if its keys share a hash slot; otherwise one
    /// per hash slot group, with refunds.
    ///
    /// With a `permit` (the server's time, `now` is `None`), each group waits for its hash slot's
    /// next merged call, which reports to the breaker; without, each group has a call of its
    /// own, and the caller reports.
    pub(crate) async fn call(
        self: &Arc<Self>,
        batch: Vec<EncodedCheck>,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<(Vec<EncodedCheck>, Answered), BackendError> {
        let mut groups = hash_slot_groups(&batch);
        if groups.len() == 1 {
            let (hash_slot, _) = groups.swap_remove(0);
            let (batch, reply) = self
                .group_call(hash_slot, batch, now, deadline, permit)
                .await?;
            return Ok((batch, reply.into()));
        }
        // Several hash slots: the consume and any refund run in a task of their own, so that a
        // caller that gives up at its deadline does not leave a half-consumed batch behind.
        let this = Arc::clone(self);
        let split = tokio::spawn(async move {
            let outcome = this.split(&batch, groups, now, deadline, permit).await?;
            Ok((batch, outcome))
        });
        let split = async {
            split
                .await
                .unwrap_or_else(|e| Err(unavailable(format!("rate-limit task failed: {e}"))))
        };
        self.transport.until(deadline, split, "from Redis").await
    }

    /// The `CHECK` of one hash slot group: merged with the hash slot's other waiting batches when there
    /// is a `permit`, else a call of its own at `now`.
    async fn group_call(
        self: &Arc<Self>,
        hash_slot: u16,
        group: Vec<EncodedCheck>,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<(Vec<EncodedCheck>, Reply), BackendError> {
        match permit {
            Some(permit) => {
                queue_in_hash_slot(&self.transport, hash_slot, group, deadline, permit).await
            }
            None => {
                let reply = self.transport.eval_check(&[group.as_slice()], now).await?;
                Ok((group, reply))
            }
        }
    }

    /// Consumes hash slot groups concurrently; if any refuses or fails, refunds those that wrote.
    ///
    /// A group made only of shadow checks refuses nothing, so its failure must not fail the
    /// batch: if it fails, or has not answered a tenth of the deadline before the caller's
    /// `deadline`, its checks are reported not checked and the enforced groups' answers stand.
    /// (If its script did run, the shadow limit counted a request it will not see refunded:
    /// its own over-count, which limits nobody.)
    async fn split(
        self: &Arc<Self>,
        batch: &[EncodedCheck],
        groups: Vec<(u16, Vec<usize>)>,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<Answered, BackendError> {
        let shadow_deadline = deadline
            .checked_sub(self.transport.deadline() / 10)
            .unwrap_or(deadline);
        let group_of = |group: &[usize]| -> (Vec<EncodedCheck>, Option<Vec<EncodedCheck>>) {
            let sub: Vec<EncodedCheck> = group.iter().map(|&i| batch[i].clone()).collect();
            // What a shadow group reports if it fails or is late: its checks not checked.
            let unanswered = sub.iter().all(|p| !p.enforce).then(|| sub.clone());
            (sub, unanswered)
        };
        let mut results = Vec::with_capacity(groups.len());
        match permit {
            // Merged: every group is queued for its hash slot at once, then the answers are awaited
            // in turn (the hash slots' tasks send the calls meanwhile).
            Some(permit) => {
                let queued: Vec<_> = groups
                    .iter()
                    .map(|(hash_slot, group)| {
                        let (sub, unanswered) = group_of(group);
                        let answer =
                            queue_in_hash_slot(&self.transport, *hash_slot, sub, deadline, permit);
                        (answer, unanswered)
                    })
                    .collect();
                for (answer, unanswered) in queued {
                    results.push(shadowed(&self.slots, answer, unanswered, shadow_deadline).await);
                }
            }
            None => {
                let tasks: Vec<_> = groups
                    .iter()
                    .map(|(hash_slot, group)| {
                        let (this, hash_slot) = (Arc::clone(self), *hash_slot);
                        let (sub, unanswered) = group_of(group);
                        tokio::spawn(async move {
                            let caller = Arc::clone(&this);
                            let call = async move {
                                caller.group_call(hash_slot, sub, now, deadline, None).await
                            };
                            shadowed(&this.slots, call, unanswered, shadow_deadline).await
                        })
                    })
                    .collect();
                for task in tasks {
                    results.push(
                        task.await
                            .map_err(|e| unavailable(format!("rate-limit task failed: {e}")))
                            .and_then(|r| r),
                    );
                }
            }
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
        for ((_, group), result) in groups.iter().zip(results) {
            let (_, reply) = result?;
            for (&i, answer) in group.iter().zip(reply.answers) {
                answers[i] = answer;
            }
        }
        Ok(Answered { committed, answers })
    }

    /// Undoes what one committed `CHECK` call wrote.
    async fn refund(
        &self,
        group: &[EncodedCheck],
        reply: &Reply,
        now: Option<Micros>,
    ) -> Result<(), BackendError> {
        let wrote: Vec<(&EncodedCheck, &Answer)> = group
            .iter()
            .zip(&reply.answers)
            .filter(|(_, a)| a.verdict.is_allowed())
            .collect();
        if wrote.is_empty() {
            return Ok(());
        }
        let args = 4 * wrote.len();
        let checks = wrote.iter().map(|(p, answer)| (*p, refund::key(p, answer)));
        let mut call = self
            .transport
            .script_call(refund::script(), checks, now, args);
        for (p, answer) in &wrote {
            call.arg(&refund::args(p, reply.now, answer));
        }
        let sent = self.transport.invoke(refund::script(), &call);
        self.transport.within_deadline(sent, "to refund").await?;
        // A request that Redis refused (or foresaw refused) while these units were held was
        // refused for units given back now: its cached denial no longer stands. (Another
        // replica's cache keeps such a denial until it runs out; lib.rs bounds it.)
        for (p, _) in &wrote {
            self.deny.forget(&p.digest);
        }
        Ok(())
    }
}

/// A hash slot group's answer; for a group of shadow checks only (`unanswered` holds them), its
/// checks reported not checked if it fails or has not answered by `shadow_deadline`.
///
/// A late group's slots are given back by the backend once its call has answered: the
/// request, told they were not checked, will not give them back itself.
async fn shadowed(
    slots: &Arc<Slots>,
    call: impl Future<Output = Result<(Vec<EncodedCheck>, Reply), BackendError>> + Send + 'static,
    unanswered: Option<Vec<EncodedCheck>>,
    shadow_deadline: Instant,
) -> Result<(Vec<EncodedCheck>, Reply), BackendError> {
    let Some(sub) = unanswered else {
        return call.await;
    };
    let mut call = Box::pin(call);
    let answer = match tokio::time::timeout_at(shadow_deadline, call.as_mut()).await {
        Ok(answer) => answer.ok(),
        Err(_) => {
            // Like a call whose caller went away: its slots are given back by id once it
            // has answered, so that the release cannot overtake the call.
            if let Some(unclaimed) = slots.unclaimed(&sub) {
                tokio::spawn(async move {
                    let _ = call.await;
                    drop(unclaimed);
                });
            }
            None
        }
    };
    Ok(answer.unwrap_or_else(|| {
        let reply = Reply {
            committed: true,
            now: 0,
            answers: vec![UNANSWERED; sub.len()],
        };
        (sub, reply)
    }))
}

/// Indices of the checks grouped by hash slot, in order of first appearance.
fn hash_slot_groups(batch: &[EncodedCheck]) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, p) in batch.iter().enumerate() {
        let hash_slot = keys::digest_hash_slot(&p.digest);
        match groups.iter_mut().find(|(s, _)| *s == hash_slot) {
            Some((_, g)) => g.push(i),
            None => groups.push((hash_slot, vec![i])),
        }
    }
    groups
}
