//! Redis Cluster: a batch split by node, one call per node group (merged with the other
//! requests' batches bound for that node, in the cross-slot form of the script), or by hash
//! slot where a node's call cannot be made (see `nodes`); refunds of the groups that wrote
//! when another refused; a node's call that met a moved hash slot sent again by hash slot.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::time::Instant;
use tollgate_engine::{BackendError, Micros};

use crate::deny_cache::RefusedKeys;
use crate::failure::unavailable;
use crate::scripts::check::{Batch, EncodedCheck};
use crate::scripts::refund;
use crate::scripts::reply::{Answer, Answered, Answers, Reply};
use crate::slots::SlotKeeper;
use crate::transport::breaker::Permit;
use crate::transport::coalesce::NodeDelivery;
use crate::transport::merged::{queue_in_hash_slot, queue_on_node};
use crate::transport::nodes::{hash_slot_groups, Route};
use crate::transport::{Transport, BACKEND};

/// A Redis Cluster's checks: a batch split by hash slot, and refunds.
pub(crate) struct Cluster {
    transport: Arc<Transport>,
    /// Told of the refunds, which reopen keys it may hold denials of.
    deny: Arc<RefusedKeys>,
    /// Gives back the slots of a late shadow group.
    slots: Arc<SlotKeeper>,
}

impl Cluster {
    pub(crate) fn new(
        transport: Arc<Transport>,
        deny: Arc<RefusedKeys>,
        slots: Arc<SlotKeeper>,
    ) -> Self {
        Self {
            transport,
            deny,
            slots,
        }
    }

