//! Concurrency slots in Redis: a sorted set per key, `<base>:slots`, of slot ids scored by
//! their deadline.
//!
//! `CHECK` takes a slot (it drops the expired ones, counts, and adds the request's id with a
//! deadline one slot lifetime away, by the server's clock). The layer gives it back with a
//! `ZREM` of that id when the response is done, and renews its deadline while the response
//! streams. An id is chosen by the client before the call, so a slot whose answer was lost
//! (the call timed out after it was sent, or the caller went away) is released by id too, once
//! Redis answers again: a pause of Redis does not leak slots until they expire.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use tollgate_engine::{Algorithm, Check, Micros};

use crate::keys::{BaseKey, KeyDigest, Suffix};
use crate::scripts::check::EncodedCheck;
use crate::scripts::{renew, slot_id};
use crate::transport::Transport;

/// The concurrency slots of one backend: releases (retried) and renewals, on the transport.
pub(crate) struct Slots {
    transport: Arc<Transport>,
    prefix: String,
    /// Releases sent and not answered yet: a concurrency check waits for them.
    releases: Releases,
}

/// One slot: its key, id and lifetime.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    key: Vec<u8>,
    slot: u128,
    ttl: Micros,
}

impl Slots {
    pub(crate) fn new(transport: Arc<Transport>, prefix: String) -> Self {
        Self {
            transport,
            prefix,
            releases: Releases::default(),
        }
    }

    fn held(&self, name: &str, digest: &KeyDigest, slot: u128, ttl: Micros) -> Held {
        Held {
            key: BaseKey::new(&self.prefix, name, digest)
                .with(Suffix::Slots)
                .as_bytes()
                .to_vec(),
            slot,
            ttl,
        }
    }

    /// The slots that `checks` hold; `digest` gives the digest of a (limit name, key).
    pub(crate) fn of_checks(
        &self,
        checks: &[Check<'_>],
        digest: impl Fn(&str, &[u8]) -> KeyDigest,
    ) -> Vec<Held> {
        checks
            .iter()
            .filter(|c| c.limit.algorithm() == Algorithm::Concurrency)
            .map(|c| {
                let d = digest(c.limit.name(), c.key);
                self.held(c.limit.name(), &d, c.slot, c.limit.quota().period_micros())
            })
            .collect()
    }

    /// The slots a batch may take: given back unless the call is answered (see [`Unclaimed`]).
    pub(crate) fn unclaimed(self: &Arc<Self>, batch: &[EncodedCheck]) -> Option<Unclaimed> {
        batch
            .iter()
            .any(|p| p.algorithm == Algorithm::Concurrency)
            .then(|| Unclaimed {
                slots: Arc::clone(self),
                held: batch
                    .iter()
                    .filter(|p| p.algorithm == Algorithm::Concurrency)
                    .map(|p| self.held(&p.name, &p.digest, p.slot, p.quota.period_micros()))
                    .collect(),
            })
    }

    /// Whether a release is in flight.
    pub(crate) fn releasing(&self) -> bool {
        self.releases.pending()
    }

    /// Resolves once no release is in flight, or at `until`.
    pub(crate) async fn released(&self, until: Instant) {
        self.releases.answered(until).await;
    }

    /// `ZREM`s `held` in a spawned task, again and again while Redis fails, until each slot
    /// would have expired anyway. Counted in [`Releases`] until each slot's first attempt is
    /// answered (or failed, by the deadline): the receiver answers then. Without a runtime (a
    /// process shutting down), nothing is sent: the slots expire.
    pub(crate) fn release(self: &Arc<Self>, held: Vec<Held>) -> Option<oneshot::Receiver<()>> {
        if held.is_empty() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (landed, landing) = oneshot::channel();
        let in_flight = InFlight::new(self, landed);
        let slots = Arc::clone(self);
        runtime.spawn(async move {
            let mut failed = Vec::new();
            for slot in held {
                let cmd = zrem(&slot);
                if !slots.attempt(&cmd).await {
                    failed.push((cmd, slot.ttl));
                }
            }
            drop(in_flight);
            for (cmd, ttl) in failed {
                slots.retry(&cmd, ttl).await;
            }
        });
        Some(landing)
    }

    /// Renews `held` in a spawned task (one attempt per slot, within the deadline: the next
    /// renewal comes a third of a lifetime later).
    pub(crate) fn renew(self: &Arc<Self>, held: Vec<Held>) {
        if held.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let transport = Arc::clone(&self.transport);
        runtime.spawn(async move {
            for slot in held {
                let call = renew::call(&slot.key, slot.slot, slot.ttl);
                let renewal = transport.invoke(renew::script(), &call);
                let _ = transport.within_deadline(renewal, "to renew a slot").await;
            }
        });
    }

    /// One attempt at `cmd`, within the deadline (at least 100 ms); whether Redis answered.
    async fn attempt(&self, cmd: &redis::Cmd) -> bool {
        let within = self.transport.deadline().max(Duration::from_millis(100));
        matches!(
            tokio::time::timeout(within, self.transport.query(cmd)).await,
            Ok(Ok(_))
        )
    }

    /// Sends `cmd` until Redis answers, waiting longer each time, for at most `within`
    /// microseconds.
    async fn retry(&self, cmd: &redis::Cmd, within: Micros) {
        let give_up = Instant::now() + Duration::from_micros(within);
        let mut wait = Duration::from_millis(50);
        while Instant::now() + wait < give_up {
            tokio::time::sleep(wait).await;
            if self.attempt(cmd).await {
                return;
            }
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }
}

/// Gives back, in the background, the slots a batch may have taken unless it is disarmed:
/// dropped with the call (the caller went away), or kept when the call failed after it may have
/// been sent.
pub(crate) struct Unclaimed {
    slots: Arc<Slots>,
    held: Vec<Held>,
}

impl Unclaimed {
    /// The call was answered: what it took is the caller's to give back.
    pub(crate) fn disarm(mut self) {
        self.held.clear();
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        self.slots.release(std::mem::take(&mut self.held));
    }
}

/// The slot releases this replica has sent and Redis has not answered yet.
///
/// A release travels on the shared connection, a check on the checks' own: without this, the
/// next request of a client that read its response to the end could reach Redis before the
/// release of the slot it held, and find it still taken. A check of a concurrency limit made
/// while releases are in flight waits for their first attempt (at most its deadline).
#[derive(Debug, Default)]
struct Releases {
    pending: AtomicUsize,
    done: Notify,
}

impl Releases {
    /// Whether a release is in flight.
    fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) > 0
    }

    /// Resolves once no release is in flight, or at `until`.
    async fn answered(&self, until: Instant) {
        loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.pending() {
                return;
            }
            if tokio::time::timeout_at(until, done).await.is_err() {
                return;
            }
        }
    }
}

/// One release in flight, counted until dropped (also when its task is cancelled); its
/// sender, dropped with it, tells the layer that the release has landed.
struct InFlight {
    slots: Arc<Slots>,
    _landed: oneshot::Sender<()>,
}

impl InFlight {
    fn new(slots: &Arc<Slots>, landed: oneshot::Sender<()>) -> Self {
        slots.releases.pending.fetch_add(1, Ordering::AcqRel);
        Self {
            slots: Arc::clone(slots),
            _landed: landed,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.slots.releases.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.slots.releases.done.notify_waiters();
        }
    }
}

fn zrem(slot: &Held) -> redis::Cmd {
    let mut cmd = redis::cmd("ZREM");
    cmd.arg(&slot.key[..]).arg(slot_id::member(slot.slot));
    cmd
}