    /// `batch` in a cluster, by `deadline`: one call if its keys share a node (or a hash
    /// slot); otherwise one per node (or hash slot) group, with refunds.
    ///
    /// With a `permit` (the server's time, `now` is `None`), each group waits for its node's
    /// next merged call in the cross-slot form (or its hash slot's, where the node's cannot
    /// be made), which reports to the breaker; without, each hash slot group has a call of its
    /// own, and the caller reports. A node's call that met a hash slot it does not serve ran
    /// nothing: its checks are sent again, by hash slot.
    pub(crate) async fn call(
        self: &Arc<Self>,
        batch: Batch,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<(Batch, Answered), BackendError> {
        let mut groups = match permit {
            Some(_) => self.transport.routes(&batch),
            None => hash_slot_groups(&batch, 0..batch.len()),
        };
        let mut batch = batch;
        if let ([(Route::Node(node), _)], Some(permit)) = (groups.as_slice(), permit) {
            let node = *node;
            let (sent, reply) =
                queue_on_node(&self.transport, node, batch, deadline, permit).await?;
            if let Some(reply) = reply {
                return Ok((sent, reply.into()));
            }
            batch = sent;
            groups = hash_slot_groups(&batch, 0..batch.len());
        }
        if let [(Route::HashSlot(hash_slot), _)] = groups.as_slice() {
            let hash_slot = *hash_slot;
            let (batch, reply) = self
                .group_call(hash_slot, batch, now, deadline, permit)
                .await?;
            return Ok((batch, reply.into()));
        }
        // Several groups: the consume and any refund run in a task of their own, so that a
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
        group: Batch,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<(Batch, Reply), BackendError> {
        match permit {
            Some(permit) => {
                queue_in_hash_slot(&self.transport, hash_slot, group, deadline, permit).await
            }
            None => {
                let reply = self.transport.eval_check(&group, now).await?;
                Ok((group, reply))
            }
        }
    }

    /// Consumes the groups concurrently; if any refuses or fails, refunds those that wrote.
    ///
    /// A group made only of shadow checks refuses nothing, so its failure must not fail the
    /// batch: if it fails, or has not answered a tenth of the deadline before the caller's
    /// `deadline`, its checks are reported not checked and the enforced groups' answers stand.
    /// (If its script did run, the shadow limit counted a request it will not see refunded:
    /// its own over-count, which limits nobody.)
    async fn split(
        self: &Arc<Self>,
        batch: &[EncodedCheck],
        groups: Vec<(Route, Vec<usize>)>,
        now: Option<Micros>,
        deadline: Instant,
        permit: Option<Permit>,
    ) -> Result<Answered, BackendError> {
        let shadow_deadline = deadline
            .checked_sub(self.transport.deadline() / 10)
            .unwrap_or(deadline);
        let group_of = |group: &[usize]| -> (Batch, Option<Batch>) {
            let sub: Batch = group.iter().map(|&i| batch[i].clone()).collect();
            // What a shadow group reports if it fails or is late: its checks not checked.
            let unanswered = sub.iter().all(|p| !p.enforce).then(|| sub.clone());
            (sub, unanswered)
        };
        let mut results: Vec<(Vec<usize>, GroupResult)> = Vec::with_capacity(groups.len());
        match permit {
            // Merged: every group is queued for its node or hash slot at once, then the
            // answers are awaited in turn (the queues' tasks send the calls meanwhile).
            Some(permit) => {
                let queue = |route: Route, sub: Batch| -> Queued {
                    match route {
                        Route::Node(node) => {
                            Box::pin(queue_on_node(&self.transport, node, sub, deadline, permit))
                        }
                        Route::HashSlot(hash_slot) => {
                            let answer = queue_in_hash_slot(
                                &self.transport,
                                hash_slot,
                                sub,
                                deadline,
                                permit,
                            );
                            Box::pin(async move { answer.await.map(|(b, r)| (b, Some(r))) })
                        }
                    }
                };
                let mut queued: Vec<_> = groups
                    .into_iter()
                    .map(|(route, group)| {
                        let (sub, unanswered) = group_of(&group);
                        (group, queue(route, sub), unanswered)
                    })
                    .collect();
                // A node's call that ran nothing (a hash slot moved) is sent again by hash
                // slot, once.
                for retry in [false, true] {
                    let mut moved = Vec::new();
                    for (group, answer, unanswered) in queued {
                        match shadowed(&self.slots, answer, unanswered, shadow_deadline).await {
                            Ok((sub, Some(reply))) => results.push((group, Ok((sub, reply)))),
                            Ok((_, None)) if !retry => moved.push(group),
                            Ok((_, None)) => results.push((
                                group,
                                Err(unavailable("a hash slot moved twice during one check")),
                            )),
                            Err(e) => results.push((group, Err(e))),
                        }
                    }
                    queued = moved
                        .into_iter()
                        .flat_map(|group| hash_slot_groups(batch, group))
                        .map(|(route, group)| {
                            let (sub, unanswered) = group_of(&group);
                            (group, queue(route, sub), unanswered)
                        })
                        .collect();
                }
            }
            None => {
                let tasks: Vec<_> = groups
                    .into_iter()
                    .map(|(route, group)| {
                        let this = Arc::clone(self);
                        let hash_slot = match route {
                            Route::HashSlot(hash_slot) | Route::Node(hash_slot) => hash_slot,
                        };
                        let (sub, unanswered) = group_of(&group);
                        let task = tokio::spawn(async move {
                            let caller = Arc::clone(&this);
                            let call = async move {
                                let answer =
                                    caller.group_call(hash_slot, sub, now, deadline, None).await;
                                answer.map(|(b, r)| (b, Some(r)))
                            };
                            shadowed(&this.slots, call, unanswered, shadow_deadline).await
                        });
                        (group, task)
                    })
                    .collect();
                for (group, task) in tasks {
                    let result = task
                        .await
                        .map_err(|e| unavailable(format!("rate-limit task failed: {e}")))
                        .and_then(|r| r)
                        .and_then(|(sub, reply)| {
                            reply
                                .map(|reply| (sub, reply))
                                .ok_or_else(|| unavailable("the rate-limit call did not run"))
                        });
                    results.push((group, result));
                }
            }
        }
        let committed = results
            .iter()
            .all(|(_, r)| r.as_ref().is_ok_and(|(_, reply)| reply.committed));
        if !committed {
            let refunds: Vec<_> = results
                .iter()
                .filter_map(|(_, r)| r.as_ref().ok())
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
        let mut answers = Answers::unanswered(batch.len());
        for (group, result) in results {
            let (_, reply) = result?;
            for (&i, answer) in group.iter().zip(reply.answers.iter()) {
                if let Some(slot) = answers.get_mut(i) {
                    *slot = *answer;
                }
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
            .zip(reply.answers.iter())
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

/// A group's answer (`None`: a node's call that ran nothing); for a group of shadow checks
/// only (`unanswered` holds them), its checks reported not checked if it fails or has not
/// answered by `shadow_deadline`.
///
/// A late group's slots are given back by the backend once its call has answered: the
/// request, told they were not checked, will not give them back itself.
async fn shadowed(
    slots: &Arc<SlotKeeper>,
    call: impl Future<Output = NodeDelivery> + Send + 'static,
    unanswered: Option<Batch>,
    shadow_deadline: Instant,
) -> NodeDelivery {
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
            answers: Answers::unanswered(sub.len()),
        };
        (sub, Some(reply))
    }))
}

/// A group's result, once sent.
type GroupResult = Result<(Batch, Reply), BackendError>;

/// A group's queued wait.
type Queued = Pin<Box<dyn Future<Output = NodeDelivery> + Send>>;
